"""The command line of a training run, settled once into a ``Run``: what the run trains (the
network: a built-in one's ARCHITECTURE flags, a description, or a network built in Python), how
(the RECIPE), on what data, and where its files go.  Everything after ``settle`` reads the Run,
which does not change; what changes while a run goes (its last good checkpoint, its process
group) lives in the objects that own it (``run_dir.RunDir``, ``distributed.Group``).
"""
from __future__ import annotations

import argparse
import dataclasses
import os

from pycapsnet.backends.base import FLOAT_DTYPES

from . import checkpoint, data, download, folder, optim
from .argtypes import fraction, nonnegative_int, positive_float, positive_int
from .log import say
from ..core import routings
from ..core.model import CapsNetConfig
from ..errors import CapsNetError

# Flags a resumed run takes from its checkpoint.  They default to None on the command line, so
# that "given" and "left out" can be told apart; ``settle`` fills them in.
#   RECIPE: how the run trains, and on what.  Left out on --resume: the run's own value.  Given:
#           it overrides, and the trainer says so.  (--data-dir, --limit and --limit-test default
#           to None, "not used", so on --resume they too mean "as the run had it".)
#   ARCHITECTURE: the model's shape, fixed by the checkpoint's weights.  Given on --resume with a
#           value other than the checkpoint's: refused.
RECIPE = {"optimizer": "adam", "lr": 2e-3, "lr_decay": 0.85, "lr_min": None, "ema": None, "seed": 0, "shift": 2, "augment": "shift",
          "batch_size": 32,
          "dtype": "float32", "dataset": "embedded", "data_dir": None, "limit": None, "limit_test": None,
          "image_size": None, "channels": None, "test_fraction": 0.2, "val_fraction": None, "early_stop": None}
# Where --epochs is left out.  Not part of RECIPE: --resume goes on to the run's own total (the
# checkpoint's "epochs") unless --epochs gives another.
EPOCHS = 12
# A routing's own recipe where the common one does not suit it: EM routing does not leave chance level
# at lr 2e-3 and batch 32 (public EM code also trains at 1e-2), it is still rising after 12 epochs, and
# the small EM network fits its training digits better when they move by at most one pixel
# (docs/performance.md, "The three routings").
ROUTING_RECIPE = {"em": {"lr": 1e-2, "batch_size": 16, "epochs": 20, "shift": 1}}
FOLDER_FLAGS = ("image_size", "channels", "test_fraction")  # how --dataset folder reads its images
# What evaluating a checkpoint takes from its run: the data it was trained on, in its dtype (not the
# --limit-test of a quick run: a checkpoint is scored on the whole test split unless told).
EVALUATED_ON = ("dtype", "dataset", "data_dir", *FOLDER_FLAGS)
ARCHITECTURE = {k: getattr(CapsNetConfig, k)  # the model's own defaults
                for k in ("routing", "routing_iters", "routing_grad", "em_lambda", "conv_channels", "conv_kernel",
                          "conv_stride", "primary_types", "primary_dim", "primary_kernel", "primary_stride",
                          "class_dim", "decoder_hidden", "recon_weight", "share_spatial", "primary_conv")}
# What a saved recipe value may be: one of a tuple of names, or what the flag's argparse type takes.
RECIPE_VALUES = {"optimizer": optim.NAMES, "dtype": FLOAT_DTYPES, "dataset": (*data.DATASETS, "arrays"), "data_dir": str,
                 "lr": positive_float, "lr_decay": positive_float, "lr_min": positive_float, "ema": fraction, "seed": nonnegative_int,
                 "shift": nonnegative_int, "augment": data.AUGMENTS, "batch_size": positive_int, "limit": positive_int,
                 "limit_test": positive_int, "channels": (1, 3), "image_size": list, "test_fraction": fraction,
                 "val_fraction": fraction, "early_stop": positive_int}


@dataclasses.dataclass(frozen=True)
class Run:
    """One run, settled: every RECIPE value and ``epochs`` filled in, the architecture (for a
    built-in network), the network otherwise, and what the command asked for."""
    backend: str
    device: str | None
    optimizer: str
    lr: float
    lr_decay: float
    lr_min: float | None  # the decay stops here (Efficient-CapsNet's code: 5e-5); None: no floor
    ema: float | None  # evaluate and keep an exponential moving average of the weights (optim.py); None: off
    seed: int
    shift: int
    augment: str  # "shift" (by up to ``shift`` pixels), "efficient" (Efficient-CapsNet's transforms), "crop-flip"
    batch_size: int
    dtype: str
    dataset: str
    data_dir: str | None
    limit: int | None
    limit_test: int | None
    image_size: tuple | None
    channels: int | None
    test_fraction: float
    val_fraction: float | None  # a seeded share of each class of the training split, held out for validation
    early_stop: int | None  # stop after this many epochs without a better validation accuracy
    epochs: int
    architecture: dict  # ARCHITECTURE's flags, for a built-in network (CapsNetConfig's fields)
    network: object = None  # a description (dict) or its JSON file, for a described network
    model: object = None  # a Network built in Python and handed to ``fit``
    arrays: tuple | None = None  # (train Split, validation Split or None) of arrays in memory (pycapsnet.Model.fit)
    scratch: bool = False  # ``out`` is a temporary directory, removed after the run (fit without out=)
    resume: str | None = None  # --resume as given (a checkpoint file or a run directory)
    checkpoint: dict | None = None  # what it holds (checkpoint.load)
    out: str | None = None
    eval_only: bool = False
    accept_changed_data: bool = False  # go on when the data differ from what the run recorded (trainer)
    overwrite: bool = False
    progress: bool = True
    log_csv: str | None = None  # --log-csv FILE: scalars per group of steps and per epoch (scalars.py)
    tensorboard: str | None = None  # --tensorboard DIR: the same, as TensorBoard events
    graph: bool = True  # record the step where the backend can (a CUDA graph)
    compile: bool = False  # the train step compiled into fused kernels (torch backend: torch.compile)
    normalize: bool = False  # a first layer normalising each channel with the training split's statistics

    @property
    def recipe(self) -> dict:
        """The RECIPE values, as the checkpoint records them."""
        return {k: getattr(self, k) for k in RECIPE}


def flag(name):
    return "--" + name.replace("_", "-")


def refuse_floor_above_lr(lr, lr_min, spell=flag) -> None:
    """The decay's floor must be at most the rate it starts from.  ``spell``: how the message names
    a recipe key (a flag on the command line, the keyword itself for ``Model.fit``)."""
    if lr_min is not None and lr_min > lr:
        raise CapsNetError(f"{spell('lr_min')} {lr_min:g} is above {spell('lr')} {lr:g}: the floor of the decay "
                           f"must be at most the learning rate it starts from; lower {spell('lr_min')} or raise "
                           f"{spell('lr')}")


def _shown(value):
    return "none" if value is None else value


def fetched(dataset: str) -> str:
    """The cache folder that ``pycapsnet data NAME`` fills, for --dataset NAME without --data-dir."""
    folder = download.cached(dataset)
    if folder is None:
        raise CapsNetError(f"--dataset {dataset} needs its data files: fetch them once with `pycapsnet data "
                           f"{dataset}` (into {download.cache_dir(dataset)}), or name a folder holding them with "
                           "--data-dir DIR")
    return folder


def settle(args, ckpt, backend: str | None = None, network=None, model=None) -> Run:
    """The Run of a command line: the RECIPE and ARCHITECTURE flags left out (None) taken from the
    checkpoint when resuming a run, else the defaults.  On --resume, an architecture flag that
    contradicts the checkpoint is refused, and a recipe flag that changes the run's value is
    announced.  Evaluating a checkpoint (--eval-only, ``pycapsnet evaluate`` / ``inspect``) takes
    only the run's data and dtype (EVALUATED_ON), so that a model is scored on its own test split
    unless told otherwise.  ``network`` / ``model``: what ``fit`` was given (else --network's file)."""
    values = {k: getattr(args, k, None) for k in {**RECIPE, **ARCHITECTURE, "epochs": None}}
    if values["decoder_hidden"] is not None:
        values["decoder_hidden"] = tuple(values["decoder_hidden"])  # as CapsNetConfig holds it
    if values["data_dir"]:
        values["data_dir"] = os.path.abspath(values["data_dir"])  # saved so that a run resumed elsewhere finds it
    network = network if network is not None else getattr(args, "network", None)
    given = {k for k in {**RECIPE, **ARCHITECTURE} if values[k] is not None}
    evaluating = bool(getattr(args, "eval_only", False))
    cfg = checkpoint.config_of(ckpt) if ckpt else None
    # a network from a description (or built in Python): its layers say how they route
    described = model is not None or network is not None or (ckpt is not None and cfg is None)
    _refuse_architecture_flags(given, ckpt, cfg, network, described, values, evaluating)
    if ckpt and ckpt.get("unverified") and not evaluating:
        raise CapsNetError(f"--resume {ckpt['path']}: the checkpoint carries no digest binding its header to its "
                           "weights (edited, or written before pycapsnet signed checkpoints), so it is read only, "
                           "never continued and signed afresh; evaluate or predict with it, or train afresh")
    if ckpt:
        _take_from_checkpoint(values, given, ckpt, cfg, evaluating)
        if values["epochs"] is None and not evaluating:
            values["epochs"] = _planned_epochs(ckpt)
    for k, v in ARCHITECTURE.items():
        if values[k] is None:
            values[k] = v
    if not described:
        refuse_ignored_flags(given, values["routing"])
    for k, v in {**RECIPE, "epochs": EPOCHS, **ROUTING_RECIPE.get(values["routing"], {})}.items():
        if values[k] is None:
            values[k] = v
    if values["dataset"] in download.DATASETS and not values["data_dir"]:
        values["data_dir"] = fetched(values["dataset"])
    normalize = bool(getattr(args, "normalize", False))
    _refuse_clashes(values, given, normalize, ckpt, model)
    return Run(backend=backend or getattr(args, "backend", None), device=getattr(args, "device", None),
               **{k: values[k] for k in (*RECIPE, "epochs")},
               architecture={} if described else {k: values[k] for k in ARCHITECTURE},
               network=network, model=model, resume=getattr(args, "resume", None), checkpoint=ckpt,
               out=getattr(args, "out", None),
               eval_only=evaluating, accept_changed_data=bool(getattr(args, "accept_changed_data", False)),
               overwrite=bool(getattr(args, "overwrite", False)),
               progress=not getattr(args, "no_progress", False), graph=not getattr(args, "no_graph", False),
               compile=bool(getattr(args, "compile", False)), normalize=normalize,
               log_csv=getattr(args, "log_csv", None), tensorboard=getattr(args, "tensorboard", None))


def _refuse_clashes(values, given, normalize, ckpt, model):
    """Settings that cannot go together, once every value is settled."""
    if values["augment"] == "efficient" and "shift" in given:
        raise CapsNetError("--shift with --augment efficient: Efficient-CapsNet's augmentation moves each image "
                           "within its own blank margins, not by --shift pixels; drop --shift, or use --augment shift")
    if values["augment"] == "crop-flip" and "shift" in given:
        raise CapsNetError("--shift with --augment crop-flip: its crops move each image by up to 4 pixels from a "
                           "4-pixel padding; drop --shift, or use --augment shift")
    refuse_floor_above_lr(values["lr"], values["lr_min"])
    if normalize and (ckpt or model is not None):
        raise CapsNetError("--normalize with " + ("--resume or --eval-only: the run's network normalises as its "
                                                  f"checkpoint {ckpt['path']} records; drop --normalize" if ckpt else
                                                  "a network already built: its layers are what they are; give "
                                                  "a description instead, or put a normalize layer first in it"))
    if values["early_stop"] is not None and values["val_fraction"] is None:
        raise CapsNetError("--early-stop needs --val-fraction F: it stops on the validation accuracy (never on the "
                           "test split, which would then no longer be a test)")


def _refuse_architecture_flags(given, ckpt, cfg, network, described, values, evaluating):
    """Architecture flags that a described network, or the checkpoint resumed, contradicts."""
    if described:
        flags = [flag(k) for k in ARCHITECTURE if k in given]
        if flags:
            where = f"{ckpt['path']} holds" if ckpt and cfg is None else "--network gives"
            raise CapsNetError(f"{where} a network built from a description, whose layers set what "
                               f"{', '.join(flags)} would: drop {'them' if len(flags) > 1 else 'it'}, or edit "
                               "the description")
        if ckpt and network is not None:
            raise CapsNetError(f"--network with --resume: the run's network is the one {ckpt['path']} records; "
                               "drop --network to continue it, or start a new run with --out DIR")
    if ckpt:
        config = cfg.to_dict() if cfg else {}
        clash = [f"{flag(k)} (the checkpoint's model was built without it)" if isinstance(config[k], bool)
                 else f"{flag(k)} {values[k]} (the checkpoint has {config[k]})"
                 for k in ARCHITECTURE if k in given and values[k] != config[k]]
        if clash:
            raise CapsNetError(f"{ckpt['path']} fixes the architecture, and these flags contradict it: "
                               f"{'; '.join(clash)}. Drop them to continue the run, or start a new one "
                               "with --out DIR")


# Architecture flags that a routing's network has no use for: given, they would be saved with the run
# and change nothing.  A routing of the registry's: its iterations and gradient mode where it routes in
# one pass, and the decoder where its paper's head has none.
IGNORED_BY = {
    "attention": {"routing_iters": "self-attention routing computes its coupling in one pass, without iterations",
                  "routing_grad": "self-attention routing has no iterations whose coupling could be held constant",
                  "em_lambda": "it is EM routing's inverse temperature"},
    "dynamic": {"em_lambda": "it is EM routing's inverse temperature"},
    "em": {"share_spatial": "the EM network's convolutional capsule layers share their transforms over "
                            "positions already",
           "primary_conv": "the EM network's primary capsules are a 1x1 layer, not a convolution",
           "primary_kernel": "the EM network's primary capsules are a 1x1 layer",
           "primary_stride": "the EM network's primary capsules are a 1x1 layer",
           "primary_dim": "the EM network's primary capsules are 4x4 pose matrices"},
}


def ignored_by(routing) -> dict:
    """{setting: why it does nothing} for ``routing``'s network."""
    if routing in IGNORED_BY:
        return IGNORED_BY[routing]
    own = routings.get(routing)
    out = {} if own.iterated else {
        "routing_iters": f"{routing} routing routes in one pass",
        "routing_grad": f"{routing} routing has no iterations whose coupling could be held constant"}
    out["em_lambda"] = "it is EM routing's inverse temperature"
    if own.head[0] == "logits":
        why = f"the {routing} network has its paper's head ({own.head[0]}, {own.head[1]}) and no decoder"
        out.update(recon_weight=why, decoder_hidden=why)
    return out


def refuse_ignored_flags(given, routing, spell=flag):
    """A setting given that ``routing``'s network has no use for, refused in one line (``spell``: a
    flag on the command line, ``str`` for ``pycapsnet.build``'s keywords)."""
    where = f"--routing {routing}" if spell is flag else f"routing {routing!r}"
    for k, why in ignored_by(routing).items():
        if k in given:
            raise CapsNetError(f"{spell(k)} does nothing with {where}: {why}; drop it")


def _take_from_checkpoint(values, given, ckpt, cfg, evaluating):
    """The run's own recipe (or, evaluating, its data and dtype) where the flags leave them out,
    and its architecture."""
    saved = ckpt["header"].get("recipe") or {}
    bad = _recipe_problem(saved)
    if bad:
        raise CapsNetError(f"{ckpt['path']} is damaged: its recipe has {bad}; use another checkpoint, "
                           "or train afresh")
    for k in EVALUATED_ON if evaluating else RECIPE:
        if k in given:
            was = saved.get(k, RECIPE[k])  # a key an older version's checkpoint lacks: the flag's default
            if values[k] != was and not evaluating:
                fresh = "; its state starts afresh" if k == "optimizer" else ""
                say(f"resuming with {flag(k)} {values[k]} (the run so far used {_shown(was)}){fresh}")
        elif k in saved:
            # --dataset X alone names other data: the run's --data-dir belongs to the run's dataset
            if k == "data_dir" and "dataset" in given and values["dataset"] != saved.get("dataset"):
                continue
            values[k] = saved[k]
            if k == "data_dir" and saved[k] and not os.path.isdir(saved[k]):
                what = "images" if values["dataset"] == "folder" else "IDX files"
                raise CapsNetError(f"the run's data directory {saved[k]} (saved in {ckpt['path']}) is not "
                                   f"there any more; give --data-dir DIR where its {what} are now")
    if cfg is not None:
        values.update({k: v for k, v in cfg.to_dict().items() if k in ARCHITECTURE})


def _planned_epochs(ckpt) -> int | None:
    """The total a resumed run was started for (--epochs), which it goes on to when --epochs is left
    out; None for a checkpoint that does not record it (the default total then applies)."""
    planned = ckpt["header"].get("epochs")
    if planned is not None and (isinstance(planned, bool) or not isinstance(planned, int) or planned < 1):
        raise CapsNetError(f"{ckpt['path']} is damaged: its header has epochs = {planned!r}; use another "
                           "checkpoint, or give --epochs N")
    return planned


def _recipe_problem(saved: dict) -> str | None:
    """'key = value' for the first value of a saved recipe that its flag would refuse; else None."""
    for k, v in saved.items():
        rule = RECIPE_VALUES.get(k)
        if rule is None or (v is None and RECIPE.get(k) is None):  # unknown keys: a newer version's
            continue
        if isinstance(rule, tuple):
            ok = v in rule
        elif rule is str:
            ok = isinstance(v, str)
        elif rule is list:  # an image size: two sizes
            ok = isinstance(v, list) and len(v) == 2 and all(isinstance(d, int) and d >= 1 for d in v)
        else:  # a number: what the flag's own argparse type takes
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (rule in (positive_float, fraction)
                                                                              or isinstance(v, int))
            try:
                ok = ok and rule(str(v)) is not None
            except argparse.ArgumentTypeError:
                ok = False
        if not ok:
            return f"{k} = {v!r}"
    return None


def check_recipe_values(values: dict, prefix: str = "") -> None:
    """CapsNetError naming the first recipe value (or ``epochs``) that its flag would refuse: for
    Python callers, who pass values without argparse's types."""
    epochs = values.get("epochs")
    if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1):
        raise CapsNetError(f"{prefix}epochs = {epochs!r}: a whole number of at least 1")
    bad = _recipe_problem({k: list(v) if isinstance(v, tuple) else v for k, v in values.items() if k != "epochs"})
    if bad:
        raise CapsNetError(f"{prefix}{bad} is not a value its flag takes (see pycapsnet train --help)")


def data_options(run: Run) -> dict:
    """data.load's options for --dataset folder, from the run (and the images its checkpoint held
    out); refused for other datasets."""
    if run.dataset != "folder":
        given = [flag(k) for k in FOLDER_FLAGS if getattr(run, k) not in (None, RECIPE[k])]
        if given:
            one = len(given) == 1
            raise CapsNetError(f"{', '.join(given)} {'says' if one else 'say'} how to read a folder of images: "
                               f"{'it goes' if one else 'they go'} with --dataset folder, not --dataset {run.dataset}")
        return {}
    record = run.checkpoint["header"].get("data") if run.checkpoint else None
    return {"image_size": tuple(run.image_size) if run.image_size else None, "channels": run.channels,
            "test_fraction": run.test_fraction, "progress": run.progress,
            "recorded": folder.splits(record) if record else None}  # each recorded file keeps its split

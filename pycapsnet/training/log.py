"""What a run tells the person watching it: one line at a time (``say``), and its progress over an
epoch's batches (``progress``): a bar in a terminal, and where the output goes to a file (a log, a
batch job) a plain line about every tenth of the way, never a carriage return.  In a data-parallel
run only the process that writes the run's files (rank 0) speaks: ``speaking(False)`` silences the
others."""
from __future__ import annotations

import os
import sys
import time

_SPEAKS = [True]


def speaking(on: bool | None = None) -> bool:
    """Whether this process speaks; with ``on``, set it first."""
    if on is not None:
        _SPEAKS[0] = bool(on)
    return _SPEAKS[0]


def say(msg: str) -> None:
    """One line, printed above a progress bar if one is showing.  If the reader of stdout has gone
    (``train ... | head``), the run goes on without it: losing a run to a closed pager would be
    worse than losing its lines, which the run directory's metrics.jsonl keeps."""
    if not _SPEAKS[0]:
        return
    try:
        try:
            from tqdm import tqdm

            tqdm.write(msg)
        except ImportError:
            print(msg, flush=True)
    except BrokenPipeError:
        _reader_gone()


def drop_stdout() -> None:
    """Point stdout at the null device, once its reader has gone: later lines, and the interpreter's
    flush at exit, then go nowhere instead of raising BrokenPipeError again."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, sys.stdout.fileno())
    os.close(null)


def _reader_gone() -> None:
    drop_stdout()
    try:
        print("stdout was closed by its reader: the run goes on; its results are in its run directory",
              file=sys.stderr, flush=True)
    except OSError:  # stderr went down the same pipe
        pass


def progress(iterable, total, desc, disable, batch: int | None = None):
    """``iterable`` with its progress shown, unless ``disable``: a tqdm bar where stdout and stderr
    are terminals (and tqdm is installed), else ``Lines``.  ``batch``: samples per item, for the
    rate.  The caller may report its running loss and accuracy with ``set_postfix``."""
    if disable:
        return iterable
    if not (sys.stdout.isatty() and sys.stderr.isatty()):
        return Lines(iterable, total, desc, batch)
    try:
        from tqdm.auto import tqdm
    except ImportError:  # the bar is a convenience, not a dependency of training
        return Lines(iterable, total, desc, batch)
    return tqdm(iterable, total=total, desc=desc, leave=False, dynamic_ncols=True)


class Lines:
    """Progress as plain lines: after about every tenth of ``total`` items (not after the last: the
    caller's own summary follows), how far, how fast, the caller's running values, and the time left."""

    def __init__(self, iterable, total, desc, batch=None):
        self.iterable, self.total, self.desc, self.batch = iterable, total, desc, batch
        self.postfix = {}

    def set_postfix(self, **values):
        self.postfix = values

    def __iter__(self):
        t0, shown = time.perf_counter(), 0
        for k, item in enumerate(self.iterable, start=1):
            yield item  # when the caller asks for the next item, item k is done
            tenth = 10 * k // self.total if self.total else 0
            if tenth > shown and k < self.total:
                shown = tenth
                elapsed = time.perf_counter() - t0
                rate = f", {k * self.batch / elapsed:.0f} samples/s" if self.batch and elapsed > 0 else ""
                values = "".join(f", {name} {value}" for name, value in self.postfix.items())
                say(f"  {self.desc}: {k}/{self.total} ({100 * k / self.total:.0f}%){rate}{values}, "
                    f"ETA {_duration(elapsed * (self.total - k) / k)}")


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s} s" if s < 60 else f"{s // 60} min {s % 60:02d} s" if s < 3600 else f"{s // 3600} h {s % 3600 // 60:02d} min"

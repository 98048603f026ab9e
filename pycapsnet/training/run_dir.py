"""A run's directory and its transactions.  Each epoch is committed as one unit, in this order:
``checkpoint.npz`` (which also holds the run's metrics records), ``best.npz`` when the epoch has
the best validation accuracy so far, then ``metrics.jsonl`` (one strict-JSON line per epoch),
``curves.png`` and ``reconstructions.png``, every file written whole (``files.atomic_write``).
A stop between two of these writes leaves a checkpoint that the other files lag behind; on
``--resume``, ``RunDir.reconcile`` rewrites them from it, so what the directory records is what
the checkpoint holds: best.npz too, which a stop can leave behind only when the checkpoint holds
that same epoch.  Files that describe an earlier checkpoint (``evaluate``'s confusion files) or
another run (what --overwrite replaces) go at the commit, or at the reconcile after a stop.

One run at a time: a run holds an OS lock on ``.lock`` in its directory for as long as it lives
(``flock``; the kernel drops it when the process ends, however it ends), and a second run on the
same directory is refused at once, naming the first one's process.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import threading
import zipfile

import numpy as np

from ..errors import CapsNetError
from ..userfiles import open_regular
from ..tools import plots
from . import checkpoint, files
from .argtypes import make_writable_dir
from .log import say
from .recipe import flag

CHECKPOINT = "checkpoint.npz"
BEST = "best.npz"  # with --val-fraction: the epoch of the best validation accuracy
METRICS = "metrics.jsonl"
PICTURES = ("curves.png", "reconstructions.png")
DESCRIBES_A_CHECKPOINT = ("confusion.json", "confusion.png")  # evaluate's, of the checkpoint it scored
LOCK = ".lock"


def best_epoch(history) -> int | None:
    """The epoch of the highest validation accuracy (the first of equals); None without validation."""
    scored = [r for r in history if "val_acc" in r]
    return max(scored, key=lambda r: (r["val_acc"], -r["epoch"]))["epoch"] if scored else None


class RunDir:
    """Where a run's files go (``path``), and what to say if it stops early: ``last_good``, the
    checkpoint to go back to as (path, epoch) (the one resumed from, then each one committed), and
    ``replacing``, the directory of an earlier run that --overwrite replaces at the first commit."""

    def __init__(self):
        self.path = None
        self.last_good = None
        self.replacing = None
        self._lock = None
        self.spell = flag  # how a message names a setting: a flag, or (``str``) fit's keyword

    def claim(self, path: str, ckpt, overwrite: bool) -> None:
        """Make ``path`` the run's directory: made and writable, locked for this run, and not holding
        another run's checkpoint unless ``overwrite`` (nothing of that run is touched before the
        first commit)."""
        self.path = path
        prepare_out_dir(path)
        self._lock = lock(path)
        mine = os.path.join(path, CHECKPOINT)
        resumed_here = ckpt is not None and os.path.exists(mine) and os.path.samefile(ckpt["path"], mine)
        if os.path.exists(mine) and not resumed_here:
            if not overwrite:
                how = (f"pycapsnet.load({path!r}).fit(...), train into another directory with fit(..., out=DIR), "
                       "or replace it with fit(..., overwrite=True)") if self.spell is str else \
                    f"--resume {path}, train into another directory with --out DIR, or replace it with --overwrite"
                raise CapsNetError(f"{path} already holds a checkpoint from an earlier run; continue it with {how}")
            # Nothing is moved aside or truncated: the earlier run's files are replaced one by one when
            # this run commits its first epoch, so a run that fails before then leaves them as they were.
            self.replacing = path
            say(f"--overwrite: the earlier run's checkpoint, metrics and pictures in {path} stay until this "
                "run's first epoch is saved")

    def commit(self, model, opt, test_set, history, recipe: dict, classes, best: bool = False, epochs=None,
               **read) -> None:
        """The epoch, committed: first the checkpoint, which holds the records too; from then on the
        epoch is done, and a run stopped before the rest is written resumes after it (``reconcile``
        rewrites what lags).  Then metrics.jsonl, then the pictures.  ``best``: the epoch has the best
        validation accuracy so far, and best.npz gets it too.  ``epochs``: the run's total (--epochs),
        which a resumed run goes on to unless told.  ``read``: what the run read (the header's
        ``data`` and ``data_changes``)."""
        record = history[-1]
        epoch = record["epoch"]
        with _ctrl_c_held():
            meta = dict(epoch=epoch, epochs=epochs, test_acc=record.get("test_acc"), recipe=recipe, history=history,
                        classes=list(classes), **read)
            checkpoint.save(os.path.join(self.path, CHECKPOINT), model, opt, **meta)
            if best:  # the best validation accuracy so far: its weights, a checkpoint of their own
                checkpoint.save(os.path.join(self.path, BEST), model, opt, **meta)
            self.last_good, self.replacing = (self.path, epoch), None
            self._drop_what_is_not_this_checkpoints(history)
            write_metrics(self.path, history)
            draw(model, test_set, self.path, history)

    def release(self) -> None:
        """Give up the directory's lock (the run is over; a process that ends drops it anyway)."""
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def _drop_what_is_not_this_checkpoints(self, history, older_than=None) -> None:
        """Remove what describes an earlier checkpoint or another run: evaluate's confusion files
        (of an earlier epoch, or of the run --overwrite replaced; with ``older_than``, the
        checkpoint's time, only those older, and saying so), and a best.npz that is not this run's
        (its records are not the first epochs of this run's)."""
        said = older_than is not None
        best = os.path.join(self.path, BEST)
        header = read_header(best)
        if header is not None and header.get("history") != history[:len(header.get("history") or [])]:
            _remove(best, said and "it held another run's weights")
        for name in DESCRIBES_A_CHECKPOINT:
            path = os.path.join(self.path, name)
            if not said or _mtime(path) < older_than:
                _remove(path, said and "it scored an earlier checkpoint")

    def _restore_best(self, ckpt, history, fresh: bool = False) -> None:
        """After a stop between the checkpoint and best.npz: the checkpoint holds the best epoch, so
        best.npz is copied from it, whole.  ``fresh``: the checkpoint is not this directory's own (a model
        saved elsewhere, fit again here): it never had a best.npz to lose, so nothing is said of one."""
        best = best_epoch(history)
        path = os.path.join(self.path, BEST)
        header = read_header(path)
        if best is None or (header is not None and header.get("history") == history[:best]):
            return
        if best == ckpt["header"].get("epoch"):
            files.atomic_write(path, lambda f: _copy_into(ckpt["path"], f))
            if not fresh:
                say(f"best.npz did not hold epoch {best}, the best: restored from the checkpoint, which holds it")
        elif fresh:
            say(f"best.npz: epoch {best}, the best so far, is not in {ckpt['path']} (it holds epoch "
                f"{ckpt['header'].get('epoch')}); best.npz will hold the next epoch that scores better")
        else:
            say(f"warning: best.npz does not hold epoch {best}, the run's best (was it moved or replaced?); "
                "it will hold the next epoch that scores better")

    def reconcile(self, ckpt, model, test_set) -> list:
        """The run's metrics records up to the checkpoint's epoch, with the directory's
        metrics.jsonl and pictures made to agree with them.  A run stopped inside an epoch's
        commit leaves a checkpoint that metrics.jsonl lags behind: the file is rewritten from the
        checkpoint's records, saying what changed."""
        epoch = ckpt["header"].get("epoch", 0)
        path = os.path.join(self.path, METRICS)
        on_disk = read_metrics(path)
        history = ckpt["header"].get("history") or []
        stale = _older(os.path.join(self.path, p) for p in PICTURES) < _mtime(ckpt["path"])
        if on_disk != history:
            dropped = [r.get("epoch") for r in on_disk if r not in history]
            restored = [r["epoch"] for r in history if r not in on_disk]
            if on_disk:
                changes = ([f"dropped its line{'s' if len(dropped) > 1 else ''} for epoch "
                            f"{', '.join(map(str, dropped))} (written after the checkpoint, or by the run it "
                            "replaced)"] if dropped else [])
                changes += [f"restored epoch {', '.join(map(str, restored))} from the checkpoint"] if restored else []
                say(f"{path} did not agree with the checkpoint, which has finished epoch {epoch}: "
                    + " and ".join(changes))
            write_metrics(self.path, history)
            stale = True
        if stale and history:
            draw(model, test_set, self.path, history)
        elsewhere = os.path.dirname(os.path.abspath(ckpt["path"])) != os.path.abspath(self.path)  # a saved model
        self._restore_best(ckpt, history, fresh=elsewhere)
        self._drop_what_is_not_this_checkpoints(history, older_than=_mtime(ckpt["path"]))
        return history

    def stopped(self, what: str, fix: str | None = None) -> str:
        """The message of a run stopped by a non-finite number: what happened, where to go back to,
        and what to try (``fix``; by default a lower learning rate)."""
        if self.last_good:
            back = "The last good checkpoint is {} (epoch {})".format(*self.last_good)
        else:
            back = "This run wrote no checkpoint yet" + (
                f" (the earlier run's files in {self.replacing} are as they were)" if self.replacing else "")
        return f"{what}; stopped. {back}; {fix or 'try a lower ' + self.spell('lr')}."


def lock(path: str):
    """An exclusive lock on ``path``/.lock for this process's life (an open file descriptor, which
    ``RunDir.release`` closes), the holder's process id written in it; a second run is refused in
    one line naming that process.  None where the system has no ``flock`` (Windows)."""
    try:
        import fcntl
    except ImportError:
        return None
    name = os.path.join(path, LOCK)
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        raise CapsNetError(f"cannot make the lock file {name}: {e.strerror or e}; choose another --out") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise CapsNetError(f"{path} is in use by another run (process {holder}); wait for it to end, or train "
                           "into another directory with --out DIR") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def unlock(path: str, fd) -> None:
    """Release ``lock(path)``'s lock; its file goes too where it is all the folder holds (a command
    refused before it wrote anything leaves no folder behind: out_dir_for removes an empty one)."""
    if fd is None:
        return
    os.close(fd)
    try:
        if os.listdir(path) == [LOCK]:
            os.remove(os.path.join(path, LOCK))
    except OSError:
        pass


def read_header(path) -> dict | None:
    """The header of the checkpoint at ``path`` (read alone, not its arrays): None if there is no
    file, {} if it is not a readable checkpoint."""
    if not os.path.exists(path):
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            header = json.loads(str(z["header"][()]))
        return header if isinstance(header, dict) else {}
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError):
        return {}


def _remove(path, why) -> None:
    if os.path.exists(path):
        os.remove(path)
        if why:
            say(f"removed {path}: {why}")


def _copy_into(src, f) -> None:
    with open(src, "rb") as s:
        shutil.copyfileobj(s, f)


def _mtime(path) -> int:
    return os.stat(path).st_mtime_ns if os.path.exists(path) else -1


def _older(paths) -> int:
    return min(_mtime(p) for p in paths)


def read_metrics(path) -> list:
    """The records of a metrics.jsonl ([] if there is none), up to a line that is not a record."""
    records = []
    if not os.path.lexists(path):
        return records
    try:
        with open_regular(path, "the metrics", mode="r", fix="move it out of the way") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:  # not a line this trainer wrote (edited by hand, say)
                    break
                if not isinstance(record, dict):
                    break
                records.append(record)
    except (OSError, UnicodeDecodeError) as e:
        raise CapsNetError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}; move it out of the way") from None
    return records


def write_metrics(out_dir, history) -> None:
    """metrics.jsonl: one line of strict JSON per epoch, written whole."""
    lines = "".join(json.dumps(r, allow_nan=False) + "\n" for r in history)
    _write(os.path.join(out_dir, METRICS), lambda path: files.atomic_write(path, lambda f: f.write(lines), text=True),
           history)


def draw(model, test_set, out_dir, history):
    """curves.png from the records, reconstructions.png from the model as it is now, on the first
    images of ``test_set`` (the split it is scored on: test, else validation, else train)."""
    curves, recons = (os.path.join(out_dir, p) for p in PICTURES)
    _write(curves, lambda path: plots.training_curves(history, path), history)
    last = history[-1]
    name, key = next((n, k) for n, k in (("test", "test_acc"), ("validation", "val_acc"), ("train", "train_acc"))
                     if k in last)
    _write(recons, lambda path: save_reconstructions(
        model, test_set, path, title=f"epoch {last['epoch']}: {name} accuracy {100 * last[key]:.2f}%"), history)


def _write(path, write, history):
    """``write(path)``, an OSError turned into one line that says the epoch itself is safe."""
    try:
        write(path)
    except OSError as e:
        raise CapsNetError(f"cannot write {path}: {e.strerror or e}. The checkpoint of epoch "
                           f"{history[-1]['epoch'] if history else 0} is saved: fix this, then --resume "
                           f"{os.path.dirname(path)} writes it again") from None


def save_reconstructions(model, split, path, n=16, title=""):
    x, y = split.images(slice(0, n)), split.y[:n]
    with model.evaluating():  # as at test time: masked by the longest capsule, no dropout, running statistics
        out = model.forward(x)
    model.release()
    recons = None if out.reconstruction is None else model.B.to_numpy(out.reconstruction)
    return plots.reconstruction_grid(x, recons, y, out.predictions, path, title, classes=split.classes)


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


@contextlib.contextmanager
def out_dir_for(path):
    """``prepare_out_dir(path)`` for a command that can still fail after it (a checkpoint or data
    refused): the directories it made are removed again if the command fails before writing into
    them, so that a refused command leaves nothing behind.  A directory that holds a file stays."""
    made, parent = [], os.path.abspath(path)
    while not os.path.lexists(parent) and os.path.dirname(parent) != parent:
        made.append(parent)  # leaf first
        parent = os.path.dirname(parent)
    prepare_out_dir(path)
    try:
        yield path
    except BaseException:
        for d in made:
            try:
                os.rmdir(d)  # only an empty one
            except OSError:
                break
        raise


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

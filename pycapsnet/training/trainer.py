"""The ways into the one trainer: ``train_numpy.py``, ``train_cupy.py``, ``train_torch.py`` and
``pycapsnet train`` / ``evaluate`` call ``main``/``run``; Python calls ``fit``.  Each settles its
flags into a ``recipe.Run`` (``describe``), hands it to the loop (``loop.Training``) and turns
expected failures into one line and an exit code: 0 done, 2 bad input (a batch too large for the
device's memory among them), 3 the loss or the model
became NaN/inf, 4 another process of a data-parallel run stopped (``distributed.py``), 130
interrupted (Ctrl-C or SIGTERM).
"""
from __future__ import annotations

import signal
import sys
import threading
import types

from . import checkpoint, distributed
from .argtypes import OneLineParser
from .flags import add_arguments
from .log import speaking
from .loop import NotFinite, Training
from .recipe import check_recipe_values, flag, settle, ARCHITECTURE, RECIPE, Run
from .run_dir import RunDir
from .. import plugins
from ..core.checks import nearest
from ..core.network import Network
from ..errors import first_line, BackendError, CapsNetError, OutOfMemory


def describe(args, backend_name: str, network=None, model=None) -> Run:
    """The command line's Run: the checkpoint it resumes or evaluates read, its flags settled."""
    ckpt = checkpoint.load(args.resume) if getattr(args, "resume", None) else None
    return settle(args, ckpt, backend_name, network=network, model=model)


def train(run: Run, directory: RunDir | None = None, spell=flag) -> dict:
    """The whole run: set-up, then each epoch trained, evaluated and committed (or, with
    ``eval_only``, the checkpoint scored).  ``directory`` keeps the last good checkpoint for the
    caller's messages if the run stops early; ``spell`` names a recipe key in them (a flag, or
    ``str``: fit's keyword)."""
    if directory is None:
        directory = RunDir()
    directory.spell = spell
    if run.checkpoint:  # the one to go back to if the run stops early (a NaN loss, Ctrl-C)
        directory.last_good = (run.resume, run.checkpoint["header"].get("epoch", 0))
    training = None
    try:
        training = Training(run, directory)
        return training.evaluate_only() if run.eval_only else training.train()
    except Exception as e:
        model = getattr(training, "model", None)
        if isinstance(e, MemoryError) or model is not None and model.B.out_of_memory(e):
            raise OutOfMemory(_out_of_memory(run, model, e, spell)) from e
        raise
    finally:
        directory.release()
        if training is not None and getattr(training, "scalars", None) is not None:
            training.scalars.close()
        if training is not None and training.group is not None:
            training.group.close()


def _out_of_memory(run: Run, model, e: BaseException, spell) -> str:
    """One line for a step that did not fit: where, at which batch, what the library said, the fix."""
    said = first_line(e)
    if model is None:  # the data were being read, or the network built: no step had run
        return (f"out of memory while reading the data and building the network ({said}): give fewer or "
                f"smaller images ({spell('limit')}, {spell('image_size')})")
    return (f"out of memory on {model.B.label} at batch {run.batch_size} ({said}): give a smaller "
            f"{spell('batch_size')}; `pycapsnet plan` works out the largest that fits")


def _terminated(signum, frame):
    raise KeyboardInterrupt  # as Ctrl-C: the message names the checkpoint to resume from


def sigterm_as_ctrl_c(handler=_terminated) -> None:
    """Handle SIGTERM (what schedulers send before a kill) with ``handler``, by default as a Ctrl-C,
    where a handler can be set (the main thread) and none is set already."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, handler)


def run(args, backend_name: str) -> int:
    """Run and turn expected failures into one clear line and an exit code (no traceback).  A
    SIGTERM (what schedulers send before a kill) is handled as a Ctrl-C; in a run of several
    processes (torchrun sends it to the others when one fails) it stops this one at its next
    collective, with exit code 4 like any other failure of the group."""
    sigterm_as_ctrl_c(distributed.note_stop if distributed.launched() else _terminated)
    directory = RunDir()
    try:
        train(describe(args, backend_name), directory)
        return 0
    except distributed.GroupFailed as e:
        good = directory.last_good
        where = ("" if not speaking() else  # rank 0 alone writes checkpoints, and knows which is the last
                 " The last good checkpoint is {} (epoch {}).".format(*good) if good else
                 " This run wrote no checkpoint yet.")
        print(f"error: {e}.{where}", file=sys.stderr)
        return 4
    except (CapsNetError, BackendError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except NotFinite as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        if not speaking():  # torchrun passes a Ctrl-C to every process: rank 0 speaks for them
            return 130
        good = directory.last_good
        where = (f"the last good checkpoint ({good[0]}, epoch {good[1]}) is intact; continue with --resume {good[0]}"
                 if good else "this run wrote no checkpoint yet; nothing to resume")
        print(f"\ninterrupted: {where}", file=sys.stderr)
        return 130
    finally:
        speaking(True)


def main(backend: str | None = None, argv=None) -> int:
    """Entry point of the per-backend scripts: ``sys.exit(main("numpy"))``."""
    try:  # before the parser is made: its --routing choices hold the routings the plugins register
        plugins.load_from_argv(argv)
    except CapsNetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    p = OneLineParser(
        prog=f"train_{backend}.py" if backend else "pycapsnet train",
        description="Train a CapsNet (Sabour et al. 2017) with hand-written gradients"
                    + (f" on the {backend} backend." if backend else "."))
    add_arguments(p, backend)
    args = p.parse_args(argv)
    return run(args, backend or args.backend)


# fit's keywords beyond the recipe's and the architecture's: where the run goes and how it shows
FIT_OPTIONS = {"epochs": None, "out": None, "resume": None, "overwrite": False, "no_progress": False,
               "log_csv": None, "tensorboard": None, "no_graph": False, "compile": False, "device": None,
               "accept_changed_data": False, "normalize": False}


def fit(network, backend: str = "numpy", **flags) -> dict:
    """Train ``network`` with the trainer of the command line on data it reads (the embedded
    digits, IDX files, a folder of images: ``dataset=``, ``data_dir=``), in Python; returns the
    last epoch's record (test_acc, train_loss, ...).  ``network``: a description
    (``architecture.network(...)``), built on ``backend`` from ``seed``, or a Network already built
    (its backend and weights are used as they are).  ``flags`` are the command line's, by their
    Python names (epochs=2, out="runs/mine", batch_size=16, limit=500, ...), each checked as the flag
    checks it: an unknown name is a TypeError naming the nearest.  Arrays in memory:
    ``pycapsnet.build(...).fit(x, y)``.  Bad input raises CapsNetError; a non-finite loss, NotFinite."""
    known = {*RECIPE, *ARCHITECTURE, *FIT_OPTIONS}
    unknown = sorted(set(flags) - known)
    if unknown:
        near = nearest(unknown[0], known)
        raise TypeError(f"fit() got an unexpected keyword argument {unknown[0]!r}"
                        + (f"; did you mean {near!r}?" if near else ""))
    check_recipe_values({k: v for k, v in flags.items() if k in RECIPE or k == "epochs"}, "fit: ")
    model = network if isinstance(network, Network) else None
    if model is not None:
        if model.architecture is None:
            raise CapsNetError("fit: this network was not built from a description (architecture.build), so a "
                               "checkpoint could not rebuild it; build it with architecture.build(description, ...)")
        if flags.get("dtype", model.B.dtype) != model.B.dtype:
            raise CapsNetError(f"fit: dtype={flags['dtype']!r}, but the network is built in {model.B.dtype}")
        backend, flags = model.B.name, {**flags, "dtype": model.B.dtype}
    args = types.SimpleNamespace(**{k: None for k in (*RECIPE, *ARCHITECTURE)}, **FIT_OPTIONS)
    for k, v in flags.items():
        setattr(args, k, tuple(v) if isinstance(v, list) else v)
    args.backend = backend
    return train(describe(args, backend, network=None if model is not None else network, model=model), spell=str)

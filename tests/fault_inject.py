"""Run the numpy trainer and stop it at one point of an epoch's commit, as a kill or a Ctrl-C would.

    python -m tests.fault_inject POINT N SIGNAL -- TRAINER FLAGS      (from the repository root)

POINT: inside the epoch's training, or in the order an epoch is committed (``run_dir.RunDir.commit``):
  training    after the epoch's first training step
  trained     the epoch is trained and evaluated; nothing of it is written yet
  saving      the checkpoint is written to its temporary file, not yet renamed into place
  checkpoint  checkpoint.npz is in place
  metrics     metrics.jsonl is in place
  curves      curves.png is in place (reconstructions.png is not yet)
N: stop at the N-th such point of this process.  SIGNAL: SIGKILL (nothing runs after it) or SIGINT
(Ctrl-C: the trainer's own handler runs).  Used by tests/test_faults.py.  Under torchrun,
FAULT_INJECT_RANK=K stops rank K alone (tests/test_distributed.py).
"""
import os
import signal
import sys

from pycapsnet.training import checkpoint, trainer
from pycapsnet.core.model import CapsNet

FILES = {"saving": "checkpoint.npz", "checkpoint": "checkpoint.npz", "metrics": "metrics.jsonl",
         "curves": "curves.png"}


def main():
    point, n, sig = sys.argv[1], int(sys.argv[2]), getattr(signal, sys.argv[3])
    if sig == signal.SIGINT:
        # Ctrl-C as a terminal delivers it, to a process that listens: one started as a background job
        # (``nohup pytest &``, a CI runner) inherits SIGINT ignored, and would never see the stop.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    flags = sys.argv[sys.argv.index("--") + 1:]
    seen = {"count": 0}

    only = os.environ.get("FAULT_INJECT_RANK")  # under torchrun: stop this one rank alone

    def hit():
        if only is not None and os.environ.get("RANK") != only:
            return
        seen["count"] += 1
        if seen["count"] == n:
            os.kill(os.getpid(), sig)

    if point == "training":
        step = CapsNet.train_step_grads

        def step_then_stop(self, x, y):
            out = step(self, x, y)
            hit()
            return out

        CapsNet.train_step_grads = step_then_stop
    elif point == "trained":
        save = checkpoint.save

        def stop_then_save(*args, **kwargs):
            hit()
            return save(*args, **kwargs)

        checkpoint.save = stop_then_save
    else:
        replace, name = os.replace, FILES[point]

        def replace_and_stop(src, dst):
            if os.path.basename(dst) != name:
                return replace(src, dst)
            if point == "saving":
                hit()
            replace(src, dst)
            if point != "saving":
                hit()

        os.replace = replace_and_stop
    return trainer.main("numpy", flags)


if __name__ == "__main__":
    sys.exit(main())

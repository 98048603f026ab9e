"""Errors pycapsnet raises for bad input.  Each message names the problem and the fix."""
from pycapsnet.backends.base import BackendError  # noqa: F401  (re-exported)


class CapsNetError(ValueError):
    """Bad input to a pycapsnet model, loss, dataset or checkpoint."""


class OutOfMemory(CapsNetError, MemoryError):
    """A train step or an evaluation needed more memory than the device has: the batch is too
    large for it.  Also a MemoryError, so code that catches one catches this."""


class NotFinite(RuntimeError):
    """The model's numbers are no longer finite (the command line's exit 3)."""


class TrainingDiverged(NotFinite):
    """Training stopped because a loss became NaN or inf; the message names the last good
    checkpoint, and nothing non-finite was saved.  ``fit`` raises it: a lower ``lr`` is the usual fix."""


def first_line(e: BaseException, limit: int = 200) -> str:
    """What an exception said, on one line: its first line, at most ``limit`` characters."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:limit]

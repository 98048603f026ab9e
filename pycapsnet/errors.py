"""Errors pycapsnet raises for bad input.  Each message names the problem and the fix."""
from pycapsnet.backends.base import BackendError  # noqa: F401  (re-exported)


class CapsNetError(ValueError):
    """Bad input to a pycapsnet model, loss, dataset or checkpoint."""


class OutOfMemory(CapsNetError, MemoryError):
    """A train step or an evaluation needed more memory than the device has: the batch is too
    large for it.  Also a MemoryError, so code that catches one catches this."""


class NotFinite(RuntimeError):
    """The model's numbers are no longer finite (the command line's exit 3)."""


class RoutingNotFinite(NotFinite):
    """A routing of the user's own made NaN or inf from finite inputs (its forward or backward, or
    an option it cannot run with): ``what`` names the routing and the pass, ``fix`` what to try."""

    def __init__(self, what: str, fix: str):
        super().__init__(f"{what}; {fix}")
        self.what, self.fix = what, fix


class TrainingDiverged(NotFinite):
    """Training stopped because a loss became NaN or inf; the message names the last good
    checkpoint, and nothing non-finite was saved.  ``fit`` raises it: a lower ``lr`` is the usual fix."""


def first_line(e: BaseException, limit: int = 200) -> str:
    """What an exception said, on one line: its first line, at most ``limit`` characters."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:limit]


def printable(text, limit: int = 300) -> str:
    """``text`` (a file's or a third party's) as one printable line: a newline, a terminal's escape
    or any other control character shown as its escape (``\\n``, ``\\x1b``), at most ``limit``
    characters."""
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))
    return out if len(out) <= limit else out[:limit] + "..."

"""What a run tells the person watching it: one line at a time (``say``), and a progress bar over
an epoch's batches (``progress``).  In a data-parallel run only the process that writes the run's
files (rank 0) speaks: ``speaking(False)`` silences the others."""
from __future__ import annotations

_SPEAKS = [True]


def speaking(on: bool | None = None) -> bool:
    """Whether this process speaks; with ``on``, set it first."""
    if on is not None:
        _SPEAKS[0] = bool(on)
    return _SPEAKS[0]


def say(msg: str) -> None:
    """One line, printed above a progress bar if one is showing."""
    if not _SPEAKS[0]:
        return
    try:
        from tqdm import tqdm

        tqdm.write(msg)
    except ImportError:
        print(msg, flush=True)


def progress(iterable, total, desc, disable):
    """``iterable`` with a progress bar (tqdm, where it is installed), unless ``disable``."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # the bar is a convenience, not a dependency of training
        return iterable
    return tqdm(iterable, total=total, desc=desc, leave=False, disable=disable or None, dynamic_ncols=True)

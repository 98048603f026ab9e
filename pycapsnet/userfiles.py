"""A file a user names, opened so that it can neither block nor flood: a regular file only, opened
without blocking (a FIFO would wait for a writer forever, a device would never end), checked by its
descriptor (the file checked is the file read), and read up to a bound the caller sets.  Every
path a user gives pycapsnet to read -- a network description, an IDX file, an image, a checkpoint,
a log to continue -- goes through here, and every refusal is one CapsNetError naming the file.
"""
from __future__ import annotations

import os
import stat

from .errors import CapsNetError

NOT_REGULAR = "not a regular file (a pipe, a device or a socket)"


def open_regular(path, what: str, limit: int | None = None, mode: str = "rb", fix: str = "name a file"):
    """``path`` opened for reading (``mode`` "rb" or "r"), if it is a regular file of at most
    ``limit`` bytes; CapsNetError "cannot read {what} {path}: ..." otherwise, ending in ``fix``
    where the path names something other than a file."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise CapsNetError(f"cannot read {what} {path}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise CapsNetError(f"cannot read {what} {path}: it is a directory; {fix}")
        if not stat.S_ISREG(st.st_mode):
            raise CapsNetError(f"cannot read {what} {path}: {NOT_REGULAR}; {fix}")
        if limit is not None and st.st_size > limit:
            raise CapsNetError(f"cannot read {what} {path}: {st.st_size:,} bytes, more than {what} may hold "
                               f"({_size(limit)}); is it the right file?")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)  # a regular file: reads behave as usual
        return os.fdopen(fd, mode, encoding=None if "b" in mode else "utf-8")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path, what: str, limit: int, text: bool = False):
    """The whole of ``path`` (bytes, or str when ``text``), a regular file of at most ``limit`` bytes."""
    with open_regular(path, what, limit, "r" if text else "rb") as f:
        try:
            data = f.read(limit + 1)
        except UnicodeDecodeError as e:
            raise CapsNetError(f"cannot read {what} {path}: it is not UTF-8 text ({e.reason})") from None
        except OSError as e:
            raise CapsNetError(f"cannot read {what} {path}: {e.strerror or e}") from None
    if len(data) > limit:  # it grew since it was checked
        raise CapsNetError(f"cannot read {what} {path}: more than {what} may hold ({_size(limit)})")
    return data


def refuse_special(path, what: str) -> None:
    """A file about to be written or appended to: refused if it exists and is not a regular file
    or a directory (writing would replace a FIFO or a device node with a file, or block on it)."""
    try:
        st = os.stat(path)
    except OSError:
        return
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        raise CapsNetError(f"cannot write {what} {path}: it exists and is {NOT_REGULAR}; name a file")


def _size(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB" if n >= 2**20 else f"{n:,} bytes"

"""Files that are never left half-written.

Every file a run writes (checkpoint, metrics, pictures) is written beside its target under a
temporary name, flushed to disk and renamed over the target (``os.replace``, atomic on POSIX and
Windows).  A reader, or a run resumed after a crash, sees the old file or the new one, never a
mixture.  A temporary's name holds its writer's process id: a writer killed before the rename
leaves its temporary behind, and the next write of the same file removes it once that process is
gone -- never the temporary of a writer still at work.
"""
from __future__ import annotations

import errno
import glob
import os
import tempfile

PREFIX = ".tmp-"


def temporaries(path: str, stale: bool = False) -> list:
    """Temporaries of writes of ``path`` beside it, ``.tmp-<stem>-<pid>-*<suffix>``; ``stale``: only
    those whose writer is gone (or is this process, or wrote no id: an older version's)."""
    directory, name = os.path.split(os.path.abspath(path))
    stem, suffix = os.path.splitext(name)
    pattern = f"{PREFIX}{glob.escape(stem)}-*{glob.escape(suffix)}"
    found = sorted(glob.glob(os.path.join(glob.escape(directory), pattern)))
    start = len(PREFIX) + len(stem) + 1
    return [p for p in found if not stale or not _alive(os.path.basename(p)[start:].split("-", 1)[0])]


def _alive(pid: str) -> bool:
    """Whether the process ``pid`` (a temporary's writer) is running and is not this one."""
    if not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):  # another user's, or a system that cannot tell: leave it
        return True
    return True


def atomic_write(path: str, write, text: bool = False) -> str:
    """Call ``write(f)`` on a fresh temporary file beside ``path``, then make it ``path`` in one
    rename.  OSError (the caller names the file and the fix) leaves ``path`` as it was."""
    if os.path.exists(path) and not (os.path.isfile(path) or os.path.isdir(path)):  # never replace a FIFO or a device
        raise OSError(errno.EEXIST, "it exists and is not a regular file (a pipe, a device or a socket); name a file")
    directory, name = os.path.split(os.path.abspath(path))
    stem, suffix = os.path.splitext(name)
    for stale in temporaries(path, stale=True):  # from a writer killed before its rename
        try:
            os.unlink(stale)
        except OSError:
            pass
    fd, tmp = tempfile.mkstemp(prefix=f"{PREFIX}{stem}-{os.getpid()}-", suffix=suffix, dir=directory)
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it 0600: give it what an ordinary file gets
        with os.fdopen(fd, "w" if text else "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
        _sync_directory(directory)  # the rename itself survives a power cut
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _umask() -> int:
    """The process's umask, read without changing it where the system says it (Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # elsewhere: set and restored at once
    os.umask(mask)
    return mask


def _sync_directory(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # Windows opens no directories; its rename is durable as it is
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)

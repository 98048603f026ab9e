"""The IDX format of MNIST and Fashion-MNIST (LeCun et al.): magic 0x0000 | type | ndim, ndim big-endian
int32 sizes, then the data; read (raw or .gz) with every count checked before a byte of data is
read, and written (unsigned bytes) for tests and exports."""
from __future__ import annotations

import gzip
import math

import numpy as np

from pycapsnet.backends.host import machine_memory

from ..errors import CapsNetError
from ..userfiles import open_regular

# IDX type codes -> NumPy dtypes (big-endian)
_IDX_TYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
# What each IDX file of a dataset holds, by its number of dimensions.
_IDX_KINDS = {1: "labels", 3: "images"}


# What an IDX file may declare before a byte of its data is read: MNIST-format files hold small
# images (a folder of images is the way for large ones), at most MAX_IDX_ITEMS of them or their labels.
MAX_IDX_ITEMS = 1 << 27
MAX_IDX_SIDE = 4096
_CHUNK = 1 << 24


def read_idx(path: str, ndim: int | None = None) -> np.ndarray:
    """Parse one IDX file (raw or .gz): magic 0x0000 | type | ndim, then ndim big-endian int32 sizes,
    then the data.  ``ndim``: the number of dimensions the caller expects (3 for images, 1 for
    labels).  The header is read and checked first (its counts against what such a file holds and
    the machine's memory), then exactly the data it declares, a chunk at a time: a .gz that
    inflates to more is refused once it passes that size, never inflated whole.  Raises
    CapsNetError naming the file on any inconsistency."""
    try:
        with open_regular(path, "the data file") as raw_file:
            f = gzip.GzipFile(fileobj=raw_file, mode="rb") if str(path).endswith(".gz") else raw_file
            dims, dtype = _idx_header(f, path, ndim)
            expected = math.prod(dims) * dtype.itemsize
            data = bytearray(expected)
            view, got = memoryview(data), 0
            while got < expected:
                n = f.readinto(view[got:got + _CHUNK])
                if not n:
                    break
                got += n
            extra = len(f.read(1)) if got == expected else 0
    except FileNotFoundError:
        raise CapsNetError(f"data file not found: {path}") from None
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise CapsNetError(f"cannot read {path}: {e} (corrupt or truncated download?)") from None
    if got != expected or extra:
        held = f"{got} bytes" if got < expected else "more"
        raise CapsNetError(f"{path}: header says {'x'.join(map(str, dims))} values ({expected} bytes) but the file "
                           f"holds {held} of data (truncated or corrupt)")
    return np.frombuffer(data, dtype).reshape(dims)


def _idx_header(f, path, ndim):
    """(dims, dtype) of an IDX file's header, read from ``f``; refused where the counts exceed what
    an images or labels file holds, or what this machine's memory would take."""
    head = f.read(4)
    if len(head) < 4 or head[0] != 0 or head[1] != 0:
        raise CapsNetError(f"{path} is not an IDX file (bad magic number {head[:4].hex() or 'empty file'}); "
                           "expected MNIST-format files such as train-images-idx3-ubyte[.gz]")
    code, found = head[2], head[3]
    if code not in _IDX_TYPES or found == 0:
        raise CapsNetError(f"{path}: unsupported IDX header (type 0x{code:02x}, {found} dimensions)")
    if ndim is not None and found != ndim:
        # checked before the sizes: read with the wrong header, they would be nonsense
        what = _IDX_KINDS.get(found, f"{found}-dimensional data")
        raise CapsNetError(f"{path} holds {what} (its magic number says {found} dimension{'s' if found > 1 else ''}), "
                           f"but the {_IDX_KINDS.get(ndim, 'data')} file belongs here; are two files swapped "
                           "or misnamed?")
    sizes = f.read(4 * found)
    if len(sizes) < 4 * found:
        raise CapsNetError(f"{path}: truncated header")
    dims = tuple(int(d) for d in np.frombuffer(sizes, ">i4"))
    dtype = np.dtype(_IDX_TYPES[code])
    shown = "x".join(map(str, dims))
    if min(dims) < 0 or dims[0] > MAX_IDX_ITEMS or any(d > MAX_IDX_SIDE for d in dims[1:]):
        raise CapsNetError(f"{path}: its header declares {shown} values, more than an IDX file of "
                           f"{_IDX_KINDS.get(found, 'data')} holds here (at most {MAX_IDX_ITEMS:,} items of at most "
                           f"{MAX_IDX_SIDE} per side): corrupt, or not an MNIST-format file")
    need, have = math.prod(dims) * (dtype.itemsize + 4), machine_memory()  # the data, then as float32
    if have and need > 0.8 * have:
        raise CapsNetError(f"{path}: its header declares {shown} values, {need / 2**30:.1f} GiB to read and "
                           f"convert, more than this machine's {have / 2**30:.1f} GiB of memory allow")
    return dims, dtype


def write_idx(path: str, array: np.ndarray) -> None:
    """Write an unsigned-byte IDX file (raw or .gz); used by the tests and to export data."""
    a = np.asarray(array, np.uint8)
    data = bytes([0, 0, 0x08, a.ndim]) + np.asarray(a.shape, ">i4").tobytes() + a.tobytes()
    with (gzip.open if path.endswith(".gz") else open)(path, "wb") as f:
        f.write(data)

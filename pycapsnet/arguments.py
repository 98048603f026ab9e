"""The Python face's argument checks.  Each takes a value a caller gave and either returns it as the
plain Python value it stands for (a NumPy integer as an int) or raises one CapsNetError that names
the argument, what it got and what it takes -- never a value quietly rounded, clamped or read as
something else (2.7 as capsule 2, "no" as true), and never a TypeError from deep inside.  The
command line checks its flags with argparse types (training/argtypes.py); these are their
counterparts for keywords."""
from __future__ import annotations

import math
import numbers
import os

import numpy as np

from .errors import CapsNetError


def shown(v) -> str:
    """A value as a message shows it: short (an array by its shape, a long repr cut)."""
    if hasattr(v, "shape") and hasattr(v, "dtype") and getattr(v, "ndim", 0) > 0:
        return f"an array of shape {tuple(v.shape)}"
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_bool(v) -> bool:
    return isinstance(v, (bool, np.bool_))


def whole(v, name: str, least: int = 0, most: int | None = None, none: bool = False) -> int | None:
    """A whole number (a Python or NumPy integer, not a bool) in [least, most] as an int."""
    if v is None and none:
        return None
    if _is_bool(v) or not isinstance(v, numbers.Integral) or v < least or (most is not None and v > most):
        where = f"from {least} to {most}" if most is not None else f"of at least {least}"
        raise CapsNetError(f"{name} must be a whole number {where}{' (or None)' if none else ''}, got {shown(v)}")
    return int(v)


def real(v, name: str, lo: float = -math.inf, hi: float = math.inf, open_lo: bool = False, open_hi: bool = False,
         none: bool = False) -> float | None:
    """A finite real number in the interval given (closed unless ``open_lo``/``open_hi``) as a float."""
    if v is None and none:
        return None
    ok = not _is_bool(v) and isinstance(v, numbers.Real) and math.isfinite(v)
    ok = ok and (v > lo if open_lo else v >= lo) and (v < hi if open_hi else v <= hi)
    if not ok:
        if lo == -math.inf and hi == math.inf:
            where = ""
        elif hi == math.inf:
            where = f" {'above' if open_lo else 'of at least'} {lo:g}"
        else:
            where = f" in {'(' if open_lo else '['}{lo:g}, {hi:g}{')' if open_hi else ']'}"
        raise CapsNetError(f"{name} must be a finite number{where}{' (or None)' if none else ''}, got {shown(v)}")
    return float(v)


def is_sequence(v, n: int) -> bool:
    """Whether ``v`` is a tuple, list or 1-d array of ``n`` items (a string is none of these)."""
    return isinstance(v, (tuple, list, np.ndarray)) and np.ndim(v) == 1 and len(v) == n


def boolean(v, name: str) -> bool:
    """True or False (a bool, or NumPy's): never a string such as "no", which Python reads as true."""
    if not _is_bool(v):
        raise CapsNetError(f"{name} must be True or False, got {shown(v)}")
    return bool(v)


def choice(v, name: str, options) -> str:
    """One of ``options`` (strings)."""
    if not isinstance(v, str) or v not in options:
        raise CapsNetError(f"{name} must be one of {', '.join(map(repr, options))}, got {shown(v)}")
    return v


def path(v, name: str, none: bool = False):
    """A path (str or os.PathLike) as a str."""
    if v is None and none:
        return None
    if not isinstance(v, (str, os.PathLike)) or not os.fspath(v):
        raise CapsNetError(f"{name} must be a path (a str or os.PathLike), got {shown(v)}")
    return os.fspath(v)


def file_to_write(v, name: str) -> str:
    """A file path that is not a folder (a picture, a table): refused before any work is done."""
    p = path(v, name)
    if os.path.isdir(p):
        raise CapsNetError(f"{name} {p} is a folder; name the file to write (such as {os.path.join(p, 'figure.png')})")
    return p

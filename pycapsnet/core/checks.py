"""Checks of what users hand the model -- options, images, labels, batch sizes -- each failing with
a CapsNetError that names the problem and the fix.  Kept apart from the network (model.py) so that
the network reads as layers; everything here runs on the host."""
from __future__ import annotations

import difflib

import numpy as np

from ..errors import CapsNetError

# Routing iterations, at most: the papers route 1 to 3 times, and each iteration keeps its coupling
# coefficients for the backward, so a number from a typo or a hostile file would grow memory and
# time until the process dies.  Descriptions, checkpoints and --routing-iters are held to it.
MAX_ROUTING_ITERS = 32


def nearest(name: str, names) -> str | None:
    """The real name a misspelt or shortened ``name`` most likely meant: one it begins (the
    shortest), else the closest by difflib; None if none is close."""
    names = sorted(names)
    started = [n for n in names if n.startswith(name)]
    if started:
        return min(started, key=len)
    close = difflib.get_close_matches(name, names, n=1)
    return close[0] if close else None


def config_with(cfg, overrides: dict, backend_name: str):
    """``cfg`` with the fields in ``overrides`` replaced; an unknown name is refused with the
    closest field ("did you mean") and, for dtype or device, where those belong."""
    fields = list(cfg.to_dict())
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        hints = [f"{k}: did you mean {m[0]}?" for k in unknown if (m := difflib.get_close_matches(k, fields, n=1))]
        if {"dtype", "device"} & set(unknown):
            hints.append("the dtype and device belong to the backend, e.g. "
                         f"CapsNet(backends.get({backend_name!r}, dtype='float64'))")
        raise CapsNetError(f"CapsNet got unknown option(s) {', '.join(unknown)}"
                           + (f" ({'; '.join(hints)})" if hints else "")
                           + f"; the options are the fields of CapsNetConfig: {', '.join(fields)}")
    return cfg.replace(**overrides)


def require_batch_size(batch_size) -> None:
    """CapsNetError unless ``batch_size`` is a whole number >= 1 (an int, not a bool or a float)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise CapsNetError(f"batch_size must be a whole number of at least 1, got {batch_size!r}")


def check_setting(name: str, value, lo: float = 0.0, hi: float = float("inf")):
    """``value`` as a float, after checking that it is a finite number within [lo, hi]."""
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    if not ok or not np.isfinite(value) or not lo <= value <= hi:
        raise CapsNetError(f"{name} must be a finite number {f'from {lo:g} to {hi:g}' if hi < float('inf') else f'of at least {lo:g}'}"
                           f", got {value!r}")
    return float(value)


def check_images(B, input_shape, x):
    """x as a device array of backend B, after checking that it is a finite float batch (N, C, H, W)
    of ``input_shape`` images.  A host array is checked on the host, before its copy to the
    device: a GPU step then reads nothing back from the device before its loss."""
    c, h, w = input_shape
    x = B.native(x)  # a torch tensor to the numpy backend, a CuPy array to torch, ...
    if not hasattr(x, "shape"):  # a nested list or tuple of pixels
        x = np.asarray(x)
    shape = tuple(x.shape)
    if len(shape) != 4:
        raise CapsNetError(f"images must be a 4-D batch (N, C, H, W) = (N, {c}, {h}, {w}); got shape {shape}"
                           + (" -- add a channel axis: x[:, None]" if len(shape) == 3 and c == 1 else ""))
    if shape[1] != c:
        raise CapsNetError(f"images have {shape[1]} channels but the model expects {c} (shape (N, C, H, W)); "
                           "build the model with input_shape matching your data")
    if shape[2:] != (h, w):
        raise CapsNetError(f"images are {shape[2]}x{shape[3]} but the model expects {h}x{w}; "
                           "resize them or build the model with input_shape=" f"({c}, {shape[2]}, {shape[3]})")
    if shape[0] == 0:
        raise CapsNetError(f"the batch of images is empty (shape {shape}); pass at least one image")
    if not B.is_floating(x):
        raise CapsNetError(f"images must be floating point (scaled to [0, 1]), got dtype {x.dtype}; "
                           "e.g. x.astype('float32') / 255")
    # the smallest and largest pixel say both: a NaN makes them NaN, an inf makes one of them inf
    xp = np if isinstance(x, np.ndarray) else B.xp
    lo, hi = float(xp.min(x)), float(xp.max(x))
    if not (np.isfinite(lo) and np.isfinite(hi)):
        raise CapsNetError("images contain NaN or inf values; clean the input data")
    if lo < 0 or hi > 1:  # the decoder's sigmoid reconstructs [0, 1]: pixels beyond it have no target
        raise CapsNetError(f"images must hold pixels in [0, 1], got values from {lo:g} to {hi:g}; scale them "
                           "(8-bit pixels: x / 255)")
    return B.asarray(x)


def check_labels(B, n_classes, y, n):
    """y as a host int64 array of n class indices in [0, n_classes)."""
    y = B.native(y)
    y_host = np.asarray(y) if isinstance(y, (np.ndarray, list, tuple)) else B.to_numpy(y)
    if y_host.ndim != 1 or y_host.shape[0] != n:
        raise CapsNetError(f"labels must be a 1-D array of {n} class indices, got shape {y_host.shape}")
    if y_host.dtype.kind not in "iu":
        raise CapsNetError(f"labels must be integers (class indices), got dtype {y_host.dtype}; "
                           "use y.astype('int64')")
    J = n_classes
    if y_host.size and (y_host.min() < 0 or y_host.max() >= J):
        raise CapsNetError(f"labels must lie in [0, {J - 1}] for {J} classes; got values from "
                           f"{y_host.min()} to {y_host.max()}")
    return y_host.astype(np.int64)


def check_capsules(v, classes, n_classes, class_dim):
    """For ``CapsNet.decode``: v (N, J, D) and one class index per sample; classes as host int64."""
    J, D = n_classes, class_dim
    shape = tuple(np.shape(v))
    if len(shape) != 3 or shape[1:] != (J, D):
        raise CapsNetError(f"class capsules must have shape (N, {J}, {D}) (N, classes, class_dim); got {shape}")
    classes = np.asarray(classes)
    if classes.shape != (shape[0],) or classes.dtype.kind not in "iu" or not ((0 <= classes) & (classes < J)).all():
        raise CapsNetError(f"classes must be {shape[0]} integers in [0, {J - 1}], one per sample; "
                           f"got {classes.tolist() if classes.size <= 8 else classes.shape}")
    return classes.astype(np.int64)

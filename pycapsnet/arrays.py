"""What the Python face takes as images and labels: NumPy, CuPy or torch arrays (torch's half
precision widened, sparse and meta tensors refused), checked and converted once, each problem one
CapsNetError naming the argument and the fix."""
from __future__ import annotations

import numpy as np

from .errors import CapsNetError, first_line


def _host(x, what: str) -> np.ndarray:
    """A NumPy array of x, whichever library holds it (a torch tensor, a CuPy array, a list)."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch
        x = _torch_host(x, what)
    elif type(x).__module__.split(".")[0] == "cupy":
        x = x.get()
    try:
        return np.asarray(x)
    except (TypeError, ValueError) as e:
        raise CapsNetError(f"{what} must be an array (NumPy, CuPy or torch), got {type(x).__name__}: {e}") from None


def _torch_host(t, what: str) -> np.ndarray:
    """A torch tensor's values on the host: half and bfloat16 widened to float32 (exactly), a sparse
    tensor or one on the meta device (no values) refused."""
    if getattr(t, "is_meta", False):
        raise CapsNetError(f"{what} is a tensor on the meta device, which holds shapes but no values: give a tensor "
                           "of real data")
    if getattr(t, "layout", None) is not None and "strided" not in str(t.layout):
        raise CapsNetError(f"{what} is a sparse tensor ({str(t.layout).replace('torch.', '')}): give a dense one, "
                           f"{what}.to_dense()")
    t = t.detach().cpu()
    if str(t.dtype) in ("torch.bfloat16", "torch.float16"):  # NumPy has no bfloat16: widen, losing nothing
        t = t.float()
    try:
        return t.numpy()
    except (TypeError, RuntimeError) as e:
        raise CapsNetError(f"{what} is a torch tensor of {str(t.dtype).replace('torch.', '')}, which pycapsnet "
                           f"cannot read ({first_line(e)}): give float32 or float64") from None


def images(x, input_shape, what: str = "x") -> np.ndarray:
    """x as float32 (N, C, H, W) for a network of ``input_shape``; (N, H, W) when C is 1."""
    a = _host(x, what)
    c, h, w = input_shape
    if a.ndim == 3 and c == 1:
        a = a[:, None]
    if a.ndim != 4 or tuple(a.shape[1:]) != (c, h, w):
        raise CapsNetError(f"{what} has shape {tuple(a.shape)}, but the network takes images of {(c, h, w)}: "
                           f"give (N, {c}, {h}, {w})" + (f" or (N, {h}, {w})" if c == 1 else ""))
    if a.dtype.kind not in "fiu" or a.dtype == np.bool_:
        raise CapsNetError(f"{what} holds {a.dtype} values; give numbers (floats in [0, 1])")
    if a.dtype.kind in "iu":
        raise CapsNetError(f"{what} holds integers ({a.dtype}); give floats in [0, 1] (x / 255 for 8-bit pixels)")
    if len(a) == 0:
        raise CapsNetError(f"{what} holds no images")
    if not np.isfinite(a).all():
        raise CapsNetError(f"{what} holds NaN or inf values (image {int(np.flatnonzero(~np.isfinite(a).reshape(len(a), -1).all(1))[0])})")
    return np.ascontiguousarray(a, dtype=np.float32)


def labels(y, n: int, n_classes: int | None, what: str = "y") -> np.ndarray:
    """y as int64 class indices, one per image, each in [0, n_classes) (None: any index from 0)."""
    a = _host(y, what)
    if a.ndim != 1 or len(a) != n:
        raise CapsNetError(f"{what} has shape {tuple(a.shape)}, but there are {n} images: give one class index each")
    if a.dtype.kind == "f":
        if not np.all(np.isfinite(a)) or np.any(a != np.round(a)):
            raise CapsNetError(f"{what} must hold whole class indices, not fractions or NaN")
    elif a.dtype.kind not in "iu" or a.dtype == np.bool_:
        indices = "class indices 0, 1, ..." if n_classes is None else f"class indices 0..{n_classes - 1}"
        raise CapsNetError(f"{what} holds {a.dtype} values; give {indices} (one-hot rows: y.argmax(1))")
    if n_classes is None:
        if len(a) and a.min() < 0:
            raise CapsNetError(f"{what} holds class {int(a.min())}: class indices start at 0")
    elif len(a) and (a.min() < 0 or a.max() >= n_classes):
        raise CapsNetError(f"{what} holds classes {int(a.min())}..{int(a.max())}, but the network has {n_classes}: "
                           f"give indices 0..{n_classes - 1}")
    return a.astype(np.int64)

"""Functions that a backend may run as one fused kernel.

A function marked ``@fusable`` is written with the Array API namespace ``xp``, readably, and is the
reference.  Where ``xp`` carries ``kernels`` holding a function of the same name (the CuPy backend's:
backends/cupy_kernels.py), that runs instead, with the same arguments but ``xp`` and the same
results: squash's norm, product and scaling in one launch where the namespace's form takes five.
NumPy and PyTorch carry none, so they run the function as written.  A call with keywords (another
axis) always runs the reference: the kernels are written for the defaults."""
from __future__ import annotations

import functools
import inspect


def fusable(fn):
    name = fn.__name__
    required = sum(p.default is inspect.Parameter.empty for p in inspect.signature(fn).parameters.values()) - 1

    @functools.wraps(fn)
    def call(xp, *args, **kwargs):
        kernels = getattr(xp, "kernels", None)
        if kernels is not None and not kwargs and len(args) == required:
            return getattr(kernels, name)(*args)
        return fn(xp, *args, **kwargs)

    call.reference = fn  # the readable function itself (the kernels' tests compare with it)
    return call

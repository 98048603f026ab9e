"""Parameter initialisers.  They run on the host with a seeded ``numpy.random.Generator`` and return
NumPy arrays, which the layers then move to their backend: the same seed gives the same weights on
NumPy, CuPy and PyTorch."""
from __future__ import annotations

import numpy as np


def uniform_fan_in(rng: np.random.Generator, shape, fan_in: int, gain: float = 1.0):
    """W ~ U(-a, a) with a = gain * sqrt(3 / fan_in) (unit-variance outputs for unit inputs when
    gain=1; gain=sqrt(2) is He's for ReLU layers); bias ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)),
    PyTorch's default."""
    a = gain * np.sqrt(3.0 / fan_in)
    W = rng.uniform(-a, a, size=shape)
    bound = 1.0 / np.sqrt(fan_in)
    b = rng.uniform(-bound, bound, size=shape[-1])
    return W, b


def he_uniform(rng, shape, fan_in):
    return uniform_fan_in(rng, shape, fan_in, gain=np.sqrt(2.0))


def given(default, std=None, bias=None):
    """``default`` (an initialiser of (W, b), as uniform_fan_in), with W drawn N(0, std^2) instead
    when ``std`` is given and b set to the constant ``bias`` when that is: the paper's published code
    starts its convolutions so (std 0.05 or 0.1, biases 0.1).  ``default`` draws first either way, so
    that a layer left at its defaults draws what it always drew."""
    if std is None and bias is None:
        return default

    def init(rng, shape, fan_in):
        W, b = default(rng, shape, fan_in)
        if std is not None:
            W = rng.normal(0.0, std, size=shape)
        return W, (b if bias is None else np.full(shape[-1], float(bias)))
    return init


def capsule_transform(rng: np.random.Generator, shape, std: float = 0.01):
    """The routing transforms W_ij ~ N(0, std^2), as in common CapsNet implementations."""
    return rng.normal(0.0, std, size=shape)


def routed_std(children: int, parents: int, dim: int) -> float:
    """A routing transform's std for which a layer's first weighted sum s_j = (1/J) sum_i W_ij u_i has
    about the length of its inputs u_i (children i: I, parents j: J, output dims: D): each of the D
    components of s_j is a sum of I terms of std std*|u|, divided by J, so std = J / sqrt(I D) makes
    |s_j| ~ |u_i|.  Capsules then keep a usable length through a stack of routing layers, where a
    small init shrinks them quadratically at every layer (squash(s) ~ s|s| for small s): 0.01, the
    paper's choice for its one routing layer, leaves the second of two at lengths ~1e-11."""
    return parents / float(np.sqrt(children * dim))

"""A routing layer's coefficients, and the gradient that flows into them, as the study tools, the
routing study's diagnostics and ``pycapsnet inspect`` read them (one implementation below all three)."""
from __future__ import annotations

import numpy as np

from pycapsnet import backends

from ..arrays import labels
from ..core import architecture
from .routing_checks import coupling_grads


def coefficients(layer) -> list:
    """A routing layer's coefficients per iteration: c_ij (dynamic, attention, ConvCaps) or, for a
    convolutional EM layer, its assignments R_ij."""
    return layer.coupling if hasattr(type(layer), "coupling") else layer.assignments


def float64_copy(net):
    """(the network on NumPy in float64 with the same weights, whether it is a copy)."""
    if net.B.name == "numpy" and net.B.dtype == "float64":
        return net, False
    copy = architecture.build(net.architecture, backends.get("numpy", dtype="float64"))
    copy.load_state_dict(net.state_dict())
    return copy, True


def grads(net, xa, y, batch_size) -> dict:
    """{layer: [dL_n/dc per iteration, or None for a constant]} of images ``xa`` with labels ``y``, on
    a float64 copy of ``net``, ``batch_size`` images at a time (routing_checks.coupling_grads)."""
    ya = labels(y, len(xa), net.n_classes)
    copy, _ = float64_copy(net)
    parts = {}
    with copy.evaluating():  # the coefficients as evaluation routes, the loss with the label mask
        for start in range(0, len(xa), batch_size):
            sl = slice(start, start + batch_size)
            for name, g in coupling_grads(copy, xa[sl].astype(np.float64), ya[sl]).items():
                parts.setdefault(name, []).append(g)
    return {name: [None if blocks[0][r] is None else np.concatenate([b[r] for b in blocks])
                   for r in range(len(blocks[0]))] for name, blocks in parts.items()}

"""Finite-difference checks of the routings of routings.py beyond dynamic routing -- uniform and
random coupling, inverted dot-product attention, self-routing, variational Bayes -- in the fully
connected layer (per position and shared) and the convolutional one, in each gradient mode the
routing has, with their heads (CapsuleLogits, LayerNorm, the NLL loss); and compositions that
stack them under and over dynamic routing.  gradcheck.py registers them under each routing's name.
"""
from __future__ import annotations

import numpy as np

from ..core import architecture as arch
from ..core.capsules import CapsuleLogits, ClassCaps
from ..core.conv_caps import ConvCaps
from ..core.layer_norm import LayerNorm
from ..core.losses import NegativeLogLikelihood
from ..core import routings
from .finite_diff import _LossLayer, check_layer

ROUTED = ("uniform", "random", "inverted", "self", "vb")


def _away(B, layer, rng):
    """Parameters away from their init (zero routing maps, unit γ): where some terms vanish."""
    for k, p in layer.params.items():
        base = 1.0 if k == "gamma" else 0.0
        p[...] = B.asarray(base + 0.5 * rng.standard_normal(tuple(p.shape)))
    return layer


def routing_layer_checks(routing, B, samples=20, eps=1e-5, tol=1e-6, seed=0):
    """The routing in ClassCaps (per position, shared, after another routing layer) and ConvCaps
    (3x3 windows at strides 1 and 2), in each of its gradient modes; its head's parts."""
    rng = np.random.default_rng(seed + 5)
    r = lambda *shape: rng.standard_normal(shape)
    results = []

    def add(label, layer, x):
        results.extend(check_layer(B, label, layer, x, samples, eps, tol, seed))

    own = routings.get(routing)
    for mode in own.modes if own.iterated else ("full",):
        for share in (False, True):
            cc = ClassCaps(B, positions=4, types=2, in_dim=4, n_classes=3, out_dim=5, routing=routing,
                           routing_grad=mode, share_spatial=share, rng=rng)
            add(f"ClassCaps {routing} routing={mode}{' shared' if share else ''}", _away(B, cc, rng), 0.5 * r(3, 4, 2, 4))
        after = ClassCaps(B, positions=1, types=4, in_dim=5, n_classes=3, out_dim=6, routing=routing, routing_grad=mode,
                          rng=rng)
        add(f"ClassCaps {routing} after routing, routing={mode}", _away(B, after, rng), 0.5 * r(3, 4, 5))
        for k, s in ((3, 1), (3, 2)):
            conv = ConvCaps(B, (5, 5), 2, 3, 3, 4, kernel=k, stride=s, routing=routing, routing_grad=mode, rng=rng)
            add(f"ConvCaps {routing} {k}x{k}/{s} routing={mode}", _away(B, conv, rng), 0.5 * r(2, 25, 2, 3))
    if routing == "inverted":
        add("LayerNorm capsules", _away(B, LayerNorm(B, 5), rng), r(3, 4, 5))
        add("LayerNorm features", _away(B, LayerNorm(B, 6), rng), 2 + r(4, 6))
        add("CapsuleLogits", CapsuleLogits(B, 5, rng=rng), r(3, 4, 5))
    if routing == "self":
        onehot = B.asarray(np.eye(4)[rng.integers(0, 4, 5)])
        scores = rng.dirichlet(np.ones(4), 5)  # scores that sum to 1, as self-routing's activations do
        add("NegativeLogLikelihood", _LossLayer(NegativeLogLikelihood(B), onehot), scores)
    return results


def routing_compositions(mode="full"):
    """Networks that stack the routings with each other and with dynamic routing, at a size for
    float64 checks: self-routing (convolutional, then fully connected) under a dynamic class layer;
    inverted attention with its paper's head and a layer norm between capsule layers; VB routing
    over convolutional VB capsules; random coupling under uniform coupling."""
    stem = [arch.conv2d(6, 3, name="conv1"), arch.relu(name="relu1"), arch.primary_caps(2, 4, 3, 2, name="primary")]
    small = dict(decoder=arch.decoder((8, 12)), input_shape=(1, 13, 13), n_classes=3)
    iterated = dict(routing_grad=mode)
    return {
        "self under dynamic": arch.network(stem + [
            arch.conv_caps(3, 4, 3, 1, routing="self", name="convcaps"),
            arch.dynamic_caps(4, 5, routing="self", name="caps1"),
            arch.dynamic_caps(3, 6, routing_grad=mode, name="classcaps")], **small),
        f"inverted with its head routing={mode}": arch.network(stem + [
            arch.conv_caps(3, 4, 3, 1, routing="inverted", **iterated, name="convcaps"), arch.layer_norm(name="norm"),
            arch.dynamic_caps(3, 6, routing="inverted", **iterated, name="classcaps"),
            arch.capsule_logits(name="logits")], head="logits", decoder=None, input_shape=(1, 13, 13), n_classes=3),
        f"vb over vb routing={mode}": arch.network(stem + [
            arch.conv_caps(3, 4, 3, 1, routing="vb", **iterated, name="convcaps"),
            arch.dynamic_caps(3, 6, routing="vb", **iterated, name="classcaps")], **small),
        "random then uniform coupling": arch.network(stem + [
            arch.dynamic_caps(4, 5, routing="random", share_spatial=True, name="caps1"),
            arch.dynamic_caps(3, 6, routing="uniform", name="classcaps")], **small),
    }

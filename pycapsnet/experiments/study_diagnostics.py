"""What the routing study measures of a trained network on the test digits, in its one test pass:

    wrong         which test digits it gets wrong (the per-digit paired tests read them)
    entropy       of each routing iteration's coefficients, per child over the parents, in units of
                  ln J (1: uniform), averaged over children and the first DIAGNOSTIC_DIGITS digits: Paik,
                  Kwak & Kim 2019's measure of polarisation
    dynamics      how much each iteration's coefficients vary from input to input: the mean over
                  digits and children of the total variation distance ½ Σ_j |c_nij - c̄_ij| from their
                  mean over the digits (0: the same coupling for every input, as Mitterreiter et al.,
                  AAAI 2023, found dynamic routing's nearly is)
    own           the routing's own measures per iteration (Routing.measures: a sparse routing's
                  support, a gated one's gates), on the same digits as entropy and dynamics
    starvation    the share of the routing layer's child capsules (and of its parents) that never
                  activate on any test digit: a child whose length (EM: activation) never exceeds
                  CHILD_ACTIVE, a class capsule whose length never exceeds PARENT_ACTIVE (Mitterreiter
                  et al.; Everett et al. 2023's vanishing activations); parents' not where the class
                  scores are logits or a distribution over the classes (self routing's)

Coefficients that are no distribution over the parents have no entropy or distance here: attention
routing's c_ij + β_ij (β is a learned, unnormalised bias), whose softmax part c_ij is measured
instead, the record says so.
"""
from __future__ import annotations

import math

import numpy as np

from ..core import routing_calls
from ..tools import coupling
from .study_protocol import CHILD_ACTIVE, DIAGNOSTIC_DIGITS, PARENT_ACTIVE


def entropy(c) -> float:
    """Mean over digits and children of -Σ_j c_ij ln c_ij / ln J:  c (n, I, J), rows summing to 1."""
    c = np.clip(np.asarray(c, np.float64), 1e-300, 1)
    return float(np.mean(-np.sum(c * np.log(c), axis=-1)) / math.log(c.shape[-1]))


def dynamics(c) -> float:
    """Mean over digits and children of ½ Σ_j |c_nij - mean_n c_nij|:  c (n, I, J)."""
    c = np.asarray(c, np.float64)
    return float(np.mean(0.5 * np.sum(np.abs(c - c.mean(axis=0, keepdims=True)), axis=-1)))


def distributions(layer) -> tuple:
    """(each iteration's coefficients as (n, I, J) distributions over the parents, a note or None)."""
    cs = [np.array(layer.B.to_numpy(c)) for c in coupling.coefficients(layer)]
    cs = [c.reshape(-1, *c.shape[-2:]) for c in cs]  # a convolutional layer's positions: more problems
    if all(np.allclose(c.sum(axis=-1), 1, atol=1e-3) and c.min() >= -1e-6 for c in cs):
        return cs, None
    algo = getattr(layer, "algo", None)
    if getattr(algo, "name", None) == "attention":  # ĉ = c + β: the trace keeps the softmax c
        return [np.array(layer.B.to_numpy(c)).transpose(0, 2, 1) for c in layer.traced(1)], (
            "attention: of c_ij, its softmax; c_ij + β_ij is no distribution (β is a learned bias, "
            "neither positive nor normalised)")
    return None, "its coefficients are no distribution over the parents"


class TestPass:
    """One pass over the test digits: predictions, and the last routing layer's measures."""

    def __init__(self, model):
        self.model = model
        self.name, self.layer = model.routing_layers()[-1] if model.routing_layers() else (None, None)
        self.wrong, self.coupling, self.note = [], None, None
        self.own, self.own_seen = {}, 0  # the routing's own measures (Routing.measures), summed over images
        self.child_max = self.parent_max = None
        # starved parents: only for scores that are lengths or activations of their own, not logits, and
        # not scores that form a distribution over the classes (self routing's, under its NLL: they sum
        # to 1, so a class below PARENT_ACTIVE is no inactive capsule)
        self.parents_thresholded = getattr(model.head, "name", None) != "logits" and type(model.head).__name__ != "LogitsHead" \
            and getattr(getattr(model, "class_loss", None), "name", None) != "nll"

    def run(self, x, y, batch=100):
        layer = self.layer
        seen = {}
        if layer is not None:
            real = type(layer).forward

            def spy(u):
                seen["u"] = u
                return real(layer, u)

            layer.forward = spy
        parts = []
        try:
            with self.model.evaluating():
                for a in range(0, len(y), batch):
                    out = self.model.forward(x[a:a + batch], reconstruct=False)
                    scores = np.array(self.model.B.to_numpy(out.lengths))
                    self.wrong.append(np.argmax(scores, axis=1) != y[a:a + batch])
                    if layer is not None:
                        self._children(seen.pop("u"))
                        self._parents(scores)
                        if a < DIAGNOSTIC_DIGITS:
                            cs, self.note = distributions(layer)
                            if cs is not None:
                                parts.append(cs)
                            self._own(layer, len(y[a:a + batch]))
                    self.model.release()
        finally:
            if layer is not None:
                del layer.forward
        self.wrong = np.concatenate(self.wrong)
        if parts:
            self.coupling = [np.concatenate([p[r] for p in parts]) for r in range(len(parts[0]))]
        return self

    def _own(self, layer, n):
        routing_calls.add_measures(self.own, layer.routing_measures() if hasattr(layer, "routing_measures") else {}, n)
        self.own_seen += n

    def _children(self, u):
        B = self.model.B
        if isinstance(u, tuple):  # matrix capsules: (poses, activations)
            size = np.array(B.to_numpy(u[1]))
        else:
            u = np.array(B.to_numpy(u))
            size = np.sqrt(np.sum(u * u, axis=-1))
        size = size.reshape(len(size), -1).max(axis=0)
        self.child_max = size if self.child_max is None else np.maximum(self.child_max, size)

    def _parents(self, scores):
        top = scores.max(axis=0)
        self.parent_max = top if self.parent_max is None else np.maximum(self.parent_max, top)

    def measures(self) -> dict:
        if self.layer is None:
            return {"entropy": None, "dynamics": None, "starved_children": None, "starved_parents": None,
                    "note": "no routing layer (a CNN)"}
        ent = None if self.coupling is None else [entropy(c) for c in self.coupling]
        dyn = None if self.coupling is None else [dynamics(c) for c in self.coupling]
        own = routing_calls.mean_measures(self.own, self.own_seen)
        return {"entropy": ent, "dynamics": dyn, "own": own,
                "starved_children": float(np.mean(self.child_max <= CHILD_ACTIVE)),
                "starved_parents": float(np.mean(self.parent_max <= PARENT_ACTIVE)) if self.parents_thresholded else None,
                "note": self.note}

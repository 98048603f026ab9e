"""The routings a vector capsule layer can run: one name each, a registry line each.

    dynamic    Sabour et al. 2017, routing.py (the layers' own path, with its blocks and shared form)
    uniform    c_ij = 1/J, one pass: no routing at all (Paik, Kwak & Kim 2019's baseline)
    random     c_ij = softmax_j of N(0, 1) logits drawn for every sample from the layer's seeded
               generator, one pass, held constant in backward (Paik et al.'s other baseline)
    inverted   inverted dot-product attention, Tsai et al. 2020 (inverted_routing.py)
    self       self-routing, Hahn et al. 2019 (self_routing.py)
    vb         variational Bayes routing, Ribeiro et al. 2020 (vb_routing.py)

``dynamic``, ``uniform`` and ``random`` are dynamic routing's code with its coefficients given or
fixed; the others are an ``Algorithm`` here: its own parameters, a forward on the votes û (I, n, J, D)
(and, for those that read them, the child capsules u (I, n, K)), and an exact backward that returns
dû, its parameters' gradients and du.  ClassCaps (fully connected) and ConvCaps (one routing per
window) run any of them unchanged: the batch axis n is the samples, or the samples' windows.
"""
from __future__ import annotations

import numpy as np

from . import inverted_routing, self_routing, vb_routing
from .routing import MODES

ROUTINGS = ("dynamic", "uniform", "random", "inverted", "self", "vb")
ITERATED = ("dynamic", "inverted", "vb")        # take ``iters``; the others route in one pass
GRADIENT_MODES = {"dynamic": ("full", "final"), "inverted": ("full", "final"), "vb": ("full", "final"),
                  "self": ("full",), "uniform": ("full", "final"), "random": ("full", "final")}
DEFAULT_ITERS = 3
# Options that belong to one routing, with their defaults (description.py checks their values).
# VB's vb_lambda, the activation's inverse temperature: at 1, the margin loss's push on the nine absent
# classes saturates every class's sigmoid within the first steps and the paper's network stays at
# chance on the embedded digits; at 0.1 it trains (docs/performance.md, "The routing family").
OPTIONS = {"inverted": {"scaled": True},
           "vb": {"alpha0": 1.0, "kappa0": 1.0, "psi0": 1.0, "nu0": None, "vb_lambda": 0.1}}


def options_for(routing: str, given: dict, dim: int) -> dict:
    """``routing``'s options, the given ones over its defaults; ValueError naming an option that
    belongs to another routing, or a VB prior that leaves the Wishart improper (ν0 ≤ D - 1)."""
    own = OPTIONS.get(routing, {})
    stray = sorted(k for k, v in given.items() if v is not None and k not in own)
    if stray:
        owners = {k: r for r, opts in OPTIONS.items() for k in opts}
        raise ValueError(", ".join(f"{k} is an option of routing '{owners[k]}'" for k in stray)
                         + f", not of '{routing}'")
    values = {k: (given.get(k) if given.get(k) is not None else v) for k, v in own.items()}
    if routing == "vb":
        values["nu0"] = float(dim + 1) if values["nu0"] is None else float(values["nu0"])
        if values["nu0"] <= dim - 1:
            raise ValueError(f"nu0 must be above dim - 1 = {dim - 1} (the Wishart's degrees of freedom), "
                             f"got {values['nu0']:g}")
    return values


class Algorithm:
    """A routing with parameters of its own.  ``reads_children``: it reads the child capsules u
    (poses and, by their length, activations), not only their votes."""
    reads_children = False
    per_child = ()  # parameters with one entry per child slot (leading axes the layer lays out)

    def __init__(self, iters, mode, options):
        self.iters, self.mode, self.options = iters, mode, options

    def coupling(self, trace) -> list:  # pragma: no cover - interface
        raise NotImplementedError


class Inverted(Algorithm):
    def params(self, lead, J, D, K) -> dict:
        return {"gamma": np.ones(D), "beta": np.zeros(D)}  # the layer norm's affine, shared by the parents

    def forward(self, B, u_hat, p, u, fixed=None):
        return inverted_routing.inverted_forward(B, u_hat, p["gamma"], p["beta"], self.iters,
                                                 self.options["scaled"], fixed)

    def backward(self, B, u_hat, u, trace, dv, p):
        du_hat, grads = inverted_routing.inverted_backward(B, u_hat, trace, dv, p["gamma"], self.mode,
                                                           self.options["scaled"])
        return du_hat, grads, None

    def coupling(self, trace):
        return inverted_routing.inverted_coupling(trace)


class SelfRouting(Algorithm):
    reads_children = True
    per_child = ("W_route", "b_route")

    def params(self, lead, J, D, K) -> dict:
        return {"W_route": np.zeros((*lead, J, K)), "b_route": np.zeros((*lead, J))}  # zero, as the paper's

    def forward(self, B, u_hat, p, u, fixed=None):
        return self_routing.self_forward(B, u_hat, u, p["W_route"], p["b_route"])

    def backward(self, B, u_hat, u, trace, dv, p):
        return self_routing.self_backward(B, u_hat, u, trace, dv, p["W_route"])

    def coupling(self, trace):
        return self_routing.self_coupling(trace)


class VB(Algorithm):
    reads_children = True

    def params(self, lead, J, D, K) -> dict:
        return {"beta_a": np.zeros(J), "beta_u": np.zeros(J)}

    def forward(self, B, u_hat, p, u, fixed=None):
        a_in = self_routing.child_activations(B.xp, u)
        return vb_routing.vb_forward(B, u_hat, a_in, p["beta_a"], p["beta_u"], self.iters, self.options, fixed)

    def backward(self, B, u_hat, u, trace, dv, p):
        xp = B.xp
        a_in = self_routing.child_activations(xp, u)
        du_hat, grads, da = vb_routing.vb_backward(B, u_hat, a_in, trace, dv, p["beta_a"], p["beta_u"],
                                                   self.options, self.mode)
        size = xp.sqrt(xp.sum(u * u, axis=-1, keepdims=True))   # a_i = |u_i|
        du = xp.where(size > 0, u * (xp.matrix_transpose(da)[..., None] / xp.where(size > 0, size, 1)), 0)
        return du_hat, grads, du

    def coupling(self, trace):
        return vb_routing.vb_coupling(trace)


ALGORITHMS = {"inverted": Inverted, "self": SelfRouting, "vb": VB}


def algorithm(routing, iters, mode, options):
    """The Algorithm of ``routing`` (None for dynamic routing's own three)."""
    return ALGORITHMS[routing](iters, mode, options) if routing in ALGORITHMS else None


def random_coupling(B, rng, n, J, I):
    """c (n, J, I): softmax over j of N(0, 1) logits, drawn on the host (every backend the same)."""
    z = rng.standard_normal((n, J, I))
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return B.asarray(e / e.sum(axis=1, keepdims=True))


def set_routing(layer, routing, iters, routing_grad, options, rng, lead):
    """A routed layer's routing (routings.py): its name, iterations, gradient mode, the Algorithm and
    its parameters (``lead``: the leading axes of its per-child parameters), or for "random" its own
    seeded generator.  ValueError (which the description names the layer in) for what it cannot run."""
    if routing not in ROUTINGS:
        raise ValueError(f"unknown routing {routing!r}: use one of {', '.join(ROUTINGS)}")
    if routing_grad not in MODES:
        raise ValueError(f"unknown routing gradient mode {routing_grad!r}: use one of {MODES}")
    if routing_grad not in GRADIENT_MODES[routing]:
        raise ValueError(f"routing '{routing}' has no gradient mode {routing_grad!r}: its coefficients are "
                         "learned from the child alone, so holding them constant would stop that; use 'full'")
    if iters is None:
        iters = DEFAULT_ITERS if routing in ITERATED else 1
    if iters < 1:
        raise ValueError(f"routing needs at least one iteration, got {iters}")
    if routing not in ITERATED and iters != 1:
        raise ValueError(f"routing '{routing}' routes in one pass; it takes no iters (got {iters})")
    layer.routing, layer.iters, layer.routing_grad = routing, iters, routing_grad
    layer.algo = algorithm(routing, iters, routing_grad, options_for(routing, options, layer.D))
    if layer.algo is not None:
        for k, v in layer.algo.params(lead, layer.J, layer.D, layer.K).items():
            layer._add_param(k, v)
    if routing == "random":
        layer.rng, layer.hold, layer.drawn = np.random.default_rng(int(rng.integers(2**63))), False, None
        layer.capturable = False  # new coefficients every step: a recorded step would replay the old


def draw_coupling(layer, n, children):
    """The coefficients of "random" routing for a batch: drawn anew, or the last ones where the layer
    holds them (a gradient check perturbs the input under one draw, as Dropout's mask)."""
    if layer.hold and layer.drawn is not None and tuple(layer.drawn.shape) == (n, layer.J, children):
        return layer.drawn
    return random_coupling(layer.B, layer.rng, n, layer.J, children)

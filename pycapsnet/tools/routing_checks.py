"""Checking a routing, built-in or your own (pycapsnet.routings), three ways, each a list of rows
(``study.check_routing`` and ``pycapsnet check-routing`` run them all):
    finite_differences   fourth-order finite differences (float64) of the routing in a fully connected
                         and a convolutional capsule layer, in each gradient mode it has
                         (gradcheck_routings.routing_layer_checks)
    across_backends      one layer, the same weights and input, on NumPy and on PyTorch (float64): its
                         output and every gradient
    autograd_reference   the routing's own forward run on the torch backend under autograd
                         (backends.autograd_reference), differentiated by PyTorch, against its
                         hand-written backward -- no second implementation: this checks the backward
                         against the forward, not the forward against the paper

and the coupling coefficients' gradient dL/dc_ij of every iteration (``coupling_grads``), which
autograd reads off the same differentiable forward: what flows back into routing.
"""
from __future__ import annotations

import numpy as np

from pycapsnet import backends

from .gradcheck_routings import routing_layer_checks
from ..core import init, routing_calls, routings
from ..core.capsules import ClassCaps
from ..errors import CapsNetError

# The problem the routing is checked on: I children of K dims voting for J parents of D dims, n samples
SIZES = dict(I=6, n=3, J=3, D=4, K=3)
TOLERANCE = {"across_backends": 1e-10, "autograd_reference": 1e-7}  # relative to each tensor's largest entry
# autograd's: PyTorch differentiates ψ by its own polygamma(1, x), off by up to 5e-10 relatively (capsule_ops.py's
# trigamma), which VB routing's gradients carry


def _row(check, what, tensor, mine, ref, tol) -> dict:
    mine, ref = np.asarray(mine, np.float64), np.asarray(ref, np.float64)
    if mine.shape != ref.shape:
        return {"check": check, "what": what, "tensor": tensor, "max_abs": np.inf, "max_rel": np.inf, "agree": False,
                "note": f"shape {mine.shape}, reference {ref.shape}"}
    diff = float(np.abs(mine - ref).max(initial=0))
    rel = diff / (float(np.abs(ref).max(initial=0)) or 1.0)
    return {"check": check, "what": what, "tensor": tensor, "max_abs": diff, "max_rel": rel, "agree": rel <= tol}


def _modes(name) -> tuple:
    own = routings.get(name)
    return own.modes if own.iterated else ("full",)


def finite_differences(name, samples=12, tol=1e-6, seed=0) -> list:
    """Finite differences of the routing's layers (fully connected, shared, after another routing
    layer, convolutional at strides 1 and 2), float64, each gradient mode."""
    B = backends.get("numpy", dtype="float64")
    return [{"check": "finite differences", "what": c.layer, "tensor": c.tensor, "max_abs": c.max_abs,
             "max_rel": c.max_rel, "agree": c.passed,
             "points": f"{c.n_checked} entries" + (f", {c.kinks} beside a kink left out" if c.kinks else "")
             + f"; errors below {c.rounding:.0e} are rounding"}
            for c in routing_layer_checks(name, B, samples, 1e-5, tol, seed)]


def layer(name, children, capsules, dim, backend="numpy", dtype="float64", seed=0, iters=None, routing_grad="full",
          init_std=None, **options):
    """A routing layer on capsules: u (N, I, K) -> v (N, J, D), routed by ``name`` (ClassCaps with one
    position).  ``children`` (I, K): the child capsules' count and size."""
    I, K = children
    std = init.routed_std(I, capsules, dim) if init_std is None else init_std
    return ClassCaps(backends.get(backend, dtype=dtype), positions=1, types=I, in_dim=K, n_classes=capsules,
                     out_dim=dim, iters=iters, routing_grad=routing_grad, rng=np.random.default_rng(seed),
                     init_std=std, routing=name, **options)


def _away(layer, rng):
    """The layer's parameters moved away from their initial values (zeros, ones): where some terms vanish."""
    for p in layer.params.values():
        p[...] = layer.B.asarray(layer.B.to_numpy(p) + 0.3 * rng.standard_normal(tuple(p.shape)))
    return layer


def across_backends(name, seed=0, other="torch") -> list:
    """One layer of the routing on NumPy and on ``other`` (float64), the same weights and input:
    v, dL/du and every parameter's gradient for L = Σ v * R, each gradient mode."""
    rows = []
    rng = np.random.default_rng(seed)
    I, n, J, D, K = (SIZES[k] for k in "InJDK")
    u = 0.5 * rng.standard_normal((n, I, K))
    R = rng.standard_normal((n, J, D))
    for mode in _modes(name):
        results = []
        for spec in ("numpy", other):
            lay = layer(name, (I, K), J, D, backend=spec, seed=seed, routing_grad=mode)
            _away(lay, np.random.default_rng(seed + 1))
            B = lay.B
            v = lay.forward(B.asarray(u))
            du = lay.backward(B.asarray(R))
            results.append({"v": B.to_numpy(v), "dL/du": B.to_numpy(du),
                            **{f"dL/d{k}": B.to_numpy(g) for k, g in lay.grads.items()}})
        for k in results[0]:
            rows.append(_row(f"numpy vs {other}", f"{name} routing={mode}", k, results[1][k], results[0][k],
                             TOLERANCE["across_backends"]))
    return rows


def _problem(name, mode, seed):
    """(routing instance, û, u, p, dv, fixed) on the host, float64: a random problem of SIZES."""
    own = routings.get(name)
    rng = np.random.default_rng(seed)
    I, n, J, D, K = (SIZES[k] for k in "InJDK")
    algo = own(routings.DEFAULT_ITERS if own.iterated else 1, mode, routings.options_for(name, {}, D))
    p = {k: v + 0.3 * rng.standard_normal(v.shape) for k, v in routings.routing_params(algo, (I,), J, D, K).items()}
    u = 0.5 * rng.standard_normal((I, n, K))
    u_hat = 0.5 * rng.standard_normal((I, n, J, D))
    dv = rng.standard_normal((n, J, D))
    return algo, u_hat, u, p, dv


def autograd_reference(name, seed=0) -> list:
    """The routing's hand-written backward against PyTorch's autograd of its own forward (float64),
    in each gradient mode: "final" is the gradient with the last coefficients given as constants,
    as the mode defines it; a routing that draws gets one draw, as constants."""
    torch = _torch()
    B = backends.get("numpy", dtype="float64")
    A = backends.autograd_reference("float64")
    rows = []
    for mode in _modes(name):
        algo, u_hat, u, p, dv = _problem(name, mode, seed)
        kids = u if algo.reads_children else None
        fixed = algo.draw(B, np.random.default_rng(seed + 3), u_hat.shape[1], u_hat.shape[2], u_hat.shape[0]) \
            if algo.draws else None
        v, trace = routing_calls.run_forward(algo, B, u_hat, p, kids, fixed)
        if mode == "final" and fixed is None:
            fixed = np.asarray(algo.coupling(trace)[-1])
        du_hat, grads, du = algo.backward(B, u_hat, kids, trace, dv, p)
        leaf = lambda a: torch.tensor(np.asarray(a), dtype=torch.float64, requires_grad=True)  # noqa: E731
        t_hat, t_p = leaf(u_hat), {k: leaf(a) for k, a in p.items()}
        t_kids = leaf(u) if kids is not None else None
        t_fixed = None if fixed is None else torch.tensor(np.asarray(fixed))
        with torch.enable_grad():
            tv, _ = algo.forward(A, t_hat, t_p, t_kids, t_fixed)
            (tv * torch.tensor(dv)).sum().backward()
        what = f"{name} routing={mode}"
        rows.append(_row("autograd", what, "v", v, tv.detach().numpy(), TOLERANCE["autograd_reference"]))
        rows.append(_row("autograd", what, "dL/dû", du_hat, _grad(t_hat), TOLERANCE["autograd_reference"]))
        for k in p:
            rows.append(_row("autograd", what, f"dL/d{k}", grads.get(k, np.zeros_like(p[k])), _grad(t_p[k]),
                             TOLERANCE["autograd_reference"]))
        if kids is not None:
            rows.append(_row("autograd", what, "dL/du", np.zeros_like(u) if du is None else du, _grad(t_kids),
                             TOLERANCE["autograd_reference"]))
    return rows


def _grad(t):
    return np.zeros(tuple(t.shape)) if t.grad is None else t.grad.numpy()


def _torch():
    try:
        import torch
    except ImportError:
        raise CapsNetError("the autograd reference and dL/dc are PyTorch's: pip install torch") from None
    return torch


def check(name, samples=12, tol=1e-6, seed=0) -> list:
    """Every check of routing ``name``: finite differences, numpy against torch, autograd."""
    return finite_differences(name, samples, tol, seed) + across_backends(name, seed) + autograd_reference(name, seed)


# ---- dL/dc --------------------------------------------------------------------------------------------
def coupling_grads(net, x, y) -> dict:
    """{routing layer: [dL_n/dc (each iteration's coefficients' gradient, for each image's own loss),
    in the layout ``coupling`` gives, or None where the coefficients are constants of the forward]}:
    the network's loss and backward run by hand (float64), and, at each routing layer, the routing's
    forward again on the torch backend under autograd with the votes it saw, differentiated against
    the gradient that reached the layer.  The full gradient, whatever mode the layer trains in."""
    torch = _torch()
    seen = {}
    layers = dict(net.routing_layers())
    spied = [name for name, lay in layers.items() if getattr(lay, "algo", None) is not None]
    shared = {name: getattr(layers[name], "routes_shared", False) for name in spied}
    for name in spied:
        _spy(layers[name], name, seen)
    try:
        net.zero_grad()
        net.loss(x, y)
        net.backward()
    finally:
        for name in spied:
            layers[name].__dict__.pop("backward", None)
            layers[name].routes_shared = shared[name]
    A = backends.autograd_reference("float64")
    n = len(y)
    out = {}
    for name in spied:
        lay = layers[name]
        u_hat, kids, dv, p, fixed = seen[name]
        leaf = lambda a: torch.tensor(np.asarray(a), dtype=torch.float64)  # noqa: E731
        algo = type(lay.algo)(lay.algo.iters, "full", lay.algo.options)
        with torch.enable_grad():
            # û, the routing's parameters and the children all require grad: a coefficient that does
            # not (a constant of the forward) has nothing flowing through it
            v, trace = algo.forward(A, leaf(u_hat).requires_grad_(), {k: leaf(a).requires_grad_() for k, a in p.items()},
                                    None if kids is None else leaf(kids).requires_grad_(),
                                    None if fixed is None else leaf(fixed))
            cs = algo.coupling(trace)
            for c in cs:
                if c.requires_grad:
                    c.retain_grad()
            (v * leaf(dv)).sum().backward()
        out[name] = [None if c.grad is None else lay.coupling_layout(c.grad.numpy() * n) for c in cs]
    return out


def _spy(lay, name, seen):
    """Keep, at the layer's backward, what its routing saw: û, the children, dL/dv, its parameters."""
    lay.routes_shared = False  # dynamic routing's shared form forms no û: the same math with û formed
    B = lay.B
    cls_backward = type(lay).backward

    def backward(dv, input_grad=True):
        ut, u_hat, *rest = lay.cache
        kids = rest[-1] if rest else None
        host = lambda a: None if a is None else np.array(B.to_numpy(a))  # noqa: E731
        dv_r = B.xp.reshape(dv, (-1, lay.J, lay.D))
        seen[name] = (host(u_hat), host(kids), host(dv_r), {k: host(a) for k, a in lay.routing_param_values().items()},
                      host(getattr(lay, "drawn", None)) if lay.algo.draws else None)
        return cls_backward(lay, dv, input_grad)

    lay.backward = backward

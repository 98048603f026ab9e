"""Finite-difference gradient checks: the machinery (one tensor, one layer); the suites that run it
over every layer and network are in gradcheck.py.

Fourth-order central differences

    n = (L(w - 2h) - 8 L(w - h) + 8 L(w + h) - L(w + 2h)) / (12 h)

against the hand-written gradient a, at sampled entries of each tensor (all entries of small ones).
In float64 with h = 1e-5 the truncation error (O(h^4)) is negligible and the rounding error of an
O(1) loss is about 1e-11; the plain two-point quotient would need h ~ 1e-6 and round to ~1e-10.
The error of an entry is

    rel = |a - n| / max(|a|, |n|, floor)

so below ``floor`` (default 1e-4) an entry is held to an absolute error of ``tol * floor``: the
relative error of an entry whose gradient is 1e-9 would measure rounding, not the backward.

Rounding of a large loss.  A layer's check sums thousands of outputs, each rounded to about
eps_mach |y|, so the loss carries rounding of about eps_mach ||y||_2 and the quotient about
eps_mach ||y||_2 / h: 1e-9 for a 64-channel convolution's output, more than 1e-6 of its smaller
input gradients.  The quotient at h/4 carries four times the quotient at h's rounding and 1/256 of
its truncation, so |n(h) - n(h/4)| measures the rounding there is, about four times the quotient's
own.  Its median over the tensor's entries (off the kinks below), m, is the tensor's: an entry's
error is counted beyond 2 m (about five times the quotient's rounding), and the two quotients may
disagree by 5 m more before an entry is taken for a kink.  A wrong backward, off by more than the
differences can resolve, still fails.

Kinks.  ReLU and the margin loss are not differentiable everywhere; when a perturbation of +-2h
crosses a kink the difference quotient is wrong, not the backward.  Every entry is therefore
differenced at h and at h/4: a smooth function gives the same quotient at both (to rounding), a wrong
backward disagrees with both alike, and an entry whose two quotients disagree by more than the
check's own tolerance straddles a kink.  Such entries are counted in ``Check.kinks`` and left out; a tensor
whose sampled entries all straddle kinks fails.

The "final" routing-gradient mode is the exact gradient of the routing with the last coupling
coefficients c_ij (EM: the last assignments R_ij) held fixed, so its checks perturb that function
(``_freeze_final_coupling``).
Used by the test suite and by ``pycapsnet gradcheck``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ..core import shared_routing
from ..core.capsules import ClassCaps
from ..core.em_routing import em_forward
from ..core.matrix_capsules import EMLayer


@dataclass
class Check:
    layer: str
    tensor: str
    max_abs: float
    max_rel: float
    n_checked: int
    tol: float
    kinks: int  # sampled entries left out because the loss has a kink within +-2h
    rounding: float  # the quotients' own rounding: errors below it are not counted (docstring)
    beyond: float  # max relative error beyond ``rounding``: what must stay below tol

    @property
    def passed(self) -> bool:
        return bool(self.n_checked > 0 and self.beyond < self.tol)


def _entries(size: int, k: int, rng) -> np.ndarray:
    return np.arange(size) if size <= k else np.sort(rng.choice(size, k, replace=False))


def compare(analytic: np.ndarray, numeric: np.ndarray, floor: float, rounding: float = 0.0):
    """(max |a - n|, max relative error, max relative error beyond ``rounding``)."""
    a, n = np.asarray(analytic, float).ravel(), np.asarray(numeric, float).ravel()
    err = np.abs(a - n)
    scale = np.maximum(np.maximum(np.abs(a), np.abs(n)), floor)
    return float(err.max(initial=0)), float((err / scale).max(initial=0)), \
        float((np.maximum(err - rounding, 0) / scale).max(initial=0))


def finite_difference(B, loss_fn, arr, idx, eps):
    """Fourth-order central differences of loss_fn() w.r.t. entries ``idx`` of backend array
    ``arr`` (perturbed in place through a flat view, then restored), and whether each entry sits
    on a kink (a ReLU input at exactly 0, a maximum tied with another), where the central
    difference is the mean of two one-sided slopes and no gradient exists.  The second differences
    tell: d(h) = f(x + h) - 2 f(x) + f(x - h) grows as h^2 where f is smooth (d(2h) = 4 d(h)) and
    as h at a kink (d(2h) = 2 d(h)), whatever the scale of f."""
    flat = B.xp.reshape(arr, (-1,))
    out, kink = np.empty(len(idx)), np.zeros(len(idx), bool)
    for k, i in enumerate(idx):
        i = int(i)
        orig = float(B.to_numpy(flat[i]))
        f = {0: loss_fn()}
        for step in (-2, -1, 1, 2):
            flat[i] = orig + step * eps
            f[step] = loss_fn()
        flat[i] = orig
        out[k] = (f[-2] - 8 * f[-1] + 8 * f[1] - f[2]) / (12 * eps)
        d1, d2 = f[1] - 2 * f[0] + f[-1], f[2] - 2 * f[0] + f[-2]
        kink[k] = abs(d1) > 1e-12 * max(1.0, abs(f[0])) and abs(d2) < 3 * abs(d1)
    return out, kink


def check_tensors(B, label, loss_fn, tensors, analytic, samples=20, eps=1e-5, tol=1e-6, floor=1e-4, seed=0):
    """One Check per named tensor: ``tensors[name]`` is perturbed, ``analytic[name]`` is its gradient."""
    rng = np.random.default_rng(seed)
    results = []
    for name, arr in tensors.items():
        a = B.to_numpy(analytic[name]).ravel()
        idx = _entries(a.size, samples, rng)
        num, kink = finite_difference(B, loss_fn, arr, idx, eps)
        fine, _ = finite_difference(B, loss_fn, arr, idx, eps / 4)
        noise = float(np.median(np.abs(num - fine)[~kink])) if (~kink).any() else 0.0  # rounding (docstring)
        smooth = np.abs(num - fine) <= tol * np.maximum(np.maximum(np.abs(num), np.abs(fine)), floor) + 5 * noise
        smooth &= ~kink
        max_abs, max_rel, beyond = compare(a[idx][smooth], num[smooth], floor, 2 * noise)
        results.append(Check(label, name, max_abs, max_rel, int(smooth.sum()), tol, int((~smooth).sum()),
                             2 * noise, beyond))
    return results


def _freeze_final_coupling(layer):
    """In "final" mode, hold the last coupling coefficients fixed for the perturbed evaluations:
    this instance's routing method is replaced by one that routes with c^{R-1} given (the
    routings' ``fixed_coupling`` / ``fixed_assignments``), the function whose exact gradient that
    mode computes.  The layer classes themselves know nothing of it."""
    algo = getattr(layer, "algo", None)
    if getattr(layer, "routing_grad", None) != "final" or getattr(algo, "draws", False):
        return  # a drawing routing: its drawn coefficients are held as Dropout's mask is (_hold_mask)
    B = layer.B
    if isinstance(layer, ClassCaps) and layer.share_spatial and layer.routes_shared:
        c = layer.shared_coupling(-1)
        layer.route_shared = lambda ut, W: shared_routing.forward(B, ut, W, layer.iters, ut.shape[2],
                                                                  fixed_coupling=c, bias=layer.bias_j)
    elif algo is not None:  # a routing of routings.py: it takes the last coefficients given
        layer.route = functools.partial(type(layer).route, layer, fixed=layer.last_coefficients())
    elif isinstance(layer, EMLayer):
        R = layer.assignments[-1]  # R^{T-1}: what "final" holds constant
        layer.route_part = lambda V, a_in, beta_a, group, sl: em_forward(
            B, V, a_in, layer.params["beta_u"], beta_a, layer.lambdas, layer.eps, group,
            fixed_assignments=R[sl], var_eps=layer.var_eps)


def _hold_mask(layer):
    """A Dropout keeps the mask it drew for the perturbed evaluations: the function whose gradient
    its backward computes is the one under that mask."""
    if hasattr(layer, "hold"):
        layer.hold = True


# ---- single layers ------------------------------------------------------------------------------
def _parts(y):
    """A layer's input or output as a tuple: matrix capsule layers pass (poses, activations) pairs."""
    return tuple(y) if isinstance(y, (tuple, list)) else (y,)


def _scalar(B, y, R):
    return sum(float(B.to_numpy(B.xp.sum(a * r))) for a, r in zip(_parts(y), R))


def check_layer(B, label, layer, x_host, samples=20, eps=1e-5, tol=1e-6, seed=0):
    """L = sum(layer(x) * R) for a fixed random R; checks dL/dx and dL/d(every parameter).  x_host
    and the output may be tuples of arrays (a matrix capsule layer's (M, a)); R is then one per part."""
    rng = np.random.default_rng(seed + 1)
    tuple_in = isinstance(x_host, tuple)
    # C-ordered: finite_difference perturbs through a flat view, which a reshape of a permuted
    # array (a layer's output handed on as its input here) would make a copy of
    xs = tuple(B.asarray(np.ascontiguousarray(a)) for a in _parts(x_host))
    x = xs if tuple_in else xs[0]
    y = layer.forward(x)
    R = tuple(B.asarray(rng.standard_normal(tuple(a.shape))) for a in _parts(y))
    _freeze_final_coupling(layer)
    _hold_mask(layer)
    layer.zero_grad()
    dx = _parts(layer.backward(R if isinstance(y, tuple) else R[0]))
    names = [f"input{k}" if tuple_in else "input" for k in range(len(xs))]
    tensors, analytic = dict(zip(names, xs)), dict(zip(names, dx))
    for k, p in layer.params.items():
        tensors[k], analytic[k] = p, layer.grads[k]
    return check_tensors(B, label, lambda: _scalar(B, layer.forward(x), R), tensors, analytic,
                         samples, eps, tol, seed=seed)


class _FunctionLayer:
    """Wraps a (forward, backward) pair of plain functions as a parameterless layer."""

    def __init__(self, fwd, bwd):
        self.fwd, self.bwd, self.params, self.grads = fwd, bwd, {}, {}

    def forward(self, x):
        self.x = x
        return self.fwd(x)

    def backward(self, dy):
        return self.bwd(self.x, dy)

    def zero_grad(self):
        pass


class _LossLayer:
    """A loss (forward(pred, target) -> scalar; backward() -> dpred) as a layer of pred."""

    def __init__(self, loss, target):
        self.loss, self.target, self.params, self.grads = loss, target, {}, {}

    def forward(self, x):
        return self.loss.forward(x, self.target)

    def backward(self, dy):
        return self.loss.backward() * dy

    def zero_grad(self):
        pass

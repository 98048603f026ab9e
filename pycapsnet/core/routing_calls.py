"""A routing's methods as the layers call them, with what each returns checked on every call: one
line naming the routing and the method for what breaks the contract (routing_contract.Routing), the
backend's own errors (out of memory, a refused host copy) as they are.  A routing that is not built in
is also checked for NaN or inf made from finite inputs, outside a recorded step; the built-in ones
are checked by the tests and keep their speed."""
from __future__ import annotations

import math

from .. import errors
from ..errors import CapsNetError, printable as _shown
from .routings import is_builtin


def run_forward(algo, B, u_hat, p, u, fixed):
    """``algo.forward`` with what it returns checked: (v (n, J, D), trace)."""
    try:
        out = algo.forward(B, u_hat, p, u, fixed)
    except Exception as e:
        raise _failed(algo, "forward", e, B) from e
    _, n, J, D = u_hat.shape
    shape = tuple(getattr(out[0], "shape", ())) if isinstance(out, tuple) and len(out) == 2 else None
    if shape != (n, J, D):
        got = f"v of shape {shape}" if shape is not None else f"{type(out).__name__}"
        raise CapsNetError(f"routing '{algo.name}': forward must return (v, trace) with v of shape (n, J, D) = "
                           f"{(n, J, D)}, got {got}; check it with `pycapsnet check-routing {algo.name}`")
    if out[0].dtype != u_hat.dtype:
        raise CapsNetError(f"routing '{algo.name}': forward returned v of dtype {out[0].dtype}, not û's {u_hat.dtype}; "
                           f"check it with `pycapsnet check-routing {algo.name}`")
    if _watched(algo, B, (u_hat, u)):
        _finite_from_finite(algo, B, "forward", (out[0],))
    return out


def _watched(algo, B, inputs) -> bool:
    """Whether to check what ``algo`` makes for NaN or inf: a routing not built in (the built-in ones
    are checked by the tests, and keep their speed), outside a recorded step, on finite inputs."""
    return not is_builtin(algo.name) and B.may_read_back() and all(a is None or B.all_finite(a) for a in inputs)


def _finite_from_finite(algo, B, what, outputs) -> None:
    """Name the routing, and the pass, that made NaN or inf from finite inputs where it happens."""
    if not all(a is None or B.all_finite(a) for a in outputs):
        options = f" (its options: {_shown(algo.options)})" if algo.options else ""
        raise errors.RoutingNotFinite(f"routing '{algo.name}' made NaN or inf in its {what} from finite inputs"
                                      f"{options}", f"check it with `pycapsnet check-routing {algo.name}`")


def run_backward(algo, B, u_hat, u, trace, dv, p, out):
    """``algo.backward_into`` with what it returns checked: dL/dû written into ``out``, (the
    parameters' gradients, dL/du or None)."""
    watched = _watched(algo, B, (u_hat, u, dv))  # (before: out may be û's own memory)
    try:
        grads, du = algo.backward_into(B, u_hat, u, trace, dv, p, out)
    except Exception as e:
        raise _failed(algo, "backward", e, B) from e
    if not isinstance(grads, dict):
        raise CapsNetError(f"routing '{algo.name}': backward must return its parameters' gradients as a dict "
                           f"({{name: array}}, {{}} if it has none), got {_shown(type(grads).__name__)}; check it with "
                           f"`pycapsnet check-routing {algo.name}`")
    wrong = [k for k, g in grads.items() if k not in p or tuple(getattr(g, "shape", ())) != tuple(p[k].shape)
             or getattr(g, "dtype", None) != p[k].dtype]
    if wrong or (du is not None and (u is None or tuple(du.shape) != tuple(u.shape) or du.dtype != u.dtype)):
        what = f"a gradient {wrong[0]!r} that is no parameter of its, or of another shape or dtype" if wrong else \
            "du, but it reads no child capsules" if u is None else \
            f"du of shape {tuple(du.shape)} and dtype {du.dtype}, not u's {tuple(u.shape)} {u.dtype}"
        raise CapsNetError(f"routing '{algo.name}': backward returned {what}; check it with "
                           f"`pycapsnet check-routing {algo.name}`")
    if watched:
        _finite_from_finite(algo, B, "backward", (out, du, *grads.values()))
    return grads, du


def run_coupling(algo, trace, n, J) -> list:
    """``algo.coupling(trace)`` checked: a list of each iteration's coefficients, (n, J, I) arrays
    (``n`` None: any)."""
    try:
        found = algo.coupling(trace)
    except Exception as e:
        raise _failed(algo, "coupling", e, None) from e
    ok = isinstance(found, (list, tuple)) and len(found) > 0 and all(
        len(getattr(c, "shape", ())) == 3 and c.shape[1] == J and n in (None, c.shape[0]) for c in found)
    if not ok:
        got = f"{type(found).__name__} of {len(found)}" if isinstance(found, (list, tuple)) else type(found).__name__
        raise CapsNetError(f"routing '{algo.name}': coupling() must return a list of each iteration's coefficients, "
                           f"arrays (n, J, I) with J = {J}, got {_shown(got)}; check it with "
                           f"`pycapsnet check-routing {algo.name}`")
    return list(found)


def run_measures(algo, B, trace) -> dict:
    """``algo.measures(B, trace)`` checked: {name: [a finite number per iteration]}."""
    try:
        found = algo.measures(B, trace)
    except Exception as e:
        raise _failed(algo, "measures", e, None) from e
    try:
        out = {k: [float(x) for x in v] for k, v in found.items() if isinstance(k, str) and isinstance(v, (list, tuple))}
        ok = len(out) == len(found) and all(math.isfinite(x) for v in out.values() for x in v)
    except (TypeError, ValueError, AttributeError):
        ok = False
    if not ok:
        raise CapsNetError(f"routing '{algo.name}': measures() must return {{name: [a finite number per iteration]}}, "
                           f"got {_shown(type(found).__name__)}; check it with `pycapsnet check-routing {algo.name}`")
    return out


def add_measures(sums: dict, own: dict, n: int) -> None:
    """Add a routing's measures ``own`` ({name: [per iteration]}) of ``n`` samples into the running
    ``sums``: their mean over every sample is the sums over the samples counted (``mean_measures``)."""
    for k, v in own.items():
        sums[k] = [t + n * u for t, u in zip(sums.get(k, [0.0] * len(v)), v)]


def mean_measures(sums: dict, n: int) -> dict:
    """The measures ``add_measures`` summed over ``n`` samples, as means."""
    return {k: [t / n for t in v] for k, v in sums.items()}


def _failed(algo, what, e, B):
    """The error a routing's failure becomes: the backend's own (out of memory, a refused host copy)
    as it is, anything else one line naming the routing and how to check it."""
    if isinstance(e, (MemoryError, CapsNetError, errors.BackendError)) or B is not None and B.out_of_memory(e):
        return e
    return CapsNetError(f"routing '{algo.name}' failed in its {what} ({type(e).__name__}: {_shown(errors.first_line(e))}); "
                        f"check it with `pycapsnet check-routing {algo.name}`")

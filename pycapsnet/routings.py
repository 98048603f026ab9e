"""Your own routing: the contract, the registry, the building blocks, and the checks.

    import pycapsnet.routings as R

    @R.register
    class MaxMin(R.Routing):
        name, iterated, modes = "maxmin", True, ("full",)
        options = {"floor": 0.0}
        def forward(self, B, u_hat, p, u, fixed=None): ...     # -> (v (n, J, D), trace)
        def backward(self, B, u_hat, u, trace, dv, p): ...    # -> (dû, {param: grad}, du or None)
        def coupling(self, trace): ...                          # -> [c (n, J, I) per iteration]

    R.check("maxmin")                           # finite differences, numpy vs torch, autograd of its forward
    layer = R.layer("maxmin", children=(32, 8), capsules=10, dim=16)   # u (N, 32, 8) -> v (N, 10, 16)
    pycapsnet.build("maxmin")                   # the paper's network routed by it; descriptions: routing="maxmin"

``Routing`` (pycapsnet/core/routing_contract.py) says what each method takes and returns, and what
``trace`` and ``fixed`` are; docs/architecture.md, "Routings", and the tutorial
docs/tutorials/4-your-own-routing.ipynb derive and check one from start to end.  On the command line
``--plugin MODULE`` imports a module that registers routings (every command takes it), and installed
packages declare theirs in the entry-point group ``pycapsnet.routings``.  A checkpoint records each
routing's name and module: loading it without the routing registered is refused, naming the module.

The building blocks, importable from here:

    squash(xp, s) -> (v, |s|)                 v = |s|²/(1 + |s|²) s/|s|;  squash_backward(xp, s, |s|, dv) -> ds
    softmax(xp, b, axis=1) -> c               softmax_backward(xp, c, dc, axis=1) -> db

and the backend's operations a routing computes with (``B``, the first argument of forward and
backward; shapes: û (I, n, J, D), c (n, J, I), s and v (n, J, D)):
    B.xp                                      the Array API namespace: xp.sum, xp.exp, xp.permute_dims, ...
    B.weighted_sum(c, u_hat)                  s_j = Σ_i c_ij û_j|i                      -> (n, J, D)
    B.agreement(u_hat, v)                     a_ij = û_j|i . v_j                        -> (n, J, I)
    B.outer_sum([c, ...], [v, ...])           dû_j|i = Σ_q c^q_ij v^q_j                 -> (I, n, J, D)
    B.matmul(a, b)                            batched matrix products (the last two axes)
    B.zeros(shape), B.empty(shape)            new arrays on the device, in the backend's dtype
    B.asarray(a), B.arange(start, stop)       host values onto the device (not inside forward on a GPU,
                                              where a step is recorded: make constants with B.arange, B.zeros)
    B.contiguous(x)                           x in C order (before a reshape of a permuted array)
    B.digamma(x), B.trigamma(x)               ψ and ψ', elementwise

Each has one plain form (backends/capsule_ops.py) and faster ones where a backend has them; the autograd
reference runs the plain ones.
"""
from __future__ import annotations

from . import arguments as a
from .backends.host import machine_memory
from .core.routing import MODES, softmax, softmax_backward
from .core.routing_contract import Routing
from .core.routings import DEFAULT_ITERS, get, is_builtin, module_of, names, register
from .core.squash import squash, squash_backward
from .errors import CapsNetError
from .study import check_routing
from .tools.routing_checks import layer as make

__all__ = ["Routing", "register", "get", "names", "is_builtin", "module_of", "DEFAULT_ITERS", "layer", "check",
           "squash", "squash_backward", "softmax", "softmax_backward"]


def layer(name, children, capsules, dim, backend="numpy", dtype="float32", seed=0, iters=None, routing_grad="full",
          init_std=None, **options):
    """A routing layer on capsules, routed by ``name``: u (N, I, K) -> v (N, J, D), with
    ``children`` = (I, K), ``capsules`` J and ``dim`` D (ClassCaps with one position; its transforms
    W_ij start at ``init_std``, or init.routed_std).  forward(u), backward(dv) -> du, params, grads.
    Every argument is checked first: one CapsNetError naming it, and nothing allocated."""
    if not isinstance(name, str):
        raise CapsNetError(f"name must be a registered routing's name (a str), got {a.shown(name)}")
    get(name)
    if not a.is_sequence(children, 2):
        raise CapsNetError(f"children must be (I, K): the number of child capsules and their dimensions, such as "
                           f"(32, 8), got {a.shown(children)}")
    I, K = (a.whole(v, f"children[{k}] ({w})", least=1) for k, (v, w) in
            enumerate(zip(children, ("I, the child capsules", "K, their dimensions"))))
    J, D = a.whole(capsules, "capsules", least=1), a.whole(dim, "dim", least=1)
    seed, iters = a.whole(seed, "seed"), a.whole(iters, "iters", least=1, none=True)
    init_std = a.real(init_std, "init_std", lo=0, open_lo=True, none=True)
    need, have = I * J * D * K * 8 * 3, machine_memory()  # W_ij, its gradient and the float64 draw it starts from
    if have and need > have // 2:
        raise CapsNetError(f"children {tuple(children)}, capsules {J} and dim {D} need W_ij of {I * J * D * K:,} "
                           f"numbers ({need / 2**30:.1f} GiB with its gradient), more than half this machine's "
                           f"{have / 2**30:.1f} GiB: give fewer or smaller capsules")
    try:
        return make(name, (I, K), J, D, backend, dtype, seed, iters, a.choice(routing_grad, "routing_grad", MODES),
                    init_std, **options)
    except CapsNetError:
        raise
    except (ValueError, TypeError) as e:
        raise CapsNetError(f"routings.layer({name!r}): {e}") from None


def check(name, samples: int = 12, tol: float = 1e-6, seed: int = 0):
    """study.check_routing: finite differences of its layers (float64), NumPy against PyTorch, and
    its hand-written backward against PyTorch's autograd of its own forward."""
    return check_routing(name, samples, tol, seed)

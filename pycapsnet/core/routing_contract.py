"""The contract a routing algorithm meets: ``Routing``, the class every routing subclasses, the
built-in ones and a researcher's own alike (``pycapsnet.routings.register`` makes one usable
everywhere: docs/architecture.md, "Routings").

A routing turns the votes of I child capsules for J parents into the J parent capsules, for each of
n problems at once (the samples of a batch, or a batch's windows in a convolutional layer):

    u_hat   û_j|i  (I, n, J, D)   the votes, W_ij u_i, made by the layer (ClassCaps, ConvCaps)
    u       u_i    (I, n, K)      the child capsules themselves, given where ``reads_children``
    p       {name: array}         the routing's own parameters (``params``), as the layer holds them
    v       v_j    (n, J, D)      the parent capsules
    c       c_ij   (n, J, I)      coupling coefficients, child i's share of parent j (``coupling``)

The layer forms û, lays out the routing's parameters, routes (on blocks of the batch, each its own
call: a routing must treat the n problems independently), and turns dL/dû back into dL/dW and dL/du.
What a routing writes is its forward and its exact backward:

    forward(B, u_hat, p, u, fixed=None) -> (v, trace)
        ``trace``: whatever backward needs (and ``coupling`` reads), kept by the layer until backward.
        ``fixed`` (n, J, I) or None: the coefficients to use in the last iteration instead of
        computing them.  The mode "final" differentiates routing as if they were constants, and a
        gradient check of that mode perturbs the function with them given; a routing that ``draws``
        gets its drawn coefficients here.
    backward(B, u_hat, u, trace, dv, p) -> (du_hat, grads, du)
        dv = dL/dv (n, J, D) -> dL/dû (I, n, J, D), {name: dL/dp[name]} summed over the n problems,
        and dL/du (I, n, K) where the routing reads u (else None).  ``self.mode`` says which
        gradient: "full" (through every iteration) or "final" (the last coefficients constant).
    coupling(trace) -> [c (n, J, I) per iteration]
    params(lead, J, D, K) -> {name: host NumPy array}: the parameters' initial values.  A parameter
        named in ``per_child`` has one entry per child slot: its shape starts with ``lead`` (the
        layer's leading axes of W), and forward and backward see it as (I, ...).

Arrays are the backend's: compute with ``B.xp`` (the Array API namespace) and the backend's named
operations (``B.weighted_sum``, ``B.agreement``, ``B.outer_sum``: pycapsnet.routings lists them), so
that one routing runs on NumPy, CuPy and PyTorch unchanged, and under PyTorch's autograd for the
automatic check of its backward.
"""
from __future__ import annotations

from ..errors import CapsNetError


class Routing:
    """A routing algorithm.  Subclass it, set the class attributes, write the four methods; the
    base class keeps ``iters``, ``mode`` and ``options`` (the declared options, checked, with their
    defaults filled in) on each instance, which a layer makes once when it is built.

    Class attributes:
        name            the name descriptions, ``build`` and ``--routing`` use
        iterated        whether it takes ``iters`` (routing iterations); else it routes in one pass
        modes           the gradient modes its backward implements: ("full",) or ("full", "final")
        options         {option: default} of its own settings (numbers, booleans, strings, None)
        reads_children  whether forward reads the child capsules u (not only their votes)
        per_child       the parameters with one entry per child slot (``params``)
        head            (head, loss) of the paper's network routed by it: ("lengths", "margin") is the
                        CapsNet's; ("logits", "cross_entropy") adds a shared linear map and drops the decoder
        transform_std   the std of the paper's network's transforms W (None: init.routed_std, which keeps
                        capsule lengths from layer to layer)
        symbol          how pictures name its coefficients ("c_ij"; VB's responsibilities "R_ij")
    Capabilities of built-in ones (a routing of your own leaves them False):
        takes_bias      the layer's ``bias`` option adds a learned β_j to every s_j, given as p["bias"]
        draws           forward's coefficients are drawn, by ``draw``, from the layer's own generator
        routes_shared   with share_spatial, the layer may route without forming û (shared_routing.py)
    """

    name: str = None
    iterated: bool = False
    modes: tuple = ("full",)
    options: dict = {}
    reads_children: bool = False
    per_child: tuple = ()
    head: tuple = ("lengths", "margin")
    transform_std: float | None = 0.01
    symbol: str = "c_ij"
    takes_bias = draws = routes_shared = False

    def __init__(self, iters: int, mode: str, options: dict):
        self.iters, self.mode, self.options = iters, mode, options

    def check_options(self, options: dict, D: int) -> dict | None:
        """Refuse values the declared types allow but the routing does not (ValueError, one line);
        return the options with any value that depends on D filled in, or None to keep them."""
        return None

    def params(self, lead: tuple, J: int, D: int, K: int) -> dict:
        return {}

    def forward(self, B, u_hat, p, u, fixed=None):  # pragma: no cover - interface
        raise NotImplementedError

    def backward(self, B, u_hat, u, trace, dv, p):  # pragma: no cover - interface
        raise NotImplementedError

    def coupling(self, trace) -> list:  # pragma: no cover - interface
        raise NotImplementedError

    def measures(self, B, trace) -> dict:
        """Optional: measures of the routing's own from a forward's ``trace``, {name: [a number per
        iteration]}, each a mean over the samples (sparsemax: the support's size per child; a gated
        routing: its gates' spread).  The routing study's table and figure, ``pycapsnet inspect`` and
        ``study.measures`` report them beside the coupling's entropy and dynamics."""
        return {}

    def backward_into(self, B, u_hat, u, trace, dv, p, out):
        """backward with dL/dû written into ``out`` (the layer passes û's own memory, whose last use
        this is): (grads, du).  A routing whose backward can write there directly overrides it."""
        du_hat, grads, du = self.backward(B, u_hat, u, trace, dv, p)
        if tuple(getattr(du_hat, "shape", ())) != tuple(out.shape) or getattr(du_hat, "dtype", None) != out.dtype:
            # (out[...] = would broadcast a smaller one silently, and cast another dtype)
            raise CapsNetError(f"routing '{self.name}': backward must return dû of û's shape (I, n, J, D) = "
                               f"{tuple(out.shape)} {out.dtype}, got {getattr(du_hat, 'shape', type(du_hat).__name__)} "
                               f"{getattr(du_hat, 'dtype', '')}; check it "
                               f"with `pycapsnet check-routing {self.name}`")
        out[...] = du_hat
        return grads, du

    def draw(self, B, rng, n: int, J: int, I: int):  # pragma: no cover - the drawing routings' own
        raise NotImplementedError

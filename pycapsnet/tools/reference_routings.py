"""The routings beyond dynamic routing written again in PyTorch, for autograd to differentiate: the
independent oracle of their hand-written backwards (tests/test_routings.py).  Each is written
from its paper's equations as a reader would write it -- votes as (N, I, J, D), einsum sums,
torch.nn.functional's layer_norm, ψ as torch.digamma with SciPy's ψ' as its derivative -- sharing no code with
pycapsnet/core.  Needs PyTorch; never part of the library's training path.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from scipy import special


class _Digamma(torch.autograd.Function):
    """ψ(x), whose derivative is SciPy's trigamma: PyTorch's own polygamma(1, x) is off by up to 5e-10
    relatively, more than an oracle may be."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.digamma(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * torch.as_tensor(special.polygamma(1, x.detach().cpu().numpy()), dtype=x.dtype, device=x.device)


_digamma = _Digamma.apply


def votes(W, u):
    """û (N, I, J, D) from W (I, J, D, K) and u (N, I, K)."""
    return torch.einsum("ijdk,nik->nijd", W, u)


def uniform_route(u_hat):
    """c_ij = 1/J: v_j = squash(mean over j's share)."""
    return squash(u_hat.sum(1) / u_hat.shape[2])


def fixed_route(u_hat, c):
    """c (N, I, J) given: v_j = squash(Σ_i c_ij û_j|i)."""
    return squash(torch.einsum("nij,nijd->njd", c, u_hat))


def squash(s):
    n2 = (s * s).sum(-1, keepdim=True)
    return s * n2.sqrt() / (1 + n2)


def inverted_route(u_hat, gamma, beta, iters, scaled=True, eps=1e-5, final=False):
    """Tsai et al. 2020: p^0 from uniform coefficients, then r = softmax_j(p . û / √D) and
    p = LayerNorm(Σ_i r û) per pass.  ``final``: the last pass's coefficients detached."""
    n, i, j, d = u_hat.shape
    k = 1 / math.sqrt(d) if scaled else 1.0
    r, p = torch.full((n, i, j), 1.0 / j, dtype=u_hat.dtype), None
    for t in range(iters):
        if t > 0:
            r = torch.softmax(k * torch.einsum("njd,nijd->nij", p, u_hat), dim=2)
        if final and t == iters - 1:
            r = r.detach()
        p = F.layer_norm(torch.einsum("nij,nijd->njd", r, u_hat), (d,), gamma, beta, eps)
    return p


def self_route(u_hat, u, W_r, b_r):
    """Hahn et al. 2019 with a_i = |u_i|: r = softmax_j(W^r u + b^r); a_j = Σ a r / Σ a; v = a_j μ_j / |μ_j|."""
    r = torch.softmax(torch.einsum("ijk,nik->nij", W_r, u) + b_r, dim=2)
    a = u.norm(dim=-1)                                       # (N, I)
    ar = a[..., None] * r
    mu = torch.einsum("nij,nijd->njd", ar / ar.sum(1, keepdim=True), u_hat)
    a_out = ar.sum(1) / a.sum(1, keepdim=True)
    return a_out[..., None] * mu / mu.norm(dim=-1, keepdim=True)


def vb_route(u_hat, a, beta_a, beta_u, iters, alpha0=1.0, kappa0=1.0, psi0=1.0, nu0=None, lam=0.1, final=False):
    """Ribeiro et al. 2020, diagonal covariance, m0 = 0, as vb_routing.py's docstring states it.
    ``final``: the responsibilities of the last M-step detached."""
    n, i, j, d = u_hat.shape
    nu0 = d + 1.0 if nu0 is None else nu0
    R = torch.full((n, i, j), 1.0 / j, dtype=u_hat.dtype)
    for t in range(iters):
        if final and t == iters - 1:
            R = R.detach()
        Rt = R * a[..., None]
        Nj = Rt.sum(1)                                                        # (N, J)
        mean = torch.einsum("nij,nijd->njd", Rt, u_hat) / Nj[..., None]
        kappa, nu, alpha = kappa0 + Nj, nu0 + Nj, alpha0 + Nj
        m = (Nj / kappa)[..., None] * mean
        S = torch.einsum("nij,nijd->njd", Rt, (u_hat - mean[:, None]) ** 2)
        P = 1 / psi0 + S + (kappa0 * Nj / kappa)[..., None] * mean ** 2
        dims = torch.arange(1, d + 1, dtype=u_hat.dtype)
        eln_lam = _digamma((nu[..., None] + 1 - dims) / 2).sum(-1) + d * math.log(2) - torch.log(P).sum(-1)
        eln_pi = _digamma(alpha) - _digamma(alpha.sum(1, keepdim=True))
        if t < iters - 1:
            Q = d / kappa[:, None] + nu[:, None] * (((u_hat - m[:, None]) ** 2) / P[:, None]).sum(-1)
            R = torch.softmax(eln_pi[:, None] + eln_lam[:, None] / 2 - Q / 2, dim=2)
    H = d / 2 * math.log(2 * math.pi * math.e) - eln_lam / 2
    a_out = torch.sigmoid(lam * (beta_a - (beta_u + torch.exp(eln_pi) * H)))
    return a_out[..., None] * m / m.norm(dim=-1, keepdim=True)


def route(routing, u_hat, u, params, iters, options, fixed=None, final=False):
    """The routing of ``routing`` on û (N, I, J, D) with the child poses u (N, I, K); ``final``:
    the last coefficients held constant (detached)."""
    if routing == "uniform":
        return uniform_route(u_hat)
    if routing == "random":
        return fixed_route(u_hat, fixed)
    if routing == "inverted":
        return inverted_route(u_hat, params["gamma"], params["beta"], iters, options.get("scaled", True), final=final)
    if routing == "self":
        return self_route(u_hat, u, params["W_route"], params["b_route"])
    if routing == "vb":
        opts = {k: v for k, v in options.items() if v is not None}
        lam = opts.pop("vb_lambda", 0.1)
        return vb_route(u_hat, u.norm(dim=-1), params["beta_a"], params["beta_u"], iters, lam=lam, final=final, **opts)
    raise ValueError(f"no reference for routing {routing!r}")

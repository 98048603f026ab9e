"""A PyTorch-autograd CapsNet of the same architecture -- the *reference*, never the library's
training path: the first thing to compare the hand-written backward with.  Needs PyTorch (this
module is not imported by ``import pycapsnet``).

Written the way readable_capsnet writes one: nn-style convolutions (F.conv2d, NCHW) and an einsum
routing loop, with every gradient left to autograd.  It reads pycapsnet's parameters (same names,
same layouts: conv weights (kh, kw, C_in, C_out), W_ij (P|1, T, J, D, K)), so the tests use it as an
independent oracle for the hand-written backward, and the benchmark compares speed and memory with
identical weights and batches.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def squash(s, dim=-1):
    n2 = (s * s).sum(dim, keepdim=True)
    # the same exact form as pycapsnet (finite at 0); autograd differentiates sqrt at n2 > 0
    return s * (n2.sqrt() / (1 + n2))


class AutogradCapsNet:
    """Functional CapsNet over a dict of leaf tensors ``params`` (requires_grad=True)."""

    def __init__(self, config, params: dict, device="cpu", dtype=torch.float32):
        self.cfg = config
        self.params = {k: torch.as_tensor(np.asarray(v), dtype=dtype, device=device).requires_grad_(True)
                       for k, v in params.items()}
        self.device, self.dtype = device, dtype

    @classmethod
    def from_model(cls, model, device="cpu", dtype=torch.float32):
        return cls(model.config, model.state_dict(), device, dtype)

    def parameters(self):
        return list(self.params.values())

    def forward(self, x, y=None):
        """x (N, C, H, W); y labels or None.  Returns (v, lengths, reconstruction)."""
        cfg, p = self.cfg, self.params
        conv = lambda t, name, stride: F.conv2d(t, p[name + ".W"].permute(3, 2, 0, 1), p[name + ".b"], stride=stride)
        h = F.relu(conv(x, "conv1", 1))
        s = conv(h, "primary", cfg.primary_stride)                    # (N, T*K, H2, W2)
        n = s.shape[0]
        s = s.permute(0, 2, 3, 1).reshape(n, -1, cfg.primary_types, cfg.primary_dim)  # (N, P, T, K)
        u = squash(s)
        W = p["classcaps.W"]                                          # (P|1, T, J, D, K)
        u_hat = torch.einsum("ptjdk,nptk->nptjd", W, u).reshape(n, -1, cfg.n_classes, cfg.class_dim)
        v = self.route(u_hat)
        lengths = v.norm(dim=-1)
        chosen = y if y is not None else lengths.argmax(1)
        mask = F.one_hot(chosen, cfg.n_classes).to(v.dtype)
        z = (v * mask[..., None]).reshape(n, -1)
        n_dec = len(cfg.decoder_hidden) + 1
        for k in range(1, n_dec + 1):
            z = z @ p[f"decoder{k}.W"] + p[f"decoder{k}.b"]
            z = F.relu(z) if k < n_dec else torch.sigmoid(z)
        return v, lengths, z.reshape(n, *cfg.input_shape)

    def route(self, u_hat):
        """Dynamic routing on û (N, I, J, D); 'final' detaches everything but the last weighted sum."""
        cfg = self.cfg
        detach = cfg.routing_grad == "final"
        u_for_b = u_hat.detach() if detach else u_hat
        b = torch.zeros(u_hat.shape[:3], dtype=u_hat.dtype, device=u_hat.device)
        for r in range(cfg.routing_iters):
            c = torch.softmax(b, dim=2)
            if r == cfg.routing_iters - 1:
                return squash(torch.einsum("nij,nijd->njd", c.detach() if detach else c, u_hat))
            v = squash(torch.einsum("nij,nijd->njd", c, u_for_b))
            b = b + torch.einsum("nijd,njd->nij", u_for_b, v)

    def loss(self, x, y):
        cfg = self.cfg
        v, lengths, recon = self.forward(x, y)
        t = F.one_hot(y, cfg.n_classes).to(lengths.dtype)
        margin = (t * F.relu(cfg.m_plus - lengths) ** 2
                  + cfg.lam * (1 - t) * F.relu(lengths - cfg.m_minus) ** 2).sum(1).mean()
        rec = cfg.recon_weight * ((recon - x) ** 2).sum() / x.shape[0]
        return margin + rec, margin, rec

    def grads(self, x, y, input_grad=False):
        """Loss and d(loss)/d(every parameter) [and d/dx] by autograd, as host NumPy arrays."""
        for t in self.params.values():
            t.grad = None
        x = torch.as_tensor(np.asarray(x), dtype=self.dtype, device=self.device).requires_grad_(input_grad)
        y = torch.as_tensor(np.asarray(y), dtype=torch.int64, device=self.device)
        total, _, _ = self.loss(x, y)
        total.backward()
        g = {k: t.grad.detach().cpu().numpy() for k, t in self.params.items()}
        if input_grad:
            g["input"] = x.grad.detach().cpu().numpy()
        return float(total.detach()), g

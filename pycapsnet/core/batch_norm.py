"""Batch normalisation (Ioffe & Szegedy 2015) over every axis but the last: the N, H, W of a
channels-last image (N, H, W, C), or the N of features (N, F) -- one mean and variance per channel.

Training mode normalises by the batch's own statistics, over the m = N*H*W values of a channel:

    μ = (1/m) Σ x,   σ² = (1/m) Σ (x - μ)²,   x̂ = (x - μ) / √(σ² + ε),   y = γ x̂ + β

and moves the running statistics towards them (PyTorch's convention: the variance unbiased):

    running_mean ← (1 - momentum) running_mean + momentum μ
    running_var  ← (1 - momentum) running_var  + momentum σ² m / (m - 1)

Evaluation mode uses the running statistics instead, so that y is a fixed affine map of x.

Backward.  dβ = Σ dy and dγ = Σ dy x̂ either way.  In evaluation mode dx = dy γ / √(σ²_run + ε).
In training mode μ and σ² depend on every x of the channel.  With r = 1/√(σ² + ε),
∂x̂_k/∂x_l = r (δ_kl - 1/m - x̂_k x̂_l / m), so

    dx = γ r (dy - mean(dy) - x̂ mean(dy x̂))  =  γ r (dy - (dβ + x̂ dγ) / m)

with the batch's own sums dβ and dγ (before they are added to the parameters' gradients).

The running statistics are state, not parameters: ``buffers``, which checkpoints save and restore
and which Adam never sees.  A data-parallel run normalises each process's batch by its own
statistics (as PyTorch's BatchNorm does without SyncBatchNorm) and averages the running statistics
over the processes at the end of every epoch (distributed.average_buffers), so every process -- and
the checkpoint -- holds the same.
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import CapsNetError
from .layers import Layer, check_input


class BatchNorm(Layer):
    """y = γ (x - μ) / √(σ² + ε) + β per channel (the last axis); see the module's docstring."""

    def __init__(self, backend, channels, momentum=0.1, eps=1e-5):
        super().__init__(backend)
        if not 0 <= momentum <= 1:
            raise ValueError(f"momentum must be in [0, 1], got {momentum!r}")
        if not eps > 0:
            raise ValueError(f"eps must be above 0, got {eps!r}")
        self.channels, self.momentum, self.eps = channels, momentum, eps
        self._add_param("gamma", np.ones(channels))
        self._add_param("beta", np.zeros(channels))
        self.buffers = {"running_mean": backend.asarray(np.zeros(channels)),
                        "running_var": backend.asarray(np.ones(channels))}

    def forward(self, x):
        # x: (N, H, W, C) or (N, C) -> y: the same shape
        check_input("BatchNorm", x, f"x (N, H, W, {self.channels}) or (N, {self.channels})", self.channels)
        B, xp = self.B, self.B.xp
        m = math.prod(x.shape[:-1])
        if not self.training:
            mu, var = self.buffers["running_mean"], self.buffers["running_var"]
            r = 1 / xp.sqrt(var + self.eps)
            x_hat = B.channel_affine(x, r, -mu * r)  # (x - μ) r
        else:
            if m < 2:
                raise CapsNetError(f"batch normalisation in training mode needs more than one value per channel, "
                                   f"and this batch of shape {tuple(x.shape)} gives one: train with a larger batch")
            axes = tuple(range(x.ndim - 1))
            mu = xp.mean(x, axis=axes)
            d = x - mu
            var = xp.mean(d * d, axis=axes)
            r = 1 / xp.sqrt(var + self.eps)
            x_hat = d * r
            self._update_running(mu, var, m)
        self.cache = (x_hat, r, self.training)
        return B.channel_affine(x_hat, self.params["gamma"], self.params["beta"])

    def _update_running(self, mu, var, m):
        """In place, so that a recorded step (graph.py) updates the same arrays when replayed."""
        k = self.momentum
        rm, rv = self.buffers["running_mean"], self.buffers["running_var"]
        rm[...] = (1 - k) * rm + k * mu
        rv[...] = (1 - k) * rv + (k * m / (m - 1)) * var

    def backward(self, dy, input_grad=True):
        xp = self.B.xp
        (x_hat, r, batch), self.cache = self.cache, None
        axes = tuple(range(dy.ndim - 1))
        d_beta = xp.sum(dy, axis=axes)
        d_gamma = xp.sum(dy * x_hat, axis=axes)
        self.grads["beta"] += d_beta
        self.grads["gamma"] += d_gamma
        if not input_grad:
            return None
        g = self.params["gamma"] * r
        if not batch:
            return dy * g
        m = math.prod(dy.shape[:-1])
        # g (dy - (dβ + x̂ dγ) / m), as two multiply-adds per element
        return self.B.channel_affine(dy, g, self.B.channel_affine(x_hat, -g * d_gamma / m, -g * d_beta / m))

"""Layer normalisation (Ba, Kiros & Hinton 2016) over the last axis: each vector x (a capsule's
D components, a position's channels, a sample's features) is normalised by its own mean and
variance, then scaled and shifted by a learned γ and β of that axis's size.

    μ = (1/D) Σ_d x_d,   σ² = (1/D) Σ_d (x_d - μ)²,   r = 1/√(σ² + ε),   x̂ = (x - μ) r,   y = γ x̂ + β

Backward.  dβ = Σ dy and dγ = Σ dy x̂, summed over every vector (all axes but the last).  Within
one vector, ∂x̂_k/∂x_l = r (δ_kl - 1/D - x̂_k x̂_l / D), so with g = γ dy

    dx = r (g - mean_d(g) - x̂ mean_d(g x̂))

-- batch norm's formula (batch_norm.py) with the roles of the axes exchanged: the statistics are
each vector's own, so nothing couples two samples, and training and evaluation are the same.
Inverted dot-product attention routing normalises its parents' poses with these functions
(inverted_routing.py); ``LayerNorm`` is the same as a layer of a description.
"""
from __future__ import annotations

import numpy as np

from .layers import Layer, check_input


def layer_norm(xp, x, gamma, beta, eps):
    """y = γ (x - μ) / √(σ² + ε) + β over the last axis -> (y, (x̂, r)), what the backward needs."""
    mu = xp.mean(x, axis=-1, keepdims=True)
    d = x - mu
    r = 1 / xp.sqrt(xp.mean(d * d, axis=-1, keepdims=True) + eps)
    x_hat = d * r
    return x_hat * gamma + beta, (x_hat, r)


def layer_norm_backward(xp, saved, gamma, dy):
    """From dL/dy: (dx, dγ, dβ), dγ and dβ summed over every vector."""
    x_hat, r = saved
    axes = tuple(range(dy.ndim - 1))
    dgamma, dbeta = xp.sum(dy * x_hat, axis=axes), xp.sum(dy, axis=axes)
    g = dy * gamma
    dx = r * (g - xp.mean(g, axis=-1, keepdims=True) - x_hat * xp.mean(g * x_hat, axis=-1, keepdims=True))
    return dx, dgamma, dbeta


class LayerNorm(Layer):
    """y = γ x̂ + β over the last axis of x (see the module's docstring); γ starts at 1, β at 0."""

    def __init__(self, backend, size, eps=1e-5):
        super().__init__(backend)
        if not eps > 0:
            raise ValueError(f"eps must be above 0, got {eps!r}")
        self.size, self.eps = size, eps
        self._add_param("gamma", np.ones(size))
        self._add_param("beta", np.zeros(size))

    def forward(self, x):
        check_input("LayerNorm", x, f"x (..., {self.size})", self.size)
        y, self.cache = layer_norm(self.B.xp, x, self.params["gamma"], self.params["beta"], self.eps)
        return y

    def backward(self, dy, input_grad=True):
        saved, self.cache = self.cache, None
        dx, dgamma, dbeta = layer_norm_backward(self.B.xp, saved, self.params["gamma"], dy)
        self.grads["gamma"] += dgamma
        self.grads["beta"] += dbeta
        return dx if input_grad else None

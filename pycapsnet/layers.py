"""Plain layers: Conv2d, ReLU, Sigmoid, Linear.

The contract every layer in pycapsnet follows (CS231n style):

* ``forward(x)`` computes the output and keeps in ``self.cache`` what ``backward`` needs;
* ``backward(dy)`` takes dL/d(output), *adds* dL/d(param) into ``self.grads[name]``, and returns
  dL/d(input) (or None when ``input_grad`` is False -- the first layer of a network needs none).

Parameters live in ``self.params`` as backend arrays; they are created on the host from a seeded
NumPy generator (see ``pycapsnet.init``) so every backend starts from the same weights.
Images inside the network are channels-last, (N, H, W, C): the im2col windows are then
contiguous rows and the PrimaryCaps output regroups into capsules with a free reshape.
"""
from __future__ import annotations

import numpy as np


class Layer:
    def __init__(self, backend):
        self.B = backend
        self.params: dict = {}
        self.grads: dict = {}
        self.cache = None
        self.input_grad = True

    def _add_param(self, name: str, host_value: np.ndarray):
        self.params[name] = self.B.asarray(host_value)
        self.grads[name] = self.B.zeros(host_value.shape)

    def zero_grad(self):
        for g in self.grads.values():
            g[...] = 0

    def forward(self, x):  # pragma: no cover - interface
        raise NotImplementedError

    def backward(self, dy):  # pragma: no cover - interface
        raise NotImplementedError


class Conv2d(Layer):
    """2-D convolution on channels-last images, as one matrix product over im2col windows.

    y[n, oh, ow, :] = b + sum_{i, j, c} x[n, s*oh + i - p, s*ow + j - p, c] * W[i, j, c, :]

    W: (kh, kw, C_in, C_out), so W.reshape(kh*kw*C_in, C_out) multiplies the im2col rows.

    With X = im2col(x) (N*OH*OW, kh*kw*C_in) the layer is Y = X W + b, hence
      dW = X^T dY,   db = sum_rows dY,   dX = dY W^T,   dx = col2im(dX)   (col2im is im2col's adjoint).
    """

    def __init__(self, backend, c_in, c_out, kernel, stride=1, padding=0, rng=None, init=None):
        super().__init__(backend)
        from . import init as initializers

        self.c_in, self.c_out, self.k, self.stride, self.padding = c_in, c_out, kernel, stride, padding
        rng = rng if rng is not None else np.random.default_rng(0)
        fan_in = kernel * kernel * c_in
        W, b = (init or initializers.uniform_fan_in)(rng, (kernel, kernel, c_in, c_out), fan_in)
        self._add_param("W", W)
        self._add_param("b", b)

    def output_hw(self, h, w):
        k, s, p = self.k, self.stride, self.padding
        return (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1

    def forward(self, x):
        # x: (N, H, W, C_in) -> y: (N, OH, OW, C_out)
        n, h, w, _ = x.shape
        oh, ow = self.output_hw(h, w)
        cols = self.B.im2col(x, self.k, self.k, self.stride, self.padding)  # (N*OH*OW, k*k*C_in)
        W = self.B.xp.reshape(self.params["W"], (-1, self.c_out))
        y = cols @ W + self.params["b"]
        self.cache = (cols, tuple(x.shape))
        return self.B.xp.reshape(y, (n, oh, ow, self.c_out))

    def backward(self, dy):
        xp = self.B.xp
        cols, x_shape = self.cache
        dy = xp.reshape(dy, (-1, self.c_out))  # (N*OH*OW, C_out)
        W = xp.reshape(self.params["W"], (-1, self.c_out))
        self.grads["W"] += xp.reshape(xp.matrix_transpose(cols) @ dy, self.params["W"].shape)
        self.grads["b"] += xp.sum(dy, axis=0)
        self.cache = None  # the im2col matrix is the biggest array of a step: free it before dX
        if not self.input_grad:
            return None
        dcols = dy @ xp.matrix_transpose(W)  # (N*OH*OW, k*k*C_in)
        return self.B.col2im(dcols, x_shape, self.k, self.k, self.stride, self.padding)


class ReLU(Layer):
    """y = max(x, 0);  dx = dy * [x > 0]."""

    def forward(self, x):
        y = self.B.xp.maximum(x, 0)
        self.cache = y
        return y

    def backward(self, dy):
        y, self.cache = self.cache, None
        return self.B.xp.where(y > 0, dy, 0)


class Sigmoid(Layer):
    """y = 1 / (1 + e^-x), computed without overflow;  dx = dy * y * (1 - y)."""

    def forward(self, x):
        xp = self.B.xp
        e = xp.exp(-xp.abs(x))  # in (0, 1]: never overflows
        y = xp.where(x >= 0, 1 / (1 + e), e / (1 + e))
        self.cache = y
        return y

    def backward(self, dy):
        y, self.cache = self.cache, None
        return dy * y * (1 - y)


class Linear(Layer):
    """y = x W + b with W: (in, out);  dW = x^T dy,  db = sum_n dy,  dx = dy W^T."""

    def __init__(self, backend, n_in, n_out, rng=None, init=None):
        super().__init__(backend)
        from . import init as initializers

        rng = rng if rng is not None else np.random.default_rng(0)
        W, b = (init or initializers.uniform_fan_in)(rng, (n_in, n_out), n_in)
        self._add_param("W", W)
        self._add_param("b", b)

    def forward(self, x):
        self.cache = x
        return x @ self.params["W"] + self.params["b"]

    def backward(self, dy):
        xp = self.B.xp
        x, self.cache = self.cache, None
        self.grads["W"] += xp.matrix_transpose(x) @ dy
        self.grads["b"] += xp.sum(dy, axis=0)
        return dy @ xp.matrix_transpose(self.params["W"]) if self.input_grad else None

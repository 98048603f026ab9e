"""Depthwise convolution: every channel convolved with its own k x k kernel, channels never mixed
(Efficient-CapsNet's primary capsules: a 9x9 kernel per channel over a 9x9 map).

    y[n, oh, ow, c] = b[c] + Σ_{i, j} x[n, s*oh + i - p, s*ow + j - p, c] W[i, j, c]

W: (k, k, C), b: (C).  The sum runs over the k*k kernel offsets, each a strided slice of x (as
MaxPool2d visits its windows): no im2col matrix, which would be k*k times the input for a product
that mixes nothing.  Backward, offset by offset:

    dW[i, j, c] = Σ_{n, oh, ow} x[n, s*oh + i, s*ow + j, c] dy[n, oh, ow, c]
    dx[n, s*oh + i, s*ow + j, c] += W[i, j, c] dy[n, oh, ow, c]       (overlapping windows add)
    db[c] = Σ_{n, oh, ow} dy[n, oh, ow, c]
"""
from __future__ import annotations

import numpy as np

from . import init as initializers
from .cnn_layers import window_offsets
from .layers import check_images, Conv2d, Layer


class DepthwiseConv2d(Layer):
    """Depthwise 2-D convolution of channels-last images; ``c_out`` must equal ``c_in`` (one
    kernel per channel), taken so that it drops in where a Conv2d is built."""

    def __init__(self, backend, c_in, c_out, kernel, stride=1, padding=0, rng=None, init=None):
        super().__init__(backend)

        if c_out != c_in:
            raise ValueError(f"a depthwise convolution gives one channel per input channel: it takes {c_in} channels "
                             f"and cannot give {c_out} (make types x dim {c_in})")
        self.c_in = self.c_out = c_in
        self.k, self.stride, self.padding = kernel, stride, padding
        rng = rng if rng is not None else np.random.default_rng(0)
        W, b = (init or initializers.uniform_fan_in)(rng, (kernel, kernel, c_in), kernel * kernel)
        self._add_param("W", W)
        self._add_param("b", b)

    output_hw = Conv2d.output_hw

    def forward(self, x):
        # x: (N, H, W, C) -> y: (N, OH, OW, C)
        check_images("DepthwiseConv2d", x, self)
        x_pad = self.B.pad_hw(x, self.padding)
        oh, ow = self.output_hw(*x.shape[1:3])
        W = self.params["W"]
        y = None
        for i, j, rows, cols in window_offsets(self.k, self.stride, oh, ow):
            term = x_pad[:, rows, cols, :] * W[i, j]
            y = term if y is None else y + term
        self.cache = x
        return y + self.params["b"]

    def backward(self, dy, input_grad=True):
        # dy: (N, OH, OW, C) -> dx: (N, H, W, C)
        xp = self.B.xp
        x, self.cache = self.cache, None
        p, (h, w) = self.padding, x.shape[1:3]
        x_pad = self.B.pad_hw(x, p)
        W, dW = self.params["W"], self.grads["W"]
        self.grads["b"] += xp.sum(dy, axis=(0, 1, 2))
        dx = self.B.zeros(tuple(x_pad.shape), dtype=self.B.dtype_name(x)) if input_grad else None
        for i, j, rows, cols in window_offsets(self.k, self.stride, *dy.shape[1:3]):
            dW[i, j] += xp.sum(x_pad[:, rows, cols, :] * dy, axis=(0, 1, 2))
            if dx is not None:
                dx[:, rows, cols, :] += dy * W[i, j]
        if dx is None or not p:
            return dx
        return dx[:, p:p + h, p:p + w, :]

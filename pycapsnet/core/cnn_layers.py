"""The baseline CNN's layers (pycapsnet/experiments/networks.py): 2x2 max pooling, flattening and
dropout, under the layer contract of layers.py."""
from __future__ import annotations

import numpy as np

from .layers import Layer


def window_offsets(k, stride, oh, ow):
    """(i, j, rows, cols) for each offset (i, j) of a k x k window: the strided slices of the input
    that offset reads across all OH x OW windows."""
    return [(i, j, slice(i, i + stride * (oh - 1) + 1, stride), slice(j, j + stride * (ow - 1) + 1, stride))
            for i in range(k) for j in range(k)]


class MaxPool2d(Layer):
    """Max-pooling of channels-last images over k x k windows, stride s (default k):

        y[n, oh, ow, c] = max_{i, j < k} x[n, s*oh + i, s*ow + j, c]

    The maximum's gradient goes to the entry it came from: dx[argmax of a window] += dy.  The
    windows are visited as k*k strided slices of x (one per offset (i, j)), each compared with y;
    the first offset that equals y takes dy, so a tie sends it to one entry only, as an argmax does."""

    def __init__(self, backend, kernel=2, stride=None):
        super().__init__(backend)
        self.k, self.stride = kernel, stride or kernel

    def output_hw(self, h, w):
        return (h - self.k) // self.stride + 1, (w - self.k) // self.stride + 1

    def _offsets(self, x):
        """(rows, cols) slices of x that offset (i, j) of every window reads, one per offset."""
        oh, ow = self.output_hw(*x.shape[1:3])
        return [(rows, cols) for _, _, rows, cols in window_offsets(self.k, self.stride, oh, ow)]

    def forward(self, x):
        # x: (N, H, W, C) -> y: (N, OH, OW, C)
        xp = self.B.xp
        offsets = self._offsets(x)
        y = x[:, offsets[0][0], offsets[0][1], :]
        for rows, cols in offsets[1:]:
            y = xp.maximum(y, x[:, rows, cols, :])
        self.cache = (x, y)
        return y

    def backward(self, dy, input_grad=True):
        xp = self.B.xp
        (x, y), self.cache = self.cache, None
        dx = self.B.zeros(tuple(x.shape), dtype=self.B.dtype_name(x))
        open_ = xp.ones_like(y, dtype=xp.bool)  # windows whose maximum has not taken dy yet
        for rows, cols in self._offsets(x):
            hit = (x[:, rows, cols, :] == y) & open_
            dx[:, rows, cols, :] += dy * hit  # overlapping windows (s < k) add up
            open_ = open_ & ~hit
        return dx


class Flatten(Layer):
    """(N, ...) -> (N, F): a channels-last image flattens in (row, column, channel) order."""

    def forward(self, x):
        self.cache = tuple(x.shape)
        return self.B.xp.reshape(x, (x.shape[0], -1))

    def backward(self, dy, input_grad=True):
        shape, self.cache = self.cache, None
        return self.B.xp.reshape(dy, shape)


class Dropout(Layer):
    """Inverted dropout (Srivastava et al. 2014): in training each entry is kept with probability
    1 - p and scaled by 1 / (1 - p), so that evaluation (the identity) sees the same expected value:

        y = x * m,   m = [u >= p] / (1 - p),   u ~ U(0, 1);      dx = dy * m

    The mask is drawn on the host from the layer's own seeded generator, so every backend draws the
    same masks.  ``hold``: keep the last mask (a gradient check perturbs the input under one mask).
    A drawn mask is data that changes every step, so a step through this layer is not captured."""

    capturable = False

    def __init__(self, backend, rate=0.5, seed=0):
        super().__init__(backend)
        if not 0 <= rate < 1:
            raise ValueError(f"the dropout rate must be in [0, 1), got {rate!r}")
        self.rate, self.rng, self.hold, self.mask = rate, np.random.default_rng(seed), False, None

    def forward(self, x):
        if not self.training or self.rate == 0:
            self.cache = None
            return x
        if not (self.hold and self.mask is not None and tuple(self.mask.shape) == tuple(x.shape)):
            keep = self.rng.random(tuple(x.shape)) >= self.rate
            self.mask = self.B.asarray(keep / (1 - self.rate), dtype=self.B.dtype_name(x))
        self.cache = self.mask
        return x * self.mask

    def backward(self, dy, input_grad=True):
        mask, self.cache = self.cache, None
        return dy if mask is None else dy * mask

"""Plain layers: Conv2d, Normalize, ReLU, Sigmoid, Linear (the baseline CNN's MaxPool2d, Flatten and
Dropout: cnn_layers.py).

The contract every layer in pycapsnet follows (CS231n style):

* ``forward(x)`` computes the output and keeps in ``self.cache`` what ``backward`` needs;
* ``backward(dy)`` takes dL/d(output), *adds* dL/d(param) into ``self.grads[name]``, and returns
  dL/d(input).  A layer with parameters may be a network's first layer, which needs no input
  gradient: its ``backward(dy, input_grad=False)`` skips that work and returns None.

A layer reads only its own cache and parameters: a parent calls its children's forward and
backward and passes arrays, nothing else.

Parameters live in ``self.params`` as backend arrays; they are created on the host from a seeded
NumPy generator (see ``pycapsnet.core.init``) so every backend starts from the same weights.
Images inside the network are channels-last, (N, H, W, C): the im2col windows are then
contiguous rows and the PrimaryCaps output regroups into capsules with a free reshape.
"""
from __future__ import annotations

import math

import numpy as np

from . import init as initializers
from ..errors import CapsNetError


def check_input(name: str, x, takes: str, last: int | None = None, ndim: int | None = None, least_hw: int = 0,
                size: int | None = None):
    """Refuse, in one line naming the layer and what it takes, an input the layer cannot compute
    with: otherwise the backend's own error (a mismatched product, a negative dimension) surfaces
    deep inside. ``ndim``: the dimensions x must have (None: any); ``last``: its last axis (the
    channels or features); ``least_hw``: the smallest height and width of an image; ``size``: the
    entries of one sample, whatever its axes (capsules that a layer regroups). Shapes are compared
    as Python ints (math.prod, not NumPy's), which torch.compile reads as constants."""
    shape = tuple(x.shape)
    if not shape or (ndim is not None and len(shape) != ndim) or (last is not None and shape[-1] != last) or \
            (least_hw and min(shape[1:3]) < least_hw) or (size is not None and math.prod(shape[1:]) != size):
        raise CapsNetError(f"{name} takes {takes}; got {shape}")


def check_images(name: str, x, conv):
    """x must be channels-last images (N, H, W, C_in) that the convolution ``conv`` fits in."""
    least = conv.k - 2 * conv.padding
    check_input(name, x, f"channels-last images x (N, H, W, {conv.c_in}) of at least {least}x{least} pixels",
                conv.c_in, ndim=4, least_hw=least)


class Layer:
    capturable = True  # False: a step through it cannot be recorded and replayed (graph.py)

    def __init__(self, backend):
        self.B = backend
        self.training = True
        self.params: dict = {}
        self.grads: dict = {}
        self.buffers: dict = {}  # state that is not learned by gradients (batch norm's running statistics)
        self.cache = None

    def _add_param(self, name: str, host_value: np.ndarray):
        self.params[name] = self.B.asarray(host_value)
        self.grads[name] = self.B.zeros(host_value.shape)

    def zero_grad(self):
        for g in self.grads.values():
            g[...] = 0

    def forward(self, x):  # pragma: no cover - interface
        raise NotImplementedError

    def backward(self, dy, input_grad=True):  # pragma: no cover - interface
        raise NotImplementedError

    def __repr__(self):
        """The layer's kind, what it takes and gives where a description built it, and its
        parameters' shapes: ``ClassCaps(a 6x6 grid of 32 capsule types of 8D -> 10 capsules of 16D; W (36, 32, 10, 16, 8))``."""
        flows = f"{self.in_flow} -> {self.out_flow}" if hasattr(self, "out_flow") else ""
        params = ", ".join(f"{k} {tuple(p.shape)}" for k, p in self.params.items())
        return f"{type(self).__name__}({'; '.join(part for part in (flows, params) if part)})"

    def walk(self):
        """This layer and the layers it is made of, depth first."""
        yield self
        for part in vars(self).values():
            if isinstance(part, Layer) and part is not self:
                yield from part.walk()

    def train(self, mode: bool = True):
        """Training (True) or evaluation (False) mode, here and in the layers this one is made of:
        Dropout and BatchNorm behave differently."""
        for layer in self.walk():
            layer.training = mode

    def release(self):
        """Drop what forward kept for a backward (and a routing layer's trace of its iterations),
        here and in the layers this one is made of: after an evaluation, so that it is not held
        into the next step."""
        for layer in self.walk():
            layer.cache = None
            if hasattr(layer, "trace"):
                layer.trace = None

    def traced(self, k):
        """For a layer that routes in blocks of the batch and keeps ``self.trace`` as (slice, trace)
        per block, in batch order (ClassCaps, the EM layers): item k of every iteration's trace over
        the whole batch, the blocks' parts joined -- a list over iterations."""
        iters = len(self.trace[0][1])
        return [self.B.xp.concat([trace[r][k] for _, trace in self.trace]) for r in range(iters)]


class Conv2d(Layer):
    """2-D convolution on channels-last images, as matrix products over im2col windows.

    y[n, oh, ow, :] = b + sum_{i, j, c} x[n, s*oh + i - p, s*ow + j - p, c] * W[i, j, c, :]

    W: (kh, kw, C_in, C_out), so W.reshape(kh*kw*C_in, C_out) multiplies the im2col rows.

    With X = im2col(x) (N*OH*OW, kh*kw*C_in) the layer is Y = X W + b, hence
      dW = X^T dY,   db = sum_rows dY,   dX = dY W^T,   dx = col2im(dX)   (col2im is im2col's adjoint);
    at stride 1, dx is computed as the convolution it equals (``_input_grad_transposed``,
    docs/backprop.md §1).

    The batch is processed in chunks of at most ``chunk_bytes`` of im2col matrix: for PrimaryCaps
    the whole X is k*k/(s*s) times the input it is made from (20 times for the paper's 9x9/2).  A chunk
    is a run of whole images while one image's X fits, else a band of output rows of one image (its
    X made from the input rows that band's windows cover), so that the working memory is bounded by
    the setting, not by the image size.  Forward keeps only x; backward rebuilds each chunk's X for
    dW -- one cheap gather -- and adds each chunk's dX straight into dx (bands of input rows
    overlap where their windows do), so neither X nor dX of the whole batch ever exists.

    A backend whose library has a convolution of its own (``B.direct_conv``: PyTorch's on the CPU)
    computes the same y, dW and dx with it instead; the math above is what its kernels compute.
    """

    chunk_bytes = 48 * 2**20
    # A narrow product (at most `narrow` columns out: few multiply-adds per number of X read) runs
    # at the speed X streams in, so its chunks are made cache-sized, X written and read back from
    # cache; a wide one wants long products (docs/performance.md, ResNet-20's convolutions)
    narrow, narrow_chunk_bytes = 64, 2 * 2**20

    def __init__(self, backend, c_in, c_out, kernel, stride=1, padding=0, rng=None, init=None):
        super().__init__(backend)

        self.c_in, self.c_out, self.k, self.stride, self.padding = c_in, c_out, kernel, stride, padding
        rng = rng if rng is not None else np.random.default_rng(0)
        fan_in = kernel * kernel * c_in
        W, b = (init or initializers.uniform_fan_in)(rng, (kernel, kernel, c_in, c_out), fan_in)
        self._add_param("W", W)
        self._add_param("b", b)

    def chunk_limit(self, columns: int) -> int:
        """Bytes of im2col matrix per chunk of a product with ``columns`` output columns."""
        return min(self.chunk_bytes, self.narrow_chunk_bytes) if columns <= self.narrow else self.chunk_bytes

    def output_hw(self, h, w):
        k, s, p = self.k, self.stride, self.padding
        return (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1

    def chunk_shape(self, n, h, w, itemsize):
        """(images, output rows, number of chunks) of ``chunks``, in closed form (for any batch)."""
        oh, ow = self.output_hw(h, w)
        per_row = ow * self.k * self.k * self.c_in * itemsize  # X of one output row of one image
        rows = max(1, self.chunk_limit(self.c_out) // per_row)
        if rows >= oh:  # whole images
            step = rows // oh
            return min(step, n), oh, -(-n // step)
        return 1, rows, n * -(-oh // rows)

    def chunks(self, n, h, w, itemsize):
        """(images, output rows) blocks whose im2col matrices hold at most chunk_bytes each."""
        images, rows, _ = self.chunk_shape(n, h, w, itemsize)
        oh = self.output_hw(h, w)[0]
        if rows >= oh:
            return [(slice(a, min(a + images, n)), slice(0, oh)) for a in range(0, n, images)]
        return [(slice(i, i + 1), slice(r, min(r + rows, oh))) for i in range(n) for r in range(0, oh, rows)]

    def _band(self, rows):
        """The padded input rows that output rows ``rows`` read: s*r0 .. s*(r1 - 1) + k."""
        return slice(self.stride * rows.start, self.stride * (rows.stop - 1) + self.k)

    def _im2col(self, x):
        return self.B.im2col(x, self.k, self.k, self.stride)  # x padded: (n*OH*OW, k*k*C_in)

    def forward(self, x):
        # x: (N, H, W, C_in) -> y: (N, OH, OW, C_out)
        check_images(type(self).__name__, x, self)
        if self.B.direct_conv:  # the library's own convolution (e.g. PyTorch's on the CPU)
            self.cache = x
            return self.B.conv2d(x, self.params["W"], self.params["b"], self.stride, self.padding)
        xp = self.B.xp
        n, h, w, _ = x.shape
        oh, ow = self.output_hw(h, w)
        W = xp.reshape(self.params["W"], (-1, self.c_out))
        x_pad = self.B.pad_hw(x, self.padding)
        chunks = self.chunks(n, h, w, x.dtype.itemsize)
        if len(chunks) == 1:
            y = self.B.matmul(self._im2col(x_pad), W)
        else:
            y = self.B.empty((n, oh, ow, self.c_out), dtype=self.B.dtype_name(x))
            for sl, rows in chunks:
                part = self.B.matmul(self._im2col(x_pad[sl, self._band(rows)]), W)
                y[sl, rows] = xp.reshape(part, (-1, rows.stop - rows.start, ow, self.c_out))
        self.cache = x
        return xp.reshape(y, (n, oh, ow, self.c_out)) + self.params["b"]

    def backward(self, dy, input_grad=True):
        # dy: (N, OH, OW, C_out) -> dx: (N, H, W, C_in)
        xp = self.B.xp
        x, self.cache = self.cache, None
        self.grads["b"] += xp.sum(dy, axis=(0, 1, 2))
        if self.B.direct_conv:
            dx, dW = self.B.conv2d_backward(dy, x, self.params["W"], self.stride, self.padding, input_grad)
            self.grads["W"] += dW
            return dx
        n, h, w, _ = x.shape
        p = self.padding
        W = xp.reshape(self.params["W"], (-1, self.c_out))
        dW = xp.reshape(self.grads["W"], W.shape)  # a view: accumulate in place
        x_pad = self.B.pad_hw(x, p)
        # a stride-1 input gradient as a convolution of dy (below), where one image's im2col of dy
        # fits in a chunk; else each chunk's dX scattered back by col2im
        transposed = input_grad and self.stride == 1 and p <= self.k - 1 and \
            h * w * self.k * self.k * self.c_out * x.dtype.itemsize <= self.chunk_bytes
        dx = self.B.zeros(tuple(x_pad.shape), dtype=self.B.dtype_name(x)) if input_grad and not transposed else None
        for sl, rows in self.chunks(n, h, w, x.dtype.itemsize):
            band = self._band(rows)
            dy_c = xp.reshape(dy[sl, rows], (-1, self.c_out))                    # (n_c*rows*OW, C_out)
            dW += self.B.matmul(xp.matrix_transpose(self._im2col(x_pad[sl, band])), dy_c)
            if dx is not None:
                dcols = self.B.matmul(dy_c, xp.matrix_transpose(W))               # (n_c*rows*OW, k*k*C_in)
                x_band = x_pad[sl, band]
                dx_band = self.B.col2im(dcols, tuple(x_band.shape), self.k, self.k, self.stride)
                if rows.stop - rows.start == dy.shape[1]:
                    dx[sl, band] = dx_band  # whole images: no other chunk touches them
                else:
                    dx[sl, band] += dx_band
                del dcols, dx_band  # before the next chunk's X is made: one chunk's matrices at a time
        if transposed:
            return self._input_grad_transposed(dy, x.shape)
        if dx is None or not p:
            return dx
        return dx[:, p:p + h, p:p + w, :]

    def _input_grad_transposed(self, dy, x_shape):
        """dx of a stride-1 convolution as a convolution itself: with q = k - 1 - p,
            dx[n, a, b, c] = sum_{i, j, o} dy_q[n, a + i, b + j, o] W[k-1-i, k-1-j, c, o],
        dy_q being dy zero-padded by q: im2col of dy_q times the flipped kernel, (k*k*C_out, C_in).
        The same sums as col2im(dY W^T), gathered instead of scattered: col2im adds k*k strided
        slices one C_in-long run at a time, which on small channel counts costs more than the product."""
        xp, B, k = self.B.xp, self.B, self.k
        n, h, w, c_in = x_shape
        W_flip = xp.reshape(xp.permute_dims(xp.flip(self.params["W"], axis=(0, 1)), (0, 1, 3, 2)), (-1, c_in))
        dy_q = B.pad_hw(dy, k - 1 - self.padding)
        per_image = h * w * k * k * self.c_out * dy.dtype.itemsize  # im2col of one image's dy_q
        step = max(1, self.chunk_limit(c_in) // per_image)          # images per chunk
        if step >= n:
            return xp.reshape(B.matmul(B.im2col(dy_q, k, k, 1), W_flip), (n, h, w, c_in))
        dx = B.empty((n, h, w, c_in), dtype=B.dtype_name(dy))
        for a in range(0, n, step):
            sl = slice(a, min(a + step, n))
            dx[sl] = xp.reshape(B.matmul(B.im2col(dy_q[sl], k, k, 1), W_flip), (-1, h, w, c_in))
        return dx


class Normalize(Layer):
    """y_c = (x_c - μ_c) / σ_c for each channel c (the last axis: the body runs channels-last), μ and σ
    constants of the network -- computed on a training split and recorded in its description, as
    the CIFAR-10 capsule papers normalise their inputs;  dx = dy / σ.  No parameters: the decoder
    still reconstructs the image as it was given."""

    def __init__(self, backend, mean, std):
        super().__init__(backend)
        self.mean = backend.asarray(np.asarray(mean, np.float64))
        self.inv_std = backend.asarray(1.0 / np.asarray(std, np.float64))

    def forward(self, x):
        return (x - self.mean) * self.inv_std

    def backward(self, dy, input_grad=True):
        return dy * self.inv_std


class ReLU(Layer):
    """y = max(x, 0);  dx = dy * [x > 0]."""

    def forward(self, x):
        y = self.B.relu(x)
        self.cache = y
        return y

    def backward(self, dy, input_grad=True):
        y, self.cache = self.cache, None
        return self.B.relu_backward(dy, y)  # y > 0 exactly where x > 0


def sigmoid(xp, x):
    """1 / (1 + e^-x) without overflow: e^-|x| is in (0, 1]."""
    e = xp.exp(-xp.abs(x))
    return xp.where(x >= 0, 1 / (1 + e), e / (1 + e))


class Sigmoid(Layer):
    """y = 1 / (1 + e^-x), computed without overflow;  dx = dy * y * (1 - y)."""

    def forward(self, x):
        y = sigmoid(self.B.xp, x)
        self.cache = y
        return y

    def backward(self, dy, input_grad=True):
        y, self.cache = self.cache, None
        return dy * y * (1 - y)


class Linear(Layer):
    """y = x W + b with W: (in, out);  dW = x^T dy,  db = sum_n dy,  dx = dy W^T."""

    def __init__(self, backend, n_in, n_out, rng=None, init=None):
        super().__init__(backend)

        rng = rng if rng is not None else np.random.default_rng(0)
        self.n_in = n_in
        W, b = (init or initializers.uniform_fan_in)(rng, (n_in, n_out), n_in)
        self._add_param("W", W)
        self._add_param("b", b)

    def forward(self, x):
        check_input("Linear", x, f"x (N, {self.n_in})", self.n_in, ndim=2)
        self.cache = x
        return self.B.matmul(x, self.params["W"]) + self.params["b"]

    def backward(self, dy, input_grad=True):
        xp = self.B.xp
        x, self.cache = self.cache, None
        self.grads["W"] += self.B.matmul(xp.matrix_transpose(x), dy)
        self.grads["b"] += xp.sum(dy, axis=0)
        return self.B.matmul(dy, xp.matrix_transpose(self.params["W"])) if input_grad else None

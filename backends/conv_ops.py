"""The backend's convolution primitives on channels-last images: ``im2col`` (gather every kernel
window into a row of a matrix), ``col2im`` (its adjoint: scatter-add rows back), zero padding, and
the hooks for a library's own convolution.  Backend (base.py) inherits them."""
from __future__ import annotations


class ConvOps:
    """Mixed into Backend, whose ``xp``, ``windows``, ``zeros``, ``dtype_name``, ``_float``,
    ``_device_kw`` and ``_over_batch`` these use."""

    # ---- convolution primitives (shared) -----------------------------------------------------
    # True where the library has its own convolution (``conv2d``, ``conv2d_backward``): Conv2d then
    # calls it instead of its im2col products.  False here: the layer's im2col form is the default.
    direct_conv: bool = False

    def conv2d(self, x, W, b, stride: int, padding: int):
        """y = conv(x, W) + b on channels-last images, by the library's own convolution (only where
        ``direct_conv``).  x (N, H, W, C_in), W (kh, kw, C_in, C_out), b (C_out,) -> (N, OH, OW, C_out)."""
        raise NotImplementedError(f"the {self.name} backend has no direct convolution (direct_conv is False)")

    def conv2d_backward(self, dy, x, W, stride: int, padding: int, input_grad: bool = True):
        """(dx or None, dW) of ``conv2d`` for dy (N, OH, OW, C_out): dW = sum over windows of x^T dy
        in W's layout, dx = the transposed convolution of dy -- the library's own kernels."""
        raise NotImplementedError(f"the {self.name} backend has no direct convolution (direct_conv is False)")

    def pad_hw(self, x, padding: int):
        """Zero-pad the two spatial axes of (N, H, W, C) by ``padding`` on each side."""
        if padding == 0:
            return x
        n, h, w, c = x.shape
        out = self.zeros((n, h + 2 * padding, w + 2 * padding, c), dtype=self.dtype_name(x))
        out[:, padding:padding + h, padding:padding + w, :] = x
        return out

    def im2col(self, x, kh: int, kw: int, stride: int, padding: int = 0):
        """(N, H, W, C) -> cols (N*OH*OW, kh*kw*C): row (n, oh, ow) holds window (oh, ow) of image n,
        flattened in (kh, kw, C) order, so that ``cols @ W.reshape(kh*kw*C, C_out)`` is the convolution."""
        win = self.windows(self.pad_hw(x, padding), kh, kw, stride)  # a view, no copy yet
        n, oh, ow = win.shape[:3]
        cols = self.xp.empty(tuple(win.shape), dtype=self._float(self.dtype_name(x)), **self._device_kw())

        def gather(sl):
            cols[sl] = win[sl]

        self._over_batch(gather, n)
        return self.xp.reshape(cols, (n * oh * ow, kh * kw * x.shape[3]))

    def col2im(self, cols, x_shape, kh: int, kw: int, stride: int, padding: int = 0):
        """Adjoint of ``im2col``: add every row of ``cols`` back onto the pixels its window covers.

        cols: (N*OH*OW, kh*kw*C) -> (N, H, W, C).  One strided add per kernel offset (i, j): the
        values that offset saw at output positions (oh, ow) return to pixels (i + s*oh, j + s*ow)."""
        n, h, w, c = x_shape
        hp, wp = h + 2 * padding, w + 2 * padding
        oh, ow = (hp - kh) // stride + 1, (wp - kw) // stride + 1
        c6 = self.xp.reshape(cols, (n, oh, ow, kh, kw, c))
        dx = self.zeros((n, hp, wp, c), dtype=self.dtype_name(cols))

        def scatter(sl):
            d, src = dx[sl], c6[sl]
            for i in range(kh):
                for j in range(kw):
                    d[:, i:i + stride * oh:stride, j:j + stride * ow:stride, :] += src[:, :, :, i, j, :]

        self._over_batch(scatter, n)
        return dx[:, padding:padding + h, padding:padding + w, :] if padding else dx

"""A strided convolution computed with the convolution theorem: the same layer as ``Conv2d``
(same W, b, output and gradients), with about 3.5x fewer multiply-adds for PrimaryCaps.

Why it pays.  The PrimaryCaps convolution (9x9, stride 2, 256 -> 256 channels on a 20x20 map) is
nearly all of a CapsNet train step: as im2col matrix products it costs 36 positions x 81 taps =
2,916 multiply-adds per (sample, c_in, c_out).  By the convolution theorem the same sum is one
complex product per spatial frequency instead: after the stride is folded into 4 phase channels
(below), 52 frequencies x 4 phases x 4 real products = 832.  Per frequency the products are one
matrix product over channels, and forward, weight gradient and input gradient all keep that shape.

Three steps, each a real linear map, so each backward is the transposed map:

1. Stride to channels ("space-to-depth").  With s = stride, row h = s*i + r of the input is row i
   of phase r; a kernel row a = s*a' + r touches only phase r.  So the stride-s convolution with a
   k x k kernel is a stride-1 correlation with a kq x kq kernel (kq = ceil(k/s), the kernel
   zero-padded to s*kq) over C' = s*s*C_in phase channels on an n_h x n_w grid:

       y[p, o] = sum_{t, c'} xs[p + t, c'] ws[t, c', o]          p: output position, t: kernel tap

2. Discrete Fourier transform over the grid.  With X(f) = sum_s xs[s] e^{-i theta(f, s)} and
   V(f) = sum_t ws[t] e^{+i theta(f, t)}, theta(f, s) = 2 pi (f1 s1 / n_h + f2 s2 / n_w),

       y[p] = 1/(n_h n_w) sum_f X(f) V(f) e^{+i theta(f, p)}

   exactly, because p + t never wraps around the n_h x n_w grid (n_h = OH - 1 + kq).  y is real,
   so f and -f contribute conjugate terms: we keep one frequency of each pair {f, -f} and weight
   it alpha_f = 2 (1 for the few f = -f).  Each transform is a constant real matrix (cos and sin
   rows, real and imaginary parts interleaved) -- a matrix product over the grid axis.

3. Per frequency, a complex matrix product over channels, in real arithmetic:

       Y = X V:    Y_r = X_r V_r - X_i V_i,    Y_i = X_r V_i + X_i V_r     (X: (N, C'), V: (C', C_out))

   and its adjoints  dX = dY V^H,  dV = X^H dY, i.e.
       dX_r = dY_r V_r^T + dY_i V_i^T,   dX_i = dY_i V_r^T - dY_r V_i^T,
       dV_r = X_r^T dY_r + X_i^T dY_i,   dV_i = X_r^T dY_i - X_i^T dY_r.
   Each is one real product of stacked blocks (2N rows or columns, and 2 C_out):

       [V_r^T; V_i^T] [X_r^T  X_i^T] = [V_r^T X_r^T  V_r^T X_i^T; V_i^T X_r^T  V_i^T X_i^T]  (Y^T's blocks)
       [dY_r  dY_i; dY_i  -dY_r] [V_r^T; V_i^T]             = [dX_r; dX_i]
       [dY_r  dY_i; dY_i  -dY_r]^T [X_r; X_i]               = [dV_r^T; dV_i^T]

   so the kernel spectrum is kept as [V_r^T; V_i^T] (2 C_out, C') per frequency, and the one block
   matrix of dY serves both gradients.

The transformed weights V are 5x larger than W (52 complex frequencies x 4 phases against 81 taps:
109 MB for PrimaryCaps on MNIST).  When they take at most ``keep_spectrum_mb`` (128 MB by default),
forward makes them in one product (one read of the kernel grid) and keeps them with the transformed
input X for backward, whose dX is then one product over all frequencies (forward's products go
``freq_chunk`` frequencies at a time, which bounds their result, as large as Y for each part);
otherwise forward makes them a chunk at a time.  That saves a third pass of the
memory-bound kernel transform (~10% of a NumPy step).  The peak does not grow with it: backward
frees X before making dX, and ClassCaps writes dû over û, so the step's peak stays below
the autograd reference's.  Larger inputs have many more frequencies (a 64 x 64 input: 394, 826 MB
of V); then forward keeps the kernel grid ws (as large as W) instead, and backward makes V again,
chunk by chunk.  ``keep_spectrum_mb = 0`` always does that.
The weight-gradient spectrum dV is made ``channel_block`` phase channels at a time (fewer on large
inputs, to stay within ``weight_grad_mb``, and at small batches, to stay within X's size) for all
frequencies, transposed (dV_r^T and dV_i^T from one product per frequency, ``_weight_grad``), and
turned back into dW at once (dws = Fw^T dV sums over all 52 frequencies and both parts in one
product), so neither it nor a running sum over frequency chunks ever exists in full.

When it does not pay.  The kernel is transformed once per step whatever the batch (three passes
over 5x W), so at small batches the transforms outweigh the saved products: for PrimaryCaps on
28 x 28 the im2col ``Conv2d`` is faster at batch 16, and on 64 x 64 or 128 x 128 inputs at batch 8
(docs/performance.md).  ``CapsNetConfig.primary_conv`` chooses.

Valid (padding-0 after ``padding``) convolutions of any stride and rectangular size.  The numbers
equal ``Conv2d``'s to rounding (the tests check 1e-12 in float64); finite differences and the
autograd oracle check the gradients independently.
"""
from __future__ import annotations

from dataclasses import dataclass

import math

import numpy as np

from .layers import Conv2d, check_images


def half_spectrum(n_h: int, n_w: int):
    """One frequency (f1, f2) of each conjugate pair {f, -f} on the n_h x n_w grid, with its weight
    alpha (2, or 1 where f = -f): (F, 2) int array, (F,) float array."""
    freqs, alpha, seen = [], [], set()
    for f1 in range(n_h):
        for f2 in range(n_w):
            if (f1, f2) in seen:
                continue
            partner = ((-f1) % n_h, (-f2) % n_w)
            seen.update({(f1, f2), partner})
            freqs.append((f1, f2))
            alpha.append(1.0 if partner == (f1, f2) else 2.0)
    return np.array(freqs), np.array(alpha)


def spectrum_mb(n_freqs: int, c_phase: int, c_out: int, itemsize: int) -> float:
    """Size in MB of a kernel spectrum V: real and imaginary parts of n_freqs (C', C_out) matrices."""
    return 2 * n_freqs * c_phase * c_out * itemsize / 2**20


def phase_grid(h: int, w: int, kernel: int, stride: int, padding: int = 0):
    """Geometry of step 1 for an (h, w) input: output size (oh, ow), taps per phase kq = ceil(k/s),
    and the phase grid (n_h, n_w) = (oh - 1 + kq, ow - 1 + kq) that holds every p + t."""
    oh, ow = (h + 2 * padding - kernel) // stride + 1, (w + 2 * padding - kernel) // stride + 1
    kq = math.ceil(kernel / stride)
    return oh, ow, kq, oh - 1 + kq, ow - 1 + kq


def dft_matrices(n_h: int, n_w: int, kq: int, oh: int, ow: int, dtype=np.float64, block: int = 1024):
    """The three constant real transforms, rows/columns ordered (frequency, re|im):

    Fx (2F, n_h*n_w):   X  = Fx @ xs     rows cos, -sin   (forward DFT of the input grid)
    Fw (2F, kq*kq):     V  = Fw @ ws     rows cos, +sin   (conjugate DFT of the kernel)
    Fy (oh*ow, 2F):     y  = Fy @ Y      alpha (cos, -sin) / (n_h n_w)   (real part of the inverse)

    Angles and their cos and sin are computed in float64, ``block`` frequencies at a time, and
    stored in ``dtype``: on a 224 x 224 input Fx and Fy alone are 2.3 GB in float64, so whole-matrix
    float64 intermediates would take several times what the float32 matrices keep."""
    freqs, alpha = half_spectrum(n_h, n_w)
    F = len(freqs)

    def grid(m_h, m_w):  # every grid point (s1, s2) of an m_h x m_w block: (m_h*m_w, 2)
        return np.stack(np.meshgrid(np.arange(m_h), np.arange(m_w), indexing="ij"), -1).reshape(-1, 2)

    def cos_sin(f, points):
        """cos and sin of theta(f, s) for frequencies f (m, 2) and grid points s (q, 2): (m, q) each.
        theta is k steps of 2 pi / (n_h n_w), k = f1 s1 n_w + f2 s2 n_h reduced modulo a turn in
        integers; then cos and sin at quarter turns, which should be 0, come out as +-1e-16 residues,
        and are set to 0.  Exactly: every other value is at least sin(pi / (2 n_h n_w)) in size.
        The residues matter: the imaginary parts of the self-conjugate frequencies, which are zero,
        would hold them (about 1e-18 in V, 1e-24 in dY), and their products are subnormal floats,
        which x86 cores multiply in microcode, many times slower than normal ones: a whole product
        of V with them runs several times slower (docs/performance.md)."""
        k = np.outer(f[:, 0] * n_w, points[:, 0])
        k += np.outer(f[:, 1] * n_h, points[:, 1])
        k %= n_h * n_w
        theta = k * (2 * np.pi / (n_h * n_w))
        del k
        c = np.cos(theta)
        s = np.sin(theta, out=theta)
        for t in (c, s):
            t[np.abs(t) < 1e-12] = 0.0
        return c, s

    points = {"x": grid(n_h, n_w), "w": grid(kq, kq), "y": grid(oh, ow)}
    Fx = np.empty((2 * F, n_h * n_w), dtype)
    Fw = np.empty((2 * F, kq * kq), dtype)
    Fy = np.empty((oh * ow, 2 * F), dtype)
    for a in range(0, F, block):
        b = min(a + block, F)
        c, s = cos_sin(freqs[a:b], points["x"])                                # (b - a, n_h*n_w)
        Fx[2 * a:2 * b:2], Fx[2 * a + 1:2 * b:2] = c, -s
        c, s = cos_sin(freqs[a:b], points["w"])
        Fw[2 * a:2 * b:2], Fw[2 * a + 1:2 * b:2] = c, s
        c, s = cos_sin(freqs[a:b], points["y"])                                # (b - a, oh*ow)
        Fy[:, 2 * a:2 * b:2] = (alpha[a:b, None] * c).T / (n_h * n_w)
        Fy[:, 2 * a + 1:2 * b:2] = -(alpha[a:b, None] * s).T / (n_h * n_w)
    return Fx, Fw, Fy


@dataclass
class Plan:
    """What FourierConv2d needs for one input size, made once (``FourierConv2d._plan``)."""
    oh: int            # output height and width
    ow: int
    kq: int            # taps per phase of the kernel, per axis
    n_h: int           # the phase grid the transforms run over
    n_w: int
    padded: tuple      # (H, W) of the zero-padded input
    F: int             # frequencies kept (half the spectrum)
    Fx: object         # (2F, n_h*n_w) DFT of the input grid
    Fy: object         # (oh*ow, 2F) real part of the inverse DFT
    Fw: object         # (2F, kq*kq) the kernel's DFT (real and imaginary rows interleaved)
    FwT: object        # (kq*kq, 2F) adjoint of the kernel's DFT (real and imaginary rows interleaved)
    chunks: list       # frequency slices of freq_chunk frequencies; chunk fs is rows 2 fs.start:2 fs.stop of Fw


class FourierConv2d(Conv2d):
    """``Conv2d`` (same parameters, same initialisation from the same rng, same results) computed
    per spatial frequency; see the module docstring for the math."""

    freq_chunk = 13       # frequencies whose transformed weights V exist at one time
    keep_spectrum_mb = 128  # keep V from forward for dX when it takes at most this many MB
    channel_block = 256   # phase channels whose weight-gradient spectrum dV exists at one time
    weight_grad_mb = 256  # ... fewer where dV of that many channels, over all frequencies, would exceed this

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._plans = {}

    def _plan(self, h, w):
        """Geometry and transforms for an (h, w) input, made once per input size."""
        itemsize = np.dtype(self.B.dtype).itemsize
        key = (h, w, self.freq_chunk, itemsize)
        if key not in self._plans:
            p, s = self.padding, self.stride
            oh, ow, kq, n_h, n_w = phase_grid(h, w, self.k, s, p)
            Fx, Fw, Fy = dft_matrices(n_h, n_w, kq, oh, ow, dtype=np.dtype(self.B.dtype))
            F = Fx.shape[0] // 2
            chunks = [slice(a, min(a + self.freq_chunk, F)) for a in range(0, F, self.freq_chunk)]
            a = self.B.asarray
            self._plans[key] = Plan(oh=oh, ow=ow, kq=kq, n_h=n_h, n_w=n_w, padded=(h + 2 * p, w + 2 * p),
                                    F=F, Fx=a(Fx), Fy=a(Fy), Fw=a(Fw), FwT=a(Fw.T), chunks=chunks)
        return self._plans[key]

    def weight_grad_block(self, n_freqs: int, itemsize: int, batch: int) -> int:
        """Phase channels per block of the weight-gradient spectrum dV^T, (F, 2 C_out, block):
        ``channel_block``, or fewer where that would exceed ``weight_grad_mb`` (large images have
        many frequencies: 6,272 at 224 x 224, where 256 channels would take 3.3 GB), and no more
        than makes the block as large as the transformed input X, (F, 2N, C'): block <= N C'/C_out.
        dV's size does not depend on the batch, so at small batches it would otherwise be the
        step's largest temporary (at batch 16, 256 channels of PrimaryCaps' dV take 4x X)."""
        per_channel = n_freqs * 2 * self.c_out * itemsize
        as_large_as_X = batch * self.stride ** 2 * self.c_in // self.c_out
        return max(1, min(self.channel_block, as_large_as_X, int(self.weight_grad_mb * 2**20) // per_channel))

    # ---- step 1: stride to channels, and back -----------------------------------------------------
    def _fit(self, x, rows, cols):
        """Crop or zero-pad (N, H, W, C) at the bottom and right to (N, rows, cols, C)."""
        n, h, w, c = x.shape
        if (h, w) == (rows, cols):
            return x
        out = self.B.zeros((n, rows, cols, c), dtype=self.B.dtype_name(x))
        out[:, :min(h, rows), :min(w, cols), :] = x[:, :rows, :cols, :]
        return out

    def _input_to_grid(self, x, g):
        """(N, H, W, C_in) -> xs (n_h*n_w, N*C'): grid point first, channel c' = (r_h, r_w, c)."""
        xp, s = self.B.xp, self.stride
        x = self._fit(self.B.pad_hw(x, self.padding), s * g.n_h, s * g.n_w)
        n = x.shape[0]
        x = xp.reshape(x, (n, g.n_h, s, g.n_w, s, self.c_in))
        x = self.B.contiguous(xp.permute_dims(x, (1, 3, 0, 2, 4, 5)))       # (n_h, n_w, N, s, s, C)
        return xp.reshape(x, (g.n_h * g.n_w, n * s * s * self.c_in))

    def _grid_to_input(self, dxs, n, h, w, g):
        """Adjoint of ``_input_to_grid``: (n_h*n_w, N*C') -> (N, H, W, C_in)."""
        xp, s, p = self.B.xp, self.stride, self.padding
        dx = xp.reshape(dxs, (g.n_h, g.n_w, n, s, s, self.c_in))
        dx = xp.reshape(self.B.contiguous(xp.permute_dims(dx, (2, 0, 3, 1, 4, 5))),
                        (n, s * g.n_h, s * g.n_w, self.c_in))
        dx = self._fit(dx, *g.padded)
        return dx[:, p:p + h, p:p + w, :] if p else dx

    def _phases(self, channels=None):
        """Each kernel phase (r_h, r_w) within the phase channels ``channels`` (a slice of C'; all by
        default): (r_h, r_w, taps a', taps b', its channels c in C_in, their offset in ``channels``).
        Phase (r_h, r_w) holds kernel rows s*a' + r_h, columns s*b' + r_w (ceil((k - r)/s) taps;
        none when the stride exceeds the kernel) as phase channels c' = (r_h*s + r_w)*C_in + c."""
        s, k, c_in = self.stride, self.k, self.c_in
        lo, hi = (0, s * s * c_in) if channels is None else (channels.start, channels.stop)
        out = []
        for rh in range(s):
            for rw in range(s):
                first = (rh * s + rw) * c_in
                a, b = max(lo, first), min(hi, first + c_in)
                if a < b:
                    out.append((rh, rw, len(range(rh, k, s)), len(range(rw, k, s)),
                                slice(a - first, b - first), slice(a - lo, b - lo)))
        return out

    def _kernel_to_grid(self, g):
        """W (k, k, C_in, C_out) -> wsT (kq*kq, C_out*C'): the kernel split into its s x s phases
        like the input, each zero-padded to kq x kq taps, with its two channel axes swapped (so
        that Fw wsT is [V_r^T; V_i^T] per frequency)."""
        xp, kq, s, W = self.B.xp, g.kq, self.stride, self.params["W"]
        wsT = self.B.zeros((kq, kq, self.c_out, s * s * self.c_in), dtype=self.B.dtype_name(W))

        def rows(sl):  # taps a' in sl of every phase: kernel rows s*a' + r_h
            for rh, rw, ta, tb, c, at in self._phases():
                a = range(ta)[sl]
                rows_W = slice(rh + s * a.start, rh + s * a.stop, s)
                wsT[a.start:a.stop, :tb, :, at] = xp.permute_dims(W[rows_W, rw::s, c], (0, 1, 3, 2))

        self.B.over_host_threads(rows, kq)  # a transposing copy, which NumPy makes on one core
        return xp.reshape(wsT, (kq * kq, -1))

    def _add_grid_to_kernel(self, dwsT, channels, g):
        """Adjoint of ``_kernel_to_grid`` for the phase channels ``channels``, added into dL/dW:
        dwsT (kq*kq, C_out*|channels|), the gradient of the kernel grid with its two channel axes
        swapped (as the weight gradient makes it), each phase's taps back to their kernel rows,
        columns and channels (the zero padding has no gradient)."""
        xp, s, kq = self.B.xp, self.stride, g.kq
        dwsT = xp.reshape(dwsT, (kq, kq, self.c_out, -1))

        def rows(sl):  # taps a' in sl of every phase
            for rh, rw, ta, tb, c, at in self._phases(channels):
                a = range(ta)[sl]
                dW_phase = self.grads["W"][rh + s * a.start:rh + s * a.stop:s, rw::s, c]  # a view: += writes into grads["W"]
                dW_phase += xp.permute_dims(dwsT[a.start:a.stop, :tb, :, at], (0, 1, 3, 2))

        self.B.over_host_threads(rows, kq)

    def _spectra(self, wsT, g):
        """The kernel spectrum V = V_r + i V_i a frequency chunk fs at a time, each made by its own
        product (only a chunk of V exists at a time), as VT = [V_r^T; V_i^T] (|fs|, 2 C_out, C')."""
        xp, mm = self.B.xp, self.B.matmul
        for fs in g.chunks:
            rows = slice(2 * fs.start, 2 * fs.stop)                            # (frequency, re|im) rows
            yield fs, xp.reshape(mm(g.Fw[rows], wsT), (fs.stop - fs.start, 2 * self.c_out, -1))

    def keeps_spectrum(self, g, x) -> bool:
        """Whether forward keeps V for backward: when it takes at most ``keep_spectrum_mb`` MB (the
        paper's PrimaryCaps, 52 frequencies: 109 MB; on a 64 x 64 input, 394 frequencies: 826 MB)."""
        size = spectrum_mb(g.F, self.stride ** 2 * self.c_in, self.c_out, x.dtype.itemsize)
        return size <= self.keep_spectrum_mb

    # ---- forward / backward ---------------------------------------------------------------------
    def forward(self, x):
        # x: (N, H, W, C_in) -> y: (N, OH, OW, C_out)
        check_images(type(self).__name__, x, self)
        xp, mm = self.B.xp, self.B.matmul  # products through the backend (see Backend.matmul)
        n, h, w, _ = x.shape
        g = self._plan(h, w)
        F, C = g.F, self.c_out
        X = xp.reshape(mm(g.Fx, self._input_to_grid(x, g)), (F, 2 * n, -1))  # [X_r; X_i] (F, 2N, C')
        wsT = self._kernel_to_grid(g)
        # Y^T: Y_r^T, Y_i^T per frequency, (C_out, N) each.  Made transposed because VT X^T, with V
        # as kept, is the faster product on the CPU than X V through a transposed view of VT.
        YT = self.B.empty((F, 2, C, n), dtype=self.B.dtype_name(x))
        VT = None
        if self.keeps_spectrum(g, x):  # [V_r^T; V_i^T] of every frequency in one product, kept for dX
            VT = xp.reshape(mm(g.Fw, wsT), (F, 2 * C, -1))                     # (F, 2 C_out, C')
        spectra = ((fs, VT[fs]) for fs in g.chunks) if VT is not None else self._spectra(wsT, g)
        for fs, VTf in spectra:
            # (X V)^T in blocks: [V_r^T X_r^T  V_r^T X_i^T; V_i^T X_r^T  V_i^T X_i^T]   (|fs|, 2 C_out, 2N)
            P = mm(VTf, xp.matrix_transpose(X[fs]))
            YT[fs, 0] = P[:, :C, :n] - P[:, C:, n:]   # Y_r^T = (X_r V_r - X_i V_i)^T
            YT[fs, 1] = P[:, C:, :n] + P[:, :C, n:]   # Y_i^T = (X_r V_i + X_i V_r)^T
            del VTf, P  # before the next chunk's are made
        y = mm(g.Fy, xp.reshape(YT, (2 * F, C * n)))                           # (OH*OW, C_out*N)
        # for backward: X, and V (kept) or else the kernel grid wsT to make V again
        self.cache = (X, VT, None if VT is not None else wsT, tuple(x.shape))
        y = xp.reshape(y, (g.oh, g.ow, C, n))
        return xp.permute_dims(y, (3, 0, 1, 2)) + self.params["b"]

    def backward(self, dy, input_grad=True):
        xp, mm = self.B.xp, self.B.matmul
        (X, VT, wsT, x_shape), self.cache = self.cache, None
        n, h, w, _ = x_shape
        g = self._plan(h, w)
        F = g.F
        self.grads["b"] += xp.sum(dy, axis=(0, 1, 2))
        dyg = xp.reshape(self.B.contiguous(xp.permute_dims(dy, (1, 2, 0, 3))), (g.oh * g.ow, -1))
        dY = xp.reshape(mm(xp.matrix_transpose(g.Fy), dyg), (F, 2, n, self.c_out))
        M = self._dY_blocks(dY)                          # [dY_r  dY_i; dY_i  -dY_r] (F, 2N, 2 C_out)
        del dY
        self._weight_grad(X, M, g)
        if not input_grad:
            return None
        c_phase, dtype = X.shape[-1], self.B.dtype_name(X)
        del X  # its last use: free it before dX, as large, is made
        if VT is not None:
            dX = mm(M, VT)                               # [dX_r; dX_i] (F, 2N, C'), V kept
        else:
            dX = self.B.empty((F, 2 * n, c_phase), dtype=dtype)
            for fs, VTf in self._spectra(wsT, g):        # V made again, a chunk at a time
                dX[fs] = mm(M[fs], VTf)
                del VTf
        del M, VT  # V, if kept, is freed before the transform below makes a result as large as dX
        dX = mm(xp.matrix_transpose(g.Fx), xp.reshape(dX, (2 * F, -1)))   # (n_h*n_w, N*C'); frees the spectrum
        return self._grid_to_input(dX, n, h, w, g)

    def _dY_blocks(self, dY):
        """dY (F, 2, N, C_out) -> M = [dY_r  dY_i; dY_i  -dY_r] (F, 2N, 2 C_out): the left factor of
        both gradients (module docstring), assembled from dY's (N, C_out) blocks as they are."""
        F, _, n, C = dY.shape
        M = self.B.empty((F, 2, n, 2, C), dtype=self.B.dtype_name(dY))
        M[:, :, :, 0] = dY                                                     # [dY_r; dY_i]
        M[:, 0, :, 1] = dY[:, 1]                                               # [dY_i; -dY_r]
        M[:, 1, :, 1] = dY[:, 0]
        M[:, 1, :, 1] *= -1                                                    # in place: no temporary
        return self.B.xp.reshape(M, (F, 2 * n, 2 * C))

    def _weight_grad(self, X, M, g):
        """dV = X^H dY for all frequencies, a block of phase channels at a time, made transposed so
        that real and imaginary parts come from one product per frequency:

            [dV_r^T; dV_i^T] = M^T [X_r; X_i],   M = [dY_r  dY_i; dY_i  -dY_r]       (2 C_out, C')

        (dV_r = X_r^T dY_r + X_i^T dY_i, dV_i = X_r^T dY_i - X_i^T dY_r), and turned straight back
        into dL/dW: the adjoint of VT = Fw wsT is dwsT = Fw^T dVT, one product summing over all
        frequencies, real and imaginary rows alike."""
        xp, mm, F = self.B.xp, self.B.matmul, g.F
        n = M.shape[1] // 2
        dYT = xp.matrix_transpose(M)          # (F, 2 C_out, 2N), a transposed view (a copy is slow on the CPU)
        c_phase = X.shape[-1]
        block = self.weight_grad_block(F, X.dtype.itemsize, n)
        for cs in (slice(a, min(a + block, c_phase)) for a in range(0, c_phase, block)):
            dVT = xp.reshape(mm(dYT, X[:, :, cs]), (2 * F, -1))               # rows (f, re|im), cols (o, c')
            self._add_grid_to_kernel(mm(g.FwT, dVT), cs, g)
            del dVT  # before the next block's is made: the peak holds one block of dV

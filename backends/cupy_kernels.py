"""Fused CUDA kernels for the CuPy backend: squash and its backward, routing's softmax over the
output capsules and its backward, and Adam.  Each replaces several elementwise passes and
reductions of the readable function in pycapsnet/core (its reference: the same math, the same
arguments and results) with one kernel launch.  On an H100 the step's elementwise passes, not its
products, were most of its time (docs/performance.md, GPU).

Each kernel is a ``Kernel``: the parameter lists and the body of a ``cupy.ElementwiseKernel``,
built on first use.  The body is plain C over one index ``i`` (one capsule vector, one softmax
column, one weight), so tests/test_cupy_kernels.py also compiles it with the host's C compiler and
compares it with the NumPy reference on the CPU; on a GPU it compares the CuPy kernel itself.

Layouts (C order, as the layers hold them):
    squash           s (..., D): one thread per vector; norm (..., 1) = |s|  (``n`` and ``i`` are
                     CuPy's own names in a kernel)
    softmax          b (N, J, I), over j (axis 1): one thread per (n, i) column
    adam             w, g, m, v of one parameter: one thread per element; the step's scalars
                     (lr / (1 - b1^t) and 1 - b2^t) read from the device, so a recorded step
                     replays with each step's values
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Kernel:
    name: str
    in_params: str    # cupy.ElementwiseKernel's: "raw T s, int32 D"; raw arrays are indexed by the body
    out_params: str   # a non-raw array is its element i (and sets the number of threads)
    body: str


SQUASH = Kernel("pycapsnet_squash", "raw T s, int32 D", "raw T v, T norm", """
    // v = |s|^2 / (1 + |s|^2) * s / |s| = f(n) s, f(n) = n / (1 + n^2): finite at s = 0
    T sum = 0;
    for (int d = 0; d < D; d++) { T x = s[i * D + d]; sum += x * x; }
    T nn = sqrt(sum);
    T f = nn / (1 + nn * nn);
    for (int d = 0; d < D; d++) v[i * D + d] = s[i * D + d] * f;
    norm = nn;
""")

SQUASH_BACKWARD = Kernel("pycapsnet_squash_backward", "raw T s, T norm, raw T dv, int32 D", "raw T ds", """
    // ds = f(n) dv + g(n) (s . dv) s, n = |s|, g(n) = (1 - n^2) / (n (1 + n^2)^2), and 0 at n = 0
    T n2 = norm * norm;
    T f = norm / (1 + n2);
    T g = norm > 0 ? (1 - n2) / (norm * ((1 + n2) * (1 + n2))) : (T)0;
    T dot = 0;
    for (int d = 0; d < D; d++) dot += s[i * D + d] * dv[i * D + d];
    T gd = g * dot;
    for (int d = 0; d < D; d++) ds[i * D + d] = f * dv[i * D + d] + gd * s[i * D + d];
""")

# One thread per column (n, i) of b (N, J, I): element (n, j, i) at (n J + j) I + i.
SOFTMAX = Kernel("pycapsnet_softmax", "raw T b, int32 J, int32 I", "raw T c", """
    // c_ij = exp(b_ij - max_k b_ik) / sum_k exp(b_ik - max_k b_ik), over the output capsules j
    long base = (i / I) * (long)J * I + i % I;
    T top = b[base];
    for (int j = 1; j < J; j++) top = b[base + (long)j * I] > top ? b[base + (long)j * I] : top;
    T sum = 0;
    for (int j = 0; j < J; j++) { T e = exp(b[base + (long)j * I] - top); c[base + (long)j * I] = e; sum += e; }
    for (int j = 0; j < J; j++) c[base + (long)j * I] = c[base + (long)j * I] / sum;
""")

SOFTMAX_BACKWARD = Kernel("pycapsnet_softmax_backward", "raw T c, raw T dc, int32 J, int32 I",
                          "raw T db", """
    // db = c (dc - sum_j c dc), over the output capsules j
    long base = (i / I) * (long)J * I + i % I;
    T dot = 0;
    for (int j = 0; j < J; j++) dot += c[base + (long)j * I] * dc[base + (long)j * I];
    for (int j = 0; j < J; j++) db[base + (long)j * I] = c[base + (long)j * I] * (dc[base + (long)j * I] - dot);
""")

ADAM = Kernel("pycapsnet_adam", "T g, raw T step_size, raw T c2, T b1, T one_minus_b1, T b2, T one_minus_b2, T eps",
              "T w, T m, T v", """
    // m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2;  w <- w - (lr / (1 - b1^t)) m / (sqrt(v / (1 - b2^t)) + eps)
    m = m * b1 + one_minus_b1 * g;
    v = v * b2 + one_minus_b2 * (g * g);
    w = w - step_size[0] * m / (sqrt(v / c2[0]) + eps);
""")

KERNELS = (SQUASH, SQUASH_BACKWARD, SOFTMAX, SOFTMAX_BACKWARD, ADAM)


class CupyKernels:
    """The kernels as the functions of pycapsnet/core they replace (``squash``, ``squash_backward``,
    ``softmax``, ``softmax_backward``: same arguments without ``xp``, same results), and ``adam``.
    Each ``cupy.ElementwiseKernel`` is built on first use (CuPy compiles it on its first launch)."""

    def __init__(self, cupy):
        self._cupy = cupy
        self._built = {}

    def _kernel(self, k: Kernel):
        if k.name not in self._built:
            self._built[k.name] = self._cupy.ElementwiseKernel(k.in_params, k.out_params, k.body, k.name)
        return self._built[k.name]

    def squash(self, s):
        cp = self._cupy
        s = cp.ascontiguousarray(s)
        v, n = cp.empty_like(s), cp.empty((*s.shape[:-1], 1), dtype=s.dtype)
        self._kernel(SQUASH)(s, s.shape[-1], v, n)
        return v, n

    def squash_backward(self, s, n, dv):
        cp = self._cupy
        s, dv = cp.ascontiguousarray(s), cp.ascontiguousarray(dv)
        ds = cp.empty_like(s)
        self._kernel(SQUASH_BACKWARD)(s, cp.ascontiguousarray(n), dv, s.shape[-1], ds)
        return ds

    def softmax(self, b):
        b = self._cupy.ascontiguousarray(b)
        c = self._cupy.empty_like(b)
        columns, j, i = _columns(b)
        self._kernel(SOFTMAX)(b, j, i, c, size=columns)
        return c

    def softmax_backward(self, c, dc):
        c, dc = self._cupy.ascontiguousarray(c), self._cupy.ascontiguousarray(dc)
        db = self._cupy.empty_like(c)
        columns, j, i = _columns(c)
        self._kernel(SOFTMAX_BACKWARD)(c, dc, j, i, db, size=columns)
        return db

    def adam(self, w, g, m, v, step_size, c2, betas, eps):
        """One parameter's Adam update, in place on w, m, v (contiguous arrays of one dtype)."""
        dt = w.dtype.type
        b1, b2 = betas
        self._kernel(ADAM)(g, step_size, c2, dt(b1), dt(1 - b1), dt(b2), dt(1 - b2), dt(eps), w, m, v)


def _columns(b):
    """(N, J, ...) seen as the softmax over axis 1 of N x I columns, I the trailing size:
    (number of columns, J, I)."""
    n, j = b.shape[:2]
    i = b.size // (n * j) if n * j else 0
    return n * i, j, i

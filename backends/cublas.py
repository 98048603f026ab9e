"""cuBLAS called directly (ctypes), for the matrix products of a CuPy step that is being recorded
as a CUDA graph.

CuPy refuses every cuBLAS call on a capturing stream ("calling cuBLAS API during stream capture is
currently unsupported", cupy/cupy#6290), although cuBLAS records into graphs (cuBLAS guide, "CUDA
Graphs support").  So while ``CupyBackend.capture`` records, its ``matmul`` comes here: the libcublas
that CuPy itself loaded, a handle of our own bound to the recording stream, a workspace of its own
(cuBLAS then allocates nothing while recording), alpha and beta passed from the host (recorded by
value).

Layout.  cuBLAS is column-major; our arrays are row-major.  A row-major (r x c) matrix with row
stride c is, read column-major, its transpose with leading dimension c.  So C = A B (row-major) is
computed as C^T = B^T A^T (column-major): ``gemm(op_b, op_a, n, m, k, B, A, C)``.  A transposed
view (``matrix_transpose`` of a C-ordered array) needs no copy: it is the column-major matrix
itself, passed with op = T and leading dimension r.
"""
from __future__ import annotations

import ctypes
import math

import numpy as np

from .base import BackendError

OP_N, OP_T = 0, 1


def matrix_layout(shape, strides, itemsize):
    """How cuBLAS reads the last two axes of an array in place: (op, leading dimension), or None
    when they are neither C-ordered nor a transposed C-ordered matrix (the caller copies them)."""
    rows, cols = shape[-2:]
    s_row, s_col = strides[-2:]
    if (s_col == itemsize or cols == 1) and (s_row == cols * itemsize or rows == 1):
        return OP_N, max(cols, 1)
    if (s_row == itemsize or rows == 1) and (s_col == rows * itemsize or cols == 1):
        return OP_T, max(rows, 1)
    return None


def batch_stride(shape, strides, itemsize):
    """The one stride, in elements, that steps through every matrix of an array's leading axes, or
    None when they are not evenly spaced (the caller copies them).  0 for a single matrix."""
    lead = [(n, s) for n, s in zip(shape[:-2], strides[:-2]) if n != 1]
    if not lead:
        return 0
    step = lead[-1][1]
    if step < 0:
        return None
    for (_, outer), (n, inner) in zip(lead[:-1], lead[1:]):
        if outer != inner * n:
            return None
    return step // itemsize if step % itemsize == 0 else None


class DirectCublas:
    def __init__(self, cupy, stream, workspace_bytes: int = 32 << 20):
        self.cupy = cupy
        self.lib = ctypes.CDLL(_loaded_libcublas())
        handle = ctypes.c_void_p()
        self._check(self.lib.cublasCreate_v2(ctypes.byref(handle)), "cublasCreate")
        self.handle = handle
        self._check(self.lib.cublasSetStream_v2(handle, ctypes.c_void_p(stream.ptr)), "cublasSetStream")
        # allocated from the recording's memory pool (the caller's allocator), kept as long as we are
        self.workspace = cupy.empty(workspace_bytes, dtype=cupy.uint8)
        self._check(self.lib.cublasSetWorkspace_v2(handle, ctypes.c_void_p(self.workspace.data.ptr),
                                                   ctypes.c_size_t(workspace_bytes)), "cublasSetWorkspace")
        self._gemm = {np.dtype(np.float32): (self.lib.cublasSgemmStridedBatched, ctypes.c_float),
                      np.dtype(np.float64): (self.lib.cublasDgemmStridedBatched, ctypes.c_double)}

    def matmul(self, a, b):
        """``a @ b`` for float32 or float64 arrays of two or more axes, leading axes broadcast."""
        cp = self.cupy
        if a.ndim < 2 or b.ndim < 2 or a.dtype != b.dtype or a.dtype not in self._gemm:
            raise BackendError(f"a recorded matmul takes two float32 or float64 arrays of 2+ axes, got "
                               f"{a.dtype}{tuple(a.shape)} @ {b.dtype}{tuple(b.shape)}")
        (m, k), (k_b, n) = a.shape[-2:], b.shape[-2:]
        if k != k_b:
            raise BackendError(f"matmul: {tuple(a.shape)} @ {tuple(b.shape)}: inner sizes differ")
        lead = tuple(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
        c = cp.empty((*lead, m, n), dtype=a.dtype)
        if c.size == 0 or k == 0:
            c[...] = 0
            return c
        op_a, ld_a, stride_a, a = self._operand(a, lead)
        op_b, ld_b, stride_b, b = self._operand(b, lead)
        gemm, scalar = self._gemm[a.dtype]
        one, zero = scalar(1), scalar(0)
        i, ll, p = ctypes.c_int, ctypes.c_longlong, self._pointer
        status = gemm(self.handle, i(op_b), i(op_a), i(n), i(m), i(k), ctypes.byref(one),
                      p(b), i(ld_b), ll(stride_b), p(a), i(ld_a), ll(stride_a),
                      ctypes.byref(zero), p(c), i(n), ll(m * n), i(math.prod(lead)))
        self._check(status, "cublas gemm")
        return c

    def _operand(self, x, lead):
        """(op, leading dimension, batch stride, array) for one operand, copied only when cuBLAS
        cannot read it in place."""
        cp = self.cupy
        if tuple(x.shape[:-2]) != lead and math.prod(x.shape[:-2]) != 1:
            x = cp.ascontiguousarray(cp.broadcast_to(x, (*lead, *x.shape[-2:])))  # partly broadcast
        layout = matrix_layout(x.shape, x.strides, x.itemsize)
        stride = batch_stride(x.shape, x.strides, x.itemsize)
        if layout is None or stride is None:
            x = cp.ascontiguousarray(x)
            layout, stride = matrix_layout(x.shape, x.strides, x.itemsize), batch_stride(x.shape, x.strides, x.itemsize)
        return (*layout, stride, x)

    @staticmethod
    def _pointer(x):
        return ctypes.c_void_p(x.data.ptr)  # where the array's first element is (its offset included)

    @staticmethod
    def _check(status, what):
        if status != 0:
            raise BackendError(f"{what} failed with cuBLAS status {status}")

    def close(self):
        if self.handle is not None:
            self.lib.cublasDestroy_v2(self.handle)
            self.handle = None


def _loaded_libcublas() -> str:
    """The path of the libcublas this process loaded (CuPy's), so that we call the same library."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "/libcublas.so" in line})
    except OSError:
        paths = []
    if not paths:
        raise BackendError("recording a CuPy step needs libcublas loaded by CuPy, and none is "
                           "(run one CuPy matmul first)")
    return paths[0]

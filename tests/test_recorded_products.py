"""What a recorded CuPy step runs instead of CuPy's own products, checked on the CPU: the direct
cuBLAS call's row-major to column-major translation (backends/cublas.py), against a column-major
GEMM written in NumPy; the routing products written as batched matmuls; the namespace's clip.  On a GPU,
test_graph.py's test_captured_step_equals_the_step_op_by_op[cupy] runs them for real."""
import ctypes

import array_api_compat.numpy
import numpy as np
import pytest

from pycapsnet import backends
from pycapsnet.backends import cublas
from pycapsnet.backends import cupy_backend
from pycapsnet.backends.cupy_backend import _CupyNamespace
from tests.conftest import CPU_BACKENDS
from tests.test_backends import ROUTING_PRODUCTS


class _NumpyCublas(cublas.DirectCublas):
    """DirectCublas with NumPy in CuPy's place and, in cuBLAS's, a column-major strided-batched
    GEMM that reads each operand exactly as cuBLAS would: from its first element, with the
    leading dimension and batch stride it is given."""

    def __init__(self):
        self.cupy, self.handle, self._arrays = np, None, {}
        self._gemm = {np.dtype(t): (self._gemm_column_major, c) for t, c in
                      [(np.float32, ctypes.c_float), (np.float64, ctypes.c_double)]}

    def _pointer(self, x):
        self._arrays[id(x)] = x
        return id(x)

    def _gemm_column_major(self, handle, op_a, op_b, m, n, k, alpha, A, lda, stride_a, B, ldb, stride_b,
                           beta, C, ldc, stride_c, batch):
        m, n, k, batch = m.value, n.value, k.value, batch.value

        def matrices(ptr, rows, cols, ld, stride):  # column-major (rows x cols), element (r, c) at r + c*ld
            x = self._arrays[ptr]
            it = x.itemsize
            return np.lib.stride_tricks.as_strided(x, (batch, rows, cols), (stride.value * it, it, ld.value * it))

        def op(ptr, op_x, rows, cols, ld, stride):
            if op_x.value == cublas.OP_N:
                return matrices(ptr, rows, cols, ld, stride)
            return np.swapaxes(matrices(ptr, cols, rows, ld, stride), 1, 2)

        assert beta._obj.value == 0  # C is written, not added to
        prod = op(A, op_a, m, k, lda, stride_a) @ op(B, op_b, k, n, ldb, stride_b)
        matrices(C, m, n, ldc, stride_c)[...] = alpha._obj.value * prod
        return 0


def _t(x):
    return np.swapaxes(x, -1, -2)  # a transposed view, as xp.matrix_transpose gives


CASES = {
    "plain": lambda r: (r(5, 3), r(3, 4)),
    "a transposed": lambda r: (_t(r(3, 5)), r(3, 4)),
    "b transposed": lambda r: (r(5, 3), _t(r(4, 3))),
    "both transposed": lambda r: (_t(r(3, 5)), _t(r(4, 3))),
    "batch @ one matrix": lambda r: (r(6, 5, 3), r(3, 4)),
    "one matrix @ batch": lambda r: (r(5, 3), r(6, 3, 4)),
    "ClassCaps: 4-D @ transposed": lambda r: (r(2, 3, 5, 4), _t(r(2, 3, 6, 4))),
    "size-1 batch broadcast": lambda r: (r(1, 5, 3), r(6, 3, 4)),
    "partly broadcast batch": lambda r: (r(2, 1, 5, 3), r(2, 3, 3, 4)),
    "a slice of the batch": lambda r: (r(8, 5, 3)[2:6], r(8, 3, 4)[1:5]),
    "every other column (copied)": lambda r: (r(5, 6)[:, ::2], r(3, 4)),
    "a single row": lambda r: (r(1, 3), r(3, 4)),
    "a single column": lambda r: (r(5, 3), r(3, 1)),
    "nothing to sum": lambda r: (r(5, 0), r(0, 4)),
}


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("case", CASES)
def test_direct_cublas_product_equals_matmul(case, dtype):
    rng = np.random.default_rng(0)
    a, b = CASES[case](lambda *s: rng.standard_normal(s).astype(dtype))
    got = _NumpyCublas().matmul(a, b)
    assert got.dtype == dtype and got.shape == (a @ b).shape
    np.testing.assert_allclose(got, a @ b, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-6)


def test_direct_cublas_reads_the_recorded_layouts_in_place():
    """The layer's operands -- C-ordered, transposed views, slices of a batch -- go to cuBLAS as
    they are; only a layout cuBLAS cannot read (columns with a gap) is copied."""
    blas, rng = _NumpyCublas(), np.random.default_rng(1)
    for x in (rng.random((4, 3)), _t(rng.random((3, 4))), rng.random((6, 4, 3))[1:5], _t(rng.random((2, 5, 3, 4)))):
        assert blas._operand(x, x.shape[:-2])[-1] is x
    x = rng.random((4, 6))[:, ::2]
    assert blas._operand(x, ())[-1] is not x
    assert cublas.matrix_layout((4, 3), (24, 8), 8) == (cublas.OP_N, 3)
    assert cublas.matrix_layout((4, 3), (8, 32), 8) == (cublas.OP_T, 4)
    assert cublas.batch_stride((2, 3, 4, 5), (480, 160, 40, 8), 8) == 20
    assert cublas.batch_stride((2, 3, 4, 5), (960, 160, 40, 8), 8) is None  # a gap between the 2 blocks


def test_direct_cublas_refuses_what_it_cannot_multiply():
    with pytest.raises(backends.BackendError, match="float32 or float64"):
        _NumpyCublas().matmul(np.ones((2, 2), np.int64), np.ones((2, 2), np.int64))
    with pytest.raises(backends.BackendError, match="inner sizes differ"):
        _NumpyCublas().matmul(np.ones((2, 3)), np.ones((2, 2)))


@pytest.mark.parametrize("spec", CPU_BACKENDS + ["numpy+column-major GEMM"])
@pytest.mark.parametrize("name", ROUTING_PRODUCTS)
def test_routing_products_by_matmul_equal_their_einsum(spec, name):
    # the forms a recording CuPy backend uses: every product through B.matmul, so through cuBLAS --
    # here also through the column-major GEMM above, which reads the operands as cuBLAS would
    B = backends.get(spec.partition("+")[0], dtype="float64")
    if spec.endswith("GEMM"):
        B.matmul = _NumpyCublas().matmul
    subscripts, shapes = ROUTING_PRODUCTS[name]
    rng = np.random.default_rng(2)
    a, b = (rng.standard_normal(s) for s in shapes)
    form = getattr(cupy_backend, f"{name}_by_matmul")
    got = B.to_numpy(form(B, B.asarray(a), B.asarray(b)))
    np.testing.assert_allclose(got, np.einsum(subscripts, a, b), rtol=1e-12, atol=1e-12)


def test_cupy_namespace_clips_with_the_library_and_passes_the_rest_on():
    xp = _CupyNamespace(array_api_compat.numpy, np)  # NumPy stands in for CuPy
    x = np.array([-2.0, 0.5, 3.0], np.float32)
    assert xp.clip(x, min=0.0).tolist() == [0.0, 0.5, 3.0] and xp.clip(x, min=0.0).dtype == np.float32
    assert xp.clip(x, max=1.0).tolist() == [-2.0, 0.5, 1.0]
    assert xp.permute_dims is array_api_compat.numpy.permute_dims

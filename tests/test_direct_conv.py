"""The torch CPU backend's convolution (PyTorch's own kernels, ``B.direct_conv``) against the
layer's im2col products on the same backend, against finite differences in float64, and its switch
(``PYCAPSNET_TORCH_CPU_CONV``).  The im2col form is the one every other backend runs; the autograd
oracle and the cross-backend tests compare whole networks on top of this."""
import numpy as np
import pytest

from pycapsnet import backends
from pycapsnet.core.layers import Conv2d
from pycapsnet.tools.finite_diff import check_layer
from tests.conftest import GPU_BACKENDS, assert_close
from tests.test_fourier import GEOMETRIES

torch = pytest.importorskip("torch")


def _torch(dtype, conv):
    B = backends.get("torch", dtype=dtype)
    B.direct_conv = conv == "direct"
    return B


def _run(B, geometry, input_grad=True, backwards=1):
    """y, dx and the accumulated dW, db of Conv2d for fixed weights, x and dy (host arrays)."""
    c_in, c_out, k, s, p, h, w = geometry
    conv = Conv2d(B, c_in, c_out, k, s, p, rng=np.random.default_rng(0))
    rng = np.random.default_rng(1)
    x = B.asarray(rng.standard_normal((3, h, w, c_in)))
    for _ in range(backwards):  # gradients accumulate over backward calls
        y = conv.forward(x)
        dy = B.asarray(rng.standard_normal(tuple(y.shape)))
        dx = conv.backward(dy, input_grad=input_grad)
    host = lambda a: None if a is None else B.to_numpy(a)
    return host(y), host(dx), host(conv.grads["W"]), host(conv.grads["b"])


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=str)
@pytest.mark.parametrize("dtype,rtol", [("float64", 1e-12), ("float32", 2e-5)])
def test_direct_conv_equals_the_im2col_products(geometry, dtype, rtol):
    direct, im2col = _run(_torch(dtype, "direct"), geometry), _run(_torch(dtype, "im2col"), geometry)
    for what, a, e in zip(("output", "dx", "dW", "db"), direct, im2col):
        assert a.dtype == e.dtype == np.dtype(dtype)
        assert_close(a, e, rtol, what)


def test_direct_conv_accumulates_and_skips_the_input_gradient_when_told():
    geometry = GEOMETRIES[1]
    y, dx, dW, db = _run(_torch("float64", "direct"), geometry, input_grad=False, backwards=2)
    _, _, dW_ref, db_ref = _run(_torch("float64", "im2col"), geometry, input_grad=False, backwards=2)
    assert dx is None
    assert_close(dW, dW_ref, 1e-12, "dW over two backward calls")
    assert_close(db, db_ref, 1e-12, "db over two backward calls")


@pytest.mark.parametrize("geometry", [GEOMETRIES[0], GEOMETRIES[1], GEOMETRIES[3], GEOMETRIES[4]], ids=str)
def test_direct_conv_passes_finite_differences(geometry):
    B = _torch("float64", "direct")
    c_in, c_out, k, s, p, h, w = geometry
    x = np.random.default_rng(2).standard_normal((2, h, w, c_in))
    results = check_layer(B, "Conv2d direct", Conv2d(B, c_in, c_out, k, s, p, rng=np.random.default_rng(0)),
                          x, samples=20)
    assert {r.tensor for r in results} == {"input", "W", "b"}
    bad = [f"{r.tensor}: {r.max_rel:.2e}" for r in results if not r.passed]
    assert not bad, bad


def test_a_wrong_direct_backward_is_caught(monkeypatch):
    """The comparison can fail: a weight gradient off by 1% in the direct path is reported."""
    B = _torch("float64", "direct")
    orig = B.conv2d_backward
    monkeypatch.setattr(B, "conv2d_backward", lambda *a, **k: (lambda dx, dW: (dx, 1.01 * dW))(*orig(*a, **k)))
    direct, im2col = _run(B, GEOMETRIES[0]), _run(_torch("float64", "im2col"), GEOMETRIES[0])
    with pytest.raises(AssertionError):
        assert_close(direct[2], im2col[2], 1e-12, "dW")


def test_the_switch(monkeypatch):
    monkeypatch.delenv("PYCAPSNET_TORCH_CPU_CONV", raising=False)
    assert backends.get("torch").direct_conv
    assert not backends.get("numpy").direct_conv
    for told, expected in (("im2col", False), (" IM2COL ", False), ("torch", True)):
        monkeypatch.setenv("PYCAPSNET_TORCH_CPU_CONV", told)
        assert backends.get("torch").direct_conv is expected
    monkeypatch.setenv("PYCAPSNET_TORCH_CPU_CONV", "onednn")
    with pytest.raises(backends.BackendError, match="PYCAPSNET_TORCH_CPU_CONV='onednn': use 'torch'"):
        backends.get("torch")


def test_a_backend_without_one_says_so():
    B = backends.get("numpy")
    with pytest.raises(NotImplementedError, match="no direct convolution"):
        B.conv2d(None, None, None, 1, 0)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_backends_keep_the_im2col_form(backend):
    """Until cuDNN's kernels are checked on a GPU (determinism of dW, CUDA graphs), the layer's own."""
    assert not backends.get(backend).direct_conv

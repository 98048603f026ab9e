"""The same weights and batch give the same outputs and gradients on every backend:
NumPy vs PyTorch always; CuPy and torch:cuda when a GPU is present."""
import numpy as np
import pytest

from pycapsnet import backends
from pycapsnet import CapsNet
from tests.conftest import GPU_BACKENDS, OTHER_ROUTINGS, SMALL, SMALL_BY_ROUTING, assert_close

pytest.importorskip("torch", reason="cross-backend checks need PyTorch: pip install torch")

RTOL = {"float64": 1e-9, "float32": 1e-4}


def _run(spec, dtype, mode, config=SMALL, n=5):
    model = CapsNet(backends.get(spec, dtype=dtype), seed=11, routing_grad=mode, **config)
    rng = np.random.default_rng(1)
    x = rng.random((n, *model.config.input_shape)).astype(dtype)
    y = rng.integers(0, model.config.n_classes, n)
    out = model.train_step_grads(x, y)
    B = model.B
    res = {"loss": np.array(out.loss), "v": B.to_numpy(out.v), "lengths": B.to_numpy(out.lengths),
           **({} if out.reconstruction is None else {"reconstruction": B.to_numpy(out.reconstruction)})}
    res.update({f"grad {k}": B.to_numpy(g) for k, g in model.grads.items()})
    res["predict"] = model.predict(x)
    return res


def _compare(a, b, dtype):
    assert a.keys() == b.keys()
    for k in a:
        if k == "predict":
            continue
        assert_close(a[k], b[k], RTOL[dtype], what=k)


@pytest.mark.parametrize("products", ["torch", "numpy"], ids=["torch's products", "NumPy's BLAS"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("mode", ["full", "final"])
def test_numpy_vs_torch(dtype, mode, products, monkeypatch):
    """PyTorch's CPU backend with its products by PyTorch itself and by NumPy's BLAS (its choice
    on AMD CPUs, backends/torch_backend.py): both, whatever this machine's CPU."""
    monkeypatch.setenv("PYCAPSNET_TORCH_CPU_MATMUL", products)
    _compare(_run("torch", dtype, mode), _run("numpy", dtype, mode), dtype)


@pytest.mark.parametrize("products", ["torch", "numpy"], ids=["torch's products", "NumPy's BLAS"])
@pytest.mark.parametrize("routing", ["dynamic", "em"])
def test_torch_routing_in_blocks_equals_numpy(products, routing, monkeypatch):
    """PyTorch's CPU backend routes blocks of the batch one after another with its own products, and
    spread over its threads with NumPy's (split_batch).  Either way, blocks of one sample on 2
    threads give NumPy's step to 1e-9 in float64, and with NumPy's products the blocks do run on
    the threads."""
    monkeypatch.setenv("PYCAPSNET_TORCH_CPU_MATMUL", products)
    B = backends.get("torch", dtype="float64")
    B.sample_block, B.threads = 1, 2
    on_threads = []
    run_parts = B._run_parts
    monkeypatch.setattr(B, "_run_parts", lambda fn, slices: (on_threads.append(len(slices)), run_parts(fn, slices)))
    config = SMALL_BY_ROUTING[routing]
    _compare(_run(B, "float64", "full", config), _run("numpy", "float64", "full", config), "float64")
    assert (max(on_threads, default=0) == 5) == (products == "numpy"), on_threads  # 5 samples, 5 blocks


@pytest.mark.parametrize("mode", ["full", "final"])
def test_numpy_vs_torch_shared_transforms(mode):
    """share_spatial routes without û (shared_routing.py), a chunk of positions at a time."""
    config = {**SMALL, "share_spatial": True}
    _compare(_run("torch", "float64", mode, config), _run("numpy", "float64", mode, config), "float64")


def test_numpy_vs_torch_paper_architecture_float32():
    a, b = _run("torch", "float32", "full", config={}, n=3), _run("numpy", "float32", "full", config={}, n=3)
    _compare(a, b, "float32")


@pytest.mark.parametrize("spec", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_gpu_vs_numpy(spec, dtype):
    _compare(_run(spec, dtype, "full"), _run("numpy", dtype, "full"), dtype)
    shared = {**SMALL, "share_spatial": True}
    _compare(_run(spec, dtype, "full", shared), _run("numpy", dtype, "full", shared), dtype)
    _compare(_run(spec, dtype, "full", config={}, n=3), _run("numpy", dtype, "full", config={}, n=3), dtype)


@pytest.mark.parametrize("spec", ["torch"] + GPU_BACKENDS)
@pytest.mark.parametrize("routing", OTHER_ROUTINGS)  # dynamic: the tests above
def test_every_routing_network_on_each_backend_is_numpys(routing, spec):
    """Each built-in routing's small network, one train step: loss, outputs and every gradient on
    torch (CPU), CuPy and torch:cuda against NumPy's, in float64 to 1e-9.  In float32 each backend
    is held to the float64 result, as close as NumPy's own float32 step comes to it (4x, and 1e-4
    of the tensor's scale at least): some of these gradients are ill-conditioned in float32 on any
    backend (self-routing's lengths do not depend on û, so W's gradient is the small part of dv
    across μ̂ that the decoder adds, left after a projection; NumPy's float32 is 2e-3 off there)."""
    config = SMALL_BY_ROUTING[routing]
    truth = _run("numpy", "float64", "full", config)
    mine64, mine32 = _run(spec, "float64", "full", config), _run(spec, "float32", "full", config)
    numpys = _run("numpy", "float32", "full", config)
    assert mine64.keys() == mine32.keys() == truth.keys()
    for k in set(truth) - {"predict"}:
        scale = float(np.abs(truth[k]).max(initial=0))
        if scale < 1e-12:  # analytically zero (the logit head's shared bias)
            assert np.abs(mine64[k]).max(initial=0) < 1e-12 and np.abs(mine32[k]).max(initial=0) < 1e-5, k
            continue
        assert_close(mine64[k], truth[k], RTOL["float64"], what=f"float64 {k}")
        numpy_error = float(np.abs(numpys[k] - truth[k]).max(initial=0)) / scale
        assert_close(mine32[k], truth[k], max(RTOL["float32"], 4 * numpy_error), what=f"float32 {k}")

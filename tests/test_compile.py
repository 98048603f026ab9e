"""The compiled train step (``--compile``; ``CapturedStep(..., compile=True)``): the same hand-written
forward, backward and Adam, traced by torch.compile into fused kernels.  On the CPU it is not
bit-for-bit the plain step -- Inductor's fused kernels and PyTorch's own products (where the plain
step uses NumPy's on AMD CPUs) round differently -- but within float32 rounding of it; and where
compilation is unavailable or fails, the step runs uncompiled after one warning."""
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest

from pycapsnet import CapsNet, backends
from pycapsnet.backends.base import CompileWarning
from pycapsnet.training import optim
from pycapsnet.training.graph import CapturedStep
from tests.conftest import GPU_BACKENDS, SMALL
from tests.test_graph import _batches

torch = pytest.importorskip("torch")


CXX = pytest.param("torch", marks=pytest.mark.skipif(
    not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")),
    reason="torch.compile's CPU code is C++, and no C++ compiler is installed"), id="torch")


@pytest.mark.parametrize("spec", [CXX, GPU_BACKENDS[1]])  # on CUDA: Triton, then a CUDA graph of it
def test_compiled_step_is_the_plain_step_within_float32_rounding(spec):
    from torch._dynamo.utils import counters

    B = backends.get(spec, dtype="float32")
    plain, comp = CapsNet(B, seed=5, **SMALL), CapsNet(B, seed=5, **SMALL)
    opt_p, opt_c = optim.Adam(plain, 1e-2), optim.Adam(comp, 1e-2)
    counters.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileWarning)  # a fallback to the plain step fails the test
        step = CapturedStep(comp, opt_c, batch_size=4, compile=True)
    for k, p in plain.params.items():  # compiling ran the step: the weights are put back
        np.testing.assert_array_equal(B.to_numpy(comp.params[k]), B.to_numpy(p), err_msg=k)
    for k, (x, y) in enumerate(_batches(4, 4, "float32")):
        if k == 2:
            opt_p.lr = opt_c.lr = 5e-3  # a new learning rate reaches the compiled step, uncompiled again
        out_p = plain.train_step_grads(x, y)
        opt_p.step()
        out_c = step(x, y)
        assert out_c.loss == pytest.approx(out_p.loss, rel=1e-5)
        np.testing.assert_array_equal(out_c.predictions, out_p.predictions)
    assert counters["stats"]["unique_graphs"] == 1  # one graph: traced once, never recompiled
    for k, p in plain.params.items():
        w = B.to_numpy(p)
        np.testing.assert_allclose(B.to_numpy(comp.params[k]), w, rtol=0, atol=1e-4 * np.abs(w).max(), err_msg=k)


def test_a_failed_compile_runs_the_step_uncompiled(monkeypatch):
    """torch.compile raising on the first call (no C++ compiler, say): one CompileWarning, and the
    step's own result, then and afterwards."""
    B = backends.get("torch", dtype="float64")
    calls = []

    def broken(fn, **kw):
        def run():
            raise RuntimeError("no C++ compiler found")
        return run

    monkeypatch.setattr(torch, "compile", broken)
    with pytest.warns(CompileWarning, match="no C\\+\\+ compiler found.*uncompiled"):
        f = B.compile(lambda: calls.append(1) or len(calls))
        assert f() == 1
    assert f() == 2 and len(calls) == 2


def test_numpy_has_no_compiler():
    B = backends.get("numpy")
    assert not B.compiles
    with pytest.warns(CompileWarning, match="numpy backend has no compiler"):
        f = B.compile(lambda: 7)
    assert f() == 7


def test_batch_norm_running_statistics_are_put_back_after_recording():
    """Recording runs the step (batch norm in training mode updates its running statistics): they
    are restored with the weights, so the recorded run is the op-by-op run."""
    from pycapsnet import build

    model = build("efficient", backend="numpy").network
    before = {k: np.array(b) for k, b in model.buffers.items()}
    assert before
    CapturedStep(model, optim.Adam(model, 1e-3), batch_size=2)
    for k, b in model.buffers.items():
        np.testing.assert_array_equal(b, before[k], err_msg=k)


def test_cli_compile_on_numpy_says_so_and_trains(tmp_path):
    r = subprocess.run([sys.executable, "train_numpy.py", "--compile", "--limit", "64", "--epochs", "1",
                        "--conv-channels", "8", "--primary-types", "2", "--no-progress", "--out", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "--compile: the numpy backend has no compiler" in r.stdout + r.stderr
    assert "Traceback" not in r.stderr

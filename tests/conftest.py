"""Backend parametrization shared by the tests.

CPU backends (numpy, torch on CPU) always run.  The GPU ones (cupy, torch:cuda) run when the library
and a CUDA GPU are present, and are skipped otherwise with the reason the backend itself gives."""
import os

# The suite runs in parallel (pytest-xdist, ``-n auto`` in setup.cfg).  Each worker takes its share
# of the cores for its BLAS and OpenMP threads, set before NumPy or PyTorch loads them: workers that
# each spun a thread per core would wait on one another.  Subprocesses the tests start inherit it.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
if _workers > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _workers)))

from pycapsnet import backends  # noqa: E402,I001  (first, as in users' scripts: it sets NumPy's BLAS thread timeout)
import numpy as np
import pytest

CPU_BACKENDS = ["numpy", "torch"]


def _gpu_param(spec):
    name = spec.split(":")[0]
    reason = backends.gpu_unavailable_reason(name)
    return pytest.param(spec, marks=pytest.mark.skipif(reason is not None, reason=f"{spec}: {reason}"), id=spec)


GPU_BACKENDS = [_gpu_param("cupy"), _gpu_param("torch:cuda")]


def assert_close(actual, expected, rtol, what=""):
    """Elementwise |a - e| <= rtol * |e| + rtol * max|e|: relative, with the tensor's own scale as
    the floor for entries near zero."""
    actual, expected = np.asarray(actual, float), np.asarray(expected, float)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} vs {expected.shape}"
    scale = float(np.abs(expected).max(initial=0))
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale, err_msg=what)


from pycapsnet.tools.gradcheck import SMALL, SMALL_BY_ROUTING  # noqa: E402,F401  (14x14 networks for float64 checks)

OTHER_ROUTINGS = sorted(r for r in SMALL_BY_ROUTING if r != "dynamic")  # SMALL_BY_ROUTING's beside SMALL

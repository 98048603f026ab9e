"""The backend layer: registry, lazy imports, clear errors, and the convolution primitives."""
import os
import subprocess
import sys

import numpy as np
import pytest

from pycapsnet import backends
from pycapsnet.backends import BackendError
from pycapsnet.backends.numpy_backend import _blas_name
from tests.conftest import CPU_BACKENDS, GPU_BACKENDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_import_pycapsnet_imports_neither_cupy_nor_torch():
    code = ("import sys, pycapsnet; m = pycapsnet.CapsNet('numpy', **{}); "
            "print('torch' in sys.modules, 'cupy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


@pytest.mark.parametrize("products", ["numpy", "torch"])
def test_a_train_step_imports_no_module(products):
    """What a step imports lazily counts in its time and its peak memory: torch.broadcast_shapes,
    once in the torch backend's products, imported sympy (some 500 modules, 34 MB) on first use.
    In a fresh process (the tests themselves import such modules), every routing and CPU backend;
    ``products``: whose BLAS the torch backend's products run on (PYCAPSNET_TORCH_CPU_MATMUL)."""
    pytest.importorskip("torch")
    code = ("import sys, numpy as np, pycapsnet, pycapsnet.training.optim\n"
            "for routing in ('dynamic', 'em', 'attention'):\n"
            "    for name in ('numpy', 'torch'):\n"
            "        model = pycapsnet.CapsNet(name, routing=routing); opt = pycapsnet.training.optim.Adam(model)\n"
            "        x, y = np.random.default_rng(0).random((2, 1, 28, 28)), np.array([1, 3])\n"
            "        before = set(sys.modules)\n"
            "        model.train_step_grads(x, y); opt.step()\n"
            "        print(routing, name, sorted(set(sys.modules) - before)[:5])\n")
    env = {**os.environ, "PYCAPSNET_TORCH_CPU_MATMUL": products}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    lines = out.stdout.splitlines()
    assert len(lines) == 6 and all(line.endswith(" []") for line in lines), out.stdout


def test_unknown_backend_names_the_choices():
    with pytest.raises(BackendError, match="unknown backend 'jax'.*numpy, cupy, torch"):
        backends.get("jax")


def test_missing_library_gives_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` raise ImportError
    with pytest.raises(BackendError, match=r"pip install .*cupy"):
        backends.get("cupy")
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(BackendError, match=r"pip install .*torch"):
        backends.get("torch")


@pytest.mark.parametrize("hidden", ["array_api_compat", "array_api_compat.numpy"])
def test_missing_array_api_compat_is_one_line_with_the_fix(monkeypatch, capsys, hidden):
    """A clone run without ``pip install -e .`` lacks array-api-compat: the backend says what to
    install, and the command line prints it as one line with exit status 2, no traceback."""
    from pycapsnet.tools import cli

    monkeypatch.setitem(sys.modules, "array_api_compat.numpy", None)
    monkeypatch.setitem(sys.modules, hidden, None)
    with pytest.raises(BackendError, match=r"array-api-compat, which is not installed: pip install -e \."):
        backends.get("numpy")
    assert cli.main(["gradcheck", "--backend", "numpy"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: pycapsnet's backends need the package array-api-compat") and "Traceback" not in err


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_cpu_backend_stops_numpys_huge_page_advice(backend, monkeypatch):
    """The heap grows over the first steps; NumPy's madvise(MADV_HUGEPAGE) made each fresh 2 MB page
    cost its whole clearing.  Off once the backend exists, unless NUMPY_MADVISE_HUGEPAGE decides."""
    if backend.startswith("torch"):
        pytest.importorskip("torch")
    setter = np._core.multiarray._set_madvise_hugepage
    before = setter(True)  # returns the setting it replaces
    try:
        monkeypatch.delenv("NUMPY_MADVISE_HUGEPAGE", raising=False)
        backends.get(backend)
        assert setter(True) is False
        monkeypatch.setenv("NUMPY_MADVISE_HUGEPAGE", "1")
        backends.get(backend)
        assert setter(True) is True  # the user's variable: left as it was
    finally:
        setter(before)


HUGE_PAGE_PROBE = """
import backends
B = backends.get("torch")
t = B.torch.ones(8_000_000)  # 32 MB: a tensor PyTorch would advise
p, flags = t.data_ptr(), None
with open("/proc/self/smaps") as f:
    for line in f:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= p < hi
        elif head == "VmFlags:" and inside:
            flags = line.split()[1:]
print("hg" in flags)  # VM_HUGEPAGE: madvise(MADV_HUGEPAGE) marked the tensor's memory
"""


@pytest.mark.skipif(not (os.path.exists("/proc/self/smaps") and os.path.isdir("/sys/kernel/mm/transparent_hugepage")),
                    reason="reads the memory map's flags from Linux's /proc, on a kernel with transparent huge pages")
@pytest.mark.parametrize("env,advised", [({}, False), ({"THP_MEM_ALLOC_ENABLE": "1"}, True)])
def test_the_torch_cpu_backend_keeps_pytorch_from_advising_huge_pages(env, advised):
    """PyTorch advises 2 MB pages for its large CPU tensors where THP_MEM_ALLOC_ENABLE=1 (the backend
    once set it); while the heap grows over the first steps each fresh one is cleared whole.  Off
    unless the user sets it (a fresh process: PyTorch reads it once)."""
    pytest.importorskip("torch")
    base = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    run = subprocess.run([sys.executable, "-c", HUGE_PAGE_PROBE], capture_output=True, text=True, cwd=ROOT,
                         env={**base, "PYTHONPATH": ROOT, **env})
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(advised)


def test_cuda_without_gpu_is_a_clear_error():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present, so asking for one is not an error here")
    with pytest.raises(BackendError, match="torch.cuda.is_available\\(\\) is False"):
        backends.get("torch", device="cuda")
    with pytest.raises(BackendError, match="numpy backend runs on the CPU"):
        backends.get("numpy", device="cuda")


def test_bad_dtype_and_device():
    with pytest.raises(BackendError, match="unsupported dtype 'float16'"):
        backends.get("numpy", dtype="float16")
    pytest.importorskip("torch")
    with pytest.raises(BackendError, match="unknown torch device 'tpu'"):
        backends.get("torch", device="tpu")


@pytest.mark.parametrize("spec", CPU_BACKENDS)
def test_host_threads_follow_pycapsnet_threads_then_omp_num_threads(spec, monkeypatch):
    """PYCAPSNET_THREADS sets the CPU backends' own threads (any count, past the cores); else
    OMP_NUM_THREADS, at most the cores this process may use; a bad value is a BackendError that
    names the fix."""
    monkeypatch.setenv("PYCAPSNET_THREADS", "7")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert backends.get(spec).threads == 7
    monkeypatch.delenv("PYCAPSNET_THREADS")
    assert backends.get(spec).threads == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "100000")
    assert backends.get(spec).threads == len(os.sched_getaffinity(0))
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert backends.get(spec).threads == len(os.sched_getaffinity(0))
    for bad in ("0", "two", "-3"):
        monkeypatch.setenv("PYCAPSNET_THREADS", bad)
        with pytest.raises(BackendError, match="PYCAPSNET_THREADS=.*whole number"):
            backends.get(spec)


def test_busy_cores_measures_other_processes_not_this_one():
    """busy_cores counts the cores other processes keep busy (this process's own CPU time left out):
    a number within the cores this process may use, on Linux; a busy loop here does not add to it
    (whatever else the machine runs meanwhile)."""
    from pycapsnet.backends.host import busy_cores

    cores = len(os.sched_getaffinity(0))
    busy = busy_cores(0.2)
    assert busy is not None and 0.0 <= busy <= cores
    import threading

    stop = threading.Event()
    spin = threading.Thread(target=lambda: [None for _ in iter(stop.is_set, True)])
    spin.start()
    try:
        with_own = busy_cores(0.2)
    finally:
        stop.set()
        spin.join()
    assert with_own is not None and with_own < busy + 0.5, "this process's own busy thread was counted as another's"


@pytest.mark.parametrize("spec", CPU_BACKENDS)
def test_a_busy_machine_is_said_once_with_the_fix_and_never_where_the_user_chose(spec, monkeypatch):
    """Other processes keeping cores busy: one line naming the thread count that would be faster;
    nothing on an idle machine, with one thread, or where PYCAPSNET_THREADS or OMP_NUM_THREADS chose."""
    from pycapsnet.backends import host

    for k in ("PYCAPSNET_THREADS", "OMP_NUM_THREADS"):
        monkeypatch.delenv(k, raising=False)
    B = backends.get(spec)
    B.threads = 4
    monkeypatch.setattr(host, "busy_cores", lambda window=0.1: 1.2)
    note = backends.busy_machine_note(B)
    assert "OMP_NUM_THREADS=3 PYCAPSNET_THREADS=3" in note and "1.2 of this machine's 4 cores" in note
    monkeypatch.setattr(host, "busy_cores", lambda window=0.1: 0.2)
    assert backends.busy_machine_note(B) is None
    monkeypatch.setattr(host, "busy_cores", lambda window=0.1: 3.9)
    assert "OMP_NUM_THREADS=1 " in backends.busy_machine_note(B)  # never fewer than one
    monkeypatch.setattr(host, "busy_cores", lambda window=0.1: None)  # the system does not say
    assert backends.busy_machine_note(B) is None
    monkeypatch.setattr(host, "busy_cores", lambda window=0.1: 2.0)
    for k in ("PYCAPSNET_THREADS", "OMP_NUM_THREADS"):
        monkeypatch.setenv(k, "4")
        assert backends.busy_machine_note(B) is None, k
        monkeypatch.delenv(k)
    B.threads = 1
    assert backends.busy_machine_note(B) is None


def test_name_may_carry_the_device():
    pytest.importorskip("torch")
    B = backends.get("torch:cpu", dtype="float64")
    assert (B.name, B.device, B.dtype) == ("torch", "cpu", "float64")


def _naive_im2col(x, k, s, p):
    x = np.pad(x, ((0, 0), (p, p), (p, p), (0, 0)))
    n, h, w, c = x.shape
    oh, ow = (h - k) // s + 1, (w - k) // s + 1
    return np.array([[x[i, s * a:s * a + k, s * b:s * b + k, :].ravel() for a in range(oh) for b in range(ow)]
                     for i in range(n)]).reshape(n * oh * ow, k * k * c)


@pytest.mark.parametrize("spec", CPU_BACKENDS + GPU_BACKENDS)
@pytest.mark.parametrize("k,s,p", [(3, 1, 0), (3, 2, 1), (9, 2, 0), (2, 3, 2)])
def test_im2col_and_its_adjoint_col2im(spec, k, s, p):
    B = backends.get(spec, dtype="float64")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 11, 10, 3))  # 5 > 2 * threads: the threaded split runs too
    ref = _naive_im2col(x, k, s, p)
    cols = B.to_numpy(B.im2col(B.asarray(x), k, k, s, p))
    np.testing.assert_array_equal(cols, ref)
    g = rng.standard_normal(ref.shape)
    dx = B.to_numpy(B.col2im(B.asarray(g), x.shape, k, k, s, p))
    # <g, im2col(x)> == <col2im(g), x> for all x, g: col2im is exactly the adjoint
    assert np.sum(g * ref) == pytest.approx(np.sum(dx * x), rel=1e-12)


@pytest.mark.parametrize("spec", CPU_BACKENDS + GPU_BACKENDS)
def test_digamma_and_trigamma_are_scipys_to_float64_precision(spec):
    """VB routing's special functions on every backend, over the range its Dirichlet and Wishart
    parameters take; the series form of trigamma (Backend's, which torch and CuPy use) on NumPy too."""
    from scipy import special

    from pycapsnet.backends.base import Backend

    x = np.concatenate([np.geomspace(1e-3, 1e5, 4000), np.linspace(0.25, 12.0, 500)])
    B = backends.get(spec, dtype="float64")
    a = B.asarray(x)
    np.testing.assert_allclose(B.to_numpy(B.digamma(a)), special.digamma(x), rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(B.to_numpy(B.trigamma(a)), special.polygamma(1, x), rtol=5e-15)
    np.testing.assert_allclose(Backend.trigamma(backends.get("numpy", dtype="float64"), x), special.polygamma(1, x),
                               rtol=5e-15)


@pytest.mark.parametrize("spec", CPU_BACKENDS + GPU_BACKENDS)
def test_digamma_and_trigamma_keep_the_backends_dtype(spec):
    """A float32 step stays float32: SciPy's polygamma returns float64 for float32 input, which VB
    routing's backward carried into its float32 gradients."""
    B = backends.get(spec, dtype="float32")
    a = B.asarray(np.linspace(0.5, 20, 7))
    for f in (B.digamma, B.trigamma):
        assert str(f(a).dtype).endswith("float32"), f.__name__


@pytest.mark.parametrize("spec", CPU_BACKENDS)
def test_transfers_dtypes_and_memory(spec):
    B = backends.get(spec, dtype="float32")
    a = B.asarray(np.arange(6.0).reshape(2, 3))
    assert "float32" in str(a.dtype)
    labels = B.asarray(np.array([1, 2]))
    assert "int" in str(labels.dtype)
    np.testing.assert_array_equal(B.to_numpy(a), np.arange(6.0).reshape(2, 3))
    assert B.all_finite(a) and not B.all_finite(B.asarray(np.array([1.0, np.nan])))
    mem = B.memory()
    assert mem["peak"] > 0 and mem["kind"]
    B.synchronize()


# The three routing products, each with its einsum: the definition every form must equal.
ROUTING_PRODUCTS = {
    "weighted_sum": ("nji,injd->njd", [(3, 4, 5), (5, 3, 4, 6)]),       # s_j = sum_i c_ij û_j|i
    "agreement": ("injd,njd->nji", [(5, 3, 4, 6), (3, 4, 6)]),          # û_j|i . v_j
    "outer_sum": ("qnji,qnjd->injd", [(3, 3, 4, 5), (3, 3, 4, 6)]),     # sum_q coeffs[q]_ij vecs[q]_j
}


# PyTorch's CPU backend with its routing products by PyTorch and by NumPy's BLAS (its choice on AMD
# CPUs, backends/torch_backend.py), both on every machine
TORCH_BOTH = [pytest.param("torch", id="torch"), pytest.param("torch+numpy-blas", id="torch, NumPy's BLAS")]


def _routing_backend(backend, monkeypatch):
    if backend.startswith("torch") and ":" not in backend:
        monkeypatch.setenv("PYCAPSNET_TORCH_CPU_MATMUL", "numpy" if backend.endswith("numpy-blas") else "torch")
        backend = "torch"
    return backends.get("numpy" if backend == "default" else backend, dtype="float64")


def routing_product(B, name, a, b, fn=None):
    """B.<name> (or ``fn(B, ...)``, e.g. Backend's own form) on host operands; outer_sum takes its
    stacked operands as lists."""
    a, b = B.asarray(a), B.asarray(b)
    call = (lambda *args: fn(B, *args)) if fn else getattr(B, name)
    return call(list(a), list(b)) if name == "outer_sum" else call(a, b)


@pytest.mark.parametrize("name", ROUTING_PRODUCTS)
@pytest.mark.parametrize("backend", ["numpy"] + TORCH_BOTH + GPU_BACKENDS + ["default"])
def test_routing_products_equal_their_einsum_in_c_order(backend, name, monkeypatch):
    # "default": Backend's plain broadcast form, which a backend inherits unless it overrides it.
    # C order: the layers reshape these results (dû -> (P, T, N, J*D)); a result in another memory
    # order makes each reshape a full copy, and the next matmul leave BLAS.
    from pycapsnet.backends.base import Backend
    B = _routing_backend(backend, monkeypatch)
    subscripts, shapes = ROUTING_PRODUCTS[name]
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal(s) for s in shapes)
    out = routing_product(B, name, a, b, getattr(Backend, name) if backend == "default" else None)
    np.testing.assert_allclose(B.to_numpy(out), np.einsum(subscripts, a, b), rtol=1e-12, atol=1e-12)
    contiguous = out.flags["C_CONTIGUOUS"] if hasattr(out, "flags") else out.is_contiguous()
    assert contiguous, name


@pytest.mark.parametrize("backend", ["numpy"] + TORCH_BOTH + GPU_BACKENDS + ["default"])
def test_outer_sum_writes_into_a_block_of_u_hat(backend, monkeypatch):
    """outer_sum(..., out=): ClassCaps writes each block's dû over that block of û, a strided view
    (I, n, J, D) of the (I, N, J, D) array; the samples outside the block stay as they were."""
    from pycapsnet.backends.base import Backend
    B = _routing_backend(backend, monkeypatch)
    outer_sum = (lambda *a, **k: Backend.outer_sum(B, *a, **k)) if backend == "default" else B.outer_sum
    rng = np.random.default_rng(0)
    coeffs, vecs = rng.standard_normal((3, 2, 4, 5)), rng.standard_normal((3, 2, 4, 6))  # (Q, n, J, I), (Q, n, J, D)
    u_hat = rng.standard_normal((5, 7, 4, 6))                                               # (I, N, J, D)
    held = B.asarray(u_hat)
    returned = outer_sum(list(B.asarray(coeffs)), list(B.asarray(vecs)), out=held[:, 3:5])
    expected = u_hat.copy()
    expected[:, 3:5] = np.einsum("qnji,qnjd->injd", coeffs, vecs)
    np.testing.assert_allclose(B.to_numpy(held), expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(B.to_numpy(returned), expected[:, 3:5], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shared", [False, True], ids=["per position", "shared over positions"])
@pytest.mark.parametrize("backend", ["numpy"] + TORCH_BOTH + GPU_BACKENDS + ["default"])
def test_predictions_and_their_blocks_are_u_hat(backend, shared, threads, monkeypatch):
    """B.predictions is û = W u (P*T products, W broadcast over positions when shared), whatever
    layout the backend stores it in; B.route_block gives a block of its samples.  On NumPy, and on
    PyTorch with NumPy's BLAS, û is sample-major, so a block is read in place (no copy), and the
    products are split over threads (forced here for small shapes)."""
    from pycapsnet.backends.base import Backend
    B = _routing_backend(backend, monkeypatch)
    numpy_products = B if backend in ("numpy", "default") else getattr(B, "_numpy", None)
    if numpy_products is not None:
        numpy_products.threads, numpy_products.parallel_min_elements = threads, 0
    in_place = backend in ("numpy", "torch+numpy-blas")  # û sample-major: a block is a view
    ops = (Backend.predictions, Backend.route_block) if backend == "default" else (None, None)
    predictions = (lambda *a: ops[0](B, *a)) if ops[0] else B.predictions
    route_block = (lambda *a: ops[1](B, *a)) if ops[1] else B.route_block
    rng = np.random.default_rng(0)
    P, T, N, K, J, D = 3, 2, 7, 4, 5, 3
    ut, W_t = rng.standard_normal((P, T, N, K)), rng.standard_normal((1 if shared else P, T, K, J * D))
    u_hat = predictions(B.asarray(ut), B.asarray(W_t))                       # (P, T, N, J*D)
    expected = np.einsum("ptnk,ptkm->ptnm", ut, np.broadcast_to(W_t, (P, T, K, J * D)))
    np.testing.assert_allclose(B.to_numpy(u_hat), expected, rtol=1e-12, atol=1e-12)
    u_hat = B.xp.reshape(u_hat, (P * T, N, J, D))                            # as ClassCaps hands it on
    block = route_block(u_hat, slice(2, 5))
    np.testing.assert_allclose(B.to_numpy(block), expected.reshape(P * T, N, J, D)[:, 2:5], rtol=1e-12, atol=1e-12)
    if in_place:  # a view of û, one contiguous piece of memory
        as_numpy = (lambda a: a) if backend == "numpy" else (lambda a: a.numpy())
        assert np.shares_memory(as_numpy(block), as_numpy(u_hat))
        assert as_numpy(block).transpose(1, 0, 2, 3).flags["C_CONTIGUOUS"]


@pytest.mark.parametrize("threads", [1, 2])
def test_numpy_contiguous_copies_split_over_threads(threads):
    """NumPy's contiguous splits a large copy over its threads (forced here for a small array): the
    same values, C-ordered, a new array; C-ordered input comes back as it is."""
    B = backends.get("numpy", dtype="float64")
    B.threads, B.parallel_pass_elements = threads, 0
    x = np.random.default_rng(0).standard_normal((7, 3, 4, 5)).transpose(2, 0, 3, 1)[:, 1:]
    y = B.contiguous(x)
    assert y.flags["C_CONTIGUOUS"] and not np.shares_memory(x, y)
    np.testing.assert_array_equal(y, x)
    assert B.contiguous(y) is y


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("backend", CPU_BACKENDS + GPU_BACKENDS + ["default"])
def test_relu_and_its_backward_equal_their_definition(backend, threads):
    """B.relu = max(x, 0) and B.relu_backward = dy [y > 0] on every backend, NumPy's split over its
    threads (forced here for a small array); zeros and negative zeros stay off the mask."""
    from pycapsnet.backends.base import Backend
    B = backends.get("numpy" if backend == "default" else backend, dtype="float64")
    B.threads, B.parallel_pass_elements = threads, 0
    relu, relu_backward = ((lambda x: Backend.relu(B, x)), (lambda dy, y: Backend.relu_backward(B, dy, y))) \
        if backend == "default" else (B.relu, B.relu_backward)
    rng = np.random.default_rng(0)
    x, dy = rng.standard_normal((5, 3, 4)), rng.standard_normal((5, 3, 4))
    x[0, 0, :2] = 0.0, -0.0
    y = relu(B.asarray(x))
    np.testing.assert_array_equal(B.to_numpy(y), np.maximum(x, 0))
    np.testing.assert_array_equal(B.to_numpy(relu_backward(B.asarray(dy), y)), np.where(x > 0, dy, 0.0))


# The two sums of EM routing, each case with its einsum.  (N, P, I, C, H) = (2, 3, 5, 4, 6).
X, W, PARENT = (2, 3, 5, 4, 6), (2, 3, 5, 4), (2, 3, 4, 6)
EM_SUMS = {
    "children": ("sum_children", "npic,npich->npch", [W, X]),                   # μ = sum_i w V
    "children, squared": ("sum_children", "npic,npich,npich->npch", [W, X, X]),  # σ² = sum_i w d d
    "entries": ("sum_entries", "npich,npich->npic", [X, X]),
    "entries, weighted": ("sum_entries", "npich,npich,npch->npic", [X, X, PARENT]),  # sum_h d² / σ²
    "entries, a parent's": ("sum_entries", "npich,npch->npic", [X, PARENT]),         # sum_h d dμ
    "entries, a parent's, weighted": ("sum_entries", "npich,npch,npch->npic", [X, PARENT, PARENT]),
}


@pytest.mark.parametrize("case", EM_SUMS)
@pytest.mark.parametrize("backend", CPU_BACKENDS + GPU_BACKENDS + ["default"])
def test_em_routing_sums_equal_their_einsum(backend, case):
    from pycapsnet.backends.base import Backend
    B = backends.get("numpy" if backend == "default" else backend, dtype="float64")
    name, subscripts, shapes = EM_SUMS[case]
    rng = np.random.default_rng(0)
    host = [rng.standard_normal(s) for s in shapes]
    fn = getattr(Backend, name).__get__(B) if backend == "default" else getattr(B, name)
    out = fn(*(B.asarray(a) for a in host))
    np.testing.assert_allclose(B.to_numpy(out), np.einsum(subscripts, *host), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", CPU_BACKENDS + GPU_BACKENDS + ["default"])
def test_em_moments_backward_equals_its_einsum(backend):
    """dV += w (2 dσ² d + dμ) and Σ_h d (dσ² d + dμ): the votes' side of the M-step's backward."""
    from pycapsnet.backends.base import Backend
    B = backends.get("numpy" if backend == "default" else backend, dtype="float64")
    fn = Backend.moments_backward.__get__(B) if backend == "default" else B.moments_backward
    rng = np.random.default_rng(0)
    d, w, dmu, dvar, dV = (rng.standard_normal(s) for s in (X, W, PARENT, PARENT, X))
    dV_out = B.asarray(dV.copy())
    dw = fn(B.asarray(d.copy()), B.asarray(w), B.asarray(dmu), B.asarray(dvar), dV_out)  # d is overwritten
    np.testing.assert_allclose(B.to_numpy(dw), np.einsum("npich,npich,npch->npic", d, d, dvar)
                               + np.einsum("npich,npch->npic", d, dmu), rtol=1e-12, atol=1e-12)
    expected = dV + w[..., None] * (2 * dvar[:, :, None] * d + dmu[:, :, None])
    np.testing.assert_allclose(B.to_numpy(dV_out), expected, rtol=1e-12, atol=1e-12)


def window_children(grid, k, stride):
    """For each slot (p, i) of one image, its child's flat index, by the definition: window
    (oh, ow) at offset (r, c) holds pixel (oh s + r, ow s + c), slot i = (r, c, type)."""
    _, h, w, t = grid
    oh, ow = (h - k) // stride + 1, (w - k) // stride + 1
    return np.array([[((y * stride + r) * w + x * stride + c) * t + ty for r in range(k) for c in range(k)
                      for ty in range(t)] for y in range(oh) for x in range(ow)])


@pytest.mark.parametrize("grid, k, stride", [((2, 6, 6, 2), 3, 1), ((2, 7, 5, 3), 3, 2), ((1, 4, 4, 1), 2, 2)])
@pytest.mark.parametrize("backend", CPU_BACKENDS + GPU_BACKENDS + ["default"])
def test_window_sum_and_max_equal_their_definition(backend, grid, k, stride):
    """Every slot gets the sum (the maximum) of x over the slots that hold its child."""
    from pycapsnet.backends.base import Backend
    B = backends.get("numpy" if backend == "default" else backend, dtype="float64")
    ops = [getattr(Backend, op).__get__(B) if backend == "default" else getattr(B, op)
           for op in ("window_sum", "window_max")]
    child = window_children(grid, k, stride)                          # (P, I)
    x = np.random.default_rng(0).standard_normal((grid[0], *child.shape))
    total, top = np.zeros((grid[0], np.prod(grid[1:]))), np.full((grid[0], np.prod(grid[1:])), -np.inf)
    for n in range(grid[0]):
        np.add.at(total[n], child, x[n])
        np.maximum.at(top[n], child, x[n])
    for op, per_child in zip(ops, (total, top)):
        out = B.to_numpy(op(B.asarray(x), grid, k, stride))
        np.testing.assert_allclose(out, per_child[:, child], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", CPU_BACKENDS + GPU_BACKENDS + ["default"])
def test_matrix_capsule_votes_and_their_backward_equal_their_einsum(backend):
    """V_ij = M_i W_ij, dW_ij = sum_{n,p} M_i^T dV_ij, dM_i = sum_j dV_ij W_ij^T, with 4x4 poses kept flat."""
    from pycapsnet.backends.base import Backend
    B = backends.get("numpy" if backend == "default" else backend, dtype="float64")
    votes, votes_backward = ((Backend.votes.__get__(B), Backend.votes_backward.__get__(B)) if backend == "default"
                             else (B.votes, B.votes_backward))
    rng = np.random.default_rng(0)
    n, p, i, c = 2, 3, 5, 4
    M, W, dV = rng.standard_normal((n, p, i, 16)), rng.standard_normal((i, c, 4, 4)), rng.standard_normal((n, p, i, c, 16))
    V, saved = votes(B.asarray(M), B.asarray(W))
    M6, dV6 = M.reshape(n, p, i, 4, 4), dV.reshape(n, p, i, c, 4, 4)
    np.testing.assert_allclose(B.to_numpy(V), np.einsum("npiab,icbd->npicad", M6, W).reshape(V.shape), atol=1e-12)
    dW, dM = votes_backward(saved, B.asarray(W), B.asarray(dV))
    np.testing.assert_allclose(B.to_numpy(dW), np.einsum("npiab,npicad->icbd", M6, dV6), atol=1e-12)
    np.testing.assert_allclose(B.to_numpy(dM), np.einsum("npicad,icbd->npiab", dV6, W).reshape(M.shape), atol=1e-12)


@pytest.mark.parametrize("spec", CPU_BACKENDS)
@pytest.mark.parametrize("n, sample_size, block, threads", [
    (7, 10, 25, 2), (7, 10, 5, 2), (7, 10, 1000, 1), (1, 10, 5, 2), (3, 10, None, 2)])
def test_split_batch_calls_every_sample_once(spec, n, sample_size, block, threads):
    """Blocks of about ``sample_block`` elements (at least one sample), at least one per thread,
    covering the batch exactly once: EM routing writes each block's result into its slice."""
    B = backends.get(spec, dtype="float64")
    B.sample_block, B.threads = block, threads
    seen = np.zeros(n, int)
    slices = []

    def fn(sl):
        slices.append(sl)
        seen[sl] += 1

    B.split_batch(fn, n, sample_size)
    assert (seen == 1).all()
    if block is None:
        assert slices == [slice(None)]
    else:
        per_block = max(1, block // sample_size)
        assert all(len(range(*sl.indices(n))) <= per_block for sl in slices)
        assert len(slices) >= min(threads, n)


@pytest.fixture
def split_numpy(monkeypatch):
    """A NumPy backend that splits every routing product and small-product batch over 2 threads
    (whatever this machine's core count), recording each split it makes."""
    B = backends.get("numpy", dtype="float64")
    B.threads, B.parallel_min_elements = 2, 0
    B.splits = []
    over_batch = B._over_batch

    def spy(fn, n):
        B.splits.append(n)
        over_batch(fn, n)

    monkeypatch.setattr(B, "_over_batch", spy)
    return B


@pytest.mark.parametrize("name", ROUTING_PRODUCTS)
def test_numpy_routing_products_split_over_threads_match_einsum(split_numpy, name):
    subscripts, shapes = ROUTING_PRODUCTS[name]
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal(s) for s in shapes)
    out = routing_product(split_numpy, name, a, b)
    assert split_numpy.splits == [3], "the batch was not split: the threaded path did not run"
    assert out.flags["C_CONTIGUOUS"]
    np.testing.assert_allclose(out, np.einsum(subscripts, a, b), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape_a,shape_b", [
    ((6, 3, 4, 8), (6, 3, 8, 5)),   # û = u W: one product per (p, t)
    ((6, 3, 4, 8), (1, 3, 8, 5)),   # share_spatial: W broadcast over positions
    ((1, 3, 4, 8), (6, 3, 8, 5)),
])
def test_numpy_matmul_split_over_threads_matches_numpy(split_numpy, shape_a, shape_b):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(shape_a), rng.standard_normal(shape_b)
    out = split_numpy.matmul(a, b)
    assert split_numpy.splits == [6]
    np.testing.assert_allclose(out, a @ b, rtol=1e-12, atol=1e-12)


def test_numpy_matmul_leaves_large_products_to_blas(split_numpy):
    # OpenBLAS threads a product this large itself: splitting the batch too would oversubscribe
    a, b = np.ones((4, 64, 64)), np.ones((4, 64, 64))
    np.testing.assert_array_equal(split_numpy.matmul(a, b), a @ b)
    assert split_numpy.splits == []


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_torch_cpu_products_by_numpys_blas_equal_torchs(dtype, monkeypatch):
    """The products that PyTorch's CPU backend hands to NumPy's BLAS (on AMD CPUs) on views of
    the tensors' memory: plain, batched, broadcast, transposed and sliced operands, as the layers
    pass them, give torch's own products and a new C-ordered tensor."""
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("PYCAPSNET_TORCH_CPU_MATMUL", "numpy")
    B = backends.get("torch", dtype=dtype)
    assert B._numpy is not None
    rng = np.random.default_rng(0)
    t = lambda *s: torch.as_tensor(rng.standard_normal(s)).to(getattr(torch, dtype))
    X = t(5, 6, 9)
    cases = [(t(7, 4), t(4, 300)),                              # a transform: skinny, wide
             (t(6, 3, 4, 8), t(6, 3, 8, 5)),                    # û = u W, one product per (p, t)
             (t(6, 3, 4, 8), t(1, 3, 8, 5)),                    # W broadcast over positions
             (t(5, 6, 4).transpose(1, 2), X[:, :, 2:7]),        # a transposed left factor, a channel slice
             (t(7, 4).T, t(7, 30))]
    for a, b in cases:
        out = B.matmul(a, b)
        assert out.is_contiguous() and out.dtype == a.dtype
        np.testing.assert_allclose(out.numpy(), (a @ b).numpy(), rtol=1e-12 if dtype == "float64" else 1e-5,
                                   atol=1e-12 if dtype == "float64" else 1e-5)
    v = t(4)
    np.testing.assert_array_equal(B.matmul(t(3, 4), v).shape, (3,))  # a vector operand: torch's own


def test_torch_cpu_products_choose_by_cpu_unless_told(monkeypatch):
    pytest.importorskip("torch")
    from pycapsnet.backends import torch_backend

    monkeypatch.delenv("PYCAPSNET_TORCH_CPU_MATMUL", raising=False)
    monkeypatch.setattr(torch_backend, "cpu_vendor", lambda: "AuthenticAMD")
    assert torch_backend._numpy_blas_is_faster() == ("openblas" in _blas_name())
    monkeypatch.setattr(torch_backend, "cpu_vendor", lambda: "GenuineIntel")
    assert not torch_backend._numpy_blas_is_faster()
    for told, expected in (("numpy", True), ("torch", False), (" Torch ", False)):
        monkeypatch.setenv("PYCAPSNET_TORCH_CPU_MATMUL", told)
        assert torch_backend._numpy_blas_is_faster() is expected
    monkeypatch.setenv("PYCAPSNET_TORCH_CPU_MATMUL", "mkl")
    with pytest.raises(backends.BackendError, match="PYCAPSNET_TORCH_CPU_MATMUL='mkl': use 'numpy'"):
        backends.get("torch")


def _env_without_blas_timeout():
    """This environment without OPENBLAS_THREAD_TIMEOUT: a child process sets it itself, or not."""
    return {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}


def test_importing_pycapsnet_sets_the_blas_thread_timeout_unless_given():
    code = "import os, pycapsnet; print(os.environ['OPENBLAS_THREAD_TIMEOUT'])"
    env = _env_without_blas_timeout()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "16"
    env["OPENBLAS_THREAD_TIMEOUT"] = "7"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "7"


def _no_openblas_here():
    """Why OpenBLAS's thread timeout cannot be read here, or '' if it can."""
    from pycapsnet.backends.host import blas_thread_timeout

    return "" if "openblas" in _blas_name() and blas_thread_timeout() is not None else \
        "NumPy's BLAS here is not an OpenBLAS that says its thread timeout"


@pytest.mark.skipif(bool(_no_openblas_here()), reason=_no_openblas_here())
@pytest.mark.parametrize("imports, given, expected", [
    ("import numpy, pycapsnet", None, 16),   # NumPy first, as a notebook does: OpenBLAS is told again
    ("import pycapsnet, numpy", None, 16),
    ("import numpy, pycapsnet", "7", 7),     # the user's own setting is left as it is
])
def test_the_blas_thread_timeout_holds_whichever_came_first_without_a_warning(imports, given, expected):
    """OpenBLAS reads OPENBLAS_THREAD_TIMEOUT when NumPy loads it; imported after NumPy, pycapsnet
    has it read again and restarts its threads (host.rearm_blas_thread_timeout).  The threads must
    then work: products split over the numpy backend's threads and OpenBLAS's own, no warning."""
    code = (f"{imports}; from pycapsnet.backends.host import blas_thread_timeout; "
            "B = pycapsnet.backends.get('numpy'); B.matmul(numpy.ones((1152, 64, 8)), numpy.ones((1152, 8, 160))); "
            "a = numpy.ones((400, 400)); assert float((a @ a)[0, 0]) == 400.0; print(blas_thread_timeout())")
    env = _env_without_blas_timeout()
    if given:
        env["OPENBLAS_THREAD_TIMEOUT"] = given
    out = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, check=True,
                         env=env)
    assert out.stdout.split() == [str(expected)] and out.stderr == "", out.stderr


def test_a_users_own_backends_module_does_not_break_pycapsnet(tmp_path):
    """The package claims no top-level name but ``pycapsnet``: backends/ installs as
    pycapsnet.backends, so a user's ``backends.py`` in the working folder (first on the path) is theirs."""
    (tmp_path / "backends.py").write_text("raise ImportError('the user\'s own backends.py was imported')\n")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])))
    code = ("import pycapsnet, numpy; m = pycapsnet.build('capsnet', conv_channels=8, primary_types=2); "
            "print(m.predict(numpy.zeros((2, 1, 28, 28), numpy.float32)).shape)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "(2,)", out.stderr


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (7, 5)])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("backend", CPU_BACKENDS + GPU_BACKENDS)
def test_channel_affine_is_the_broadcast_multiply_add(backend, dtype, shape):
    """B.channel_affine (batch norm's passes; PyTorch's is one addcmul) against x * a + c."""
    B = backends.get(backend, dtype=dtype)
    rng = np.random.default_rng(0)
    x, a, c = (rng.standard_normal(s).astype(dtype) for s in (shape, shape[-1:], shape[-1:]))
    y = B.channel_affine(B.asarray(x), B.asarray(a), B.asarray(c))
    assert B.dtype_name(y) == dtype and tuple(y.shape) == shape
    np.testing.assert_allclose(B.to_numpy(y), x * a + c, rtol=1e-6 if dtype == "float32" else 1e-14, atol=1e-6)

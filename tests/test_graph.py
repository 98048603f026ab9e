"""A captured train step (pycapsnet.training.graph) computes what the op-by-op step computes: the same losses
and the same weights after several steps, on every backend (a CUDA graph on torch:cuda, a re-run
with host transfers refused elsewhere); and what a graph could not replay is refused on the CPU."""
import argparse
import contextlib
import functools

import numpy as np
import pytest

from pycapsnet import backends
from pycapsnet.backends import BackendError
from pycapsnet import CapsNet, CapsNetError
from pycapsnet.training import flags, loop, optim, trainer
from pycapsnet.training.graph import CapturedEval, CapturedStep
from tests.conftest import CPU_BACKENDS, GPU_BACKENDS, OTHER_ROUTINGS, SMALL, SMALL_BY_ROUTING


def _batches(n_steps, n, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.random((n, 1, 14, 14)).astype(dtype), rng.integers(0, SMALL["n_classes"], n))
            for _ in range(n_steps)]


@pytest.mark.parametrize("name", ["adam", "sgd"])
@pytest.mark.parametrize("spec", CPU_BACKENDS + GPU_BACKENDS)
def test_captured_step_equals_the_step_op_by_op(spec, name):
    B = backends.get(spec, dtype="float64")
    eager, rec = CapsNet(B, seed=5, **SMALL), CapsNet(B, seed=5, **SMALL)
    opt_e, opt_r = optim.make(name, eager, 1e-2), optim.make(name, rec, 1e-2)
    step = CapturedStep(rec, opt_r, batch_size=4)
    # recording ran the step (warm-up): the weights and moments must be back where they were
    for k, p in eager.params.items():
        np.testing.assert_array_equal(B.to_numpy(rec.params[k]), B.to_numpy(p), err_msg=k)
    for k, (x, y) in enumerate(_batches(4, 4, "float64")):
        if k == 2:
            opt_e.lr = opt_r.lr = 5e-3  # a new learning rate reaches the recording
        out_e = eager.train_step_grads(x, y)
        opt_e.step()
        out_r = step(x, y)
        assert out_r.loss == pytest.approx(out_e.loss, rel=1e-12, abs=0)
        assert out_r.parts == pytest.approx(out_e.parts, rel=1e-12)
        np.testing.assert_allclose(B.to_numpy(out_r.lengths), B.to_numpy(out_e.lengths), rtol=1e-12)
    assert opt_r.step_count == opt_e.step_count == 4
    for k, p in eager.params.items():
        np.testing.assert_allclose(B.to_numpy(rec.params[k]), B.to_numpy(p), rtol=1e-10, atol=1e-14, err_msg=k)


@pytest.mark.parametrize("routing", OTHER_ROUTINGS)
@pytest.mark.parametrize("spec", CPU_BACKENDS + GPU_BACKENDS)
def test_every_routing_records_and_replays_its_step(spec, routing):
    """Each built-in routing's small network, three captured steps against three op by op (on the
    CPU the recording is a re-run with host transfers refused, which finds a host copy inside a
    routing before a GPU does).  Random routing draws new coefficients every step: it is never
    recorded, and training runs it op by op."""
    B = backends.get(spec, dtype="float64")
    eager, rec = CapsNet(B, seed=5, **SMALL_BY_ROUTING[routing]), CapsNet(B, seed=5, **SMALL_BY_ROUTING[routing])
    if routing == "random":
        assert not rec.capturable
        return
    opt_e, opt_r = optim.make("adam", eager, 1e-2), optim.make("adam", rec, 1e-2)
    step, evaluation = CapturedStep(rec, opt_r, batch_size=4), CapturedEval(rec, batch_size=4)
    rng = np.random.default_rng(0)
    for _ in range(3):
        x, y = rng.random((4, *rec.config.input_shape)), rng.integers(0, rec.config.n_classes, 4)
        out_e = eager.train_step_grads(x, y)
        opt_e.step()
        assert step(x, y).loss == pytest.approx(out_e.loss, rel=1e-12, abs=0)
        assert evaluation(x, y).loss == pytest.approx(eager.loss(x, y).loss, rel=1e-12, abs=0)
    for k, p in eager.params.items():
        np.testing.assert_allclose(B.to_numpy(rec.params[k]), B.to_numpy(p), rtol=1e-10, atol=1e-14, err_msg=k)


@pytest.mark.parametrize("spec", CPU_BACKENDS + GPU_BACKENDS)
def test_captured_evaluation_equals_the_evaluation_op_by_op(spec):
    """Losses, class scores and predicted classes as model.loss gives them, batch after batch, and
    after the weights change (a train step between two evaluations); recording changes no weight."""
    B = backends.get(spec, dtype="float64")
    model = CapsNet(B, seed=5, **SMALL)
    before = {k: B.to_numpy(p).copy() for k, p in model.params.items()}
    evaluation = CapturedEval(model, batch_size=4)
    for k, p in model.params.items():
        np.testing.assert_array_equal(B.to_numpy(p), before[k], err_msg=k)
    opt = optim.Adam(model, 1e-2)
    for k, (x, y) in enumerate(_batches(3, 4, "float64", seed=1)):
        if k == 2:
            model.train_step_grads(x, y)
            opt.step()
        out_r = evaluation(x, y)
        out_e = model.loss(x, y)
        assert out_r.loss == pytest.approx(out_e.loss, rel=1e-12, abs=0)
        assert out_r.parts == pytest.approx(out_e.parts, rel=1e-12)
        np.testing.assert_array_equal(out_r.predictions, out_e.predictions)
        np.testing.assert_allclose(B.to_numpy(out_r.lengths), B.to_numpy(out_e.lengths), rtol=1e-12)
    with pytest.raises(CapsNetError, match="captured evaluation takes batches of 4, got 3"):
        evaluation(*_batches(1, 3, "float64")[0])
    with pytest.raises(CapsNetError, match="takes labels y with the images"):
        evaluation(_batches(1, 4, "float64")[0][0])
    prediction = CapturedEval(model, batch_size=4, labels=False)  # model.predict's forward
    for x, _ in _batches(2, 4, "float64", seed=2):
        np.testing.assert_array_equal(prediction(x).predictions, model.predict(x))


def test_a_host_transfer_inside_the_recorded_step_is_refused(monkeypatch):
    pytest.importorskip("torch")
    B = backends.get("torch", dtype="float64")
    model = CapsNet(B, seed=0, **SMALL)
    real = CapsNet.loss_on_device

    def loss_with_a_host_read(self, x, y):
        out = real(self, x, y)
        out.loss  # reads the device: a graph could not replay this
        return out

    monkeypatch.setattr(CapsNet, "loss_on_device", loss_with_a_host_read)
    with pytest.raises(BackendError, match="inside a captured step"):
        CapturedStep(model, optim.Adam(model), batch_size=2)
    assert not B._host_transfers_refused  # the refusal ends with the failed capture


def test_captured_step_takes_only_its_batch_size():
    model = CapsNet("numpy", seed=0, **SMALL)
    step = CapturedStep(model, optim.Adam(model), batch_size=4)
    x, y = _batches(1, 3, "float32")[0]
    with pytest.raises(CapsNetError, match="batches of 4, got 3"):
        step(x, y)
    for bad in (0, 2.5, "4"):
        with pytest.raises(CapsNetError, match=f"batch_size must be a whole number of at least 1, got {bad!r}"):
            CapturedStep(model, optim.Adam(model), batch_size=bad)


@pytest.mark.parametrize("recording, limit, expected", [
    (CapturedStep, 80, [32, 32] * 2),   # batches of 32: 80 = 32 + 32 + 16, the 16 ran op by op
    (CapturedEval, 32, [16, 16] * 2),   # test batches of 16 here: 40 = 16 + 16 + 8
], ids=["step", "evaluation"])
def test_trainer_uses_the_recordings_for_full_batches(tmp_path, monkeypatch, recording, limit, expected):
    """With a backend that can capture, the trainer records the step and the evaluation (in batches
    of loop.EVAL_BATCH); the last, smaller batch of each runs op by op.  Same numbers as
    --no-graph.  (torch on the CPU, told it can capture: the recording is then a re-run with host
    transfers refused, so this checks the trainer's bookkeeping.)"""
    torch_backend = pytest.importorskip("pycapsnet.backends.torch_backend")
    monkeypatch.setattr(torch_backend.TorchBackend, "can_capture", True)
    monkeypatch.setattr(loop, "EVAL_BATCH", 16)
    calls = []
    real_call = recording.__call__
    monkeypatch.setattr(recording, "__call__", lambda self, x, y: calls.append(len(y)) or real_call(self, x, y))
    argv = ["--conv-channels", "16", "--primary-types", "4", "--limit", str(limit), "--limit-test", "40",
            "--batch-size", "32", "--epochs", "2", "--no-progress", "--dtype", "float64"]
    args = argparse.ArgumentParser()
    flags.add_arguments(args, "torch")
    a = trainer.train(trainer.describe(args.parse_args(argv + ["--out", str(tmp_path / "a")]), "torch"))
    assert calls == expected
    b = trainer.train(trainer.describe(args.parse_args(argv + ["--out", str(tmp_path / "b"), "--no-graph"]), "torch"))
    assert len(calls) == len(expected)
    for k in ("train_loss", "train_acc", "test_loss", "test_acc"):
        assert a[k] == pytest.approx(b[k], rel=1e-12), k


def test_the_recorded_step_makes_no_tensor_from_host_data(monkeypatch):
    """What CUDA refuses inside a graph capture: copying host data to the device.  Array-API
    wrappers do that behind a call such as ``xp.maximum(x, 0)`` (the 0 becomes a tensor first), so
    our own guard cannot see it: here torch's tensor constructors refuse while the step is recorded."""
    torch = pytest.importorskip("torch")
    B = backends.get("torch", dtype="float32")
    model = CapsNet(B, seed=0, **SMALL)
    made = []
    for name in ("asarray", "as_tensor", "tensor"):
        real = getattr(torch, name)

        def guarded(*args, _real=real, _name=name, **kwargs):
            if B._host_transfers_refused:
                made.append(_name)
                raise RuntimeError(f"torch.{_name} inside the recorded step")
            return _real(*args, **kwargs)

        monkeypatch.setattr(torch, name, guarded)
    CapturedStep(model, optim.Adam(model), batch_size=2)
    assert made == []


class _FakeCuda:
    """Stands in for ``cupy.cuda`` on a machine without a GPU, logging what CupyBackend.capture asks
    of it: which allocator and stream each run of the step saw, and whether the stream captured."""

    def __init__(self):
        self.log, self.allocator, self.capturing = [], None, False
        self.null = self.current = self.Stream(self, name="null")

    class MemoryPool:
        def malloc(self, size):
            raise AssertionError("not called by the fake step")

        def used_bytes(self):
            return 3

        def total_bytes(self):
            return 5

    class Stream:
        def __init__(self, cuda, non_blocking=False, name="side"):
            self.cuda, self.name = cuda, name

        def __enter__(self):
            self.outer, self.cuda.current = self.cuda.current, self
            return self

        def __exit__(self, *exc):
            self.cuda.current = self.outer

        def record(self):
            return f"event on {self.name}"

        def wait_event(self, event):
            self.cuda.log.append(f"{self.name} waits for {event}")

        def begin_capture(self):
            self.cuda.capturing = True

        def end_capture(self):
            self.cuda.capturing = False
            cuda = self.cuda
            return type("Graph", (), {"launch": lambda _, stream: cuda.log.append(f"graph on {stream.name}")})()

    def get_current_stream(self):
        return self.current

    @contextlib.contextmanager
    def using_allocator(self, allocator):
        self.allocator = allocator
        try:
            yield
        finally:
            self.allocator = None


class _FakeBlas(str):  # stands in for backends.cublas.DirectCublas
    def __new__(cls, name, log):
        self = super().__new__(cls, name)
        self.log = log
        return self

    def close(self):
        self.log.append(f"{self} closed")


def _fake_cupy_backend():
    cupy_backend = pytest.importorskip("pycapsnet.backends.cupy_backend")
    B = cupy_backend.CupyBackend.__new__(cupy_backend.CupyBackend)  # no cupy or GPU needed for capture
    cuda = _FakeCuda()
    cuda.Stream = functools.partial(_FakeCuda.Stream, cuda)
    B.lib = type("cupy", (), {"cuda": cuda, "get_default_memory_pool": staticmethod(_FakeCuda.MemoryPool)})
    B._graph_pools, B._graph_blas, B._direct_cublas = [], [], None
    B._make_direct_cublas = lambda stream: _FakeBlas(f"cuBLAS handle on {stream.name}", cuda.log)
    return B, cuda


def test_cupy_records_the_step_on_a_side_stream_into_a_pool_of_its_own():
    """CupyBackend.capture without a GPU: the order of its CUDA calls, which the GPU tests check in
    earnest (test_captured_step_equals_the_step_op_by_op[cupy])."""
    B, cuda = _fake_cupy_backend()

    def step():
        cuda.log.append((cuda.current.name, cuda.allocator is not None and cuda.allocator.__self__ is B._graph_pools[-1],
                         B._host_transfers_refused, cuda.capturing, B._direct_cublas))

    replay = B.capture(step)
    assert cuda.log == ["side waits for event on null",
                        ("side", True, False, False, None),  # warm-up: compile kernels, build constants
                        ("side", True, True, False, "cuBLAS handle on side"),  # warm-up, no host transfers,
                        ("side", True, True, True, "cuBLAS handle on side"),   # recorded   products by cuBLAS
                        "null waits for event on side"]
    assert cuda.current is cuda.null and cuda.allocator is None and not B._host_transfers_refused
    assert B._direct_cublas is None and B._graph_blas == ["cuBLAS handle on side"]  # kept: its workspace
    del cuda.log[:]
    replay()
    replay()
    assert cuda.log == ["graph on null", "graph on null"]  # replays launch the graph; the step does not run
    assert B.memory()["peak"] == 10  # CuPy's default pool and the graph's own


def test_cupy_ends_a_failed_recording_and_reports_the_step_error():
    B, cuda = _fake_cupy_backend()
    runs = []

    def step():
        runs.append(cuda.capturing)
        if cuda.capturing:
            raise ValueError("a host read")

    with pytest.raises(ValueError, match="a host read"):
        B.capture(step)
    assert runs == [False, False, True]
    assert cuda.log[-1] == "cuBLAS handle on side closed"  # a failed recording keeps no handle
    assert not cuda.capturing and cuda.current is cuda.null and cuda.allocator is None
    assert not B._host_transfers_refused and B._direct_cublas is None


def test_cupy_takes_no_products_a_recording_refuses():
    """A CUDA graph refuses CuPy's own matmul (it calls cuBLAS during the capture): every NumPy-backend
    method that calls the library's matmul itself is replaced on the CuPy backend, by Backend's form
    or its own, unless it never runs there.  (The EM sums once slipped through: sum_children_pair.)"""
    import inspect
    import re

    from pycapsnet.backends.cupy_backend import CupyBackend
    from pycapsnet.backends.numpy_backend import NumpyBackend

    never_on_cupy = {"predictions": "falls back to Backend's where the library is not NumPy",
                     "_matmul_into": "only slotwise_votes calls it, and CuPy's votes are Backend's"}
    inherited = [name for name, fn in vars(NumpyBackend).items()
                 if callable(fn) and re.search(r"matmul\(|\s@\s", inspect.getsource(fn))
                 and getattr(CupyBackend, name) is fn and name not in never_on_cupy]
    assert inherited == []
    assert "lib is not np" in inspect.getsource(NumpyBackend.predictions)
    assert "_matmul_into" not in inspect.getsource(CupyBackend.votes)

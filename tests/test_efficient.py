"""Efficient-CapsNet (Mazzia et al. 2021) built from parts: batch normalisation, depthwise primary
capsules, Efficient-CapsNet's squash, self-attention routing.  Each part against finite differences
(gradcheck.efficient_layer_checks, run by test_gradcheck too), against PyTorch autograd in both
batch-norm modes, numpy against torch, its running statistics against torch's, the built-in
description's parameter count, training from the CLI with a bit-identical resume, and bad input."""
import json

import numpy as np
import pytest

from pycapsnet import backends
from pycapsnet import CapsNetError
from pycapsnet.core import architecture as A
from pycapsnet.core.batch_norm import BatchNorm
from pycapsnet.tools import gradcheck
from pycapsnet.training import checkpoint
from tests.conftest import CPU_BACKENDS, assert_close

torch = pytest.importorskip("torch", reason="the autograd oracle needs PyTorch: pip install torch")
from pycapsnet.tools.reference import AutogradNetwork  # noqa: E402


def _small(backend, seed=1):
    """Efficient-CapsNet's structure at a checkable size, its routing and batch norm away from init."""
    model = gradcheck.away_from_init(A.build(gradcheck.efficient_architecture(), backends.get(backend, dtype="float64"),
                                             seed=seed), seed)
    rng = np.random.default_rng(seed)
    for name, layer in model.body:
        if isinstance(layer, BatchNorm):
            layer.params["gamma"][...] = model.B.asarray(1 + 0.3 * rng.standard_normal(layer.channels))
            layer.params["beta"][...] = model.B.asarray(0.3 * rng.standard_normal(layer.channels))
            layer.buffers["running_mean"][...] = model.B.asarray(0.2 * rng.standard_normal(layer.channels))
            layer.buffers["running_var"][...] = model.B.asarray(0.5 + rng.random(layer.channels))
    return model


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_every_new_layer_passes_finite_differences(backend):
    results = gradcheck.efficient_layer_checks(backends.get(backend, dtype="float64"), samples=15)
    names = {r.layer for r in results}
    assert {"BatchNorm training image", "BatchNorm evaluation image", "BatchNorm training features",
            "DepthwiseConv2d 3x3/2 pad1", "PrimaryCaps depthwise squash=efficient"} <= names
    bad = [f"{r.layer} / {r.tensor}: {r.max_rel:.2e}" for r in results if not r.passed]
    assert not bad, bad


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("training", [True, False], ids=["training", "evaluation"])
def test_the_network_matches_autograd_in_both_modes(backend, training):
    """The loss to 1e-12 and every gradient, the input's too, to 1e-10 of the largest entry of
    autograd's, with batch norm normalising by the batch (training) or the running statistics."""
    model = _small(backend)
    model.train(training)
    rng = np.random.default_rng(3)
    x, y = rng.random((5, 1, 9, 9)), rng.integers(0, 3, 5)
    before = {k: model.B.to_numpy(b).copy() for k, b in model.buffers.items()}
    model.zero_grad()
    out = model.loss(x, y)
    dx = model.backward(input_grad=True)
    ref = AutogradNetwork.from_model(model, dtype=torch.float64)
    ref.buffers = {k: torch.as_tensor(v) for k, v in before.items()}  # the statistics the forward started from
    loss_ref, g = ref.grads(x, y, input_grad=True)
    assert out.loss == pytest.approx(loss_ref, rel=1e-12)
    assert set(g) == {"input", *model.params}
    for k, want in g.items():
        assert_close(model.B.to_numpy(dx if k == "input" else model.grads[k]), want, 1e-10, what=k)


def test_running_statistics_follow_torch_and_only_in_training():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 5, 6, 3)) * 2 + 1                       # channels-last
    for backend in CPU_BACKENDS:
        bn = BatchNorm(backends.get(backend, dtype="float64"), 3, momentum=0.3, eps=1e-3)
        rm, rv = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
        for _ in range(2):
            bn.forward(bn.B.asarray(x))
            torch.nn.functional.batch_norm(torch.as_tensor(x).permute(0, 3, 1, 2), rm, rv, training=True,
                                           momentum=0.3, eps=1e-3)
        assert_close(bn.B.to_numpy(bn.buffers["running_mean"]), rm.numpy(), 1e-14, "running mean")
        assert_close(bn.B.to_numpy(bn.buffers["running_var"]), rv.numpy(), 1e-14, "running var (unbiased)")
        bn.train(False)
        bn.forward(bn.B.asarray(x + 5))
        assert_close(bn.B.to_numpy(bn.buffers["running_mean"]), rm.numpy(), 1e-14, "evaluation leaves them be")


def test_numpy_and_torch_agree():
    grads = []
    for backend in CPU_BACKENDS:
        model = _small(backend)
        rng = np.random.default_rng(4)
        model.zero_grad()
        model.loss(rng.random((4, 1, 9, 9)), rng.integers(0, 3, 4))
        dx = model.backward(input_grad=True)
        grads.append({"input": model.B.to_numpy(dx), **{k: model.B.to_numpy(g) for k, g in model.grads.items()},
                      **{k: model.B.to_numpy(b) for k, b in model.buffers.items()}})
    for k in grads[0]:
        assert_close(grads[1][k], grads[0][k], 1e-12, what=k)


def test_the_built_in_description_counts_the_papers_parameters():
    """161,824 trainable parameters without the decoder (batch norm's γ and β, not its running
    statistics), on MNIST's 28x28 digits; the description is a JSON file the package carries."""
    import pycapsnet

    model = pycapsnet.build("efficient")
    net = model.network
    params = {k: int(np.prod(p.shape)) for k, p in net.params.items()}
    assert sum(v for k, v in params.items() if not k.startswith("decoder")) == 161_824
    assert sorted(net.buffers) == sorted(f"bn{k}.running_{s}" for k in range(1, 5) for s in ("mean", "var"))
    assert A.DESCRIBED["efficient"] == "efficient.json" and "efficient" in A.load("efficient")["body"][-2]["squash"]
    assert "161,824" not in repr(net) and f"{net.n_params():,}" in model.summary()


def test_the_autograd_reference_runs_the_full_size_network():
    """The 28x28 network, one batch of 2, float64: what bench.py compares the step with."""
    arch = dict(A.load("efficient"), input_shape=[1, 28, 28], n_classes=10)
    model = A.build(arch, backends.get("numpy", dtype="float64"), seed=0)
    rng = np.random.default_rng(0)
    x, y = rng.random((2, 1, 28, 28)), np.array([3, 7])
    model.train_step_grads(x, y)
    _, g = AutogradNetwork.from_model(model, dtype=torch.float64).grads(x, y)
    for k, ref in g.items():
        assert_close(model.grads[k], ref, 1e-9, what=k)


def test_trains_from_the_cli_and_resumes_bit_identical(tmp_path):
    """--network efficient on the embedded digits; the running statistics are in the checkpoint,
    and a run resumed after its first epoch ends where an uninterrupted one does."""
    from pycapsnet.training.trainer import main as train_main

    common = ["--network", "efficient", "--limit", "48", "--batch-size", "16", "--no-progress", "--no-graph"]
    whole, part = str(tmp_path / "whole"), str(tmp_path / "part")
    assert train_main("numpy", [*common, "--epochs", "2", "--out", whole]) == 0
    assert train_main("numpy", [*common, "--epochs", "1", "--out", part]) == 0
    assert train_main("numpy", ["--resume", part, "--epochs", "2", "--no-progress", "--no-graph"]) == 0
    a, b = (checkpoint.load(f"{d}/checkpoint.npz") for d in (whole, part))
    assert "bn4.running_var" in a["params"] and not np.allclose(a["params"]["bn4.running_var"], 1)
    for k in a["params"]:
        np.testing.assert_array_equal(a["params"][k], b["params"][k], err_msg=k)


@pytest.mark.parametrize("change, says", [
    ({"layer": "batch_norm", "momentum": 1.5}, "momentum must be a finite number in [0, 1]"),
    ({"layer": "batch_norm", "eps": 0}, "eps must be a finite number in (0, 1]"),
    ({"layer": "batch_norm", "eps": -1e-3}, "eps must be a finite number in (0, 1]"),
    ({"layer": "primary_caps", "types": 8, "dim": 8, "kernel": 3, "stride": 1, "conv": "depthwise"},
     "cannot give 64"),
    ({"layer": "primary_caps", "types": 2, "dim": 4, "kernel": 3, "squash": "sabuor"}, "squash must be one of"),
])
def test_bad_options_are_refused_at_build_time_naming_the_layer(change, says, tmp_path):
    from pycapsnet.training.trainer import main as train_main

    body = [A.conv2d(8, 3, name="conv1"), {**change, "name": "odd"}] + \
        ([] if change["layer"] == "primary_caps" else [A.primary_caps(2, 4, 3, 1)]) + [A.attention_caps(3, 4)]
    arch = A.network(body, input_shape=(1, 9, 9), n_classes=3)
    with pytest.raises(CapsNetError, match="layer 'odd'") as e:
        A.build(arch, "numpy")
    assert says in str(e.value) and "\n" not in str(e.value)
    path = tmp_path / "odd.json"
    path.write_text(json.dumps(arch))
    assert train_main("numpy", ["--network", str(path), "--limit", "16", "--no-progress", "--out",
                                str(tmp_path / "run")]) == 2


def test_batch_norm_refuses_one_value_per_channel_in_training():
    model = A.build(A.network([A.conv2d(4, 3), A.batch_norm(name="bn"), A.primary_caps(2, 2, 1, 1),
                               A.dynamic_caps(3, 4)], input_shape=(1, 3, 3), n_classes=3), "numpy")
    with pytest.raises(CapsNetError, match="more than one value per channel"):
        model.loss(np.zeros((1, 1, 3, 3), np.float32), np.array([0]))
    model.train(False)
    assert model.predict(np.zeros((1, 1, 3, 3), np.float32)).shape == (1,)  # evaluation: the running statistics


def test_the_whole_loss_passes_finite_differences_and_a_broken_backward_fails(monkeypatch):
    """Every parameter and the input of the small network's loss (batch norm in training mode);
    then a batch norm backward that forgets the batch's statistics depend on x is caught."""
    results = gradcheck.network_checks(backends.get("numpy", dtype="float64"), _small("numpy"), "efficient",
                                       samples=10)
    assert {"input", "bn1.gamma", "bn2.beta", "primary.W", "classcaps.bias", "decoder1.W"} <= {r.tensor for r in results}
    assert all(r.passed for r in results), [(r.tensor, r.max_rel) for r in results if not r.passed]
    monkeypatch.setattr(BatchNorm, "backward", lambda self, dy, input_grad=True: _as_if_constant(self, dy))
    broken = gradcheck.network_checks(backends.get("numpy", dtype="float64"), _small("numpy"), "efficient", samples=10)
    assert any(not r.passed for r in broken if r.tensor in ("input", "conv1.W"))


def _as_if_constant(bn, dy):
    """Batch norm's backward as if μ and σ² were constants: right in evaluation mode only."""
    xp = bn.B.xp
    (x_hat, r, _), bn.cache = bn.cache, None
    axes = tuple(range(dy.ndim - 1))
    bn.grads["beta"] += xp.sum(dy, axis=axes)
    bn.grads["gamma"] += xp.sum(dy * x_hat, axis=axes)
    return dy * bn.params["gamma"] * r


def test_gradcheck_cli_checks_a_described_network(tmp_path, capsys):
    from pycapsnet.tools.cli import main

    path = tmp_path / "small.json"
    path.write_text(json.dumps(gradcheck.efficient_architecture()))
    assert main(["gradcheck", "--network", str(path), "--samples", "4"]) == 0
    out = capsys.readouterr().out
    assert "bn2" in out and "primary" in out and "FAIL" not in out


def test_trains_from_python_and_saves_its_running_statistics(tmp_path):
    import pycapsnet

    (x, y), (xt, yt) = pycapsnet.load_digits()
    model = pycapsnet.build("efficient", seed=0)
    history = model.fit(x[:48], y[:48], epochs=1, batch_size=16)
    assert len(history) == 1 and 0 <= model.evaluate(xt[:32], yt[:32])["accuracy"] <= 1
    model.save(str(tmp_path / "e.npz"))
    same = pycapsnet.load(str(tmp_path / "e.npz"))
    for k, b in model.network.buffers.items():
        np.testing.assert_array_equal(same.network.B.to_numpy(same.network.buffers[k]), model.network.B.to_numpy(b))
    np.testing.assert_array_equal(same.predict_scores(xt[:8]), model.predict_scores(xt[:8]))

"""Networks as compositions (architecture.py, network.py): stacked routing layers and ConvCaps checked
by finite differences, by autograd and across backends; misfits refused at build time; the built-in
networks unchanged (checkpoints written before they became compositions load and compute the same);
any composition trained, checkpointed, resumed and evaluated without the user's code."""
import json
import os
from pathlib import Path

import numpy as np
import pytest

from pycapsnet import backends
from pycapsnet import CapsNet, CapsNetError
from pycapsnet.training import checkpoint
from pycapsnet.core import architecture as A
from pycapsnet.tools import gradcheck
from pycapsnet.tools.finite_diff import check_layer
from pycapsnet.core.capsules import ClassCaps, PrimaryCaps
from pycapsnet.core.conv_caps import ConvCaps
from pycapsnet.core.squash import squash_backward
from tests.conftest import CPU_BACKENDS, assert_close

torch = pytest.importorskip("torch", reason="the autograd oracle needs PyTorch: pip install torch")
from pycapsnet.tools.reference import AutogradNetwork  # noqa: E402

DATA = Path(__file__).parent / "data"


def _built(description, backend, seed=1):
    """The description built in float64, routing transforms away from the tiny initialisation."""
    return gradcheck.away_from_init(A.build(description, backends.get(backend, dtype="float64"), seed=seed), seed)


def _batch(model, n=4, seed=3):
    rng = np.random.default_rng(seed)
    return rng.random((n, *model.input_shape)), rng.integers(0, model.n_classes, n)


COMPOSED = [(mode, label) for mode in ("full", "final") for label in gradcheck.composed_architectures(mode)]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_composed_networks_pass_finite_differences(backend):
    """Two stacked routing layers, a ConvCaps network (also on colour images normalised per channel)
    and residual blocks, both routing modes: every parameter and the input."""
    results = gradcheck.composed_checks(backends.get(backend, dtype="float64"), samples=8)
    # the input and 14 (two routing layers, each with a bias), 12 or 33 tensors (residual blocks)
    assert len(results) == 2 * 15 + 2 * 2 * 13 + 2 * 34
    assert sum(r.layer.startswith("colour") and r.tensor == "input" for r in results) == 2  # through Normalize
    assert all(r.passed for r in results), [(r.layer, r.tensor, r.max_rel) for r in results if not r.passed]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("mode,label", COMPOSED)
def test_composed_networks_match_autograd(backend, mode, label):
    model = _built(gradcheck.composed_architectures(mode)[label], backend)
    assert_network_matches_autograd(model, *_batch(model), 1e-8)


def assert_network_matches_autograd(model, x, y, rtol):
    """The loss to 1e-12 and every gradient, the input's too, to ``rtol`` of AutogradNetwork's (float64)."""
    model.zero_grad()
    out = model.loss(x, y)
    dx = model.backward(input_grad=True)
    loss_ref, g = AutogradNetwork.from_model(model, dtype=torch.float64).grads(x, y, input_grad=True)
    assert out.loss == pytest.approx(loss_ref, rel=1e-12)
    assert set(g) == {*model.grads, "input"}
    assert_all_close({k: model.B.to_numpy(dx if k == "input" else model.grads[k]) for k in g}, g, rtol)


def assert_all_close(ours: dict, refs: dict, rtol):
    """Each array to ``rtol`` of its reference; one that is zero but for rounding (the gradient of a
    bias that batch norm subtracts again) only within 1e-12 of the largest, on both sides."""
    scale = max(float(np.abs(ref).max()) for ref in refs.values())
    for k, ref in refs.items():
        if np.abs(ref).max() < 1e-12 * scale:
            assert np.abs(ours[k]).max() < 1e-12 * scale, k
        else:
            assert_close(ours[k], ref, rtol, what=k)


@pytest.mark.parametrize("mode,label", COMPOSED)
def test_composed_networks_agree_across_backends(mode, label):
    results = []
    for backend in CPU_BACKENDS:
        model = _built(gradcheck.composed_architectures(mode)[label], backend)
        x, y = _batch(model)
        model.zero_grad()
        out = model.loss(x, y)
        dx = model.backward(input_grad=True)
        results.append({"loss": np.array(out.loss), "v": model.B.to_numpy(out.v), "input": model.B.to_numpy(dx),
                        **{k: model.B.to_numpy(g) for k, g in model.grads.items()}})
    assert_all_close(results[1], results[0], 1e-12)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("mode", ["full", "final"])
@pytest.mark.parametrize("kernel,stride", [(3, 1), (3, 2), (2, 2)])
def test_convcaps_layer_passes_finite_differences(backend, mode, kernel, stride):
    B = backends.get(backend, dtype="float64")
    rng = np.random.default_rng(kernel + stride)
    layer = ConvCaps(B, (5, 5), 2, 3, 3, 4, kernel=kernel, stride=stride, iters=3, routing_grad=mode, rng=rng)
    layer.params["W"][...] = B.asarray(0.5 * rng.standard_normal(layer.params["W"].shape))
    results = check_layer(B, "ConvCaps", layer, 0.5 * rng.standard_normal((2, 25, 2, 3)), samples=15)
    assert [r.tensor for r in results] == ["input", "W"] and all(r.passed for r in results), results


def test_gradcheck_catches_a_wrong_convcaps_backward(monkeypatch):
    """The check above can fail: a backward that drops routing's feedback term (the "final" form
    in "full" mode) is caught."""
    from pycapsnet.core.routing import Dynamic

    monkeypatch.setattr(Dynamic, "gradient_mode", property(lambda self: "final"))
    B = backends.get("numpy", dtype="float64")
    rng = np.random.default_rng(0)
    layer = ConvCaps(B, (5, 5), 2, 3, 3, 4, routing_grad="full", rng=rng)
    layer.params["W"][...] = B.asarray(0.5 * rng.standard_normal(layer.params["W"].shape))
    results = check_layer(B, "ConvCaps", layer, 0.5 * rng.standard_normal((2, 25, 2, 3)), samples=15)
    assert not any(r.passed for r in results)


def test_every_layer_of_a_described_network_is_checked(tmp_path):
    """gradcheck --network: each body layer on the input it receives, then the whole loss."""
    from pycapsnet.tools.cli import main

    path = tmp_path / "net.json"
    path.write_text(json.dumps(gradcheck.composed_architectures("final")["ConvCaps network routing=final"]))
    results = gradcheck.run_network(backends.get("numpy", dtype="float64"), str(path), samples=6)
    assert [r.layer for r in results][:1] == ["conv1"] and {"relu1", "primary", "convcaps", "classcaps"} <= {
        r.layer for r in results}
    assert all(r.passed for r in results)
    assert main(["gradcheck", "--network", str(path), "--samples", "4"]) == 0


MISFITS = [
    ([A.conv2d(8, 5, name="stem"), A.dynamic_caps(10, 16, name="caps")],
     "layer 'caps' (dynamic_caps) cannot follow 'stem' (conv2d), which emits a 24x24 image of 8 channels: "
     "it takes vector capsules"),
    ([A.conv2d(8, 5), A.relu(), A.primary_caps(4, 4, 5, 2), A.dynamic_caps(10, 16), A.conv_caps(4, 4)],
     "layer 'conv_caps1' (conv_caps) cannot follow 'dynamic_caps1' (dynamic_caps), which emits 10 capsules "
     "of 16D: convolutional capsules need a grid"),
    ([A.conv2d(8, 5), A.relu(), A.primary_caps(4, 4, 5, 2), A.dynamic_caps(12, 16)],
     "the head 'lengths' takes 10 vector capsules without a grid (one per class), but the body's last layer "
     "'dynamic_caps1' (dynamic_caps) emits 12 capsules of 16D"),
    ([A.conv2d(8, 5), A.relu(), A.primary_caps(4, 4, 5, 2), A.class_matrix_caps(10)],
     "'class_matrix_caps1' (class_matrix_caps) cannot follow 'primary_caps1' (primary_caps), which emits a "
     "10x10 grid of 4 capsule types of 4D: it takes matrix capsules"),
    ([A.conv2d(8, 5), A.relu(), A.primary_caps(4, 4, 5, 2), A.dynamic_caps(4, 8), A.dynamic_caps(10, 16, share_spatial=True)],
     "share_spatial shares a transform over the positions of a grid, and this input has none"),
    ([A.conv2d(8, 30)], "'conv2d1' (conv2d) cannot follow the input, which emits a 28x28 image of 1 channels: "
                        "its 30x30 windows (stride 1) do not fit"),
    ([{"layer": "conv2d", "channels": 8}], "layer 'conv2d1' (conv2d): missing kernel"),
    ([{"layer": "dense", "units": 8}], "body layer 1: unknown layer 'dense'"),
]


@pytest.mark.parametrize("body,message", MISFITS)
def test_layers_that_do_not_fit_are_refused_at_build_time(body, message):
    with pytest.raises(CapsNetError, match=None) as e:
        A.build(A.network(body, input_shape=(1, 28, 28), n_classes=10), "numpy")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_network_is_a_composition_under_dotted_names():
    model = A.build(gradcheck.composed_architectures()["two routing layers routing=full"], "numpy")
    names = ["conv1.W", "conv1.b", "primary.W", "primary.b", "caps1.W", "caps1.bias", "classcaps.W", "classcaps.bias"] + \
            [f"decoder{k}.{p}" for k in (1, 2, 3) for p in "Wb"]
    assert list(model.params) == names and list(model.grads) == names
    assert sum(g.size for g in model.grads.values()) == model.flat_grads.size == model.n_params()
    model.train_step_grads(*_batch(model))
    assert np.shares_memory(model.grads["caps1.W"], model.flat_grads)  # one buffer: zero_grad, all-reduce
    model.zero_grad()
    assert not model.flat_grads.any()
    state = model.state_dict()
    other = A.build(model.architecture, "numpy", seed=9)
    other.load_state_dict(state)
    assert all(np.array_equal(other.state_dict()[k], v) for k, v in state.items())


@pytest.mark.parametrize("name", ["dynamic", "attention", "em"])
def test_checkpoints_written_before_compositions_load_and_compute_the_same(name):
    """tests/data holds checkpoints that d4f17c0 (CapsNet as one hand-wired class) wrote after one
    Adam step, and the loss, predictions and gradients it computed on a fixed batch, in float64
    (EM's recomputed once its coordinate addition and saturated slope were corrected: the file's note)."""
    expected = json.loads((DATA / "d4f17c0-expected.json").read_text())[name]
    B = backends.get("numpy", dtype="float64")
    model, ckpt = checkpoint.load_model(str(DATA / f"d4f17c0-{name}.npz"), B)
    rng = np.random.default_rng(0)
    x = rng.random((4, *model.input_shape))
    y = rng.integers(0, model.n_classes, 4)
    model.zero_grad()
    out = model.loss(x, y)
    model.backward()
    # Not bit for bit: BLAS sums in an order that depends on its thread count and the CPU's vector
    # width, which moves float64 results in the last digits. Any change to the math moves them by
    # far more than 1e-12.
    close = dict(rel=1e-12, abs=1e-14)
    assert out.loss == pytest.approx(expected["loss"], **close)
    assert out.parts == pytest.approx(expected["parts"], **close)
    assert out.predictions.tolist() == expected["predictions"]
    sums = {k: float(np.asarray(g).sum()) for k, g in model.grads.items()}
    assert sums.keys() == expected["grad_sums"].keys()
    assert sums == pytest.approx(expected["grad_sums"], **close)


def test_a_described_network_trains_resumes_and_evaluates_without_user_code(tmp_path, capsys):
    """fit() in Python; the checkpoint records the description; evaluate and --resume rebuild it."""
    from pycapsnet.tools.cli import main as cli
    from pycapsnet.training.trainer import fit, main as train_main

    description = A.network([A.conv2d(8, 9, name="conv1"), A.relu(), A.primary_caps(4, 4, 9, 2, name="primary"),
                             A.conv_caps(4, 4, 3, 1, name="convcaps"), A.dynamic_caps(6, 8, name="caps1"),
                             A.dynamic_caps(10, 8, name="classcaps")], decoder=A.decoder((16,)))
    out = str(tmp_path / "run")
    flags = dict(epochs=1, limit=48, limit_test=20, batch_size=16, out=out, no_progress=True)
    first = fit(description, **flags)
    assert 0 <= first["test_acc"] <= 1
    header = checkpoint.load(out)["header"]
    assert "config" not in header and header["architecture"]["input_shape"] == [1, 28, 28]
    assert header["architecture"]["n_classes"] == 10
    assert cli(["evaluate", out, "--limit-test", "20"]) == 0
    assert train_main("numpy", ["--resume", out, "--epochs", "2", "--no-progress"]) == 0
    assert checkpoint.load(out)["header"]["epoch"] == 2
    assert train_main("numpy", ["--resume", out, "--epochs", "3", "--routing", "em"]) == 2
    assert "a network built from a description" in capsys.readouterr().err
    assert cli(["inspect", out, "--out", str(tmp_path / "inspect")]) == 0
    assert os.path.exists(tmp_path / "inspect" / "coupling.png")


def test_a_described_network_from_the_command_line(tmp_path, capsys):
    from pycapsnet.training.trainer import main as train_main

    path = tmp_path / "net.json"
    body = [A.conv2d(8, 9), A.relu(), A.primary_caps(4, 4, 9, 2), A.dynamic_caps(10, 8)]
    path.write_text(json.dumps(A.network(body, decoder=None)))
    out = str(tmp_path / "run")
    assert train_main("numpy", ["--network", str(path), "--epochs", "1", "--limit", "32", "--limit-test", "16",
                                "--out", out, "--no-progress"]) == 0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(A.network([A.conv2d(8, 9), A.dynamic_caps(10, 8)])))
    assert train_main("numpy", ["--network", str(bad), "--epochs", "1", "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot follow 'conv2d1' (conv2d)" in err
    (tmp_path / "broken.json").write_text("{not json")
    assert train_main("numpy", ["--network", str(tmp_path / "broken.json"), "--out", str(tmp_path / "c")]) == 2
    assert "is not JSON" in capsys.readouterr().err


def test_builtin_networks_are_compositions_with_their_old_names():
    m = CapsNet("numpy", routing="em", **{k: v for k, v in gradcheck.SMALL_EM.items() if k != "routing"})
    assert [n for n, _ in m.body] == ["conv1", "relu1", "primary", "convcaps1", "convcaps2", "classcaps"]
    assert A.build(m.architecture, "numpy", seed=0).state_dict().keys() == m.state_dict().keys()


def test_the_example_builds_and_trains_both_custom_networks(tmp_path):
    import runpy

    example = runpy.run_path(str(Path(__file__).parents[1] / "examples" / "build_your_own.py"))
    assert example["main"](["--quick", "--out", str(tmp_path), "--save-descriptions"]) == 0
    for name in ("two-routing", "convcaps"):
        assert checkpoint.load(str(tmp_path / name))["header"]["epoch"] == 1
        assert json.loads((tmp_path / f"{name}.json").read_text())["body"][-1]["name"] == "classcaps"


def _every_kind_of_layer():
    """Descriptions that use every layer kind: the built-ins, the experiments' CNN, the compositions,
    and one with max pooling, padding, attention and shared transforms."""
    from pycapsnet.experiments.networks import baseline_cnn, capsnet

    built_in = [CapsNet("numpy", routing=r, **({} if r == "em" else dict(conv_channels=16, primary_types=4))).architecture
                for r in ("dynamic", "attention", "em")]
    extra = A.network([A.conv2d(6, 3, padding=1), A.max_pool(2), A.relu(), A.primary_caps(3, 4, 3, 1),
                       A.attention_caps(5, 6, share_spatial=True), A.dynamic_caps(4, 8)],
                      decoder=A.decoder((16,)), input_shape=(2, 15, 15), n_classes=4)
    normalised = A.network([A.conv2d(8, 3), A.relu(), A.batch_norm(), A.primary_caps(2, 4, 5, 1, conv="depthwise",
                                                                                    squash="efficient"),
                            A.flatten(), A.batch_norm(momentum=0.5), A.linear(3)],
                           head="logits", decoder=None, input_shape=(1, 9, 9), n_classes=3)
    return [*built_in, baseline_cnn((1, 28, 28)), capsnet((1, 28, 28)), extra, normalised,
            *gradcheck.composed_architectures().values()]


@pytest.mark.parametrize("k", range(9))
def test_parameter_shapes_from_a_description_are_what_build_makes(k):
    """description.param_shapes works the shapes out without allocating (memory preflight, and the
    check of a checkpoint's arrays against its header): it must agree with the layers themselves."""
    from pycapsnet.core import description

    arch = _every_kind_of_layer()[k]
    built = {name: tuple(p.shape) for name, p in A.build(arch, "numpy").state_dict().items()}  # buffers too
    assert description.param_shapes(arch) == built


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("share_spatial", [False, True], ids=["own W", "shared W"])
@pytest.mark.parametrize("mode", ["full", "final"])
def test_a_bias_on_s_j_passes_finite_differences(backend, mode, share_spatial):
    """β_j added to every iteration's s_j (the paper's published code): dβ sums ds^r over the
    iterations and the batch, on both routing paths (û formed, and shared transforms without û)."""
    B = backends.get(backend, dtype="float64")
    rng = np.random.default_rng(4)
    layer = ClassCaps(B, 4, 2, 3, 3, 5, iters=3, routing_grad=mode, share_spatial=share_spatial, rng=rng, bias=0.1)
    layer.params["W"][...] = B.asarray(0.5 * rng.standard_normal(layer.params["W"].shape))
    assert B.to_numpy(layer.params["bias"]).tolist() == [[0.1] * 5] * 3
    results = check_layer(B, "ClassCaps bias", layer, 0.5 * rng.standard_normal((2, 4, 2, 3)), samples=15)
    assert [r.tensor for r in results] == ["input", "W", "bias"] and all(r.passed for r in results), results


def test_a_wrong_bias_gradient_is_caught(monkeypatch):
    """The check above can fail: dβ from the last iteration alone (the "final" form in "full" mode)."""
    from pycapsnet.core.routing import Dynamic

    real = Dynamic._factors
    monkeypatch.setattr(Dynamic, "_factors", lambda self, B, u_hat, trace, dv, p: (
        real(self, B, u_hat, trace, dv, p)[0], {"bias": B.xp.sum(squash_backward(
            B.xp, trace[-1][1], trace[-1][2], dv), axis=0)}))
    B = backends.get("numpy", dtype="float64")
    rng = np.random.default_rng(4)
    layer = ClassCaps(B, 4, 2, 3, 3, 5, iters=3, rng=rng, bias=0.1)
    layer.params["W"][...] = B.asarray(0.5 * rng.standard_normal(layer.params["W"].shape))
    results = check_layer(B, "ClassCaps bias", layer, 0.5 * rng.standard_normal((2, 4, 2, 3)), samples=15)
    assert [r.passed for r in results] == [True, True, False]


@pytest.mark.parametrize("layer,message", [
    (A.dynamic_caps(10, 16, bias="0.1"), "a finite number in [-10, 10] or null"),
    (A.dynamic_caps(10, 16, bias=float("nan")), "a finite number in [-10, 10] or null"),
    ({"layer": "attention_caps", "capsules": 10, "dim": 16, "bias": 0.1}, "bias"),
])
def test_a_bad_bias_is_refused_in_one_line(layer, message):
    body = [A.conv2d(8, 9), A.relu(), A.primary_caps(4, 4, 9, 2), layer]
    with pytest.raises(CapsNetError) as e:
        A.build(A.network(body, input_shape=(1, 28, 28), n_classes=10), "numpy")
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("conv", ["fourier", "im2col", "depthwise"])
def test_scaled_primary_capsules_pass_finite_differences(backend, conv):
    """s = W * (scale x) + b (the published code's 1/32): dW sees the scaled input, db does not
    scale, dx is scaled once; the options that start the convolution set what they say."""
    B = backends.get(backend, dtype="float64")
    rng = np.random.default_rng(5)
    types, dim = (2, 2) if conv == "depthwise" else (2, 4)
    layer = PrimaryCaps(B, 4, types, dim, 3, 1, rng=rng, conv=conv, init_std=0.7, bias=0.1, scale=0.25)
    W = B.to_numpy(layer.params["W"])
    assert B.to_numpy(layer.params["b"]).tolist() == [0.1] * (types * dim) and 0.5 < W.std() < 0.9
    results = check_layer(B, f"PrimaryCaps {conv} scale", layer, rng.standard_normal((2, 5, 5, 4)), samples=15)
    assert [r.tensor for r in results] == ["input", "W", "b"] and all(r.passed for r in results), results


def test_a_primary_capsule_scale_left_out_of_backward_is_caught(monkeypatch):
    """The check above can fail: dx not scaled (forward scales x, backward forgets it)."""
    monkeypatch.setattr(PrimaryCaps, "backward", lambda self, du, input_grad=True: self.conv.backward(
        self.B.xp.reshape(squash_backward(self.B.xp, self.cache[0], self.cache[1], du), self.cache[2]), input_grad))
    B = backends.get("numpy", dtype="float64")
    rng = np.random.default_rng(5)
    layer = PrimaryCaps(B, 4, 2, 4, 3, 1, rng=rng, scale=0.25)
    results = check_layer(B, "PrimaryCaps scale", layer, rng.standard_normal((2, 5, 5, 4)), samples=15)
    assert [r.tensor for r in results] == ["input", "W", "b"] and not results[0].passed


def test_convolutions_left_at_their_defaults_start_as_they_always_did():
    """init_std, bias and scale unset: the description holds no new key and the same seed draws the
    same weights (checkpoints and recorded runs rebuild as they were)."""
    plain = [A.conv2d(8, 9, name="conv1"), A.relu(), A.primary_caps(4, 4, 9, 2, name="primary"), A.dynamic_caps(10, 16)]
    assert set(plain[0]) == {"layer", "name", "channels", "kernel", "stride", "padding"}
    assert "scale" not in plain[2] and "init_std" not in plain[2]
    a = A.build(A.network(plain, input_shape=(1, 28, 28), n_classes=10), "numpy", seed=3).state_dict()
    set_ = [A.conv2d(8, 9, init_std=0.05, bias=0.1, name="conv1"), A.relu(),
            A.primary_caps(4, 4, 9, 2, init_std=0.1, bias=0.1, scale=1 / 32, name="primary"), A.dynamic_caps(10, 16)]
    b = A.build(A.network(set_, input_shape=(1, 28, 28), n_classes=10), "numpy", seed=3).state_dict()
    assert np.all(b["conv1.b"] == np.float32(0.1)) and abs(b["conv1.W"].std() - 0.05) < 0.005
    assert abs(b["primary.W"].std() - 0.1) < 0.01 and not np.allclose(a["conv1.W"], b["conv1.W"])


@pytest.mark.parametrize("layer,message", [
    (A.primary_caps(4, 4, 9, 2, scale=0), "scale must be a finite number in (0, 1000]"),
    (A.primary_caps(4, 4, 9, 2, scale="1/32"), "scale must be a finite number in (0, 1000]"),
    (A.primary_caps(4, 4, 9, 2, init_std=-0.1), "init_std must be a finite number in (0, 100] or null"),
    (A.primary_caps(4, 4, 9, 2, bias=float("inf")), "bias must be a finite number in [-10, 10] or null"),
])
def test_bad_convolution_starts_and_scales_are_refused_in_one_line(layer, message):
    body = [A.conv2d(8, 9), A.relu(), layer, A.dynamic_caps(10, 16)]
    with pytest.raises(CapsNetError) as e:
        A.build(A.network(body, input_shape=(1, 28, 28), n_classes=10), "numpy")
    assert message in str(e.value) and "'primary_caps1'" in str(e.value) and "\n" not in str(e.value)


def test_the_published_network_is_carried_by_name():
    """--network capsnet-published: the paper's network with every choice of its published code that
    docs/published-code.md lists, 160 parameters (beta_j) more than the built-in one."""
    arch = A.load("capsnet-published")
    conv1, _, primary, classcaps = arch["body"]
    assert (conv1["init_std"], conv1["bias"]) == (0.05, 0.1) and arch["decoder"]["weight"] == 0.01
    assert (primary["init_std"], primary["bias"], primary["scale"]) == (0.1, 0.1, 1 / 32)
    assert (classcaps["init_std"], classcaps["bias"], classcaps["iters"]) == (0.1, 0.1, 3)
    model = A.build({**arch, "input_shape": [1, 28, 28], "n_classes": 10}, "numpy")
    assert model.n_params() == 8_215_728 == CapsNet("numpy").n_params() + 160


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_training_runs_no_backward_in_front_of_the_first_layer_with_parameters(backend, monkeypatch):
    """A Normalize (or any layer without parameters) in front of conv1 would only make the input's
    gradient, which training does not want: it is released, not run, conv1 is told so, and every
    parameter's gradient is bit for bit what the full backward gives."""
    B = backends.get(backend, dtype="float64")
    d = A.network([A.normalize([0.5, 0.4, 0.3], [0.2, 0.25, 0.3], name="norm"), A.relu(name="first_relu"),
                   A.conv2d(6, 5, name="conv1"), A.relu(name="relu1"), A.primary_caps(2, 4, kernel=5, stride=2),
                   A.dynamic_caps(10, 8, iters=2)], input_shape=(3, 16, 16), n_classes=10)
    rng = np.random.default_rng(0)
    x, y = rng.random((4, 3, 16, 16)), rng.integers(0, 10, 4)
    net = A.build(d, B, seed=0)
    norm, conv1 = net.body["norm"], net.body["conv1"]
    net.zero_grad()
    net.loss(x, y)
    net.backward(input_grad=True)
    full = {k: B.to_numpy(g).copy() for k, g in net.grads.items()}
    calls = []
    for name, layer in (("norm", norm), ("conv1", conv1)):
        real = layer.backward
        monkeypatch.setattr(layer, "backward", lambda dy, input_grad=True, real=real, name=name:
                            calls.append((name, input_grad)) or real(dy, input_grad))
    net.zero_grad()
    net.loss(x, y)
    assert net.backward() is None
    assert calls == [("conv1", False)]
    assert norm.cache is None and net.body["first_relu"].cache is None  # released
    for k, g in net.grads.items():
        assert np.array_equal(B.to_numpy(g), full[k]), k


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_outputs_backward_is_the_gradient_of_a_loss_of_ones_own_on_the_outputs(backend):
    """Network.outputs_backward from dL/dv, dL/dscores and dL/dreconstruction of a user's loss
    L = Σ v G + Σ scores H + Σ reconstruction K: every parameter's gradient and the input's, against
    finite differences in float64."""
    from pycapsnet.tools.finite_diff import check_tensors

    B = backends.get(backend, dtype="float64")
    d = A.network([A.conv2d(4, 5, name="conv1"), A.relu(name="relu1"), A.primary_caps(2, 4, kernel=5, stride=2),
                   A.dynamic_caps(3, 6, iters=2)], decoder=A.decoder([12]), input_shape=(1, 14, 14), n_classes=3)
    net = A.build(d, B, seed=0)
    rng = np.random.default_rng(1)
    x, y = rng.random((2, 1, 14, 14)), np.array([0, 2])
    G, H, K = rng.standard_normal((2, 3, 6)), rng.standard_normal((2, 3)), rng.standard_normal((2, 1, 14, 14))
    xd, yd = net.checked(x, y)

    def loss():
        out = net.forward_on_device(xd, yd)
        return float(np.sum(B.to_numpy(out.v) * G) + np.sum(B.to_numpy(out.lengths) * H)
                     + np.sum(B.to_numpy(out.reconstruction) * K))

    net.zero_grad()
    loss()
    dx = net.outputs_backward(B.asarray(G), B.asarray(H), B.asarray(K), input_grad=True)
    x_param = {"x": xd}
    results = check_tensors(B, "outputs", loss, {**net.params, **x_param}, {**net.grads, "x": dx}, samples=8)
    assert len(results) == len(net.params) + 1 and all(r.passed for r in results), results


def test_the_body_gets_colour_images_channels_last_in_memory(monkeypatch):
    """Not a permuted view of (N, C, H, W): conv1's windows over one gather C-strided single values
    (docs/performance.md).  What conv1 is handed is C-ordered, on its own and behind a Normalize."""
    B = backends.get("numpy", dtype="float32")
    for front in ([], [A.normalize([0.5] * 3, [0.25] * 3, name="norm")]):
        d = A.network([*front, A.conv2d(4, 5, name="conv1"), A.relu(name="relu1"), A.primary_caps(2, 4, kernel=5, stride=2),
                       A.dynamic_caps(3, 6, iters=1)], input_shape=(3, 14, 14), n_classes=3)
        net = A.build(d, B, seed=0)
        seen, real = [], net.body["conv1"].forward
        monkeypatch.setattr(net.body["conv1"], "forward", lambda x, real=real: seen.append(x) or real(x))
        net.loss(np.random.default_rng(0).random((2, 3, 14, 14)), np.array([0, 1]))
        assert seen[0].shape == (2, 14, 14, 3) and seen[0].flags["C_CONTIGUOUS"]

"""Residual blocks (core/residual.py): the layer by finite differences, the ways it can be wrong
caught, descriptions with blocks checked and weighed before building, a block under the torch
wrapper, and a network of blocks trained from a description file.  The compositions with blocks
are checked by finite differences, autograd and across backends in test_composition.py."""
import json

import numpy as np
import pytest

import pycapsnet
from pycapsnet import backends, CapsNetError
from pycapsnet.core import architecture as A
from pycapsnet.core.description import param_shapes
from pycapsnet.core.residual import Residual
from pycapsnet.tools import gradcheck
from pycapsnet.tools.finite_diff import check_layer
from tests.conftest import CPU_BACKENDS


def _block(B, project, rng):
    spec = A.basic_block(3, 2 if project else 1, project=project)
    body, _, _ = A.build_body(B, [spec], (2 if project else 3, 6, 6), rng)
    return body["residual1"]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("project", [False, True], ids=["identity", "projection"])
@pytest.mark.parametrize("training", [True, False], ids=["training", "evaluation"])
def test_a_residual_block_passes_finite_differences(backend, project, training):
    B = backends.get(backend, dtype="float64")
    rng = np.random.default_rng(5)
    block = _block(B, project, rng)
    assert isinstance(block, Residual) and [n for n, _ in block] == (["body", "shortcut"] if project else ["body"])
    block.train(training)
    results = check_layer(B, "Residual", block, rng.standard_normal((2, 6, 6, 2 if project else 3)), samples=10)
    names = {r.tensor for r in results}
    assert "input" in names and "body.conv1.W" in names and ("shortcut.conv.W" in names) == project
    assert all(r.passed for r in results), [(r.tensor, r.max_rel) for r in results if not r.passed]


@pytest.mark.parametrize("project", [False, True], ids=["identity", "projection"])
def test_the_check_fails_on_a_block_whose_backward_drops_the_shortcut(monkeypatch, project):
    """dx without the shortcut's part (the identity's dy, or the projection's backward) is caught."""
    def wrong(self, dy, input_grad=True):
        if len(self.layers) > 1:
            self.layers[1].backward(dy, input_grad)  # its parameters' gradients, but not its share of dx
        return self.layers[0].backward(dy, input_grad)

    monkeypatch.setattr(Residual, "backward", wrong)
    B = backends.get("numpy", dtype="float64")
    rng = np.random.default_rng(5)
    results = check_layer(B, "Residual", _block(B, project, rng), rng.standard_normal((2, 6, 6, 2 if project else 3)))
    assert [r.passed for r in results if r.tensor == "input"] == [False]


def test_a_description_with_blocks_is_weighed_as_it_is_built():
    arch = gradcheck.composed_architectures()["residual blocks routing=full"]
    model = A.build(arch, "numpy")
    built = {k: tuple(v.shape) for k, v in {**model.params, **model.buffers}.items()}
    assert param_shapes(arch) == built
    assert "block2.shortcut.conv.W" in built and "block1.body.bn2.running_var" in built
    assert "block2: Residual(" in repr(model) and "    shortcut: Sequential(" in repr(model)


@pytest.mark.parametrize("body,said", [
    ([A.conv2d(5, 3, padding=1)], "its body ends in 'conv2d1' (conv2d), which emits a 6x6 image of 5 channels, and "
                                  "its shortcut (the identity shortcut) emits a 6x6 image of 3 channels"),
    ([A.conv2d(3, 3)], "which emits a 4x4 image of 3 channels"),
    ([A.flatten()], "which emits 108 features"),
])
def test_branches_that_cannot_be_added_are_refused_in_one_line(body, said):
    arch = A.network([A.residual(body, name="res"), A.flatten(), A.linear(2)], head="logits", decoder=None,
                     input_shape=(3, 6, 6), n_classes=2)
    with pytest.raises(CapsNetError) as e:
        A.build(arch)
    assert said in str(e.value) and "layer 'res' (residual) cannot follow the input" in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("spec,said", [
    ({"layer": "residual"}, "missing body"),
    ({"layer": "residual", "body": []}, "body must be a non-empty list of layers"),
    ({"layer": "residual", "body": "conv"}, "body must be a non-empty list of layers"),
    ({"layer": "residual", "body": [{"layer": "relu"}], "shortcut": []}, "shortcut must be a non-empty list of "
                                                                         "layers or null (the identity)"),
    ({"layer": "residual", "body": [{"layer": "conv2d", "channels": 0, "kernel": 3}]},
     "layer 'residual1' (residual), body: layer 'conv2d1' (conv2d): channels must be a whole number"),
    ({"layer": "residual", "body": [{"layer": "relu"}], "shortcut": [{"layer": "pool"}]},
     "layer 'residual1' (residual), shortcut: body layer 1: unknown layer 'pool'"),
    ({"layer": "residual", "body": [{"layer": "relu"}], "skip": 1}, "unknown option skip"),
])
def test_a_malformed_block_is_refused_before_anything_is_built(spec, said):
    arch = A.network([spec, A.flatten(), A.linear(2)], head="logits", decoder=None, input_shape=(3, 6, 6), n_classes=2)
    with pytest.raises(CapsNetError, match=None) as e:
        A.build(arch)
    assert said in str(e.value), str(e.value)


def test_dropout_inside_a_block_is_held_for_the_autograd_reference():
    """A layer that draws (Dropout) inside a block: its mask is found by its dotted name."""
    pytest.importorskip("torch", reason="the autograd oracle")
    from tests.test_composition import assert_network_matches_autograd

    body = [A.conv2d(4, 3, padding=1, name="conv1"),
            A.residual([A.relu(), A.dropout(0.3, name="drop"), A.conv2d(4, 3, padding=1)], name="block"),
            A.flatten(), A.linear(3, name="out")]
    model = A.build(A.network(body, head="logits", decoder=None, input_shape=(1, 5, 5), n_classes=3),
                    backends.get("numpy", dtype="float64"), seed=2)
    assert list(model.generators()) == ["block.body.drop"]
    rng = np.random.default_rng(0)
    x, y = rng.random((4, 1, 5, 5)), rng.integers(0, 3, 4)
    assert_network_matches_autograd(model, x, y, 1e-9)


def test_blocks_under_the_torch_wrappers_gradcheck():
    torch = pytest.importorskip("torch", reason="the torch wrapper")
    import pycapsnet.torch as pct

    net = pct.Network(pycapsnet.build(gradcheck.composed_architectures()["residual blocks routing=full"],
                                      backend="torch", dtype="float64"))
    assert "block2.shortcut.bn.running_mean" in dict(net.named_buffers())
    x = torch.rand(2, 3, 9, 9, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: net(t)[1], (x,), eps=1e-6, atol=1e-5)


def test_a_network_of_blocks_trains_evaluates_and_resumes_from_its_file(tmp_path, capsys):
    """The batch norms' running statistics inside the blocks are saved, restored and evaluated with."""
    from pycapsnet.tools.cli import main as cli
    from pycapsnet.training import checkpoint
    from pycapsnet.training.trainer import main as train_main

    arch = gradcheck.composed_architectures()["residual blocks routing=full"]
    arch = {**arch, "input_shape": None, "n_classes": None, "body": [*arch["body"][:-1], A.dynamic_caps(10, 6)]}
    path = tmp_path / "resnet.json"
    path.write_text(json.dumps(arch))
    out = str(tmp_path / "run")
    flags = ["--limit", "48", "--limit-test", "20", "--batch-size", "16", "--no-progress"]
    assert train_main("numpy", ["--network", str(path), "--epochs", "1", "--out", out, *flags]) == 0
    assert any(k.startswith("block2.shortcut.bn.running") for k in checkpoint.load(out)["params"])
    assert cli(["evaluate", out, "--limit-test", "20"]) == 0
    assert train_main("numpy", ["--resume", out, "--epochs", "2", "--no-progress"]) == 0
    assert checkpoint.load(out)["header"]["epoch"] == 2


# ---- the study's ResNet-20 backbone ---------------------------------------------------------------
def test_the_resnet20_backbone_is_resnet20():
    """16/32/64 channels in three stages of three basic blocks, the 2nd and 3rd stage's first block
    strided and projected, 32x32 -> an 8x8 map; primary capsules of 32 types of 16D on it (3x3/1:
    a 6x6 grid); 20 weighted layers counting the class layer: 1 + 18 + primary + class."""
    from pycapsnet.experiments import study_networks as rs

    arch = rs.network("dynamic", (3, 32, 32), rs.RESNET20)
    body = arch["body"]
    blocks = [s for s in body if s["layer"] == "residual"]
    assert len(blocks) == 9 and [b["body"][0]["channels"] for b in blocks] == [16] * 3 + [32] * 3 + [64] * 3
    assert [("shortcut" in b, b["body"][0]["stride"]) for b in blocks] == \
        [(False, 1)] * 3 + [(True, 2), (False, 1), (False, 1)] * 2
    model = A.build(arch, "numpy")
    assert model.body["primary"].in_flow.grid == (8, 8) and model.body["primary"].out_flow.grid == (6, 6)
    assert model.body["primary"].out_flow.types == 32 and model.body["primary"].out_flow.dim == 16
    convs = [k for k in model.params if k.endswith(".W") and "shortcut" not in k]
    assert len(convs) == 1 + 18 + 2
    cnn = rs.network("cnn", (3, 32, 32), rs.RESNET20)  # matched in parameters to the dynamic row, as on capsnet
    total = lambda d: sum(int(np.prod(s)) for k, s in param_shapes(d).items() if "running" not in k)  # noqa: E731
    assert abs(total(cnn) - total(arch)) < 0.01 * total(arch)


def test_the_study_on_the_resnet20_backbone(tmp_path):
    import pycapsnet.experiments as experiments
    from tests.test_cifar10 import _write

    _write(tmp_path / "d", n_train=12, n_test=10)
    results = experiments.routings(out=str(tmp_path / "s"), quick=True, affine=False, dataset="cifar10",
                                   data_dir=str(tmp_path / "d"), routings=["uniform", "em", "cnn"], lr=2e-3, seeds=1,
                                   augment="crop-flip", backbone="resnet20", progress=False)
    assert results["settings"]["backbone"]["kind"] == "resnet20"
    assert "the ResNet-20 backbone" in results["protocol"]["summary"]
    assert set(results["cifar10"]) == {"uniform", "em", "cnn"}
    with pytest.raises(CapsNetError, match="drop --conv-channels"):
        experiments.routings(out=str(tmp_path / "t"), quick=True, affine=False, dataset="cifar10",
                             data_dir=str(tmp_path / "d"), backbone="resnet20", conv_channels=8, progress=False)

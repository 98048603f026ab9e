"""PyTorch autograd as an independent oracle: the same forward written with torch ops under autograd
(pycapsnet/tools/reference.py) gives the hand-written gradients, float64, rtol 1e-8."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the autograd oracle needs PyTorch: pip install torch")

from pycapsnet import backends  # noqa: E402
from pycapsnet.tools.reference import AutogradCapsNet  # noqa: E402
from pycapsnet import CapsNet  # noqa: E402
from tests.conftest import CPU_BACKENDS, SMALL, assert_close  # noqa: E402


def assert_matches_autograd(model, x, y, rtol=1e-8):
    """The loss to 1e-12 and every gradient, the input's too, to ``rtol`` of autograd's (float64)."""
    model.zero_grad()
    out = model.loss(x, y)
    dx = model.backward(input_grad=True)
    loss_ref, g = AutogradCapsNet.from_model(model, dtype=torch.float64).grads(x, y, input_grad=True)
    assert out.loss == pytest.approx(loss_ref, rel=1e-12)
    for k, ref in g.items():
        mine = dx if k == "input" else model.grads[k]
        assert_close(model.B.to_numpy(mine), ref, rtol, what=k)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("mode", ["full", "final"])
@pytest.mark.parametrize("share", [False, True])
def test_gradients_match_autograd(backend, mode, share):
    model = CapsNet(backends.get(backend, dtype="float64"), seed=2, routing_grad=mode, share_spatial=share, **SMALL)
    rng = np.random.default_rng(5)
    assert_matches_autograd(model, rng.random((6, 1, 14, 14)), rng.integers(0, 4, 6))


@pytest.mark.parametrize("routing", ["dynamic", "attention"])
@pytest.mark.parametrize("stride", [2, 3])
def test_a_strided_conv1_matches_autograd(routing, stride):
    """conv1 with stride 2 (a 2x2 primary grid) and 3 (1x1): the routing's positions follow it."""
    model = CapsNet(backends.get("numpy", dtype="float64"), seed=1, routing=routing, conv_stride=stride, **SMALL)
    assert model.n_positions == model.params["classcaps.W"].shape[0] == (4 if stride == 2 else 1)
    rng = np.random.default_rng(stride)
    assert_matches_autograd(model, rng.random((4, 1, 14, 14)), rng.integers(0, 4, 4))


def test_paper_architecture_matches_autograd():
    """The full-size MNIST CapsNet (8.2 M parameters), one batch of 2, float64."""
    model = CapsNet(backends.get("numpy", dtype="float64"), seed=0)
    rng = np.random.default_rng(0)
    x, y = rng.random((2, 1, 28, 28)), np.array([3, 7])
    model.train_step_grads(x, y)
    _, g = AutogradCapsNet.from_model(model, dtype=torch.float64).grads(x, y)
    for k, ref in g.items():
        assert_close(model.grads[k], ref, 1e-8, what=k)

"""The baseline CNN's layers (MaxPool2d, Flatten, Dropout, softmax cross-entropy, the logits head):
float64 finite differences, PyTorch autograd as the oracle, numpy against torch, and their modes."""
import numpy as np
import pytest

from pycapsnet import backends
from pycapsnet import CapsNetError
from pycapsnet.core import architecture as A
from pycapsnet.core.cnn_layers import Dropout, Flatten, MaxPool2d
from pycapsnet.core.losses import SoftmaxCrossEntropy
from pycapsnet.experiments.networks import baseline_cnn
from pycapsnet.tools import gradcheck
from pycapsnet.tools.finite_diff import _LossLayer, check_layer
from tests.conftest import CPU_BACKENDS, assert_close

torch = pytest.importorskip("torch", reason="the autograd oracle needs PyTorch: pip install torch")
import torch.nn.functional as F  # noqa: E402
from tests.test_composition import assert_network_matches_autograd  # noqa: E402


def _B(backend):
    return backends.get(backend, dtype="float64")


def _small_cnn(dropout=0.3, conv=None):
    """conv -> pool (overlapping 3x3/2) -> relu -> conv -> pool 2x2 -> relu -> flatten -> fc -> dropout -> logits."""
    body = [A.conv2d(4, 3, padding=1), A.max_pool(3, 2), A.relu(), A.conv2d(5, 3, padding=1, conv=conv), A.max_pool(2),
            A.relu(), A.flatten(), A.linear(7), A.relu(), A.dropout(dropout), A.linear(3)]
    return A.network(body, head="logits", decoder=None, input_shape=(2, 11, 11), n_classes=3)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("kernel,stride", [(2, 2), (3, 2), (3, 1)])
def test_max_pool_passes_finite_differences(backend, kernel, stride):
    x = np.random.default_rng(kernel + stride).standard_normal((2, 7, 8, 3))
    results = check_layer(_B(backend), "max_pool", MaxPool2d(_B(backend), kernel, stride), x, samples=80)
    # entries that are no window's maximum have gradient 0, which roundoff makes look unsmooth at
    # the default floor; the maxima (a quarter or more of them) are all checked
    assert all(r.passed and r.n_checked >= 10 for r in results), results


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_max_pool_matches_torch_and_sends_a_tie_to_one_entry(backend):
    B = _B(backend)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 9, 9, 3))
    pool = MaxPool2d(B, 3, 2)
    y = B.to_numpy(pool.forward(B.asarray(x)))
    dy = rng.standard_normal(y.shape)
    dx = B.to_numpy(pool.backward(B.asarray(dy)))
    xt = torch.tensor(x).permute(0, 3, 1, 2).requires_grad_(True)
    yt = F.max_pool2d(xt, 3, 2)
    yt.backward(torch.tensor(dy).permute(0, 3, 1, 2))
    assert_close(y, yt.detach().permute(0, 2, 3, 1).numpy(), 1e-15, "y")
    assert_close(dx, xt.grad.permute(0, 2, 3, 1).numpy(), 1e-15, "dx")
    # a window of equal entries: its gradient goes to one of them, not to each
    flat = MaxPool2d(B, 2)
    flat.forward(B.asarray(np.ones((1, 2, 2, 1))))
    assert B.to_numpy(flat.backward(B.asarray(np.full((1, 1, 1, 1), 5.0)))).ravel().tolist() == [5, 0, 0, 0]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_flatten_and_dropout_pass_finite_differences(backend):
    B = _B(backend)
    x = np.random.default_rng(1).standard_normal((3, 4, 5, 2))
    assert all(r.passed for r in check_layer(B, "flatten", Flatten(B), x))
    drop = Dropout(B, 0.4, seed=3)
    results = check_layer(B, "dropout", drop, x, samples=30)
    assert all(r.passed for r in results), results
    kept = B.to_numpy(drop.mask) != 0
    assert 0.4 < kept.mean() < 0.8 and np.allclose(B.to_numpy(drop.mask)[kept], 1 / 0.6)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_dropout_draws_new_masks_in_training_and_is_the_identity_in_evaluation(backend):
    B = _B(backend)
    x = B.asarray(np.ones((4, 50)))
    drop = Dropout(B, 0.5, seed=0)
    a, b = B.to_numpy(drop.forward(x)), B.to_numpy(drop.forward(x))
    assert not np.array_equal(a, b) and set(np.unique(a)) == {0.0, 2.0}
    drop.train(False)
    assert np.array_equal(B.to_numpy(drop.forward(x)), np.ones((4, 50)))
    assert np.array_equal(B.to_numpy(drop.backward(B.asarray(np.full((4, 50), 3.0)))), np.full((4, 50), 3.0))
    with pytest.raises(ValueError, match="rate"):
        Dropout(B, 1.0)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_cross_entropy_passes_finite_differences_and_matches_torch(backend):
    B = _B(backend)
    rng = np.random.default_rng(2)
    z = 3 * rng.standard_normal((5, 4))
    y = rng.integers(0, 4, 5)
    onehot = B.asarray(np.eye(4)[y])
    assert all(r.passed for r in check_layer(B, "cross_entropy", _LossLayer(SoftmaxCrossEntropy(B), onehot), z))
    two = np.eye(4)[y] + np.eye(4)[(y + 1) % 4]  # two targets per sample (MultiMNIST): the sum of both losses
    assert all(r.passed for r in check_layer(B, "two-target", _LossLayer(SoftmaxCrossEntropy(B), B.asarray(two)), z))
    zt = torch.tensor(z, requires_grad=True)
    ref = F.cross_entropy(zt, torch.tensor(y))
    ref.backward()
    ref = ref.detach()
    loss = SoftmaxCrossEntropy(B)
    assert float(B.to_numpy(loss.forward(B.asarray(z), onehot))) == pytest.approx(float(ref), rel=1e-14)
    assert_close(B.to_numpy(loss.backward()), zt.grad.numpy(), 1e-14, "dz")
    big = B.asarray(np.array([[1000.0, 0.0], [0.0, -1000.0]]))  # no overflow: log-sum-exp of z - max z
    assert float(B.to_numpy(loss.forward(big, B.asarray(np.array([[1.0, 0], [1.0, 0]]))))) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_cnn_passes_finite_differences_layer_by_layer_and_whole(backend):
    results = gradcheck.run_network(_B(backend), _small_cnn(), samples=12)
    assert {r.layer for r in results} >= {"max_pool1", "dropout1", "flatten1", "network"}
    assert all(r.passed for r in results), [(r.layer, r.tensor, r.max_rel) for r in results if not r.passed]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_cnn_with_dropout_matches_autograd(backend):
    model = A.build(_small_cnn(), _B(backend), seed=1)
    rng = np.random.default_rng(4)
    assert_network_matches_autograd(model, rng.random((5, 2, 11, 11)), rng.integers(0, 3, 5), 1e-10)


def test_a_cnn_agrees_across_backends_dropout_masks_included():
    rng = np.random.default_rng(5)
    x, y = rng.random((4, 2, 11, 11)), rng.integers(0, 3, 4)
    grads = []
    for backend in CPU_BACKENDS:
        model = A.build(_small_cnn(), _B(backend), seed=2)
        model.train_step_grads(x, y)
        grads.append({k: model.B.to_numpy(g) for k, g in model.grads.items()})
    for k in grads[0]:
        assert_close(grads[1][k], grads[0][k], 1e-12, what=k)


def test_evaluation_drops_nothing_and_a_dropout_network_is_not_captured():
    model = A.build(_small_cnn(0.5), "numpy", seed=0)
    x = np.random.default_rng(6).random((6, 2, 11, 11))
    assert not model.capturable and A.build(A.network([A.conv2d(4, 3), A.relu(), A.flatten(), A.linear(3)],
                                                      head="logits", decoder=None, input_shape=(1, 5, 5),
                                                      n_classes=3), "numpy").capturable
    first, second = model.scores(x), model.scores(x)
    assert np.array_equal(first, second) and model.training  # evaluation mode only inside scores
    from pycapsnet.training import data
    from pycapsnet.training.loop import evaluate
    split = data.Split((x * 255).astype(np.uint8), np.arange(6) % 3)
    assert evaluate(model, split, 3) == evaluate(model, split, 3) and model.training


def test_descriptions_that_do_not_fit_are_refused_in_one_line():
    shape = dict(input_shape=(1, 8, 8), n_classes=3)
    with pytest.raises(CapsNetError, match="'linear1' .linear. cannot follow the input, which emits a 8x8 image"):
        A.build(A.network([A.linear(3)], head="logits", decoder=None, **shape))
    with pytest.raises(CapsNetError, match="no class capsules for a decoder"):
        A.build(A.network([A.flatten(), A.linear(3)], head="logits", **shape))
    with pytest.raises(CapsNetError, match="takes 3 features .one logit per class., but .* emits 5 features"):
        A.build(A.network([A.flatten(), A.linear(5)], head="logits", decoder=None, **shape))
    with pytest.raises(CapsNetError, match="windows .stride 2. do not fit"):
        A.build(A.network([A.max_pool(2), A.max_pool(2), A.max_pool(2), A.max_pool(2), A.flatten(), A.linear(3)],
                          head="logits", decoder=None, **shape))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_fourier_conv2d_is_the_im2col_layer_in_a_network(backend):
    """conv="fourier" builds the convolution-theorem layer: finite differences layer by layer and
    whole, autograd's gradients, and the im2col network's loss and gradients from the same seed."""
    from pycapsnet.core.fourier import FourierConv2d
    model = A.build(_small_cnn(conv="fourier"), _B(backend), seed=1)
    assert [name for name, layer in model.layers() if isinstance(layer, FourierConv2d)] == ["conv2d2"]
    results = gradcheck.run_network(_B(backend), _small_cnn(conv="fourier"), samples=12)
    assert all(r.passed for r in results), [(r.layer, r.tensor, r.max_rel) for r in results if not r.passed]
    rng = np.random.default_rng(4)
    x, y = rng.random((5, 2, 11, 11)), rng.integers(0, 3, 5)
    assert_network_matches_autograd(model, x, y, 1e-10)
    fourier, direct = (A.build(_small_cnn(0.0, conv), _B(backend), seed=1) for conv in ("fourier", None))
    assert direct.loss(x, y).loss == pytest.approx(fourier.loss(x, y).loss, rel=1e-12)
    fourier.backward()
    direct.backward()
    for k, g in direct.grads.items():
        assert_close(fourier.B.to_numpy(fourier.grads[k]), direct.B.to_numpy(g), 1e-11, what=k)


def test_the_baseline_cnn_convolves_many_input_channels_by_fourier_and_an_unknown_conv_is_refused():
    convs = [part.get("conv") for part in baseline_cnn((3, 32, 32))["body"] if part["layer"] == "conv2d"]
    assert convs == [None, "fourier", "fourier"]  # conv1: 3 input channels; conv2, conv3: 256
    quick = [part.get("conv") for part in baseline_cnn((1, 28, 28), channels=(8, 8, 8))["body"] if part["layer"] == "conv2d"]
    assert quick == [None, None, None]
    with pytest.raises(CapsNetError, match="conv must be one of 'im2col', 'fourier', got 'fft'"):
        A.build(A.network([A.conv2d(4, 3, conv="fft"), A.flatten(), A.linear(3)], head="logits", decoder=None,
                          input_shape=(1, 5, 5), n_classes=3))


def test_the_baseline_cnn_trains_with_the_library_trainer(tmp_path):
    from pycapsnet.training.trainer import fit
    last = fit(baseline_cnn((1, 28, 28), channels=(8, 8, 8), hidden=(16, 12)), epochs=3, limit=400,
               batch_size=20, out=str(tmp_path / "run"))
    assert last["test_acc"] > 0.15 and last["test_loss"] < 2.2  # chance: 10%, and a loss of log 10 = 2.30

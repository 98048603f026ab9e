"""The study tools from a notebook (issue 88): fit that continues, data loaders, the study tools as
Python, the optimizer for a loop of your own, and the Python face's papercuts."""
import json
import os
import sys

import numpy as np
import pytest

import pycapsnet
import pycapsnet.study as study
from pycapsnet import CapsNetError, backends
from pycapsnet.core import architecture as A
from pycapsnet.training import data

SMALL = dict(conv_channels=8, primary_types=2)


@pytest.fixture(scope="module")
def digits():
    (x, y), (xt, yt) = pycapsnet.datasets.load_digits()
    return x[:48], y[:48], xt[:16], yt[:16]


def _weights(model):
    return model.network.state_dict()


def _same(a, b):
    wa, wb = _weights(a), _weights(b)
    return wa.keys() == wb.keys() and all(np.array_equal(wa[k], wb[k]) for k in wa)


# ---- 1. fit continues ------------------------------------------------------------------------------
def test_fit_called_again_continues_as_one_longer_fit(digits):
    x, y, _, _ = digits
    once = pycapsnet.build("capsnet", seed=0, **SMALL)
    once.fit(x, y, epochs=3, batch_size=16, progress=False)
    steps = pycapsnet.build("capsnet", seed=0, **SMALL)
    for _ in range(3):
        steps.fit(x, y, epochs=1, batch_size=16, progress=False)
    assert [r["epoch"] for r in steps.history] == [1, 2, 3]
    assert [r["lr"] for r in steps.history] == [r["lr"] for r in once.history]
    assert _same(once, steps)


def test_reset_starts_over_from_the_weights_as_they_are(digits):
    x, y, _, _ = digits
    model = pycapsnet.build("capsnet", seed=0, **SMALL)
    model.fit(x, y, epochs=2, batch_size=16, progress=False)
    model.fit(x, y, epochs=1, batch_size=16, progress=False, reset=True)
    assert [r["epoch"] for r in model.history] == [1] and model.history[0]["lr"] == pytest.approx(2e-3)


@pytest.mark.parametrize("how", ["run directory", "saved model"])
def test_a_loaded_model_continues_where_it_stopped(digits, tmp_path, how):
    x, y, _, _ = digits
    straight = pycapsnet.build("capsnet", seed=0, **SMALL)
    straight.fit(x, y, epochs=3, batch_size=16, progress=False)
    first = pycapsnet.build("capsnet", seed=0, **SMALL)
    if how == "run directory":
        first.fit(x, y, epochs=2, batch_size=16, progress=False, out=str(tmp_path / "run"))
        path = str(tmp_path / "run")
    else:
        first.fit(x, y, epochs=2, batch_size=16, progress=False)
        path = first.save(str(tmp_path / "mine.npz"))
    again = pycapsnet.load(path)
    again.fit(x, y, epochs=1, batch_size=16, progress=False)
    assert [r["epoch"] for r in again.history] == [1, 2, 3] and _same(straight, again)
    if how == "run directory":  # continued in the model's own directory: the run's files are as they were
        assert len(open(tmp_path / "run" / "metrics.jsonl").readlines()) == 2


def test_continuing_with_images_of_another_size_is_refused(digits):
    x, y, _, _ = digits
    model = pycapsnet.build("capsnet", seed=0, **SMALL)
    model.fit(x, y, epochs=1, batch_size=16, progress=False)
    with pytest.raises(CapsNetError, match="takes images of"):
        model.fit(np.zeros((8, 1, 32, 32), np.float32), y[:8], epochs=1, progress=False)


# ---- 2. datasets -----------------------------------------------------------------------------------
def test_the_loaders_return_arrays_that_unpack_and_print_as_one_line(tmp_path):
    digits = pycapsnet.datasets.load_digits()
    (x, y), (xt, yt) = digits
    assert x.shape == (4000, 1, 28, 28) and x.dtype == np.float32 and yt.shape == (1000,)
    assert repr(digits) == "Data(train 4,000 x 1x28x28, test 1,000, classes 0..9)"
    assert repr(digits.train) == "Split(4,000 x 1x28x28)" and digits.test.x is xt
    folder = tmp_path / "idx"
    folder.mkdir()
    for part, n in (("train", 30), ("test", 10)):
        img, lbl = data.IDX_FILES[part]
        data.write_idx(str(folder / img), (np.arange(n * 784) % 256).reshape(n, 28, 28))
        data.write_idx(str(folder / lbl), np.arange(n) % 10)
    mnist = pycapsnet.datasets.load_mnist(folder)
    assert repr(mnist).startswith("Data(train 30 x 1x28x28, test 10, classes 0..9, from ")
    assert mnist.train.x.max() == 1.0 and mnist.train.y.dtype == np.int64


def test_mnist_from_the_cache_says_how_to_fill_it(tmp_path, monkeypatch):
    from pycapsnet.training import download

    monkeypatch.setenv("PYCAPSNET_DATA", str(tmp_path / "cache"))
    with pytest.raises(CapsNetError, match="download=True"):
        pycapsnet.datasets.load_fashion_mnist()
    asked = []
    monkeypatch.setattr(download, "download", lambda name, folder=None, **k: asked.append(name) or str(tmp_path))
    with pytest.raises(CapsNetError, match="missing data file"):  # the stand-in downloader fetched nothing
        pycapsnet.datasets.load_mnist(download=True)
    assert asked == ["mnist"]


def test_a_folder_and_the_generators(tmp_path, digits):
    from PIL import Image

    for name in ("cat", "dog"):
        (tmp_path / "f" / name).mkdir(parents=True)
        for k in range(5):
            Image.fromarray(np.full((12, 12), 40 * k, np.uint8)).save(tmp_path / "f" / name / f"{k}.png")
    folder = pycapsnet.datasets.load_folder(tmp_path / "f")
    assert folder.classes == ("cat", "dog") and len(folder.train.y) + len(folder.test.y) == 10
    x, y, _, _ = digits
    images, a, b, first, second = pycapsnet.datasets.multimnist(x[:10], y[:10], pairs=2, seed=0)
    assert images.shape == (20, 1, 36, 36) and (a != b).all() and np.allclose(images, np.clip(first + second, 0, 1))
    moved = pycapsnet.datasets.affine(x[:4], seed=0)
    assert moved.shape == (4, 1, 40, 40) and moved.max() <= 1


# ---- 3. the study tools ----------------------------------------------------------------------------
def test_gradcheck_of_a_float32_model_runs_on_a_float64_copy_and_says_so():
    model = pycapsnet.build("capsnet", seed=0, **SMALL)
    report = study.gradcheck(model, samples=3)
    assert report.passed and report.note == "a float64 copy of the model's weights"
    assert "the whole loss" in repr(report) and model.B.dtype == "float32"


def test_gradcheck_of_a_layer_and_of_a_description():
    from pycapsnet.core.layer_norm import LayerNorm

    layer = LayerNorm(backends.get("numpy", dtype="float64"), 5)
    assert study.gradcheck((layer, np.random.default_rng(0).standard_normal((3, 5))), samples=5).passed
    small = A.network([A.conv2d(4, 3), A.relu(), A.primary_caps(2, 4, 3, 2), A.dynamic_caps(3, 4)],
                      input_shape=(1, 9, 9), n_classes=3, decoder=None)
    assert study.gradcheck(small, samples=3).passed
    with pytest.raises(CapsNetError, match="float64"):
        study.gradcheck((LayerNorm(backends.get("numpy"), 5), np.zeros((2, 5))))


def test_crosscheck_and_the_autograd_twin_whose_loss_is_a_tensor(digits):
    torch = pytest.importorskip("torch")
    x, y, _, _ = digits
    model = pycapsnet.build("capsnet", seed=0, dtype="float64", **SMALL)
    assert study.crosscheck(model, "numpy", "torch").passed
    twin = study.autograd_twin(model)
    loss = twin.loss(x[:4], y[:4])
    assert isinstance(loss, torch.Tensor) and loss.ndim == 0
    loss.backward()
    model.network.zero_grad()
    out = model.network.loss(x[:4].astype(np.float64), y[:4])
    model.network.backward()
    assert float(loss) == pytest.approx(out.loss, rel=1e-12)
    for k, g in model.network.grads.items():
        np.testing.assert_allclose(twin.params[k].grad.numpy(), g, rtol=1e-8, atol=1e-12, err_msg=k)


def test_coupling_figure_4_and_inspect_from_arrays(digits, tmp_path):
    x, y, xt, yt = digits
    model = pycapsnet.build("capsnet", seed=0, **SMALL)
    c = study.coupling(model, xt[:3])
    assert list(c) == ["classcaps"] and [a.shape for a in c["classcaps"]] == [(3, 72, 10)] * 3
    assert np.allclose(c["classcaps"][0].sum(axis=2), 1)
    decoded, steps = study.figure_4(model, xt[:1], path=tmp_path / "f4.png")
    assert decoded.shape == (16, 11, 1, 28, 28) and len(steps) == 11 and (tmp_path / "f4.png").exists()
    written = study.inspect(model, xt, yt, out=str(tmp_path / "inspect"))
    assert {os.path.basename(p) for p in written} == {"reconstructions.png", "perturbation.png", "coupling.png"}
    with pytest.raises(CapsNetError, match="no routing layer"):
        study.coupling(pycapsnet.build(A.network([A.conv2d(4, 5, stride=2), A.relu(), A.flatten(), A.linear(10)],
                                                 head="logits", decoder=None)), xt[:2])


# ---- 4. a loop of your own -------------------------------------------------------------------------
def test_the_documented_loop_trains_to_fits_weights(digits):
    from pycapsnet.optim import Adam, batches, exponential_lr

    x, y, _, _ = digits
    fitted = pycapsnet.build("capsnet", seed=0, **SMALL)
    fitted.fit(x, y, epochs=2, batch_size=16, progress=False)
    model = pycapsnet.build("capsnet", seed=0, **SMALL)
    net, opt = model.network, Adam(model.network, lr=2e-3)
    for epoch in range(2):
        opt.lr = exponential_lr(2e-3, 0.85, epoch)
        for xb, yb in batches(x, y, 16, epoch):
            net.train_step_grads(xb, yb)
            opt.step()
    assert _same(fitted, model)


# ---- 5. papercuts ----------------------------------------------------------------------------------
def test_the_python_faces_papercuts():
    model = pycapsnet.build("capsnet", seed=0, **SMALL)
    summary = model.summary()
    assert repr(summary) == str(summary) and summary.startswith("layer")
    assert {"load_digits", "datasets", "study", "optim", "Model"} <= set(dir(pycapsnet))
    assert "efficient" in pycapsnet.build.__doc__ and "capsnet-published" in pycapsnet.build.__doc__
    assert "epochs" in model.fit.__doc__.split("\n\n")[0] and "0.85" in model.fit.__doc__.split("\n\n")[0]
    out = model.network.forward(np.zeros((2, 1, 28, 28), np.float32))
    assert out.scores is out.lengths
    with pytest.raises(CapsNetError, match=r"give \(64, 20, 20\)"):
        A.build_body(backends.get("numpy"), [A.conv2d(4, 3)], (20, 20, 64))


def test_a_second_copy_of_the_backends_package_is_taken(monkeypatch):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.syspath_prepend(root)
    monkeypatch.delitem(sys.modules, "backends", raising=False)
    import backends as second  # the repository's folder, imported under its own name

    B = second.get("numpy")
    assert type(B).__module__ != type(backends.get("numpy")).__module__
    assert backends.get(B).name == "numpy"
    model = pycapsnet.build("capsnet", backend=B, **SMALL)
    assert model.B.name == "numpy"
    json.dumps(model.recipe)


# ---- 6. tutorials that cannot rot ------------------------------------------------------------------
@pytest.mark.parametrize("name", ["1-routing-by-hand", "2-train-and-look-inside", "3-your-own-layer-in-pytorch",
                                  "4-your-own-routing"])
def test_each_tutorial_runs_at_its_small_size_in_a_kernel_and_keeps_its_outputs(name, monkeypatch, tmp_path):
    """Each tutorial in a real Jupyter kernel (nbclient), as a user runs it, its working folder a
    temporary one; the saved file is valid nbformat 4.5 (every cell has its id) and carries outputs."""
    pytest.importorskip("torch", reason="the tutorials check against autograd and wrap layers for PyTorch")
    nbformat = pytest.importorskip("nbformat", reason="the test extra installs it")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "docs", "tutorials", f"{name}.ipynb")
    saved = json.load(open(path))
    nbformat.validate(nbformat.reads(json.dumps(saved), as_version=4))
    assert (saved["nbformat"], saved["nbformat_minor"]) >= (4, 5) and all(c.get("id") for c in saved["cells"])
    code = [c for c in saved["cells"] if c["cell_type"] == "code"]
    assert code and all(c["outputs"] for c in code[1:]), "the saved notebook has cells without outputs: " \
        "python benchmarks/notebooks.py writes them"
    sys.path.insert(0, os.path.join(root, "benchmarks"))
    try:
        import notebooks
    finally:
        sys.path.pop(0)
    monkeypatch.setenv("PYCAPSNET_TUTORIAL_QUICK", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    notebooks.run_notebook(path, write=False, cwd=str(tmp_path))
    assert not os.listdir(tmp_path), "the tutorial leaves files behind"

"""The Python face (pycapsnet/api.py): build, fit on arrays, evaluate, predict, save, load, summary,
on numpy and torch; fit and the command line share one training loop; bad input is one
CapsNetError (or, for a misspelt keyword, a TypeError naming the real one)."""
import json
import os
import sys
import subprocess

import numpy as np
import pytest

import pycapsnet
from pycapsnet import CapsNetError
from pycapsnet.training import data, trainer
from tests.conftest import CPU_BACKENDS

SMALL = dict(conv_channels=16, primary_types=4)


@pytest.fixture(scope="module")
def digits():
    train, test = data.load_embedded()
    return train.images(slice(0, 64)), train.y[:64], test.images(slice(0, 32)), test.y[:32]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_the_readmes_lines_run(backend, digits, tmp_path):
    if backend == "torch":
        pytest.importorskip("torch", reason="the torch backend needs PyTorch")
    x_train, y_train, x_val, y_val = digits
    x_test, y_test = x_val, y_val
    model = pycapsnet.build("capsnet", input_shape=(1, 28, 28), n_classes=10, backend=backend, seed=0, **SMALL)
    history = model.fit(x_train, y_train, epochs=2, batch_size=16, validation_data=(x_val, y_val), progress=False)
    scores = model.evaluate(x_test, y_test)
    labels = model.predict(x_test)
    lengths = model.predict_scores(x_test)
    path = model.save(str(tmp_path / "mine.npz"))
    same = pycapsnet.load(path, backend=backend)
    text = model.summary()
    assert [r["epoch"] for r in history] == [1, 2] and all("val_acc" in r and "test_acc" not in r for r in history)
    assert set(scores) == {"loss", "accuracy"} and 0 <= scores["accuracy"] <= 1
    assert scores["accuracy"] == pytest.approx(history[-1]["val_acc"]) and labels.shape == (32,)
    assert lengths.shape == (32, 10) and ((lengths >= 0) & (lengths <= 1)).all()
    np.testing.assert_array_equal(same.predict(x_test), labels)
    assert same.history == history
    assert "classcaps" in text and f"total: {model.network.n_params():,} parameters" in text
    assert repr(model).startswith("pycapsnet.Model(conv1, primary, classcaps;")


def test_torch_tensors_and_one_channel_without_its_axis(digits):
    torch = pytest.importorskip("torch")
    x, y, _, _ = digits
    model = pycapsnet.build("capsnet", seed=0, **SMALL)
    a = model.predict_scores(x[:8])
    b = model.predict_scores(torch.tensor(x[:8, 0]))  # (N, H, W), a tensor
    np.testing.assert_array_equal(a, b)
    model.evaluate(torch.tensor(x[:8]), torch.tensor(y[:8]))


def test_fit_on_arrays_is_the_command_lines_run(digits, tmp_path):
    """The same digits, recipe and seed: fit's epochs are train_numpy.py's, bit for bit (its test
    split is fit's validation data)."""
    x, y, xv, yv = digits
    model = pycapsnet.build("capsnet", seed=0, **SMALL)
    history = model.fit(x, y, epochs=2, batch_size=16, validation_data=(xv, yv), progress=False,
                        out=str(tmp_path / "fit"))
    assert trainer.main("numpy", ["--conv-channels", "16", "--primary-types", "4", "--limit", "64",
                                  "--limit-test", "32", "--batch-size", "16", "--epochs", "2", "--no-progress",
                                  "--out", str(tmp_path / "cli")]) == 0
    cli = [json.loads(line) for line in (tmp_path / "cli" / "metrics.jsonl").read_text().splitlines()]
    assert [r["train_loss"] for r in history] == [r["train_loss"] for r in cli]
    assert [r["val_acc"] for r in history] == [r["test_acc"] for r in cli]
    # the run directory fit kept is one the command line reads
    done = subprocess.run([sys.executable, "-m", "pycapsnet", "inspect", str(tmp_path / "fit"), "--out",
                           str(tmp_path / "pngs"), "--dataset", "embedded"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert pycapsnet.load(str(tmp_path / "fit")).history == history


def test_a_described_network_and_image_files(digits, tmp_path):
    from PIL import Image

    from pycapsnet.core import architecture as A

    x, y, _, _ = digits
    net = A.network([A.conv2d(8, 9), A.relu(), A.primary_caps(2, 8, kernel=9, stride=2), A.dynamic_caps(10, 16)])
    model = pycapsnet.build(net, seed=1, classes=list("abcdefghij"))
    history = model.fit(x[:32], y[:32], epochs=2, batch_size=16, lr=1e-3, lr_decay=0.1, lr_min=5e-4, progress=False)
    assert [h["lr"] for h in history] == pytest.approx([1e-3, 5e-4])  # the decay stops at its floor
    Image.fromarray((x[0, 0] * 255).astype(np.uint8)).save(tmp_path / "d.png")
    [(path, best)] = model.predict(str(tmp_path / "d.png"), top=2)
    assert path.endswith("d.png") and len(best) == 2 and best[0][0] in "abcdefghij"
    assert model.predict(x[:3], top=1)[0][0][0] in "abcdefghij"


BAD = {
    "a misspelt keyword": (lambda m, x, y: m.fit(x, y, epoch=1), TypeError, "did you mean 'epochs'"),
    "the wrong shape": (lambda m, x, y: m.fit(x[:, :, :20], y), CapsNetError, "give (N, 1, 28, 28) or (N, 28, 28)"),
    "integer pixels": (lambda m, x, y: m.predict((x * 255).astype(np.uint8)), CapsNetError, "x / 255"),
    "a label out of range": (lambda m, x, y: m.fit(x, y + 10), CapsNetError, "give indices 0..9"),
    "one-hot labels": (lambda m, x, y: m.fit(x, np.eye(10)[y]), CapsNetError, "one class index each"),
    "N mismatch": (lambda m, x, y: m.fit(x, y[:-1]), CapsNetError, "there are 64 images"),
    "NaN": (lambda m, x, y: m.evaluate(np.where(x > 0.5, np.nan, x), y), CapsNetError, "NaN or inf"),
    "a string epochs": (lambda m, x, y: m.fit(x, y, epochs="3"), CapsNetError, "epochs must be a whole number"),
    "validation not a pair": (lambda m, x, y: m.fit(x, y, validation_data=x), CapsNetError, "a pair (x, y)"),
    "a floor above lr": (lambda m, x, y: m.fit(x, y, lr=1e-3, lr_min=1e-2), CapsNetError, "lr_min 0.01 is above lr"),
    "a negative floor": (lambda m, x, y: m.fit(x, y, lr_min=-1.0), CapsNetError, "lr_min must be a positive number"),
    "no images": (lambda m, x, y: m.predict(x[:0]), CapsNetError, "holds no images"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_clear_error(digits, case):
    x, y, _, _ = digits
    call, kind, message = BAD[case]
    model = pycapsnet.build("capsnet", seed=0, **SMALL)
    with pytest.raises(kind, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")) as e:
        call(model, x, y)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("seed", [-1, 1.5, "0", True])
def test_build_refuses_a_seed_that_is_not_a_whole_number(seed):
    with pytest.raises(CapsNetError, match=r"^seed must be a whole number of at least 0, got "):
        pycapsnet.build("capsnet", seed=seed, **SMALL)


def test_a_misspelt_network_names_the_choices():
    # (a routing registered by another test may sit between vb and efficient)
    with pytest.raises(CapsNetError, match="unknown network 'capsnett': give one of capsnet, dynamic, em, attention, "
                                           "uniform, random, inverted, self, vb, .*efficient, capsnet-published, "
                                           "or a description"):
        pycapsnet.build("capsnett")


def test_load_refuses_what_is_not_a_model(tmp_path):
    (tmp_path / "notes.npz").write_bytes(b"hello")
    with pytest.raises(CapsNetError, match="is not a readable pycapsnet checkpoint"):
        pycapsnet.load(str(tmp_path / "notes.npz"))


def test_an_arrays_run_asks_for_data_on_the_command_line(digits, tmp_path, capsys):
    from pycapsnet.tools import cli

    x, y, _, _ = digits
    pycapsnet.build("capsnet", seed=0, **SMALL).fit(x[:16], y[:16], epochs=1, batch_size=16, progress=False,
                                                     out=str(tmp_path / "r"))
    assert cli.main(["evaluate", str(tmp_path / "r")]) == 2
    assert "trained on arrays in memory" in capsys.readouterr().err
    assert os.path.exists(tmp_path / "r" / "checkpoint.npz")


def test_the_trainers_fit_checks_its_keywords_without_argparse(tmp_path):
    """trainer.fit(network, **flags) on data it reads: a misspelt or abbreviated flag is a TypeError
    naming the real one (argparse took 'epoch' for 'epochs'), a wrong value one CapsNetError."""
    from pycapsnet.core import architecture as A
    from pycapsnet.training.trainer import fit

    net = A.network([A.conv2d(8, 9), A.relu(), A.primary_caps(2, 8, kernel=9, stride=2), A.dynamic_caps(10, 16)])
    for wrong, near in (({"epoch": 1}, "epochs"), ({"limit_t": 16}, "limit_test"), ({"x": np.zeros(3)}, None)):
        with pytest.raises(TypeError, match=f"did you mean '{near}'" if near else "unexpected keyword argument 'x'"):
            fit(net, **wrong)
    with pytest.raises(CapsNetError, match="lr = 'fast' is not a value its flag takes"):
        fit(net, lr="fast")
    last = fit(net, epochs=1, limit=32, limit_test=16, batch_size=16, no_progress=True, out=str(tmp_path / "r"))
    assert last["epoch"] == 1


def test_layers_and_networks_show_their_structure():
    from pycapsnet import backends
    from pycapsnet import CapsNet
    from pycapsnet.core.capsules import ClassCaps

    net = CapsNet("numpy", **SMALL)
    text = repr(net)
    assert text.startswith("Network(1x28x28 -> 10 classes, 1,638,480 parameters on numpy:cpu/float32")
    assert "classcaps: ClassCaps(a 6x6 grid of 4 capsule types of 8D -> 10 capsules of 16D; W (36, 4, 10, 16, 8))" in text
    assert "decoder: 512 -> 1024 -> 784" in text and "object at 0x" not in text + repr(net.body)
    assert repr(ClassCaps(backends.get("numpy"), 4, 2, 4, 3, 5)) == "ClassCaps(W (4, 2, 3, 5, 4))"

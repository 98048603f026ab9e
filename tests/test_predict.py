"""Using a trained folder run: ``pycapsnet predict`` on image files, ``pycapsnet.load`` in Python,
``evaluate`` per class with a confusion matrix, the collapse warning, and the splits as datasets."""
import json
import os

import numpy as np
import pytest
from PIL import Image

import pycapsnet
from pycapsnet.tools import cli
from pycapsnet.training import checkpoint, data, trainer

SHAPES = ("disc", "square", "bar")


def _shape_images(root, per_class=12, size=16, seed=0):
    """Three classes of small RGB images: a red disc, a green square, a blue bar, placed at random on noise."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[:size, :size]
    for c, colour in zip(SHAPES, ([220, 40, 40], [40, 220, 40], [40, 40, 220])):
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            a = rng.integers(0, 90, (size, size, 3)).astype(np.uint8)
            y, x = rng.integers(4, size - 4, 2)
            mask = {"disc": (yy - y) ** 2 + (xx - x) ** 2 < 9, "square": (abs(yy - y) < 3) & (abs(xx - x) < 3),
                    "bar": (abs(yy - y) < 2) & (abs(xx - x) < 4)}[c]
            a[mask] = colour
            Image.fromarray(a).save(root / c / f"{c}{i:02d}.png")
    return root


ARCH = ["--conv-channels", "8", "--primary-types", "2", "--conv-kernel", "3", "--primary-kernel", "3",
        "--class-dim", "8", "--decoder-hidden", "32", "64", "--no-progress"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    images, out = _shape_images(root / "images"), root / "run"
    assert trainer.main("numpy", [*ARCH, "--dataset", "folder", "--data-dir", str(images), "--batch-size", "4",
                                  "--epochs", "4", "--out", str(out)]) == 0
    return images, out


def test_predict_prints_a_line_per_file_and_names_unreadable_ones_after(run, tmp_path, capsys):
    images, out = run
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"not an image")
    (tmp_path / "notes.txt").write_text("a file beside the images")
    Image.fromarray(np.zeros((40, 30, 3), np.uint8)).save(tmp_path / "big.jpg")  # resized to the run's 16x16
    capsys.readouterr()
    assert cli.main(["predict", str(out), str(bad), str(images / "disc" / "disc00.png"), str(tmp_path),
                     "--top", "2"]) == 2
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    assert [line.split("\t")[0] for line in lines] == [str(images / "disc" / "disc00.png"), str(tmp_path / "big.jpg")]
    for line in lines:
        path, c1, s1, c2, s2 = line.split("\t")
        assert {c1, c2} <= set(SHAPES) and c1 != c2 and float(s1) >= float(s2)
    err = captured.err.strip().splitlines()
    assert err[0].startswith("skipped 1 file(s) that are not images") and "notes.txt" in err[0]
    assert err[1:] == [f"error: cannot read the image {bad}: its contents are not an image format Pillow "
                       "decodes (a damaged or misnamed file?)"]


def test_predict_as_json_and_from_python_agree_with_the_models_own_scores(run, capsys):
    images, out = run
    files = sorted(str(p) for p in (images / "bar").iterdir())[:5]
    assert cli.main(["predict", str(out), *files, "--json", "--top", "3"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    loaded = pycapsnet.load(str(out))
    assert loaded.classes == tuple(sorted(SHAPES))
    assert [(r["path"], [(t["class"], pytest.approx(t["score"], rel=1e-6)) for t in r["top"]]) for r in records] \
        == loaded.predict(files, top=3)
    # the pixels the run trained or tested on: read() is the folder's decoding, x / 255
    tr, te = data.load_folder(str(images), seed=0)
    split = {tuple(split.files[k])[0]: (split, k) for split in (tr, te) for k in range(len(split))}
    for path, record in zip(files, records):
        own, k = split[os.path.relpath(path, images)]
        np.testing.assert_array_equal(loaded.read(path), own.images(k))
        scores = loaded.model.B.to_numpy(loaded.model.forward(own.images(slice(k, k + 1)), reconstruct=False).lengths)
        assert record["top"][0]["class"] == loaded.classes[int(np.argmax(scores[0]))]


def test_evaluate_prints_per_class_accuracy_and_writes_the_confusion_matrix(run, capsys):
    images, out = run
    capsys.readouterr()
    assert cli.main(["evaluate", str(out)]) == 0
    printed = capsys.readouterr().out
    record = json.loads((out / "confusion.json").read_text())
    counts = np.array(record["counts"])
    assert record["classes"] == sorted(SHAPES) and counts.shape == (3, 3)
    header = checkpoint.load(str(out))["header"]
    assert counts.sum() == sum(1 for r in header["data"] if r[4] == "test")
    acc = float(printed.split("test accuracy ")[1].split("%")[0])
    assert acc == pytest.approx(100 * np.trace(counts) / counts.sum(), abs=0.01)
    for k, name in enumerate(record["classes"]):
        assert f"  {name:<6}  {100 * counts[k, k] / counts[k].sum():6.2f}%  of {counts[k].sum()} images" in printed
    assert (out / "confusion.png").stat().st_size > 1000


def test_a_run_predicting_one_class_for_everything_says_so(tmp_path, capsys):
    images = _shape_images(tmp_path / "images", per_class=10)
    # the paper's network, one step an epoch: it predicts one class for every test image
    assert trainer.main("numpy", ["--no-progress", "--dataset", "folder", "--data-dir", str(images),
                                  "--conv-channels", "16", "--primary-types", "4", "--conv-kernel", "3",
                                  "--epochs", "1", "--batch-size", "32", "--out", str(tmp_path / "o")]) == 0
    printed = capsys.readouterr().out
    assert "warning: all 6 test images are predicted as " in printed and "after 1 training step:" in printed
    assert "--batch-size" in printed


def test_the_splits_are_map_style_datasets_a_torch_dataloader_takes(run):
    torch = pytest.importorskip("torch")
    images, _ = run
    for split in (data.load_embedded()[1], data.load_folder(str(images))[0]):
        x0, y0 = split[0]
        assert x0.dtype == np.float32 and x0.shape == split.x.shape[1:] and y0 == int(split.y[0])
        loader = torch.utils.data.DataLoader(split, batch_size=5, shuffle=False)
        x, y = next(iter(loader))
        np.testing.assert_array_equal(x.numpy(), split.images(slice(0, 5)))
        np.testing.assert_array_equal(y.numpy(), split.y[:5])
        assert len(split) == len(split.y)
    with pytest.raises(IndexError):
        split[len(split)]
    with pytest.raises(TypeError, match="split.take"):
        split[0:2]


def test_validation_split_best_checkpoint_and_early_stop_survive_resume(tmp_path, capsys):
    images, out = _shape_images(tmp_path / "images", per_class=12), tmp_path / "run"
    flags = [*ARCH, "--dataset", "folder", "--data-dir", str(images), "--batch-size", "4", "--out", str(out)]
    assert trainer.main("numpy", [*flags, "--epochs", "2", "--val-fraction", "0.25"]) == 0
    printed = capsys.readouterr().out
    assert "validation: 6 of the training images held out (--val-fraction 0.25)" in printed  # 30 train: 10 a class
    header = checkpoint.load(str(out))["header"]
    assert header["recipe"]["val_fraction"] == 0.25 and all("val_acc" in r for r in header["history"])
    best = max(header["history"], key=lambda r: (r["val_acc"], -r["epoch"]))["epoch"]
    assert checkpoint.load(str(out / "best.npz"))["header"]["epoch"] == best
    # resumed: the same validation images, the flag taken from the run; a learning rate of ~0 keeps
    # the validation accuracy where it is, so --early-stop 2 stops two epochs after the best
    assert cli.main(["train", "--no-progress", "--resume", str(out), "--epochs", "9", "--lr", "1e-12",
                     "--early-stop", "2"]) == 0
    printed = capsys.readouterr().out
    header = checkpoint.load(str(out))["header"]
    best = max(header["history"], key=lambda r: (r["val_acc"], -r["epoch"]))["epoch"]
    assert header["epoch"] == best + 2 < 9
    assert "early stop: no better validation accuracy in 2 epochs" in printed
    assert checkpoint.load(str(out / "best.npz"))["header"]["epoch"] == best
    # an early-stopped run resumed says so instead of training
    assert cli.main(["train", "--no-progress", "--resume", str(out), "--epochs", "9"]) == 0
    assert "resume with a larger --early-stop to train on" in capsys.readouterr().out
    assert checkpoint.load(str(out))["header"]["epoch"] == header["epoch"]
    assert cli.main(["train", "--no-progress", "--early-stop", "2", "--out", str(tmp_path / "x")]) == 2
    assert "--early-stop needs --val-fraction" in capsys.readouterr().err


def test_progress_in_a_log_is_plain_lines_about_every_tenth_of_an_epoch(tmp_path):
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "pycapsnet", "train", "--conv-channels", "8", "--primary-types", "2",
                          "--limit", "200", "--limit-test", "20", "--batch-size", "10", "--epochs", "1",
                          "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "\r" not in run.stdout + run.stderr
    lines = [line for line in run.stdout.splitlines() if line.startswith("  epoch 1/1: ")]
    assert [line.split(": ")[1].split(" ")[0] for line in lines] == [f"{k}/20" for k in range(2, 20, 2)]
    assert all("samples/s, loss " in line and ", acc " in line and "ETA " in line for line in lines)


def test_log_csv_and_tensorboard_record_step_groups_and_epochs_and_continue_on_resume(tmp_path):
    import csv

    out, table, events = tmp_path / "run", tmp_path / "scalars.csv", tmp_path / "tb"
    flags = ["--no-progress", "--conv-channels", "8", "--primary-types", "2", "--limit", "100", "--limit-test", "20",
             "--batch-size", "10", "--out", str(out), "--log-csv", str(table)]
    assert trainer.main("numpy", [*flags, "--epochs", "1", "--tensorboard", str(events)]) == 0
    assert trainer.main("numpy", [*flags, "--epochs", "2", "--resume", str(out)]) == 0
    rows = list(csv.DictReader(table.open()))
    steps = [r for r in rows if r["kind"] == "steps"]
    assert [int(r["step"]) for r in steps] == list(range(1, 21))  # 10 steps an epoch, a group of 1: 2 epochs
    epochs = [r for r in rows if r["kind"] == "epoch"]
    history = checkpoint.load(str(out))["header"]["history"]
    assert [(int(r["epoch"]), int(r["step"])) for r in epochs] == [(1, 10), (2, 20)]
    for r, h in zip(epochs, history):
        assert float(r["test_acc"]) == pytest.approx(h["test_acc"], rel=1e-5)
        assert float(r["loss"]) == pytest.approx(h["train_loss"], rel=1e-5)
    for r in steps:
        assert float(r["loss"]) == pytest.approx(float(r["margin"]) + float(r["reconstruction"]), rel=1e-4)
    tb = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator",
                             reason="--tensorboard needs pip install -e '.[tensorboard]'")
    acc = tb.EventAccumulator(str(events))
    acc.Reload()
    assert {"train_steps/loss", "epoch/loss", "test/acc"} <= set(acc.Tags()["scalars"])
    assert [e.step for e in acc.Scalars("train_steps/loss")] == list(range(1, 11))
    assert acc.Scalars("test/acc")[0].value == pytest.approx(history[0]["test_acc"], rel=1e-6)


def test_predict_trusts_nothing_it_is_given(run, tmp_path, capsys):
    """A FIFO in a directory is skipped and one given by name refused (neither hangs); a 2 GB file
    named .png is refused by its size before a byte is read; tabs and newlines in names cannot forge
    fields or lines; the good files are printed as they are made, errors said as they come."""
    images, out = run
    good = tmp_path / "dir" / "a\tb\nc.png"
    good.parent.mkdir()
    good.write_bytes((images / "disc" / "disc00.png").read_bytes())
    os.mkfifo(tmp_path / "dir" / "pipe.png")
    os.mkfifo(tmp_path / "named.png")
    huge = tmp_path / "huge.png"
    with open(huge, "wb") as f:
        f.truncate(2 << 30)  # sparse: no disk used
    capsys.readouterr()
    assert cli.main(["predict", str(out), str(tmp_path / "dir"), str(tmp_path / "named.png"), str(huge)]) == 2
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert len(lines) == 1 and lines[0].split("\t")[0] == str(good).replace("\t", "\\t").replace("\n", "\\n")
    err = captured.err
    assert "pipe.png" in err.splitlines()[0]  # skipped, not an image file
    assert f"error: cannot read the image {tmp_path / 'named.png'}: not a regular file" in err
    assert f"error: cannot read the image {huge}: 2,147,483,648 bytes, more than the image may hold" in err


def test_predict_escapes_class_names_with_tabs(run, tmp_path, capsys, monkeypatch):
    from pycapsnet.tools import predict

    images, out = run
    real = predict.Run.__init__

    def odd_names(self, *args, **kwargs):
        real(self, *args, **kwargs)
        self.classes = ("di\tsc", "squ\nare", "bar")

    monkeypatch.setattr(predict.Run, "__init__", odd_names)
    capsys.readouterr()
    assert cli.main(["predict", str(out), str(images / "disc" / "disc00.png"), "--top", "3"]) == 0
    fields = capsys.readouterr().out.rstrip("\n").split("\t")
    assert len(fields) == 7 and set(fields[1::2]) == {"di\\tsc", "squ\\nare", "bar"}

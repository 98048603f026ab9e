"""--dataset folder: images in one sub-directory per class, decoded once into uint8 storage."""
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pycapsnet import CapsNetError

from pycapsnet.training import checkpoint, data, trainer

from pycapsnet.tools import cli

ARCH = ["--conv-channels", "8", "--primary-types", "2", "--no-progress", "--batch-size", "16"]


def _write(folder: Path, split: data.Split, start=0):
    """Each image as a PNG in folder/<class>/<index>.png; the index, zero-padded, keeps the order."""
    for k in range(len(split)):
        d = folder / str(int(split.y[k]))
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.round(split.x[k, 0] * 255).astype(np.uint8)).save(d / f"{start + k:05d}.png")


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """The first 96 training and 40 test digits of the embedded set, as PNGs under train/ and test/."""
    tr, te = data.load_embedded()
    tr, te = tr.head(96), te.head(40)
    assert len(set(tr.y)) == len(set(te.y)) == 10  # every class in both halves
    root = tmp_path_factory.mktemp("digits")
    _write(root / "train", tr)
    _write(root / "test", te, start=len(tr))
    return root


def test_training_from_a_folder_is_training_on_the_same_digits(digits, tmp_path):
    """The same seed and images give the same losses and weights through either path, exactly."""
    tr, te = data.load_folder(str(digits))
    assert tr.x.dtype == np.uint8 and tr.x.shape == (96, 1, 28, 28) and tr.classes == data.DIGITS
    assert trainer.main("numpy", [*ARCH, "--dataset", "folder", "--data-dir", str(digits), "--epochs", "2",
                                  "--out", str(tmp_path / "folder")]) == 0
    assert trainer.main("numpy", [*ARCH, "--limit", "96", "--limit-test", "40", "--epochs", "2",
                                  "--out", str(tmp_path / "embedded")]) == 0
    a, b = checkpoint.load(str(tmp_path / "folder")), checkpoint.load(str(tmp_path / "embedded"))
    for ra, rb in zip(a["header"]["history"], b["header"]["history"]):
        assert (ra["train_loss"], ra["test_loss"]) == (rb["train_loss"], rb["test_loss"])
    for k in b["params"]:
        np.testing.assert_array_equal(a["params"][k], b["params"][k], err_msg=k)
    assert a["header"]["classes"] == list(data.DIGITS)
    assert a["header"]["recipe"]["dataset"] == "folder" and a["header"]["recipe"]["data_dir"] == str(digits)
    assert cli.main(["evaluate", str(tmp_path / "folder")]) == 0  # the run's folder, found from the checkpoint


def test_a_folder_without_train_and_test_holds_out_a_seeded_share_of_each_class(tmp_path):
    rng = np.random.default_rng(0)
    for name, n in (("cat", 10), ("dog", 5), ("eel", 2)):
        (tmp_path / name).mkdir()
        for k in range(n):
            Image.fromarray(rng.integers(0, 255, (6, 8, 3), dtype=np.uint8)).save(tmp_path / name / f"{k}.jpg")
    tr, te = data.load_folder(str(tmp_path), test_fraction=0.2, seed=1)
    assert tr.classes == ("cat", "dog", "eel") and tr.x.shape[1:] == (3, 6, 8)  # RGB from the images
    assert np.bincount(te.y).tolist() == [2, 1, 1] and np.bincount(tr.y).tolist() == [8, 4, 1]
    again, _ = data.load_folder(str(tmp_path), test_fraction=0.2, seed=1)
    np.testing.assert_array_equal(again.x, tr.x)
    grey, _ = data.load_folder(str(tmp_path), channels=1, image_size=(12, 10))
    assert grey.x.shape[1:] == (1, 12, 10)
    assert grey.images(slice(0, 2)).dtype == np.float32 and grey.images().max() <= 1


def _one_png(path, size=(4, 4), mode="L"):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size).save(path)


@pytest.mark.parametrize("make,message", [
    (lambda d: (_one_png(d / "a" / "1.png"), (d / "b").mkdir()), "the class folder {d}/b holds no images"),
    (lambda d: _one_png(d / "a" / "1.png"), "{d} holds one class folder (a): a classifier needs at least two"),
    (lambda d: _one_png(d / "1.png"), "{d} holds no class folders"),
    (lambda d: (_one_png(d / "a" / "1.png"), _one_png(d / "b" / "2.png", (5, 4))),
     "{d}/b/2.png is 4x5 but {d}/a/1.png is 4x4: give --image-size H W"),
    (lambda d: (_one_png(d / "a" / "1.png"), (d / "b").mkdir(), (d / "b" / "2.png").write_bytes(b"\x89PNG\r\n")),
     "cannot read the image {d}/b/2.png"),
    (lambda d: (_one_png(d / "train" / "a" / "1.png"), _one_png(d / "train" / "b" / "1.png")),
     "{d} has a train/ folder but no test/ one"),
])
def test_bad_folders_are_one_line_naming_the_file(tmp_path, capsys, make, message):
    d = tmp_path / "data"
    d.mkdir()
    make(d)
    assert trainer.main("numpy", [*ARCH, "--dataset", "folder", "--data-dir", str(d), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert message.format(d=d) in err and len(err.strip().splitlines()) == 1, err


def test_a_truncated_image_is_named(tmp_path):
    d = tmp_path / "data"
    for name in ("a", "b"):
        (d / name).mkdir(parents=True)
        Image.fromarray(np.full((32, 32), 7, np.uint8)).save(d / name / "1.png")
    whole = (d / "b" / "1.png").read_bytes()
    (d / "b" / "1.png").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(CapsNetError, match=f"cannot read the image {d}/b/1.png"):
        data.load_folder(str(d))


def test_folder_flags_go_with_the_folder_dataset_and_classes_with_their_checkpoint(digits, tmp_path, capsys):
    assert trainer.main("numpy", [*ARCH, "--image-size", "32", "32", "--out", str(tmp_path / "o")]) == 2
    assert ("--image-size says how to read a folder of images: it goes with --dataset folder, not --dataset "
            "embedded") in capsys.readouterr().err
    assert trainer.main("numpy", [*ARCH, "--dataset", "folder", "--data-dir", str(digits), "--epochs", "1",
                                  "--out", str(tmp_path / "run")]) == 0
    other = tmp_path / "other"
    for k, name in enumerate(["zero", "one"] + [f"c{k}" for k in range(2, 10)]):
        _one_png(other / "train" / name / "1.png", (28, 28))
        _one_png(other / "test" / name / "1.png", (28, 28))
    capsys.readouterr()
    assert cli.main(["evaluate", str(tmp_path / "run"), "--dataset", "folder", "--data-dir", str(other)]) == 2
    assert "the data's classes (c2, c3, c4, c5, c6, c7, c8, c9, one, zero) are not those of the model" \
           in capsys.readouterr().err

"""A folder run knows its data: what changed since the run recorded it is refused (or accepted and
recorded), the held-out split survives additions, every bit depth and orientation reads right,
limits keep every class, and oversized images are refused before anything is allocated."""
import shutil
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pycapsnet.tools import cli
from pycapsnet.training import checkpoint, checkpoint_header, data, folder, preflight, trainer

ARCH = ["--conv-channels", "4", "--primary-types", "2", "--no-progress", "--batch-size", "8"]
CLASSES = ("ant", "bee", "cow")


def _image(rng, k):
    """A 20x20 grey image that tells its class k apart (a bright row band) under noise."""
    a = rng.integers(0, 60, (20, 20)).astype(np.uint8)
    a[6 * k:6 * k + 5] = 220
    return a


def _folder(root: Path, per_class=8, start=0, seed=0):
    rng = np.random.default_rng([seed, start])
    for k, name in enumerate(CLASSES):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(start, start + per_class):
            Image.fromarray(_image(rng, k)).save(root / name / f"{name}{i:03d}.png")
    return root


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A folder of 3 x 8 images and a one-epoch run on it."""
    base = tmp_path_factory.mktemp("fp")
    images = _folder(base / "images")
    assert trainer.main("numpy", [*ARCH, "--dataset", "folder", "--data-dir", str(images), "--epochs", "1",
                                  "--out", str(base / "run")]) == 0
    return base


def _copy(trained, tmp_path):
    shutil.copytree(trained / "images", tmp_path / "images")
    shutil.copytree(trained / "run", tmp_path / "run")
    # the run records where its images were: point it at the copy, as a user's moved folder would be
    return tmp_path / "images", ["--data-dir", str(tmp_path / "images")]


def _swap(images: Path):
    a, b = images / "ant" / "ant000.png", images / "bee" / "bee000.png"
    da, db = a.read_bytes(), b.read_bytes()
    a.write_bytes(db), b.write_bytes(da)


@pytest.mark.parametrize("change,said", [
    (lambda d: _folder(d, per_class=4, start=8, seed=1), "12 file(s) added (ant/ant008.png"),
    (lambda d: (d / "cow" / "cow003.png").unlink(), "1 file(s) removed (cow/cow003.png)"),
    (lambda d: Image.fromarray(np.zeros((20, 20), np.uint8)).save(d / "bee" / "bee002.png"),
     "1 file(s) modified (bee/bee002.png)"),
    (_swap, "2 image(s) now in another class (ant/ant000.png, bee/bee000.png)"),
])
def test_a_changed_folder_is_refused_saying_what_changed_unless_accepted(trained, tmp_path, capsys, change, said):
    images, here = _copy(trained, tmp_path)
    run = str(tmp_path / "run")
    assert cli.main(["evaluate", run, *here]) == 0  # the same images, moved: accepted without a word
    before = checkpoint.load(run)["header"]["data"]
    change(images)
    capsys.readouterr()
    for argv in (["evaluate", run, *here],
                 ["train", "--resume", run, *here, "--epochs", "2", "--no-progress"]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert said in err and "--accept-changed-data" in err and len(err.strip().splitlines()) == 1, err
    assert cli.main(["train", "--resume", run, *here, "--epochs", "2", "--no-progress", "--accept-changed-data"]) == 0
    header = checkpoint.load(run)["header"]
    assert said in header["data_changes"][-1]["changes"][-1] and header["data_changes"][-1]["epoch"] == 1
    # every image still there keeps the split the run recorded for it
    now = folder.splits(header["data"])
    assert all(now[p] == split for p, split in folder.splits(before).items() if p in now)
    assert cli.main(["evaluate", run, *here]) == 0  # the new record is the run's now


def test_added_images_never_move_an_image_between_the_splits(tmp_path):
    _folder(tmp_path, per_class=10)
    train, test = data.load_folder(str(tmp_path), seed=3)
    record = folder.fingerprint(train, test)
    for start in (10, 13, 30):  # more and more images, each time against the last record
        _folder(tmp_path, per_class=3 if start < 30 else 20, start=start, seed=start)
        train2, test2 = data.load_folder(str(tmp_path), seed=3, recorded=folder.splits(record))
        now = folder.fingerprint(train2, test2)
        before, after = folder.splits(record), folder.splits(now)
        assert all(after[p] == split for p, split in before.items())
        assert not [c for c in folder.changes(record, now) if "split" in c or "training" in c]
        record = now
    counts = np.bincount(test2.y)
    assert counts.min() >= 0.2 * 36 - 3, counts  # still about a fifth of each class


def test_every_bit_depth_and_the_exif_orientation_read_right(tmp_path, capsys):
    ramp = (np.arange(24 * 32).reshape(24, 32) * 85).astype(np.uint16)  # 0 .. 65195
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    Image.fromarray(ramp).save(tmp_path / "a" / "deep.png")  # mode I;16
    assert Image.open(tmp_path / "a" / "deep.png").mode.startswith("I")
    rgb = np.zeros((24, 32, 3), np.uint8)
    rgb[:4, :, 0] = 255  # a red band at the top, as the picture is seen
    # stored turned a quarter (32 x 24), with the EXIF orientation 8 that turns it back upright
    stored = Image.fromarray(np.rot90(rgb, -1).copy())
    exif = Image.Exif()
    exif[0x0112] = 8
    stored.save(tmp_path / "b" / "turned.png", exif=exif)
    Image.fromarray(rgb).save(tmp_path / "b" / "plain.webp", lossless=True)
    Image.fromarray(rgb).convert("P").save(tmp_path / "a" / "anim.gif")
    (tmp_path / "a" / "notes.txt").write_text("not an image")
    x, y, files, classes, _, _ = folder.load(str(tmp_path), channels=3)
    assert "skipped 1 file that is not an image" in capsys.readouterr().out
    names = [p for p, _, _ in files]
    deep = x[names.index("a/deep.png")]
    np.testing.assert_array_equal(deep[0], np.round(ramp / 257.0).astype(np.uint8))  # not clipped at 255
    assert (deep == 255).mean() < 0.01
    turned = x[names.index("b/turned.png")]
    np.testing.assert_array_equal(turned, np.moveaxis(rgb, -1, 0))  # upright, 24 x 32
    np.testing.assert_array_equal(x[names.index("b/plain.webp")], np.moveaxis(rgb, -1, 0))
    assert x[names.index("a/anim.gif")][0, 0, 0] == 255


def test_folder_limits_keep_every_class_and_the_embedded_set_its_first_images(tmp_path):
    _folder(tmp_path, per_class=8)  # file names start with the class: sorted, the first ones are one class
    train, test = data.load_folder(str(tmp_path))
    small = train.limited(6, seed=0)
    assert np.bincount(small.y).tolist() == [2, 2, 2]
    assert sorted(test.limited(2, seed=0).y.tolist()) in ([0, 1], [0, 2], [1, 2])
    assert small.files is not None and len(small.files) == 6
    again = train.limited(6, seed=0)
    np.testing.assert_array_equal(again.x, small.x)
    emb, _ = data.load_embedded()
    np.testing.assert_array_equal(emb.limited(48, seed=5).x, emb.x[:48])  # the reference runs' --limit 48


def _png_header_only(path: Path, width: int, height: int):
    """A PNG whose header claims width x height pixels, with almost no data behind it."""
    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 10))
                     + chunk(b"IEND", b""))


def test_oversized_images_are_refused_before_anything_is_allocated(tmp_path, capsys, monkeypatch):
    memory = 16 * 2**30  # a 16 GiB machine, whatever this one has
    monkeypatch.setattr(folder, "machine_memory", lambda: memory)
    monkeypatch.setattr(preflight, "machine_memory", lambda: memory)
    _folder(tmp_path / "d", per_class=2)
    _png_header_only(tmp_path / "d" / "ant" / "aaa.png", 50000, 50000)
    argv = [*ARCH, "--dataset", "folder", "--data-dir", str(tmp_path / "d"), "--out", str(tmp_path / "o")]
    assert trainer.main("numpy", argv) == 2
    err = capsys.readouterr().err
    assert "aaa.png declares an image too large to decode safely (2,500 megapixels, 7.0 GiB decoded in RGB)" in err
    (tmp_path / "d" / "ant" / "aaa.png").unlink()
    assert trainer.main("numpy", [*argv, "--image-size", "100000", "100000"]) == 2
    err = capsys.readouterr().err
    assert "6 images of 100000x100000 with 1 channel would need 279.4 GiB to decode, more than this machine's " \
           "16.0 GiB" in err
    assert len(err.strip().splitlines()) == 1
    # the set alone (5.0 GiB) fits; one image's working copies while it is resized do not
    assert trainer.main("numpy", [*argv, "--image-size", "30000", "30000"]) == 2
    assert "6 images of 30000x30000 with 1 channel would need 25.1 GiB to decode" in capsys.readouterr().err
    # the images fit; the per-position transforms of the network for them do not
    assert trainer.main("numpy", [*argv, "--image-size", "3000", "3000"]) == 2
    err = capsys.readouterr().err
    assert "the network for 3000x3000 images holds 10,935,173,080 parameters, 231.6 GiB" in err and "--share-spatial" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("flags,said", [
    (["--routing", "attention", "--routing-grad", "final"], "--routing-grad does nothing with --routing attention"),
    (["--routing", "attention", "--routing-iters", "5"], "--routing-iters does nothing with --routing attention"),
    (["--routing", "em", "--share-spatial"], "--share-spatial does nothing with --routing em"),
    (["--routing", "em", "--primary-conv", "im2col"], "--primary-conv does nothing with --routing em"),
    (["--em-lambda", "0.01"], "--em-lambda does nothing with --routing dynamic"),
])
def test_flags_a_network_ignores_are_refused(tmp_path, capsys, flags, said):
    assert trainer.main("numpy", [*ARCH, *flags, "--limit", "8", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert said in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_eval_only_with_another_routing_is_refused(tmp_path, capsys):
    run = str(tmp_path / "em")
    assert trainer.main("numpy", ["--routing", "em", "--conv-channels", "4", "--primary-types", "2", "--limit", "16",
                                  "--limit-test", "8", "--epochs", "1", "--no-progress", "--out", run]) == 0
    capsys.readouterr()
    assert trainer.main("numpy", ["--resume", run, "--eval-only", "--routing", "dynamic"]) == 2
    assert "--routing dynamic (the checkpoint has em)" in capsys.readouterr().err


def test_a_damaged_data_record_is_named(trained, tmp_path):
    header = checkpoint.load(str(trained / "run"))["header"]
    header["data"][0] = ["x", "ant", "big", "0", "train"]
    assert "its record of the data it read is not a list of" in checkpoint_header.header_problem(header)


def test_crosscheck_of_a_folder_run_feeds_the_runs_own_images(trained, capsys):
    pytest.importorskip("torch")
    assert cli.main(["crosscheck", "--checkpoint", str(trained / "run"), "--batch", "4"]) == 0
    out = capsys.readouterr().out
    assert f"the first 4 test images of its run ({trained / 'images'})" in out.splitlines()[0]
    assert cli.main(["crosscheck", "--routing", "dynamic", "--batch", "2", "--seed", "1"]) == 0
    assert "2 test digits" in capsys.readouterr().out

"""The newest surfaces under faults (issue 86): the Python API, the torch wrapper, the IDX reader and
the record tool.  Each test is one reproduction of the issue; each fault ends in one line naming the
problem and the fix, never loses a file, never blocks and never allocates before it checks."""
import gzip
import json
import os
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest

import pycapsnet
from pycapsnet import CapsNetError
from pycapsnet.core import architecture as A
from pycapsnet.training import checkpoint, data, trainer
from pycapsnet.tools import cli
from tests.test_faults import TINY, _rewrite_header

ROOT = Path(__file__).resolve().parent.parent
SMALL = dict(conv_channels=8, primary_types=2)


@pytest.fixture(scope="module")
def digits():
    train, _ = data.load_embedded()
    return train.images(slice(0, 32)), train.y[:32]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A one-epoch run directory of the tiny network."""
    out = tmp_path_factory.mktemp("surfaces") / "run"
    assert trainer.main("numpy", [*TINY, "--epochs", "1", "--out", str(out)]) == 0
    return out


def _one_line(capsys, *fragments):
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for f in fragments:
        assert f in err, err


# ---- data loss ---------------------------------------------------------------------------------
@pytest.mark.parametrize("classes", [list(range(10)), np.arange(10), tuple("abcdefghij")])
def test_class_names_build_accepts_are_stored_and_read_back(tmp_path, digits, classes):
    """1, 17: whole numbers and arrays of them are names; what fit writes, load reads."""
    x, y = digits
    model = pycapsnet.build("capsnet", seed=0, classes=classes, **SMALL)
    model.fit(x, y, epochs=1, batch_size=16, out=str(tmp_path / "run"), progress=False)
    again = pycapsnet.load(str(tmp_path / "run"))
    assert again.classes == tuple(str(c) for c in classes) == model.classes


@pytest.mark.parametrize("classes, said", [([None] * 10, "class 0 is None"), (["a"] * 10, "'a' twice"),
                                           ("0123456789", "a list of names"), ([1.5] * 10, "class 0 is 1.5")])
def test_class_names_that_cannot_be_stored_are_refused_by_build(classes, said):
    with pytest.raises(CapsNetError, match=said):
        pycapsnet.build("capsnet", classes=classes, **SMALL)


@pytest.mark.parametrize("kind", ["fifo", "socket"])
def test_save_never_replaces_a_fifo_or_another_special_file(tmp_path, kind):
    """2 (a socket stands for a device node, which only root may make; /dev/null itself is not put
    at risk of a regression's replacing it)."""
    import socket

    model = pycapsnet.build("capsnet", **SMALL)
    target = str(tmp_path / "node.npz")
    if kind == "fifo":
        os.mkfifo(target)
    else:
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(target)
    with pytest.raises(CapsNetError, match="not a regular file"):
        model.save(target)
    assert os.path.exists(target) and not os.path.isfile(target)


def test_save_does_not_replace_a_run_directorys_checkpoint(run, tmp_path):
    """3: the run's record stays, whether the directory or its checkpoint file is named."""
    before = (run / "checkpoint.npz").read_bytes()
    model = pycapsnet.build("capsnet", **SMALL)
    for target in (run, run / "checkpoint.npz", run / "other.npz"):
        with pytest.raises(CapsNetError, match="is a run directory"):
            model.save(str(target))
    assert (run / "checkpoint.npz").read_bytes() == before and not (run / "other.npz").exists()
    assert model.save(str(tmp_path / "mine.npz")) == str(tmp_path / "mine.npz")


def _record(run, dest, *extra):
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "record_run.py"), str(run), str(dest),
                           "--command", "train_numpy.py", "--commit", "abc", *extra],
                          capture_output=True, text=True, cwd=ROOT)


@pytest.mark.parametrize("fault", ["empty", "garbage", "missing log", "no run", "dest a file", "no train_seconds"])
def test_record_run_checks_everything_before_it_writes(run, tmp_path, fault):
    """4, 23: an earlier record stays as it was; one line, exit 2 -- or, without train_seconds, a record
    that says the time is unknown."""
    src = tmp_path / "src"
    src.mkdir()
    lines = (run / "metrics.jsonl").read_text()
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "metrics.jsonl").write_text("earlier\n")
    (dest / "curves.png").write_bytes(b"earlier")
    extra = []
    if fault == "empty":
        (src / "metrics.jsonl").write_text("")
    elif fault == "garbage":
        (src / "metrics.jsonl").write_text("{not json\n")
    elif fault == "missing log":
        (src / "metrics.jsonl").write_text(lines)
        extra = ["--log", str(tmp_path / "nowhere.log")]
    elif fault == "no run":
        src = tmp_path / "absent"
    elif fault == "dest a file":
        (src / "metrics.jsonl").write_text(lines)
        dest = tmp_path / "file"
        dest.write_text("mine")
    else:
        records = [json.loads(line) for line in lines.splitlines()]
        (src / "metrics.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if k != "train_seconds"})
                                                   + "\n" for r in records))
    done = _record(src, dest, *extra)
    if fault == "no train_seconds":
        assert done.returncode == 0, done.stderr
        assert "training time not recorded" in (dest / "README.md").read_text()
        assert json.loads((dest / "record.json").read_text())["wall_seconds"] is None
        return
    assert done.returncode == 2 and done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr
    if fault == "dest a file":
        assert dest.read_text() == "mine"
    else:
        assert (dest / "metrics.jsonl").read_text() == "earlier\n" and (dest / "curves.png").read_bytes() == b"earlier"
        assert sorted(os.listdir(dest)) == ["curves.png", "metrics.jsonl"]


# ---- silent wrong ------------------------------------------------------------------------------
def _idx(path, array, code):
    dtype = {0x08: ">u1", 0x0D: ">f4", 0x0B: ">i2"}[code]
    a = np.asarray(array, dtype)
    raw = bytes([0, 0, code, a.ndim]) + np.asarray(a.shape, ">i4").tobytes() + a.tobytes()
    with (gzip.open if str(path).endswith(".gz") else open)(path, "wb") as f:
        f.write(raw)


def _idx_dir(root, images, code=0x08, labels=None):
    root.mkdir(exist_ok=True)
    labels = np.arange(len(images)) % 10 if labels is None else labels
    for part in ("train", "test"):
        img, lbl = data.IDX_FILES[part]
        _idx(root / img, images, code)
        _idx(root / lbl, labels, 0x08)
    return root


def test_float_idx_pixels_in_the_unit_interval_are_taken_as_they_are(tmp_path):
    """5: float pixels are not divided by 255 again; out of [0, 1] they are refused, not guessed at."""
    rng = np.random.default_rng(0)
    x = rng.random((20, 28, 28)).astype(np.float32)
    train, _ = data.load_idx_dir(str(_idx_dir(tmp_path / "f", x, 0x0D)))
    np.testing.assert_array_equal(train.x[:, 0], x)
    byte_train, _ = data.load_idx_dir(str(_idx_dir(tmp_path / "b", np.round(255 * x), 0x08)))
    np.testing.assert_allclose(byte_train.x[:, 0], np.round(255 * x) / 255, rtol=0, atol=0)
    with pytest.raises(CapsNetError, match=r"float pixels must lie in \[0, 1\], found values 0..255"):
        data.load_idx_dir(str(_idx_dir(tmp_path / "g", 255 * (x > 0.5), 0x0D)))
    with pytest.raises(CapsNetError, match=r"whole-number pixels must lie in 0..255"):
        data.load_idx_dir(str(_idx_dir(tmp_path / "s", -x.astype(np.int16) - 1, 0x0B)))


def test_an_unsigned_checkpoint_is_read_unverified_and_never_resumed(run, tmp_path, capsys):
    """7: an edited header without its digest evaluates with a warning, and --resume refuses it
    (which would sign it afresh)."""
    edited = tmp_path / "edited"
    edited.mkdir()

    def edit(h):
        h.pop("digest")
        h["recipe"]["lr"] = 0.5
        return h

    _rewrite_header(run / "checkpoint.npz", edit, dst=edited / "checkpoint.npz", rebind=False)
    ckpt = checkpoint.load(str(edited))
    assert ckpt["unverified"] and "no digest" in capsys.readouterr().out
    assert trainer.main("numpy", ["--resume", str(edited), "--epochs", "2", "--no-progress"]) == 2
    _one_line(capsys, "carries no digest", "never continued")
    assert "digest" not in checkpoint.load(str(edited))["header"]
    assert cli.main(["evaluate", str(edited)]) == 0


@pytest.mark.parametrize("shape, said", [((1.0, 28.5, 28), "three whole numbers"), ("1x28x28", "three whole numbers"),
                                         (None, "three whole numbers"), ((1, 28), "three whole numbers"),
                                         ((1, 0, 28), "three whole numbers")])
def test_build_refuses_an_input_shape_it_would_truncate_or_misread(shape, said):
    """8, 20."""
    with pytest.raises(CapsNetError, match=said):
        pycapsnet.build("capsnet", input_shape=shape, **SMALL)


def test_build_refuses_what_is_no_network_in_one_line():
    """20."""
    with pytest.raises(CapsNetError, match="network must be the name of one"):
        pycapsnet.build(["conv2d"])


# ---- hangs -------------------------------------------------------------------------------------
def _finishes(fn, seconds=20):
    """fn() in a thread: what it returned or raised, or a failure if it blocks."""
    out = {}

    def go():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 -- handed to the test
            out["error"] = e

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "blocked on a FIFO"
    return out


def test_fifos_are_refused_wherever_a_users_path_is_read(tmp_path, capsys):
    """9: a description, an IDX file and --log-csv that are FIFOs, each refused at once."""
    fifo = str(tmp_path / "net.json")
    os.mkfifo(fifo)
    got = _finishes(lambda: pycapsnet.build(fifo))
    assert isinstance(got.get("error"), CapsNetError) and "not a regular file" in str(got["error"])
    for argv in (["plan", "--network", fifo], ["gradcheck", "--network", fifo]):
        got = _finishes(lambda: cli.main(argv))
        assert got.get("value") == 2
        _one_line(capsys, "not a regular file")
    got = _finishes(lambda: trainer.main("numpy", ["--network", fifo, "--out", str(tmp_path / "r")]))
    assert got.get("value") == 2
    _one_line(capsys, "not a regular file")
    idx = _idx_dir(tmp_path / "idx", np.zeros((10, 28, 28)))
    os.unlink(idx / data.IDX_FILES["train"][0])
    os.mkfifo(idx / data.IDX_FILES["train"][0])
    got = _finishes(lambda: data.load_idx_dir(str(idx)))
    assert isinstance(got.get("error"), CapsNetError) and "not a regular file" in str(got["error"])
    log = str(tmp_path / "log.csv")
    os.mkfifo(log)
    got = _finishes(lambda: trainer.main("numpy", [*TINY, "--epochs", "1", "--out", str(tmp_path / "r2"),
                                                   "--log-csv", log]))
    assert got.get("value") == 2
    _one_line(capsys, "--log-csv", "not a regular file")


# ---- unbounded memory --------------------------------------------------------------------------
def test_a_description_is_read_to_its_bound_and_no_further(tmp_path):
    """10: /dev/zero and a file larger than any description, refused by what they are."""
    with pytest.raises(CapsNetError, match="not a regular file"):
        A.load("/dev/zero")
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(A.DESCRIPTION_LIMIT + 1)  # sparse: nothing is written
    with pytest.raises(CapsNetError, match="more than the network description may hold"):
        pycapsnet.build(str(big))


def test_a_png_of_absurd_proportions_is_refused_before_it_is_decoded(tmp_path):
    """11: 1 x 170,000,000 pixels (under Pillow's bomb limit) in a few hundred KB."""
    from pycapsnet.training import folder

    path = tmp_path / "thin.png"
    width = 170_000_000
    row = b"\0" + bytes(width)  # one scanline of a grey image, filter 0
    png = _png(width, 1, zlib.compress(row, 9))
    path.write_bytes(png)
    assert path.stat().st_size < 1_000_000
    with pytest.raises(CapsNetError, match="pixels"):
        folder.read_image(str(path), 1, (28, 28))


def _png(w, h, idat):
    import struct

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0)) + \
        chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def test_an_idx_gz_that_inflates_past_its_header_is_refused_without_inflating_it(tmp_path, monkeypatch):
    """12: the header's counts bound what is read; a header beyond what such a file holds is refused."""
    path = tmp_path / "bomb-idx3-ubyte.gz"
    with gzip.open(path, "wb", compresslevel=9) as f:
        f.write(bytes([0, 0, 8, 3]) + np.asarray([10, 28, 28], ">i4").tobytes())
        zeros = bytes(1 << 20)
        for _ in range(64):  # 64 MiB inflated, far more than the 7,840 bytes declared
            f.write(zeros)
    read = []
    real = gzip.GzipFile.readinto
    monkeypatch.setattr(gzip.GzipFile, "readinto", lambda self, b: read.append(len(b)) or real(self, b))
    with pytest.raises(CapsNetError, match="truncated or corrupt"):
        data.read_idx(str(path), 3)
    assert sum(read) < 1 << 20
    huge = tmp_path / "huge-idx3-ubyte"
    huge.write_bytes(bytes([0, 0, 8, 3]) + np.asarray([2**30, 28, 28], ">i4").tobytes())
    with pytest.raises(CapsNetError, match="more than an IDX file of images holds"):
        data.read_idx(str(huge), 3)


@pytest.mark.parametrize("layer", [A.primary_caps(4, 8, kernel=1500), A.conv2d(4, 3000)])
def test_windows_that_do_not_fit_are_refused_before_the_weights_are_drawn(layer, monkeypatch):
    """13: refused by its sizes; the layer is never constructed (its weights never drawn)."""
    made = []
    for cls in ("PrimaryCaps", "Conv2d"):
        real = getattr(A, cls)
        monkeypatch.setattr(A, cls, lambda *a, real=real, **k: made.append(a) or real(*a, **k))
    arch = A.network([A.conv2d(4, 9), layer], input_shape=(1, 28, 28), n_classes=10)
    with pytest.raises(CapsNetError, match="windows .* do not fit"):
        A.build(arch)
    assert len(made) == 1  # conv2d(4, 9) alone


def test_conv_matrix_caps_windows_that_do_not_fit_are_refused(monkeypatch):
    arch = A.network([A.conv2d(4, 5, stride=2), A.primary_matrix_caps(2), A.conv_matrix_caps(2, kernel=3000),
                      A.class_matrix_caps(10)], head="activations", loss=A.spread_loss(), decoder=None,
                     input_shape=(1, 28, 28), n_classes=10)
    made = []
    monkeypatch.setattr(A, "ConvMatrixCaps", lambda *a, **k: made.append(a))
    with pytest.raises(CapsNetError, match="windows .* do not fit"):
        A.build(arch)
    assert not made


# ---- tracebacks --------------------------------------------------------------------------------
def test_relu_after_matrix_capsules_is_refused_at_build():
    """14."""
    arch = A.network([A.conv2d(4, 5, stride=2), A.primary_matrix_caps(2), A.relu(), A.class_matrix_caps(10)],
                     head="activations", loss=A.spread_loss(), decoder=None, input_shape=(1, 28, 28), n_classes=10)
    with pytest.raises(CapsNetError, match=r"relu.*cannot follow .*pose, activation"):
        A.build(arch)


@pytest.mark.parametrize("value", [None, "0.5", 1.5, True])
def test_a_history_record_that_is_not_numbers_is_a_damaged_checkpoint(run, tmp_path, capsys, value):
    """15: history lies outside the digest, so each record's values are checked."""
    dst = tmp_path / "r"
    dst.mkdir()

    def edit(h):
        h["history"][-1]["test_acc"] = value
        return h

    _rewrite_header(run / "checkpoint.npz", edit, dst=dst / "checkpoint.npz")
    assert trainer.main("numpy", ["--resume", str(dst), "--epochs", "2", "--no-progress"]) == 2
    _one_line(capsys, "is damaged", "test_acc")


@pytest.mark.parametrize("key", ["train_loss", "lr", "train_acc"])
def test_a_history_record_without_a_number_resumes_and_draws(run, tmp_path, capsys, key):
    """95.18: a record without train_loss (checkpoint.save takes any history) ended --resume in a
    KeyError while the curves were drawn; the curves draw what the records hold."""
    dst = tmp_path / "r"
    dst.mkdir()

    def edit(h):
        del h["history"][-1][key]
        return h

    _rewrite_header(run / "checkpoint.npz", edit, dst=dst / "checkpoint.npz")
    assert trainer.main("numpy", ["--resume", str(dst), "--epochs", "2", "--no-progress"]) == 0
    assert (dst / "curves.png").stat().st_size > 1000


def test_numpy_scalars_are_numbers_everywhere(tmp_path, digits):
    """16: NumPy scalars for every number fit and build take; the header records plain numbers."""
    x, y = digits
    model = pycapsnet.build("capsnet", n_classes=np.int64(10), seed=np.int32(0), input_shape=np.array([1, 28, 28]),
                            **SMALL)
    model.fit(x, y, epochs=np.int64(1), batch_size=np.int64(16), seed=np.uint8(1), shift=np.int16(1),
              lr=np.float32(0.002), lr_decay=np.float64(0.9), ema=np.float32(0.5), out=str(tmp_path / "run"),
              progress=False)
    recipe = checkpoint.load(str(tmp_path / "run"))["header"]["recipe"]
    assert recipe["batch_size"] == 16 and type(recipe["lr"]) is float and recipe["lr"] == pytest.approx(0.002)


def test_torch_tensors_of_every_kind_are_read_or_refused_in_one_line(digits):
    """18."""
    torch = pytest.importorskip("torch")
    x, y = digits
    model = pycapsnet.build("capsnet", **SMALL)
    half = torch.tensor(x[:4]).to(torch.bfloat16)
    np.testing.assert_array_equal(model.predict_scores(half), model.predict_scores(half.float().numpy()))
    with pytest.raises(CapsNetError, match="meta device"):
        model.predict(torch.empty(4, 1, 28, 28, device="meta"))
    with pytest.raises(CapsNetError, match="sparse"):
        model.predict(torch.tensor(x[:4]).to_sparse())
    with pytest.raises(CapsNetError, match="meta device"):
        model.fit(torch.empty(4, 1, 28, 28, device="meta"), y[:4], epochs=1, progress=False)


def test_predict_takes_a_directory_as_the_command_line_does(run, tmp_path):
    """19."""
    from PIL import Image

    folder = tmp_path / "images"
    (folder / "deeper").mkdir(parents=True)
    for name in ("a.png", "deeper/b.png"):
        Image.fromarray(np.zeros((28, 28), np.uint8)).save(folder / name)
    (folder / "notes.txt").write_text("not an image")
    got = pycapsnet.load(str(run)).predict(str(folder))
    assert [p for p, _ in got] == [str(folder / "a.png"), str(folder / "deeper" / "b.png")]
    (tmp_path / "empty").mkdir()
    with pytest.raises(CapsNetError, match="no image files"):
        pycapsnet.load(str(run)).predict(str(tmp_path / "empty"))


FULL_DISK = """
import threading, sys
from tensorboard.summary.writer import record_writer
from pycapsnet.training.scalars import Scalars

def full(self, data):
    raise OSError(28, "No space left on device")

scalars = Scalars(tensorboard=sys.argv[1])
record_writer.RecordWriter.write = full
for step in range(5):
    scalars.add("steps", 1, step, {"loss": 1.0})
    threading.Event().wait(0.2)
scalars.close()
assert threading.excepthook is threading.__excepthook__
"""


def test_a_full_disk_under_tensorboard_is_one_warning_and_no_traceback(tmp_path):
    """22: the event writer's thread dies of the full disk; only the project's line is printed (in
    a process of its own: pytest replaces the hook that prints a thread's traceback)."""
    pytest.importorskip("tensorboard")
    done = subprocess.run([sys.executable, "-c", FULL_DISK, str(tmp_path / "tb")], capture_output=True, text=True,
                          cwd=ROOT)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert done.stdout.count("warning: cannot write --tensorboard") == 1, done.stdout


def test_predict_scores_a_batch_too_large_for_memory_in_halves(digits, monkeypatch):
    """24: as evaluate does; each image's scores are its own."""
    x, _ = digits
    model = pycapsnet.build("capsnet", **SMALL)
    expected = model.predict_scores(x[:16], batch_size=4)
    real = model.network.forward_on_device

    def limited(xb, *a, **k):
        if xb.shape[0] > 3:
            raise MemoryError("Unable to allocate 7.6 GiB")
        return real(xb, *a, **k)

    monkeypatch.setattr(model.network, "forward_on_device", limited)
    np.testing.assert_allclose(model.predict_scores(x[:16], batch_size=20000), expected, rtol=1e-6, atol=1e-7)
    assert model.predict(x[:16], batch_size=16).shape == (16,)

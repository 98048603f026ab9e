"""CIFAR-10's binary version (issue 106): the reader on small files made here in the authors' format
(records of 1 label byte + 3,072 pixel bytes, R then G then B), the refusals (a truncated or padded
file, a label beyond 9, the pickled Python version), and the downloader against a server the test
starts on 127.0.0.1 with a small archive in the authors' layout: its digest checked, only the
expected members unpacked, a member that would land outside, a link or a device refused."""
import hashlib
import http.server
import io
import os
import tarfile
import threading

import numpy as np
import pytest

import pycapsnet
from pycapsnet.errors import CapsNetError
from pycapsnet.tools import cli
from pycapsnet.training import cifar10, data, download


def _records(n, seed):
    rng = np.random.default_rng(seed)
    labels = np.arange(n) % 10
    pixels = rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)
    raw = np.concatenate([labels[:, None].astype(np.uint8), pixels.reshape(n, -1)], axis=1)
    return raw.tobytes(), pixels, labels


def _write(folder, n_train=20, n_test=10, meta=True):
    """A cifar-10-batches-bin/ of five training files of n_train records and a test file of n_test."""
    inner = folder / cifar10.FOLDER
    inner.mkdir(parents=True)
    expected = {"train": ([], []), "test": ([], [])}
    for k, name in enumerate((*cifar10.TRAIN, *cifar10.TEST)):
        part = "test" if name in cifar10.TEST else "train"
        raw, x, y = _records(n_test if part == "test" else n_train, k)
        (inner / name).write_bytes(raw)
        expected[part][0].append(x)
        expected[part][1].append(y)
    if meta:
        (inner / cifar10.META).write_text("\n".join(cifar10.CLASSES) + "\n\n")
    return {p: (np.concatenate(x), np.concatenate(y)) for p, (x, y) in expected.items()}


def test_the_binary_records_are_read_as_the_authors_lay_them_out(tmp_path):
    expected = _write(tmp_path)
    (x, y), (xt, yt) = pycapsnet.datasets.load_cifar10(str(tmp_path))
    assert x.shape == (100, 3, 32, 32) and x.dtype == np.float32 and xt.shape == (10, 3, 32, 32)
    np.testing.assert_array_equal(x, expected["train"][0] / np.float32(255))  # channel 0 red: the first 1,024
    np.testing.assert_array_equal(y, expected["train"][1])
    np.testing.assert_array_equal(yt, expected["test"][1])
    train, test = data.load("cifar10", str(tmp_path / cifar10.FOLDER))  # the folder itself is fine too
    assert train.classes == cifar10.CLASSES and train.x.dtype == np.uint8 and len(test) == 10


@pytest.mark.parametrize("damage,said", [("truncated", "truncated or padded"), ("padded", "truncated or padded"),
                                         ("label 12", "has the label 12"), ("missing", "lacks data_batch_3.bin"),
                                         ("meta", "names 3 classes")])
def test_a_damaged_file_is_one_line_naming_it(tmp_path, capsys, damage, said):
    _write(tmp_path)
    path = tmp_path / cifar10.FOLDER / "data_batch_3.bin"
    raw = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(raw[:-5])
    elif damage == "padded":
        path.write_bytes(raw + b"\0" * 7)
    elif damage == "label 12":
        path.write_bytes(bytes([12]) + raw[1:])
    elif damage == "missing":
        path.unlink()
    else:
        (tmp_path / cifar10.FOLDER / cifar10.META).write_text("a\nb\nc\n")
    with pytest.raises(CapsNetError, match=said):
        data.load("cifar10", str(tmp_path))
    from pycapsnet.training import trainer

    assert trainer.main("numpy", ["--dataset", "cifar10", "--data-dir", str(tmp_path), "--epochs", "1",
                                  "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and said in err


def test_the_pickled_python_version_is_refused_and_never_unpickled(tmp_path):
    marker = tmp_path / "RAN"
    inner = tmp_path / "cifar-10-batches-py"
    inner.mkdir()

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    import pickle

    (inner / "data_batch_1").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CapsNetError, match="Python \\(pickle\\) version.*binary version"):
        pycapsnet.datasets.load_cifar10(str(tmp_path))
    assert not marker.exists()


def test_colour_images_train_and_score_through_the_command_line(tmp_path, capsys):
    _write(tmp_path, n_train=8, n_test=8)
    from pycapsnet.training import trainer

    assert trainer.main("numpy", ["--dataset", "cifar10", "--data-dir", str(tmp_path), "--epochs", "1",
                                  "--conv-channels", "8", "--primary-types", "2", "--decoder-hidden", "16", "32",
                                  "--batch-size", "8", "--no-progress", "--out", str(tmp_path / "run")]) == 0
    assert cli.main(["evaluate", str(tmp_path / "run"), "--data-dir", str(tmp_path)]) == 0
    assert "airplane" in capsys.readouterr().out  # the classes by their names


# ---- the downloader -------------------------------------------------------------------------------
def _archive(extra=None):
    """A tar.gz in the authors' layout (small files), with ``extra`` (name, kind) members added."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name in (*cifar10.TRAIN, *cifar10.TEST):
            raw = _records(4, len(name))[0]
            info = tarfile.TarInfo(f"{cifar10.FOLDER}/{name}")
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
        meta = ("\n".join(cifar10.CLASSES) + "\n").encode()
        info = tarfile.TarInfo(f"{cifar10.FOLDER}/{cifar10.META}")
        info.size = len(meta)
        tar.addfile(info, io.BytesIO(meta))
        for name, kind in extra or ():
            info = tarfile.TarInfo(name)
            if kind == "file":
                info.size = 4
                tar.addfile(info, io.BytesIO(b"evil"))
            else:
                info.type = tarfile.SYMTYPE if kind == "link" else tarfile.CHRTYPE
                info.linkname = "/etc/passwd" if kind == "link" else ""
                tar.addfile(info)
    return buf.getvalue()


class Handler(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", str(len(Handler.body)))
        self.end_headers()
        self.wfile.write(Handler.body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server(monkeypatch):
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    monkeypatch.setattr(download, "TIMEOUT_S", 2)
    yield f"http://127.0.0.1:{httpd.server_address[1]}/cifar-10-binary.tar.gz"
    httpd.shutdown()
    httpd.server_close()


def _serve(monkeypatch, body, digest=None):
    Handler.body = body
    spec = {**download.ARCHIVES["cifar10"], "md5": digest or hashlib.md5(body).hexdigest()}
    monkeypatch.setitem(download.ARCHIVES, "cifar10", spec)


def test_the_archive_is_fetched_checked_and_unpacked_to_what_the_reader_reads(server, monkeypatch, tmp_path, capsys):
    _serve(monkeypatch, _archive())
    monkeypatch.setitem(download.ARCHIVES, "cifar10", {**download.ARCHIVES["cifar10"], "urls": (server,)})
    assert cli.main(["data", "cifar10", str(tmp_path / "c"), "--quiet"]) == 0
    assert "verified (MD5" in capsys.readouterr().err
    (x, y), (xt, yt) = pycapsnet.datasets.load_cifar10(str(tmp_path / "c"))
    assert x.shape == (20, 3, 32, 32) and len(yt) == 4
    assert sorted(os.listdir(tmp_path / "c" / cifar10.FOLDER)) == sorted((*cifar10.TRAIN, *cifar10.TEST, cifar10.META))
    Handler.body = b"served again"  # a second call keeps the verified archive: nothing fetched
    assert cli.main(["data", "cifar10", str(tmp_path / "c"), "--quiet"]) == 0
    assert "already here, verified" in capsys.readouterr().err


def test_an_archive_of_another_digest_is_refused_and_nothing_is_unpacked(server, monkeypatch, tmp_path, capsys):
    _serve(monkeypatch, _archive(), digest="0" * 32)
    monkeypatch.setitem(download.ARCHIVES, "cifar10", {**download.ARCHIVES["cifar10"], "urls": (server,)})
    assert cli.main(["data", "cifar10", str(tmp_path / "c"), "--quiet"]) == 2
    assert "wrong content" in capsys.readouterr().err
    assert not (tmp_path / "c" / cifar10.FOLDER).exists() and not (tmp_path / "c" / "cifar-10-binary.tar.gz").exists()


@pytest.mark.parametrize("member,kind,said", [("../evil.txt", "file", "would land outside"),
                                              ("/tmp/evil-abs.txt", "file", "would land outside"),
                                              (f"{cifar10.FOLDER}/link", "link", "a link or a device"),
                                              (f"{cifar10.FOLDER}/dev", "device", "a link or a device")])
def test_a_hostile_member_is_refused_before_anything_is_written(server, monkeypatch, tmp_path, capsys, member, kind,
                                                                said):
    _serve(monkeypatch, _archive([(member, kind)]))
    monkeypatch.setitem(download.ARCHIVES, "cifar10", {**download.ARCHIVES["cifar10"], "urls": (server,)})
    folder = tmp_path / "c"
    assert cli.main(["data", "cifar10", str(folder), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert said in err and err.strip().splitlines()[-1].startswith("error: ")
    assert not (tmp_path / "evil.txt").exists() and not os.path.exists("/tmp/evil-abs.txt")
    assert not (folder / cifar10.FOLDER).exists()


def test_crop_flip_crops_from_a_four_pixel_padding_and_flips_half(tmp_path):
    from pycapsnet.training import augment

    x = np.arange(2 * 3 * 32 * 32, dtype=np.float32).reshape(2, 3, 32, 32) + 1
    rng = np.random.default_rng(0)
    seen_flip = seen_plain = False
    for _ in range(40):
        out = augment.crop_flip(x, rng)
        for i in range(2):
            ys, xs = np.nonzero(out[i, 0])
            kept = out[i][:, ys.min():ys.max() + 1, xs.min():xs.max() + 1]
            assert kept.shape[1] >= 28 and kept.shape[2] >= 28  # moved by at most 4 pixels
            assert (out[i] == 0).sum() % 3 == 0  # the padding is zero in every channel alike
            row = kept[0, 0]
            seen_flip |= bool(row[0] > row[-1])
            seen_plain |= bool(row[0] < row[-1])
    assert seen_flip and seen_plain
    whole = augment.crop_flip(x, np.random.default_rng(5), of=2)
    parts = [augment.crop_flip(x[i:i + 1], np.random.default_rng(5), slice(i, i + 1), 2) for i in range(2)]
    np.testing.assert_array_equal(whole, np.concatenate(parts))  # a shard augments its part as the whole batch does


def test_the_routing_study_on_colour_images_with_crop_flip(tmp_path):
    import json

    import pycapsnet.experiments as experiments

    _write(tmp_path / "d", n_train=12, n_test=10)
    results = experiments.routings(out=str(tmp_path / "s"), quick=True, affine=False, dataset="cifar10",
                                   data_dir=str(tmp_path / "d"), routings=["uniform", "dynamic"], lr=2e-3, seeds=1,
                                   augment="crop-flip", progress=False)
    assert results["dataset"] == "cifar10" and set(results["cifar10"]) == {"uniform", "dynamic"}
    assert results["settings"]["augment"] == "crop-flip" and "flips" in results["protocol"]["summary"]
    assert "test images" in (tmp_path / "s" / "results.md").read_text()
    units = json.loads((tmp_path / "s" / "units.json").read_text())
    assert units["flags"]["data"]["dataset"] == "cifar10"


@pytest.mark.parametrize("name", ["capsnet", "vb", "attention", "em", "efficient", "cnn"])
def test_every_built_in_network_trains_on_colour_images(name):
    from pycapsnet.experiments.networks import baseline_cnn

    rng = np.random.default_rng(0)
    x, y = rng.random((4, 3, 32, 32)).astype(np.float32), np.arange(4)
    small = dict(conv_channels=8, primary_types=2, decoder_hidden=(16, 32)) if name in ("capsnet", "vb", "attention") \
        else {}
    network = baseline_cnn((3, 32, 32), channels=(8, 8, 8), hidden=(16, 16)) if name == "cnn" else name
    model = pycapsnet.build(network, input_shape=(3, 32, 32), **small)
    model.fit(x, y, epochs=1, progress=False)
    assert model.predict_scores(x).shape == (4, 10)


def test_the_torch_wrapper_and_its_gradcheck_at_three_by_32_by_32():
    torch = pytest.importorskip("torch", reason="the torch wrapper")
    import pycapsnet.torch as pct

    model = pycapsnet.build("capsnet", input_shape=(3, 32, 32), backend="torch", dtype="float64", conv_channels=2,
                            primary_types=1, decoder_hidden=(4, 8))
    net = pct.Network(model.network)
    x = torch.rand(1, 3, 32, 32, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: net(t)[1], (x,), eps=1e-6, atol=1e-5, fast_mode=True)


def test_predict_reads_colour_image_files(tmp_path, capsys):
    from PIL import Image

    from pycapsnet.training import trainer

    _write(tmp_path / "d", n_train=8, n_test=8)
    assert trainer.main("numpy", ["--dataset", "cifar10", "--data-dir", str(tmp_path / "d"), "--epochs", "1",
                                  "--conv-channels", "8", "--primary-types", "2", "--decoder-hidden", "16", "32",
                                  "--no-progress", "--out", str(tmp_path / "run")]) == 0
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(tmp_path / "a.png")
    capsys.readouterr()
    assert cli.main(["predict", str(tmp_path / "run"), str(tmp_path / "a.png")]) == 0
    out = capsys.readouterr().out.strip().split("\t")
    assert out[0].endswith("a.png") and out[1] in cifar10.CLASSES


def test_per_channel_normalisation_from_the_training_images_alike_for_every_row(tmp_path):
    import json

    import pycapsnet.experiments as experiments
    from pycapsnet.core import architecture as A

    _write(tmp_path / "d", n_train=12, n_test=10)
    results = experiments.routings(out=str(tmp_path / "s"), quick=True, affine=False, dataset="cifar10",
                                   data_dir=str(tmp_path / "d"), routings=["uniform", "cnn"], lr=2e-3, seeds=1,
                                   normalize=True, progress=False)
    norm = results["settings"]["normalize"]
    train, _ = data.load("cifar10", str(tmp_path / "d"))
    rows = json.loads((tmp_path / "s" / "units.json").read_text())["flags"]
    assert rows["normalize"] == norm and "normalised per channel" in results["protocol"]["summary"]
    # computed on the study's training images alone (its validation share held out of them)
    assert len(norm["mean"]) == 3 and all(0.3 < m < 0.7 for m in norm["mean"]) and all(0.2 < s < 0.4 for s in norm["std"])
    with pytest.raises(CapsNetError, match="as many channels"):
        pycapsnet.build(A.network([A.normalize([0.5], [0.2]), A.conv2d(4, 9), A.relu(), A.primary_caps(2, 4),
                                   A.dynamic_caps(10, 4)], decoder=None, input_shape=(3, 32, 32), n_classes=10))
    st = pycapsnet.datasets.channel_stats(train.images())
    np.testing.assert_allclose(st["mean"], train.images().mean(axis=(0, 2, 3)), rtol=1e-6)


def test_the_normalize_layer_under_the_torch_wrappers_gradcheck():
    torch = pytest.importorskip("torch", reason="the torch wrapper")
    import pycapsnet.torch as pct
    from pycapsnet.tools.gradcheck import composed_architectures

    arch = composed_architectures()["colour, normalised, ConvCaps routing=full"]
    assert arch["body"][0]["layer"] == "normalize"
    net = pct.Network(pycapsnet.build(arch, backend="torch", dtype="float64"))
    x = torch.rand(1, 3, 13, 13, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: net(t)[1], (x,), eps=1e-6, atol=1e-5)


# ---- train --normalize: the training split's statistics, a first layer, recorded ------------------
def test_train_normalize_records_the_training_splits_statistics_in_the_checkpoint(tmp_path, capsys):
    from pycapsnet.core.layers import Normalize
    from pycapsnet.training import checkpoint
    from pycapsnet.training.trainer import main as train_main

    _write(tmp_path / "d", n_train=40, n_test=10)
    out = str(tmp_path / "run")
    small = ["--conv-channels", "4", "--primary-types", "2", "--decoder-hidden", "8", "--no-progress"]
    assert train_main("numpy", ["--dataset", "cifar10", "--data-dir", str(tmp_path / "d"), "--epochs", "1",
                                "--limit", "30", "--val-fraction", "0.2", "--normalize", "--out", out, *small]) == 0
    assert "normalised per channel with the training images' mean" in capsys.readouterr().out
    header = checkpoint.load(out)["header"]
    (x, y), _ = pycapsnet.datasets.load_cifar10(str(tmp_path / "d"))
    split = data.Split(x, y).limited(30, 0).held_out(0.2, 0)[0]  # what the run trained on: --limit, then validation out
    want = data.channel_stats(split.x)
    np.testing.assert_allclose(header["config"]["input_mean"], want["mean"], rtol=1e-12)
    np.testing.assert_allclose(header["config"]["input_std"], want["std"], rtol=1e-12)
    model = checkpoint.model_of(checkpoint.load(out), "numpy")
    assert isinstance(model.body["norm"], Normalize) and [n for n, _ in model.body][:2] == ["norm", "conv1"]
    assert cli.main(["evaluate", out, "--limit-test", "10"]) == 0
    assert train_main("numpy", ["--resume", out, "--epochs", "2", "--no-progress"]) == 0
    assert train_main("numpy", ["--resume", out, "--epochs", "3", "--normalize", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "drop --normalize" in err and err.count("\n") == 1


def test_fit_normalize_puts_the_layer_first_in_a_description(tmp_path):
    from pycapsnet.core import architecture as A
    from pycapsnet.training import checkpoint
    from pycapsnet.training.trainer import fit

    _write(tmp_path / "d", n_train=20, n_test=10)
    body = [A.conv2d(4, 9), A.relu(), A.primary_caps(2, 4), A.dynamic_caps(10, 4)]
    flags = dict(dataset="cifar10", data_dir=str(tmp_path / "d"), epochs=1, batch_size=10, no_progress=True)
    fit(A.network(body, decoder=None), out=str(tmp_path / "a"), normalize=True, **flags)
    arch = checkpoint.load(str(tmp_path / "a"))["header"]["architecture"]
    assert arch["body"][0]["layer"] == "normalize" and len(arch["body"][0]["mean"]) == 3
    with pytest.raises(CapsNetError, match="normalises its input already"):
        fit(arch, out=str(tmp_path / "b"), normalize=True, **flags)


@pytest.mark.parametrize("mean,std,said", [((0.5,), None, "go together"), ((0.5, 0.5), (0.2, 0.2), "per input channel"),
                                           ((0.5,), (0.0,), "above 0"), ((float("nan"),), (0.2,), "finite")])
def test_a_config_refuses_statistics_it_cannot_normalise_with(mean, std, said):
    from pycapsnet.core.model import CapsNetConfig

    with pytest.raises(CapsNetError, match=said):
        CapsNetConfig(input_mean=mean, input_std=std)

"""The downloader (pycapsnet/training/download.py) against an HTTP server the test starts on
127.0.0.1, never the internet: mirrors that answer 404, serve a corrupt file, stop mid-transfer or
stall, then a good one.  The files are small IDX files made here; their digests replace the
published ones for the test."""
import gzip
import hashlib
import http.server
import io
import os
import re
import threading
import time

import numpy as np
import pytest

from pycapsnet.errors import CapsNetError
from pycapsnet.tools import cli
from pycapsnet.training import data, download

STEMS = [s for pair in data.IDX_FILES.values() for s in pair]


def _idx_files():
    """Raw IDX bytes of a tiny MNIST: 20 train and 10 test 28x28 images."""
    rng = np.random.default_rng(0)
    out = {}
    for part, n in (("train", 20), ("test", 10)):
        img, lbl = data.IDX_FILES[part]
        for stem, array in ((img, rng.integers(0, 256, (n, 28, 28))), (lbl, np.arange(n) % 10)):
            buf = io.BytesIO()
            a = np.asarray(array, np.uint8)
            buf.write(bytes([0, 0, 0x08, a.ndim]) + np.asarray(a.shape, ">i4").tobytes() + a.tobytes())
            out[stem] = buf.getvalue()
    return out


RAW = _idx_files()
GZ = {stem: gzip.compress(raw) for stem, raw in RAW.items()}


class Handler(http.server.BaseHTTPRequestHandler):
    """/dead/: 404.  /corrupt/: bytes that are no gzip.  /wrong/: a valid gzip of other content.
    /cut/: promises the whole file, sends half, hangs up.  /slow/: answers after the timeout.
    /good/: the file.  Every request is logged in ``hits``."""
    hits = []

    def do_GET(self):
        kind, name = self.path.strip("/").split("/", 1)
        Handler.hits.append((kind, name))
        body = GZ.get(name[:-3]) if name.endswith(".gz") else None
        if kind == "dead" or body is None:
            self.send_error(404)
            return
        if kind == "slow":
            time.sleep(1.5)
        if kind == "trickle":  # each read within the timeout, the whole never
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            for k in range(len(body)):
                try:
                    self.wfile.write(body[k:k + 1])
                    self.wfile.flush()
                except OSError:
                    return
                time.sleep(0.05)
            return
        if kind == "corrupt":
            body = b"<html>this mirror moved</html>" * 10
        if kind == "wrong":
            body = gzip.compress(b"\0" * 100)
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body[:len(body) // 2] if kind == "cut" else body)
        if kind == "cut":
            self.wfile.flush()
            self.connection.close()

    def log_message(self, *args):
        pass


@pytest.fixture
def server(monkeypatch):
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    Handler.hits = []
    base = f"http://127.0.0.1:{httpd.server_address[1]}"
    spec = {"mirrors": tuple(f"{base}/{k}/" for k in ("dead", "corrupt", "cut", "good")),
            "digest": "sha256 of content", "files": {s: hashlib.sha256(RAW[s]).hexdigest() for s in STEMS}}
    monkeypatch.setitem(download.DATASETS, "mnist", spec)
    monkeypatch.setattr(download, "TIMEOUT_S", 0.5)
    yield base
    httpd.shutdown()
    httpd.server_close()


def test_mirrors_in_turn_until_one_serves_the_right_file(server, tmp_path, capsys):
    folder = download.download("mnist", str(tmp_path / "m"), progress=False)
    assert sorted(os.listdir(folder)) == sorted(s + ".gz" for s in STEMS)  # nothing else: no temporaries
    for stem in STEMS:
        with gzip.open(os.path.join(folder, stem + ".gz")) as f:
            assert f.read() == RAW[stem]
    err = capsys.readouterr().err
    for why in (r"dead/train-images-idx3-ubyte.gz: HTTP 404", r"corrupt/train-images-idx3-ubyte.gz: not a valid gzip",
                r"cut/train-images-idx3-ubyte.gz: (the transfer stopped at \d+ of \d+ bytes|the connection failed)"):
        assert re.search(why, err), why
    train, test = data.load_idx_dir(folder)
    assert len(train) == 20 and len(test) == 10
    # a second run fetches nothing
    Handler.hits = []
    download.download("mnist", folder, progress=False)
    assert Handler.hits == [] and "already here, verified" in capsys.readouterr().err


@pytest.mark.parametrize("kind,why", [("wrong", "wrong content"), ("slow", "no answer within"),
                                      ("cut", ""), ("corrupt", "gzip")])
def test_a_bad_mirror_alone_fails_in_one_line_and_leaves_nothing(server, tmp_path, kind, why):
    folder = tmp_path / "m"
    with pytest.raises(CapsNetError) as e:
        download.download("mnist", str(folder), mirrors=[f"{server}/{kind}/"], progress=False)
    msg = str(e.value)
    assert "\n" not in msg and "train-images-idx3-ubyte.gz" in msg and why in msg and "by hand" in msg
    assert os.listdir(folder) == []  # no partial file a later run could mistake for data


def test_a_corrupt_file_already_there_is_fetched_again(server, tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "train-labels-idx1-ubyte.gz").write_bytes(GZ["train-labels-idx1-ubyte"][:10])
    download.download("mnist", str(folder), mirrors=[f"{server}/good/"], progress=False)
    with gzip.open(folder / "train-labels-idx1-ubyte.gz") as f:
        assert f.read() == RAW["train-labels-idx1-ubyte"]


def test_no_network_and_a_folder_that_cannot_be_made(server, tmp_path):
    with pytest.raises(CapsNetError, match="cannot connect"):
        download.download("mnist", str(tmp_path / "a"), mirrors=["http://127.0.0.1:9/"], progress=False)
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(CapsNetError, match="cannot create the data folder .*PYCAPSNET_DATA"):
        download.download("mnist", str(tmp_path / "file" / "m"), progress=False)


def test_a_full_disk_fails_in_one_line_and_leaves_nothing(server, tmp_path, monkeypatch):
    real = download._Verifier.update

    def full(self, chunk):
        self.out = _Full()
        return real(self, chunk)

    monkeypatch.setattr(download._Verifier, "update", full)
    with pytest.raises(CapsNetError, match="No space left on device") as e:
        download.download("mnist", str(tmp_path / "m"), mirrors=[f"{server}/good/"], progress=False)
    assert "train-images-idx3-ubyte.gz" in str(e.value) and "free some space" in str(e.value)
    assert os.listdir(tmp_path / "m") == []


class _Full:
    def write(self, _):
        raise OSError(28, "No space left on device")


def test_the_cli_fetches_into_the_cache_and_train_finds_it_there(server, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PYCAPSNET_DATA", str(tmp_path / "cache"))
    from pycapsnet.training import recipe

    with pytest.raises(CapsNetError, match="pycapsnet data mnist"):  # not fetched yet: says how
        recipe.fetched("mnist")
    assert cli.main(["data", "mnist", "--quiet"]) == 0
    assert "--dataset mnist now finds them" in capsys.readouterr().out
    assert recipe.fetched("mnist") == str(tmp_path / "cache" / "mnist")
    assert cli.main(["train", "--dataset", "mnist", "--epochs", "1", "--limit", "8", "--limit-test", "4",
                     "--conv-channels", "8", "--primary-types", "2", "--batch-size", "4",
                     "--no-progress", "--out", str(tmp_path / "run")]) == 0


def test_the_cli_says_what_failed_in_one_line(server, tmp_path, capsys):
    download.DATASETS["mnist"]["mirrors"] = (f"{server}/dead/",)
    assert cli.main(["data", "mnist", str(tmp_path / "m"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: could not fetch train-images-idx3-ubyte.gz") and "Traceback" not in "".join(err)


def test_the_published_digests_are_carried():
    """The MNIST digests are those of the decompressed files (../shared/data/mnist/SHA256SUMS);
    Fashion-MNIST's are Zalando's MD5s of the .gz files."""
    mnist, fashion = download.DATASETS["mnist"], download.DATASETS["fashion-mnist"]
    assert mnist["files"]["train-images-idx3-ubyte"].startswith("ba891046e650")
    assert fashion["files"]["train-images-idx3-ubyte"] == "8d4fb7e6c68d591d4c3dfef9ec88bf0d"
    assert len(mnist["mirrors"]) >= 2 and len(fashion["mirrors"]) >= 2


def test_a_trickling_mirror_is_given_up_at_the_deadline_with_progress_said(server, tmp_path, monkeypatch, capsys):
    """95.24: a mirror that sends a byte now and then (every read within the timeout) is left after the
    deadline, lines of progress said meanwhile; nothing is left behind."""
    monkeypatch.setattr(download, "DEADLINE_S", 0.6)
    monkeypatch.setattr(download, "TELL_EVERY_S", 0.2)
    with pytest.raises(CapsNetError, match="too slow: .* bytes in 0.6 s"):
        download.download("mnist", str(tmp_path / "m"), mirrors=[f"{server}/trickle/"], progress=True)
    err = capsys.readouterr().err
    assert re.search(r"train-images-idx3-ubyte.gz: 0.0 of 0.0 MB \(\d+%\), [\d.]+ kB/s \(given up after 0.6 s\)", err)
    assert os.listdir(tmp_path / "m") == []

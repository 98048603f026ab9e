"""Hostile and faulty input to the newer surfaces (issue 62, items 4-8): each ends in one line and
exit 2, or in a warning while the run goes on -- never a traceback, never a lost epoch."""
import csv
import json

import numpy as np
import pytest

from pycapsnet.core import architecture as A
from pycapsnet.training import checkpoint, trainer
from pycapsnet.tools import cli
from tests.test_faults import TINY

CNN = A.network([A.conv2d(4, 5, stride=2), A.relu(), A.flatten(), A.linear(10)], head="logits", decoder=None)


def _one_line_error(capsys, *fragments):
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for f in fragments:
        assert f in err, err
    return err


# ---- 7. log writers ------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["file", "under a file"])
def test_tensorboard_at_a_file_is_refused_before_training(tmp_path, capsys, where):
    pytest.importorskip("torch", reason="--tensorboard writes through PyTorch")
    (tmp_path / "f").write_text("mine")
    target = tmp_path / "f" if where == "file" else tmp_path / "f" / "tb"
    assert trainer.main("numpy", [*TINY, "--epochs", "1", "--out", str(tmp_path / "run"),
                                  "--tensorboard", str(target)]) == 2
    _one_line_error(capsys, f"--tensorboard {target}")
    assert not (tmp_path / "run" / "checkpoint.npz").exists() and (tmp_path / "f").read_text() == "mine"


def test_log_csv_on_another_file_is_refused_and_left_as_it_was(tmp_path, capsys):
    other = tmp_path / "notes.csv"
    other.write_text("name,value\na,1\n")
    assert trainer.main("numpy", [*TINY, "--epochs", "1", "--out", str(tmp_path / "run"),
                                  "--log-csv", str(other)]) == 2
    _one_line_error(capsys, "is not a pycapsnet log")
    assert other.read_text() == "name,value\na,1\n"


def test_log_csv_of_an_earlier_run_is_continued(tmp_path):
    log = tmp_path / "log.csv"
    for epochs in (1, 2):
        assert trainer.main("numpy", [*TINY, "--epochs", str(epochs), "--log-csv", str(log),
                                      *(["--resume", str(tmp_path / "run")] if epochs == 2 else
                                        ["--out", str(tmp_path / "run")])]) == 0
    rows = list(csv.DictReader(log.open()))
    assert [r["epoch"] for r in rows if r["kind"] == "epoch"] == ["1", "2"]


def test_a_full_disk_under_the_scalars_loses_no_epoch(tmp_path, capsys, monkeypatch):
    real = csv.DictWriter.writerow
    count = {"n": 0}

    def full_after_two(self, row):
        count["n"] += 1
        if count["n"] > 2:
            raise OSError(28, "No space left on device")
        return real(self, row)

    monkeypatch.setattr(csv.DictWriter, "writerow", full_after_two)
    assert trainer.main("numpy", [*TINY, "--epochs", "2", "--out", str(tmp_path / "run"),
                                  "--log-csv", str(tmp_path / "log.csv")]) == 0
    out = capsys.readouterr().out
    assert out.count("warning: cannot write --log-csv") == 1 and "No space left on device" in out
    assert checkpoint.load(str(tmp_path / "run"))["header"]["epoch"] == 2


# ---- 8. the remaining tracebacks ------------------------------------------------------------------
@pytest.fixture(scope="module")
def cnn_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("cnn")
    (root / "cnn.json").write_text(json.dumps(CNN))
    assert trainer.main("numpy", ["--limit", "32", "--limit-test", "16", "--batch-size", "16", "--no-progress",
                                  "--network", str(root / "cnn.json"), "--epochs", "1", "--out",
                                  str(root / "run")]) == 0
    return root / "run"


def test_inspect_on_a_cnn_says_it_has_no_routing(cnn_run, tmp_path, capsys):
    assert cli.main(["inspect", str(cnn_run), "--out", str(tmp_path / "pngs")]) == 2
    _one_line_error(capsys, "without capsule routing", "pycapsnet evaluate")


def test_inspect_on_a_full_disk_is_one_line(tmp_path, capsys, monkeypatch):
    from pycapsnet.tools import plots

    run = tmp_path / "run"
    assert trainer.main("numpy", [*TINY, "--epochs", "1", "--out", str(run)]) == 0
    capsys.readouterr()

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(plots, "coupling_heatmaps", full)
    assert cli.main(["inspect", str(run), "--out", str(tmp_path / "pngs")]) == 2
    _one_line_error(capsys, "cannot write into --out", "No space left on device")


def test_a_refused_inspect_or_experiment_leaves_no_directory_behind(tmp_path, capsys):
    """--out is made first, so that a bad one fails at once; a command refused after that (no such
    checkpoint, no data) removes what it made, and nothing it did not make."""
    out = tmp_path / "made" / "pngs"
    assert cli.main(["inspect", str(tmp_path / "nope.npz"), "--out", str(out)]) == 2
    _one_line_error(capsys, "checkpoint not found")
    assert not (tmp_path / "made").exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    assert cli.main(["inspect", str(tmp_path / "nope.npz"), "--out", str(mine)]) == 2
    assert mine.is_dir()  # the user's own directory stays
    capsys.readouterr()
    assert cli.main(["experiment", "table1", "--quick", "--data-dir", str(tmp_path / "mine"), "--out",
                     str(out)]) == 2
    _one_line_error(capsys, "missing data file train-images-idx3-ubyte")
    assert not (tmp_path / "made").exists()


# ---- 5. the header is bound to the weights ---------------------------------------------------------
@pytest.mark.parametrize("edit", ["iters 3 -> 1", "a relu removed", "a relu added", "a weight changed"])
def test_a_header_edited_apart_from_its_weights_is_refused(tmp_path, capsys, edit):
    from tests.test_faults import _rewrite_header

    net = A.network([A.conv2d(8, 9, name="conv1"), A.relu(), A.primary_caps(2, 8, kernel=9, stride=2),
                     A.dynamic_caps(10, 16, name="classcaps")])
    (tmp_path / "net.json").write_text(json.dumps(net))
    run = tmp_path / "run"
    assert trainer.main("numpy", [*TINY[4:], "--network", str(tmp_path / "net.json"), "--epochs", "1",
                                  "--out", str(run)]) == 0
    body = lambda h: h["architecture"]["body"]
    edits = {"iters 3 -> 1": lambda h: (body(h)[-1].update(iters=1), h)[1],
             "a relu removed": lambda h: (body(h).pop(1), h)[1],
             "a relu added": lambda h: (body(h).insert(3, {"layer": "relu"}), h)[1],
             "a weight changed": lambda h: h}
    arrays = (lambda a: {**a, "param/classcaps.W": a["param/classcaps.W"] * 1.01}) if edit == "a weight changed" \
        else (lambda a: a)
    _rewrite_header(run / "checkpoint.npz", edits[edit], edit_arrays=arrays, rebind=False)
    capsys.readouterr()
    assert cli.main(["evaluate", str(run)]) == 2
    _one_line_error(capsys, "is damaged: its header and its weights disagree")


# ---- 4 (checkpoints) and 8: members that declare more than they hold, pickles, FIFOs --------------
def _with_member(src, dst, name, raw: bytes):
    import zipfile

    with zipfile.ZipFile(src) as a, zipfile.ZipFile(dst, "w") as b:
        for info in a.infolist():
            b.writestr(info, raw if info.filename == name else a.read(info))


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory):
    from pycapsnet import CapsNet
    from tests.conftest import SMALL

    return checkpoint.save(str(tmp_path_factory.mktemp("ck") / "checkpoint.npz"), CapsNet("numpy", seed=0, **SMALL),
                           epoch=0)


@pytest.mark.parametrize("member,how", [("param/conv1.b.npy", "2**40 entries"), ("header.npy", "2**40 entries"),
                                        ("param/conv1.b.npy", "a pickle")])
def test_a_member_is_checked_before_anything_is_allocated(small_ckpt, tmp_path, capsys, member, how):
    import io
    import pickle
    import resource

    if how == "a pickle":
        raw = pickle.dumps({"x": 1})
    else:
        buf = io.BytesIO()
        np.lib.format.write_array_header_1_0(buf, {"descr": "<f8", "fortran_order": False, "shape": (2**40,)})
        raw = buf.getvalue() + b"\0" * 64
    bad = tmp_path / "checkpoint.npz"
    _with_member(small_ckpt, bad, member, raw)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (mapped + (2 << 30), hard))  # 2**40 float64 would be 8 TiB more
    try:
        assert cli.main(["evaluate", str(bad)]) == 2
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    _one_line_error(capsys, f"{bad} is damaged: its member")


def test_a_fifo_named_like_a_checkpoint_or_an_image_never_hangs(small_ckpt, tmp_path, capsys):
    import os

    fifo = tmp_path / "checkpoint.npz"
    os.mkfifo(fifo)
    assert cli.main(["evaluate", str(fifo)]) == 2
    _one_line_error(capsys, "not a regular file")


# ---- 4. descriptions and headers validated before anything is built ---------------------------------
GOOD = A.network([A.conv2d(8, 9, name="conv1"), A.relu(), A.primary_caps(2, 8, kernel=9, stride=2),
                  A.dynamic_caps(10, 16, name="classcaps")])


def _described(edit):
    arch = json.loads(json.dumps(GOOD))
    edit(arch)
    return arch


BAD_DESCRIPTIONS = {
    "a string for a boolean": (lambda a: a["body"][3].update(share_spatial="false"),
                               "layer 'classcaps' (dynamic_caps): share_spatial must be true or false"),
    "a size of 0": (lambda a: a["body"][2].update(types=0), "types must be a whole number of at least 1, got 0"),
    "a float size": (lambda a: a["body"][0].update(channels=8.5), "channels must be a whole number"),
    "NaN init": (lambda a: a["body"][3].update(init_std=float("nan")), "init_std must be a finite number"),
    "an unknown decoder key": (lambda a: a["decoder"].update(hiden=[8]), "the decoder has unknown key(s) hiden"),
    "an unknown top key": (lambda a: a.update(optimiser="adam"), "unknown key(s) optimiser"),
    "max_pool stride 0": (lambda a: a["body"].insert(2, {"layer": "max_pool", "kernel": 2, "stride": 0}),
                          "(max_pool): stride must be a whole number of at least 1, got 0"),
    "a billion iterations": (lambda a: a["body"][3].update(iters=1000000000),
                             "iters must be a whole number from 1 to 32"),
    "a huge capsule": (lambda a: a["body"][3].update(dim=100000), "more than this machine's"),
}


@pytest.mark.parametrize("case", list(BAD_DESCRIPTIONS))
def test_a_bad_description_is_one_line_before_anything_is_built(tmp_path, capsys, case):
    edit, message = BAD_DESCRIPTIONS[case]
    (tmp_path / "net.json").write_text(json.dumps(_described(edit)))
    assert trainer.main("numpy", [*TINY[4:], "--network", str(tmp_path / "net.json"), "--epochs", "1",
                                  "--out", str(tmp_path / "run")]) == 2
    _one_line_error(capsys, message)


def test_deep_json_and_routing_iterations_from_every_door(tmp_path, capsys):
    (tmp_path / "deep.json").write_text("[" * 100000 + "]" * 100000)
    assert trainer.main("numpy", [*TINY[4:], "--network", str(tmp_path / "deep.json"), "--epochs", "1"]) == 2
    _one_line_error(capsys, "nests deeper than any description does")
    assert trainer.main("numpy", [*TINY, "--routing-iters", "1000000000", "--epochs", "1",
                                  "--out", str(tmp_path / "r")]) == 2
    _one_line_error(capsys, "routing_iters (--routing-iters) must be at most 32")


def test_a_header_edited_to_a_huge_layer_is_refused_without_allocating_it(tmp_path, capsys):
    import resource

    from tests.test_faults import _rewrite_header

    (tmp_path / "net.json").write_text(json.dumps(GOOD))
    run = tmp_path / "run"
    assert trainer.main("numpy", [*TINY[4:], "--network", str(tmp_path / "net.json"), "--epochs", "1",
                                  "--out", str(run)]) == 0
    # rebound, as a careless writer would: the shapes, not the digest, must catch it
    _rewrite_header(run / "checkpoint.npz", lambda h: (h["architecture"]["body"][3].update(dim=30000), h)[1])
    capsys.readouterr()
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (mapped + (1 << 30), hard))  # the layer would take 4 GB
    try:
        assert cli.main(["evaluate", str(run)]) == 2
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    _one_line_error(capsys, "its parameter classcaps.W is (36, 2, 10, 16, 8), but its header's network has "
                            "(36, 2, 10, 30000, 8)")


def test_crosscheck_of_a_network_without_a_decoder(tmp_path, capsys):
    net = A.network([A.conv2d(8, 9, name="conv1"), A.relu(), A.primary_caps(2, 8, kernel=9, stride=2),
                     A.dynamic_caps(10, 16, name="classcaps")], decoder=None)
    (tmp_path / "net.json").write_text(json.dumps(net))
    assert trainer.main("numpy", [*TINY[4:], "--network", str(tmp_path / "net.json"), "--epochs", "1",
                                  "--out", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    assert cli.main(["crosscheck", "--checkpoint", str(tmp_path / "run"), "--b", "numpy", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "reconstruction" not in out and "0 disagree" in out

"""Run integrity under faults: kills and Ctrl-C at every point of an epoch's commit, divergence,
--overwrite, leftover temporaries, damaged checkpoints and misleading inputs.

A tiny model (8 conv channels, 2 capsule types, 32 training digits) keeps each run to seconds.
The kills run in subprocesses (tests/fault_inject.py); the rest call the entry points in-process,
where an uncaught exception (a traceback for the user) fails the test.  Every comparison of
metrics leaves out the two timing fields, which no two runs share."""
import json
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from pycapsnet import backends
from pycapsnet import CapsNetError
from pycapsnet.training import checkpoint, data, optim, recipe, trainer
from pycapsnet.tools import cli
from pycapsnet.core.model import CapsNet
from tests.conftest import SMALL
from tests.test_data import write_mnist_dir

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--conv-channels", "8", "--primary-types", "2", "--limit", "32", "--limit-test", "16",
        "--batch-size", "16", "--no-progress"]
TIMING = ("train_seconds", "train_samples_per_s")
PICTURES = ("curves.png", "reconstructions.png")


def _train(*flags, inject=()):
    """The numpy trainer in a subprocess of this checkout; ``inject``: (POINT, N, SIGNAL) of
    tests/fault_inject.py, to stop it there."""
    program = ["-m", "tests.fault_inject", *inject, "--"] if inject else [str(ROOT / "train_numpy.py")]
    return subprocess.run([sys.executable, *program, *flags], capture_output=True, text=True, timeout=300,
                          cwd=str(ROOT))


def _strict(line):
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(line, parse_constant=refuse)


def record(run):
    """metrics.jsonl as strict JSON, without the timing fields."""
    lines = (Path(run) / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in _strict(line).items() if k not in TIMING} for line in lines]


def weights(run):
    ckpt = checkpoint.load(str(run))
    return {**ckpt["params"], **{"optim/" + k: v for k, v in ckpt["optim"].items()}}


def files_of(run):
    """Every file of a run directory and its bytes, but the lock (which names the last run's process)."""
    return {p.name: p.read_bytes() for p in Path(run).iterdir() if p.name != ".lock"}


def temporaries(run):
    return sorted(p.name for p in Path(run).iterdir() if p.name.startswith(".tmp-"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """'one': a run after its first epoch; 'two': the same run trained for two epochs without a stop
    (what every interrupted run must end as)."""
    root = tmp_path_factory.mktemp("runs")
    jobs = {name: subprocess.Popen([sys.executable, str(ROOT / "train_numpy.py"), *TINY, "--epochs", str(n),
                                    "--out", str(root / name)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True)
            for name, n in (("one", 1), ("two", 2))}
    for name, job in jobs.items():
        out, err = job.communicate(timeout=300)
        assert job.returncode == 0, err
    return {name: root / name for name in jobs}


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _assert_same_as_uninterrupted(run, straight):
    a, b = weights(run), weights(straight)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert record(run) == record(straight)
    assert temporaries(run) == []
    stamp = (Path(run) / "checkpoint.npz").stat().st_mtime_ns
    assert all((Path(run) / p).stat().st_mtime_ns >= stamp for p in PICTURES), "pictures older than the checkpoint"
    lines = (Path(run) / "metrics.jsonl").read_text().splitlines()  # the file is the checkpoint's record
    assert [_strict(line) for line in lines] == checkpoint.load(str(run))["header"]["history"]


# ---- 1. a stop at any point of an epoch, its commit above all -------------------------------------------------
@pytest.mark.parametrize("point,sig", [("training", "SIGKILL"), ("trained", "SIGKILL"), ("saving", "SIGKILL"),
                                       ("checkpoint", "SIGKILL"), ("metrics", "SIGKILL"), ("curves", "SIGKILL"),
                                       ("checkpoint", "SIGINT")])
def test_a_stop_anywhere_in_the_commit_resumes_to_the_uninterrupted_run(runs, tmp_path, point, sig):
    run = _copy(runs["one"], tmp_path / "run")
    killed = _train("--resume", str(run), "--epochs", "2", *TINY, inject=(point, "1", sig))
    if sig == "SIGKILL":
        assert killed.returncode == -signal.SIGKILL, killed.stderr
    else:  # Ctrl-C waits for the commit to end, then the trainer names the checkpoint that holds it
        assert killed.returncode == 130, killed.stderr
        assert f"interrupted: the last good checkpoint ({run}, epoch 2) is intact" in killed.stderr
    if point == "saving":
        assert temporaries(run), "the kill should leave the checkpoint's temporary behind"
    resumed = _train("--resume", str(run), "--epochs", "2", "--no-progress")
    assert resumed.returncode == 0, resumed.stderr
    if (point, sig) == ("checkpoint", "SIGKILL"):
        assert "did not agree with the checkpoint, which has finished epoch 2: restored epoch 2" in resumed.stdout
    _assert_same_as_uninterrupted(run, runs["two"])


def test_resume_alone_finishes_the_run_it_was_started_as(runs, tmp_path):
    """A run started for 2 epochs, killed in its second: --resume alone goes on to the run's own
    total (it used to take the default 12), then has nothing left to train."""
    run = tmp_path / "run"
    killed = _train(*TINY, "--epochs", "2", "--out", str(run), inject=("training", "3", "SIGKILL"))  # 2 steps an epoch
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert checkpoint.load(str(run))["header"]["epochs"] == 2
    resumed = _train("--resume", str(run), "--no-progress")
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming after epoch 1 from {run / 'checkpoint.npz'}, to epoch 2" in resumed.stdout
    _assert_same_as_uninterrupted(run, runs["two"])
    again = _train("--resume", str(run), "--no-progress")
    assert again.returncode == 0 and "nothing to train" in again.stdout
    # a checkpoint from before the total was recorded: the default; a damaged total: one line
    assert recipe._planned_epochs({"header": {}, "path": "c.npz"}) is None
    with pytest.raises(CapsNetError, match="c.npz is damaged: its header has epochs = 'two'"):
        recipe._planned_epochs({"header": {"epochs": "two"}, "path": "c.npz"})


def test_metrics_lines_beyond_the_checkpoint_are_dropped_on_resume(runs, tmp_path, capsys):
    """A metrics.jsonl with a line the checkpoint does not hold (epoch 2's line, a checkpoint of
    epoch 1: written by hand, or by another run): the resumed run drops the line, and says so."""
    run = _copy(runs["one"], tmp_path / "run")
    line = (run / "metrics.jsonl").read_text()
    (run / "metrics.jsonl").write_text(line + line.replace('"epoch": 1', '"epoch": 2'))
    assert trainer.main("numpy", ["--resume", str(run), "--epochs", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "did not agree with the checkpoint, which has finished epoch 1: dropped its line for epoch 2" in out
    _assert_same_as_uninterrupted(run, runs["two"])


# ---- 2. --overwrite keeps the old record until it has a new one -------------------------------
def test_overwrite_leaves_the_earlier_run_whole_until_its_first_epoch_is_saved(runs, tmp_path):
    run = _copy(runs["two"], tmp_path / "run")
    before = files_of(run)
    diverged = _train(*TINY, "--epochs", "1", "--out", str(run), "--overwrite", "--limit", "16", "--lr", "1e30")
    assert diverged.returncode == 3, diverged.stderr
    assert (f"This run wrote no checkpoint yet (the earlier run's files in {run} are as they were)"
            in diverged.stderr)
    killed = _train(*TINY, "--epochs", "1", "--out", str(run), "--overwrite", inject=("trained", "1", "SIGKILL"))
    assert killed.returncode == -signal.SIGKILL
    assert files_of(run) == before
    # once it has saved an epoch, the directory is the new run's alone
    assert _train(*TINY, "--epochs", "1", "--out", str(run), "--overwrite", "--seed", "3").returncode == 0
    assert [r["epoch"] for r in record(run)] == [1]
    assert checkpoint.load(str(run))["header"]["recipe"]["seed"] == 3


# ---- 3. nothing non-finite is saved ----------------------------------------------------------------
def test_a_diverged_epoch_is_never_saved_and_names_the_real_last_good_checkpoint(runs, tmp_path, capsys):
    run = _copy(runs["one"], tmp_path / "run")
    before = files_of(run)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # overflow warnings give way to the one line
        # one step per epoch: the loss is checked before that step, so only the end-of-epoch check sees it
        code = trainer.main("numpy", ["--resume", str(run), "--epochs", "2", "--limit", "16", "--lr", "1e30",
                                      "--no-progress"])
    assert code == 3
    err = capsys.readouterr().err
    assert f"; stopped. The last good checkpoint is {run} (epoch 1); try a lower --lr." in err, err
    assert "after epoch 2" in err and len(err.strip().splitlines()) == 1
    assert files_of(run) == before
    record(run)  # strict JSON


def test_a_model_with_non_finite_outputs_or_weights_is_refused_by_evaluate(runs, tmp_path, capsys):
    ckpt = checkpoint.load(str(runs["one"]))
    model = CapsNet("numpy", checkpoint.config_of(ckpt))
    model.load_state_dict(ckpt["params"])
    for p in model.params.values():
        p *= 1e30  # finite weights, overflowing outputs: what --lr 1e30 used to save
    huge = checkpoint.save(str(tmp_path / "huge.npz"), model, **{k: v for k, v in ckpt["header"].items()
                                                                  if k in ("epoch", "recipe")})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cli.main(["evaluate", huge]) == 3
        err = capsys.readouterr().err
        assert f"the model in {huge} gives a test loss of nan: its outputs are not finite" in err, err
        assert cli.main(["inspect", huge, "--out", str(tmp_path / "pngs")]) == 2
    assert "gives class capsules that are not finite" in capsys.readouterr().err

    model.params["conv1.W"][0, 0, 0, 0] = np.nan
    with pytest.raises(Exception, match="conv1.W holds NaN or inf"):
        checkpoint.save(str(tmp_path / "nan.npz"), model)
    assert not (tmp_path / "nan.npz").exists()
    nan = tmp_path / "nan.npz"  # as an older version could have written it
    _rewrite_header(Path(huge), lambda h: h, nan, lambda a: {**a, "param/conv1.W": a["param/conv1.W"] * np.nan})
    for argv in (["evaluate", str(nan)], ["train", "--resume", str(nan), "--epochs", "3", "--out", str(tmp_path / "o")]):
        assert cli.main(argv) == 2
        assert f"error: {nan}: parameter conv1.W holds NaN or inf values" in capsys.readouterr().err


# ---- 4. leftover temporaries ---------------------------------------------------------------------
def test_temporaries_of_killed_writes_are_removed_at_the_next_write(tmp_path):
    model = CapsNet("numpy", **SMALL)
    stale = [".tmp-checkpoint-abc.npz", ".tmp-checkpoint-k2x9_a0q.npz"]
    for name in stale + [".tmp-other-abc.npz", "keep.npz"]:
        (tmp_path / name).write_bytes(b"x" * 100)
    checkpoint.save(str(tmp_path / "checkpoint.npz"), model)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-other-abc.npz", "checkpoint.npz", "keep.npz"]


# ---- 5. damaged checkpoints: one line naming the file, exit 2, from every command ---------------
def _rewrite_header(path, edit, dst=None, edit_arrays=lambda a: a, rebind=True):
    """The checkpoint at ``path`` with its header and arrays edited; ``rebind``: its digest made to
    match again (as if a buggy writer had saved it so), so that the check under test is reached."""
    with np.load(path) as z:
        arrays = edit_arrays({k: z[k] for k in z.files})
    header = edit(json.loads(str(arrays["header"])))
    if rebind and isinstance(header, dict) and "digest" in header:
        header["digest"] = checkpoint.digest(header, {k[6:]: v for k, v in arrays.items() if k.startswith("param/")})
    arrays["header"] = np.array(json.dumps(header))
    np.savez(dst or path, **arrays)


DAMAGE = {
    "header-a-list": (lambda h: [h], None, "its header is a JSON list, not the object pycapsnet writes"),
    "no-config": (lambda h: {k: v for k, v in h.items() if k != "config"}, None, "its header has no model configuration"),
    "unknown-config": (lambda h: {**h, "config": {**h["config"], "capsule_colour": "blue"}}, None,
                       "its model configuration has fields this pycapsnet does not know: capsule_colour"),
    "bad-config": (lambda h: {**h, "config": {**h["config"], "conv_channels": "many"}}, None,
                   "its model configuration is invalid"),
    "epoch-not-integer": (lambda h: {**h, "epoch": 1.5}, None, "its epoch is 1.5, not a whole number"),
    "recipe-value": (lambda h: {**h, "recipe": {**h["recipe"], "lr": "fast"}}, None, "its recipe has lr = 'fast'"),
    "optimizer-state-shape": (lambda h: h, lambda a: {**a, "optim/m/conv1.W": a["optim/m/conv1.W"][:1]},
                              "its adam state m/conv1.W is (1, 9, 1, 8), not (9, 9, 1, 8)"),
    "optimizer-state-missing": (lambda h: h, lambda a: {k: v for k, v in a.items() if not k.startswith("optim/")},
                                "its adam state lacks step_count, lr, m/conv1.W and "),
}
COMMANDS = {
    "train": lambda p, tmp: ["train", "--resume", p, "--epochs", "3", "--no-progress"],
    "evaluate": lambda p, tmp: ["evaluate", p],
    "inspect": lambda p, tmp: ["inspect", p, "--out", str(tmp / "pngs")],
    "crosscheck": lambda p, tmp: ["crosscheck", "--checkpoint", p, "--b", "numpy", "--batch", "2"],
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_checkpoint_is_one_line_naming_it_from_every_command(runs, tmp_path, capsys, damage):
    edit, edit_arrays, message = DAMAGE[damage]
    path = tmp_path / "run" / "checkpoint.npz"
    _copy(runs["one"], tmp_path / "run")
    _rewrite_header(path, edit, edit_arrays=edit_arrays or (lambda a: a))
    # the optimizer's state is read by training alone, the recipe by the commands that take the run's data
    commands = (["train"] if damage.startswith("optimizer") else ["train", "evaluate", "inspect"]
                if damage.startswith("recipe") else list(COMMANDS))
    for name in commands:
        assert cli.main(COMMANDS[name](str(path), tmp_path)) == 2, name
        err = capsys.readouterr().err
        assert err.startswith(f"error: {path} is damaged: ") and message in err, (name, err)
        assert len(err.strip().splitlines()) == 1, (name, err)


def test_an_unwritable_metrics_file_is_one_line(runs, tmp_path, capsys):
    run = _copy(runs["one"], tmp_path / "run")
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").mkdir()  # (a read-only file would do, but root writes those anyway)
    assert trainer.main("numpy", ["--resume", str(run), "--epochs", "2", "--no-progress"]) == 2
    assert f"error: cannot read the metrics {run / 'metrics.jsonl'}: it is a directory; move it out of the way" \
        in capsys.readouterr().err
    fresh = tmp_path / "fresh"
    (fresh / "metrics.jsonl").mkdir(parents=True)
    assert trainer.main("numpy", [*TINY, "--epochs", "1", "--out", str(fresh)]) == 2
    err = capsys.readouterr().err
    assert f"error: cannot write {fresh / 'metrics.jsonl'}: Is a directory. The checkpoint of epoch 1 is saved" in err


# ---- 6. messages that name the problem and the fix -----------------------------------------------
@pytest.mark.parametrize("where", ["step", "evaluation", "set-up"])
def test_a_batch_too_large_for_memory_is_one_line_naming_the_batch(tmp_path, capsys, monkeypatch, where):
    """What NumPy raises when an allocation fails: in a train step or in the evaluation after it,
    the batch is named; before any step (the data read, the network built), the images."""
    from pycapsnet.training import loop

    def too_large(*args, **kwargs):
        raise MemoryError("Unable to allocate 2.75 GiB for an array with shape (4000, 36, 32, 160)")

    monkeypatch.setattr(*{"step": (optim.Adam, "step"), "evaluation": (loop, "evaluate"),
                          "set-up": (loop.Training, "_setup")}[where], too_large)
    assert trainer.main("numpy", [*TINY, "--epochs", "1", "--out", str(tmp_path / "o")]) == 2
    said = "(Unable to allocate 2.75 GiB for an array with shape (4000, 36, 32, 160))"
    assert capsys.readouterr().err == (
        f"error: out of memory while reading the data and building the network {said}: give fewer or smaller "
        "images (--limit, --image-size)\n" if where == "set-up" else
        f"error: out of memory on numpy:cpu/float32 at batch 16 {said}: give a smaller --batch-size; "
        "`pycapsnet plan` works out the largest that fits\n")


def test_an_evaluation_batch_too_large_for_memory_is_scored_in_halves(monkeypatch):
    """Evaluation keeps 100 images' forward: where that does not fit, the batch is scored in
    halves (here down to 25), with the same accuracy and loss; other errors are not retried."""
    from pycapsnet.training import loop

    _, te = data.load_embedded()
    split = data.Split(te.x[:100], te.y[:100])
    from pycapsnet.core.model import CapsNetConfig

    model = CapsNet(backends.get("numpy", dtype="float64"), CapsNetConfig(conv_channels=8, primary_types=2))
    accuracy, loss = loop.evaluate(model, split, batch_size=100)
    real, sizes = CapsNet.loss, []

    def fits_25(self, x, y):
        sizes.append(len(y))
        if len(y) > 25:
            raise MemoryError("Unable to allocate 1.00 GiB")
        return real(self, x, y)

    monkeypatch.setattr(CapsNet, "loss", fits_25)
    assert loop.evaluate(model, split, batch_size=100) == (accuracy, pytest.approx(loss, rel=1e-12))
    assert sizes == [100, 50, 25, 25, 50, 25, 25]

    def broken(self, x, y):
        raise ValueError("not a memory error")

    monkeypatch.setattr(CapsNet, "loss", broken)
    with pytest.raises(ValueError, match="not a memory error"):
        loop.evaluate(model, split, batch_size=100)


def test_predict_out_of_memory_is_one_line(runs, tmp_path, capsys, monkeypatch):
    from PIL import Image

    from pycapsnet.core.model import CapsNet

    def too_large(*args, **kwargs):
        raise MemoryError("Unable to allocate 9.00 GiB")

    Image.fromarray(np.zeros((28, 28), np.uint8)).save(tmp_path / "digit.png")
    monkeypatch.setattr(CapsNet, "scores", too_large)
    assert cli.main(["predict", str(runs["one"]), str(tmp_path / "digit.png")]) == 2
    assert capsys.readouterr().err == ("error: out of memory (Unable to allocate 9.00 GiB): give a smaller "
                                       "--batch-size where the command takes one\n")


def test_fit_out_of_memory_is_a_memory_error_naming_its_keyword(monkeypatch):
    import pycapsnet
    from pycapsnet.errors import OutOfMemory

    def too_large(*args, **kwargs):
        raise MemoryError("Unable to allocate 1.00 GiB")

    monkeypatch.setattr(optim.Adam, "step", too_large)
    (x, y), _ = pycapsnet.load_digits()
    model = pycapsnet.build("capsnet", input_shape=(1, 28, 28), n_classes=10, seed=0)
    with pytest.raises(OutOfMemory, match=r"at batch 8 \(Unable to allocate 1.00 GiB\): give a smaller batch_size;") as e:
        model.fit(x[:16], y[:16], epochs=1, batch_size=8, progress=False)
    assert isinstance(e.value, MemoryError) and isinstance(e.value.__cause__, MemoryError)


def test_each_backend_knows_its_libraries_out_of_memory_errors():
    B = backends.get("numpy")
    assert B.out_of_memory(MemoryError()) and not B.out_of_memory(ValueError("x"))
    torch = pytest.importorskip("torch")
    T = backends.get("torch")
    try:
        torch.empty(2**62, dtype=torch.uint8)  # the CPU allocator's RuntimeError, raised at once
    except RuntimeError as e:
        assert T.out_of_memory(e)
    else:
        pytest.fail("torch allocated 4 EiB")
    assert T.out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not T.out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def _write_idx_float(path, values):
    a = np.asarray(values, ">f4")
    Path(path).write_bytes(bytes([0, 0, 0x0D, a.ndim]) + np.asarray(a.shape, ">i4").tobytes() + a.tobytes())


@pytest.fixture(scope="module")
def idx_dir(tmp_path_factory):
    tr, te = data.load_embedded()
    d = tmp_path_factory.mktemp("idx")
    write_mnist_dir(str(d), data.Split(tr.x[:20], tr.y[:20]), data.Split(te.x[:10], te.y[:10]))
    return d


def test_idx_files_that_are_swapped_misshapen_or_mislabelled_are_named(idx_dir, tmp_path):
    d = _copy(idx_dir, tmp_path / "d")
    labels = next(p for p in d.iterdir() if p.name.startswith("train-labels"))
    images = next(p for p in d.iterdir() if p.name.startswith("train-images"))
    shutil.copy(images, labels)  # an images file under the labels' name
    with pytest.raises(Exception, match=f"{labels} holds images \\(its magic number says 3 dimensions\\), but the "
                                        "labels file belongs here; are two files swapped or misnamed\\?"):
        data.load("mnist", str(d))

    d = _copy(idx_dir, tmp_path / "sizes")
    test_images = next(p for p in d.iterdir() if p.name.startswith("t10k-images"))
    data.write_idx(str(test_images), np.zeros((10, 20, 20), np.uint8))
    with pytest.raises(Exception, match="the train images .*train-images.* are 28x28 but the test images "
                                        f"\\({test_images}\\) are 20x20: both splits must hold images of one size"):
        data.load("mnist", str(d))

    for bad, shown in ((2.5, "2.5"), (np.nan, "nan")):
        d = _copy(idx_dir, tmp_path / f"labels-{shown}")
        lbl = next(p for p in d.iterdir() if p.name.startswith("train-labels"))
        lbl.unlink()
        values = np.arange(20) % 10.0
        values[7] = bad
        _write_idx_float(d / "train-labels-idx1-ubyte", values)
        with pytest.raises(Exception, match=f"labels must be whole numbers 0..9, but label 7 is {shown}"):
            data.load("mnist", str(d))


def test_data_dir_without_a_dataset_that_reads_it_is_refused(idx_dir, tmp_path, capsys):
    assert trainer.main("numpy", [*TINY, "--data-dir", str(idx_dir), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "names IDX files, but the dataset is embedded (the default), which reads none: say what the files " \
           "hold with --dataset mnist or --dataset fashion-mnist" in err
    assert not (tmp_path / "o" / "checkpoint.npz").exists()


def test_dtypes_in_any_spelling_and_the_device_flag_in_command_line_words(capsys):
    for spelling in (np.float32, np.dtype("float32"), "f4", "float32"):
        assert backends.get("numpy", dtype=spelling).dtype == "float32"
    assert backends.get("numpy", dtype="f8").dtype == "float64"
    with pytest.raises(backends.BackendError, match=r"unsupported dtype <class 'numpy.float16'> \(float16\): "
                                                    "pycapsnet computes in float32 or float64 only"):
        backends.get("numpy", dtype=np.float16)
    torch = pytest.importorskip("torch")
    assert backends.get("torch", dtype=torch.float64).dtype == "float64"
    if torch.cuda.is_available():
        return  # --device cuda works here; the message below is for machines without a GPU
    assert trainer.main("torch", ["--device", "cuda", *TINY]) == 2
    err = capsys.readouterr().err
    assert "run on the CPU: --device cpu on the command line" in err and len(err.strip().splitlines()) == 1


def test_a_learning_rate_beyond_the_dtype_is_one_line_and_no_warning(tmp_path, capsys):
    model = CapsNet("numpy", **SMALL)
    with pytest.raises(Exception, match="lr must be a finite number > 0, got 0"):
        optim.Adam(model, lr=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        code = trainer.main("numpy", [*TINY, "--lr", "1e300", "--out", str(tmp_path / "o")])
    assert code == 2
    assert capsys.readouterr().err == ("error: the learning rate 1e+300 makes a step size beyond the range of "
                                       "float32 (largest 3.4e+38); use a lower lr\n")


def test_a_run_outlives_the_reader_of_its_output(tmp_path):
    """``train_numpy.py ... | head -1``: the reader goes after the first line; the run does not die
    of a BrokenPipeError but trains to its end, says once on stderr that it goes on, and exits 0."""
    run = tmp_path / "run"
    p = subprocess.Popen([sys.executable, str(ROOT / "train_numpy.py"), *TINY, "--epochs", "2", "--out", str(run)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    assert p.stdout.readline().startswith("pycapsnet on numpy")
    p.stdout.close()
    err = p.stderr.read()
    assert p.wait(timeout=300) == 0, err
    assert "Traceback" not in err and "the run goes on" in err
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2

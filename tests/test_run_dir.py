"""A run directory holds one run, whole (issue 62, items 1-3): best.npz belongs to the epoch's
commit, a second run on a directory in use is refused, and --overwrite leaves nothing of the run
it replaces.  Kills run in subprocesses (tests/fault_inject.py), as in test_faults.py."""
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from pycapsnet.training import checkpoint, files
from pycapsnet.tools import cli
from tests.test_faults import ROOT, TIMING, TINY, _copy, _train, files_of, record, weights

# tiny, with a validation split whose best epoch is the second (checked in the fixture)
VAL = [*TINY, "--limit", "160", "--seed", "1", "--val-fraction", "0.2"]


@pytest.fixture(scope="module")
def val_runs(tmp_path_factory):
    """'one' and 'two': the validated run after one epoch, and straight through two."""
    root = tmp_path_factory.mktemp("val")
    for name, n in (("one", 1), ("two", 2)):
        done = _train(*VAL, "--epochs", str(n), "--out", str(root / name))
        assert done.returncode == 0, done.stderr
    best = checkpoint.load(str(root / "two" / "best.npz"))["header"]["epoch"]
    assert best == 2, "the case needs a run whose second epoch validates best"
    return {name: root / name for name in ("one", "two")}


def _same_weights(a, b):
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        np.testing.assert_array_equal(wa[k], wb[k], err_msg=k)


# ---- 1. best.npz belongs to the commit ---------------------------------------------------------
@pytest.mark.parametrize("point", ["checkpoint", "metrics", "curves"])
def test_best_npz_holds_the_best_epoch_after_a_kill_anywhere_in_the_commit(val_runs, tmp_path, point):
    run = _copy(val_runs["one"], tmp_path / "run")
    killed = _train("--resume", str(run), "--epochs", "2", *VAL, inject=(point, "1", "SIGKILL"))
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed = _train("--resume", str(run), "--epochs", "2", "--no-progress")
    assert resumed.returncode == 0, resumed.stderr
    if point == "checkpoint":  # killed between checkpoint.npz and best.npz
        assert "best.npz did not hold epoch 2, the best: restored from the checkpoint" in resumed.stdout
    _same_weights(run / "best.npz", val_runs["two"] / "best.npz")
    best_history = checkpoint.load(str(run / "best.npz"))["header"]["history"]
    assert [{k: v for k, v in r.items() if k not in TIMING} for r in best_history] == record(val_runs["two"])
    _same_weights(run, val_runs["two"])


# ---- 2. one run per directory -----------------------------------------------------------------
def test_a_second_run_on_a_directory_in_use_is_refused_naming_the_first(tmp_path):
    out = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "tests.fault_inject", "trained", "1", "SIGSTOP", "--",
                              *TINY, "--epochs", "1", "--out", str(out)], cwd=str(ROOT),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):  # until it stops itself, trained, holding the lock, nothing committed
            if _state(first.pid) == "T":
                break
            time.sleep(0.1)
        assert _state(first.pid) == "T"
        t0 = time.perf_counter()
        second = _train(*TINY, "--epochs", "1", "--out", str(out))
        assert second.returncode == 2 and time.perf_counter() - t0 < 60
        assert f"{out} is in use by another run (process {first.pid})" in second.stderr
        assert second.stderr.count("\n") == 1 and not (out / "checkpoint.npz").exists()
    finally:
        first.kill()
        first.wait()
    # the kernel dropped the dead run's lock: nothing stale is left to clear by hand
    third = _train(*TINY, "--epochs", "1", "--out", str(out))
    assert third.returncode == 0, third.stderr


def _state(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_in_process_runs_release_the_lock(tmp_path):
    from pycapsnet.training import trainer

    for _ in range(2):
        assert trainer.main("numpy", [*TINY, "--epochs", "1", "--out", str(tmp_path / "r"), "--overwrite"]) == 0


def test_a_write_leaves_the_temporaries_of_a_live_writer_alone(tmp_path):
    """Only temporaries whose process is gone (or that name none) are cleared."""
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        dead = _a_dead_pid()
        names = {"live": f".tmp-metrics-{sleeper.pid}-abc.jsonl", "dead": f".tmp-metrics-{dead}-abc.jsonl",
                 "old": ".tmp-metrics-k2x9.jsonl"}
        for name in names.values():
            (tmp_path / name).write_text("x")
        files.atomic_write(str(tmp_path / "metrics.jsonl"), lambda f: f.write("{}\n"), text=True)
        left = sorted(p.name for p in tmp_path.iterdir())
        assert left == sorted([names["live"], "metrics.jsonl"])
    finally:
        sleeper.kill()
        sleeper.wait()


def _a_dead_pid():
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


# ---- 3. --overwrite leaves nothing of the old run ----------------------------------------------
def _evaluated_val_run(val_runs, tmp_path):
    run = _copy(val_runs["two"], tmp_path / "run")
    assert cli.main(["evaluate", str(run)]) == 0
    assert (run / "confusion.json").exists() and (run / "confusion.png").exists() and (run / "best.npz").exists()
    return run


def test_overwrite_removes_every_file_of_the_replaced_run(val_runs, tmp_path):
    run = _evaluated_val_run(val_runs, tmp_path)
    done = _train(*TINY, "--epochs", "1", "--out", str(run), "--overwrite")
    assert done.returncode == 0, done.stderr
    assert sorted(files_of(run)) == ["checkpoint.npz", "curves.png", "metrics.jsonl", "reconstructions.png"]
    assert [r["epoch"] for r in record(run)] == [1]


def test_overwrite_killed_in_its_first_commit_leaves_nothing_of_the_replaced_run(val_runs, tmp_path):
    run = _evaluated_val_run(val_runs, tmp_path)
    killed = _train(*TINY, "--epochs", "1", "--out", str(run), "--overwrite", inject=("checkpoint", "1", "SIGKILL"))
    assert killed.returncode == -signal.SIGKILL
    resumed = _train("--resume", str(run), "--epochs", "1", "--no-progress")
    assert resumed.returncode == 0, resumed.stderr
    assert "removed" in resumed.stdout and "best.npz: it held another run's weights" in resumed.stdout
    assert sorted(files_of(run)) == ["checkpoint.npz", "curves.png", "metrics.jsonl", "reconstructions.png"]


def test_evaluate_then_resume_keeps_confusion_until_the_next_commit(val_runs, tmp_path):
    """The confusion files describe the checkpoint they scored: kept while it is the run's last,
    removed when the run commits a newer one."""
    run = _evaluated_val_run(val_runs, tmp_path)
    assert _train("--resume", str(run), "--epochs", "2", "--no-progress").returncode == 0  # nothing to train
    assert (run / "confusion.json").exists()
    assert _train("--resume", str(run), "--epochs", "3", "--no-progress").returncode == 0
    assert not (run / "confusion.json").exists() and (run / "best.npz").exists()


def test_fit_on_a_saved_model_says_nothing_of_a_best_npz_it_never_had(tmp_path, capsys, monkeypatch):
    """The README's path: fit with validation, save, load, fit again (issue 108): the loaded model's
    run never held a best.npz, so no 'was it moved or replaced?'."""
    import pycapsnet

    monkeypatch.chdir(tmp_path)
    (x, y), (xt, yt) = pycapsnet.load_digits()
    model = pycapsnet.build("capsnet", conv_channels=8, primary_types=2, decoder_hidden=(16, 32))
    model.fit(x[:64], y[:64], epochs=1, validation_data=(xt[:32], yt[:32]), progress=False)
    model.save("mine.npz")
    capsys.readouterr()
    pycapsnet.load("mine.npz").fit(x[:64], y[:64], epochs=1, progress=False)
    said = capsys.readouterr()
    assert "best.npz" not in said.out + said.err and "moved or replaced" not in said.out + said.err

"""Data-parallel training on torch.distributed (gloo, CPU): two processes with batch B end where
one process with batch 2B ends, and a process that dies stops the others with a message.

The two-process runs go through torchrun (``python -m torch.distributed.run``), as a user
launches them; the single-process runs are the plain trainer.  A tiny model keeps each to seconds."""
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pycapsnet.training import checkpoint

from pycapsnet.tools import cli
from tests.conftest import assert_close

pytest.importorskip("torch.distributed")
ROOT = Path(__file__).resolve().parent.parent
# 40 images in global batches of 16: steps of 16, 16 and 8 images per epoch; shifts on (2 pixels)
TINY = ["--conv-channels", "8", "--primary-types", "2", "--limit", "40", "--limit-test", "16", "--no-progress"]


def _run(argv, env=None, timeout=300):
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout, cwd=str(ROOT),
                          env={**os.environ, **(env or {})})


def _torchrun(n, flags):
    return _run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n),
                 str(ROOT / "train_numpy.py"), *flags])


@pytest.mark.parametrize("optimizer,dtype,epochs,limit,rtol,more", [
    ("adam", "float64", 2, 40, 1e-12, []),
    ("sgd", "float64", 1, 33, 1e-12, []),   # the last global batch is 1 image: the second process has none
    ("adam", "float32", 1, 40, 1e-4, []),   # float32 sums in another order: rounding, not a different step
    ("adam", "float64", 2, 40, 1e-12, ["--ema", "0.9"]),  # averaged weights in params, the live ones in optim
], ids=["adam", "sgd-short-batch", "float32", "ema"])
def test_two_processes_end_with_the_weights_of_one_with_their_global_batch(tmp_path, optimizer, dtype, epochs, limit,
                                                                           rtol, more):
    flags = [*TINY, "--optimizer", optimizer, "--dtype", dtype, "--epochs", str(epochs), "--limit", str(limit), *more]
    two = _torchrun(2, [*flags, "--batch-size", "8", "--out", str(tmp_path / "two")])
    assert two.returncode == 0, two.stderr[-3000:]
    assert "data parallel: 2 processes (gloo), batch 8 per process, global batch 16" in two.stdout
    assert two.stdout.count("epoch   1") == 1  # rank 0 alone prints
    one = _run([str(ROOT / "train_numpy.py"), *flags, "--batch-size", "16", "--out", str(tmp_path / "one")])
    assert one.returncode == 0, one.stderr
    a, b = checkpoint.load(str(tmp_path / "two")), checkpoint.load(str(tmp_path / "one"))
    for k in b["params"]:
        assert_close(a["params"][k], b["params"][k], rtol, k)
    assert set(a["optim"]) == set(b["optim"])
    assert any(k.startswith("average") for k in b["optim"]) == bool(more)
    for k in b["optim"]:
        assert_close(a["optim"][k], b["optim"][k], rtol, "optimizer " + k)
    for ra, rb in zip(a["header"]["history"], b["header"]["history"]):  # the global loss and accuracy
        assert ra["processes"] == 2 and rb["processes"] == 1
        for key in ("train_loss", "test_loss", "train_acc", "test_acc"):
            assert ra[key] == pytest.approx(rb[key], rel=rtol), key
    # the checkpoint of two processes continues on one, and is evaluated by one
    assert cli.main(["evaluate", str(tmp_path / "two"), "--limit-test", "8"]) == 0
    more = _run([str(ROOT / "train_numpy.py"), "--resume", str(tmp_path / "two"), "--epochs", str(epochs + 1),
                 "--no-progress"])
    assert more.returncode == 0, more.stderr
    assert "resuming on 1 process (the run so far used 2): the global batch is now 8, 8 per process" in more.stdout


def test_the_overlap_benchmark_sums_what_the_trainer_sums():
    """benchmarks/distributed_step.py --overlap: the gradient summed in two parts, the tail started
    during the backward, is the trainer's one sum of it, on the same batch."""
    import json

    run = _run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                str(ROOT / "benchmarks" / "distributed_step.py"), "--overlap", "--global-batch", "8", "--steps", "1"])
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["same_sum"] and result["processes"] == 2
    assert result["gradients_and_sum_ms"] > 0 and result["overlapped_ms"] > 0


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_process_that_dies_stops_the_others_with_a_message_and_the_checkpoint_intact(tmp_path):
    """Launched without torchrun (whose agent would stop the survivors itself): rank 1 is killed
    at its third step (epoch 2, step 1); rank 0, waiting in the gradients' sum, says so and exits 4."""
    out = tmp_path / "run"
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2",
           "PYCAPSNET_COLLECTIVE_TIMEOUT": "60"}
    flags = [*TINY, "--limit", "32", "--batch-size", "8", "--epochs", "3", "--out", str(out)]
    ranks = []
    for rank in (0, 1):
        program = [str(ROOT / "train_numpy.py")] if rank == 0 else ["-m", "tests.fault_inject", "training", "3",
                                                                   "SIGKILL", "--"]
        ranks.append(subprocess.Popen([sys.executable, *program, *flags], cwd=str(ROOT), text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      env={**os.environ, **env, "RANK": str(rank), "LOCAL_RANK": str(rank)}))
    results = [p.communicate(timeout=120) for p in ranks]
    assert ranks[1].returncode == -signal.SIGKILL
    assert ranks[0].returncode == 4, results[0][1]
    err = results[0][1]
    assert "error: another process of this run stopped or cannot be reached" in err, err
    assert f"The last good checkpoint is {out} (epoch 1)." in err and "Traceback" not in err, err
    assert checkpoint.load(str(out))["header"]["epoch"] == 1


def test_under_torchrun_a_survivor_exits_4_with_its_one_message_over_repeated_kills(tmp_path):
    """torchrun sends SIGTERM to the survivors when a process dies; the survivor may be waiting in a
    collective that fails at the same moment.  Whichever comes first, it exits 4 with one line,
    never 130 or -15, and no traceback of its own (torchrun's ChildFailedError summary is torchrun's)."""
    for attempt in range(3):
        out = tmp_path / f"run{attempt}"
        run = _run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                    "-m", "tests.fault_inject", "training", "3", "SIGKILL", "--",
                    *TINY, "--limit", "32", "--batch-size", "8", "--epochs", "3", "--out", str(out)],
                   env={"FAULT_INJECT_RANK": "1", "PYCAPSNET_COLLECTIVE_TIMEOUT": "60"}, timeout=200)
        log = run.stdout + run.stderr
        assert run.returncode != 0
        assert "exitcode  : 4 (pid" in log and "exitcode  : -9" in log, log[-3000:]
        ours = log.split("Traceback (most recent call last):")[0]  # what precedes torchrun's own summary
        assert ours.count("error: another process of this run stopped") == 1, log[-3000:]
        assert f"The last good checkpoint is {out} (epoch 1)." in ours, log[-3000:]
        assert "KeyboardInterrupt" not in log and "Exception ignored" not in log and "interrupted" not in log
        assert checkpoint.load(str(out))["header"]["epoch"] == 1


def test_the_shards_of_a_batch_are_one_processs_batch():
    from pycapsnet.training import data, distributed

    x = np.arange(10 * 4 * 4, dtype=np.float32).reshape(10, 1, 4, 4)
    split = data.Split(x, np.arange(10))
    whole = list(data.batches(split, 7, np.random.default_rng(3), shift=1))
    parts = [list(data.batches(split, 7, np.random.default_rng(3), 1, lambda n, k=k: distributed.shard(n, k, 3)))
             for k in range(3)]
    for step, (xw, yw) in enumerate(whole):
        np.testing.assert_array_equal(np.concatenate([p[step][0] for p in parts]), xw)
        np.testing.assert_array_equal(np.concatenate([p[step][1] for p in parts]), yw)
    assert [distributed.shard(7, k, 3) for k in range(3)] == [slice(0, 3), slice(3, 5), slice(5, 7)]
    assert [distributed.shard(2, k, 3) for k in range(3)] == [slice(0, 1), slice(1, 2), slice(2, 2)]


def test_without_torch_the_message_says_what_to_install(monkeypatch, capsys, tmp_path):
    from pycapsnet.training import trainer

    for k, v in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now fails, as where it is not installed
    monkeypatch.setitem(sys.modules, "torch.distributed", None)
    assert trainer.main("numpy", [*TINY, "--out", str(tmp_path / "o")]) == 2
    assert "training on several processes runs on torch.distributed, and PyTorch is not installed: pip install " \
           "torch (a single process needs no torch)" in capsys.readouterr().err


def test_batch_norm_trains_data_parallel_and_its_running_statistics_are_averaged(tmp_path):
    """Each process normalises its shard by its own statistics; after each epoch the processes'
    running statistics are replaced by their mean, so rank 0's checkpoint holds the shared ones."""
    import json

    from pycapsnet.core import architecture as A

    desc = A.network([A.conv2d(4, 5, 2, name="conv1"), A.relu(), A.batch_norm(momentum=0.5, name="bn"),
                      A.primary_caps(2, 4, 5, 2, name="primary"), A.attention_caps(10, 4, name="classcaps")],
                     decoder=None)
    path = tmp_path / "bn.json"
    path.write_text(json.dumps(desc))
    flags = ["--network", str(path), "--limit", "40", "--limit-test", "16", "--no-progress", "--epochs", "1",
             "--batch-size", "8", "--dtype", "float64"]
    two = _torchrun(2, [*flags, "--out", str(tmp_path / "two")])
    assert two.returncode == 0, two.stderr[-3000:]
    params = checkpoint.load(str(tmp_path / "two"))["params"]
    mean, var = params["bn.running_mean"], params["bn.running_var"]
    assert np.all(np.isfinite(mean)) and np.all(mean != 0) and np.all(var > 0) and np.all(var != 1)


def test_the_running_statistics_are_replaced_by_their_mean_over_the_processes():
    """distributed.average_buffers with a stand-in for the process group: this process holds a, the
    other b; all_reduce sums them in place, and the mean is what every process keeps."""
    from pycapsnet import backends
    from pycapsnet.core import architecture as A
    from pycapsnet.training.distributed import average_buffers

    model = A.build(A.network([A.conv2d(3, 3), A.batch_norm(name="bn"), A.primary_caps(1, 3, 3, 1),
                               A.dynamic_caps(2, 4)], input_shape=(1, 7, 7), n_classes=2), backends.get("numpy"))
    a, b = np.array([1.0, 2.0, 3.0]), np.array([3.0, 6.0, -1.0])
    model.buffers["bn.running_mean"][...] = a

    class OtherRank:
        world = 2

        def sum_(self, x):
            x += b if x is model.buffers["bn.running_mean"] else x  # the other holds b, and the same variance
            return x

    average_buffers(OtherRank(), model)
    np.testing.assert_allclose(model.buffers["bn.running_mean"], (a + b) / 2)
    np.testing.assert_allclose(model.buffers["bn.running_var"], 1)

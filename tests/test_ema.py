"""--ema (optim.py): an exponential moving average of the weights, moved after every update,
scored, checkpointed and predicted with; a resumed run ends where the straight one does; a run
resumed with --ema starts its average from the checkpoint's weights; bad decays are refused."""
import json
import os
import shutil

import numpy as np
import pytest

import pycapsnet
from pycapsnet import CapsNet, CapsNetError, backends
from pycapsnet.training import checkpoint, data, optim, trainer
from pycapsnet.training.graph import CapturedStep
from tests.conftest import CPU_BACKENDS, GPU_BACKENDS, SMALL

DATA = ["--limit", "96", "--limit-test", "40", "--no-progress", "--conv-channels", "16", "--primary-types", "4",
        "--batch-size", "32", "--dtype", "float64"]


def _steps(model, opt, n, seed=0):
    """n train steps on random batches; the weights after each, on the host."""
    B, rng, after = model.B, np.random.default_rng(seed), []
    for _ in range(n):
        model.train_step_grads(rng.random((3, 1, 14, 14)), rng.integers(0, SMALL["n_classes"], 3))
        opt.step()
        after.append({k: B.to_numpy(p).copy() for k, p in model.params.items()})
    return after


@pytest.mark.parametrize("name", ["adam", "sgd"])
@pytest.mark.parametrize("spec", CPU_BACKENDS + GPU_BACKENDS)
def test_the_average_is_the_ramped_exponential_average_of_the_weights(spec, name):
    """w̄_0 = w_0, w̄_t = β_t w̄_(t-1) + (1 - β_t) w_t with β_t = min(ema, (1 + t)/(10 + t)), against
    the recurrence run on the host over the weights each step left; the update itself is the one
    without --ema (the same weights)."""
    B = backends.get(spec, dtype="float64")
    B.elementwise_block = 1000  # several blocks per weight matrix
    plain, averaged = CapsNet(B, seed=3, **SMALL), CapsNet(B, seed=3, **SMALL)
    start = {k: B.to_numpy(p).copy() for k, p in averaged.params.items()}
    opt = optim.make(name, averaged, 1e-2, ema=0.6)
    weights = _steps(averaged, opt, 6)
    for k, w in enumerate(_steps(plain, optim.make(name, plain, 1e-2), 6)):
        for n in w:
            np.testing.assert_array_equal(weights[k][n], w[n], err_msg=n)
    expected = start
    for t, w in enumerate(weights, start=1):
        beta = min(0.6, (1 + t) / (10 + t))
        expected = {n: beta * expected[n] + (1 - beta) * w[n] for n in w}
    for n, a in opt.state["average"].items():
        np.testing.assert_allclose(B.to_numpy(a), expected[n], rtol=1e-12, atol=1e-14, err_msg=n)
        assert not np.array_equal(expected[n], weights[-1][n]), n  # the average is not the weights


def test_use_average_trades_the_two_sets_and_a_step_on_the_averages_is_refused():
    B = backends.get("numpy", dtype="float64")
    model = CapsNet(B, seed=1, **SMALL)
    opt = optim.Adam(model, 1e-2, ema=0.9)
    _steps(model, opt, 3)
    live = {k: p.copy() for k, p in model.params.items()}
    mean = {k: a.copy() for k, a in opt.state["average"].items()}
    arrays = {k: p for k, p in model.params.items()}
    opt.use_average(True)
    opt.use_average(True)  # twice: still the averages
    for k, p in model.params.items():
        assert p is arrays[k]  # the same arrays (a recorded step holds them), new contents
        np.testing.assert_array_equal(p, mean[k])
        np.testing.assert_array_equal(opt.state["average"][k], live[k])
    with pytest.raises(CapsNetError, match=r"use_average\(False\) before training"):
        opt.step()
    assert opt.step_count == 3
    opt.use_average(False)
    for k, p in model.params.items():
        np.testing.assert_array_equal(p, live[k])
        np.testing.assert_array_equal(opt.state["average"][k], mean[k])
    plain = optim.Adam(model, 1e-2)
    plain.use_average(True)  # without ema: nothing to trade
    np.testing.assert_array_equal(model.params["classcaps.W"], live["classcaps.W"])
    assert "average" not in plain.state and "averaged" not in plain.state_dict()


def test_the_state_round_trips_while_averaged():
    """A checkpoint is written with the averages in the parameters: the state restored into a new
    model and optimizer is the same, and trading back gives the live weights."""
    B = backends.get("numpy", dtype="float64")
    model = CapsNet(B, seed=1, **SMALL)
    opt = optim.Adam(model, 1e-2, ema=0.9)
    _steps(model, opt, 2)
    opt.use_average(True)
    params, state = model.state_dict(), opt.state_dict()
    assert int(state["averaged"]) == 1
    other = CapsNet(B, seed=7, **SMALL)
    other.load_state_dict(params)
    again = optim.Adam(other, 1e-2, ema=0.9)
    again.load_state_dict(state)
    assert again.averaged
    again.use_average(False)
    opt.use_average(False)
    for k, p in model.params.items():
        np.testing.assert_array_equal(other.params[k], p, err_msg=k)
        np.testing.assert_array_equal(again.state["average"][k], opt.state["average"][k], err_msg=k)


@pytest.mark.parametrize("spec", CPU_BACKENDS + GPU_BACKENDS)
def test_a_captured_step_moves_the_average_as_the_step_op_by_op(spec):
    B = backends.get(spec, dtype="float64")
    eager, rec = CapsNet(B, seed=5, **SMALL), CapsNet(B, seed=5, **SMALL)
    opt_e, opt_r = optim.Adam(eager, 1e-2, ema=0.8), optim.Adam(rec, 1e-2, ema=0.8)
    step = CapturedStep(rec, opt_r, batch_size=4)
    rng = np.random.default_rng(0)
    for _ in range(4):
        x, y = rng.random((4, 1, 14, 14)), rng.integers(0, SMALL["n_classes"], 4)
        eager.train_step_grads(x, y)
        opt_e.step()
        step(x, y)
    for k, a in opt_e.state["average"].items():
        np.testing.assert_allclose(B.to_numpy(opt_r.state["average"][k]), B.to_numpy(a), rtol=1e-10, atol=1e-14)


def _metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_a_run_scores_and_keeps_the_average_and_resumes_exactly(tmp_path, capsys):
    """Each epoch is scored with the average, and the checkpoint holds it as the model's weights
    (evaluate scores what the run reported); two epochs and one-plus-one resumed end the same,
    bit for bit, the live weights (the optimizer's) included."""
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    assert trainer.main("numpy", DATA + ["--ema", "0.9", "--epochs", "2", "--out", straight]) == 0
    assert trainer.main("numpy", DATA + ["--ema", "0.9", "--epochs", "1", "--out", resumed]) == 0
    assert trainer.main("numpy", ["--no-progress", "--epochs", "2", "--resume", resumed]) == 0
    a, b = checkpoint.load(straight), checkpoint.load(resumed)
    assert a["header"]["recipe"]["ema"] == 0.9 and b["header"]["recipe"]["ema"] == 0.9
    for part in ("params", "optim"):
        for k in a[part]:
            np.testing.assert_array_equal(a[part][k], b[part][k], err_msg=k)
    assert int(a["optim"]["averaged"]) == 1
    assert any(not np.array_equal(a["params"][k], a["optim"][f"average/{k}"]) for k in a["params"])
    assert _metrics(straight) == [dict(r, train_seconds=s["train_seconds"], train_samples_per_s=s["train_samples_per_s"])
                                  for r, s in zip(_metrics(resumed), _metrics(straight))]
    capsys.readouterr()
    assert trainer.main("numpy", ["--no-progress", "--eval-only", "--resume", straight, "--limit-test", "40"]) == 0
    said = capsys.readouterr().out
    assert f"test accuracy {100 * _metrics(straight)[-1]['test_acc']:.2f}%" in said


def test_resuming_with_ema_starts_the_average_from_the_checkpoint(tmp_path, capsys):
    """A run trained without --ema, resumed with it: the training is the one resumed without it
    (the live weights the same, bit for bit), and the weights it keeps are the average."""
    out, plain = str(tmp_path / "run"), str(tmp_path / "plain")
    assert trainer.main("numpy", DATA + ["--epochs", "1", "--out", out]) == 0
    shutil.copytree(out, plain)
    capsys.readouterr()
    assert trainer.main("numpy", ["--no-progress", "--epochs", "2", "--resume", out, "--ema", "0.999"]) == 0
    said = capsys.readouterr()
    assert "resuming with --ema 0.999 (the run so far used none)" in said.out + said.err
    assert trainer.main("numpy", ["--no-progress", "--epochs", "2", "--resume", plain]) == 0
    averaged, trained = checkpoint.load(out), checkpoint.load(plain)
    assert int(averaged["optim"]["step_count"]) == 6  # 96 images in batches of 32, two epochs
    for k, w in trained["params"].items():
        np.testing.assert_array_equal(averaged["optim"][f"average/{k}"], w, err_msg=k)  # the live weights
        np.testing.assert_array_equal(averaged["optim"][f"m/{k}"], trained["optim"][f"m/{k}"], err_msg=k)
    assert all(not np.array_equal(averaged["params"][k], w) for k, w in trained["params"].items()
               if k.endswith(".W"))


def test_fit_leaves_the_average_in_the_model(tmp_path):
    train, _ = data.load_embedded()
    x, y = train.images(slice(0, 64)), train.y[:64]
    model = pycapsnet.build("capsnet", seed=0, conv_channels=16, primary_types=4)
    history = model.fit(x, y, epochs=1, batch_size=16, ema=0.5, validation_data=(x[:32], y[:32]), progress=False,
                        out=str(tmp_path / "fit"))
    assert model.evaluate(x[:32], y[:32])["accuracy"] == pytest.approx(history[-1]["val_acc"])
    saved = checkpoint.load(str(tmp_path / "fit"))
    for k, p in saved["params"].items():
        np.testing.assert_array_equal(model.B.to_numpy(model.network.params[k]), p, err_msg=k)


@pytest.mark.parametrize("ema", [0, 1, 1.5, -0.1, "0.9", True])
def test_a_decay_outside_0_1_is_refused(ema, tmp_path, capsys):
    model = pycapsnet.build("capsnet", seed=0, conv_channels=16, primary_types=4)
    x = np.zeros((4, 1, 28, 28), np.float32)
    with pytest.raises(CapsNetError, match=r"ema must be a number between 0 and 1"):
        model.fit(x, np.arange(4), ema=ema, progress=False)
    if isinstance(ema, (int, float)) and not isinstance(ema, bool):
        with pytest.raises(CapsNetError, match=r"ema must be a finite number in \(0, 1\)"):
            optim.Adam(CapsNet("numpy", **SMALL), ema=ema)
        with pytest.raises(SystemExit) as stop:
            trainer.main("numpy", DATA + ["--ema", str(ema), "--out", str(tmp_path / "r")])
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert "argument --ema: must be a number between 0 and 1" in err and "Traceback" not in err

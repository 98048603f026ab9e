"""The `pycapsnet` command: each subcommand's outputs, exit codes, and that crosscheck catches a
perturbed gradient."""
import os
import subprocess
import sys

import numpy as np
import pytest

from pycapsnet import backends
from pycapsnet import CapsNet
from pycapsnet.training import checkpoint
from pycapsnet.tools import cli, crosscheck
from tests.conftest import SMALL

PAPER_SMALL = dict(conv_channels=16, primary_types=4)  # 28x28 digits, a quick model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ck") / "checkpoint.npz")
    return checkpoint.save(path, CapsNet("numpy", seed=1, **PAPER_SMALL), epoch=1)


def test_gradcheck_passes_and_prints_a_table(capsys):
    assert cli.main(["gradcheck", "--samples", "2"]) == 0  # every check at 2 entries a tensor: its table
    out = capsys.readouterr().out
    assert "max rel err" in out and "ClassCaps routing=full" in out and "CapsNet routing=final" in out
    assert "0 failed" in out and "FAIL" not in out


def test_gradcheck_fails_on_a_broken_backward(monkeypatch, capsys):
    from pycapsnet.core import layers

    real = layers.Linear.backward

    def broken(self, dy, *args, **kwargs):
        dx = real(self, dy, *args, **kwargs)
        self.grads["b"] *= 1.001  # a 0.1% error in one bias gradient
        return dx

    monkeypatch.setattr(layers.Linear, "backward", broken)
    # the decoder's Linear layers are in every network: the quickest routing's checks find them
    assert cli.main(["gradcheck", "--samples", "2", "--routing", "attention"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_gradcheck_in_float32_is_refused_with_the_reason(capsys):
    """It used to run and report 20 FAILs on a correct backward: float32 rounding, not the gradients."""
    assert cli.main(["gradcheck", "--dtype", "float32", "--samples", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: gradcheck runs in float64 only, not float32: float32 rounding swamps")
    assert "pycapsnet crosscheck --a numpy --b BACKEND --dtype-b float32" in err


def test_crosscheck_agrees_and_catches_a_perturbation(ckpt, capsys):
    pytest.importorskip("torch")
    assert cli.main(["crosscheck", "--a", "numpy", "--b", "torch", "--checkpoint", ckpt, "--batch", "4"]) == 0
    out = capsys.readouterr().out
    assert "dL/d classcaps.W" in out and "0 disagree" in out
    rc = cli.main(["crosscheck", "--a", "numpy", "--b", "torch", "--checkpoint", ckpt, "--batch", "4",
                   "--perturb-grad", "primary.W=1.0001"])
    out = capsys.readouterr().out
    assert rc == 1
    assert [line for line in out.splitlines() if line.startswith("dL/d primary.W")][0].rstrip().endswith("DISAGREE")
    assert "1 disagree" in out


def test_a_float32_backward_is_checked_against_the_float64_one(ckpt, capsys):
    """--dtype-b: side b in float32, side a in float64 (the backward gradcheck checks), from the same
    float32 weights; float32's rounding stays far inside the tolerance, a 0.1% error does not."""
    rows, models, _ = crosscheck.crosscheck("numpy", "numpy", "float64", batch=2, config=SMALL, dtype_b="float32")
    hi, lo = models
    assert (hi.B.dtype, lo.B.dtype) == ("float64", "float32")
    for k, p in lo.params.items():  # the same numbers on both sides: float64 holds float32's exactly
        np.testing.assert_array_equal(hi.B.to_numpy(hi.params[k]), lo.B.to_numpy(p).astype(np.float64), err_msg=k)
    assert max(r["max_rel"] for r in rows) < 1e-5
    argv = ["crosscheck", "--a", "numpy", "--b", "numpy", "--dtype-b", "float32", "--checkpoint", ckpt, "--batch", "2"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("numpy:cpu/float64  vs  numpy:cpu/float32") and "(tolerance 0.0001 of each tensor's scale, float64 vs float32)" in out
    assert cli.main(argv + ["--perturb-grad", "classcaps.W=1.001"]) == 1
    assert "1 disagree" in capsys.readouterr().out


def test_crosscheck_float32_tolerance_follows_the_dtype(capsys):
    pytest.importorskip("torch")
    assert cli.main(["crosscheck", "--dtype", "float32", "--batch", "2"]) == 0
    assert "tolerance 0.0001" in capsys.readouterr().out


def test_crosscheck_torch_cpu_vs_cuda_needs_a_gpu(capsys):
    pytest.importorskip("torch")
    if backends.gpu_unavailable_reason("torch") is None:
        pytest.skip("a GPU is present: the comparison itself runs in test_gpu_crosscheck")
    assert cli.main(["crosscheck", "--a", "torch:cpu", "--b", "torch:cuda"]) == 2
    assert "torch.cuda.is_available() is False" in capsys.readouterr().err


@pytest.mark.skipif(backends.gpu_unavailable_reason("torch") is not None,
                    reason=f"torch:cuda: {backends.gpu_unavailable_reason('torch')}")
def test_gpu_crosscheck(ckpt):
    assert cli.main(["crosscheck", "--a", "torch:cpu", "--b", "torch:cuda", "--checkpoint", ckpt]) == 0


def test_inspect_writes_three_pictures(ckpt, tmp_path, capsys):
    out = str(tmp_path / "ins")
    assert cli.main(["inspect", ckpt, "--out", out, "--index", "3"]) == 0
    assert ("coupling.npz: the coupling coefficients c_ij of test image 3, one array per routing iteration "
            "(iteration_1, iteration_2, iteration_3), each (144, 10): 144 input capsules x 10 classes"
            in capsys.readouterr().out)
    for name in ["reconstructions.png", "perturbation.png", "coupling.png"]:
        with open(os.path.join(out, name), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", name
    c = np.load(os.path.join(out, "coupling.npz"))
    assert len(c.files) == 3  # one (I, J) matrix per routing iteration
    first = c["iteration_1"]
    assert first.shape == (6 * 6 * 4, 10)
    np.testing.assert_allclose(first, 0.1, rtol=1e-6)  # b = 0: uniform coupling in iteration 1
    np.testing.assert_allclose(c["iteration_3"].sum(1), 1.0, rtol=1e-5)


def test_inspect_writes_each_iterations_coupling_gradient(ckpt, tmp_path, capsys):
    """96.3: dL/dc per iteration from the command line: none for c^0 = 1/J (a constant), one (I, J) array
    for each later iteration."""
    pytest.importorskip("torch", reason="dL/dc is read by PyTorch's autograd off the routing's forward")
    out = str(tmp_path / "ins")
    assert cli.main(["inspect", ckpt, "--out", out, "--coupling-grad"]) == 0
    said = capsys.readouterr().out
    assert "classcaps: mean |dL/dc_ij| per iteration: constant, " in said
    g = np.load(os.path.join(out, "coupling_grad.npz"))
    assert sorted(g.files) == ["classcaps/iteration_2", "classcaps/iteration_3"]
    assert g["classcaps/iteration_3"].shape == (6 * 6 * 4, 10) and np.abs(g["classcaps/iteration_3"]).max() > 0


def test_bare_pycapsnet_prints_its_help_and_version_says_which(capsys):
    import pycapsnet

    assert cli.main([]) == 0
    assert "{gradcheck,crosscheck,inspect,train,evaluate,predict,plan,experiment,data,check-routing}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:
        cli.main(["--version"])
    assert stop.value.code == 0 and capsys.readouterr().out.strip() == f"pycapsnet {pycapsnet.__version__}"


def test_inspect_into_a_file_is_an_error_not_a_traceback(ckpt, capsys):
    assert cli.main(["inspect", ckpt, "--out", ckpt]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --out {ckpt} is a file; it names the directory the results go to: "
                          "choose another with --out")
    assert "Traceback" not in err


def test_figure4_perturbation_moves_one_dimension(ckpt):
    model, _ = checkpoint.load_model(ckpt, backends.get("numpy"))
    v = np.zeros((2, 10, 16), np.float32)
    v[1, 3, 5] = 0.25
    rec = model.decode(v, [3, 3])
    assert rec.shape == (2, 1, 28, 28) and not np.allclose(rec[0], rec[1])
    # capsules other than the chosen one are masked out
    v2 = v.copy()
    v2[:, 7] = 1.0
    np.testing.assert_allclose(model.decode(v2, [3, 3]), rec)


def test_evaluate_and_train_subcommands(ckpt, tmp_path, capsys):
    assert cli.main(["evaluate", ckpt]) == 0
    printed = capsys.readouterr()
    assert "test accuracy" in printed.out + printed.err
    out = str(tmp_path / "run")
    assert cli.main(["train", "--conv-channels", "8", "--primary-types", "2", "--limit", "64", "--limit-test", "20",
                     "--epochs", "1", "--no-progress", "--out", out]) == 0
    assert os.path.exists(os.path.join(out, "checkpoint.npz"))


def test_train_says_when_other_processes_keep_its_cores_busy(tmp_path, capsys, monkeypatch):
    """The busy-machine note (backends.busy_machine_note) is said by train where the threads were
    not chosen, and the run goes on."""
    from pycapsnet.backends import host

    for k in ("PYCAPSNET_THREADS", "OMP_NUM_THREADS"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(host, "busy_cores", lambda window=0.1: 1.0)
    monkeypatch.setattr("pycapsnet.backends.numpy_backend.cpu_threads", lambda: 2)
    out = str(tmp_path / "run")
    assert cli.main(["train", "--conv-channels", "8", "--primary-types", "2", "--limit", "64", "--limit-test", "20",
                     "--epochs", "1", "--no-progress", "--out", out]) == 0
    printed = capsys.readouterr()
    assert "OMP_NUM_THREADS=1 PYCAPSNET_THREADS=1" in printed.out + printed.err


def test_errors_exit_2_without_traceback(tmp_path):
    bad = tmp_path / "nope.npz"
    for argv, msg in [(["inspect", str(bad)], "checkpoint not found"),
                      (["evaluate", str(bad)], "checkpoint not found"),
                      (["crosscheck", "--a", "jax"], "unknown backend 'jax'"),
                      (["crosscheck", "--perturb-grad", "nope=2"], "no parameter 'nope'"),
                      (["train", "--network", "efficeint"], "the name of one the package carries: efficient")]:
        r = subprocess.run([sys.executable, "-m", "pycapsnet", *argv], capture_output=True, text=True, cwd=tmp_path)
        assert r.returncode == 2, (argv, r.stderr)
        assert msg in r.stderr and "Traceback" not in r.stderr, (argv, r.stderr)
    assert not (tmp_path / "inspect").exists(), "the refused inspect left its default --out, ./inspect"


@pytest.mark.parametrize("argv,message", [
    (["gradcheck", "--samples", "0"], "argument --samples: must be at least 1, got 0"),  # was 84 FAILs
    (["gradcheck", "--tol", "-1"], "argument --tol: must be a finite number above 0, got -1"),
    (["crosscheck", "--batch", "-2"], "argument --batch: must be at least 1, got -2"),  # ran 998 digits
    (["crosscheck", "--rtol", "0"], "argument --rtol: must be a finite number above 0, got 0"),
    (["crosscheck", "--seed", "-1"], "argument --seed: must be 0 or more, got -1"),
    (["inspect", "ckpt.npz", "--index", "-1"], "argument --index: must be 0 or more, got -1"),
    (["train", "--batch-size", "0"], "argument --batch-size: must be at least 1, got 0"),
    (["crosscheck", "--perturb-grad", "primary.W=abc"], "argument --perturb-grad: expected a number, got 'abc'"),
    (["crosscheck", "--perturb-grad", "=2"], "argument --perturb-grad: expected NAME=FACTOR, e.g. primary.W=1.01"),
    (["crosscheck", "--perturb-grad", "primary.W=nan"], "argument --perturb-grad: FACTOR must be a finite number"),
])
def test_impossible_numbers_are_refused_when_the_command_line_is_read(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_console_entry_point_is_declared():
    with open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "setup.py")) as f:
        setup = f.read()
    assert "pycapsnet=pycapsnet.tools.cli:main" in setup


def test_inspect_draws_every_routing_layer_of_a_composition(tmp_path, capsys):
    """ConvCaps and two routing layers: a picture and the arrays of each layer's coefficients;
    Figure 4 for the capsule and over the range asked for."""
    import json

    from pycapsnet.core import architecture as A
    from pycapsnet.training import trainer

    net = A.network([A.conv2d(8, 9, name="conv1"), A.relu(), A.primary_caps(4, 4, kernel=9, stride=2, name="primary"),
                     A.conv_caps(4, 4, kernel=3, name="convcaps"), A.dynamic_caps(6, 8, name="caps1"),
                     A.dynamic_caps(10, 16, name="classcaps")], decoder=A.decoder((16,)))
    (tmp_path / "net.json").write_text(json.dumps(net))
    run = tmp_path / "run"
    assert trainer.main("numpy", ["--network", str(tmp_path / "net.json"), "--limit", "32", "--limit-test", "16",
                                  "--batch-size", "16", "--epochs", "1", "--no-progress", "--out", str(run)]) == 0
    out = tmp_path / "pngs"
    assert cli.main(["inspect", str(run), "--out", str(out), "--capsule", "3", "--range", "0.5"]) == 0
    for stem, shape in (("coupling_convcaps", (36, 4)), ("coupling_caps1", (64, 6)), ("coupling", (6, 10))):
        assert (out / f"{stem}.png").stat().st_size > 5000
        with np.load(out / f"{stem}.npz") as z:
            assert sorted(z.files) == ["iteration_1", "iteration_2", "iteration_3"] and z["iteration_1"].shape == shape
    assert (out / "perturbation.png").exists()
    capsys.readouterr()
    assert cli.main(["inspect", str(run), "--out", str(out), "--capsule", "10"]) == 2
    assert "--capsule must be a class index 0..9" in capsys.readouterr().err


def test_a_reader_that_stops_early_gets_no_traceback():
    """``pycapsnet gradcheck | head -3``: once the reader has gone, the command stops with 141 (as a
    program killed by SIGPIPE) and says nothing on stderr, rather than a BrokenPipeError traceback."""
    p = subprocess.Popen([sys.executable, "-m", "pycapsnet", "gradcheck", "--routing", "attention"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().startswith("finite-difference checks")
    p.stdout.close()
    err = p.stderr.read()
    assert p.wait(timeout=120) == 141, err
    assert "Traceback" not in err and err == ""

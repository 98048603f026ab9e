"""Round 5 of the fault, bad-input and security probe (issue 103): nothing run from an untrusted
folder, no study data lost, nothing silently wrong on the plugin and study surfaces, one line instead
of a traceback.  Each test names its item; each failed on the main of the issue."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pycapsnet
import pycapsnet.experiments as experiments
import pycapsnet.routings as R
from pycapsnet import CapsNetError
from pycapsnet.core import architecture as A, routings as registry
from pycapsnet.experiments import study_stats, study_units
from pycapsnet.tools import cli
from tests import routing_plugin

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = Path(routing_plugin.__file__).read_text()
Q = ["--quick", "--epochs", "1", "--limit", "40", "--limit-test", "20", "--no-affine", "--routings", "uniform",
     "dynamic"]


def _run(*args, cwd, env=None, module=True):
    head = [sys.executable, "-m", "pycapsnet"] if module else [sys.executable, "-c", args[0]]
    return subprocess.run([*head, *(args if module else args[1:])], capture_output=True, text=True, timeout=600,
                          cwd=str(cwd), env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def _one_line(err: str, *fragments):
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    for f in fragments:
        assert f in err, err


def _plant(folder: Path, marker: Path) -> None:
    """A dist-info and its module in ``folder``: importing the module writes ``marker``."""
    info = folder / "planted-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: planted\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[pycapsnet.routings]\nplanted = plantedmod:X\n")
    (folder / "plantedmod.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")


# ---- 1, 2: code run from an untrusted folder ---------------------------------------------------------
@pytest.mark.parametrize("how", ["python -m", "python -c"])
def test_1_a_dist_info_planted_in_the_current_folder_is_never_imported(tmp_path, how):
    marker = tmp_path / "RAN"
    _plant(tmp_path, marker)
    if how == "python -m":
        done = _run("check-routing", "--help", cwd=tmp_path)
    else:
        done = _run("from pycapsnet.core import routings; print(routings.names())", cwd=tmp_path, module=False)
    assert done.returncode == 0, done.stderr
    assert not marker.exists()
    assert "planted 1.0 in the current folder are not loaded" in done.stderr


def test_2_an_installed_plugin_wins_over_a_file_of_its_name_in_the_current_folder(tmp_path):
    site, here = tmp_path / "site", tmp_path / "here"
    site.mkdir(), here.mkdir()
    (site / "shipped5.py").write_text(PLUGIN.replace('"tempered"', '"shipped5"').replace("tempered-", "shipped5-"))
    marker = tmp_path / "RAN"
    (here / "shipped5.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    env = {"PYTHONPATH": f"{ROOT}{os.pathsep}{site}"}
    done = _run("check-routing", "--help", "--plugin", "shipped5", cwd=here, env=env)
    assert done.returncode == 0 and not marker.exists(), done.stderr
    assert "imported the installed" in done.stderr and "./shipped5.py" in done.stderr
    done = _run("check-routing", "--help", "--plugin", "./shipped5.py", cwd=here, env=env)  # "this file"
    assert marker.exists(), done.stderr


def test_11_a_plugin_that_exits_as_it_is_imported_is_refused(tmp_path, capsys):
    (tmp_path / "exiter.py").write_text("import sys\nsys.exit(0)\n")
    assert cli.main(["train", "--plugin", str(tmp_path / "exiter.py"), "--epochs", "1"]) == 2
    _one_line(capsys.readouterr().err, "sys.exit(0)")


# ---- 5: names that mean something else ----------------------------------------------------------------
@pytest.mark.parametrize("name,said", [("em", "matrix capsules"), ("cnn", "CNN baseline"), ("capsnet", "paper's"),
                                       ("probe-3", "iterations"), ("efficient", "Efficient-CapsNet")])
def test_5_a_routing_may_not_take_a_name_that_means_something_else(name, said):
    cls = type("Taken", (routing_plugin.Tempered,), {"name": name})
    with pytest.raises(CapsNetError, match=said):
        R.register(cls)
    assert name not in R.names()


# ---- 3, 4, 6, 7, 15, 16, 20, 21, 23: the study's files ------------------------------------------------
@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("study") / "s"
    assert cli.main(["experiment", "routings", *Q, "--seeds", "2", "--out", str(out)]) == 0
    return out


def _copy(study, tmp_path, name="c", edit=None):
    d = tmp_path / name
    shutil.copytree(study, d)
    if edit is not None:
        record = json.loads((d / "units.json").read_text())
        edit(record)
        (d / "units.json").write_text(json.dumps(record))
    return d


def test_every_unit_names_its_trial_and_carries_its_digest(study):
    units = json.loads((study / "units.json").read_text())["units"]
    chosen = json.loads((study / "choices.json").read_text())["choices"]
    for key, unit in units.items():
        assert unit["digest"] == study_units.digest(unit)
        if key.startswith("main"):
            assert unit["trial"] == chosen[key.split(" ")[1]]


def test_3_merge_never_replaces_another_studys_units(study, tmp_path, capsys):
    other = _copy(study, tmp_path, "other", lambda r: r["layout"].update(seeds=3))
    before = (other / "units.json").read_text()
    assert cli.main(["experiment", "routings", "--merge", str(study), "--out", str(other)]) == 2
    _one_line(capsys.readouterr().err, "units of another study")
    assert (other / "units.json").read_text() == before
    assert cli.main(["experiment", "routings", "--merge", str(study), "--out", str(study)]) == 0  # itself, again


def test_4_two_runs_into_one_out_at_once_the_second_is_refused(study, tmp_path, capsys):
    from pycapsnet.training.run_dir import lock, unlock

    out = _copy(study, tmp_path)
    held = lock(str(out))  # a shard running into it
    try:
        done = subprocess.run([sys.executable, "-m", "pycapsnet", "experiment", "routings", *Q, "--seeds", "2",
                               "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=str(ROOT))
        assert done.returncode == 2
        _one_line(done.stderr, "in use by another run")
        assert cli.main(["experiment", "routings", "--merge", str(study), "--out", str(out)]) == 2
    finally:
        unlock(str(out), held)
    assert "in use by another run" in capsys.readouterr().err


def _main(record, key="main uniform seed 0"):
    return record["units"][key]


@pytest.mark.parametrize("edit,said", [
    (lambda r: _main(r).update(test_error=0.01), "digest"),
    (lambda r: (_main(r).update(test_error=0.0, wrong=study_stats.pack(np.ones(20, bool))), _main(r).pop("digest")),
     "not what its own record of wrong digits says"),
    (lambda r: (_main(r).update(trial="lr=1e+09"), _main(r).update(digest=study_units.digest(_main(r)))),
     "ran trial lr=1e+09, not"),
    (lambda r: r.update(flags=[1]), "not the study's settings"),
    (lambda r: r["units"].update({"main uniform seed 0": None}), "not an object"),
    (lambda r: (_main(r).update(test_error="x"), _main(r).pop("digest")), "no test error"),
    (lambda r: (_main(r).pop("wrong"), _main(r).pop("digest")), "no test error"),
    (lambda r: (_main(r).update(wrong="zz"), _main(r).pop("digest")), "not hexadecimal"),
    (lambda r: (_main(r).update(val=[]), _main(r).pop("digest")), "validation accuracies"),
    (lambda r: r["layout"].update(rows=[1]), "rows are not a list"),
    (lambda r: r["layout"].update(seeds="2"), "seeds is not a whole number"),
    (lambda r: r["layout"].update(seeds=10**9), "seeds is not a whole number"),
])
def test_7_15_23_a_merged_units_file_is_checked_unit_by_unit(study, tmp_path, capsys, edit, said):
    d = _copy(study, tmp_path, edit=edit)
    assert cli.main(["experiment", "routings", "--merge", str(d), "--out", str(tmp_path / "o")]) == 2
    _one_line(capsys.readouterr().err, said, str(d / "units.json"))
    assert not (tmp_path / "o" / "results.json").exists()


def test_15_a_units_file_nested_too_deep_is_one_line(study, tmp_path, capsys):
    d = _copy(study, tmp_path)
    (d / "units.json").write_text("[" * 100_000 + "]" * 100_000)
    assert cli.main(["experiment", "routings", "--merge", str(d), "--out", str(tmp_path / "o")]) == 2
    _one_line(capsys.readouterr().err, str(d / "units.json"))


@pytest.mark.parametrize("choice", ["lr=1e+09", "lr=0.003", 5, "lr=0.002,iters=7", None])
def test_6_16_a_choice_is_checked_against_its_tuning_units_before_any_unit(study, tmp_path, capsys, choice):
    d = _copy(study, tmp_path)
    record = json.loads((d / "choices.json").read_text())
    record["choices"]["uniform"] = choice
    forged = d / "choices.json"
    forged.write_text(json.dumps(record))
    out = tmp_path / "run"
    assert cli.main(["experiment", "routings", *Q, "--seeds", "2", "--out", str(out), "--choices", str(forged)]) == 2
    _one_line(capsys.readouterr().err, f"--choices {forged}", "do not follow from its tuning units")
    assert not out.exists()


def test_21_merge_refuses_the_flags_it_would_ignore(study, tmp_path, capsys):
    assert cli.main(["experiment", "routings", "--merge", str(study), "--out", str(tmp_path / "o"),
                     "--epochs", "3"]) == 2
    _one_line(capsys.readouterr().err, "--epochs")


# ---- 8: the study's data --------------------------------------------------------------------------
@pytest.mark.parametrize("case,said", [("test label 11", "y_test holds label 11"),
                                       ("a class with no training image", "class '5' has no training image")])
def test_8_labels_the_network_cannot_score_are_refused(tmp_path, case, said):
    (x, y), (xt, yt) = pycapsnet.load_digits()
    x, y, xt, yt = x[:200], y[:200].copy(), xt[:40], yt[:40].copy()
    if case == "test label 11":
        yt[0] = 11
    else:
        y[y == 5] = 6
        yt[yt == 5] = 6
    with pytest.raises(CapsNetError, match=said):
        experiments.routings(out=str(tmp_path / "s"), data=((x, y), (xt, yt)), quick=True, routings=["uniform"],
                             lr=1e-3, affine=False, progress=False)
    assert not (tmp_path / "s").exists()


# ---- 9, 10, 17: the Python face ---------------------------------------------------------------------
@pytest.mark.parametrize("eps", [1e-46, 1e-300])
def test_9_an_eps_the_weights_dtype_rounds_to_0_is_refused(eps):
    from pycapsnet.optim import Adam

    with pytest.raises(CapsNetError, match="rounds to 0"):
        Adam(pycapsnet.build("capsnet", routing_iters=1), eps=eps)


def test_10_an_inner_held_block_keeps_the_outer_ones_draw():
    torch = pytest.importorskip("torch", reason="the torch wrapper")
    import pycapsnet.torch as pt

    caps = pt.Layer(R.layer("random", children=(6, 4), capsules=3, dim=4, backend="torch", dtype="float64"))
    u = torch.rand(2, 6, 4, dtype=torch.float64)
    with pt.held(caps):
        first = caps(u)
        with pt.held(caps):
            assert torch.equal(caps(u), first)
        assert torch.equal(caps(u), first)  # the outer block holds its draw still
    assert not torch.equal(caps(u), first)


@pytest.mark.parametrize("dtype", ["float64", "float16", "mixed"])
def test_17_load_state_dict_assign_computes_in_the_tensors_dtype_or_refuses(dtype):
    torch = pytest.importorskip("torch", reason="the torch wrapper")
    import pycapsnet.torch as pt

    m = pt.Network(pycapsnet.build("capsnet", backend="torch", routing_iters=1).network)
    x = torch.rand(2, 1, 28, 28)
    state = m.state_dict()
    if dtype == "float64":
        m.load_state_dict({k: v.double() for k, v in state.items()}, assign=True)
        assert m(x.double())[0].dtype == torch.float64
        return
    given = {k: v.half() for k, v in state.items()} if dtype == "float16" else \
        {k: (v.double() if i == 0 else v) for i, (k, v) in enumerate(state.items())}
    with pytest.raises(CapsNetError, match="left as it was"):
        m.load_state_dict(given, assign=True)
    assert m(x)[0].dtype == torch.float32


# ---- 12, 13, 14, 19, 24: a plugin's faults, named --------------------------------------------------
def _faulty(name, **methods):
    cls = type(name.title(), (routing_plugin.Tempered,), {"name": name, **methods})
    return R.register(cls)


def _backward_returning(grads):
    def backward(self, B, u_hat, u, trace, dv, p):
        du_hat, _, du = routing_plugin.Tempered.backward(self, B, u_hat, u, trace, dv, p)
        return du_hat, grads, du
    return backward


@pytest.mark.parametrize("grads", [None, []])
def test_12_a_backward_whose_grads_are_no_dict_is_one_error(grads):
    layer = R.layer(_faulty(f"grads{type(grads).__name__.lower()}", backward=_backward_returning(grads)).name,
                    children=(6, 4), capsules=3, dim=4)
    layer.forward(np.random.default_rng(0).random((2, 6, 4), np.float32))
    with pytest.raises(CapsNetError, match="gradients as a dict"):
        layer.backward(np.ones((2, 3, 4), np.float32))


def test_12_a_backward_whose_du_hat_has_another_shape_is_one_error():
    def backward(self, B, u_hat, u, trace, dv, p):
        du_hat, grads, du = routing_plugin.Tempered.backward(self, B, u_hat, u, trace, dv, p)
        return du_hat[0], grads, du  # (n, J, D): out[...] = would broadcast it

    layer = R.layer(_faulty("dushape", backward=backward).name, children=(6, 4), capsules=3, dim=4)
    layer.forward(np.random.default_rng(0).random((2, 6, 4), np.float32))
    with pytest.raises(CapsNetError, match="dû of û's shape"):
        layer.backward(np.ones((2, 3, 4), np.float32))


@pytest.mark.parametrize("coupling,said", [(lambda self, trace: 3, "coupling\\(\\) must return"),
                                           (lambda self, trace: 1 / 0, "failed in its coupling")])
def test_13_a_coupling_that_fails_is_one_error(coupling, said):
    name = "couplingint" if "must" in said else "couplingraise"
    layer = R.layer(_faulty(name, coupling=coupling).name, children=(6, 4), capsules=3, dim=4)
    layer.forward(np.random.default_rng(0).random((2, 6, 4), np.float32))
    with pytest.raises(CapsNetError, match=said):
        layer.coupling


@pytest.mark.parametrize("kw,said", [(dict(children=(-1, 8)), "children\\[0\\]"), (dict(children=(0, 8)), "children"),
                                     (dict(children="32x8"), "children must be"), (dict(dim=2.5), "dim"),
                                     (dict(iters="3"), "iters"), (dict(iters=0), "iters"), (dict(seed=-1), "seed"),
                                     (dict(init_std=0), "init_std"), (dict(colour=1), "no option"),
                                     (dict(routing_grad="x"), "routing_grad"),
                                     (dict(children=(10**6, 10**4)), "more than half")])
def test_14_routings_layer_checks_its_arguments(kw, said):
    args = {**dict(children=(6, 4), capsules=3, dim=4), **kw}
    with pytest.raises(CapsNetError, match=said):
        R.layer("dynamic", **args)


def test_19_nan_made_by_a_plugin_routing_names_it_and_its_pass(tmp_path):
    class Nanny(routing_plugin.Tempered):
        name = "nanny"

        def check_options(self, options, D):
            return None  # lets temperature 0 through: softmax(b / 0)

    R.register(Nanny)
    d = A.network([A.conv2d(4, 9, name="conv1"), A.relu(name="r"), A.primary_caps(2, 4, kernel=9, stride=2,
                                                                                  name="primary"),
                   A.dynamic_caps(10, 4, routing="nanny", temperature=0.0, name="classcaps")], head="lengths",
                  decoder=None, input_shape=(1, 28, 28), n_classes=10)
    (x, y), _ = pycapsnet.load_digits()
    with pytest.raises(pycapsnet.errors.TrainingDiverged, match="routing 'nanny' made NaN or inf in its forward") as e:
        pycapsnet.build(d).fit(x[:32], y[:32], epochs=1, progress=False)
    assert "lower lr" not in str(e.value) and "check-routing nanny" in str(e.value)


def test_24_a_params_that_cannot_be_allocated_is_one_error():
    def params(self, lead, J, D, K):
        raise MemoryError("Unable to allocate 11.6 TiB")

    with pytest.raises(CapsNetError, match="params\\(\\) ran out of memory"):
        R.layer(_faulty("greedy", params=params).name, children=(6, 4), capsules=3, dim=4)


# ---- 18, 22: what files and third parties say, printed as one line --------------------------------------
def test_18_a_checkpoints_routing_module_with_control_characters_is_refused_escaped(tmp_path, capsys):
    from pycapsnet.training import checkpoint

    with pytest.raises(CapsNetError) as e:
        checkpoint._unregistered({"routings": {"mine": "evil\n\x1b[31mrun --plugin x"}}, "ck.npz")
    assert "\n" not in str(e.value) and "\x1b" not in str(e.value) and "\\x1b" in str(e.value)
    assert "no Python module name" in str(e.value)


@pytest.mark.parametrize("value,said", [("nosuchmod5:X", "did not load"), ("json:dumps", "not a Routing class")])
def test_22_a_broken_or_wrong_entry_point_is_one_line(tmp_path, value, said):
    info = tmp_path / "broken5-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken5\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[pycapsnet.routings]\nbroken5 = {value}\n")
    done = _run("from pycapsnet.core import routings; print(routings.names())", cwd=ROOT, module=False,
                env={"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"})
    assert done.returncode == 0, done.stderr
    _one_line(done.stderr, "warning: the routing plugin broken5", said)
    assert ".py:" not in done.stderr  # no file:line of a raw UserWarning


def test_printable_escapes_what_a_terminal_would_act_on():
    assert pycapsnet.errors.printable("a\nb\x1b[31m\tc é") == "a\\nb\\x1b[31m\\tc é"


def test_the_current_folders_entries_are_those_python_puts_there(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", ["", str(tmp_path), "/elsewhere"])
    assert registry.current_folder_entries() == ["", str(tmp_path)]
    with registry.without_current_folder() as path:
        assert path == ["/elsewhere"] and sys.path == ["/elsewhere"]
    assert sys.path == ["", str(tmp_path), "/elsewhere"]


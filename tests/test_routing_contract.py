"""A routing of one's own (issue 96): the public contract, registration, and a routing defined outside
the package (tests/routing_plugin.py, "tempered") going everywhere a built-in one goes; a wrong
backward caught by each check; bad plugins and bad registrations in one line."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pycapsnet
import pycapsnet.routings as R
import pycapsnet.study as study
from pycapsnet import CapsNetError
from pycapsnet.core import architecture as A
from pycapsnet.tools import cli
from tests import routing_plugin  # noqa: F401  (registers "tempered" and its two wrong twins)

torch = pytest.importorskip("torch", reason="autograd is the reference, and the torch backend the second one")

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = str(ROOT / "tests" / "routing_plugin.py")
TINY = dict(conv_channels=8, primary_types=2, decoder_hidden=(16, 32))
TINY_FLAGS = ["--conv-channels", "8", "--primary-types", "2", "--decoder-hidden", "16", "32", "--limit", "48",
              "--limit-test", "16", "--batch-size", "16", "--no-progress"]


@pytest.fixture(scope="module")
def digits():
    (x, y), (xt, yt) = pycapsnet.load_digits()
    return x[:48], y[:48], xt[:16], yt[:16]


# ---- 1: the contract and registration -------------------------------------------------------------
def test_the_built_in_routings_are_registered_through_the_same_door():
    assert R.names()[:7] == ("dynamic", "attention", "uniform", "random", "inverted", "self", "vb")
    assert all(R.is_builtin(n) for n in R.names()[:7]) and not R.is_builtin("tempered")
    assert R.module_of("tempered") == "tests.routing_plugin"


def _routing(**attrs):
    methods = dict(forward=lambda self, B, u_hat, p, u, fixed=None: None,
                   backward=lambda self, B, u_hat, u, trace, dv, p: None, coupling=lambda self, trace: [])
    return type("Mine", (R.Routing,), {"name": "mine", **methods, **attrs})


@pytest.mark.parametrize("cls,said", [
    (object, "a subclass of pycapsnet.routings.Routing"),
    (_routing(name="Bad Name"), "its name must be lower-case"),
    (_routing(name="tempered"), "the name is taken by tests.routing_plugin.Tempered"),
    (_routing(coupling=R.Routing.coupling), "it must define coupling()"),
    (_routing(modes=("final",)), "modes must be a tuple holding 'full'"),
    (_routing(options={"temperature": [1, 2]}), "option temperature's default must be"),
    (_routing(options={"iters": 2}), "option 'iters' must be a Python name that is not a layer's own option"),
    (_routing(iterated="yes"), "iterated must be True or False"),
])
def test_a_bad_registration_is_one_line(cls, said):
    with pytest.raises(CapsNetError, match=said) as e:
        R.register(cls)
    assert "\n" not in str(e.value)


def test_the_same_class_defined_again_replaces_itself_as_a_notebook_cell_run_twice_does():
    first = R.register(_routing(name="again"))
    second = R.register(_routing(name="again"))
    assert R.get("again") is second is not first


# ---- 2: everywhere a built-in routing works --------------------------------------------------------
def test_descriptions_take_it_and_check_its_options():
    body = [A.conv2d(4, 3), A.relu(), A.primary_caps(2, 4, 3, 2)]
    ok = A.network(body + [A.conv_caps(3, 4, routing="tempered", temperature=0.5, name="conv"),
                           A.dynamic_caps(3, 6, routing="tempered", weigh_by_length=False, name="classcaps")],
                   input_shape=(1, 13, 13), n_classes=3)
    net = A.build(ok, "numpy")
    assert net.body["conv"].algo.options == {"temperature": 0.5, "weigh_by_length": True}
    assert net.body["conv"].params["gate"].shape == (3 * 3 * 2, 3)   # per child slot of a 3x3 window of 2 types
    assert net.body["classcaps"].params["gate"].shape == (9, 3, 3)    # per position and type of a 3x3 grid
    for option, said in ((dict(temperature="hot"), "temperature must be a finite number"),
                         (dict(temperature=-1.0), "temperature must be above 0"),
                         (dict(scaled=True), "scaled is an option of routing 'inverted', not of 'tempered'"),
                         (dict(weigh_by_length=1), "weigh_by_length must be true or false")):
        bad = A.network(body + [A.dynamic_caps(3, 6, routing="tempered", name="classcaps", **option)],
                        input_shape=(1, 13, 13), n_classes=3)
        with pytest.raises(CapsNetError, match=said) as e:
            A.build(bad, "numpy")
        assert "classcaps" in str(e.value)


def test_build_fit_evaluate_predict_save_and_the_study_tools(digits, tmp_path):
    x, y, xt, yt = digits
    model = pycapsnet.build("tempered", routing_iters=2, seed=1, **TINY)
    assert model.network.classcaps.algo.name == "tempered" and model.network.classcaps.iters == 2
    model.fit(x, y, epochs=1, batch_size=16, progress=False)
    assert 0 <= model.evaluate(xt, yt)["accuracy"] <= 1 and model.predict(xt).shape == (16,)
    path = model.save(str(tmp_path / "mine.npz"))
    header = json.loads(str(np.load(path)["header"]))
    assert header["routings"] == {"tempered": "tests.routing_plugin"}
    assert study.gradcheck(model, samples=3).passed
    assert study.crosscheck(model, "numpy", "torch", batch=2).passed
    c, dc = study.coupling(model, xt[:4], yt[:4], grad=True)
    assert [a.shape for a in c["classcaps"]] == [(4, 72, 10)] * 2
    assert [None if g is None else g.shape for g in dc["classcaps"]] == [(4, 72, 10)] * 2
    assert study.inspect(model, xt, yt, out=str(tmp_path / "inspect"))


def test_the_torch_wrapper_runs_it_with_its_own_backward():
    import pycapsnet.torch as pct

    net = pct.Network(pycapsnet.build("tempered", backend="torch", dtype="float64", seed=2, **TINY))
    x = torch.rand(3, 1, 28, 28, dtype=torch.float64)
    net.loss(x, torch.tensor([1, 2, 3])).backward()
    assert all(p.grad is not None for p in net.parameters())


def test_dl_dc_is_the_gradient_that_flows_into_each_iterations_coefficients(digits):
    """dL/dc of dynamic routing: None at its first iteration (c = 1/J is a constant there), and at
    the last the gradient holding everything before it: Σ_d û_j|i ds_j, by hand."""
    x, y, _, _ = digits
    model = pycapsnet.build("capsnet", dtype="float64", seed=3, routing_iters=2, **TINY)
    c, dc = study.coupling(model, x[:3], y[:3], grad=True)
    assert dc["classcaps"][0] is None and dc["classcaps"][1].shape == c["classcaps"][1].shape
    net = model.network
    layer = net.classcaps
    seen = {}
    real = type(layer).backward

    def spy(dv, input_grad=True):
        seen["u_hat"] = np.array(layer.cache[1])
        seen["dv"] = np.array(dv)
        return real(layer, dv, input_grad)

    layer.backward = spy
    with net.evaluating():
        net.zero_grad()
        net.loss(x[:3], y[:3])
        net.backward()
    del layer.backward
    from pycapsnet.core.squash import squash_backward

    (cr, s, s_norm, v) = layer.trace[0][1][-1]
    ds = squash_backward(np, s, s_norm, seen["dv"])
    by_hand = 3 * np.einsum("injd,njd->nij", seen["u_hat"], ds)  # each image's own loss: n times the mean's
    np.testing.assert_allclose(dc["classcaps"][1], by_hand, rtol=1e-9, atol=1e-12)


# ---- 3: each check catches a wrong backward ----------------------------------------------------------
def test_the_right_backward_passes_every_check():
    report = R.check("tempered", samples=6)
    assert report.passed and {r["check"] for r in report} == {"finite differences", "numpy vs torch", "autograd"}


@pytest.mark.parametrize("name,caught_by", [("tempered-wrong", ("finite differences", "autograd")),
                                            ("tempered-torch-bug", ("numpy vs torch",))])
def test_a_wrong_backward_is_caught(name, caught_by):
    """The wrong backward (the feedback through earlier iterations dropped) fails finite differences
    and autograd; the one that differs on PyTorch fails numpy vs torch (a backward wrong the same
    way on every backend agrees with itself there: that check is for backend-specific faults)."""
    report = R.check(name, samples=6)
    failed = {r["check"] for r in report if not r["agree"]}
    assert set(caught_by) <= failed and not report.passed


# ---- the command line, a new process, entry points -----------------------------------------------------
def _run(*args, env=None, cwd=None):
    return subprocess.run([sys.executable, "-m", "pycapsnet", *args], capture_output=True, text=True, timeout=600,
                          cwd=cwd or str(ROOT), env={**os.environ, **(env or {})})


def test_train_with_a_plugin_and_reload_in_a_new_process_bit_identically(tmp_path):
    run = tmp_path / "run"
    done = _run("train", "--plugin", PLUGIN, "--routing", "tempered", *TINY_FLAGS, "--epochs", "1", "--out", str(run))
    assert done.returncode == 0, done.stderr
    scores = ("import numpy as np, pycapsnet; (x, _), _ = pycapsnet.load_digits(); "
              f"np.save({str(tmp_path / 'p.npy')!r}, pycapsnet.load({str(run)!r}).predict_scores(x[:20]))")
    again = subprocess.run([sys.executable, "-c", f"import importlib.util as u, sys; s = u.spec_from_file_location("
                            f"'routing_plugin', {PLUGIN!r}); m = u.module_from_spec(s); sys.modules['routing_plugin'] = m;"
                            f" s.loader.exec_module(m); {scores}"], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    first = np.load(tmp_path / "p.npy")
    again = subprocess.run([sys.executable, "-c", f"import routing_plugin; {scores}"], capture_output=True, text=True,
                           timeout=300, cwd=str(ROOT / "tests"))
    assert again.returncode == 0, again.stderr
    np.testing.assert_array_equal(np.load(tmp_path / "p.npy"), first)
    refused = _run("evaluate", str(run))
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert "routing 'tempered' of module routing_plugin, which is not registered here: no module routing_plugin is " \
           "installed here" in refused.stderr and "--plugin PATH/routing_plugin.py" in refused.stderr
    assert _run("evaluate", str(run), "--plugin", PLUGIN).returncode == 0


def test_check_routing_on_the_command_line(tmp_path):
    assert cli.main(["check-routing", "tempered", "--plugin", "tests.routing_plugin", "--samples", "4"]) == 0
    assert cli.main(["check-routing", "tempered-wrong", "--plugin", "tests.routing_plugin", "--samples", "4"]) == 1


@pytest.mark.parametrize("plugin,said", [("no_such_module_here", "--plugin no_such_module_here: it did not import "
                                                                 "(ModuleNotFoundError"),
                                         ("missing.py", "--plugin missing.py: no such file")])
def test_a_plugin_that_does_not_import_is_one_line_and_exit_2(tmp_path, plugin, said):
    done = _run("train", "--plugin", plugin, "--routing", "tempered", "--out", str(tmp_path / "run"), cwd=str(tmp_path))
    assert done.returncode == 2 and said in done.stderr and done.stderr.count("\n") == 1
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("forward,said", [
    ("return u_hat, []", "routing 'faulty': forward must return (v, trace) with v of shape (n, J, D)"),
    ("return 1 / 0", "routing 'faulty' failed in its forward (ZeroDivisionError: division by zero); check it with "
                     "`pycapsnet check-routing faulty`")])
def test_a_routing_whose_forward_fails_is_named_in_one_line_and_nothing_is_written(tmp_path, forward, said):
    plugin = tmp_path / "faulty_routing.py"
    plugin.write_text("import pycapsnet.routings as R\n"
                      "@R.register\nclass Faulty(R.Routing):\n    name = 'faulty'\n"
                      f"    def forward(self, B, u_hat, p, u, fixed=None):\n        {forward}\n"
                      "    def backward(self, B, u_hat, u, trace, dv, p):\n        raise ZeroDivisionError('oops')\n"
                      "    def coupling(self, trace):\n        return []\n")
    done = _run("train", "--plugin", str(plugin), "--routing", "faulty", *TINY_FLAGS, "--out", str(tmp_path / "run"))
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and said in done.stderr, done.stderr
    assert not (tmp_path / "run" / "checkpoint.npz").exists()


def test_the_routing_study_runs_a_plugin_routing_from_the_command_line(tmp_path):
    done = _run("experiment", "routings", "--plugin", PLUGIN, "--routings", "tempered", "uniform", "--quick", "--lr",
                "0.002", "--no-affine", "--limit", "60", "--limit-test", "20", "--seeds", "1", "--out", str(tmp_path / "s"))
    assert done.returncode == 0, done.stderr
    results = json.loads((tmp_path / "s" / "results.json").read_text())
    assert set(results[results["dataset"]]) == {"tempered", "uniform"} and results["complete"]


def test_installed_packages_register_through_the_entry_point_group(tmp_path):
    (tmp_path / "shipped_routing.py").write_text(Path(PLUGIN).read_text().replace('"tempered"', '"shipped"')
                                                 .replace("tempered-wrong", "shipped-wrong")
                                                 .replace("tempered-torch-bug", "shipped-torch-bug"))
    info = tmp_path / "shipped_routing-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: shipped-routing\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[pycapsnet.routings]\nshipped = shipped_routing:Tempered\n")
    done = subprocess.run([sys.executable, "-c", "from pycapsnet.core import routings; print(routings.names())"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 0 and "'shipped'" in done.stdout, done.stderr

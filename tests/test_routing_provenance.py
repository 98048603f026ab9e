"""Your own routing, reproducible (issue 105): results bound to the routing code that made them, one
rule for a name registered twice, and the contract's dtypes checked on every call."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pycapsnet.routings as R
from pycapsnet import CapsNetError
from pycapsnet.core import routing_source
from tests import routing_plugin

ROOT = Path(__file__).resolve().parent.parent
SOURCE = Path(routing_plugin.__file__).read_text().replace('"tempered"', '"provtest"').replace(
    "tempered-wrong", "provtest-wrong").replace("tempered-torch-bug", "provtest-torch-bug")
TINY = ["--conv-channels", "8", "--primary-types", "2", "--decoder-hidden", "16", "32", "--limit", "48",
        "--limit-test", "16", "--batch-size", "16", "--no-progress", "--epochs", "1"]


def _run(*args, cwd=ROOT, env=None):
    return subprocess.run([sys.executable, "-m", "pycapsnet", *args], capture_output=True, text=True, timeout=600,
                          cwd=str(cwd), env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def test_a_checkpoint_records_its_routings_source_and_a_changed_one_is_said_or_refused(tmp_path):
    plugin = tmp_path / "provplug.py"
    plugin.write_text(SOURCE)
    run = tmp_path / "run"
    done = _run("train", "--plugin", str(plugin), "--routing", "provtest", *TINY, "--out", str(run))
    assert done.returncode == 0, done.stderr
    import zipfile
    with zipfile.ZipFile(run / "checkpoint.npz") as z, z.open("header.npy") as f:
        header = json.loads(str(np.lib.format.read_array(f)))
    recorded = header["routing_sources"]["provtest"]
    assert recorded["module"] == "provplug" and recorded["class"] == "Tempered" and len(recorded["digest"]) == 16
    same = _run("evaluate", str(run), "--plugin", str(plugin))
    assert same.returncode == 0 and "warning" not in same.stderr, same.stderr
    plugin.write_text(SOURCE.replace("b = b + ", "b = b + 1.0 * "))  # the update rule changed
    warned = _run("evaluate", str(run), "--plugin", str(plugin))
    assert warned.returncode == 0
    line = [x for x in warned.stderr.splitlines() if x.startswith("warning")]
    assert len(line) == 1 and recorded["digest"] in line[0] and "--strict refuses it" in line[0]
    strict = _run("evaluate", str(run), "--plugin", str(plugin), "--strict")
    assert strict.returncode == 2 and strict.stderr.count("\n") == 1 and recorded["digest"] in strict.stderr


def test_a_merge_refuses_units_of_another_version_of_a_routing(tmp_path):
    plugin = tmp_path / "provplug.py"
    study = ["experiment", "routings", "--quick", "--no-affine", "--routings", "uniform", "provtest", "--limit", "60",
             "--limit-test", "20", "--seeds", "1", "--lr", "0.002"]
    plugin.write_text(SOURCE)
    assert _run(*study, "--plugin", str(plugin), "--shard", "1/2", "--out", str(tmp_path / "s1")).returncode == 0
    plugin.write_text(SOURCE.replace("b = b + ", "b = b + 1.0 * "))
    assert _run(*study, "--plugin", str(plugin), "--shard", "2/2", "--out", str(tmp_path / "s2")).returncode == 0
    merged = _run("experiment", "routings", "--plugin", str(plugin), "--merge", str(tmp_path / "s1"),
                  str(tmp_path / "s2"), "--out", str(tmp_path / "m"))
    assert merged.returncode == 2 and "other routings" in merged.stderr, merged.stderr
    units = json.loads((tmp_path / "s1" / "units.json").read_text())
    assert units["flags"]["routings"]["provtest"]["module"] == "provplug"


def test_an_explicit_import_replaces_an_installed_packages_class_and_the_reverse_keeps_it(tmp_path):
    (tmp_path / "shipped5.py").write_text(SOURCE.replace('"provtest"', '"shipped5"'))
    (tmp_path / "mine5.py").write_text(SOURCE.replace('"provtest"', '"shipped5"'))
    info = tmp_path / "shipped5-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: shipped5\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[pycapsnet.routings]\nshipped5 = shipped5:Tempered\n")
    env = {"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
    after = subprocess.run([sys.executable, "-c", "from pycapsnet.core import routings as r; r.names(); import mine5; "
                            "print(r.get('shipped5').__module__)"], capture_output=True, text=True, cwd=str(ROOT),
                           env={**os.environ, **env}, timeout=120)
    assert after.returncode == 0 and after.stdout.strip() == "mine5", after.stderr
    lines = after.stderr.splitlines()  # (the module registers its two wrong twins too: a line each)
    assert all(x.startswith("warning: ") for x in lines) and "replaces shipped5.Tempered," in lines[0]
    before = subprocess.run([sys.executable, "-c", "import mine5; from pycapsnet.core import routings as r; r.names(); "
                             "print(r.get('shipped5').__module__)"], capture_output=True, text=True, cwd=str(ROOT),
                            env={**os.environ, **env}, timeout=120)
    assert before.returncode == 0 and before.stdout.strip() == "mine5", before.stderr
    lines = before.stderr.splitlines()
    assert all(x.startswith("warning: ") for x in lines) and "registered explicitly" in lines[0]


def test_a_built_in_name_from_an_entry_point_is_refused_loudly(tmp_path):
    (tmp_path / "dyn5.py").write_text(SOURCE.replace('@R.register\n', '').replace('"provtest"', '"dynamic"'))
    info = tmp_path / "dyn5-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dyn5\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[pycapsnet.routings]\ndyn5 = dyn5:Tempered\n")
    done = subprocess.run([sys.executable, "-c", "from pycapsnet.core import routings as r; "
                           "print(r.get('dynamic').__module__)"], capture_output=True, text=True, cwd=str(ROOT),
                          env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}, timeout=120)
    assert done.stdout.strip() == "pycapsnet.core.routing" and "takes the built-in name 'dynamic'" in done.stderr


def test_the_source_of_a_class_without_a_module_file_is_its_own():
    namespace = {}
    exec("import pycapsnet.routings as R\nclass Nofile(R.Routing):\n    name = 'nofile'\n"
         "    def forward(self, B, u_hat, p, u, fixed=None): return 1\n", namespace)
    cls = namespace["Nofile"]
    assert len(routing_source.digest_of(cls)) == 16 and routing_source.distribution_of("no_such_module_5") is None


def _dtype_wrong(method):
    def backward(self, B, u_hat, u, trace, dv, p):
        du_hat, grads, du = routing_plugin.Tempered.backward(self, B, u_hat, u, trace, dv, p)
        if method == "grads":
            grads = {k: g.astype(np.float64) for k, g in grads.items()}
        return (du_hat.astype(np.float64) if method == "du_hat" else du_hat), grads, du
    return backward


@pytest.mark.parametrize("method,said", [("du_hat", "dû of û's shape"), ("grads", "another shape or dtype")])
def test_a_backward_of_another_dtype_is_refused(method, said):
    cls = R.register(type(f"Wide{method}", (routing_plugin.Tempered,), {"name": f"wide-{method.replace('_', '')}",
                                                                         "backward": _dtype_wrong(method)}))
    layer = R.layer(cls.name, children=(6, 4), capsules=3, dim=4)
    layer.forward(np.random.default_rng(0).random((2, 6, 4), np.float32))
    with pytest.raises(CapsNetError, match=said):
        layer.backward(np.ones((2, 3, 4), np.float32))


# ---- 4: a routing's own measures -------------------------------------------------------------------
def _few(x, y, xt, yt):
    """Six training and two test digits of each class."""
    pick = lambda labels, k: np.concatenate([np.flatnonzero(labels == c)[:k] for c in range(10)])  # noqa: E731
    a, b = pick(y, 6), pick(yt, 2)
    return (x[a], y[a]), (xt[b], yt[b])


class Peaked(routing_plugin.Tempered):
    name = "peaked"

    def measures(self, B, trace):
        return {"peak": [float(B.xp.mean(B.xp.max(c, axis=1))) for c, *_ in trace]}


def test_a_routings_own_measures_reach_the_study_tools_inspect_and_the_routing_study(tmp_path):
    import pycapsnet
    import pycapsnet.experiments as experiments
    import pycapsnet.study as study

    R.register(Peaked)
    (x, y), (xt, yt) = pycapsnet.load_digits()
    model = pycapsnet.build("peaked", conv_channels=8, primary_types=2, decoder_hidden=(16, 32))
    own = study.measures(model, x[:6])
    (layer, found), = own.items()
    assert list(found) == ["peak"] and len(found["peak"]) == 3 and all(0.1 <= p <= 1 for p in found["peak"])
    results = experiments.routings(out=str(tmp_path / "s"), quick=True, affine=False, routings=["uniform", "peaked"],
                                   data=_few(x, y, xt, yt), lr=2e-3, seeds=1, progress=False)
    assert results["arrays"]["peaked"]["measures"]["own"]["peak"] == pytest.approx(
        json.loads((tmp_path / "s" / "units.json").read_text())["units"]["main peaked seed 0"]["measures"]["own"]["peak"])
    assert "peak: " in (tmp_path / "s" / "results.md").read_text()


def test_measures_of_the_wrong_form_are_one_line():
    class Bad(routing_plugin.Tempered):
        name = "badmeasures"

        def measures(self, B, trace):
            return {"peak": "high"}

    R.register(Bad)
    layer = R.layer("badmeasures", children=(6, 4), capsules=3, dim=4)
    layer.forward(np.random.default_rng(0).random((2, 6, 4), np.float32))
    with pytest.raises(CapsNetError, match="measures\\(\\) must return"):
        layer.routing_measures()


# ---- 5, 6: the discovery's failures said; the words a user reads --------------------------------------
def test_the_protocol_line_with_one_lr_says_only_what_ran(tmp_path):
    import pycapsnet
    import pycapsnet.experiments as experiments

    (x, y), (xt, yt) = pycapsnet.load_digits()
    results = experiments.routings(out=str(tmp_path / "s"), quick=True, affine=False, routings=["uniform"],
                                   data=_few(x, y, xt, yt), lr=2e-3, seeds=1, progress=False)
    summary = results["protocol"]["summary"]
    assert "one lr for every row, 0.002, given (no tuning)" in summary
    assert "tuning seed" not in summary and "chosen" not in summary


def test_check_routing_says_which_points_each_finite_difference_row_covered():
    rows = [r for r in R.check("dynamic", samples=3) if r["check"] == "finite differences"]
    assert rows and all("entries" in r["points"] and "rounding" in r["points"] for r in rows)
    assert any(r["max_rel"] > 0 for r in rows)  # the relative error itself, not what exceeds the tolerance


def test_a_plugins_uninstalled_package_is_said_to_be_missing(tmp_path):
    from pycapsnet.training import checkpoint

    with pytest.raises(CapsNetError, match="no module gone_pkg5 is installed here"):
        checkpoint._unregistered({"routings": {"gone5": "gone_pkg5.routing"}}, "ck.npz")

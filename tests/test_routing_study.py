"""The routing study as an instrument (issue 97): the protocol keeps the test set out of every choice,
the statistics give the textbook values, shards merge into the unsharded table, mixed settings are
refused, your own data and routings run."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

import pycapsnet
from pycapsnet import CapsNetError, experiments
from pycapsnet.experiments import study_diagnostics, study_networks, study_protocol, study_report
from pycapsnet.experiments import study_stats as st
from pycapsnet.experiments import study_tuning as tuning

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--quick", "--no-affine", "--routings", "uniform", "dynamic", "--limit", "100", "--limit-test", "40"]


def _study(out, *flags):
    return subprocess.run([sys.executable, "-m", "pycapsnet", "experiment", "routings", *flags, "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=str(ROOT))


# ---- the statistics: textbook values ---------------------------------------------------------------
def test_mcnemar_exact_is_the_binomial_tail():
    assert st.mcnemar(10, 2) == pytest.approx(2 * stats.binom.cdf(2, 12, 0.5)) == pytest.approx(0.03857421875)
    assert st.mcnemar(0, 0) == 1.0 and st.mcnemar(5, 5) == 1.0 and st.mcnemar(0, 6) == pytest.approx(0.03125)


def test_paired_t_is_scipys_and_its_interval_covers_the_mean():
    a, b = [1.2, 1.0, 1.4, 1.1, 1.3], [1.0, 0.9, 1.0, 1.0, 1.1]
    d = st.paired(a, b)
    assert d["p"] == pytest.approx(stats.ttest_rel(a, b).pvalue) and d["n"] == 5
    half = stats.t.ppf(0.975, 4) * np.std(np.subtract(a, b), ddof=1) / np.sqrt(5)
    assert d["ci95"] == pytest.approx([d["mean"] - half, d["mean"] + half])


def test_holm_and_wilson():
    assert st.holm([0.01, 0.04, 0.03, None]) == pytest.approx([0.03, 0.06, 0.06, None])
    lo, hi = st.wilson(0, 10)
    assert lo == 0 and hi == pytest.approx(0.2775, abs=1e-4)
    lo, hi = st.wilson(50, 100)
    assert (lo, hi) == pytest.approx((0.4038, 0.5962), abs=1e-4)


def test_two_rows_with_known_per_digit_outcomes_give_the_textbook_p_values():
    """Rows A and B on 40 digits, 3 seeds: A wrong on digits 0-11, B on 0-1 and 30 (every seed), so
    per seed b = 10, c = 1: McNemar p = 2 P(Binom(11, 1/2) <= 1), described per seed."""
    n = 40
    wrong_a, wrong_b = np.zeros(n, bool), np.zeros(n, bool)
    wrong_a[:12], wrong_b[[0, 1, 30]] = True, True
    unit = lambda w, e: {"test_error": e, "wrong": st.pack(w), "params": 1, "step": 0.01,  # noqa: E731
                         "measures": {"entropy": [1.0], "dynamics": [0.0], "starved_children": 0.0,
                                      "starved_parents": 0.0}}
    done = {"B": [unit(wrong_b, 7.5)] * 3, "A": [unit(wrong_a, 30.0), unit(wrong_a, 31.0), unit(wrong_a, 29.0)]}
    rows = study_report.main_rows(done, "B", n, margin=1.0, resamples=2000)
    assert rows["A"]["mcnemar_per_seed"] == [{"b": 10, "c": 1, "p": pytest.approx(2 * stats.binom.cdf(1, 11, 0.5))}] * 3
    assert rows["A"]["vs_baseline"]["t"]["p"] == pytest.approx(stats.ttest_rel([30, 31, 29], [7.5] * 3).pvalue)
    assert rows["A"]["t_holm"] == rows["A"]["vs_baseline"]["t"]["p"]  # one comparison: Holm changes nothing
    assert rows["A"]["vs_baseline"]["mean"] == pytest.approx(22.5)  # from the digits' own record: (12 - 3) / 40
    assert rows["A"]["word"] == "worse" and rows["A"]["tost"]["margin"] == 1.0
    assert rows["A"]["wilson95"][0] == pytest.approx([100 * b for b in st.wilson(12, 40)])


def test_the_bootstrap_is_reproducible_by_seed_and_holds_both_sources_of_variation():
    rng = np.random.default_rng(1)
    wa, wb = rng.random((6, 500)) < 0.3, rng.random((6, 500)) < 0.2
    one, again, other = st.bootstrap(wa, wb, 4000, 7), st.bootstrap(wa, wb, 4000, 7), st.bootstrap(wa, wb, 4000, 8)
    assert one == again and one["ci95"] != other["ci95"] and one["resamples"] == 4000
    assert one["mean"] == pytest.approx(100 * (wa.mean() - wb.mean()))
    assert one["ci95"][0] < one["mean"] < one["ci95"][1] and one["p"] < 0.05
    same_seeds = np.repeat(wa[:1], 6, axis=0), np.repeat(wb[:1], 6, axis=0)  # no training variation: images alone
    images = st.bootstrap(*same_seeds, 4000, 7)
    seeds = st.bootstrap(np.tile(wa[:, :1], (1, 500)), np.tile(wb[:, :1], (1, 500)), 4000, 7)  # seeds alone
    assert images["ci95"][1] - images["ci95"][0] > 0 and seeds["ci95"][1] - seeds["ci95"][0] > 0


def test_tost_and_the_planner_agree_with_statsmodels():
    weightstats = pytest.importorskip("statsmodels.stats.weightstats", reason="statsmodels is the oracle")
    power = pytest.importorskip("statsmodels.stats.power", reason="statsmodels is the oracle")
    rng = np.random.default_rng(3)
    for margin in (0.05, 0.1, 0.3):
        a = rng.normal(1.2, 0.2, 15)
        b = a + rng.normal(0.02, 0.19, 15)
        assert st.tost(a, b, margin)["p"] == pytest.approx(weightstats.ttost_paired(a, b, -margin, margin)[0], rel=1e-9)
    for sd, effect, want in ((0.19, 0.1, 0.8), (0.19, 0.1, 0.9), (1.0, 0.5, 0.8), (0.3, 0.25, 0.9)):
        n = power.TTestPower().solve_power(effect_size=effect / sd, alpha=0.05, power=want)
        assert st.seeds_for(sd, effect, want) == int(np.ceil(n))
    assert st.detectable(0.19, 15) == pytest.approx(
        0.19 * power.TTestPower().solve_power(effect_size=None, nobs=15, alpha=0.05, power=0.8), rel=1e-6)
    assert st.seeds_for(0.19, 0.1) == 31 and st.seeds_for(0.19, 0.1, 0.9) == 40  # the review's ~30 and ~39


def test_the_four_words():
    assert st.word(-0.3, 0.01, 0.5, 0.1) == "better" and st.word(0.3, 0.01, None, None) == "worse"
    assert st.word(0.02, 0.6, 0.01, 0.1) == "equivalent" and st.word(0.02, 0.6, 0.2, 0.1) == "inconclusive"
    assert st.word(0.0, 0.9, 0.0, None) == "inconclusive"  # no margin declared: never equivalent


def test_diagnostics_on_known_coefficients():
    uniform = np.full((4, 3, 5), 0.2)
    assert study_diagnostics.entropy(uniform) == pytest.approx(1.0) and study_diagnostics.dynamics(uniform) == 0
    one_hot = np.zeros((2, 3, 5))
    one_hot[0, :, 0] = one_hot[1, :, 1] = 1  # two inputs, each child all to one parent, a different one
    assert study_diagnostics.entropy(one_hot) == pytest.approx(0, abs=1e-12)
    assert study_diagnostics.dynamics(one_hot) == pytest.approx(0.5)


@pytest.mark.parametrize("row, has_parents", [("dynamic", True), ("self", False), ("inverted", False)])
def test_starved_parents_only_where_class_scores_are_capsules_own(row, has_parents):
    """Lengths (margin loss) have a threshold of activity; self routing's scores, a distribution over the
    classes under its NLL, and inverted's logits have none: their starved-parents share is not given."""
    from pycapsnet import backends
    from pycapsnet.core import architecture as A

    d = study_networks.network(row, (1, 28, 28), study_networks.QUICK_BACKBONE)
    model = A.build(d, backends.get("numpy", dtype="float64"), seed=0)
    x = np.random.default_rng(0).random((6, 1, 28, 28))
    m = study_diagnostics.TestPass(model).run(x, np.arange(6) % 10, batch=3).measures()
    assert (m["starved_parents"] is not None) == has_parents
    assert 0.0 <= m["starved_children"] <= 1.0


# ---- the protocol ----------------------------------------------------------------------------------
def test_the_test_set_is_sealed_until_every_rows_choice_is_fixed():
    sealed = study_protocol.SealedTest(object())
    with pytest.raises(CapsNetError, match="reads its test set only after every choice is fixed"):
        sealed.open()
    for partial in ({}, {"uniform": "lr=0.002"}, {"uniform": "lr=0.002", "dynamic": 5}):
        with pytest.raises(CapsNetError, match="every row's choice"):
            sealed.fix(partial, ["uniform", "dynamic"])
        with pytest.raises(CapsNetError):
            sealed.open()
    with pytest.raises(CapsNetError, match="no row"):
        sealed.fix({}, [])
    sealed.fix({"uniform": "lr=0.002", "dynamic": "lr=0.001"}, ["uniform", "dynamic"])
    assert sealed.open() is not None


def test_the_choice_rule_breaks_ties_by_the_worst_seed_then_a_fixed_order_not_the_listing():
    assert tuning.choose({"lr=0.001": [0.9, 0.9], "lr=0.002": [0.95, 0.93], "lr=0.004": [0.94, 0.94]}) == \
        ("lr=0.004", pytest.approx(0.94))  # equal means: the higher worst seed
    tie = {"lr=0.001,vb_lambda=0.1": [0.9], "lr=0.001,vb_lambda=1": [0.9]}
    flipped = dict(reversed(list(tie.items())))
    assert tuning.choose(tie) == tuning.choose(flipped)  # the listing order does not decide
    assert {t.get("vb_lambda") for t in tuning.trials("vb")} == {0.1, 1.0}
    assert len(tuning.trials("vb")) == 2 * len(tuning.trials("dynamic")) == 2 * len(tuning.LR_GRID)


def _known(row, accuracy_of_lr, seeds=tuning.TUNE_SEEDS):
    """Tuning units of ``row`` whose validation accuracy is a function of the rate."""
    return {f"tune {row} lr={lr:g} seed {s}": {"val": [accuracy_of_lr(lr)]}
            for lr in (tuning.LR_LIMITS[0] * 2 ** k for k in range(8)) for s in seeds}


@pytest.mark.parametrize("best,chosen,extended,capped", [
    (1e-3, "lr=0.001", [], None),                              # interior: the grid as it is
    (8e-3, "lr=0.008", [0.008, 0.016], None),                  # the top: x2 until the choice is interior
    (1, "lr=0.016", [0.008, 0.016], "highest"),                # rising to the limit: capped, and said
    (2.5e-4, "lr=0.00025", [0.000125, 0.00025], None)])        # the bottom: /2
def test_a_choice_at_the_grids_edge_extends_the_grid(best, chosen, extended, capped):
    known = _known("uniform", lambda lr: 1 - abs(np.log(lr / best)) / 100)
    keys, results = tuning.plan(["uniform"], lambda row: row, known)
    r = results["uniform"]
    assert (r["chosen"], r["extended"], r["capped"]) == (chosen, extended, capped)
    assert r["lead"]["se"] == 0 and r["lead"]["mean"] > 0 and len(r["trials"]) == 4 + len(extended)
    if 0.016 in extended:  # without the last round's units, the row waits for them, and the plan lists them
        keys, results = tuning.plan(["uniform"], lambda row: row, {k: v for k, v in known.items() if "0.016" not in k})
        assert results["uniform"] is None and sum("lr=0.016" in k for k in keys) == len(tuning.TUNE_SEEDS)


def test_a_shard_reads_no_test_digit_before_every_rows_tuning_is_done(tmp_path):
    done = _study(tmp_path / "s1", *SMALL, "--shard", "1/2")
    assert done.returncode == 0, done.stderr
    units = json.loads((tmp_path / "s1" / "units.json").read_text())["units"]
    assert units and all(k.startswith("tune ") for k in units) and not (tmp_path / "s1" / "choices.json").exists()
    assert all("test_error" not in u and "wrong" not in u for u in units.values())
    assert "merge the shards' folders" in done.stderr + done.stdout


def _sharded(tmp_path, *flags, shards=2, rounds=5):
    """The shards' loop: run each, merge, run each again with the merged choices.json, until the
    merged table is complete (the tuning's rounds, then the main units)."""
    for _ in range(rounds):
        choices = tmp_path / "m" / "choices.json"
        for k in range(1, shards + 1):
            done = _study(tmp_path / f"s{k}", *flags, "--shard", f"{k}/{shards}",
                          *(["--choices", str(choices)] if choices.exists() else []))
            assert done.returncode == 0, done.stderr
        merge = _study(tmp_path / "m", "--merge", *(str(tmp_path / f"s{k}") for k in range(1, shards + 1)))
        assert merge.returncode == 0, merge.stderr
        results = json.loads((tmp_path / "m" / "results.json").read_text())
        if results["complete"]:
            return results
    raise AssertionError("the shards never completed the study")


def test_shards_merged_give_the_unsharded_table_and_mixed_settings_are_refused(tmp_path):
    whole = _study(tmp_path / "whole", *SMALL, "--sweep", "1")
    assert whole.returncode == 0, whole.stderr
    a = _sharded(tmp_path, *SMALL, "--sweep", "1")
    b = json.loads((tmp_path / "whole" / "results.json").read_text())
    assert any(t["extended"] for t in b["tuning"].values())  # (the quick networks want rates past the grid)
    assert a["embedded"] == b["embedded"] and a["sweep"] == b["sweep"] and a["tuning"] == b["tuning"]
    units = json.loads((tmp_path / "m" / "units.json").read_text())["units"]
    chosen = json.loads((tmp_path / "m" / "choices.json").read_text())["choices"]
    for key, unit in units.items():  # every unit names its trial, and the choices it ran under
        if not key.startswith("tune"):
            assert unit["trial"] == chosen[key.split(" ")[1]] and unit["choices"] == tuning.digest(chosen)
    other = _study(tmp_path / "o", *SMALL, "--epochs", "2", "--shard", "1/2")
    assert other.returncode == 0, other.stderr
    refused = _study(tmp_path / "m2", "--merge", str(tmp_path / "s1"), str(tmp_path / "o"))
    assert refused.returncode == 2 and "were run with other epochs" in refused.stderr
    assert refused.stderr.count("\n") == 1


def test_a_unit_trained_in_two_folders_merges_where_only_its_timing_differs(tmp_path):
    """A stopped run's last unit, run again by a shard: the same figures (training is reproducible),
    another step time; a unit whose figures differ is still refused."""
    from pycapsnet.experiments import study_units

    assert _study(tmp_path / "a", *SMALL, "--lr", "0.002").returncode == 0
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    (tmp_path / "b" / ".lock").unlink(missing_ok=True)
    path = tmp_path / "b" / "units.json"
    record = json.loads(path.read_text())
    key = next(k for k, u in record["units"].items() if isinstance(u.get("val"), list) and u["val"])
    # the same figures, timed apart and on other kernels (a shard on another machine): one unit
    again = {**record["units"][key], "step": record["units"][key]["step"] * 1.5, "kernels": "mkl SkylakeX"}
    record["units"][key] = {**again, "digest": study_units.digest(again)}
    path.write_text(json.dumps(record))
    merged = _study(tmp_path / "m", "--merge", str(tmp_path / "a"), str(tmp_path / "b"))
    assert merged.returncode == 0, merged.stderr
    unit = record["units"][key]
    record["units"][key] = study_units.sealed({**unit, "val": [*unit["val"][:-1], unit["val"][-1] + 1e-3]})
    path.write_text(json.dumps(record))
    refused = _study(tmp_path / "m2", "--merge", str(tmp_path / "a"), str(tmp_path / "b"))
    assert refused.returncode == 2 and "hold different figures" in refused.stderr, refused.stderr


@pytest.mark.parametrize("forge,said", [
    (lambda c, u: c["choices"].update(uniform="lr=0.0005"), "do not follow from its tuning units"),
    (lambda c, u: c["choices"].pop("dynamic"), "do not follow from its tuning units"),
    (lambda c, u: c["tuning_units"].update({k: "0" * 16 for k in list(c["tuning_units"])[:1]}), "absent"),
    (lambda c, u: u["units"].pop(next(iter(c["tuning_units"]))), "absent"),
    (lambda c, u: c.pop("tuning_units"), "lists no tuning units"),
    (lambda c, u: u.clear(), "no units.json beside it")])  # the file copied away from its merge's folder
def test_a_forged_or_partial_choices_file_is_refused_before_any_unit(tmp_path, forge, said):
    assert _study(tmp_path / "whole", *SMALL).returncode == 0
    c = json.loads((tmp_path / "whole" / "choices.json").read_text())
    u = json.loads((tmp_path / "whole" / "units.json").read_text())
    forge(c, u)
    (tmp_path / "whole" / "choices.json").write_text(json.dumps(c))
    (tmp_path / "whole" / "units.json").write_text(json.dumps(u))
    if not u:
        (tmp_path / "whole" / "units.json").unlink()
    done = _study(tmp_path / "new", *SMALL, "--choices", str(tmp_path / "whole" / "choices.json"))
    assert done.returncode == 2 and said in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert not (tmp_path / "new").exists()


def test_your_own_data_as_arrays_and_your_own_routing(tmp_path):
    from tests import routing_plugin  # noqa: F401  (registers "tempered")

    (x, y), (xt, yt) = pycapsnet.load_digits()
    results = experiments.routings(out=str(tmp_path / "r"), quick=True, affine=False, data=((x[:100], y[:100]),
                                   (xt[:30], yt[:30])), routings=["uniform", "tempered"], lr=2e-3, seeds=2)
    assert results["complete"] and results["dataset"] == "arrays" and set(results["arrays"]) == {"uniform", "tempered"}
    assert results["data"]["test"]["digits"] == 30 and results["data"]["validation"]["digits"] == 10
    row = results["arrays"]["tempered"]
    assert len(row["mcnemar_per_seed"]) == 2 and len(row["wilson95"]) == 2 and row["word"] == "inconclusive"
    assert (tmp_path / "r" / "routings.png").stat().st_size > 5000
    # each unit says which BLAS kernels its products ran on (its rounding depends on them), under its digest
    from pycapsnet.backends.host import blas_kernels

    units = json.loads((tmp_path / "r" / "units.json").read_text())["units"]
    assert blas_kernels() and {u["kernels"] for u in units.values()} == {blas_kernels()}
    assert results["kernels"] == {blas_kernels(): len(units)}
    assert f"products ran on {blas_kernels()} ({len(units)} units)" in (tmp_path / "r" / "results.md").read_text()


@pytest.mark.parametrize("kwargs,said", [(dict(affine="no"), "affine must be True or False"),
                                         (dict(routings=[1]), "routings must be a list of row names"),
                                         (dict(out=None), "out must be a path"),
                                         (dict(data=[1, 2, 3]), "data must be"),
                                         (dict(routings=["warp"]), "--routings warp: not a row of the study")])
def test_the_python_form_refuses_what_it_would_misread(tmp_path, kwargs, said):
    args = {"out": str(tmp_path / "r"), "quick": True, **kwargs}
    with pytest.raises(CapsNetError, match=said):
        experiments.routings(**args)
    assert not (tmp_path / "r").exists()


def test_the_cnn_row_matches_the_dynamic_rows_parameters():
    shape, backbone = (1, 28, 28), study_networks.BACKBONE
    caps, cnn = (study_networks.params_of(study_networks.network(r, shape, backbone)) for r in ("dynamic", "cnn"))
    assert abs(cnn - caps) / caps < 0.02


def test_the_affine_part_reads_at_the_last_epoch_and_at_the_declared_target(tmp_path):
    done = _study(tmp_path / "a", "--quick", "--routings", "uniform", "--lr", "0.002", "--limit", "100",
                  "--limit-test", "20", "--seeds", "1", "--affine-target", "1")
    assert done.returncode == 0, done.stderr
    results = json.loads((tmp_path / "a" / "results.json").read_text())
    row = results["affine"]["uniform"]
    assert row["target_epoch"] == [1] and row["last_affine"]["n"] == 1 and results["protocol"]["affine_target"] == 1
    assert "at the first epoch reaching 1.0% translated validation accuracy" in (tmp_path / "a" / "results.md").read_text()


def test_a_full_disk_at_the_figure_is_one_line_and_the_units_are_kept(tmp_path, monkeypatch, capsys):
    """95.19: the disk fills while routings.png is written: one line, exit 2, units.json kept."""
    from pycapsnet.tools import cli, plots

    def full(fig, path, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(plots, "save", full)
    out = tmp_path / "r"
    code = cli.main(["experiment", "routings", "--quick", "--no-affine", "--routings", "uniform", "--lr", "0.002",
                     "--limit", "60", "--limit-test", "20", "--seeds", "1", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: cannot write the results into") and "No space left" in err[-1]
    assert (out / "units.json").exists()


def test_a_study_folder_of_other_settings_is_refused_not_replaced(tmp_path):
    first = _study(tmp_path / "s", *SMALL, "--lr", "0.002", "--seeds", "1")
    assert first.returncode == 0, first.stderr
    units = (tmp_path / "s" / "units.json").read_text()
    again = _study(tmp_path / "s", *SMALL, "--lr", "0.002", "--seeds", "1", "--epochs", "2")
    assert again.returncode == 2 and "holds units run with other epochs" in again.stderr
    assert (tmp_path / "s" / "units.json").read_text() == units


def test_the_seed_planner_reads_a_pilots_paired_spread(tmp_path):
    errors = {"uniform": [1.2, 1.1, 1.4, 1.3], "vb": [1.0, 1.05, 1.2, 1.0]}
    units = {f"main {r} seed {s}": {"test_error": e} for r, es in errors.items() for s, e in enumerate(es)}
    (tmp_path / "units.json").write_text(json.dumps({"flags": {}, "layout": {"rows": ["uniform", "vb"]},
                                                     "units": units}))
    sd = float(np.std(np.subtract(errors["vb"], errors["uniform"]), ddof=1))
    done = _study(tmp_path / "unused", "--plan-seeds", "--pilot", str(tmp_path), "--effect", "0.1")
    assert done.returncode == 0, done.stderr
    assert f"| vb | 4 | {sd:.3f} | {st.seeds_for(sd, 0.1)} | {st.seeds_for(sd, 0.1, 0.9)} |" in done.stdout
    refused = _study(tmp_path / "unused", "--plan-seeds", "--effect", "0.1")
    assert refused.returncode == 2 and "--pilot DIR" in refused.stderr and not (tmp_path / "unused").exists()


def test_units_csv_is_long_form_that_pandas_reads_as_it_is(tmp_path):
    pandas = pytest.importorskip("pandas", reason="the reader the long form is made for")
    assert _study(tmp_path / "s", *SMALL, "--seeds", "1").returncode == 0
    frame = pandas.read_csv(tmp_path / "s" / "units.csv")
    units = json.loads((tmp_path / "s" / "units.json").read_text())["units"]
    assert len(frame) == len(units) and set(frame["kind"]) == {"tune", "main"}
    main = frame[frame["kind"] == "main"].set_index("row")
    assert main.loc["uniform", "test_error"] == units["main uniform seed 0"]["test_error"]
    assert main.loc["uniform", "trial"] == units["main uniform seed 0"]["trial"]


def test_a_tuning_trial_that_diverges_is_recorded_with_its_curves_and_the_study_goes_on(tmp_path, monkeypatch):
    from pycapsnet.experiments import loop

    real = loop.train

    def diverging(model, epochs, batches, n, step=loop.default_step, lr=2e-3, curve=None, **kw):
        if lr >= 4e-3:  # the grid's top rate and beyond: NaN in the first epoch
            curve.append(float("nan"))
            raise loop.Diverged("the loss became nan", 0, 0.01)
        return real(model, epochs, batches, n, step=step, lr=lr, curve=curve, **kw)

    monkeypatch.setattr(loop, "train", diverging)
    results = experiments.routings(out=str(tmp_path / "s"), quick=True, affine=False, routings=["uniform"], seeds=1,
                                   limit=60, limit_test=20, progress=False)
    units = json.loads((tmp_path / "s" / "units.json").read_text())["units"]
    failed = {k: u for k, u in units.items() if u.get("diverged")}
    assert failed and all("lr=0.004" in k for k in failed)
    assert all(u["val"] == [0.0] and u["loss"] == [None] and u["diverged"] == 1 for u in failed.values())
    assert results["complete"] and results["tuning"]["uniform"]["chosen"] != "lr=0.004"
    kept = next(u for k, u in units.items() if k.startswith("tune") and not u.get("diverged"))
    assert set(kept["measures"]) >= {"entropy", "dynamics", "starved_children"}  # a collapse can be read


# ---- the MultiMNIST part (--multimnist) ------------------------------------------------------------
def test_the_multimnist_part_tunes_on_validation_pairs_and_its_shards_merge_into_the_unsharded_table(tmp_path):
    """Its own tuning rows, its choices in choices.json, its main units at those choices, the main table's
    statistics on the test pairs; em has no capsules to mask, so it has no MultiMNIST row (it has an
    affine one).  Shards and their merge give the unsharded tables, the affine part's too."""
    flags = ["--quick", "--routings", "uniform", "dynamic", "em", "--limit", "100", "--limit-test", "40",
             "--multimnist", "--margin", "5", "--seeds", "2", "--affine-target", "5"]  # (and the affine part)
    whole = _study(tmp_path / "whole", *flags)
    assert whole.returncode == 0, whole.stderr
    b = json.loads((tmp_path / "whole" / "results.json").read_text())
    mm = b["multimnist"]
    assert set(mm["rows"]) == {"uniform", "dynamic"} and mm["baseline"] == "uniform" and mm["test_pairs"] == 40
    assert mm["settings"] == {"shift": 4, "canvas": 36, "pairs": 1, "decoder": [32, 64], "val_seed": 12344,
                              "test_seed": 12345}
    assert {"multimnist:uniform", "multimnist:dynamic"} <= set(b["tuning"]) and "multimnist:em" not in b["tuning"]
    dynamic = mm["rows"]["dynamic"]
    assert dynamic["word"] in ("better", "worse", "equivalent", "inconclusive") and dynamic["tost"] is not None
    assert len(dynamic["mcnemar_per_seed"]) == 2 and dynamic["measures"] is None
    units = json.loads((tmp_path / "whole" / "units.json").read_text())["units"]
    chosen = json.loads((tmp_path / "whole" / "choices.json").read_text())["choices"]
    for s in range(2):
        unit = units[f"multimnist dynamic seed {s}"]
        assert unit["trial"] == chosen["multimnist:dynamic"] and unit["choices"] == tuning.digest(chosen)
        wrong = st.unpack(unit["wrong"], 40)
        assert unit["test_error"] == pytest.approx(100 * wrong.mean()) and dynamic["errors"][s] == unit["test_error"]
    assert "MultiMNIST (Sabour et al. §6)" in (tmp_path / "whole" / "results.md").read_text()
    a = _sharded(tmp_path, *flags)
    assert a["multimnist"] == b["multimnist"] and a["tuning"] == b["tuning"] and a["embedded"] == b["embedded"]
    assert a["affine"] == b["affine"] and {"affine:uniform", "affine:dynamic", "affine:em"} <= set(a["tuning"])


def test_the_multimnist_part_refuses_what_it_cannot_take(tmp_path):
    shift = _study(tmp_path / "s", *SMALL, "--shift", "2")
    assert shift.returncode == 2 and "--shift in its MultiMNIST part only: add --multimnist" in shift.stderr
    assert shift.stderr.count("\n") == 1 and not (tmp_path / "s").exists()
    rows = _study(tmp_path / "r", "--quick", "--no-affine", "--routings", "em", "cnn", "--multimnist")
    assert rows.returncode == 2 and "--routings names none" in rows.stderr
    x = np.random.default_rng(0).random((60, 3, 32, 32)).astype(np.float32)
    y = np.arange(60) % 10
    with pytest.raises(CapsNetError, match="one-channel digits, and these images are 3x32x32: drop --multimnist"):
        experiments.routings(out=str(tmp_path / "c"), quick=True, affine=False, data=((x, y), (x[:20], y[:20])),
                             routings=["uniform"], lr=2e-3, multimnist=True, progress=False)
    assert not (tmp_path / "c").exists()


def test_a_multimnist_unit_whose_error_is_not_its_record_of_missed_pairs_is_refused(tmp_path):
    from pycapsnet.experiments import study_units

    results = experiments.routings(out=str(tmp_path / "a"), quick=True, affine=False, routings=["uniform"], lr=2e-3,
                                   seeds=1, limit=60, limit_test=20, multimnist=True, shift=2, pairs=1, progress=False)
    assert results["complete"] and results["multimnist"]["settings"]["canvas"] == 32
    path = tmp_path / "a" / "units.json"
    record = json.loads(path.read_text())
    unit = record["units"]["multimnist uniform seed 0"]
    record["units"]["multimnist uniform seed 0"] = study_units.sealed({**unit, "test_error": (unit["test_error"] + 5) % 100})
    path.write_text(json.dumps(record))
    refused = _study(tmp_path / "m", "--merge", str(tmp_path / "a"))
    assert refused.returncode == 2 and "is not what its own record of wrong digits says" in refused.stderr


def test_the_seed_planner_reads_the_multimnist_parts_spread_against_its_own_baseline(tmp_path):
    from pycapsnet.experiments import study_plan

    errors = {"main uniform": [1.2, 1.1, 1.4], "main dynamic": [1.0, 1.3, 1.2],
              "multimnist uniform": [30.0, 34.0, 31.0], "multimnist dynamic": [28.0, 33.5, 27.0]}
    units = {f"{r} seed {s}": {"test_error": e} for r, es in errors.items() for s, e in enumerate(es)}
    (tmp_path / "units.json").write_text(json.dumps({"flags": {}, "layout": {"rows": ["uniform", "dynamic"]},
                                                     "units": units}))
    planned = study_plan.plan(str(tmp_path), 1.0)
    sd = float(np.std(np.subtract(errors["multimnist dynamic"], errors["multimnist uniform"]), ddof=1))
    assert planned["rows"]["multimnist:dynamic"]["sd"] == pytest.approx(sd)  # against the part's uniform
    assert planned["rows"]["dynamic"]["sd"] == pytest.approx(float(np.std([-0.2, 0.2, -0.2], ddof=1)))
    assert "multimnist:uniform" not in planned["rows"] and set(planned["rows"]) == {"dynamic", "multimnist:dynamic"}


def test_the_affine_parts_interval_of_an_accuracy_stays_within_0_and_100():
    """Three seeds, one collapsed (as a pilot's uniform row did): the t interval of the mean would
    reach below 0 and above 100."""
    units = {f"affine uniform seed {s}": {"last": {"translated": t, "affine": t / 2}, "target": None}
             for s, t in enumerate([93.1, 92.5, 29.5])}
    r = study_report.affine_rows(units, ["uniform"], 3)["uniform"]
    assert r["last_translated"]["ci95"] == [0.0, 100.0] and r["last_translated"]["n"] == 3
    assert r["last_translated"]["mean"] == pytest.approx(np.mean([93.1, 92.5, 29.5]))
    assert r["target_affine"]["n"] == 0 and r["target_epoch"] == [None, None, None]


def test_the_affine_part_chooses_its_rate_on_translated_validation_digits(tmp_path):
    """Its own tuning rows ("affine:ROW", scored on the validation digits placed on its canvas), and
    each affine unit at that choice, not the main table's."""
    done = _study(tmp_path / "a", "--quick", "--routings", "uniform", "--limit", "100", "--limit-test", "20",
                  "--seeds", "1", "--affine-target", "5")
    assert done.returncode == 0, done.stderr
    units = json.loads((tmp_path / "a" / "units.json").read_text())["units"]
    chosen = json.loads((tmp_path / "a" / "choices.json").read_text())["choices"]
    assert set(chosen) == {"uniform", "affine:uniform"}
    tuned = [k for k in units if k.startswith("tune affine:uniform ")]
    assert len(tuned) >= 12 and all(0 <= v <= 1 for k in tuned for v in units[k]["val"])
    assert units["affine uniform seed 0"]["trial"] == chosen["affine:uniform"]
    results = json.loads((tmp_path / "a" / "results.json").read_text())
    assert results["settings"]["affine"]["tuned"] and "affine:uniform" in results["tuning"]
    assert "its own choice on translated validation digits" in (tmp_path / "a" / "results.md").read_text()

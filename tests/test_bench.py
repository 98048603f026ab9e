"""The benchmark's smoke run: the real command, a tiny model, one timed step (no timing asserted)."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_rows_report_ratios_against_the_eager_and_the_compiled_reference():
    """--reference both: every row gets its ratio to each reference, per round then the median (the
    compiled reference's own compile time shows); the real compile is too slow for the suite."""
    sys.path.insert(0, ROOT)
    from benchmarks.bench import parser, table_row

    args = parser().parse_args(["--reference", "both"])

    def result(impl, rounds, compile_s=None):
        return {"impl": impl, "label": impl, "train_samples_per_s_rounds": rounds, "train_samples_per_s": rounds[0],
                "eval_samples_per_s": 1.0, "peak_train_mem_mb": 100.0, "compile_s": compile_s}

    ref, compiled = result("autograd:cpu", [10.0, 12.0]), result("autograd-compiled:cpu", [20.0, 20.0], 30.0)
    mine = result("numpy", [30.0, 36.0])
    row = table_row(mine, ref, {}, args, compiled)
    assert mine["speedup_vs_autograd_rounds"] == [3.0, 3.0] and mine["speedup_vs_compiled_rounds"] == [1.5, 1.8]
    assert mine["speedup_vs_compiled"] == pytest.approx(1.65)
    assert row["train vs compiled"] == "1.65x (1.50-1.80)"
    assert table_row(compiled, ref, {}, args, compiled)["compile s"] == "30"


def test_step_over_own_products_is_taken_in_pairs():
    """Each speed run times [step, own products] in pairs, a step and then the products it runs
    (paired_steps): step / own products is the median over every pair of every round, so that a
    machine that slows between a step and a product moves both halves, not the ratio."""
    sys.path.insert(0, ROOT)
    from benchmarks.bench import _median_run, parser, table_row

    args = parser().parse_args([])  # the Fourier PrimaryCaps: its own products are fourier_floor_s

    def run(step, own, pairs):
        return {"impl": "numpy", "label": "numpy", "train_step_s": step, "train_samples_per_s": 64 / step,
                "eval_samples_per_s": 1.0, "peak_train_mem_mb": 100.0, "pairs": pairs,
                "floor": {"floor_s": 9.0, "fourier_floor_s": own, "gflop": 1.0, "gflop_per_s": 1.0, "products": {}}}

    # the machine slowed in round 2, and within round 3 after its first pair: both halves of a pair move
    r = _median_run([run(0.30, 0.20, [[0.30, 0.20], [0.32, 0.20], [0.30, 0.20]]),
                     run(0.60, 0.40, [[0.60, 0.40], [0.64, 0.40], [0.60, 0.40]]),
                     run(0.32, 0.10, [[0.32, 0.20], [0.64, 0.40], [0.60, 0.40]])])
    assert r["floor_rounds"][1] == {"floor_s": 9.0, "fourier_floor_s": 0.40} and "pairs" not in r
    row = table_row(r, None, r.pop("floor"), args)
    assert r["step_over_own_floor_rounds"] == pytest.approx([1.5, 1.5, 1.6])
    # the pooled median of the nine pairs; a floor timed apart (0.10 s in round 3) would give 3.2
    assert r["step_over_own_floor"] == pytest.approx(1.5) and row["step / own"] == "1.50 (1.50-1.60)"
    assert r["own_floor_s"] == 0.10  # the reported step's own round's floor (the median throughput: 0.32 s)
    assert row["own products s"] == "0.400"  # what the table shows: the pairs' products (median of nine)
    # without pairs (a run from before them): the reported step over its floor
    r = _median_run([{k: v for k, v in run(0.30, 0.20, []).items() if k != "pairs"}])
    table_row(r, None, r.pop("floor"), args)
    assert r["step_over_own_floor"] == pytest.approx(1.5) and r["step_over_own_floor_rounds"] == [pytest.approx(1.5)]


def test_a_stopped_benchmark_leaves_the_rounds_it_measured(tmp_path, monkeypatch):
    """bench.py writes its JSON after every phase: stopped in the memory phase (a time limit), the
    file holds the speed rounds, marked incomplete, and no half-written file."""
    sys.path.insert(0, ROOT)
    from benchmarks import bench

    def spawn(kind, impl, args, env_extra=None, **extra):
        if env_extra:  # the memory run: where the time limit strikes
            raise KeyboardInterrupt
        return {"impl": impl, "label": impl, "train_samples_per_s": 10.0, "eval_samples_per_s": 20.0}

    monkeypatch.setattr(bench, "_spawn", spawn)
    out = tmp_path / "b.json"
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--backends", "numpy", "--rounds", "2", "--json", str(out)])
    res = json.loads(out.read_text())
    assert res["complete"] is False and res["main"] == []
    assert [len(r) for r in res["rounds_so_far"].values()] == [2, 2]      # numpy and the reference
    assert os.listdir(tmp_path) == ["b.json"]


def test_benchmark_quick_run_writes_a_complete_table(tmp_path):
    pytest.importorskip("torch", reason="the benchmark's reference is PyTorch autograd")
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench.py"), "--quick", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "train vs autograd" in r.stdout and "step / floor" in r.stdout
    res = json.loads(out.read_text())
    impls = {m["impl"]: m for m in res["main"]}
    assert set(impls) == {"numpy", "torch", "autograd:cpu"} and res["complete"] is True
    assert set(res["code"]) == {"commit", "clean", "tree", "source"}  # the code it measured
    # the thread counts each ran with: pycapsnet's own for its backends, PyTorch's where torch is loaded
    assert impls["numpy"]["threads"]["pycapsnet"] >= 1 and impls["autograd:cpu"]["threads"]["pycapsnet"] is None
    assert impls["torch"]["threads"]["torch"] >= 1 and "threads: numpy: pycapsnet" in r.stdout
    for name, m in impls.items():
        assert "error" not in m, (name, m)
        assert m["train_samples_per_s"] > 0 and m["eval_samples_per_s"] > 0 and m["peak_train_mem_mb"] > 0
        assert res["floor"][name]["floor_s"] > 0
    assert impls["numpy"]["speedup_vs_autograd"] > 0 and impls["numpy"]["step_over_floor"] > 0
    # --quick takes 2 rounds: every run is kept, the ratio is the median of the per-round ratios
    for m in impls.values():
        assert len(m["train_samples_per_s_rounds"]) == 2 and m["train_samples_per_s"] in m["train_samples_per_s_rounds"]
    per_round = [a / b for a, b in zip(impls["numpy"]["train_samples_per_s_rounds"],
                                       impls["autograd:cpu"]["train_samples_per_s_rounds"])]
    assert impls["numpy"]["speedup_vs_autograd"] == pytest.approx(sum(per_round) / 2)
    # step / own products in pairs: --quick's one step per round, so one pair per round
    pairs = impls["numpy"]["pairs_rounds"]
    assert [len(p) for p in pairs] == [1, 1] and all(s > 0 and p > 0 for s, p in sum(pairs, []))
    ratios = [s / p for s, p in sum(pairs, [])]
    assert impls["numpy"]["step_over_own_floor_rounds"] == pytest.approx(ratios)
    assert impls["numpy"]["step_over_own_floor"] == pytest.approx(sum(ratios) / 2)
    products = res["floor"]["numpy"]["products"]
    assert {"primary forward", "primary dW", "primary dX", "classcaps u_hat"} <= set(products)
    # the picture of the same JSON
    png = tmp_path / "bench.png"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "plot_results.py"), str(out), "--out", str(png)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_results_picture_names_a_file_that_is_not_a_benchmark(tmp_path, capsys, monkeypatch):
    from benchmarks.plot_results import main

    monkeypatch.setattr(sys, "argv", ["plot_results.py"])  # the program name argparse prints

    for text, message in [(None, "does not exist; write one with python benchmarks/bench.py --json"),
                          ("{", "cannot read .* as JSON"),
                          ('{"runs": []}', "is not a benchmarks/bench.py result"),
                          ('{"main": [{"impl": "cupy", "error": "no GPU"}]}', "holds no measured implementation"),
                          ('{"main": [], "complete": false}', "stopped before its first implementation was finished")]:
        path = tmp_path / "r.json"
        if text is not None:
            path.write_text(text)
        with pytest.raises(SystemExit) as stop:
            main([str(path), "--out", str(tmp_path / "r.png")])
        assert stop.value.code == 2
        assert re.search("plot_results.py: error: .*" + message, capsys.readouterr().err)
        assert not (tmp_path / "r.png").exists()
        path.unlink(missing_ok=True)


def test_step_profile_accounts_for_the_whole_step():
    """Wall and CPU time of each part, the products within them; the parts add up to the step."""
    from benchmarks.profile_step import profile

    (step, cpu), rows, moved, _ = profile("numpy", batch=2, steps=1, warmup=1)
    times = {label: (t, products) for label, t, products, _ in rows}
    assert "PrimaryCaps (convolution + squash) backward" in times and "Adam" in times
    assert all(t > 0 for label, (t, _) in times.items() if not label.startswith("rest"))
    assert abs(sum(t for t, _ in times.values()) - step) < 1e-9
    assert abs(sum(c for *_, c in rows) - cpu) < 1e-9 and cpu > 0  # CPU time: the parts add up to it too
    # the products are part of their layer's time: PrimaryCaps' convolution is products, Adam none
    assert all(0 <= p <= t for label, (t, p) in times.items() if not label.startswith("rest"))
    assert times["PrimaryCaps (convolution + squash) forward"][1] > 0 and times["Adam"][1] == 0
    # compulsory bytes: conv1 reads 2 digits and its 9x9x256 kernels and bias, writes 2 x 20x20x256 maps;
    # Adam reads θ, g, m, v and writes θ, m, v of all 8,215,568 + decoder parameters
    conv1 = 4 * (2 * 28 * 28 + 81 * 256 + 256 + 2 * 20 * 20 * 256)
    assert moved["conv1 forward"] == conv1
    # backward reads dy, x and θ and writes dθ; the first layer makes no dx
    assert moved["conv1 backward"] == 4 * (2 * 20 * 20 * 256 + 2 * 28 * 28 + 2 * (81 * 256 + 256))
    from pycapsnet.core.model import CapsNet
    n_params = sum(int(np.prod(p.shape)) for p in CapsNet("numpy").params.values())
    assert moved["Adam"] == 7 * 4 * n_params
    assert set(moved) == set(times)


def test_floor_counts_the_routing_passes_and_measures_memory():
    """The bound's FLOPs outside the products: dynamic routing's five passes over û forward, ten
    backward, 2 FLOPs a value; Adam's 12 a parameter; and a bandwidth from a real stream."""
    from benchmarks.profile_step import bandwidth, pass_gflop

    from pycapsnet.core.model import CapsNet

    extra = pass_gflop(CapsNet("numpy"), 64)
    u_hat = 64 * 1152 * 10 * 16
    assert extra["ClassCaps (u_hat = W u, routing) forward"] == pytest.approx(5 * 2 * u_hat / 1e9)
    assert extra["ClassCaps (u_hat = W u, routing) backward"] == pytest.approx(20 * u_hat / 1e9)
    assert 0.5 < bandwidth(mb=16, reps=2) < 2000  # GB/s


@pytest.mark.parametrize("script,argv,message", [
    ("bench", ["--steps", "0"], "argument --steps: must be at least 1, got 0"),
    ("bench", ["--rounds", "0"], "argument --rounds: must be at least 1, got 0"),
    ("bench", ["--warmup", "-1"], "argument --warmup: must be 0 or more, got -1"),
    ("profile_step", ["--batch-size", "0"], "argument --batch-size: must be at least 1, got 0"),
    ("bench", ["--backends", "numpy", "jax"], "argument --backends: unknown backend 'jax': choose from numpy, cupy, torch"),
    ("bench", ["--backends", "torch:cuda+fast"], "unknown backend 'torch:cuda+fast'"),
    ("bench", ["--ref-device", "gpu"], "argument --ref-device: expected cpu, cuda or cuda:N, got 'gpu'"),
    # an output that cannot be written is refused before minutes of measuring, not after
    ("bench", ["--json", os.path.join(ROOT, "setup.py", "r.json")],
     f"argument --json: cannot write {os.path.join(ROOT, 'setup.py', 'r.json')}: {os.path.join(ROOT, 'setup.py')} is a file"),
    ("bench", ["--json", ROOT], f"argument --json: {ROOT} is a directory; name the file to write"),
    ("plot_results", ["--out", os.path.join(ROOT, "setup.py", "b.png")], "argument --out: cannot write"),
    ("profile_step", ["--backend", "jax"], "error: unknown backend 'jax': choose one of numpy"),
])
def test_benchmark_flags_refuse_impossible_numbers(script, argv, message, capsys, tmp_path):
    import importlib

    main = importlib.import_module(f"benchmarks.{script}").main
    if script == "bench":  # should the check break: a short run, and the README's results.json untouched
        argv = argv + ["--quick", "--backends", "numpy", "--no-reference", "--json", str(tmp_path / "r.json")]
    if script == "plot_results":  # should the check break: docs/benchmark.png untouched
        argv = argv + ["--out", str(tmp_path / "b.png")]
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_benchmark_measures_a_recorded_step(tmp_path):
    """``+graph`` measures the step through CapturedStep (as plain torch:cuda and cupy do); on the CPU the
    recording is a re-run with host transfers refused, which this runs end to end."""
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench.py"), "--quick", "--no-reference",
                        "--backends", "numpy+graph", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    (m,) = json.loads(out.read_text())["main"]
    assert m["impl"] == "numpy+graph" and "error" not in m, m
    assert m["label"].startswith("numpy:cpu, recorded") and m["train_samples_per_s"] > 0


def test_code_version_names_the_files_even_where_git_lags_behind_them(tmp_path, monkeypatch):
    """A copy whose .git is older than its files (a GPU machine sent a newer commit's files) is
    reported dirty at the old commit, and its tree id is the newer commit's tree."""
    from benchmarks.provenance import code_version

    def git(*args):
        return subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                              capture_output=True, text=True, check=True).stdout.strip()

    monkeypatch.delenv("PYCAPSNET_CODE_VERSION", raising=False)
    assert code_version(str(tmp_path))["commit"] is None  # no history, nothing stated
    monkeypatch.setenv("PYCAPSNET_CODE_VERSION", "abc123 dirty")
    assert code_version(str(tmp_path)) == {"commit": "abc123", "clean": False, "tree": None,
                                           "source": "PYCAPSNET_CODE_VERSION"}
    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("commit", "-qm", "one")
    one = code_version(str(tmp_path))
    assert one["source"] == "git" and one["clean"] is True and one["commit"] == git("rev-parse", "HEAD")
    assert one["tree"] == git("rev-parse", "HEAD^{tree}")
    (tmp_path / "a.py").write_text("x = 2\n")
    (tmp_path / "b.py").write_text("y = 1\n")
    git("add", "-A")
    git("commit", "-qm", "two")
    two_tree = git("rev-parse", "HEAD^{tree}")
    git("reset", "-q", "--soft", "HEAD~1")  # .git back at "one", the files still "two"'s
    git("reset", "-q")
    lagging = code_version(str(tmp_path))
    assert lagging["commit"] == one["commit"] and lagging["clean"] is False and lagging["tree"] == two_tree
    assert git("status", "--porcelain") != ""  # the scratch index left the checkout's own alone


def test_seeds_figure_marks_the_fixed_epoch_and_says_the_mean_error(tmp_path, capsys):
    """benchmarks/seeds_figure.py: the runs' mean test error at the epoch given, and a PNG; a run
    without that epoch is refused in one line (exit 2)."""
    sys.path.insert(0, ROOT)
    from benchmarks.seeds_figure import main

    for name, accs in (("a", [0.99, 0.996]), ("b", [0.98, 0.997])):
        os.makedirs(tmp_path / name)
        with open(tmp_path / name / "metrics.jsonl", "w") as f:
            for epoch, acc in enumerate(accs, 1):
                f.write(json.dumps({"epoch": epoch, "train_loss": 0.1, "test_acc": acc}) + "\n")
    png = tmp_path / "seeds.png"
    assert main([str(tmp_path / "a"), str(tmp_path / "b"), "--epoch", "2", "--target", "99.7", "--out", str(png)]) == 0
    assert "mean test error at epoch 2: 0.350%" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit) as stop:
        main([str(tmp_path / "a"), "--epoch", "3", "--out", str(png)])
    assert stop.value.code == 2 and "a has no test accuracy at epoch 3" in capsys.readouterr().err


def test_pair_figure_chooses_each_records_epoch_on_validation(tmp_path, capsys):
    """benchmarks/pair_figure.py: per record, the best validation epoch from --from on (the
    earliest of equals) and its test accuracy, and a PNG; a record without validation is refused
    in one line (exit 2)."""
    sys.path.insert(0, ROOT)
    from benchmarks.pair_figure import main

    rows = {"a": [(0.999, 0.90), (0.99, 0.991), (0.995, 0.993), (0.995, 0.999)],  # epoch 1 is before --from
            "b": [(0.9, 0.9), (0.992, 0.994), (0.991, 0.998), (0.993, 0.996)]}
    for name, accs in rows.items():
        os.makedirs(tmp_path / name)
        with open(tmp_path / name / "metrics.jsonl", "w") as f:
            for epoch, (val, test) in enumerate(accs, 1):
                f.write(json.dumps({"epoch": epoch, "val_acc": val, "test_acc": test}) + "\n")
    png = tmp_path / "pair.png"
    assert main([str(tmp_path / "a"), str(tmp_path / "b"), "--labels", "last", "averaged", "--from", "2",
                 "--out", str(png)]) == 0
    said = capsys.readouterr().out
    assert "last: epoch 3 chosen on validation (99.50%), test 99.30%" in said
    assert "averaged: epoch 4 chosen on validation (99.30%), test 99.60%" in said
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    os.makedirs(tmp_path / "c")
    (tmp_path / "c" / "metrics.jsonl").write_text(json.dumps({"epoch": 1, "test_acc": 0.9}) + "\n")
    with pytest.raises(SystemExit) as stop:
        main([str(tmp_path / "a"), str(tmp_path / "c"), "--out", str(png)])
    assert stop.value.code == 2 and "no epoch from 1 on has a validation accuracy" in capsys.readouterr().err


def test_readings_say_validations_epoch_and_the_best_test_epoch(tmp_path, capsys):
    """benchmarks/readings.py: per record, the earliest best-validation epoch and its test error,
    and the best test epoch (the earliest of equals); records one level down (a sweep's settings)
    are found; a record without validation says so; a folder without records is one line (exit 2)."""
    sys.path.insert(0, ROOT)
    from benchmarks.readings import main

    rows = {"run": [(0.99, 0.990), (0.995, 0.993), (0.995, 0.996), (0.994, 0.996)],
            "sweep/a": [(0.9, 0.9), (0.991, 0.997)]}
    for name, accs in rows.items():
        os.makedirs(tmp_path / name)
        with open(tmp_path / name / "metrics.jsonl", "w") as f:
            for epoch, (val, test) in enumerate(accs, 1):
                f.write(json.dumps({"epoch": epoch, "val_acc": val, "test_acc": test}) + "\n")
    os.makedirs(tmp_path / "noval")
    (tmp_path / "noval" / "metrics.jsonl").write_text(json.dumps({"epoch": 1, "test_acc": 0.9975}) + "\n")
    assert main([str(tmp_path / "run"), str(tmp_path / "sweep"), str(tmp_path / "noval")]) == 0
    said = capsys.readouterr().out
    assert "| 4 | 2 | 0.70% | 3 | 0.40% |" in said  # validation ties at 2 and 3: the earliest
    assert "| 2 | 2 | 0.30% | 2 | 0.30% |" in said and "a |" in said
    assert "| 1 | none (no validation) |  | 1 | 0.25% |" in said
    os.makedirs(tmp_path / "empty")
    with pytest.raises(SystemExit) as stop:
        main([str(tmp_path / "empty")])
    assert stop.value.code == 2 and "no metrics.jsonl in" in capsys.readouterr().err


def test_study_rows_quick_run_times_each_row_after_its_warm_up(tmp_path):
    """benchmarks/study_rows.py on the --quick backbone: every row asked for gets a CPU time per
    round and its ratio to uniform's, and the JSON says the warm-up and the command that made it."""
    out = tmp_path / "rows.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "study_rows.py"), "--quick", "--rows", "uniform",
                    "em", "cnn", "--steps", "1", "--rounds", "2", "--warmup", "2", "--out", str(out)],
                   check=True, cwd=ROOT, capture_output=True, env={**os.environ, "PYCAPSNET_THREADS": "1"})
    record = json.loads(out.read_text())
    assert set(record["rows"]) == {"uniform", "em", "cnn"} and record["warmup"] == 2
    assert all(len(r["rounds"]) == 2 and r["cpu_ms_per_step"] > 0 for r in record["rows"].values())
    assert record["rows"]["uniform"]["vs_uniform"] == 1.0 and "--warmup 2" in record["command"]

"""``pycapsnet plan --network``: a described network's step measured at two small batches and
extrapolated, against the step measured at the batch itself."""
import json

import numpy as np
import pytest

from pycapsnet.core import architecture
from pycapsnet.tools import cli
from pycapsnet.tools.gradcheck import composed_architectures
from pycapsnet.tools.plan_measured import measure_step, measured_batches, plan_network


NOISE = 8 << 10  # bytes: the spread of one traced step's Python allocations between measurements


def _efficient():
    return dict(architecture.load("efficient"), input_shape=(1, 28, 28), n_classes=10)


def _convcaps():
    return dict(composed_architectures()["ConvCaps network routing=full"])


@pytest.mark.parametrize("make,times", [(_efficient, 2), (_convcaps, 1.5)], ids=["efficient", "convcaps"])
def test_the_extrapolated_peak_is_the_measured_one(make, times):
    """Beyond the two measured batches, each segment of the step follows its own line: the peak is
    the largest of them at n, and a step run at n peaks there (within 5%, never more than 2% above)."""
    arch, n = make(), int(times * measured_batches()[1])
    plan = plan_network(arch, n)
    measured = measure_step(arch, n)
    assert n > max(measured_batches()) and plan.measured_at == measured_batches()
    # Python's own allocations in a traced step vary by a few KB from one measurement to the next (the
    # small ConvCaps network's whole step is ~0.5 MB): 2% plus that floor
    assert 0.98 * measured["peak"] - NOISE <= plan.peak <= 1.05 * measured["peak"]
    assert plan.peak_at == measured["peak_at"]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_each_layer_keeps_what_its_forward_keeps(dtype):
    """relu1 keeps its output (N, 24, 24, 32), conv1 its input image (N, 28, 28, 1): exactly, at a
    batch the lines reach beyond the measured ones; the rows' parameters are the network's."""
    arch = _efficient()
    itemsize = np.dtype(dtype).itemsize
    n = 3 * measured_batches()[1]
    plan = plan_network(arch, n, dtype)
    rows = {row.name: row for row in plan.layers}
    assert rows["relu1"].kept == n * 24 * 24 * 32 * itemsize
    assert rows["conv1"].kept == n * 28 * 28 * itemsize
    assert rows["relu1"].params == 0 and rows["conv1"].params == 5 * 5 * 32 + 32
    assert plan.n_params == architecture.build(arch, "numpy").n_params() == 1_573_168


def test_the_largest_batch_it_promises_fits():
    arch = _efficient()
    plan = plan_network(arch, 4)
    budget = int(1.5 * plan.peak)
    most = plan.largest_batch(budget)
    assert most > measured_batches()[1]
    assert measure_step(arch, most)["peak"] <= budget
    assert plan.largest_batch(plan.state // 2) == 0


def test_plan_command_plans_a_described_network(tmp_path, capsys):
    path = tmp_path / "net.json"
    path.write_text(json.dumps(_convcaps()))
    a, b = measured_batches()
    assert cli.main(["plan", "--network", str(path), "--batch-size", str(2 * b), "--memory", "1GB", "--measure"]) == 0
    out = capsys.readouterr().out
    assert f"measured at batches {a} and {b}, extrapolated" in out.splitlines()[0]
    for text in ("convcaps", "classcaps", f"peak of the step at batch {2 * b}", "largest batch within 1GB: "):
        assert text in out, text
    assert 0.95 <= float(out.rsplit("plan/measured", 1)[1]) <= 1.05


@pytest.mark.parametrize("argv,words", [
    (["--routing", "em"], "--routing sets a built-in network; a described one has its layers in efficient"),
    (["--conv-channels", "8", "--share-spatial"], "--conv-channels, --share-spatial set a built-in network"),
    (["--input-shape", "1", "8", "8"], "cannot follow"),
])
def test_plan_of_a_described_network_refuses_in_one_line(argv, words, capsys):
    assert cli.main(["plan", "--network", "efficient", *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1


def test_a_step_too_large_to_measure_is_one_line(monkeypatch, capsys):
    import tracemalloc

    from pycapsnet.core.network import Network

    def out_of_memory(self, x, y):
        raise MemoryError

    monkeypatch.setattr(Network, "train_step_grads", out_of_memory)
    assert cli.main(["plan", "--network", "efficient"]) == 2
    err = capsys.readouterr().err
    assert "ran out of this machine's memory: plan a smaller batch" in err and len(err.strip().splitlines()) == 1
    assert not tracemalloc.is_tracing()

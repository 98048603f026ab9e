"""``pycapsnet plan``: the planned peak of a train step against the measured one, the largest batch
for a budget, and the command's output and errors."""
from pycapsnet import backends  # noqa: F401,I001
import pytest
from pycapsnet.backends.numpy_backend import NumpyBackend

from pycapsnet.tools import cli
from pycapsnet.core.capsules import ClassCaps
from pycapsnet.core.fourier import FourierConv2d
from pycapsnet.core.layers import Conv2d
from pycapsnet.core.model import CapsNetConfig
from pycapsnet.tools.plan import measured_peak, parse_memory, plan

CASES = {
    "rgb 32x32 shared fourier": (dict(input_shape=(3, 32, 32), n_classes=20, share_spatial=True), 4),
    "rgb 32x32 shared im2col": (dict(input_shape=(3, 32, 32), n_classes=20, share_spatial=True,
                                     primary_conv="im2col"), 4),
    "28x28 materialised im2col": (dict(input_shape=(1, 28, 28), n_classes=10, primary_conv="im2col"), 8),
    "28x28 materialised fourier": (dict(input_shape=(1, 28, 28), n_classes=10), 8),
    # two im2col chunks in PrimaryCaps' backward: one chunk's matrices are freed before the next's are made
    "rgb 48x48 shared im2col, batch 64": (dict(input_shape=(3, 48, 48), n_classes=20, conv_channels=16,
                                                primary_types=4, share_spatial=True, primary_conv="im2col"), 64),
    "rgb 48x48 conv1 stride 2": (dict(input_shape=(3, 48, 48), n_classes=20, conv_channels=16, conv_stride=2,
                                      primary_types=4, share_spatial=True), 16),
    "28x28 attention": (dict(routing="attention"), 8),
    # the transforms shared, û formed all the same: the weight gradient is made per position, then summed
    "rgb 32x32 attention shared": (dict(input_shape=(3, 32, 32), n_classes=20, routing="attention",
                                        share_spatial=True), 4),
    "28x28 em": (dict(routing="em"), 8),
    "rgb 40x40 em, 3 iterations": (dict(input_shape=(3, 40, 40), n_classes=20, routing="em", routing_iters=3), 4),
}


@pytest.mark.parametrize("small_chunks", [False, True], ids=["default chunks", "small chunks"])
@pytest.mark.parametrize("case", list(CASES))
def test_planned_peak_is_within_15_percent_of_a_measured_step(case, small_chunks, monkeypatch):
    """The plan walks the step's allocations from the configuration alone; tracemalloc measures the
    NumPy arrays of a real step (Adam included).  With small chunks the im2col convolutions work in
    bands of rows, the shared routing in chunks of positions and the Fourier weight gradient in
    blocks of a few channels, and EM routing in blocks of one sample, as on large images."""
    if small_chunks:
        monkeypatch.setattr(Conv2d, "chunk_bytes", 2**20)
        monkeypatch.setattr(ClassCaps, "chunk_bytes", 2**18)
        monkeypatch.setattr(FourierConv2d, "weight_grad_mb", 1)
        monkeypatch.setattr(NumpyBackend, "sample_block", 1 << 14)
    overrides, batch = CASES[case]
    cfg = CapsNetConfig(**overrides)
    planned, measured = plan(cfg, batch).peak, measured_peak(cfg, batch)
    assert abs(planned / measured - 1) <= 0.15, f"plan {planned / 2**20:.1f} MB, measured {measured / 2**20:.1f} MB"


def test_the_largest_batch_the_plan_promises_fits_as_measured():
    """The probe's case: 3x48x48, 20 classes, 16 channels, 4 types, shared, im2col, within 200 MiB."""
    cfg = CapsNetConfig(input_shape=(3, 48, 48), n_classes=20, conv_channels=16, primary_types=4,
                        share_spatial=True, primary_conv="im2col")
    most = plan(cfg, 8).largest_batch(200 * 2**20)
    assert most > 64
    measured = measured_peak(cfg, most, steps=1)
    assert abs(plan(cfg, most).peak / measured - 1) <= 0.15, (most, measured / 2**20)


@pytest.mark.parametrize("routing", ["dynamic", "em"])
def test_a_batch_of_any_size_is_planned_at_once(routing, capsys):
    import time

    t0 = time.perf_counter()
    assert cli.main(["plan", "--routing", routing, "--batch-size", "100000000000", "--memory", "1e100GB"]) == 0
    assert time.perf_counter() - t0 < 5
    out = capsys.readouterr().out
    assert "peak of the step at batch 100000000000: " in out and " TiB " in out
    assert "largest batch within 1e100GB: 1,099,511,627,776 or more (the search stops there)" in out


def test_the_largest_batch_is_the_last_one_that_fits():
    cfg = CapsNetConfig(input_shape=(3, 64, 64), n_classes=50, share_spatial=True)
    p = plan(cfg, 8)
    budget = plan(cfg, 1).peak + 40 * p.per_image
    most = p.largest_batch(budget)
    assert most > 1
    assert plan(cfg, most).peak <= budget < plan(cfg, most + 1).peak
    assert p.largest_batch(plan(cfg, 1).peak - 1) == 0
    assert p.per_image > 0


def test_sharing_the_transforms_keeps_the_peak_flat_in_the_number_of_classes():
    """Without share_spatial routing holds û, P*T*J*D floats per image; with it the classes cost
    only the small per-type matrices and a bounded chunk."""
    def peak(classes, share):
        return plan(CapsNetConfig(input_shape=(3, 64, 64), n_classes=classes, share_spatial=share), 8).peak
    assert peak(200, False) - peak(20, False) > 4 * (peak(200, True) - peak(20, True))


@pytest.mark.parametrize("text,expected", [("80GB", 80 * 2**30), ("512 MB", 512 * 2**20), ("1.5GiB", int(1.5 * 2**30)),
                                           ("4096", 4096), ("2t", 2 * 2**40)])
def test_memory_sizes_are_read_with_their_units(text, expected):
    assert parse_memory(text) == expected


def test_plan_command_prints_layers_peak_and_largest_batch(capsys):
    assert cli.main(["plan", "--input-shape", "3", "32", "32", "--classes", "20", "--share-spatial",
                     "--batch-size", "4", "--memory", "2GB", "--measure"]) == 0
    out = capsys.readouterr().out
    for text in ("conv1", "primary", "classcaps", "decoder3", "parameters: ", "peak of the step at batch 4",
                 "each further image adds", "largest batch within 2GB: ", "plan/measured"):
        assert text in out, text
    ratio = float(out.rsplit("plan/measured", 1)[1])
    assert 0.85 <= ratio <= 1.15


@pytest.mark.parametrize("routing,layers", [("attention", ("classcaps",)),
                                            ("em", ("primary", "convcaps1", "convcaps2", "classcaps"))])
def test_plan_command_plans_every_routings_network(routing, layers, capsys):
    """Each routing's own network, with its own defaults (EM: conv1 of 32 channels, 5x5/2)."""
    from pycapsnet.core.model import CapsNet, CapsNetConfig

    assert cli.main(["plan", "--routing", routing, "--batch-size", "4", "--measure"]) == 0
    out = capsys.readouterr().out
    n_params = sum(int(p.size) for p in CapsNet("numpy", CapsNetConfig(routing=routing)).params.values())
    assert f"{routing} routing" in out.splitlines()[0] or "EM routing" in out.splitlines()[0]
    assert f"parameters: {n_params:,}" in out
    for name in layers:
        assert f"\n{name} " in out, name
    assert 0.85 <= float(out.rsplit("plan/measured", 1)[1]) <= 1.15


@pytest.mark.parametrize("argv,words", [
    (["--routing", "em", "--share-spatial"], "--share-spatial does nothing with --routing em"),
    (["--routing", "attention", "--routing-iters", "2"], "--routing-iters does nothing with --routing attention"),
    (["--memory", "80XB"], "cannot read memory size '80XB'"),
    (["--memory=-1GB"], "cannot read memory size"),
    (["--input-shape", "1", "10", "10"], "smaller than the receptive field"),
    (["--memory", "1KB"], "none: not even one image fits; --share-spatial and --primary-conv im2col shrink the step"),
])
def test_plan_command_bad_input_is_one_line(argv, words, capsys):
    rc = cli.main(["plan", *argv])
    out, err = capsys.readouterr()
    if "not even one" in words:
        assert rc == 0 and words in out
    else:
        assert rc == 2 and words in err and len(err.strip().splitlines()) == 1

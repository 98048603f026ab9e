"""EM routing (matrix capsules) and self-attention routing: finite differences in float64, the
autograd oracle, NumPy against PyTorch (float64 and float32) and the GPUs, numerical safety in both
float dtypes, and the assignment normalisation over every parent that receives a child."""
import numpy as np
import pytest

from pycapsnet import backends
from pycapsnet import CapsNet
from pycapsnet.tools import gradcheck
from pycapsnet.core.em_routing import em_backward, em_forward
from pycapsnet.core.matrix_capsules import ClassMatrixCaps, ConvMatrixCaps, WindowGroup
from pycapsnet.core.capsules import AttentionCaps
from pycapsnet.tools.gradcheck import SMALL_BY_ROUTING
from tests.conftest import CPU_BACKENDS, GPU_BACKENDS, assert_close
from tests.test_cross_backend import _run as run_step
from tests.test_gradcheck import _assert_all_pass

B64 = backends.get("numpy", dtype="float64")
RTOL = {"float64": 1e-9, "float32": 1e-4}
ROUTED = [("em", "full"), ("em", "final"), ("attention", "full")]


# ---- finite differences ---------------------------------------------------------------------------
def test_em_layers_finite_differences():
    results = gradcheck.em_layer_checks(B64, samples=20)
    assert {r.layer for r in results} >= {"PrimaryMatrixCaps", "ConvMatrixCaps 3x3/2 routing=full",
                                          "ConvMatrixCaps 3x3/2 routing=final", "ClassMatrixCaps routing=full",
                                          "ClassMatrixCaps routing=final", "SpreadLoss"}
    assert {r.tensor for r in results} >= {"input0", "input1", "W", "beta_u", "lambda_beta_a"}
    _assert_all_pass(results)


def test_attention_layers_finite_differences():
    results = gradcheck.attention_layer_checks(B64, samples=20)
    assert {r.layer for r in results} >= {"squash_exp", "squash_exp near 0", "AttentionCaps", "AttentionCaps shared"}
    _assert_all_pass(results)


@pytest.mark.parametrize("routing,mode", ROUTED + [("attention", "shared")])
def test_whole_loss_finite_differences(routing, mode):
    config = {"share_spatial": True} if mode == "shared" else {"routing_grad": mode}
    results = gradcheck.model_checks(B64, samples=10, routing=routing, **config)
    names = {r.tensor for r in results}
    assert "input" in names and "decoder3.W" in names
    if routing == "em":
        assert names >= {"primary.W", "convcaps1.W", "convcaps2.beta_u", "classcaps.lambda_beta_a"}
    else:
        assert "classcaps.bias" in names
    _assert_all_pass(results)


def test_more_iterations_and_a_sharper_temperature():
    _assert_all_pass(gradcheck.model_checks(B64, samples=8, routing="em", routing_iters=5, em_lambda=0.2, seed=4))


def test_the_check_catches_a_wrong_em_backward(monkeypatch):
    """The E-step's softmax backward off by 1% is caught."""
    from pycapsnet.core import em_routing

    orig = em_routing.em_backward

    def wrong(*a, **k):
        dV, da, dbu, dba = orig(*a, **k)
        return dV, da, dbu, 1.01 * dba

    monkeypatch.setattr("pycapsnet.core.matrix_capsules.em_backward", wrong)
    results = gradcheck.em_layer_checks(B64, samples=5)
    assert any(not r.passed and r.tensor == "lambda_beta_a" for r in results)


# ---- the autograd oracle --------------------------------------------------------------------------
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("routing,mode", ROUTED + [("attention", "shared")])
def test_gradients_match_autograd(backend, routing, mode):
    pytest.importorskip("torch", reason="the autograd oracle needs PyTorch")
    from tests.test_autograd_oracle import assert_matches_autograd

    config = {**SMALL_BY_ROUTING[routing], **({"share_spatial": True} if mode == "shared" else {"routing_grad": mode})}
    model = CapsNet(backends.get(backend, dtype="float64"), seed=2, **config)
    for _, layer in model.layers():  # parameters away from their initial zeros and small values
        for p in layer.params.values():
            p += model.B.asarray(0.2 * np.random.default_rng(3).standard_normal(tuple(p.shape)))
    rng = np.random.default_rng(5)
    x = rng.random((4, *model.config.input_shape))
    # EM at 1e-10 of each tensor's largest entry (test_em_precision.py has the case where 1e-8 was too loose)
    assert_matches_autograd(model, x, rng.integers(0, model.config.n_classes, 4), 1e-10 if routing == "em" else 1e-8)


# ---- across backends ----------------------------------------------------------------------------
def _run(spec, dtype, routing, mode, n=4):
    """Outputs and gradients of one train step (test_cross_backend's) of the small network of ``routing``."""
    res = run_step(spec, dtype, mode, config=SMALL_BY_ROUTING[routing], n=n)
    del res["predict"]
    return res


def _compare(a, b, dtype, routing):
    from pycapsnet.tools.crosscheck import EM_FLOAT32_TOLERANCE  # why EM's float32 is looser: see there

    rtol = EM_FLOAT32_TOLERANCE if routing == "em" and dtype == "float32" else RTOL[dtype]
    assert a.keys() == b.keys()
    for k in a:
        assert_close(a[k], b[k], rtol, what=k)


def test_em_float32_is_as_close_to_float64_on_each_backend():
    """What the looser EM float32 tolerance stands for: each backend's float32 step is within it of
    the float64 step, so neither side is the odd one out."""
    pytest.importorskip("torch", reason="cross-backend checks need PyTorch")
    exact = _run("numpy", "float64", "em", "full")
    for spec in ("numpy", "torch"):
        _compare(_run(spec, "float32", "em", "full"), exact, "float32", "em")


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("routing,mode", ROUTED)
def test_numpy_vs_torch(dtype, routing, mode):
    pytest.importorskip("torch", reason="cross-backend checks need PyTorch")
    _compare(_run("torch", dtype, routing, mode), _run("numpy", dtype, routing, mode), dtype, routing)


@pytest.mark.parametrize("spec", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("routing,mode", ROUTED)
def test_gpu_vs_numpy(spec, dtype, routing, mode):
    _compare(_run(spec, dtype, routing, mode), _run("numpy", dtype, routing, mode), dtype, routing)


# ---- what EM routing computes ---------------------------------------------------------------------
def test_a_child_shares_its_assignment_over_every_parent_that_receives_it():
    """ConvMatrixCaps: each child's R sums to 1 over the parents of every type at every position whose
    window holds it -- not to 1 per position, which would drop the competition between positions."""
    rng = np.random.default_rng(0)
    layer = ConvMatrixCaps(B64, 2, 3, kernel=3, stride=1, iters=3, rng=rng)
    M, a = rng.standard_normal((2, 6, 6, 2, 16)), rng.uniform(0.1, 0.9, (2, 6, 6, 2))
    layer.forward((M, a))
    group = WindowGroup(B64, (2, 6, 6, 2), 3, 1)
    for R in layer.assignments:                          # (N, P, I, C)
        per_child = group.sum(R.sum(-1))                 # every slot holds its child's total
        np.testing.assert_allclose(per_child, 1, rtol=1e-12)
        assert not np.allclose(R.sum(-1), 1)            # per slot (one position) it is not 1
    # the centre child of a 6x6 grid with 3x3/1 windows sits in 9 windows: R^0 = 1 / (9 * 3)
    R0 = layer.assignments[0].reshape(2, 4, 4, 3, 3, 2, 3)
    assert R0[0, 1, 1, 1, 1, 0, 0] == pytest.approx(1 / 27)


def test_em_routing_runs_its_e_step_only_between_m_steps():
    rng = np.random.default_rng(1)
    V, a_in = rng.standard_normal((2, 1, 5, 3, 16)), rng.uniform(0.2, 0.8, (2, 1, 5))
    zeros = np.zeros(3)
    _, _, trace = em_forward(B64, V, a_in, zeros, zeros, [0.1, 0.2, 0.3])
    assert len(trace) == 3  # three M-steps, hence two E-steps: R^0 (uniform), R^1, R^2
    np.testing.assert_allclose(trace[0][0], 1 / 3)
    assert not np.allclose(trace[2][0], trace[1][0])


# ---- numerical safety -----------------------------------------------------------------------------
def _finite(B, *arrays):
    return all(B.all_finite(a) for a in arrays)


def _em_case(case, rng):
    """(V (N, 1, I, C, 16), a_in (N, 1, I)) of one hard case."""
    V, a = rng.standard_normal((2, 1, 6, 3, 16)), rng.uniform(0.2, 0.8, (2, 1, 6))
    if case == "zero activations":
        a[:] = 0
    elif case == "identical votes":       # σ² -> ε
        V[:] = V[:, :, :1]
    elif case == "a single child":
        V, a = V[:, :, :1], a[:, :, :1]
    elif case == "very large poses":
        V *= 1e4
    return V, a


CASES = ["zero activations", "identical votes", "a single child", "very large poses"]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("backend", CPU_BACKENDS + GPU_BACKENDS)
def test_log_sigmoid_is_exact_and_finite(backend, dtype):
    """ln sigmoid(z) against -ln(1 + e^-z) computed by NumPy in float64 (logaddexp), across the range
    where sigmoid(z) rounds to 0 or 1."""
    from pycapsnet.core.em_routing import log_sigmoid

    B = backends.get(backend, dtype=dtype)
    z = np.concatenate([-np.logspace(4, -6, 41), [0.0], np.logspace(-6, 4, 41)])
    got = B.to_numpy(log_sigmoid(B.xp, B.asarray(z)))
    expected = -np.logaddexp(0.0, -z.astype(dtype).astype(np.float64))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, expected, rtol={"float32": 1e-6, "float64": 1e-14}[dtype], atol=1e-30)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mode", ["full", "final"])
def test_em_routing_stays_finite(dtype, case, mode):
    B = backends.get("numpy", dtype=dtype)
    rng = np.random.default_rng(2)
    V, a = (B.asarray(t) for t in _em_case(case, rng))
    beta = B.asarray(rng.standard_normal(3))
    lambdas = [0.01, 0.1, 1.0]
    with np.errstate(over="raise", invalid="raise", divide="raise"):  # underflow to 0 is fine
        mu, act, trace = em_forward(B, V, a, beta, beta, lambdas)
        grads = em_backward(B, V, a, beta, lambdas, trace, B.asarray(rng.standard_normal(tuple(mu.shape))),
                            B.asarray(rng.standard_normal(tuple(act.shape))), mode=mode)
    assert _finite(B, mu, act, *[t for step in trace for t in step], *grads), case


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", CASES)
def test_em_layers_stay_finite(dtype, case):
    """The same cases through ConvMatrixCaps (children shared by windows) and ClassMatrixCaps."""
    B = backends.get("numpy", dtype=dtype)
    rng = np.random.default_rng(3)
    M, a = rng.standard_normal((2, 5, 5, 2, 16)), rng.uniform(0.2, 0.8, (2, 5, 5, 2))
    if case == "zero activations":
        a[:] = 0
    elif case == "identical votes":
        M[:] = 0                                          # every vote is 0 (W 0 would do too)
    elif case == "a single child":
        M, a = M[:, :3, :3, :1], a[:, :3, :3, :1]         # one window, one type: 9 slots, no overlap
    elif case == "very large poses":
        M *= 1e4
    conv = ConvMatrixCaps(B, M.shape[3], 3, kernel=3, stride=1, rng=rng)
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        M2, a2 = conv.forward((B.asarray(M), B.asarray(a)))
        cls = ClassMatrixCaps(B, tuple(M2.shape[1:3]), 3, 4, rng=rng)
        v, act = cls.forward((M2, a2))
        d = cls.backward((B.asarray(rng.standard_normal(tuple(v.shape))), B.asarray(rng.standard_normal(tuple(act.shape)))))
        dM, da = conv.backward(d)
    assert _finite(B, M2, a2, v, act, dM, da, *conv.grads.values(), *cls.grads.values()), case


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", ["zero predictions", "identical votes", "a single child", "very large poses"])
def test_attention_routing_stays_finite(dtype, case):
    B = backends.get("numpy", dtype=dtype)
    rng = np.random.default_rng(4)
    positions, types = (1, 1) if case == "a single child" else (4, 2)
    layer = AttentionCaps(B, positions, types, 4, 3, 5, rng=rng)
    u = rng.standard_normal((3, positions, types, 4))
    if case == "zero predictions":        # s_j = 0: the squash at its singular point
        u[:] = 0
    elif case == "identical votes":
        u[:] = u[:1, :1, :1]
    elif case == "very large poses":
        u *= 1e4
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        v = layer.forward(B.asarray(u))
        du = layer.backward(B.asarray(rng.standard_normal(tuple(v.shape))))
    assert _finite(B, v, du, *layer.grads.values()), case


# ---- the networks -----------------------------------------------------------------------------------
def test_the_papers_em_network_builds():
    """A=32, B=8, C=D=16, 3 iterations; on 28x28 digits: 12x12 primary, 5x5 and 3x3 convolutional capsules.
    The default differs only in routing 2 times (the 3-iteration network learns slowly on the embedded digits)."""
    assert CapsNet("numpy", routing="em").config.routing_iters == 2
    model = CapsNet("numpy", routing="em", routing_iters=3)
    c = model.config
    assert (c.conv_channels, c.conv_kernel, c.conv_stride, c.primary_types, c.matrix_types, c.routing_iters) == \
        (32, 5, 2, 8, (16, 16), 3)
    assert model.params["convcaps1.W"].shape == (72, 16, 4, 4)
    assert model.params["classcaps.W"].shape == (16, 10, 4, 4)
    out = model.loss(np.random.default_rng(0).random((2, 1, 28, 28)), [1, 2])
    assert out.v.shape == (2, 10, 16) and set(out.parts) == {"spread", "reconstruction"}


def test_switching_routing_takes_the_new_routings_defaults():
    from pycapsnet.core.model import CapsNetConfig

    em = CapsNetConfig().replace(routing="em")
    assert (em.conv_channels, em.primary_types) == (32, 8)
    assert CapsNetConfig().replace(routing="em", conv_channels=64).conv_channels == 64


def test_spread_loss_margin_schedule_reaches_the_step():
    model = CapsNet(B64, seed=0, **SMALL_BY_ROUTING["em"])
    rng = np.random.default_rng(0)
    x, y = rng.random((3, 1, 12, 12)), np.array([0, 1, 2])
    losses = []
    for epoch in (0, 3, 20):
        model.set_epoch(epoch)
        losses.append(model.loss(x, y).parts["spread"])
    assert float(model.class_loss.margin) == pytest.approx(0.9)
    assert losses[0] < losses[1] < losses[2]  # a wider margin, a larger loss on the same activations


# ---- the trainer and the commands ----------------------------------------------------------------
SMALL_EM_FLAGS = ["--conv-channels", "8", "--primary-types", "4"]
QUICK_DATA = ["--limit", "64", "--limit-test", "32", "--no-progress", "--batch-size", "32"]


@pytest.mark.parametrize("routing", ["em", "attention"])
def test_train_resume_evaluate_and_inspect(routing, tmp_path):
    """--routing selects the network; the run checkpoints, resumes to the uninterrupted run's weights,
    and the checkpoint is evaluated and inspected with its own network."""
    import json
    import os

    from pycapsnet.training import checkpoint, trainer

    from pycapsnet.tools import cli

    flags = ["--routing", routing, *(SMALL_EM_FLAGS if routing == "em" else ["--conv-channels", "16", "--primary-types", "4"])]
    out, straight = str(tmp_path / "run"), str(tmp_path / "straight")
    assert trainer.main("numpy", flags + QUICK_DATA + ["--epochs", "1", "--out", out]) == 0
    assert trainer.main("numpy", ["--no-progress", "--epochs", "2", "--resume", out]) == 0
    assert trainer.main("numpy", flags + QUICK_DATA + ["--epochs", "2", "--out", straight]) == 0
    a, b = checkpoint.load(out), checkpoint.load(straight)
    assert a["header"]["config"]["routing"] == routing
    for k in a["params"]:
        np.testing.assert_allclose(a["params"][k], b["params"][k], rtol=1e-6, atol=1e-7, err_msg=k)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert [json.loads(line)["epoch"] for line in f] == [1, 2]
    assert cli.main(["evaluate", out, "--limit-test", "32"]) == 0
    pictures = str(tmp_path / "inspect")
    assert cli.main(["inspect", out, "--out", pictures]) == 0
    names = ["reconstructions.png", "perturbation.png", "coupling.png"] + (["activations.png"] if routing == "em" else [])
    for name in names:
        with open(os.path.join(pictures, name), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", name
    c = np.load(os.path.join(pictures, "coupling.npz"))
    if routing == "em":  # R_ij of the class layer per iteration; each child's sums to 1 over the classes
        from pycapsnet.core.model import CapsNetConfig
        assert len(c.files) == CapsNetConfig(routing="em").routing_iters
        for name in c.files:
            np.testing.assert_allclose(c[name].sum(1), 1.0, rtol=1e-5)


def test_a_checkpoint_of_another_routing_is_refused_on_resume(tmp_path, capsys):
    from pycapsnet.training import trainer

    out = str(tmp_path / "run")
    assert trainer.main("numpy", ["--routing", "em", *SMALL_EM_FLAGS, *QUICK_DATA, "--epochs", "1", "--out", out]) == 0
    assert trainer.main("numpy", ["--routing", "dynamic", "--epochs", "2", "--resume", out, "--no-progress"]) != 0
    assert "--routing dynamic (the checkpoint has em)" in capsys.readouterr().err


def test_gradcheck_and_crosscheck_take_the_routing(capsys):
    from pycapsnet.tools import cli

    assert cli.main(["gradcheck", "--routing", "em", "--samples", "4"]) == 0
    out = capsys.readouterr().out
    assert "ConvMatrixCaps 3x3/2 routing=full" in out and "CapsNet em routing=final" in out and "0 failed" in out
    assert "ClassCaps routing" not in out  # only the EM checks
    assert cli.main(["crosscheck", "--routing", "attention", "--batch", "2"]) == 0
    assert "classcaps.bias" in capsys.readouterr().out


@pytest.mark.parametrize("spec", CPU_BACKENDS + GPU_BACKENDS)
@pytest.mark.parametrize("routing", ["em", "attention"])
def test_captured_step_equals_the_step_op_by_op(spec, routing):
    """The step a GPU records as a graph (re-run with host transfers refused on the CPU) computes what
    the step op by op does, and a new spread-loss margin reaches the recording."""
    from pycapsnet.training import optim
    from pycapsnet.training.graph import CapturedStep

    B = backends.get(spec, dtype="float64")
    config = SMALL_BY_ROUTING[routing]
    eager, rec = CapsNet(B, seed=5, **config), CapsNet(B, seed=5, **config)
    opt_e, opt_r = optim.make("adam", eager, 1e-2), optim.make("adam", rec, 1e-2)
    step = CapturedStep(rec, opt_r, batch_size=3)
    rng = np.random.default_rng(0)
    for k in range(3):
        if k == 2:
            eager.set_epoch(4), rec.set_epoch(4)
        x, y = rng.random((3, *eager.config.input_shape)), rng.integers(0, eager.config.n_classes, 3)
        out_e = eager.train_step_grads(x, y)
        opt_e.step()
        assert step(x, y).loss == pytest.approx(out_e.loss, rel=1e-12, abs=0)
    for k, p in eager.params.items():
        np.testing.assert_allclose(B.to_numpy(rec.params[k]), B.to_numpy(p), rtol=1e-12, atol=1e-14, err_msg=k)


def test_evaluation_releases_what_the_em_network_kept():
    """After predict no backward follows: the votes, the window slots and every iteration's R must not
    be carried into the next train step."""
    m = CapsNet("numpy", seed=0, **SMALL_BY_ROUTING["em"])
    x = np.random.default_rng(0).random((2, 1, 12, 12))
    m.forward(x)
    layers = [m.primary, m.primary.linear, *m.convcaps, m.classcaps]
    assert all(layer.cache is not None for layer in layers) and m.classcaps.trace is not None
    m.predict(x)
    assert all(layer.cache is None for layer in layers)
    assert all(layer.trace is None for layer in (*m.convcaps, m.classcaps))


def test_a_saturated_parent_keeps_its_exact_tiny_gradient():
    """a_j = sigmoid(z_j) rounds to 1 once z_j > ~37: its slope is e^-z, not 1 - a_j = 0.  The
    backward takes it from z; autograd of the same routing (log-sigmoid, float64) is the oracle."""
    torch = pytest.importorskip("torch", reason="the autograd oracle needs PyTorch")
    rng = np.random.default_rng(3)
    V, a_in = rng.standard_normal((2, 1, 5, 3, 16)), rng.uniform(0.2, 0.8, (2, 1, 5))
    beta_u, beta_a, lambdas = np.full(3, 0.1), np.array([60.0, 0.5, -0.5]), [0.7, 1.0]  # parent 0: z ~ 50
    mu, a, trace = em_forward(B64, V, a_in, beta_u, beta_a, lambdas)
    assert a[..., 0].min() == 1.0 and trace[-1][4][..., 0].min() > 40
    gmu, ga = rng.standard_normal(mu.shape), rng.standard_normal(a.shape)
    _, _, dbeta_u, dbeta_a = em_backward(B64, V, a_in, beta_u, lambdas, trace, gmu, ga)

    Vt, at = torch.tensor(V), torch.tensor(a_in)
    bu, ba = torch.tensor(beta_u, requires_grad=True), torch.tensor(beta_a, requires_grad=True)
    R = torch.full((2, 1, 5, 3), 1 / 3, dtype=torch.float64)
    for t, lam in enumerate(lambdas):
        Rp = R * at[..., None]
        r = Rp.sum(2)
        w = Rp / (r[:, :, None] + 1e-6)
        m = torch.einsum("npic,npich->npch", w, Vt)
        var = torch.einsum("npic,npich->npch", w, (Vt - m[:, :, None]) ** 2) + 1e-6
        z = lam * (ba - r * (16 * bu + 0.5 * torch.log(var).sum(-1)))
        if t < len(lambdas) - 1:
            ln_p = -(((Vt - m[:, :, None]) ** 2) / (2 * var[:, :, None]) + 0.5 * torch.log(var[:, :, None])).sum(-1)
            R = torch.softmax(torch.nn.functional.logsigmoid(z)[:, :, None] + ln_p, dim=-1)
    ((m * torch.tensor(gmu)).sum() + (torch.sigmoid(z) * torch.tensor(ga)).sum()).backward()
    assert 0 < abs(ba.grad[0].item()) < 1e-15  # the saturated parent's slope: tiny, and not zero
    np.testing.assert_allclose(dbeta_a, ba.grad.numpy(), rtol=1e-6, atol=0)
    np.testing.assert_allclose(dbeta_u, bu.grad.numpy(), rtol=1e-8)


def test_coordinate_addition_adds_row_then_column_as_the_paper_says():
    from pycapsnet.core.matrix_capsules import ClassMatrixCaps

    layer = ClassMatrixCaps(B64, (3, 5), 2, 4, rng=np.random.default_rng(0))
    rng = np.random.default_rng(1)
    M, a = rng.standard_normal((2, 3, 5, 2, 16)), rng.uniform(0.1, 0.9, (2, 3, 5, 2))
    layer.forward((M, a))
    V = layer.cache[1].reshape(2, 3, 5, 2, 4, 16)                      # the votes routed: (N, GH, GW, T, J, 16)
    plain, _ = B64.votes(M.reshape(2, 15, 2, 16), layer.params["W"])  # M_i W_ij alone
    offsets = V - plain.reshape(V.shape)                              # the same for every sample, type and class
    np.testing.assert_allclose(offsets[..., 3], np.broadcast_to(((np.arange(3) + 0.5) / 3)[:, None, None, None],
                                                                (2, 3, 5, 2, 4)), atol=1e-15)   # (0, 3): the row
    np.testing.assert_allclose(offsets[..., 7], np.broadcast_to(((np.arange(5) + 0.5) / 5)[None, :, None, None],
                                                                (2, 3, 5, 2, 4)), atol=1e-15)   # (1, 3): the column
    assert not np.delete(offsets, [3, 7], axis=-1).any()              # no other entry moves

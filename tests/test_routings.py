"""The routing family (issue 89): uniform and random coupling, inverted dot-product attention,
self-routing and variational Bayes routing, in the fully connected and the convolutional capsule
layer.  Each backward against PyTorch autograd on an independent formulation
(tools/reference_routings.py) in float64, numpy against torch, the torch wrapper's gradcheck, the
built-in network per routing (bit-for-bit from its seed), compositions, and bad options in one line.
Finite differences of every layer and network: tests/test_gradcheck.py and the checks here."""
import json

import numpy as np
import pytest

import pycapsnet
from pycapsnet import CapsNetError, backends
from pycapsnet.core import architecture as A
from pycapsnet.core.capsules import ClassCaps
from pycapsnet.core.conv_caps import ConvCaps
from pycapsnet.core import routings
from pycapsnet.tools import gradcheck
from tests.conftest import GPU_BACKENDS, assert_close

torch = pytest.importorskip("torch", reason="autograd is the oracle, and the torch backend a second backend")
from pycapsnet.tools import reference_routings as ref  # noqa: E402

ROUTED = ("uniform", "random", "inverted", "self", "vb")
CASES = [(r, m) for r in ROUTED for m in (routings.get(r).modes if routings.get(r).iterated else ("full",))]
B64 = backends.get("numpy", dtype="float64")


def _layer(B, routing, mode, conv, share=False, seed=0):
    """A layer of the routing with parameters away from their init, the same on every backend."""
    rng = np.random.default_rng(seed)
    if conv:
        layer = ConvCaps(B, (5, 5), 2, 3, 3, 4, kernel=3, stride=2, routing=routing, routing_grad=mode, rng=rng)
    else:
        layer = ClassCaps(B, positions=4, types=2, in_dim=3, n_classes=3, out_dim=4, routing=routing,
                          routing_grad=mode, share_spatial=share, rng=rng)
    init = np.random.default_rng(seed + 1)
    for k, p in layer.params.items():
        p[...] = B.asarray((1.0 if k == "gamma" else 0.0) + 0.5 * init.standard_normal(tuple(p.shape)))
    return layer


def _input(conv, seed=0):
    rng = np.random.default_rng(seed + 2)
    return 0.5 * rng.standard_normal((2, 25, 2, 3) if conv else (3, 4, 2, 3))


def _reference(layer, x, routing, mode, conv):
    """(v, {name: gradient}) of L = Σ v * R by autograd on reference_routings, from the layer's values."""
    t = lambda a: torch.tensor(np.asarray(B64.to_numpy(a) if not isinstance(a, np.ndarray) else a),
                               dtype=torch.float64, requires_grad=True)
    params = {k: t(p) for k, p in layer.params.items()}
    xt = t(x)
    if conv:
        n = x.shape[0]
        grid = xt.reshape(n, 5, 5, 2 * 3).permute(0, 3, 1, 2)                       # (N, T*K, H, W)
        cols = torch.nn.functional.unfold(grid, 3, stride=2)                        # (N, T*K*9, P)
        P = cols.shape[-1]
        # unfold orders a column (channel, kernel row, kernel column); the layer's slots are (row, column, type)
        u = cols.reshape(n, 2, 3, 3, 3, P).permute(0, 5, 3, 4, 1, 2).reshape(n * P, 18, 3)
        W = params["W"]                                                              # (I, C, D, K)
        per_child = {k: params[k] for k in ("W_route", "b_route") if k in params}
    else:
        n, P = x.shape[0], 1
        u = xt.reshape(n, 8, 3)
        lead = lambda p: p.expand(4, 2, *p.shape[2:]).reshape(8, *p.shape[2:])
        W = lead(params["W"])                                                        # (I, J, D, K)
        per_child = {k: lead(params[k]) for k in ("W_route", "b_route") if k in params}
    u_hat = ref.votes(W, u)
    fixed = None
    if routing == "random":
        fixed = torch.tensor(B64.to_numpy(layer.drawn)).permute(0, 2, 1)             # (N, I, J)
    v = ref.route(routing, u_hat, u, {**params, **per_child}, layer.iters, layer.algo.options if layer.algo else {},
                  fixed=fixed, final=mode == "final")
    v = v.reshape(n, P, *v.shape[1:]) if conv else v
    R = torch.tensor(np.random.default_rng(9).standard_normal(tuple(v.shape)))
    (v * R).sum().backward()
    return v.detach().numpy(), R.numpy(), {"input": xt.grad.numpy(), **{k: p.grad.numpy() for k, p in params.items()}}


@pytest.mark.parametrize("conv", [False, True])
@pytest.mark.parametrize("routing, mode", CASES)
def test_each_backward_is_autograds_on_an_independent_formulation(routing, mode, conv):
    layer = _layer(B64, routing, mode, conv)
    x = _input(conv)
    v = layer.forward(B64.asarray(x))
    v_ref, R, grads = _reference(layer, x, routing, mode, conv)
    np.testing.assert_allclose(B64.to_numpy(v), v_ref, rtol=1e-10, atol=1e-12)
    layer.zero_grad()
    dx = layer.backward(B64.asarray(R))
    np.testing.assert_allclose(dx, grads["input"], rtol=1e-9, atol=1e-12)
    for k, g in layer.grads.items():
        np.testing.assert_allclose(B64.to_numpy(g), grads[k], rtol=1e-9, atol=1e-12, err_msg=k)


@pytest.mark.parametrize("routing", ["self", "inverted"])
def test_shared_transforms_sum_their_gradients_over_positions(routing):
    layer = _layer(B64, routing, "full", conv=False, share=True)
    x = _input(False)
    layer.forward(B64.asarray(x))
    _, R, grads = _reference(layer, x, routing, "full", False)
    layer.zero_grad()
    np.testing.assert_allclose(layer.backward(B64.asarray(R)), grads["input"], rtol=1e-9, atol=1e-12)
    for k, g in layer.grads.items():
        np.testing.assert_allclose(B64.to_numpy(g), grads[k], rtol=1e-9, atol=1e-12, err_msg=k)


@pytest.mark.parametrize("spec", ["torch"] + GPU_BACKENDS)
@pytest.mark.parametrize("conv", [False, True])
@pytest.mark.parametrize("routing, mode", CASES)
def test_numpy_and_the_other_backends_agree(routing, mode, conv, spec):
    """The layer on torch (CPU), CuPy and torch:cuda against NumPy's, float64: output, input and
    parameter gradients, and random routing's draw."""
    T64 = backends.get(spec, dtype="float64")
    a, b = _layer(B64, routing, mode, conv), _layer(T64, routing, mode, conv)
    x = _input(conv)
    va, vb = a.forward(B64.asarray(x)), b.forward(T64.asarray(x))
    if routing == "random":  # the same seed draws the same coefficients on every backend
        np.testing.assert_array_equal(B64.to_numpy(a.drawn), T64.to_numpy(b.drawn))
    assert_close(T64.to_numpy(vb), B64.to_numpy(va), 1e-10, f"{spec} v")
    R = np.random.default_rng(3).standard_normal(tuple(va.shape))
    a.zero_grad(), b.zero_grad()
    assert_close(T64.to_numpy(b.backward(T64.asarray(R))), a.backward(B64.asarray(R)), 1e-10, f"{spec} input")
    for k in a.grads:
        assert_close(T64.to_numpy(b.grads[k]), B64.to_numpy(a.grads[k]), 1e-10, f"{spec} grad {k}")


@pytest.mark.parametrize("routing", ["inverted", "self", "vb"])
def test_the_torch_wrapper_passes_gradcheck(routing):
    import pycapsnet.torch as pct

    T64 = backends.get("torch", dtype="float64")
    caps = pct.Layer(_layer(T64, routing, "full", conv=False))
    x = torch.tensor(_input(False), dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(caps, (x,), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("routing", ROUTED)
def test_each_built_in_network_passes_its_full_loss_check(routing):
    results = gradcheck.model_checks(B64, samples=6, routing=routing)
    bad = [f"{r.layer} / {r.tensor}: {r.max_rel:.2e}" for r in results if not r.passed]
    assert results and not bad, bad


def test_compositions_stack_the_routings_with_dynamic_routing_and_pass():
    results = gradcheck.routing_composed_checks(B64, samples=5)
    labels = {r.layer for r in results}
    assert "self under dynamic" in labels and "inverted with its head routing=final" in labels
    bad = [f"{r.layer} / {r.tensor}: {r.max_rel:.2e}" for r in results if not r.passed]
    assert not bad, bad


def test_the_check_catches_a_wrong_layer_norm_backward(monkeypatch):
    """The oracle can fail: a layer norm backward that leaves out its mean term is reported."""
    from pycapsnet.core import inverted_routing

    real = inverted_routing.layer_norm_backward

    def wrong(xp, saved, gamma, dy):
        dx, dg, db = real(xp, saved, gamma, dy)
        return dx + xp.mean(dy * gamma, axis=-1, keepdims=True) * saved[1], dg, db

    monkeypatch.setattr(inverted_routing, "layer_norm_backward", wrong)
    layer = _layer(B64, "inverted", "full", conv=False)
    x = _input(False)
    layer.forward(B64.asarray(x))
    _, R, grads = _reference(layer, x, "inverted", "full", False)
    layer.zero_grad()
    assert not np.allclose(layer.backward(B64.asarray(R)), grads["input"], rtol=1e-6)


@pytest.mark.parametrize("routing", ROUTED)
def test_each_built_in_network_trains_and_reproduces_bit_for_bit_from_its_seed(routing, tmp_path):
    (x, y), _ = pycapsnet.load_digits()
    runs = []
    for k in range(2):
        model = pycapsnet.build(routing, seed=3, conv_channels=8, primary_types=4)
        model.fit(x[:48], y[:48], epochs=1, batch_size=16, progress=False)
        runs.append(model.network.state_dict())
    assert runs[0].keys() == runs[1].keys()
    for k in runs[0]:
        np.testing.assert_array_equal(runs[0][k], runs[1][k])


def test_descriptions_hold_the_routing_and_survive_json():
    net = A.network([A.conv2d(6, 3), A.relu(), A.primary_caps(2, 4, 3, 2),
                     A.conv_caps(3, 4, routing="vb", psi0=2.0, iters=2),
                     A.dynamic_caps(3, 6, routing="inverted", scaled=False), A.capsule_logits()],
                    head="logits", decoder=None, input_shape=(1, 13, 13), n_classes=3)
    again = json.loads(json.dumps(net))
    a, b = A.build(net, B64, seed=1), A.build(again, B64, seed=1)
    assert a.params.keys() == b.params.keys() and "conv_caps1.psi0" not in a.params
    assert b.body["dynamic_caps1"].algo.options == {"scaled": False}
    assert b.body["conv_caps1"].algo.options["psi0"] == 2.0 and b.body["conv_caps1"].iters == 2


BAD = [
    (dict(routing="magic"), "routing must be one of"),
    (dict(routing="self", iters=3), "routes in one pass"),
    (dict(routing="self", routing_grad="final"), "has no gradient mode 'final'"),
    (dict(routing="vb", psi0=0), "psi0 must be a finite number"),
    (dict(routing="vb", kappa0=-1), "kappa0 must be a finite number"),
    (dict(routing="vb", nu0=2.0), "nu0 must be above dim - 1"),
    (dict(routing="inverted", alpha0=1.0), "alpha0 is an option of routing 'vb'"),
    (dict(routing="dynamic", scaled=True), "scaled is an option of routing 'inverted'"),
    (dict(routing="inverted", scaled="yes"), "scaled must be true or false"),
    (dict(routing="inverted", iters=40), "iters must be a whole number from 1 to 32"),
    (dict(routing="inverted", bias=0.1), "takes none"),
    (dict(routing="vb", psi0=1e-300), r"psi0 must be a finite number in \[0.0001, 10000\]"),
    (dict(routing="vb", nu0=1e6), "nu0 must be above dim - 1 = 5 .* and at most"),
]


@pytest.mark.parametrize("option", [dict(alpha0=1e-4), dict(alpha0=1e4), dict(kappa0=1e-4), dict(kappa0=1e4),
                                    dict(psi0=1e-4), dict(psi0=1e4), dict(vb_lambda=1e-4), dict(vb_lambda=1e4),
                                    dict(nu0=5.0001), dict(nu0=5 + 1e4)])
def test_vb_priors_at_their_bounds_train_in_float32(option):
    """95.11: every prior the check allows keeps a float32 run finite (psi0 1e-300 ended in a NaN loss)."""
    net = A.build(A.network([A.conv2d(4, 3), A.relu(), A.primary_caps(2, 4, 3, 2),
                             A.dynamic_caps(3, 6, routing="vb", name="classcaps", **option)],
                            input_shape=(1, 13, 13), n_classes=3), backends.get("numpy"))
    rng = np.random.default_rng(0)
    x, y = rng.random((8, 1, 13, 13)).astype(np.float32), rng.integers(0, 3, 8)
    from pycapsnet.training import optim

    opt = optim.make("adam", net, 2e-3)
    with np.errstate(over="raise", invalid="raise", divide="raise"):  # (underflow to 0 is fine)
        for _ in range(5):
            assert np.isfinite(net.train_step_grads(x, y).loss)
            opt.step()
    assert all(np.isfinite(p).all() for p in net.params.values())


@pytest.mark.parametrize("options, said", BAD)
def test_bad_routing_options_are_refused_at_build_naming_the_layer(options, said):
    net = A.network([A.conv2d(4, 3), A.relu(), A.primary_caps(2, 4, 3, 2),
                     A.dynamic_caps(3, 6, name="classcaps", **options)], input_shape=(1, 13, 13), n_classes=3)
    with pytest.raises(CapsNetError, match=said) as e:
        A.build(net, B64)
    assert "classcaps" in str(e.value) and "\n" not in str(e.value)


def test_zero_parents_and_a_misfit_head_are_refused():
    with pytest.raises(CapsNetError, match="capsules must be a whole number of at least 1"):
        A.build(A.network([A.conv2d(4, 3), A.primary_caps(2, 4, 3, 2), A.dynamic_caps(0, 6, routing="self")],
                          input_shape=(1, 13, 13), n_classes=3), B64)
    with pytest.raises(CapsNetError, match="capsule_logits.*class capsules without a grid"):
        A.build(A.network([A.conv2d(4, 3), A.primary_caps(2, 4, 3, 2), A.capsule_logits()], head="logits",
                          decoder=None, input_shape=(1, 13, 13), n_classes=3), B64)


def _autograd_agrees(model, seed=0, batch=3):
    """The network's hand-written loss gradients against AutogradNetwork's on the same batch."""
    from pycapsnet.tools.reference import AutogradNetwork

    rng = np.random.default_rng(seed)
    x = rng.random((batch, *model.input_shape))
    y = rng.integers(0, model.n_classes, batch)
    model.zero_grad()
    out = model.loss(B64.asarray(x), y)
    dx = model.backward(input_grad=True)
    ref = AutogradNetwork.from_model(model, dtype=torch.float64)
    loss, grads = ref.grads(x, y, input_grad=True)
    assert loss == pytest.approx(out.loss, rel=1e-12)
    np.testing.assert_allclose(dx, grads["input"], rtol=1e-8, atol=1e-12)
    for k, g in model.grads.items():
        np.testing.assert_allclose(B64.to_numpy(g), grads[k], rtol=1e-8, atol=1e-12, err_msg=k)


@pytest.mark.parametrize("routing", ROUTED)
def test_each_built_in_network_is_autograds(routing):
    from pycapsnet.core.model import CapsNet

    model = gradcheck.away_from_init(CapsNet(B64, seed=1, **gradcheck.SMALL_BY_ROUTING[routing]), 1)
    _autograd_agrees(model)


@pytest.mark.parametrize("mode", ["full", "final"])
def test_the_compositions_are_autograds(mode):
    for label, description in gradcheck.routing_compositions(mode).items():
        _autograd_agrees(gradcheck.away_from_init(A.build(description, B64, seed=2), 2))

"""pycapsnet.torch: pycapsnet layers and networks as torch modules whose backward is pycapsnet's own.

torch.autograd.gradcheck (float64, finite differences against the Jacobian the hand-written backward
gives) on every wrapped layer and on whole networks; a torch conv stem plus wrapped capsule layers
trained with torch.optim.Adam ends where pycapsnet's own step and Adam end; torch's rules (another
forward before a backward, a second backward, double backward, .to, state_dict) hold."""
import subprocess
import sys

import numpy as np
import pytest

import pycapsnet
from pycapsnet import backends
from pycapsnet import CapsNet, CapsNetError
from pycapsnet.core import architecture as A
from pycapsnet.core.batch_norm import BatchNorm
from pycapsnet.core.capsules import AttentionCaps, ClassCaps, PrimaryCaps
from pycapsnet.core.depthwise import DepthwiseConv2d
from pycapsnet.core.conv_caps import ConvCaps
from pycapsnet.core.layers import Conv2d, ReLU
from pycapsnet.core.losses import MarginLoss
from pycapsnet.core.matrix_capsules import ClassMatrixCaps, ConvMatrixCaps, PrimaryMatrixCaps
from pycapsnet.core.network import LengthHead, Network, Sequential
from pycapsnet.tools.finite_diff import _freeze_final_coupling
from pycapsnet.tools.gradcheck import SMALL, SMALL_EM, away_from_init, efficient_architecture
from pycapsnet.training import optim

torch = pytest.importorskip("torch", reason="pycapsnet.torch needs PyTorch: pip install torch")
import pycapsnet.torch as pct  # noqa: E402

B = backends.get("torch", dtype="float64")


def _r(rng, *shape, scale=1.0):
    return scale * rng.standard_normal(shape)


def _away(layer, rng, **scales):
    """Parameters away from the tiny initialisation, where every term of the gradient counts."""
    for k, s in scales.items():
        layer.params[k][...] = B.asarray(_r(rng, *layer.params[k].shape, scale=s))
    return layer


def _layers():
    """(label, layer, inputs as host arrays): every layer kind, both routing-gradient modes."""
    rng = np.random.default_rng(0)
    act = lambda *shape: rng.uniform(0.1, 0.9, shape)
    cases = [("Conv2d 3x3/2", Conv2d(B, 3, 4, 3, 2, 1, rng=rng), (_r(rng, 2, 6, 7, 3),))]
    for conv in ("fourier", "im2col"):
        cases.append((f"PrimaryCaps {conv}", PrimaryCaps(B, 3, types=2, dim=4, kernel=3, stride=2, rng=rng, conv=conv),
                      (_r(rng, 2, 7, 7, 3),)))
    for mode in ("full", "final"):
        for share in (False, True):
            cc = ClassCaps(B, positions=4, types=2, in_dim=4, n_classes=3, out_dim=5, iters=3, routing_grad=mode,
                           share_spatial=share, rng=rng)
            cases.append((f"ClassCaps {mode}{' shared' if share else ''}", _away(cc, rng, W=0.5),
                          (_r(rng, 3, 4, 2, 4, scale=0.5),)))
        conv = ConvCaps(B, (5, 5), 2, 3, 3, 4, kernel=3, stride=2, iters=3, routing_grad=mode, rng=rng)
        cases.append((f"ConvCaps {mode}", _away(conv, rng, W=0.5), (_r(rng, 2, 25, 2, 3, scale=0.5),)))
        em_conv = ConvMatrixCaps(B, 2, 3, kernel=3, stride=2, iters=3, routing_grad=mode, lam=0.5, rng=rng)
        em_cls = ClassMatrixCaps(B, (2, 3), 2, 4, iters=3, routing_grad=mode, lam=0.3, rng=rng)
        cases.append((f"ConvMatrixCaps {mode}", _away(em_conv, rng, beta_u=0.3, lambda_beta_a=0.3),
                      (_r(rng, 2, 5, 5, 2, 16), act(2, 5, 5, 2))))
        cases.append((f"ClassMatrixCaps {mode}", _away(em_cls, rng, beta_u=0.3, lambda_beta_a=0.3),
                      (_r(rng, 2, 2, 3, 2, 16), act(2, 2, 3, 2))))
    for share in (False, True):
        att = AttentionCaps(B, positions=4, types=2, in_dim=4, n_classes=3, out_dim=5, share_spatial=share, rng=rng)
        cases.append((f"AttentionCaps{' shared' if share else ''}", _away(att, rng, W=0.5, bias=0.3),
                      (_r(rng, 3, 4, 2, 4, scale=0.5),)))
    cases.append(("PrimaryMatrixCaps", PrimaryMatrixCaps(B, 5, 3, rng=rng), (_r(rng, 2, 3, 4, 5),)))
    for mode in ("training", "evaluation"):  # Efficient-CapsNet's parts
        bn = _away(BatchNorm(B, 3, momentum=0.2), rng, gamma=1.0, beta=0.5)
        bn.buffers["running_var"][...] = B.asarray(0.5 + rng.random(3))
        cases.append((f"BatchNorm {mode}", bn, (_r(rng, 3, 4, 5, 3),)))
    cases.append(("DepthwiseConv2d 3x3/2", DepthwiseConv2d(B, 3, 3, 3, 2, 1, rng=rng), (_r(rng, 2, 6, 7, 3),)))
    cases.append(("PrimaryCaps depthwise efficient", PrimaryCaps(B, 8, types=2, dim=4, kernel=3, stride=1, rng=rng,
                                                                 conv="depthwise", squash="efficient"),
                  (_r(rng, 2, 4, 4, 8),)))
    return cases


LAYERS = _layers()


@pytest.mark.parametrize("label,layer,inputs", LAYERS, ids=[c[0] for c in LAYERS])
def test_gradcheck_on_every_wrapped_layer(label, layer, inputs):
    xs = tuple(torch.tensor(a, requires_grad=True) for a in inputs)
    module = pct.Layer(layer)
    module.train("evaluation" not in label)  # batch norm: the batch's statistics, or the running ones
    if getattr(layer, "routing_grad", None) == "final":
        # "final" is the exact gradient of routing with the last coupling held: hold it (as pycapsnet's
        # own check does), from a forward on these inputs
        layer.forward(xs[0].detach() if len(xs) == 1 else tuple(x.detach() for x in xs))
        _freeze_final_coupling(layer)
    params = tuple(module.parameters())

    def fn(*tensors):
        return pct._Capsule.apply(module._op, len(xs), *tensors)

    eps = 1e-5 if "Matrix" in label else 1e-6  # EM: as pycapsnet's own check (gradcheck.em_layer_checks)
    # EM's layers take thousands of inputs: their whole Jacobian is most of this file's time, so
    # PyTorch's fast mode checks them along random directions (u^T J v against differences)
    assert torch.autograd.gradcheck(fn, (*xs, *params), eps=eps, atol=1e-6, rtol=1e-5, fast_mode="Matrix" in label)


NETWORKS = [("dynamic", SMALL), ("attention", {**SMALL, "routing": "attention"}), ("em", SMALL_EM),
            ("efficient", None)]


@pytest.mark.parametrize("label,config", NETWORKS, ids=[n for n, _ in NETWORKS])
def test_gradcheck_on_whole_networks_outputs_and_loss(label, config):
    net = away_from_init(CapsNet(B, **config) if config else A.build(efficient_architecture(), B, seed=1), 1)
    module = pct.Network(net)
    rng = np.random.default_rng(2)
    x = torch.tensor(rng.random((2, *net.input_shape)), requires_grad=True)
    y = torch.tensor(rng.integers(0, net.n_classes, 2))
    params = tuple(module.parameters())
    module._op.labels = module._labels(y, x)

    def outputs(*tensors):
        return pct._Capsule.apply(module._op, 1, *tensors)

    def loss(*tensors):
        module._loss_op.labels = module._labels(y, x)
        return pct._Capsule.apply(module._loss_op, 1, *tensors)

    eps = 1e-5 if label == "em" else 1e-6
    for fn in (outputs, loss):
        assert torch.autograd.gradcheck(fn, (x, *params), eps=eps, atol=1e-6, rtol=1e-5, fast_mode=True)
    assert module.loss(x, y).item() == pytest.approx(net.loss(x.detach(), y).loss, rel=1e-14)


def _stem_and_caps(seed):
    """The same network twice: pycapsnet's (conv1, ReLU, PrimaryCaps, ClassCaps, lengths, margin
    loss) and torch's (a torch Conv2d and ReLU with conv1's initial weights, then the capsule
    layers wrapped, lengths and margin loss in torch)."""
    def caps(rng):
        return [("primary", PrimaryCaps(B, 6, types=4, dim=4, kernel=3, stride=2, rng=rng)),
                ("classcaps", ClassCaps(B, positions=9, types=4, in_dim=4, n_classes=5, out_dim=6, rng=rng))]

    rng = np.random.default_rng(seed)
    conv1 = Conv2d(B, 1, 6, 3, rng=rng)
    ours = Network(B, Sequential(B, [("conv1", conv1), ("relu", ReLU(B)), *caps(rng)]), LengthHead(B),
                   MarginLoss(B), input_shape=(1, 9, 9), n_classes=5, class_dim=6)
    rng = np.random.default_rng(seed)
    Conv2d(B, 1, 6, 3, rng=rng)  # the same draws: the capsule layers start where ours start
    stem = torch.nn.Conv2d(1, 6, 3, dtype=torch.float64)
    with torch.no_grad():
        stem.weight.copy_(conv1.params["W"].permute(3, 2, 0, 1))  # (kh, kw, C_in, C_out) -> (C_out, C_in, kh, kw)
        stem.bias.copy_(conv1.params["b"])
    return ours, stem, pct.Layer(Sequential(B, caps(rng)))


def test_a_torch_stem_with_wrapped_capsules_trains_as_pycapsnets_own_step_and_adam():
    ours, stem, caps = _stem_and_caps(seed=4)
    caps.classcaps.W.data.mul_(20.0)  # transforms away from the tiny initialisation: routing that matters
    ours.params["classcaps.W"][...] *= 20.0
    model = torch.nn.Sequential(stem, torch.nn.ReLU())
    opt_torch = torch.optim.Adam([*model.parameters(), *caps.parameters()], lr=3e-3)
    opt_ours = optim.Adam(ours, lr=3e-3)
    rng = np.random.default_rng(7)
    for step in range(6):
        x, y = rng.random((8, 1, 9, 9)), rng.integers(0, 5, 8)
        out = ours.train_step_grads(x, y)
        opt_ours.step()
        opt_torch.zero_grad()
        v = caps(model(torch.tensor(x)).permute(0, 2, 3, 1))   # channels-last into the capsule layers
        lengths = torch.sqrt((v * v).sum(-1))
        onehot = torch.nn.functional.one_hot(torch.tensor(y), 5).double()
        loss = (onehot * torch.clamp(0.9 - lengths, min=0) ** 2
                + 0.5 * (1 - onehot) * torch.clamp(lengths - 0.1, min=0) ** 2).sum(1).mean()
        loss.backward()
        opt_torch.step()
        assert loss.item() == pytest.approx(out.loss, rel=1e-12, abs=1e-15)
    theirs = {"conv1.W": stem.weight.detach().permute(2, 3, 1, 0), "conv1.b": stem.bias.detach(),
              **{k: p.detach() for k, p in caps.named_parameters()}}
    assert set(theirs) == set(ours.params)
    for k, p in ours.params.items():
        scale = float(p.abs().max())
        assert float((theirs[k] - p).abs().max()) <= 1e-10 * scale, k


def test_torchs_rules_hold():
    rng = np.random.default_rng(1)
    cc = _away(ClassCaps(B, positions=4, types=2, in_dim=4, n_classes=3, out_dim=5, rng=rng), rng, W=0.5)
    module = pct.Layer(cc)
    assert module.W.data_ptr() == cc.params["W"].data_ptr()  # the layer's own tensor, no copy
    u1, u2 = (torch.tensor(_r(rng, 3, 4, 2, 4), requires_grad=True) for _ in range(2))
    # another forward before the backward changes nothing of the first's gradient
    module(u1).sum().backward()
    alone = (u1.grad.clone(), module.W.grad.clone())
    u1.grad, module.W.grad = None, None
    first, second = module(u1), module(u2)
    (first.sum() + 0 * second.sum()).backward()
    assert torch.equal(u1.grad, alone[0]) and torch.equal(module.W.grad, alone[1])
    # a second backward through one graph gives the same gradient again
    module.W.grad = None
    out = module(u1).sum()
    out.backward(retain_graph=True)
    once = module.W.grad.clone()
    out.backward()
    assert torch.allclose(module.W.grad, 2 * once, rtol=1e-14, atol=0)
    # a graph of the gradient (for a second derivative): one clear error, at once
    with pytest.raises(RuntimeError, match="differentiate once"):
        torch.autograd.grad((module(u1) ** 2).sum(), u1, create_graph=True)
    # state_dict round trip, and .to(float32) computes in float32 on a float32 backend
    state = {k: v.clone() for k, v in module.state_dict().items()}
    assert list(state) == ["W"]
    module.float()
    assert module.wrapped.B.dtype == "float32" and module(u1.float()).dtype == torch.float32
    module.double()
    module.load_state_dict(state)
    assert torch.equal(module.W, state["W"])
    with pytest.raises(CapsNetError, match="computes in float64"):
        module(u1.float())


def test_a_layer_of_another_backend_is_refused_in_one_line():
    layer = ClassCaps(backends.get("numpy"), positions=4, types=2, in_dim=4, n_classes=3, out_dim=5)
    with pytest.raises(CapsNetError, match="built on the numpy backend; .* backends.get\\('torch'"):
        pct.Layer(layer)


def test_importing_pycapsnet_imports_neither_torch_nor_cupy():
    code = "import sys, pycapsnet, pycapsnet.training.trainer; print('torch' in sys.modules, 'cupy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_a_backend_takes_arrays_of_another_library():
    """A torch tensor (even one that requires grad) to the numpy backend, a NumPy array to torch:
    converted, the same result as the backend's own arrays."""
    rng = np.random.default_rng(0)
    x, y = rng.random((3, 1, 14, 14)), np.array([0, 2, 1])
    ours = CapsNet(backends.get("numpy", dtype="float64"), seed=0, **SMALL)
    theirs = CapsNet(B, seed=0, **SMALL)
    want = ours.loss(x, y).loss
    assert ours.loss(torch.tensor(x, requires_grad=True), torch.tensor(y)).loss == want
    assert theirs.loss(x, y).loss == pytest.approx(want, rel=1e-12)
    np.testing.assert_array_equal(ours.predict(torch.tensor(x)), ours.predict(x))


CUDA = backends.gpu_unavailable_reason("torch")


@pytest.mark.skipif(CUDA is not None, reason=f"torch:cuda: {CUDA}")
def test_on_a_gpu_the_wrapped_layer_passes_gradcheck_and_moves_with_to():
    rng = np.random.default_rng(5)
    gpu = backends.get("torch", device="cuda", dtype="float64")
    cc = ClassCaps(gpu, positions=4, types=2, in_dim=4, n_classes=3, out_dim=5, rng=rng)
    cc.params["W"][...] = gpu.asarray(_r(rng, *cc.params["W"].shape, scale=0.5))
    module = pct.Layer(cc)
    u = torch.tensor(_r(rng, 3, 4, 2, 4, scale=0.5), device="cuda", requires_grad=True)
    assert torch.autograd.gradcheck(lambda u, W: pct._Capsule.apply(module._op, 1, u, W)[0], (u, module.W))
    on_cpu = module(u).detach().cpu()
    module.cpu()  # the layers follow the module: a CPU backend, CPU tensors
    assert module.wrapped.B.device == "cpu" and torch.allclose(module(u.detach().cpu()), on_cpu, rtol=1e-12)
    module.cuda()
    assert module.wrapped.B.device.startswith("cuda") and module(u).is_cuda


def _described_with_awkward_names(B):
    from pycapsnet.core import architecture as A

    desc = A.network([A.conv2d(4, 9, name="to"), A.relu(), A.dropout(0.5, name="drop"),
                      A.primary_caps(2, 4, 9, 2, name="training"), A.dynamic_caps(10, 8, name="forward")],
                     input_shape=(1, 28, 28), n_classes=10)
    return A.build(desc, B, seed=0)


@pytest.mark.parametrize("which", ["built-in", "described", "efficient"])
def test_dtype_copies_and_modes_on_any_network(which, tmp_path):
    """.double() on a network from a description (the built-in is one too), deepcopy, pickle and
    torch.save, .eval() reaching a Dropout inside, layer names torch's Module already uses."""
    import copy
    import pickle

    B = backends.get("torch")
    net = CapsNet(B, seed=0, conv_channels=16, primary_types=4) if which == "built-in" else \
        A.build(dict(A.load("efficient"), input_shape=[1, 28, 28], n_classes=10), B) if which == "efficient" else \
        _described_with_awkward_names(B)
    m = pct.Network(net).eval()
    x = torch.rand(2, 1, 28, 28)
    scores = m(x)[1]
    torch.save(m, tmp_path / "m.pt")
    for other in (copy.deepcopy(m), pickle.loads(pickle.dumps(m)), torch.load(tmp_path / "m.pt", weights_only=False)):
        assert torch.equal(other(x)[1], scores)
    d = copy.deepcopy(m).double()
    assert d(x.double())[1].dtype == torch.float64
    torch.testing.assert_close(d(x.double())[1].float(), scores, rtol=1e-4, atol=1e-6)
    if which == "efficient":  # the running statistics moved with the parameters; training mode uses the batch's
        assert net.buffers["bn1.running_var"].dtype == torch.float32
        assert d.wrapped.buffers["bn1.running_var"].dtype == torch.float64
        m.train()
        assert not torch.equal(m(x)[1], scores)
    if which == "described":
        assert {"to_.W", "training_.W", "forward_.W"} <= {k for k, _ in m.named_parameters()}
        assert torch.equal(m(x)[1], m(x)[1])          # eval: the dropout drops nothing
        m.train()
        assert not torch.equal(m(x)[1], m(x)[1])      # train: it drops


def test_a_failed_conversion_and_bad_inputs_are_one_clear_error():
    B = backends.get("torch")
    m = pct.Network(CapsNet(B, seed=0, conv_channels=16, primary_types=4))
    with pytest.raises(CapsNetError, match="left as it was .*float16"):
        m.half()
    assert all(p.dtype == torch.float32 for p in m.parameters())
    m(torch.rand(1, 1, 28, 28))  # still computes, in float32
    for bad, message in ((torch.zeros(0, 1, 28, 28), "no samples"), (torch.zeros(2, 1, 20, 20), r"\(N, 1, 28, 28\)"),
                         (torch.zeros(2, 1, 28, 28, dtype=torch.int64), "takes float tensors")):
        with pytest.raises(CapsNetError, match=message):
            m(bad)
    caps = pct.Layer(ClassCaps(B, positions=36, types=4, in_dim=8, n_classes=10, out_dim=16))
    with pytest.raises(CapsNetError, match=r"ClassCaps takes u \(N, 36, 4, 8\).*got \(3, 35, 4, 8\)"):
        caps(torch.zeros(3, 35, 4, 8))


def test_the_model_that_build_gives_is_wrapped_as_its_network():
    model = pycapsnet.build("capsnet", backend="torch", seed=0, conv_channels=16, primary_types=4)
    m, x, y = pct.Network(model), torch.rand(2, 1, 28, 28), torch.tensor([3, 5])
    # the model's own tensors, no copies: training the module trains the model
    assert sorted(p.data_ptr() for p in m.parameters()) == sorted(t.data_ptr() for t in model.network.params.values())
    m.loss(x, y).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())

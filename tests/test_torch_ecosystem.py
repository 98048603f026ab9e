"""The wrapped layers inside PyTorch's ecosystem (issues 86 item 6, 87): the module's training flag
however it is set, batch norm's running statistics as buffers, Lightning's fit, validate and
predict with their defaults, and inference mode on the pool's threads."""
import io
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="pycapsnet.torch wraps layers for PyTorch")

import pycapsnet  # noqa: E402
import pycapsnet.torch as pct  # noqa: E402
from pycapsnet import CapsNetError, backends  # noqa: E402
from pycapsnet.core import architecture as A  # noqa: E402

BN_NET = A.network([A.conv2d(8, 5, stride=2), A.batch_norm(), A.relu(), A.dropout(0.3),
                    A.primary_caps(4, 4, kernel=3, stride=2), A.dynamic_caps(10, 8, name="classcaps")],
                   input_shape=(1, 28, 28), n_classes=10, decoder=None)


def _caps_body(B):
    body, _, _ = A.build_body(B, [A.batch_norm(), A.dropout(0.2), A.primary_caps(4, 8, kernel=3, stride=2),
                                  A.dynamic_caps(10, 8)], (16, 12, 12))
    return body


def _bn(module):
    root = module.wrapped
    layers = root.layers() if callable(getattr(root, "layers", None)) else root.named_layers()
    return next(layer for _, layer in layers if layer.buffers)


def test_the_wrapped_layers_follow_the_modules_flag_however_it_is_set():
    """87.1: Lightning sets ``module.training`` directly; the layers read it at each call."""
    caps = pct.Layer(_caps_body(backends.get("torch")))
    x = torch.rand(4, 12, 12, 16)
    caps.train()
    caps.training = False
    caps(x)
    assert not _bn(caps).training
    before = _bn(caps).buffers["running_mean"].clone()
    caps(x)
    torch.testing.assert_close(_bn(caps).buffers["running_mean"], before)  # evaluation: left be
    caps.training = True
    caps(x)
    assert _bn(caps).training and not torch.equal(_bn(caps).buffers["running_mean"], before)


def test_batch_norms_running_statistics_are_buffers_and_survive_a_state_dict_round_trip():
    """86.6: named_buffers holds them; torch.save/load_state_dict carries them, so evaluation scores
    are the same afterwards; .double() keeps the layers updating the module's buffers."""
    net = pct.Network(pycapsnet.build(BN_NET, backend="torch", seed=0))
    names = dict(net.named_buffers())
    assert {n.rsplit(".", 1)[1] for n in names} == {"running_mean", "running_var"}
    x = torch.rand(16, 1, 28, 28)
    net.train()
    for _ in range(3):
        net(x)  # the running statistics move in training
    net.eval()
    expected = net(x)[1]
    blob = io.BytesIO()
    torch.save(net.state_dict(), blob)
    other = pct.Network(pycapsnet.build(BN_NET, backend="torch", seed=1))
    other.load_state_dict(torch.load(io.BytesIO(blob.getvalue())))
    other.eval()
    torch.testing.assert_close(other(x)[1], expected, rtol=0, atol=0)
    bn_name = next(n for n in names if n.endswith("running_mean"))
    wide = other.double()
    before = wide.get_buffer(bn_name).clone()
    wide.train()
    wide(x.double())
    assert wide.get_buffer(bn_name).dtype == torch.float64
    assert _bn(wide).buffers["running_mean"] is wide.get_buffer(bn_name)
    assert not torch.equal(wide.get_buffer(bn_name), before)  # the forward updated the module's own buffer


def test_load_state_dict_with_assign_puts_the_new_buffers_where_the_layers_read_them():
    """95.8: assign=True replaces the module's buffer tensors; the layers score with, and training
    updates, the ones the module now holds."""
    net = pct.Network(pycapsnet.build(BN_NET, backend="torch", seed=0))
    x = torch.rand(16, 1, 28, 28)
    net.train()
    for _ in range(3):
        net(x)
    net.eval()
    expected = net(x)[1]
    other = pct.Network(pycapsnet.build(BN_NET, backend="torch", seed=0))
    state = {k: v.clone() for k, v in net.state_dict().items()}
    other.load_state_dict(state, assign=True)
    other.eval()
    torch.testing.assert_close(other(x)[1], expected, rtol=0, atol=0)
    name = next(n for n, _ in other.named_buffers() if n.endswith("running_mean"))
    assert other.get_buffer(name) is state[name]
    before = state[name].clone()
    other.train()
    other(x)
    assert _bn(other).buffers["running_mean"] is other.get_buffer(name)
    assert not torch.equal(other.get_buffer(name), before)  # training moved the module's own buffer


def test_gradcheck_of_a_layer_that_draws_passes_inside_held():
    """95.8: random routing draws new coefficients each forward (as nn.Dropout draws masks), so
    gradcheck perturbs a different function each time; ``held`` holds the draw while it checks."""
    from pycapsnet.core.capsules import ClassCaps

    caps = pct.Layer(ClassCaps(backends.get("torch", dtype="float64"), positions=4, types=2, in_dim=4, n_classes=3,
                               out_dim=4, routing="random", rng=np.random.default_rng(1)))
    u = torch.rand(2, 4, 2, 4, dtype=torch.float64, requires_grad=True)
    assert not torch.autograd.gradcheck(caps, (u,), raise_exception=False)
    with pct.held(caps):
        assert torch.autograd.gradcheck(caps, (u,))
    a, b = caps(u), caps(u)
    assert not torch.equal(a, b)  # drawing anew after the block
    with pytest.raises(CapsNetError, match="held takes a module of pycapsnet.torch"):
        with pct.held("caps"):
            pass


def test_a_pool_thread_runs_in_the_callers_grad_and_inference_modes(monkeypatch):
    """87.2: where routing's blocks run on NumPy's thread pool (AMD CPUs; forced here), each part
    runs in the mode of the call that split it, whenever the pool's threads were made."""
    from pycapsnet.backends.torch_backend import TorchBackend

    monkeypatch.setenv("PYCAPSNET_TORCH_CPU_MATMUL", "numpy")
    B = TorchBackend("float32", "cpu")
    B.split_batch(lambda sl: None, 8, 1 << 20)  # the pool's threads, made outside inference mode
    seen = []
    with torch.inference_mode():
        t = torch.zeros(8, 4)

        def part(sl):
            seen.append(torch.is_inference_mode_enabled())
            t[sl] += torch.ones(t[sl].shape)

        B.split_batch(part, 8, 1 << 20)
    with torch.no_grad():
        B.split_batch(lambda sl: seen.append(not torch.is_grad_enabled()), 8, 1 << 20)
    assert all(seen) and len(seen) >= 4 and float(t.sum()) == 32


def test_inside_lightning_the_running_statistics_move_and_validate_and_predict_work():
    """87.1, 87.2: a LightningModule of a torch stem and wrapped capsule layers (batch norm and
    dropout inside): after the sanity check's and each epoch's validation passes, training still
    trains the layers in training mode; validate and predict run with Lightning's defaults
    (inference mode)."""
    L = pytest.importorskip("lightning", reason="the Lightning test needs pip install lightning (the [test] extra)")
    B = backends.get("torch")
    body = _caps_body(B)

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.stem = torch.nn.Conv2d(1, 16, 5, stride=2)
            self.caps = pct.Layer(body)

        def forward(self, x):
            return self.caps(torch.relu(self.stem(x)).permute(0, 2, 3, 1).contiguous()).norm(dim=-1)

        def training_step(self, batch, i):
            return torch.nn.functional.cross_entropy(self(batch[0]), batch[1])

        def validation_step(self, batch, i):
            self.log("val_acc", (self(batch[0]).argmax(1) == batch[1]).float().mean())

        def predict_step(self, batch, i):
            return self(batch[0])

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), 1e-3)

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.rand(48, 1, 28, 28, generator=g), torch.randint(0, 10, (48,), generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    model = Model()
    trainer = L.Trainer(max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", num_sanity_val_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, loader, loader)
        stats = _bn(model.caps).buffers["running_mean"].clone()
        assert float(stats.abs().sum()) > 0  # trained in training mode after the sanity check
        scores = trainer.validate(model, loader, verbose=False)
        predicted = trainer.predict(model, loader)
    assert 0 <= scores[0]["val_acc"] <= 1 and sum(len(p) for p in predicted) == 48
    torch.testing.assert_close(_bn(model.caps).buffers["running_mean"], stats)  # evaluation left them be
    assert np.isfinite(torch.cat(predicted).numpy()).all()


# ---- 87.3-7: torch.compile, second derivatives, torch.func, autocast, export, jit, meta ------------
def _caps64():
    B = backends.get("torch", dtype="float64")
    body, _, _ = A.build_body(B, [A.primary_caps(3, 4, kernel=3, stride=2), A.dynamic_caps(4, 5)], (6, 9, 9))
    return pct.Layer(body)


class _Stemmed(torch.nn.Module):
    def __init__(self, caps, dtype=torch.float64):
        super().__init__()
        self.stem = torch.nn.Conv2d(1, 6, 3).to(dtype)
        self.caps = caps

    def forward(self, x):
        return self.caps(torch.relu(self.stem(x)).permute(0, 2, 3, 1).contiguous()).norm(dim=-1)


def test_torch_compile_compiles_around_the_wrapped_layer_and_its_backward_is_the_eager_one():
    torch.manual_seed(0)
    model = _Stemmed(_caps64())
    x = torch.rand(3, 1, 11, 11, dtype=torch.float64)
    eager = model(x)
    eager.sum().backward()
    expected = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    compiled = torch.compile(model, backend="aot_eager")
    out = compiled(x)
    out.sum().backward()
    torch.testing.assert_close(out, eager)
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[k], msg=k)


def test_every_route_to_a_second_derivative_raises_the_one_message():
    caps = _caps64()
    u = torch.rand(2, 9, 9, 6, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="differentiate once"):
        torch.autograd.grad(caps(u).sum(), u, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate once"):
        torch.autograd.functional.hessian(lambda t: caps(t).sum(), u)
    with pytest.raises(RuntimeError, match="differentiate once"):
        torch.autograd.gradgradcheck(lambda t: caps(t), (u,))
    (g,) = torch.autograd.grad(caps(u).sum(), u)  # first derivatives as before
    assert torch.isfinite(g).all()


def test_functional_call_runs_with_the_given_tensors_and_torch_func_transforms_are_refused():
    caps = _caps64()
    u = torch.rand(2, 9, 9, 6, dtype=torch.float64)
    params = {k: v.detach().clone() for k, v in caps.named_parameters()}
    torch.testing.assert_close(torch.func.functional_call(caps, params, (u,)), caps(u))
    doubled = {k: 2 * v for k, v in params.items()}
    assert not torch.allclose(torch.func.functional_call(caps, doubled, (u,)), caps(u))
    with pytest.raises(CapsNetError, match="torch.func"):
        torch.func.grad(lambda p: torch.func.functional_call(caps, p, (u,)).sum())(params)
    with pytest.raises(CapsNetError, match="torch.func"):
        torch.func.vmap(caps)(u[:, None])


def test_under_autocast_the_layer_computes_in_its_own_dtype():
    net = pct.Network(pycapsnet.build(BN_NET, backend="torch", seed=0))
    net.eval()
    x = torch.rand(4, 1, 28, 28)
    expected = net(x)[1]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        stem = torch.nn.Conv2d(1, 1, 1)
        with torch.no_grad():
            stem.weight.fill_(1.0), stem.bias.zero_()
        v, scores, _ = net(stem(x))           # the stem hands on bfloat16
    assert scores.dtype == torch.float32
    torch.testing.assert_close(scores, net(x.to(torch.bfloat16).float())[1], rtol=0, atol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        same = net(x)[1]
    torch.testing.assert_close(same, expected, rtol=0, atol=0)
    net.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = net.loss(x, torch.tensor([1, 2, 3, 4]))
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in net.parameters())


def test_export_jit_and_the_meta_device_are_refused_and_leave_the_module_working():
    caps = _caps64()
    u = torch.rand(2, 9, 9, 6, dtype=torch.float64)
    expected = caps(u)
    with pytest.raises(CapsNetError, match="torch.export"):
        torch.export.export(_caps64(), (u,))  # one that never ran eagerly
    with pytest.raises(CapsNetError, match="torch.export"):
        torch.export.export(caps, (u,))
    with pytest.raises(CapsNetError, match="torch.jit.script"):
        torch.jit.script(caps)
    with pytest.raises(CapsNetError, match="torch.jit.trace"):
        torch.jit.trace(caps, (u,))
    with pytest.raises(CapsNetError, match="meta device"):
        caps.to("meta")
    torch.testing.assert_close(caps(u), expected)

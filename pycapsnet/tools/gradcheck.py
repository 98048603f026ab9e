"""Finite-difference gradient checks of every layer and of the full loss, on each network's small
random inputs: the suites behind ``pycapsnet gradcheck`` and the test suite.  How one tensor is
checked (fourth-order central differences, kinks, the quotients' own rounding) is finite_diff.py's.
"""
from __future__ import annotations

import functools

import numpy as np

from pycapsnet import backends as _backends

from ..core import architecture as arch
from ..core.batch_norm import BatchNorm
from ..core.capsules import AttentionCaps, CapsuleLength, ClassCaps, PrimaryCaps
from ..core.depthwise import DepthwiseConv2d
from ..core.conv_caps import ConvCaps
from ..core.fourier import FourierConv2d
from ..core.layers import Conv2d, Linear, ReLU, Sigmoid
from ..core.losses import MarginLoss, ReconstructionLoss, SpreadLoss
from ..core.matrix_capsules import ClassMatrixCaps, ConvMatrixCaps, PrimaryMatrixCaps
from ..core.model import CapsNet
from ..core.routing import softmax, softmax_backward
from ..core import routings
from ..core.squash import squash, squash_backward, squash_exp, squash_exp_backward
from ..errors import CapsNetError
from .finite_diff import _freeze_final_coupling, _hold_mask, _LossLayer, _FunctionLayer, check_layer, check_tensors
from .gradcheck_routings import ROUTED, routing_compositions, routing_layer_checks


def layer_checks(B, samples=20, eps=1e-5, tol=1e-6, seed=0):
    """Checks of every layer of pycapsnet, on small random inputs."""
    return [check for checks in LAYER_CHECKS.values() for check in checks(B, samples, eps, tol, seed)]


def _dynamic_layer_checks(B, samples=20, eps=1e-5, tol=1e-6, seed=0):
    """The plain layers and those of the dynamic-routing network."""
    rng = np.random.default_rng(seed)
    xp = B.xp
    r = lambda *shape: rng.standard_normal(shape)
    results = []

    def add(label, layer, x):
        results.extend(check_layer(B, label, layer, x, samples, eps, tol, seed))

    add("Conv2d 3x3/1", Conv2d(B, 3, 4, 3, 1, 0, rng=rng), r(2, 6, 6, 3))
    add("Conv2d 3x3/2 pad1", Conv2d(B, 3, 5, 3, 2, 1, rng=rng), r(2, 7, 8, 3))
    add("ReLU", ReLU(B), r(3, 7))
    add("Sigmoid", Sigmoid(B), 4 * r(3, 7))
    add("Linear", Linear(B, 6, 5, rng=rng), r(4, 6))
    add("squash", _FunctionLayer(lambda s: squash(xp, s)[0],
                                 lambda s, dv: squash_backward(xp, s, squash(xp, s)[1], dv)), r(3, 4, 5))
    add("softmax", _FunctionLayer(lambda b: softmax(xp, b),
                                  lambda b, dc: softmax_backward(xp, softmax(xp, b), dc)), 3 * r(4, 6))
    add("FourierConv2d 3x3/2 pad1", FourierConv2d(B, 3, 5, 3, 2, 1, rng=rng), r(2, 7, 8, 3))
    add("FourierConv2d 5x5/3", FourierConv2d(B, 2, 3, 5, 3, 0, rng=rng), r(2, 13, 11, 2))
    for conv in ("fourier", "im2col"):
        add(f"PrimaryCaps {conv}", PrimaryCaps(B, 3, types=2, dim=4, kernel=3, stride=2, rng=rng, conv=conv),
            r(2, 7, 7, 3))
    for mode in ("full", "final"):
        for share in (False, True):
            cc = ClassCaps(B, positions=4, types=2, in_dim=4, n_classes=3, out_dim=5, iters=3,
                           routing_grad=mode, share_spatial=share, rng=rng)
            cc.params["W"][...] = B.asarray(0.5 * r(*cc.params["W"].shape))  # away from the tiny init
            add(f"ClassCaps routing={mode}{' shared' if share else ''}", cc, 0.5 * r(3, 4, 2, 4))
    for mode in ("full", "final"):
        routed = ClassCaps(B, positions=1, types=4, in_dim=5, n_classes=3, out_dim=6, iters=3, routing_grad=mode, rng=rng)
        routed.params["W"][...] = B.asarray(0.5 * r(*routed.params["W"].shape))
        add(f"ClassCaps after routing, routing={mode}", routed, 0.5 * r(3, 4, 5))  # v (N, J, D) of a layer before
        for k, s in ((3, 1), (3, 2)):
            conv = ConvCaps(B, (5, 5), 2, 3, 3, 4, kernel=k, stride=s, iters=3, routing_grad=mode, rng=rng)
            conv.params["W"][...] = B.asarray(0.5 * r(*conv.params["W"].shape))
            add(f"ConvCaps {k}x{k}/{s} routing={mode}", conv, 0.5 * r(2, 25, 2, 3))
    add("CapsuleLength", CapsuleLength(B), r(3, 4, 5))
    onehot = B.asarray(np.eye(4)[rng.integers(0, 4, 5)])
    add("MarginLoss", _LossLayer(MarginLoss(B), onehot), rng.uniform(0.0, 1.0, (5, 4)))
    add("ReconstructionLoss", _LossLayer(ReconstructionLoss(B, weight=0.5), B.asarray(rng.random((3, 1, 4, 4)))),
        rng.random((3, 1, 4, 4)))
    return results


def attention_layer_checks(B, samples=20, eps=1e-5, tol=1e-6, seed=0):
    """Self-attention routing's layers: its squash, and AttentionCaps with W and the bias per
    position and shared."""
    rng = np.random.default_rng(seed + 2)
    xp = B.xp
    r = lambda *shape: rng.standard_normal(shape)
    results = []
    sq = _FunctionLayer(lambda s: squash_exp(xp, s)[0], lambda s, dv: squash_exp_backward(xp, s, squash_exp(xp, s)[1], dv))
    results += check_layer(B, "squash_exp", sq, r(3, 4, 5), samples, eps, tol, seed)
    results += check_layer(B, "squash_exp near 0", sq, 1e-3 * r(3, 4, 5), samples, 1e-8, tol, seed)  # the series branch
    for share in (False, True):
        layer = AttentionCaps(B, positions=4, types=2, in_dim=4, n_classes=3, out_dim=5, share_spatial=share, rng=rng)
        layer.params["W"][...] = B.asarray(0.5 * r(*layer.params["W"].shape))
        layer.params["bias"][...] = B.asarray(0.3 * r(*layer.params["bias"].shape))
        results += check_layer(B, f"AttentionCaps{' shared' if share else ''}", layer, 0.5 * r(3, 4, 2, 4),
                               samples, eps, tol, seed)
    return results + efficient_layer_checks(B, samples, eps, tol, seed)


def efficient_layer_checks(B, samples=20, eps=1e-5, tol=1e-6, seed=0):
    """Efficient-CapsNet's parts: batch norm in training and evaluation mode (on images and on
    features), depthwise convolutions, and primary capsules that convolve depthwise and squash as
    Efficient-CapsNet does."""
    rng = np.random.default_rng(seed + 3)
    r = lambda *shape: rng.standard_normal(shape)
    results = []
    for training in (True, False):
        for shape in ((2, 5, 4, 3), (6, 3)):
            bn = BatchNorm(B, shape[-1], momentum=0.3)
            bn.params["gamma"][...] = B.asarray(1 + 0.5 * r(shape[-1]))
            bn.params["beta"][...] = B.asarray(0.5 * r(shape[-1]))
            bn.buffers["running_mean"][...] = B.asarray(0.3 * r(shape[-1]))
            bn.buffers["running_var"][...] = B.asarray(0.5 + rng.random(shape[-1]))
            bn.train(training)
            what = f"BatchNorm {'training' if training else 'evaluation'} {'image' if len(shape) == 4 else 'features'}"
            results += check_layer(B, what, bn, 1 + 2 * r(*shape), samples, eps, tol, seed)
    results += check_layer(B, "DepthwiseConv2d 3x3/1", DepthwiseConv2d(B, 3, 3, 3, 1, 0, rng=rng), r(2, 6, 5, 3),
                           samples, eps, tol, seed)
    results += check_layer(B, "DepthwiseConv2d 3x3/2 pad1", DepthwiseConv2d(B, 2, 2, 3, 2, 1, rng=rng), r(2, 7, 6, 2),
                           samples, eps, tol, seed)
    for conv, squash_name in (("depthwise", "efficient"), ("depthwise", "sabour"), ("im2col", "efficient")):
        c_in = 8 if conv == "depthwise" else 3
        layer = PrimaryCaps(B, c_in, types=2, dim=4, kernel=3, stride=1, rng=rng, conv=conv, squash=squash_name)
        results += check_layer(B, f"PrimaryCaps {conv} squash={squash_name}", layer, r(2, 5, 5, c_in),
                               samples, eps, tol, seed)
    return results


def efficient_architecture():
    """Efficient-CapsNet's structure at a size for float64 checks: convolutions with batch norm,
    depthwise primary capsules squashed as Efficient-CapsNet does, self-attention routing."""
    body = [arch.conv2d(4, 3, name="conv1"), arch.relu(), arch.batch_norm(name="bn1"),
            arch.conv2d(8, 3, 2, name="conv2"), arch.relu(), arch.batch_norm(momentum=0.01, eps=1e-3, name="bn2"),
            arch.primary_caps(2, 4, 3, 1, conv="depthwise", squash="efficient", name="primary"),
            arch.attention_caps(3, 4, name="classcaps")]
    return arch.network(body, decoder=arch.decoder((8, 12)), input_shape=(1, 9, 9), n_classes=3)


def em_layer_checks(B, samples=20, eps=1e-5, tol=1e-6, seed=0):
    """Matrix capsule layers in both routing-gradient modes (overlapping 3x3/2 windows, so that a
    child competes between parent positions), and the spread loss.  Differenced at 10 ``eps``: EM's
    forward runs through terms far larger than its output (the cost's log σ², Gaussian densities
    divided by σ²), so at eps the quotient's rounding error (which falls as 1/h) reaches the
    tolerance for a correct backward -- 1.1e-6 on one BLAS's rounding, 3e-7 on another -- while at
    10 eps it is ~1e-8 and the truncation error (h^4) is still negligible."""
    eps = 10 * eps
    rng = np.random.default_rng(seed + 3)
    r = lambda *shape: rng.standard_normal(shape)
    act = lambda *shape: rng.uniform(0.1, 0.9, shape)
    results = []
    results += check_layer(B, "PrimaryMatrixCaps", PrimaryMatrixCaps(B, 5, 3, rng=rng), r(2, 3, 4, 5), samples, eps, tol, seed)
    for mode in ("full", "final"):
        conv = ConvMatrixCaps(B, 2, 3, kernel=3, stride=2, iters=3, routing_grad=mode, lam=0.5, rng=rng)
        cls = ClassMatrixCaps(B, (2, 3), 2, 4, iters=3, routing_grad=mode, lam=0.3, rng=rng)
        for layer in (conv, cls):  # β away from 0, where some terms of their gradients vanish
            layer.params["beta_u"][...] = B.asarray(0.3 * r(*layer.params["beta_u"].shape))
            layer.params["lambda_beta_a"][...] = B.asarray(0.3 * r(*layer.params["lambda_beta_a"].shape))
        results += check_layer(B, f"ConvMatrixCaps 3x3/2 routing={mode}", conv, (r(2, 7, 7, 2, 16), act(2, 7, 7, 2)),
                               samples, eps, tol, seed)
        results += check_layer(B, f"ClassMatrixCaps routing={mode}", cls, (r(2, 2, 3, 2, 16), act(2, 2, 3, 2)),
                               samples, eps, tol, seed)
    onehot = B.asarray(np.eye(4)[rng.integers(0, 4, 5)])
    results += check_layer(B, "SpreadLoss", _LossLayer(SpreadLoss(B, m_start=0.5), onehot), rng.uniform(0, 1, (5, 4)),
                           samples, eps, tol, seed)
    return results


# ---- the whole model ------------------------------------------------------------------------------
SMALL = dict(input_shape=(1, 14, 14), conv_channels=8, conv_kernel=3, primary_types=4, primary_dim=4,
             primary_kernel=3, primary_stride=2, n_classes=4, class_dim=6, decoder_hidden=(16, 24))
# The EM network at a size for float64 checks: a 10x10 primary grid, 4x4 and 2x2 convolutional capsules.
SMALL_EM = dict(input_shape=(1, 12, 12), conv_channels=4, conv_kernel=3, conv_stride=1, primary_types=2,
                matrix_types=(3, 3), n_classes=3, decoder_hidden=(8, 12), routing="em", em_lambda=0.05,
                routing_iters=3)  # the paper's 3 iterations (two E-steps to differentiate through), not the default 2
SMALL_BY_ROUTING = {"dynamic": SMALL, "attention": {**SMALL, "routing": "attention"}, "em": SMALL_EM,
                    **{r: {**SMALL, "routing": r} for r in ROUTED}}


def small_of(routing) -> dict:
    """The built-in network of ``routing`` at SMALL's size (any registered routing's too)."""
    return SMALL_BY_ROUTING.get(routing) or {**SMALL, "routing": routing}


def model_checks(B, samples=12, eps=1e-5, tol=1e-6, floor=1e-4, seed=0, batch=3, **config):
    """A built-in network's full loss (class + reconstruction) w.r.t. every parameter and the input."""
    cfg = {**small_of(config.get("routing", "dynamic")), **config}
    model = CapsNet(B, seed=seed, **cfg)
    c = model.config
    name = "CapsNet" if c.routing == "dynamic" else f"CapsNet {c.routing}"
    label = (f"{name}{'' if c.routing == 'attention' else ' routing=' + c.routing_grad}"
             f"{' shared' if c.share_spatial else ''}"
             f"{' im2col' if c.primary_conv == 'im2col' else ''}"
             f"{f' conv1 stride {c.conv_stride}' if c.conv_stride != 1 and c.routing != 'em' else ''}")
    return network_checks(B, model, label, samples, eps, tol, floor, seed, batch)


def network_checks(B, model, label, samples=12, eps=1e-5, tol=1e-6, floor=1e-4, seed=0, batch=3):
    """Any Network's full loss w.r.t. every parameter tensor and the input, on a random batch."""
    rng = np.random.default_rng(seed)
    x = B.asarray(rng.random((batch, *model.input_shape)))
    y = rng.integers(0, model.n_classes, batch)
    model.zero_grad()
    model.loss(x, y)
    for _, layer in model.routing_layers():
        _freeze_final_coupling(layer)
    for layer in model.parts():
        _hold_mask(layer)
    dx = model.backward(input_grad=True)
    tensors = {"input": x, **model.params}
    analytic = {"input": dx, **model.grads}
    return check_tensors(B, label, lambda: model.loss(x, y).loss, tensors, analytic,
                         samples, eps, tol, floor, seed)


def composed_architectures(mode="full"):
    """Two compositions beyond the built-ins, at a size for float64 checks: two dynamic-routing
    layers stacked (primary -> 4 capsules of 5D, transforms shared over positions -> 3 classes),
    each with a bias on s_j, its convolutions started and scaled as the paper's published code
    does, and ConvCaps between PrimaryCaps and the class capsules (3x3/1 windows
    over a 5x5 primary grid), the latter also on colour images normalised per channel; and a
    ResNet's residual blocks (one with the identity shortcut, one projecting to a strided grid),
    batch-normed in training mode, before primary capsules."""
    two = [arch.conv2d(6, 3, init_std=0.3, bias=0.1, name="conv1"), arch.relu(name="relu1"),
           arch.primary_caps(3, 4, 3, 2, init_std=0.2, bias=0.1, scale=0.25, name="primary"),
           arch.dynamic_caps(4, 5, routing_grad=mode, share_spatial=True, bias=0.1, name="caps1"),
           arch.dynamic_caps(3, 6, routing_grad=mode, bias=-0.2, name="classcaps")]
    conv = [arch.conv2d(6, 3, name="conv1"), arch.relu(name="relu1"), arch.primary_caps(2, 4, 3, 2, name="primary"),
            arch.conv_caps(3, 4, 3, 1, routing_grad=mode, name="convcaps"),
            arch.dynamic_caps(3, 6, routing_grad=mode, name="classcaps")]
    colour = [arch.normalize([0.5, 0.4, 0.3], [0.25, 0.2, 0.3], name="norm"), *conv]
    resnet = [arch.conv2d(4, 3, padding=1, name="conv1"), arch.batch_norm(name="bn1"), arch.relu(name="relu1"),
              arch.basic_block(4, name="block1"), arch.relu(name="relu2"),
              arch.basic_block(6, 2, project=True, name="block2"), arch.relu(name="relu3"),
              arch.primary_caps(2, 4, 3, 1, conv="im2col", name="primary"),
              arch.dynamic_caps(3, 6, routing_grad=mode, name="classcaps")]
    small = dict(decoder=arch.decoder((8, 12)), input_shape=(1, 13, 13), n_classes=3)
    return {f"two routing layers routing={mode}": arch.network(two, **small),
            f"ConvCaps network routing={mode}": arch.network(conv, **small),
            f"colour, normalised, ConvCaps routing={mode}": arch.network(colour, **{**small, "input_shape": (3, 13, 13)}),
            f"residual blocks routing={mode}": arch.network(resnet, **{**small, "input_shape": (3, 9, 9)})}


def composed_checks(B, samples=12, eps=1e-5, tol=1e-6, floor=1e-4, seed=0, batch=3):
    """network_checks of ``composed_architectures`` in both routing-gradient modes."""
    results = []
    for mode in ("full", "final"):
        for label, description in composed_architectures(mode).items():
            model = away_from_init(arch.build(description, B, seed=seed), seed)
            results += network_checks(B, model, label, samples, eps, tol, floor, seed, batch)
    return results


def away_from_init(model, seed=0):
    """``model`` with its routing transforms W ~ N(0, 0.5^2): at a small init routing is nearly
    uniform, and a check would exercise little of it."""
    for _, layer in model.routing_layers():
        W = layer.params["W"]
        W[...] = model.B.asarray(0.5 * np.random.default_rng(seed).standard_normal(W.shape))
    return model


def layer_checks_of(B, model, samples=20, eps=1e-5, tol=1e-6, seed=0, batch=2):
    """check_layer of every layer of ``model``'s body, each on the input it receives from a random
    batch of images (run through the layers before it)."""
    rng = np.random.default_rng(seed)
    host = lambda a: tuple(B.to_numpy(p) for p in a) if isinstance(a, tuple) else B.to_numpy(a)
    device = lambda a: tuple(B.asarray(p) for p in a) if isinstance(a, tuple) else B.asarray(a)
    h = rng.random((batch, *model.input_shape[1:], model.input_shape[0]))   # channels-last images
    results = []
    for name, layer in model.body:
        x_host, h = h, host(layer.forward(device(h)))  # the next layer's input, before the checks move this one
        results += check_layer(B, name, layer, x_host, samples, eps, tol, seed)
    return results


def run_network(B, description, samples=20, tol=1e-6, seed=0, report=None):
    """Every layer of the described network, then its whole loss (``pycapsnet gradcheck --network``)."""
    require_float64(B)
    description = dict(arch.load(description) if isinstance(description, str) else description)
    description["input_shape"] = description.get("input_shape") or [1, 28, 28]  # null: the data's, here MNIST's
    description["n_classes"] = description.get("n_classes") or 10
    results = _Reported(report)
    results += layer_checks_of(B, arch.build(description, B, seed=seed), samples, 1e-5, tol, seed)
    # a fresh build for the whole loss: the layer checks left "final" layers holding their coupling
    results += network_checks(B, arch.build(description, B, seed=seed), "network", samples, 1e-5, tol, seed=seed)
    return list(results)


def require_float64(B):
    """Finite differences check a gradient only in float64.  In float32 a loss of O(1) rounds at
    ~1e-7, so the step must be ~1e-2 to rise above it, and the curvature over such a step is of the
    size of the gradients being checked: at h = 1e-2 and a 2% tolerance, 20 of the 84 checks failed
    on a correct backward.  The backward is the same code in both dtypes; a float32 backward is
    compared with the float64 one instead (``pycapsnet crosscheck --dtype-b float32``)."""
    if B.dtype != "float64":
        raise CapsNetError(f"gradcheck runs in float64 only, not {B.dtype}: float32 rounding swamps finite "
                           "differences (20 of 84 checks fail on a correct backward). The backward is the same "
                           "code in both dtypes; to check a float32 backward against the float64 one checked "
                           "here: pycapsnet crosscheck --a numpy --b BACKEND --dtype-b float32")


# Per routing: its layer checks, and the full-loss checks of its network (the config overrides of each).
LAYER_CHECKS = {"dynamic": _dynamic_layer_checks, "em": em_layer_checks, "attention": attention_layer_checks}
MODEL_CHECKS = {
    "dynamic": [dict(routing_grad="full"), dict(routing_grad="final"), dict(share_spatial=True),
                dict(primary_conv="im2col"),  # the default convolves by FourierConv2d
                dict(conv_stride=2), dict(conv_stride=3)],  # conv1 strided: a 2x2 and a 1x1 primary grid
    "em": [dict(routing="em", routing_grad="full"), dict(routing="em", routing_grad="final")],
    "attention": [dict(routing="attention"), dict(routing="attention", share_spatial=True),
                  dict(routing="attention", conv_stride=2)],
}


def layer_checks_of_routing(routing):
    """The layer checks of ``routing``: the built-in ones' own, or any registered routing in the
    fully connected and convolutional layers (gradcheck_routings.routing_layer_checks)."""
    return LAYER_CHECKS.get(routing) or functools.partial(routing_layer_checks, routing)


def model_checks_of_routing(routing) -> list:
    """The full-loss checks of ``routing``'s network: each gradient mode where it iterates."""
    if routing in MODEL_CHECKS:
        return MODEL_CHECKS[routing]
    own = routings.get(routing)
    return [dict(routing=routing, routing_grad=mode) for mode in own.modes if own.iterated or mode == "full"]


def run_all(backend="numpy", device=None, dtype="float64", samples=20, tol=1e-6, seed=0, routing=None,
            report=None):
    """Every layer check, then the full-loss checks of each routing (MODEL_CHECKS); ``routing``: that
    routing's layers and network only.  ``report(check)`` is called on each as it is done."""
    B = _backends.get(backend, device=device, dtype=dtype)
    require_float64(B)
    eps = 1e-5
    chosen = ["dynamic", "em", "attention", *ROUTED] if routing is None else [routing]
    results = _Reported(report)
    for r in chosen:
        results += layer_checks_of_routing(r)(B, samples, eps, tol, seed)
    for r in chosen:
        for config in model_checks_of_routing(r):
            results += model_checks(B, samples, eps, tol, seed=seed, **config)
    if routing in (None, "dynamic"):
        results += composed_checks(B, samples, eps, tol, seed=seed)
    if routing in (None, "attention"):
        model = away_from_init(arch.build(efficient_architecture(), B, seed=seed), seed)
        results += network_checks(B, model, "Efficient-CapsNet's structure", samples, eps, tol, seed=seed)
    if routing is None or routing in ROUTED:
        results += routing_composed_checks(B, samples, eps, tol, seed=seed)
    return list(results)


def routing_composed_checks(B, samples=12, eps=1e-5, tol=1e-6, floor=1e-4, seed=0, batch=3):
    """network_checks of gradcheck_routings' compositions, in both routing-gradient modes."""
    results = []
    for mode in ("full", "final"):
        for label, description in routing_compositions(mode).items():
            if mode == "final" and "routing=" not in label:
                continue  # nothing in it iterates: the same network as in "full"
            model = away_from_init(arch.build(description, B, seed=seed), seed)
            results += network_checks(B, model, label, samples, eps, tol, floor, seed, batch)
    return results


class _Reported(list):
    """A list of results that hands each group to ``report`` as it is added (the CLI prints them
    as they are checked, not all at the end)."""

    def __init__(self, report=None):
        super().__init__()
        self.report = report

    def __iadd__(self, results):
        self.extend(results)
        if self.report is not None:
            for r in results:
                self.report(r)
        return self

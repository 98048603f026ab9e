"""Describe a network, then build it.  A description is plain data (JSON): the input shape, the
number of classes, the body's layers in order, the head, the class loss and the decoder.

    arch = network(body=[conv2d(256, 9, name="conv1"), relu(),
                         primary_caps(32, 8, kernel=9, stride=2, name="primary"),
                         dynamic_caps(32, 12, name="caps1"), dynamic_caps(10, 16, name="classcaps")],
                   input_shape=(1, 28, 28))
    model = build(arch, backends.get("numpy"), seed=0)      # a Network (network.py)

Each layer takes the shape its predecessor emits (worked out here, before anything is allocated),
so a routing layer infers its input capsule count.  Layers that do not fit are refused at build
time in one line naming both layers and both shapes.  Checkpoints record the description
(``Network.architecture``): ``evaluate``, ``inspect`` and ``--resume`` rebuild the network from it.

What flows between layers, per sample (``Flow``):
    image    (H, W, C) channels-last
    vector   capsules (P, T, K): P positions of a (H, W) grid, or no grid (P = 1) after a routing layer
    matrix   (M (H, W, T, 16), a (H, W, T)) on a grid, or (μ (J, 16), a (J)) after class capsules
    flat     (F) features: a flattened image or capsules, a Linear layer's output (the baseline CNN)
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import numpy as np

from pycapsnet import backends
from pycapsnet.backends.host import machine_memory

from . import description, routings
from .description import DESCRIBED, DESCRIPTION_LIMIT, load  # noqa: F401 -- architecture.load(path), as callers know it
from .batch_norm import BatchNorm
from .capsules import AttentionCaps, CapsuleLogits, ClassCaps, PrimaryCaps
from .conv_caps import ConvCaps
from .init import given, he_uniform, routed_std
from .layer_norm import LayerNorm
from .cnn_layers import Dropout, Flatten, MaxPool2d
from .fourier import FourierConv2d
from .layers import Conv2d, Linear, Normalize, ReLU, Sigmoid
from .losses import MarginLoss, NegativeLogLikelihood, ReconstructionLoss, SoftmaxCrossEntropy, SpreadLoss
from .matrix_capsules import ClassMatrixCaps, ConvMatrixCaps, PrimaryMatrixCaps
from .heads import ActivationHead, LengthHead, LogitsHead, MaskedDecoder
from .network import Network
from .sequential import Sequential
from .residual import Residual
from .parts import (  # noqa: F401 -- the parts of a description, re-exported: architecture.conv2d(...)
    DEFAULT_LOSS, attention_caps, batch_norm, capsule_logits, class_matrix_caps, conv2d, conv_caps, conv_matrix_caps,
    cross_entropy, decoder, dropout, dynamic_caps, flatten, layer_norm, linear, margin_loss, max_pool, network, nll_loss,
    normalize, primary_caps, primary_matrix_caps, relu, residual, basic_block, spread_loss)
from ..errors import CapsNetError


@dataclass(frozen=True)
class Flow:
    """What one sample carries between two layers: kind "image" (grid (H, W), C channels),
    "vector" (grid or None, T capsule types, K dims), "matrix" (grid or None, T types, 4x4 poses) or
    "flat" (no grid, T features)."""
    kind: str
    grid: tuple | None
    types: int
    dim: int = 16

    def __str__(self):
        if self.kind == "flat":
            return f"{self.types} features"
        if self.kind == "image":
            return f"a {self.grid[0]}x{self.grid[1]} image of {self.types} channels"
        what = f"capsule{'s' if self.grid is None else ' types'} of {self.dim}D" if self.kind == "vector" \
            else f"matrix capsule{'s' if self.grid is None else ' types'} (4x4 poses)"
        return f"{self.types} {what}" if self.grid is None else \
            f"a {self.grid[0]}x{self.grid[1]} grid of {self.types} {what}"


# ---- building --------------------------------------------------------------------------------------
def _conv2d(B, flow, rng, channels, kernel, stride=1, padding=0, conv="im2col", init_std=None, bias=None):
    if conv not in ("im2col", "fourier"):  # the same layer (parameters, initialisation, results to rounding) either way
        raise ValueError(f"unknown convolution {conv!r}: use 'im2col' or 'fourier'")
    grid = _windows(_need(flow, "image"), kernel, stride, padding)  # checked before the weights are drawn
    layer = (FourierConv2d if conv == "fourier" else Conv2d)(B, flow.types, channels, kernel, stride, padding,
                                                             rng=rng, init=given(he_uniform, init_std, bias))
    return layer, Flow("image", grid, channels)


def _relu(B, flow, rng):
    if flow.kind == "matrix":
        raise _Misfit("it takes an image, vector capsules or features, not (pose, activation) pairs")
    return ReLU(B), flow


def _max_pool(B, flow, rng, kernel=2, stride=None):
    layer = MaxPool2d(B, kernel, stride)
    return layer, Flow("image", _fits(layer.output_hw(*_need(flow, "image").grid), kernel, layer.stride), flow.types)


def _flatten(B, flow, rng):
    if flow.kind == "matrix":
        raise _Misfit("it takes an image, vector capsules or features")
    size = math.prod(flow.grid or (1,)) * flow.types * (1 if flow.kind in ("image", "flat") else flow.dim)
    return Flatten(B), Flow("flat", None, size, 1)


def _linear(B, flow, rng, features):
    return Linear(B, _need(flow, "flat").types, features, rng=rng, init=he_uniform), Flow("flat", None, features, 1)


def _dropout(B, flow, rng, rate=0.5):
    if flow.kind == "matrix":
        raise _Misfit("it takes an image, vector capsules or features")
    return Dropout(B, rate, seed=int(rng.integers(2**63))), flow


def _batch_norm(B, flow, rng, momentum=0.1, eps=1e-5):
    if flow.kind not in ("image", "flat"):
        raise _Misfit("it takes an image or features")
    return BatchNorm(B, flow.types, momentum, eps), flow


def _primary_caps(B, flow, rng, types, dim, kernel=9, stride=2, conv="fourier", squash="sabour", init_std=None,
                  bias=None, scale=1.0):
    grid = _windows(_need(flow, "image"), kernel, stride)
    layer = PrimaryCaps(B, flow.types, types, dim, kernel, stride, rng=rng, conv=conv, squash=squash,
                        init_std=init_std, bias=bias, scale=scale)
    return layer, Flow("vector", grid, types, dim)


def _routed_from(flow, share_spatial, capsules, dim, init_std):
    """((positions, types, dims) of a routing layer's input capsules, its transforms' init std)."""
    _need(flow, "vector")
    if share_spatial and flow.grid is None:
        raise _Misfit("share_spatial shares a transform over the positions of a grid, and this input has none")
    positions = math.prod(flow.grid) if flow.grid else 1
    std = routed_std(positions * flow.types, capsules, dim) if init_std is None else init_std
    return (positions, flow.types, flow.dim), std


# A routed layer's options beyond its own are its routing's (routings.py: the ones it declares)
def _dynamic_caps(B, flow, rng, capsules, dim, iters=None, routing_grad="full", share_spatial=False, init_std=None,
                  bias=None, routing="dynamic", **routing_options):
    children, std = _routed_from(flow, share_spatial, capsules, dim, init_std)
    layer = ClassCaps(B, *children, capsules, dim, iters, routing_grad, share_spatial, rng=rng, init_std=std,
                      bias=bias, routing=routing, **routing_options)
    return layer, Flow("vector", None, capsules, dim)


def _attention_caps(B, flow, rng, capsules, dim, share_spatial=False, init_std=None):
    children, std = _routed_from(flow, share_spatial, capsules, dim, init_std)
    layer = AttentionCaps(B, *children, capsules, dim, share_spatial=share_spatial, rng=rng, init_std=std)
    return layer, Flow("vector", None, capsules, dim)


def _conv_caps(B, flow, rng, types, dim, kernel=3, stride=1, iters=None, routing_grad="full", init_std=None,
               routing="dynamic", **routing_options):
    if _need(flow, "vector").grid is None:
        raise _Misfit("convolutional capsules need a grid of capsules, and this input has none")
    grid = _windows(flow, kernel, stride)
    layer = ConvCaps(B, flow.grid, flow.types, flow.dim, types, dim, kernel, stride, iters, routing_grad, rng=rng,
                     init_std=init_std, routing=routing, **routing_options)
    return layer, Flow("vector", grid, types, dim)


def _capsule_logits(B, flow, rng):
    if _need(flow, "vector").grid is not None:
        raise _Misfit("it takes class capsules without a grid (after a routing layer)")
    return CapsuleLogits(B, flow.dim, rng=rng), Flow("flat", None, flow.types, 1)


def _normalize(B, flow, rng, mean, std):
    if flow.kind != "image" or len(mean) != flow.types or len(std) != flow.types:
        raise _Misfit(f"it takes an image of as many channels as it has means and deviations ({len(mean)}), "
                      f"here {flow.types if flow.kind == 'image' else 'no image'}")
    return Normalize(B, mean, std), flow


def _layer_norm(B, flow, rng, eps=1e-5):
    if flow.kind == "matrix":
        raise _Misfit("it takes an image, vector capsules or features, not (pose, activation) pairs")
    return LayerNorm(B, flow.dim if flow.kind == "vector" else flow.types, eps), flow


def _primary_matrix_caps(B, flow, rng, types):
    return PrimaryMatrixCaps(B, _need(flow, "image").types, types, rng=rng), Flow("matrix", flow.grid, types)


def _conv_matrix_caps(B, flow, rng, types, kernel=3, stride=1, iters=2, routing_grad="full", em_lambda=1e-3):
    if _need(flow, "matrix").grid is None:
        raise _Misfit("convolutional capsules need a grid of capsules, and this input has none")
    grid = _windows(flow, kernel, stride)
    layer = ConvMatrixCaps(B, flow.types, types, kernel, stride, iters, routing_grad, em_lambda, rng=rng)
    return layer, Flow("matrix", grid, types)


def _class_matrix_caps(B, flow, rng, capsules, iters=2, routing_grad="full", em_lambda=1e-3):
    if _need(flow, "matrix").grid is None:
        raise _Misfit("class matrix capsules take a grid of matrix capsules, and this input has none")
    layer = ClassMatrixCaps(B, flow.grid, flow.types, capsules, iters, routing_grad, em_lambda, rng=rng)
    return layer, Flow("matrix", None, capsules)


def _residual(B, flow, rng, body, shortcut=None):
    """residual.Residual: ``body`` and ``shortcut`` (None: the identity) built from ``flow``, and
    refused unless both emit the same."""
    main, out, last = _chain(B, body, flow, rng, "the block's input", "the residual block's ")
    side, side_out, side_last = (None, flow, "the identity shortcut") if shortcut is None else \
        _chain(B, shortcut, flow, rng, "the block's input", "the residual block's shortcut's ")
    if out != side_out:
        raise _Misfit(f"its body ends in {last}, which emits {out}, and its shortcut ({side_last}) emits {side_out}: "
                      "they are added, so they must emit the same (a projection where the body changes the shape: "
                      "a 1x1 convolution of the body's stride and channels)")
    return Residual(B, main, side), out


LAYERS = {"conv2d": _conv2d, "relu": _relu, "max_pool": _max_pool, "flatten": _flatten, "linear": _linear,
          "dropout": _dropout, "batch_norm": _batch_norm, "primary_caps": _primary_caps, "dynamic_caps": _dynamic_caps,
          "attention_caps": _attention_caps, "conv_caps": _conv_caps, "primary_matrix_caps": _primary_matrix_caps,
          "conv_matrix_caps": _conv_matrix_caps, "class_matrix_caps": _class_matrix_caps,
          "capsule_logits": _capsule_logits, "layer_norm": _layer_norm, "normalize": _normalize,
          "residual": _residual}
HEADS = {"lengths": ("vector", LengthHead), "activations": ("matrix", ActivationHead), "logits": ("flat", LogitsHead)}
LOSSES = {"margin": MarginLoss, "spread": SpreadLoss, "cross_entropy": SoftmaxCrossEntropy, "nll": NegativeLogLikelihood}


class _Misfit(Exception):
    """A layer cannot take what its predecessor emits: the reason, completed by ``build``."""


def _need(flow, kind):
    if flow.kind != kind:
        raise _Misfit(f"it takes {'an image' if kind == 'image' else kind + ' capsules'}")
    return flow


def _fits(grid, kernel, stride):
    if min(grid) < 1:
        raise _Misfit(f"its {kernel}x{kernel} windows (stride {stride}) do not fit in the input")
    return tuple(int(d) for d in grid)


def _windows(flow, kernel, stride, padding=0):
    """The grid of a layer's valid windows over ``flow``'s grid, from the sizes alone: a layer whose
    windows do not fit is refused before its weights are allocated."""
    return _fits(tuple((d + 2 * padding - kernel) // stride + 1 for d in flow.grid), kernel, stride)


def _options(fn, spec, label):
    """The keyword options of ``spec`` for builder ``fn``; CapsNetError naming what is unknown or missing."""
    options = {k: v for k, v in spec.items() if k not in ("layer", "name")}
    params = list(inspect.signature(fn).parameters.values())[3:]  # after (B, flow, rng)
    routed = params and params[-1].kind == inspect.Parameter.VAR_KEYWORD  # and the options of its routing
    params = [p for p in params if p.kind != inspect.Parameter.VAR_KEYWORD]
    allowed = [p.name for p in params]
    if routed:
        name = spec.get("routing", "dynamic")
        allowed += list(routings.get(name).options) if name in routings.names() else []
        owners = {k: r for r in routings.names() for k in routings.get(r).options}
        theirs = sorted(k for k in set(options) - set(allowed) if k in owners)
        if theirs:
            raise CapsNetError(f"{label}: " + ", ".join(f"{k} is an option of routing '{owners[k]}'" for k in theirs)
                               + f", not of '{name}'")
    unknown = sorted(set(options) - set(allowed))
    missing = [p.name for p in params if p.default is inspect.Parameter.empty and p.name not in options]
    if unknown or missing:
        what = "; ".join(([f"unknown option {', '.join(unknown)}"] if unknown else [])
                         + ([f"missing {', '.join(missing)}"] if missing else []))
        raise CapsNetError(f"{label}: {what} (its options: {', '.join(allowed) or 'none'})")
    return options


def build_body(B, body, input_shape, rng=None):
    """(Sequential, the Flow it emits, how its last layer is named in messages) from the body's
    layer descriptions, for images of ``input_shape`` (C, H, W), initialised from ``rng`` (default:
    seed 0).  Each layer's input is worked out from the one before, so that layers built this way
    need no count the description can infer; each keeps the Flow it takes and the one it emits
    (``in_flow``, ``out_flow``)."""
    rng = np.random.default_rng(0) if rng is None else rng
    c, h, w = input_shape
    if c == h != w:  # (20, 20, 64): a square image's height, width and channels, in that order
        raise CapsNetError(f"input_shape is (channels, height, width); {tuple(input_shape)} reads as a {h}x{w} "
                           f"image of {c} channels -- if it is a {c}x{h} image of {w} channels, give ({w}, {c}, {h})")
    return _chain(B, body, Flow("image", (h, w), c), rng, "the input")


def _chain(B, body, flow, rng, prev, within=""):
    """(Sequential, the Flow it emits, its last layer in words) of the layers ``body`` describes,
    taking ``flow`` from ``prev``; ``within``: the block they are part of, in messages."""
    layers, counts = [], {}
    for k, spec in enumerate(body):
        kind = spec.get("layer") if isinstance(spec, dict) else None
        if kind not in LAYERS:
            raise CapsNetError(f"{within}body layer {k + 1}: unknown layer {kind!r}; use one of {', '.join(LAYERS)}")
        counts[kind] = counts.get(kind, 0) + 1
        name = str(spec.get("name") or f"{kind}{counts[kind]}")
        label = f"{within}layer '{name}' ({kind})"
        options = _options(LAYERS[kind], spec, label)
        try:
            layer, out = LAYERS[kind](B, flow, rng, **options)
        except _Misfit as e:
            raise CapsNetError(f"{label} cannot follow {prev}, which emits {flow}: {e}") from None
        except (ValueError, TypeError) as e:  # a layer's own refusal of an option
            raise CapsNetError(f"{label}: {e}") from None
        layers.append((name, layer))
        layer.in_flow, layer.out_flow = flow, out  # what it takes and gives: inspect's pictures, summary()
        flow, prev = out, f"'{name}' ({kind})"
    return Sequential(B, layers), flow, prev


def assemble(B, arch: dict, seed: int = 0) -> dict:
    """The keyword arguments of ``Network`` for description ``arch``: its parts built on backend B,
    initialised from ``seed`` (the body's layers in order, then the decoder's)."""
    description.check(arch)
    if arch.get("input_shape") is None or arch.get("n_classes") is None:
        raise CapsNetError("the network description needs input_shape (C, H, W) and n_classes to be built")
    _fits_memory(arch, B)
    input_shape = tuple(int(d) for d in arch["input_shape"])
    n_classes = int(arch["n_classes"])
    if len(input_shape) != 3 or min(input_shape) < 1 or n_classes < 2:
        raise CapsNetError(f"input_shape must be 3 sizes (C, H, W) and n_classes at least 2, got "
                           f"{list(input_shape)} and {n_classes}")
    rng = np.random.default_rng(seed)
    body, flow, last = build_body(B, arch["body"], input_shape, rng)
    head = arch.get("head", "lengths")
    if head not in HEADS:
        raise CapsNetError(f"unknown head {head!r}; use one of {', '.join(HEADS)}")
    kind, head_cls = HEADS[head]
    if flow.kind != kind or flow.grid is not None or flow.types != n_classes:
        what = f"{n_classes} features (one logit per class)" if kind == "flat" else \
            f"{n_classes} {kind} capsules without a grid (one per class)"
        raise CapsNetError(f"the head '{head}' takes {what}, but the body's last layer {last} emits {flow}")
    if kind == "flat" and arch.get("decoder"):
        raise CapsNetError("the head 'logits' has no class capsules for a decoder to reconstruct from: "
                           "describe the network with decoder=None")
    loss = dict(arch.get("loss") or DEFAULT_LOSS[head]())
    loss_cls = LOSSES.get(loss.pop("loss", None))
    if loss_cls is None:
        raise CapsNetError(f"unknown loss in {arch.get('loss')}; use one of {', '.join(LOSSES)}")
    parts = dict(body=body, head=head_cls(B), class_loss=loss_cls(B, **loss), input_shape=input_shape,
                 n_classes=n_classes, class_dim=flow.dim, architecture=arch)
    if arch.get("decoder"):
        parts["decoder"], parts["recon_loss"] = _decoder(B, arch["decoder"], n_classes * flow.dim, input_shape, rng)
    return parts


def _fits_memory(arch, B) -> None:
    """Refuse, before anything is allocated, a network whose parameters cannot be trained in this
    machine's memory: each is held six times (itself, its gradient, Adam's two moments, and the
    host copies of parameters and moments that a checkpoint writes), and the largest is first
    drawn in float64 and copied (12 bytes an entry).  Working arrays come on top, so the bound
    is 90% of the memory, not all of it."""
    sizes = [math.prod(s) for s in description.param_shapes(arch).values()] or [0]
    need, have = 6 * sum(sizes) * np.dtype(B.dtype).itemsize + 12 * max(sizes), machine_memory()
    if have and need > 0.9 * have:
        raise CapsNetError(f"the described network holds {sum(sizes):,} parameters, {need / 2**30:.1f} GiB with their "
                           f"gradients, Adam's moments and a checkpoint's copies, more than this machine's "
                           f"{have / 2**30:.1f} GiB allow: make its layers smaller")


def _decoder(B, spec, n_in, input_shape, rng):
    """(MaskedDecoder, ReconstructionLoss): Linear + ReLU per hidden size, then Linear + Sigmoid to pixels."""
    hidden = [int(d) for d in spec.get("hidden", ())]
    sizes = (n_in, *hidden, math.prod(input_shape))
    layers = []
    for k, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]), start=1):
        last = k == len(sizes) - 1
        layers.append((f"decoder{k}", Linear(B, a, b, rng=rng, init=None if last else he_uniform)))
        layers.append((f"decoder{k}_{'sigmoid' if last else 'relu'}", Sigmoid(B) if last else ReLU(B)))
    return MaskedDecoder(B, layers), ReconstructionLoss(B, spec.get("weight", 0.0005))


def build(arch: dict, backend="numpy", seed: int = 0) -> Network:
    """The Network that ``arch`` describes, on ``backend`` (a Backend or a name)."""
    B = backends.get(backend)
    try:
        return Network(B, **assemble(B, arch, seed))
    except MemoryError:  # what the parameters' preflight does not count: a layer's own working arrays
        raise CapsNetError("building the described network ran out of memory; make its layers smaller") from None

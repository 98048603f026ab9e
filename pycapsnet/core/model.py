"""The CapsNet of Sabour, Frosst & Hinton (2017): conv1 -> PrimaryCaps -> ClassCaps (dynamic routing)
-> capsule lengths, with a masked decoder that reconstructs the input.  ``routing`` picks the
capsule part of the network (the rest is shared):
    "dynamic"    the network below, margin loss
    "attention"  the same with self-attention routing (Efficient-CapsNet) in place of dynamic routing
    "em"         matrix capsules with EM routing (Hinton et al. 2018), spread loss on the class activations:
                 conv1 5x5/2, 32 channels, ReLU --PrimaryMatrixCaps 1x1, 8 types--ConvMatrixCaps 3x3/2, 16 types
                 --ConvMatrixCaps 3x3/1, 16 types--ClassMatrixCaps (coordinate addition)--> poses (N, J, 16), a (N, J)
    Each feeds its class capsules (poses for EM) to the same masked decoder, and its class scores
    (|v_j|, or a_j for EM) to the loss and the predictions.

    x (N, C, H, W) --conv1 9x9, 256, ReLU--> (N, H1, W1, 256)
                   --PrimaryCaps 9x9/2, 32 types x 8D--> u_i (N, P, 32, 8), P = H2*W2
                   --ClassCaps, routing r=3--> v_j (N, 10, 16) --|.|--> lengths (N, 10)
    decoder: v masked by the label (training) or by the longest capsule (evaluation), flattened
             (N, 160) --512 ReLU--1024 ReLU--C*H*W sigmoid--> reconstruction (N, C, H, W)
    loss = margin(lengths, y) + 0.0005 * sum-of-squares(reconstruction - x)
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import math

import numpy as np

from pycapsnet import backends as _backends

from . import architecture as arch, routings
from .capsules import PrimaryCaps
from .checks import check_setting, config_with, MAX_ROUTING_ITERS
from .description import param_shapes as described
from .heads import Outputs  # noqa: F401  (part of this module's public names)
from .network import Network
from .routing import MODES as ROUTING_MODES
from ..errors import CapsNetError


# The paper's network routed otherwise: "em" is matrix capsules (its own layers); every other name is a
# routing of the registry (routings.py: the built-in ones and any registered), run by the class layer.
# A routing's paper's head and loss, and its transforms' init, are its own (Routing.head, transform_std).
_VECTOR_CAPSULES = dict(conv_channels=256, conv_kernel=9, conv_stride=1, primary_types=32,  # Sabour et al.'s
                        routing_iters=3)
# The paper routes 3 times; 2 is EM's default here because the 3-iteration network learns far
# more slowly on the embedded digits (docs/performance.md, "The three routings").  The EM column is
# the paper's matrix-capsule network (32 channels of 5x5/2, 8 primary capsule types).
_EM = dict(conv_channels=32, conv_kernel=5, conv_stride=2, primary_types=8, routing_iters=2)


def routing_names() -> tuple:
    """What CapsNetConfig.routing takes: "em" and every registered routing."""
    names = routings.names()
    return (*names[:1], "em", *names[1:])


def routing_defaults(routing: str) -> dict:
    """Defaults that depend on the routing (a field left None takes its routing's)."""
    if routing == "em":
        return dict(_EM)
    iterated = routing in ("dynamic", "attention") or routings.get(routing).iterated
    return dict(_VECTOR_CAPSULES, routing_iters=routings.DEFAULT_ITERS if iterated else 1)


EM_KERNELS = ((3, 2), (3, 1))  # (kernel, stride) of the two ConvMatrixCaps, the paper's


@dataclass
class CapsNetConfig:
    input_shape: tuple = (1, 28, 28)      # (C, H, W)
    n_classes: int = 10
    routing: str = "dynamic"              # "em" | a registered routing (routing_names())
    conv_channels: int = None             # None: the routing's default (routing_defaults)
    conv_kernel: int = None
    conv_stride: int = None
    primary_types: int = None
    primary_dim: int = 8
    primary_kernel: int = 9
    primary_stride: int = 2
    primary_conv: str = "fourier"         # "fourier" | "im2col": how PrimaryCaps convolves (same result)
    class_dim: int = 16
    routing_iters: int = None             # None: the routing's default (3; EM: 2)
    routing_grad: str = "full"            # "full" | "final" (dynamic and EM routing)
    share_spatial: bool = False           # dynamic and attention routing
    matrix_types: tuple = (16, 16)        # EM: capsule types C, D of the two ConvMatrixCaps
    em_lambda: float = 1e-3               # EM: inverse temperature λ of the last iteration (em_routing.py)
    decoder_hidden: tuple = (512, 1024)
    recon_weight: float = 0.0005
    m_plus: float = 0.9
    m_minus: float = 0.1
    lam: float = 0.5
    input_mean: tuple = None              # each channel's mean and deviation: a first layer normalises
    input_std: tuple = None               # the input with them (train --normalize: the training split's)

    def __post_init__(self):
        if not isinstance(self.routing, str) or self.routing not in routing_names():
            raise CapsNetError(f"CapsNetConfig.routing must be one of {routing_names()} (a routing of your own: "
                               f"import the module that registers it), got {self.routing!r}")
        for name, value in routing_defaults(self.routing).items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        self.input_shape = tuple(int(d) for d in self.input_shape)
        self.decoder_hidden = tuple(int(d) for d in self.decoder_hidden)
        self.matrix_types = tuple(int(d) for d in self.matrix_types)
        # Refuse what cannot build a network here, naming the field, rather than fail later inside
        # an initialiser (a zero fan-in) or a reshape (zero capsule types).
        sizes = ("n_classes", "conv_channels", "conv_kernel", "conv_stride", "primary_types", "primary_dim",
                 "primary_kernel", "primary_stride", "class_dim", "routing_iters")
        for name in sizes:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise CapsNetError(f"CapsNetConfig.{name} must be an integer of at least 1, got {value!r}")
        if self.routing_iters > MAX_ROUTING_ITERS:
            raise CapsNetError(f"CapsNetConfig.routing_iters (--routing-iters) must be at most {MAX_ROUTING_ITERS}, "
                               f"got {self.routing_iters}: the papers route 1 to 3 times")
        bad = [f"{name} {getattr(self, name)}" for name in ("input_shape", "decoder_hidden", "matrix_types")
               if any(d < 1 for d in getattr(self, name))]
        if bad:
            raise CapsNetError(f"CapsNetConfig: every size in {' and '.join(bad)} must be at least 1")
        if len(self.matrix_types) != len(EM_KERNELS):
            raise CapsNetError(f"CapsNetConfig.matrix_types needs {len(EM_KERNELS)} sizes (one per ConvMatrixCaps), "
                               f"got {self.matrix_types}")
        self._check_normalisation()
        if self.routing == "em" and self.class_dim != 16:
            raise CapsNetError(f"CapsNetConfig.class_dim is the pose size, 16 (4x4), with routing 'em', "
                               f"got {self.class_dim}")
        if not self.em_lambda > 0:
            raise CapsNetError(f"CapsNetConfig.em_lambda must be positive, got {self.em_lambda!r}")
        for name, hi in (("em_lambda", float("inf")), ("recon_weight", float("inf")), ("m_plus", 1), ("m_minus", 1),
                         ("lam", float("inf"))):
            check_setting(f"CapsNetConfig.{name}", getattr(self, name), 0, hi)
        for name, allowed in (("routing_grad", ROUTING_MODES), ("primary_conv", PrimaryCaps.FULL_CONVS)):
            if getattr(self, name) not in allowed:
                raise CapsNetError(f"CapsNetConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")

    def _check_normalisation(self):
        if (self.input_mean is None) != (self.input_std is None):
            raise CapsNetError("CapsNetConfig.input_mean and input_std go together: give both (a number per "
                               "input channel each) or neither")
        if self.input_mean is None:
            return
        self.input_mean, self.input_std = tuple(self.input_mean), tuple(self.input_std)
        c = self.input_shape[0]
        finite = lambda t: all(isinstance(v, (int, float, np.floating, np.integer)) and not isinstance(v, bool)
                               and math.isfinite(v) for v in t)  # noqa: E731
        if len(self.input_mean) != c or len(self.input_std) != c or not finite(self.input_mean + self.input_std) \
                or min(self.input_std) <= 0:
            raise CapsNetError(f"CapsNetConfig.input_mean and input_std need a finite number per input channel "
                               f"({c}), the deviations above 0; got {self.input_mean} and {self.input_std}")

    def to_dict(self):
        return asdict(self)

    def replace(self, **overrides):
        """A copy with ``overrides``.  Where the routing changes, a field that held the old routing's
        default (ROUTING_DEFAULTS) and is not overridden takes the new routing's."""
        values = {**self.to_dict(), **overrides}
        if values["routing"] != self.routing:
            for k, v in routing_defaults(self.routing).items():
                if k not in overrides and values[k] == v:
                    values[k] = None
        return type(self)(**values)


def geometry(cfg):
    """(positions P of the primary capsule grid, (H2, W2)) for a config; CapsNetError if too small."""
    if len(cfg.input_shape) != 3:
        raise CapsNetError(f"input_shape must be (channels, height, width), got {cfg.input_shape}")
    if cfg.routing == "em":
        grids = em_grids(cfg)
        return grids[0][0] * grids[0][1], grids[0]
    c, h, w = cfg.input_shape
    k1, s1, k2, s2 = cfg.conv_kernel, cfg.conv_stride, cfg.primary_kernel, cfg.primary_stride
    h1, w1 = (h - k1) // s1 + 1, (w - k1) // s1 + 1  # conv1's output
    if min(h, w) < k1 or min(h1, w1) < k2:
        field_px = k1 + (k2 - 1) * s1  # conv1 then one PrimaryCaps window
        raise CapsNetError(
            f"input {h}x{w} is smaller than the receptive field {field_px}x{field_px} of conv1 "
            f"({k1}x{k1}, stride {s1}) followed by PrimaryCaps ({k2}x{k2}, stride {s2}); use larger images or "
            f"smaller kernels or strides (--conv-kernel, --conv-stride, --primary-kernel, --primary-stride)")
    hw = ((h1 - k2) // s2 + 1, (w1 - k2) // s2 + 1)
    return hw[0] * hw[1], hw


def em_grids(cfg):
    """EM network: (H, W) of the primary grid, of each ConvMatrixCaps' output, in order; CapsNetError if
    the input is too small for them."""
    c, h, w = cfg.input_shape
    grids = [((h - cfg.conv_kernel) // cfg.conv_stride + 1, (w - cfg.conv_kernel) // cfg.conv_stride + 1)]
    for k, s in EM_KERNELS:
        gh, gw = grids[-1]
        grids.append(((gh - k) // s + 1, (gw - k) // s + 1))
    if min(h, w) < cfg.conv_kernel or min(min(g) for g in grids) < 1:
        raise CapsNetError(f"input {h}x{w} is too small for the EM network: conv1 {cfg.conv_kernel}x{cfg.conv_kernel}"
                           f"/{cfg.conv_stride}, then ConvMatrixCaps 3x3/2 and 3x3/1 need at least 7x7 primary "
                           f"capsules; use larger images or a smaller --conv-kernel or --conv-stride")
    return grids


def param_shapes(cfg: CapsNetConfig) -> dict:
    """Name -> shape of every parameter, from the configuration alone (nothing is allocated)."""
    positions, _ = geometry(cfg)
    if cfg.routing == "em":
        return _em_param_shapes(cfg)
    if cfg.routing not in ("dynamic", "em", "attention"):
        return described(builtin_architecture(cfg))
    c, h, w = cfg.input_shape
    caps = cfg.primary_types * cfg.primary_dim
    shapes = {
        "conv1.W": (cfg.conv_kernel, cfg.conv_kernel, c, cfg.conv_channels), "conv1.b": (cfg.conv_channels,),
        "primary.W": (cfg.primary_kernel, cfg.primary_kernel, cfg.conv_channels, caps), "primary.b": (caps,),
        "classcaps.W": (1 if cfg.share_spatial else positions, cfg.primary_types, cfg.n_classes,
                        cfg.class_dim, cfg.primary_dim),
    }
    if cfg.routing == "attention":
        shapes["classcaps.bias"] = (1 if cfg.share_spatial else positions, cfg.primary_types, cfg.n_classes)
    return {**shapes, **_decoder_shapes(cfg)}


def _em_param_shapes(cfg):
    c = cfg.input_shape[0]
    A, T = cfg.conv_channels, cfg.primary_types
    shapes = {"conv1.W": (cfg.conv_kernel, cfg.conv_kernel, c, A), "conv1.b": (A,),
              "primary.W": (A, T * 17), "primary.b": (T * 17,)}
    types = (T, *cfg.matrix_types, cfg.n_classes)
    for k, (kernel, _) in enumerate(EM_KERNELS, start=1):
        shapes[f"convcaps{k}.W"] = (kernel * kernel * types[k - 1], types[k], 4, 4)
        shapes[f"convcaps{k}.beta_u"] = shapes[f"convcaps{k}.lambda_beta_a"] = (types[k],)
    shapes["classcaps.W"] = (types[-2], cfg.n_classes, 4, 4)
    shapes["classcaps.beta_u"] = shapes["classcaps.lambda_beta_a"] = (cfg.n_classes,)
    return {**shapes, **_decoder_shapes(cfg)}


def _decoder_shapes(cfg):
    shapes = {}
    for k, (a, b) in enumerate(decoder_sizes(cfg), start=1):
        shapes[f"decoder{k}.W"], shapes[f"decoder{k}.b"] = (a, b), (b,)
    return shapes


def decoder_sizes(cfg: CapsNetConfig):
    """(inputs, outputs) of each decoder layer: masked capsules J*D -> hidden ... -> C*H*W pixels."""
    sizes = (cfg.n_classes * cfg.class_dim, *cfg.decoder_hidden, int(np.prod(cfg.input_shape)))
    return list(zip(sizes[:-1], sizes[1:]))


def builtin_architecture(cfg: CapsNetConfig) -> dict:
    """The description (architecture.py) of the network ``cfg`` configures, under the parameter
    names that checkpoints have always used: conv1, primary, [convcaps1, convcaps2,] classcaps,
    decoder1 ..."""
    body = [arch.conv2d(cfg.conv_channels, cfg.conv_kernel, cfg.conv_stride, name="conv1"), arch.relu(name="relu1")]
    if cfg.input_mean is not None:  # no parameters: the other layers keep their checkpoints' names
        body.insert(0, arch.normalize(cfg.input_mean, cfg.input_std, name="norm"))
    routed = dict(iters=cfg.routing_iters, routing_grad=cfg.routing_grad)
    if cfg.routing == "em":
        em = dict(routed, em_lambda=cfg.em_lambda)
        body += [arch.primary_matrix_caps(cfg.primary_types, name="primary")]
        body += [arch.conv_matrix_caps(t, kernel, stride, **em, name=f"convcaps{k}")
                 for k, (t, (kernel, stride)) in enumerate(zip(cfg.matrix_types, EM_KERNELS), start=1)]
        body += [arch.class_matrix_caps(cfg.n_classes, **em, name="classcaps")]
        head, loss = "activations", arch.spread_loss()
    else:
        body += [arch.primary_caps(cfg.primary_types, cfg.primary_dim, cfg.primary_kernel, cfg.primary_stride,
                                   cfg.primary_conv, name="primary")]
        caps = (cfg.n_classes, cfg.class_dim)
        if cfg.routing == "attention":  # Efficient-CapsNet's routing in the paper's network: its own layer
            body += [arch.attention_caps(*caps, share_spatial=cfg.share_spatial, init_std=0.01, name="classcaps")]
        elif cfg.routing == "dynamic":
            body += [arch.dynamic_caps(*caps, **routed, share_spatial=cfg.share_spatial, init_std=0.01,
                                       name="classcaps")]
        else:  # a routing of the registry, with its paper's head where it has one
            own = routings.get(cfg.routing)
            body += [arch.dynamic_caps(*caps, iters=cfg.routing_iters if own.iterated else None, routing=cfg.routing,
                                       routing_grad=cfg.routing_grad if own.iterated else "full",
                                       share_spatial=cfg.share_spatial, init_std=own.transform_std, name="classcaps")]
            if own.head != ("lengths", "margin"):
                head, loss_name = own.head
                if head == "logits":
                    body += [arch.capsule_logits(name="logits")]
                    return arch.network(body, head, {"loss": loss_name}, None, cfg.input_shape, cfg.n_classes)
                loss = {"loss": loss_name}
                return arch.network(body, head, loss, arch.decoder(cfg.decoder_hidden, cfg.recon_weight),
                                    cfg.input_shape, cfg.n_classes)
        head, loss = "lengths", arch.margin_loss(cfg.m_plus, cfg.m_minus, cfg.lam)
    return arch.network(body, head, loss, arch.decoder(cfg.decoder_hidden, cfg.recon_weight),
                        cfg.input_shape, cfg.n_classes)


class CapsNet(Network):
    """One of the three built-in networks, configured by a CapsNetConfig: a Network built from
    ``builtin_architecture(config)``.  ``backend`` is a Backend or a name for ``backends.get``;
    ``seed`` fixes the host initialisation, so the same seed gives the same weights on every backend."""

    def __init__(self, backend="numpy", config: CapsNetConfig | None = None, seed: int = 0, **overrides):
        B = _backends.get(backend)  # a name, or a Backend (returned as it is)
        cfg = config or CapsNetConfig()
        if overrides:
            cfg = config_with(cfg, overrides, B.name)
        self.config = cfg
        self.n_positions, self.primary_hw = geometry(cfg)  # primary capsule grid; checks the input size
        super().__init__(B, **arch.assemble(B, builtin_architecture(cfg), seed))
        self.conv1, self.primary, self.classcaps = (self.body[k] for k in ("conv1", "primary", "classcaps"))
        self.convcaps = [layer for name, layer in self.body if name.startswith("convcaps")]

    @property
    def n_primary_capsules(self) -> int:
        return self.n_positions * self.config.primary_types

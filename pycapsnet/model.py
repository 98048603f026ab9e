"""The CapsNet of Sabour, Frosst & Hinton (2017): conv1 -> PrimaryCaps -> ClassCaps (dynamic routing)
-> capsule lengths, with a masked decoder that reconstructs the input.  ``routing`` picks the
capsule part of the network (the rest is shared):

    "dynamic"    the network below, margin loss
    "attention"  the same with self-attention routing (Efficient-CapsNet) in place of dynamic routing
    "em"         matrix capsules with EM routing (Hinton et al. 2018), spread loss on the class activations:
                 conv1 5x5/2, A=32, ReLU --PrimaryMatrixCaps 1x1, B=8--ConvMatrixCaps 3x3/2, C=16
                 --ConvMatrixCaps 3x3/1, D=16--ClassMatrixCaps (coordinate addition)--> poses (N, J, 16), a (N, J)
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

import numpy as np

import backends as _backends

from .capsules import AttentionCaps, CapsuleLength, ClassCaps, PrimaryCaps
from .checks import check_capsules, check_images, check_labels, config_with, require_batch_size
from .errors import CapsNetError
from .init import he_uniform
from .layers import Conv2d, Linear, ReLU, Sigmoid
from .losses import MarginLoss, ReconstructionLoss, SpreadLoss
from .matrix_capsules import ClassMatrixCaps, ConvMatrixCaps, PrimaryMatrixCaps
from .routing import MODES as ROUTING_MODES


ROUTINGS = ("dynamic", "em", "attention")
# Defaults that depend on the routing (a field left None takes its routing's): the EM column is the
# paper's matrix-capsule network (A = 32 channels of 5x5/2, B = 8 primary types).
_VECTOR_CAPSULES = dict(conv_channels=256, conv_kernel=9, conv_stride=1, primary_types=32,  # Sabour et al.'s
                        routing_iters=3)
ROUTING_DEFAULTS = {
    "dynamic": _VECTOR_CAPSULES,
    "attention": _VECTOR_CAPSULES,  # the same network, routed otherwise
    # The paper routes 3 times; 2 is the default here because the 3-iteration network learns far
    # more slowly on the embedded digits (docs/performance.md, "The three routings").
    "em": dict(conv_channels=32, conv_kernel=5, conv_stride=2, primary_types=8, routing_iters=2),
}
EM_KERNELS = ((3, 2), (3, 1))  # (kernel, stride) of the two ConvMatrixCaps, the paper's


@dataclass
class CapsNetConfig:
    input_shape: tuple = (1, 28, 28)      # (C, H, W)
    n_classes: int = 10
    routing: str = "dynamic"              # "dynamic" | "em" | "attention" (ROUTINGS)
    conv_channels: int = None             # None: the routing's default (ROUTING_DEFAULTS)
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

    def __post_init__(self):
        if self.routing not in ROUTINGS:
            raise CapsNetError(f"CapsNetConfig.routing must be one of {ROUTINGS}, got {self.routing!r}")
        for name, value in ROUTING_DEFAULTS[self.routing].items():
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
        bad = [f"{name} {getattr(self, name)}" for name in ("input_shape", "decoder_hidden", "matrix_types")
               if any(d < 1 for d in getattr(self, name))]
        if bad:
            raise CapsNetError(f"CapsNetConfig: every size in {' and '.join(bad)} must be at least 1")
        if len(self.matrix_types) != len(EM_KERNELS):
            raise CapsNetError(f"CapsNetConfig.matrix_types needs {len(EM_KERNELS)} sizes (one per ConvMatrixCaps), "
                               f"got {self.matrix_types}")
        if self.routing == "em" and self.class_dim != 16:
            raise CapsNetError(f"CapsNetConfig.class_dim is the pose size, 16 (4x4), with routing 'em', "
                               f"got {self.class_dim}")
        if not self.em_lambda > 0:
            raise CapsNetError(f"CapsNetConfig.em_lambda must be positive, got {self.em_lambda!r}")
        for name, allowed in (("routing_grad", ROUTING_MODES), ("primary_conv", tuple(PrimaryCaps.CONVS))):
            if getattr(self, name) not in allowed:
                raise CapsNetError(f"CapsNetConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")

    def to_dict(self):
        return asdict(self)

    def replace(self, **overrides):
        """A copy with ``overrides``.  Where the routing changes, a field that held the old routing's
        default (ROUTING_DEFAULTS) and is not overridden takes the new routing's."""
        values = {**self.to_dict(), **overrides}
        if values["routing"] != self.routing and self.routing in ROUTING_DEFAULTS:
            for k, v in ROUTING_DEFAULTS[self.routing].items():
                if k not in overrides and values[k] == v:
                    values[k] = None
        return type(self)(**values)


def _geometry(cfg):
    """(positions P of the primary capsule grid, (H2, W2)) for a config; CapsNetError if too small."""
    if len(cfg.input_shape) != 3:
        raise CapsNetError(f"input_shape must be (channels, height, width), got {cfg.input_shape}")
    if cfg.routing == "em":
        grids = em_grids(cfg)
        return grids[0][0] * grids[0][1], grids[0]
    c, h, w = cfg.input_shape
    k1, k2, s2 = cfg.conv_kernel, cfg.primary_kernel, cfg.primary_stride
    field_px = k1 + k2 - 1  # conv1 (stride 1) then one PrimaryCaps window
    if min(h, w) < field_px:
        raise CapsNetError(
            f"input {h}x{w} is smaller than the receptive field {field_px}x{field_px} of conv1 "
            f"({k1}x{k1}) followed by PrimaryCaps ({k2}x{k2}, stride {s2}); use larger images or "
            f"smaller kernels (conv_kernel, primary_kernel)")
    h1, w1 = h - k1 + 1, w - k1 + 1
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
                           f"capsules; use larger images or a smaller conv_kernel or conv_stride")
    return grids


def param_shapes(cfg: CapsNetConfig) -> dict:
    """Name -> shape of every parameter, from the configuration alone (nothing is allocated)."""
    positions, _ = _geometry(cfg)
    if cfg.routing == "em":
        return _em_param_shapes(cfg)
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


class Outputs:
    """What ``forward`` and ``loss`` return: class capsules v_j (N, J, D), their lengths (N, J) and
    the reconstruction (N, C, H, W), on the device.  After ``loss``, the loss values and the
    predicted classes stay on the device too until read: ``loss`` (the total), ``parts`` (margin,
    reconstruction) and ``predictions`` fetch all of them with one transfer, so a GPU step is not
    held up mid-way, nor read twice."""

    def __init__(self, B, v, lengths, reconstruction=None, loss_name="margin"):
        self.v, self.lengths, self.reconstruction = v, lengths, reconstruction
        self.loss_name = loss_name  # the class loss's: "margin", or "spread" (EM)
        self.summary = None  # device array (3 + N,): total, margin, reconstruction, predicted classes
        self._B, self._host = B, None

    def set_losses(self, total, margin, recon):
        xp = self._B.xp
        self._host = None
        predicted = xp.astype(xp.argmax(self.lengths, axis=1), total.dtype)  # class indices, exact in floats
        self.summary = xp.concat([xp.stack([total, margin, recon]), predicted])

    def renewed(self) -> "Outputs":
        """The same arrays with the host copy of the summary dropped: for arrays that were
        overwritten in place (a replayed captured step), so that ``loss`` reads them again."""
        out = Outputs(self._B, self.v, self.lengths, self.reconstruction, self.loss_name)
        out.summary = self.summary
        return out

    def _fetch(self):
        if self._host is None:
            self._host = None if self.summary is None else self._B.to_numpy(self.summary).astype(np.float64)
        return self._host

    @property
    def loss(self):
        host = self._fetch()
        return None if host is None else float(host[0])

    @loss.setter
    def loss(self, value):
        self._fetch()[0] = value

    @property
    def parts(self) -> dict:
        host = self._fetch()
        return {} if host is None else {self.loss_name: float(host[1]), "reconstruction": float(host[2])}

    @property
    def predictions(self):
        """The longest capsule of each sample: host int64 (N,)."""
        host = self._fetch()
        if host is None:  # a forward without losses
            return np.argmax(self._B.to_numpy(self.lengths), axis=1)
        return host[3:].astype(np.int64)


class CapsNet:
    """The model.  ``backend`` is a Backend or a name for ``backends.get``; ``seed`` fixes the host
    initialisation, so the same seed gives the same weights on every backend."""

    def __init__(self, backend="numpy", config: CapsNetConfig | None = None, seed: int = 0, **overrides):
        self.B = _backends.get(backend)  # a name, or a Backend (returned as it is)
        cfg = config or CapsNetConfig()
        if overrides:
            cfg = config_with(cfg, overrides, self.B.name)
        self.config = cfg
        self.n_positions, self.primary_hw = _geometry(cfg)  # primary capsule grid; checks the input size
        c, h, w = cfg.input_shape
        rng = np.random.default_rng(seed)
        B = self.B
        self.conv1 = Conv2d(B, c, cfg.conv_channels, cfg.conv_kernel, cfg.conv_stride, rng=rng, init=he_uniform)
        self.relu1 = ReLU(B)
        self.matrix = cfg.routing == "em"  # matrix capsules pass (poses, activations) between layers
        if self.matrix:
            grids = em_grids(cfg)
            types = (cfg.primary_types, *cfg.matrix_types)
            self.primary = PrimaryMatrixCaps(B, cfg.conv_channels, cfg.primary_types, rng=rng)
            self.convcaps = [ConvMatrixCaps(B, types[k], types[k + 1], kernel, stride, cfg.routing_iters,
                                            cfg.routing_grad, cfg.em_lambda, rng=rng)
                             for k, (kernel, stride) in enumerate(EM_KERNELS)]
            self.classcaps = ClassMatrixCaps(B, grids[-1], types[-1], cfg.n_classes, cfg.routing_iters,
                                             cfg.routing_grad, cfg.em_lambda, rng=rng)
            self.class_loss = SpreadLoss(B)
            self.routed_grid = (grids[-1], types[-1])  # the class layer's children: (H, W) grid, types
        else:
            self.primary = PrimaryCaps(B, cfg.conv_channels, cfg.primary_types, cfg.primary_dim,
                                       cfg.primary_kernel, cfg.primary_stride, rng=rng,
                                       conv=cfg.primary_conv)
            caps = (self.n_positions, cfg.primary_types, cfg.primary_dim, cfg.n_classes, cfg.class_dim)
            if cfg.routing == "attention":
                self.classcaps = AttentionCaps(B, *caps, share_spatial=cfg.share_spatial, rng=rng)
            else:
                self.classcaps = ClassCaps(B, *caps, cfg.routing_iters, cfg.routing_grad, cfg.share_spatial, rng=rng)
            self.convcaps = []
            self.class_loss = MarginLoss(B, cfg.m_plus, cfg.m_minus, cfg.lam)
            self.routed_grid = (self.primary_hw, cfg.primary_types)
        self.length = CapsuleLength(B)
        self.decoder = []
        for k, (a, b) in enumerate(decoder_sizes(cfg)):
            hidden = k < len(cfg.decoder_hidden)
            self.decoder.append(Linear(B, a, b, rng=rng, init=he_uniform if hidden else None))
            self.decoder.append(ReLU(B) if hidden else Sigmoid(B))
        self.recon_loss = ReconstructionLoss(B, cfg.recon_weight)
        self._eye = B.asarray(np.eye(cfg.n_classes))  # row j: the one-hot mask of class j
        self._cache = None
        # Every gradient is a view into one flat array: one buffer to zero, and one to sum across
        # the processes of a data-parallel run (pycapsnet.distributed) without copying.
        self.flat_grads = B.zeros((self.n_params(),))
        offset = 0
        for _, layer in self.layers():
            for k, g in layer.grads.items():
                size = int(np.prod(g.shape))
                layer.grads[k] = B.xp.reshape(self.flat_grads[offset:offset + size], tuple(g.shape))
                offset += size

    # ---- structure ------------------------------------------------------------------------------
    @property
    def n_primary_capsules(self) -> int:
        return self.n_positions * self.config.primary_types

    def layers(self):
        """(name, layer) for every layer with parameters, in forward order."""
        named = [("conv1", self.conv1), ("primary", self.primary)]
        named += [(f"convcaps{k}", l) for k, l in enumerate(self.convcaps, start=1)] + [("classcaps", self.classcaps)]
        named += [(f"decoder{k // 2 + 1}", l) for k, l in enumerate(self.decoder) if l.params]
        return named

    @property
    def params(self) -> dict:
        return {f"{n}.{k}": p for n, l in self.layers() for k, p in l.params.items()}

    @property
    def grads(self) -> dict:
        return {f"{n}.{k}": g for n, l in self.layers() for k, g in l.grads.items()}

    def n_params(self) -> int:
        return int(sum(np.prod(p.shape) for p in self.params.values()))

    def zero_grad(self):
        self.flat_grads[...] = 0

    def state_dict(self) -> dict:
        """Parameters as host NumPy arrays (backend-neutral)."""
        return {k: self.B.to_numpy(v) for k, v in self.params.items()}

    def load_state_dict(self, state: dict):
        """Copy host arrays into the parameters; raises CapsNetError listing every mismatch."""
        own = self.params
        problems = [f"missing {k} (model has {tuple(p.shape)})" for k, p in own.items() if k not in state]
        problems += [f"unexpected {k} {tuple(np.shape(v))}" for k, v in state.items() if k not in own]
        problems += [f"{k}: checkpoint {tuple(np.shape(state[k]))} vs model {tuple(p.shape)}"
                     for k, p in own.items() if k in state and tuple(np.shape(state[k])) != tuple(p.shape)]
        if problems:  # one line, as every error a command prints
            raise CapsNetError("checkpoint does not match this architecture: " + "; ".join(problems)
                               + "; build the model with the checkpoint's configuration")
        for k, p in own.items():
            p[...] = self.B.asarray(state[k])

    # ---- input checks (checks.py) ----------------------------------------------------------------
    def checked(self, x, y=None):
        """x and y checked (check_images, check_labels) and on the device, as the underscored methods
        below take them; y may be None."""
        x = check_images(self.B, self.config.input_shape, x)
        return x, None if y is None else self.B.asarray(check_labels(self.B, self.config.n_classes, y, x.shape[0]))

    # ---- forward / backward -----------------------------------------------------------------------
    # The public methods check their input on the host and hand device arrays to the underscored
    # ones, which do device work only: that part is what a captured step (pycapsnet.graph) records.
    def forward(self, x, y=None, reconstruct=True) -> Outputs:
        """x: (N, C, H, W) floats in [0, 1].  With labels y the decoder sees the true class capsule
        (training); without, the longest one (evaluation).  Keeps what ``backward`` needs."""
        return self._forward(*self.checked(x, y), reconstruct)

    def _forward(self, x, y, reconstruct=True) -> Outputs:
        """``forward`` on checked device arrays; y: int labels (N,) or None."""
        xp = self.B.xp
        h = self.relu1.forward(self.conv1.forward(xp.permute_dims(x, (0, 2, 3, 1))))  # channels-last
        v, lengths = self._capsules_forward(h)      # class capsules (N, J, D), class scores (N, J)
        out = Outputs(self.B, v, lengths, loss_name=self.class_loss.name)
        self._cache = {"x": x, "v": v, "mask": None}
        if reconstruct:
            chosen = y if y is not None else xp.argmax(lengths, axis=1)
            out.reconstruction, self._cache["mask"] = self._decode(v, chosen)
        return out

    def _capsules_forward(self, h):
        """conv1's output (N, H1, W1, C1) -> (class capsules v (N, J, D), class scores (N, J)): |v_j|,
        or for matrix capsules the poses μ_j (D = 16) and their activations a_j."""
        if self.matrix:
            z = self.primary.forward(h)                 # (M (N, H, W, B, 16), a (N, H, W, B))
            for layer in self.convcaps:
                z = layer.forward(z)
            return self.classcaps.forward(z)
        v = self.classcaps.forward(self.primary.forward(h))  # u_i (N, P, T, K) -> v_j (N, J, D)
        return v, self.length.forward(v)

    def _capsules_backward(self, dv, dscores):
        """The adjoint of ``_capsules_forward``: dL/dv and dL/d(scores) -> dL/dh."""
        if self.matrix:
            d = self.classcaps.backward((dv, dscores))
            for layer in reversed(self.convcaps):
                d = layer.backward(d)
            return self.primary.backward(d)
        du = self.classcaps.backward(dv + self.length.backward(dscores))
        return self.primary.backward(du)

    def set_epoch(self, epoch: int):
        """Tell the loss which epoch is starting (the spread loss's margin grows with it)."""
        self.class_loss.set_epoch(epoch)

    def _decode(self, v, classes):
        """classes: device int array (N,): the capsule each sample's decoder sees."""
        xp = self.B.xp
        mask = xp.take(self._eye, classes, axis=0)                      # (N, J), one-hot rows
        z = xp.reshape(v * mask[..., None], (v.shape[0], -1))           # masked capsules (N, J*D)
        for layer in self.decoder:
            z = layer.forward(z)
        return xp.reshape(z, (v.shape[0], *self.config.input_shape)), mask

    def decode(self, v, classes):
        """Reconstruction from class capsules v (N, J, D), keeping only capsule ``classes[n]`` of
        each sample (the others masked to 0), as the decoder sees them."""
        classes = check_capsules(v, classes, self.config.n_classes, self.config.class_dim)
        return self._decode(self.B.asarray(v), self.B.asarray(classes))[0]

    def loss(self, x, y) -> Outputs:
        """Forward with the label mask plus both losses; ``backward()`` then fills the gradients."""
        return self._loss(*self.checked(x, y))

    def _loss(self, x, y) -> Outputs:
        out = self._forward(x, y)
        onehot = self._cache["mask"]  # with labels, the decoder's mask is the one-hot target
        class_loss = self.class_loss.forward(out.lengths, onehot)
        recon = self.recon_loss.forward(out.reconstruction, x)
        out.set_losses(class_loss + recon, class_loss, recon)
        return out

    def backward(self, input_grad: bool = False):
        """Gradients of the last ``loss()`` added into ``grads``; returns dL/dx (N, C, H, W) when
        ``input_grad`` (only gradient checks need it), else None."""
        xp = self.B.xp
        n = self._cache["x"].shape[0]
        d_recon = self.recon_loss.backward()                 # dL/dx_hat (N, C, H, W)
        dz = xp.reshape(d_recon, (n, -1))
        for layer in reversed(self.decoder):
            dz = layer.backward(dz)
        dv = xp.reshape(dz, tuple(self._cache["v"].shape)) * self._cache["mask"][..., None]
        dh = self._capsules_backward(dv, self.class_loss.backward())
        dx = self.conv1.backward(self.relu1.backward(dh), input_grad)  # training needs no dL/dx
        self._cache = None
        if dx is None:
            return None
        # x is also the reconstruction target: L depends on it through -(x_hat - x) as well
        return xp.permute_dims(dx, (0, 3, 1, 2)) - d_recon

    def train_step_grads(self, x, y) -> Outputs:
        """zero_grad + loss + backward: the gradient of one batch, ready for an optimizer."""
        return self._train_step_grads(*self.checked(x, y))

    def _train_step_grads(self, x, y) -> Outputs:
        self.zero_grad()
        out = self._loss(x, y)
        self.backward()
        return out

    def predict(self, x, batch_size: int = 256):
        """Class indices (host int64 array) by the longest class capsule, ``batch_size`` images at a
        time: a forward holds some MB per 28x28 image (û alone is I x J x D floats), so a whole
        test set at once would hold gigabytes."""
        require_batch_size(batch_size)
        x = check_images(self.B, self.config.input_shape, x)
        lengths = []
        for a in range(0, x.shape[0], batch_size):
            lengths.append(self.B.to_numpy(self._forward(x[a:a + batch_size], None, reconstruct=False).lengths))
            self.release()
        return np.argmax(np.concatenate(lengths), axis=1).astype(np.int64)

    def release(self):
        """Drop what forward kept for a backward (the PrimaryCaps spectra and û alone are hundreds
        of MB at batch 64), e.g. after an evaluation, so that it is not held into the next step."""
        inner = [getattr(self.primary, k) for k in ("conv", "linear") if hasattr(self.primary, k)]
        for layer in (self.conv1, self.relu1, self.primary, *inner, *self.convcaps, self.classcaps, self.length,
                      *self.decoder):
            layer.cache = None
        for layer in (*self.convcaps, self.classcaps):
            layer.trace = None  # EM keeps R, μ, σ², r, a of every iteration: sizable at evaluation batches
        self._cache = None

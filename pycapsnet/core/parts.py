"""The parts of a network description: one function per layer, loss and decoder, each returning
the plain data (a dict) that architecture.build builds from and a JSON file holds.

    body = [conv2d(256, 9, name="conv1"), relu(), primary_caps(32, 8, kernel=9, stride=2, name="primary"),
            dynamic_caps(10, 16, name="classcaps")]
    arch = network(body, input_shape=(1, 28, 28))

A part holds every option its layer's builder takes but those that are unset and were added after
descriptions were first saved (init_std and bias of conv2d and primary_caps, and scale), so that
descriptions written before them read the same.
"""
from __future__ import annotations


def _part(kind, name, **options):
    return {"layer": kind, **({"name": name} if name else {}), **options}


# A convolution's weights start He-uniform and its biases uniform in ±1/√fan_in, or, given
# init_std and bias, at N(0, init_std²) and the constant bias (the paper's published code's choice);
# a description holds those two options only when they are set.
def conv2d(channels, kernel, stride=1, padding=0, init_std=None, bias=None, conv=None, name=None):
    """conv: "im2col" (None) or "fourier", the convolution theorem (fourier.py), which pays where the
    input has many channels (docs/performance.md)."""
    return _part("conv2d", name, channels=channels, kernel=kernel, stride=stride, padding=padding,
                 **_set(init_std=init_std, bias=bias, conv=conv))


def relu(name=None):
    return _part("relu", name)


def normalize(mean, std, name=None):
    """Each input channel c as (x_c - mean[c]) / std[c]: the first layer of a network whose inputs are
    normalised with a training split's statistics (pycapsnet.datasets.channel_stats)."""
    return _part("normalize", name, mean=[float(m) for m in mean], std=[float(s) for s in std])


def max_pool(kernel=2, stride=None, name=None):
    return _part("max_pool", name, kernel=kernel, stride=stride)


def flatten(name=None):
    return _part("flatten", name)


def linear(features, name=None):
    return _part("linear", name, features=features)


def dropout(rate=0.5, name=None):
    return _part("dropout", name, rate=rate)


def batch_norm(momentum=0.1, eps=1e-5, name=None):
    return _part("batch_norm", name, momentum=momentum, eps=eps)


# scale: s_i = W * (scale x) + b, the convolution scaled and the bias not, as the published code's
# primary capsules are (a one-iteration routing from one input to 32 types: scale 1/32).
def primary_caps(types, dim, kernel=9, stride=2, conv="fourier", squash="sabour", init_std=None, bias=None, scale=1.0,
                 name=None):
    return _part("primary_caps", name, types=types, dim=dim, kernel=kernel, stride=stride, conv=conv, squash=squash,
                 **_set(init_std=init_std, bias=bias), **({} if scale == 1 else {"scale": scale}))


def _set(**options):
    return {k: v for k, v in options.items() if v is not None}


# Routing layers' transforms start at init_std, or, left None, at init.routed_std: capsules keep
# their length from layer to layer, so that stacks of routing layers learn.
#
# ``routing`` (routings.py): "dynamic" (the default), "uniform", "random", "inverted", "self" or "vb";
# ``iters`` left None is the routing's default (3 for those that iterate); ``scaled`` is inverted
# routing's 1/√D on its agreements, alpha0 ... vb_lambda are VB routing's priors and temperature.
def dynamic_caps(capsules, dim, iters=None, routing_grad="full", share_spatial=False, init_std=None, bias=None,
                 routing="dynamic", name=None, **routing_options):
    return _part("dynamic_caps", name, capsules=capsules, dim=dim, **_iters(iters, routing),
                 routing_grad=routing_grad, share_spatial=share_spatial, init_std=init_std, bias=bias,
                 **_routing(routing, routing_options))


def _iters(iters, routing):
    """Dynamic routing's descriptions have always held their iterations (3 by default)."""
    if iters is None and routing == "dynamic":
        iters = 3
    return {} if iters is None else {"iters": iters}


def _routing(routing, options):
    return {**({} if routing == "dynamic" else {"routing": routing}), **_set(**options)}


def attention_caps(capsules, dim, share_spatial=False, init_std=None, name=None):
    return _part("attention_caps", name, capsules=capsules, dim=dim, share_spatial=share_spatial, init_std=init_std)


def conv_caps(types, dim, kernel=3, stride=1, iters=None, routing_grad="full", init_std=None, routing="dynamic",
              name=None, **routing_options):
    return _part("conv_caps", name, types=types, dim=dim, kernel=kernel, stride=stride, **_iters(iters, routing),
                 routing_grad=routing_grad, init_std=init_std, **_routing(routing, routing_options))


def capsule_logits(name=None):
    """Class capsules (J, D) -> J logits by one linear map shared over the classes (then head "logits")."""
    return _part("capsule_logits", name)


def residual(body, shortcut=None, name=None):
    """A residual block (residual.py): the sum of ``body``'s output and ``shortcut``'s (lists of
    parts), or of ``body``'s and its input where ``shortcut`` is None."""
    return _part("residual", name, body=list(body), **({} if shortcut is None else {"shortcut": list(shortcut)}))


def basic_block(channels, stride=1, project=False, name=None):
    """ResNet's basic block for CIFAR-10 (He et al. 2016, §4.2): 3x3 convolution (``stride``), batch
    norm, ReLU, 3x3 convolution, batch norm, plus the input -- or, ``project`` (where the block changes
    the channels or the grid), the input through a 1x1 convolution of ``stride`` and batch norm.  The
    ReLU after the sum is the next part: ``[basic_block(16), relu(), ...]``."""
    body = [conv2d(channels, 3, stride, 1, name="conv1"), batch_norm(name="bn1"), relu(name="relu1"),
            conv2d(channels, 3, 1, 1, name="conv2"), batch_norm(name="bn2")]
    shortcut = [conv2d(channels, 1, stride, name="conv"), batch_norm(name="bn")] if project else None
    return residual(body, shortcut, name)


def layer_norm(eps=1e-5, name=None):
    """Layer normalisation over the last axis: a capsule's components, an image's channels, features."""
    return _part("layer_norm", name, eps=eps)


def primary_matrix_caps(types, name=None):
    return _part("primary_matrix_caps", name, types=types)


def conv_matrix_caps(types, kernel=3, stride=1, iters=2, routing_grad="full", em_lambda=1e-3, name=None):
    return _part("conv_matrix_caps", name, types=types, kernel=kernel, stride=stride, iters=iters,
                 routing_grad=routing_grad, em_lambda=em_lambda)


def class_matrix_caps(capsules, iters=2, routing_grad="full", em_lambda=1e-3, name=None):
    return _part("class_matrix_caps", name, capsules=capsules, iters=iters, routing_grad=routing_grad,
                 em_lambda=em_lambda)


def margin_loss(m_plus=0.9, m_minus=0.1, lam=0.5):
    return {"loss": "margin", "m_plus": m_plus, "m_minus": m_minus, "lam": lam}


def spread_loss():
    return {"loss": "spread"}


def cross_entropy():
    return {"loss": "cross_entropy"}


def nll_loss():
    """-log of the label's score: for class scores that sum to 1 (self-routing's activations)."""
    return {"loss": "nll"}


def decoder(hidden=(512, 1024), weight=0.0005):
    return {"hidden": list(hidden), "weight": weight}


def network(body, head="lengths", loss=None, decoder=decoder(), input_shape=None, n_classes=None):
    """A whole description.  ``head``: "lengths" (vector capsules), "activations" (matrix
    capsules) or "logits" (a CNN's last Linear layer); ``loss`` defaults to the head's: margin for
    lengths, spread for activations, cross-entropy for logits; ``decoder`` None: no reconstruction
    (a CNN has none).  input_shape (C, H, W) and n_classes may be left None for the trainer to take
    from the data."""
    loss = loss or DEFAULT_LOSS.get(head, margin_loss)()
    return {"input_shape": None if input_shape is None else list(input_shape), "n_classes": n_classes,
            "body": list(body), "head": head, "loss": loss, "decoder": decoder}


DEFAULT_LOSS = {"lengths": margin_loss, "activations": spread_loss, "logits": cross_entropy}

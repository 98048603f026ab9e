"""The routing study's networks: each row's on a shared backbone (routing_study.py says what the
backbones and rows are), and the CNN row matched to the dynamic row's parameter count."""
from __future__ import annotations

import re

import numpy as np

from .networks import baseline_cnn
from ..core import architecture as A, routings
from ..core.description import param_shapes
from ..errors import CapsNetError

QUICK_BACKBONE = dict(conv_channels=8, primary_types=2, primary_dim=8, class_dim=16)
BACKBONE = dict(conv_channels=64, primary_types=16, primary_dim=8, class_dim=16)
# The ResNet's: "kind" names it (a backbone without one is the CapsNet-style one, as records before it)
RESNET20 = dict(kind="resnet20", widths=[16, 32, 64], blocks=3, primary_types=32, primary_dim=16, class_dim=16)
QUICK_RESNET20 = dict(kind="resnet20", widths=[4, 8, 8], blocks=1, primary_types=2, primary_dim=4, class_dim=8)
BACKBONES = {"capsnet": (BACKBONE, QUICK_BACKBONE), "resnet20": (RESNET20, QUICK_RESNET20)}


def row_spec(name: str) -> tuple:
    """("cnn" | "em" | "vector", routing, iterations or None) of a row name; CapsNetError if none."""
    if name == "cnn":
        return "cnn", None, None
    m = re.fullmatch(r"(.+)-(\d+)", name)
    base, iters = (m.group(1), int(m.group(2))) if m else (name, None)
    if base == "em":
        return "em", "em", iters or 2
    if base in routings.names() and (iters is None or routings.get(base).iterated):
        return "vector", base, iters
    raise CapsNetError(f"--routings {name}: not a row of the study; give a registered routing "
                       f"({', '.join(routings.names())}), NAME-k for an iterated one at k iterations, em or cnn")


def network(row, shape, backbone, options=None, decoder=None, n_classes=10, head=None) -> dict:
    """The description of ``row``'s network on the backbone (``options``: its routing's own; ``decoder``:
    the hidden sizes of a reconstruction decoder; ``head``: (head, loss description) in place of the
    routing paper's, for a row with class capsules)."""
    kind, routing, iters = row_spec(row)
    if kind == "cnn":
        return matched_cnn(shape, backbone, n_classes)
    stem, primary = stem_of(backbone)
    if kind == "em":
        body = stem + [A.primary_matrix_caps(backbone["primary_types"], name="primary"),
                       A.class_matrix_caps(n_classes, iters=iters, name="classcaps")]
        return A.network(body, head="activations", loss=A.spread_loss(), decoder=None, input_shape=shape,
                         n_classes=n_classes)
    body = stem + [A.primary_caps(backbone["primary_types"], backbone["primary_dim"], **primary, name="primary"),
                   A.dynamic_caps(n_classes, backbone["class_dim"], iters=iters, routing=routing, name="classcaps",
                                  **(options or {}))]
    if head is None:
        head, loss = routings.get(routing).head
        loss = A.margin_loss() if loss == "margin" else {"loss": loss}
    else:
        head, loss = head
    if head == "logits":
        body.append(A.capsule_logits(name="logits"))
    return A.network(body, head=head, loss=loss, decoder=decoder and A.decoder(decoder), input_shape=shape,
                     n_classes=n_classes)


def stem_of(backbone) -> tuple:
    """(the layers before the primary capsules, the primary capsules' kernel, stride and convolution)."""
    if backbone.get("kind", "capsnet") == "capsnet":
        return [A.conv2d(backbone["conv_channels"], 9, name="conv1"), A.relu(name="relu1")], \
            dict(kernel=9, stride=2)
    widths = backbone["widths"]
    stem = [A.conv2d(widths[0], 3, padding=1, name="conv1"), A.batch_norm(name="bn1"), A.relu(name="relu1")]
    for s, w in enumerate(widths, start=1):
        for b in range(1, backbone["blocks"] + 1):
            first = b == 1 and s > 1  # a stage's first block halves the grid and widens: projected
            stem += [A.basic_block(w, 2 if first else 1, project=first, name=f"block{s}_{b}"),
                     A.relu(name=f"relu{s}_{b}")]
    return stem, dict(kernel=3, stride=1, conv="im2col")  # (the Fourier convolution pays on large kernels only)


def normalized(description: dict, mean, std) -> dict:
    """``description`` with the study's per-channel normalisation (--normalize: the training images'
    mean and deviation per channel) as its first layer, as every row's input is given."""
    return {**description, "body": [A.normalize(mean, std, name="norm"), *description["body"]]}


def matched_cnn(shape, backbone, n_classes=10) -> dict:
    """The baseline CNN (networks.baseline_cnn) with its widths scaled by one factor so that its
    parameters come closest to those of the "dynamic" row's network."""
    target = params_of(network("dynamic", shape, backbone, n_classes=n_classes))
    best = None
    for f in np.geomspace(0.02, 1.5, 200):
        w = lambda n: max(1, int(round(n * f)))  # noqa: E731
        d = baseline_cnn(shape, n_classes, channels=(w(256), w(256), w(128)), hidden=(w(328), w(192)))
        gap = abs(params_of(d) - target)
        if best is None or gap < best[0]:
            best = (gap, d)
    return best[1]


def params_of(description) -> int:
    return int(sum(np.prod(s) for s in param_shapes(description).values()))

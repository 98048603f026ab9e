"""The study tools as Python, for a notebook: each takes a Model (``pycapsnet.build``, ``load``), its
network, a layer, or a description, and returns what it found as arrays or as a ``Report`` that
prints as a table.

    import pycapsnet, pycapsnet.study as study
    model = pycapsnet.build("capsnet", conv_channels=16, primary_types=4)
    study.gradcheck(model)               # finite differences, float64, every parameter and the input
    study.crosscheck(model, "numpy", "torch")   # one batch on two backends, every tensor compared
    twin = study.autograd_twin(model)    # the same network under PyTorch autograd: twin.loss(x, y).backward()
    c = study.coupling(model, x[:8])     # {layer: [c_ij of each iteration, (8, I, J)]}
    m = study.measures(model, x[:8])     # {layer: {measure: [per iteration]}}: a routing's own (Routing.measures)
    decoded, steps = study.figure_4(model, x[:1], path="figure4.png")   # the paper's Figure 4
    study.inspect(model, x_test, y_test, out="inspect/")   # the pictures `pycapsnet inspect` draws

Finite differences check a gradient only in float64: a float32 model is checked on a float64 copy
of itself (its weights, held exactly), which the report says.
"""
from __future__ import annotations

import os

import numpy as np

from pycapsnet import backends
from pycapsnet.backends.host import machine_memory

from . import arguments as a, arguments as arg  # (arg where a function's own parameter is named a)
from .api import Model
from .arrays import images, labels
from .core import architecture, routing_calls, routings
from .core.model import CapsNet
from .core.network import Network
from .errors import CapsNetError
from .tools import coupling as coupling_tools, finite_diff, gradcheck as checks, plots, routing_checks
from .tools.coupling import float64_copy
from .tools.inspect_run import draw
from .tools.tables import format_table
from .training.run_dir import prepare_out_dir


class Report(list):
    """Rows of a check (dicts, or finite_diff.Check); ``passed`` is True when every row passed."""

    def __init__(self, rows, title="", note=""):
        super().__init__(rows)
        self.title, self.note = title, note

    @property
    def passed(self) -> bool:
        return all(_passed(r) for r in self)

    def __repr__(self):
        rows = [_row(r) for r in self]
        head = f"{self.title}: {sum(map(_passed, self))} of {len(self)} passed" + (f" ({self.note})" if self.note else "")
        return head + ("\n" + format_table(rows, list(rows[0])) if rows else "")


def _passed(r) -> bool:
    return r.passed if hasattr(r, "passed") else r["agree"]


def _row(r) -> dict:
    if hasattr(r, "passed"):
        return {"layer": r.layer, "tensor": r.tensor, "max rel err": f"{r.max_rel:.2e}", "checked": r.n_checked,
                "passed": "yes" if r.passed else "NO"}
    if "check" in r:  # check_routing's
        return {"check": r["check"], "what": r["what"], "tensor": r["tensor"], "max abs": f"{r['max_abs']:.2e}",
                "max rel": f"{r['max_rel']:.2e}", "passed": "yes" if r["agree"] else "NO",
                "points checked": r.get("points", "every entry")}
    return {"tensor": r["tensor"], "kind": r["kind"], "max abs": f"{r['max_abs']:.2e}",
            "max rel": f"{r['max_rel']:.2e}", "agree": "yes" if r["agree"] else "NO"}


def _network(target):
    return getattr(target, "network", target)


def _checked_network(target, who: str):
    """The network of a Model or a network; CapsNetError for anything else."""
    net = _network(target)
    if not isinstance(net, Network):
        raise CapsNetError(f"{who} takes a Model (pycapsnet.build, load) or its network, not {type(target).__name__}")
    return net


MAX_SAMPLES, MAX_BATCH = 100_000, 1024  # what a check of one batch on this machine's memory can hold


def gradcheck(target, samples: int = 12, seed: int = 0, tol: float = 1e-6, batch: int = 3) -> Report:
    """Finite differences (fourth order, float64) against the hand-written backward: of a Model or
    network, its whole loss w.r.t. every parameter and the input, then each layer of its body; of a
    layer, its input and parameters (give ``target=(layer, x)``); of a description (a dict, its JSON
    file, or "efficient"), every layer then the whole loss.  A float32 model is checked on a float64
    copy (the report says so)."""
    if hasattr(samples, "shape"):
        raise CapsNetError("gradcheck draws its own batch: gradcheck(model) checks the model on it; its second "
                           "argument is samples (entries checked per tensor), not images")
    samples = a.whole(samples, "samples (entries checked per tensor)", least=1, most=MAX_SAMPLES)
    tol, seed = a.real(tol, "tol", 0, open_lo=True), a.whole(seed, "seed")
    batch = a.whole(batch, "batch", least=1, most=MAX_BATCH)
    B = backends.get("numpy", dtype="float64")
    if isinstance(target, (str, os.PathLike, dict)):
        return Report(checks.run_network(B, target, samples, tol, seed), "gradcheck of the description")
    if isinstance(target, tuple) and len(target) == 2:
        layer, x = target
        if getattr(layer.B, "dtype", None) != "float64":
            raise CapsNetError("gradcheck of a layer runs in float64: build the layer on backends.get('numpy', "
                               "dtype='float64')")
        return Report(finite_diff.check_layer(B, type(layer).__name__, layer, np.asarray(x, np.float64), samples,
                                              1e-5, tol, seed), f"gradcheck of {type(layer).__name__}")
    net = _network(target)
    if not isinstance(net, Network):
        raise CapsNetError(f"gradcheck takes a Model, a network, (layer, input) or a description, not "
                           f"{type(target).__name__}")
    net, copied = float64_copy(net)
    rows = checks.network_checks(B, net, "the whole loss", samples, 1e-5, tol, seed=seed, batch=batch)
    rows += checks.layer_checks_of(B, net, samples, 1e-5, tol, seed)
    return Report(rows, "gradcheck", "a float64 copy of the model's weights" if copied else "")


def crosscheck(target, a: str = "numpy", b: str = "torch", dtype: str = "float64", dtype_b: str | None = None,
               batch: int = 4, seed: int = 0, rtol: float | None = None) -> Report:
    """One batch through the same weights on two backends or devices (``a``, ``b``: "numpy", "torch",
    "torch:cuda", "cupy"; ``dtype_b`` float32 against a float64 ``dtype``): the loss, the outputs
    and every gradient compared, each to ``rtol`` of its own largest entry (default 1e-9, or 1e-4
    where a side is float32)."""
    net = _checked_network(target, "crosscheck")
    dtype = arg.choice(dtype, "dtype", ("float32", "float64"))
    dtype_b = None if dtype_b is None else arg.choice(dtype_b, "dtype_b", ("float32", "float64"))
    batch, seed = arg.whole(batch, "batch", least=1, most=MAX_BATCH), arg.whole(seed, "seed")
    rtol = arg.real(rtol, "rtol", 0, none=True)  # 0: equal to the last bit
    sides = []
    for spec, dt in ((a, dtype), (b, dtype_b or dtype)):
        model = architecture.build(net.architecture, backends.get(spec, dtype=dt))
        model.load_state_dict(net.state_dict())
        sides.append(model)
    low = "float32" if "float32" in (dtype, dtype_b or dtype) else "float64"
    rng = np.random.default_rng(seed)
    x, y = rng.random((batch, *net.input_shape)).astype(low), rng.integers(0, net.n_classes, batch)
    results = []
    for model in sides:
        model.zero_grad()
        out = model.loss(x, y)
        dx = model.backward(input_grad=True)
        B = model.B
        res = {"loss": ("forward", np.array(out.loss)), "class scores": ("forward", B.to_numpy(out.lengths)),
               "dL/dx (input)": ("gradient", B.to_numpy(dx))}
        res.update({f"dL/d {k}": ("gradient", B.to_numpy(g)) for k, g in model.grads.items()})
        results.append(res)
    tol = rtol if rtol is not None else (1e-4 if low == "float32" else 1e-9)
    rows = _compared(results, tol, np.finfo(low).eps)
    return Report(rows, f"crosscheck {a} ({dtype}) against {b} ({dtype_b or dtype})", f"tolerance {tol:g}")


def _compared(results, tol, eps) -> list:
    """Each tensor's largest difference relative to its own largest entry -- but never at a finer
    scale than its floats resolve at ``tol``: 10 eps / tol of the largest tensor of its kind.  A
    gradient that is zero but for round-off (~1e-16 everywhere in float64) is thus compared at the
    size of the sums it was rounded in, not failed for its rounding."""
    scale = lambda t: float(np.abs(t).max(initial=0))  # noqa: E731
    largest = {}
    for kind, u in results[0].values():
        largest[kind] = max(largest.get(kind, 0.0), scale(u))
    rows = []
    for name, (kind, u) in results[0].items():
        w = results[1][name][1]
        diff = float(np.abs(u.astype(np.float64) - w.astype(np.float64)).max(initial=0))
        floor = 10 * eps / tol * largest[kind] if tol > 0 else 0.0
        at = max(scale(u), floor)
        rel = diff / at if at > 0 else (0.0 if diff == 0 else np.inf)
        rows.append({"tensor": name, "kind": kind, "max_abs": diff, "max_rel": rel,
                     "agree": diff == 0 if tol == 0 else rel <= tol})
    return rows


class AutogradTwin:
    """The network written again in PyTorch operations, every gradient left to autograd
    (tools/reference.py's AutogradNetwork), from the model's weights: ``loss(x, y)`` is a scalar
    tensor (``.backward()`` fills ``params[name].grad``); ``forward(x, y)`` gives (v, scores,
    reconstruction); ``grads(x, y)`` the loss and every gradient as NumPy arrays."""

    def __init__(self, net, dtype):
        import torch

        from .tools.reference import AutogradCapsNet, AutogradNetwork

        self.net = net
        if isinstance(net, CapsNet) and net.config.routing == "em":  # matrix capsules: the built-in's own twin
            self.reference = AutogradCapsNet.from_model(net, dtype=getattr(torch, dtype))
        else:
            matrix = [s["layer"] for s in net.architecture["body"] if "matrix" in s["layer"]]
            if matrix:
                raise CapsNetError(f"the autograd twin writes described networks without matrix capsules ({matrix[0]} "
                                   "here; the built-in 'em' network has its own): check this one with study.gradcheck")
            self.reference = AutogradNetwork.from_model(net, dtype=getattr(torch, dtype))
        self.params = self.reference.params

    def forward(self, x, y=None):
        return self.reference.forward(self._tensor(x), None if y is None else self._labels(y, x))

    def loss(self, x, y):
        return self.reference.loss(self._tensor(x), self._labels(y, x))[0]

    def grads(self, x, y, input_grad: bool = False):
        x = self._host_images(x)
        return self.reference.grads(x, self._host_labels(y, x), a.boolean(input_grad, "input_grad"))

    def _host_images(self, x):
        return images(x, self.net.input_shape).astype(np.float64)

    def _host_labels(self, y, x):
        return labels(y, len(x), self.net.n_classes)

    def _tensor(self, x):
        import torch

        if torch.is_tensor(x) and tuple(x.shape[1:]) == tuple(self.net.input_shape) and x.dtype == self.reference.dtype:
            return x  # as it is: a tensor that requires grad keeps its graph
        return torch.as_tensor(self._host_images(x), dtype=self.reference.dtype)

    def _labels(self, y, x):
        import torch

        return torch.as_tensor(self._host_labels(y, x if not torch.is_tensor(x) else np.empty(len(x))), dtype=torch.int64)


def autograd_twin(target, dtype: str = "float64") -> AutogradTwin:
    """The model under PyTorch autograd, the same weights: the independent oracle of its backward."""
    return AutogradTwin(_checked_network(target, "autograd_twin"), a.choice(dtype, "dtype", ("float32", "float64")))


def coupling(target, x, y=None, grad: bool = False, batch_size: int = 100):
    """Each routing layer's coefficients of every routing iteration for images x, as the network
    evaluates: {layer name: [c (N, I, J) per iteration]} (EM: assignments R; a convolutional layer's
    (N, P, I, C), its P window positions).  ``grad=True`` (with labels y): also how the loss pulls
    on them, as (c, dc): dc {layer: [dL_n/dc per iteration]}, each image's own loss's gradient with
    respect to the coefficients of each iteration, read by PyTorch's autograd off the routing's own
    forward (routing_checks.coupling_grads); None for coefficients that are constants of the forward
    (uniform's 1/J, a random draw, dynamic routing's first iteration), through which nothing flows.
    The full gradient, whichever mode the layer trains in; EM's layers have none here."""
    net = _checked_network(target, "coupling")
    B = net.B
    if not net.routing_layers():
        raise CapsNetError("this network has no routing layer (a CNN): it has no coupling coefficients")
    xa = images(x, net.input_shape)
    batch_size = a.whole(batch_size, "batch_size", least=1)
    if a.boolean(grad, "grad"):
        if y is None:
            raise CapsNetError("coupling(..., grad=True) needs the labels y: the gradient is the loss's")
        return coupling(net, xa, batch_size=batch_size), coupling_tools.grads(net, xa, y, batch_size)
    parts = {}
    with net.evaluating():  # a batch at a time: a forward holds MB per image (û alone is I x J x D floats)
        for start in range(0, len(xa), batch_size):
            net.forward(xa[start:start + batch_size])
            for name, layer in net.routing_layers():
                cs = [np.array(B.to_numpy(c)) for c in coupling_tools.coefficients(layer)]
                if not parts:
                    _refuse_beyond_memory(sum(c[0].nbytes for c in cs) * len(xa) * len(net.routing_layers()))
                parts.setdefault(name, []).append(cs)
            net.release()
    return {name: [np.concatenate([b[r] for b in blocks]) for r in range(len(blocks[0]))]
            for name, blocks in parts.items()}


def measures(target, x, batch_size: int = 100) -> dict:
    """Each routing layer's routing's own measures (Routing.measures: a sparse routing's support, a
    gated one's gates) for images x, each iteration's mean over the images: {layer name: {measure:
    [per iteration]}}; {} for a layer whose routing declares none."""
    net = _checked_network(target, "measures")
    if not net.routing_layers():
        raise CapsNetError("this network has no routing layer (a CNN): its routing has no measures")
    xa = images(x, net.input_shape)
    batch_size = a.whole(batch_size, "batch_size", least=1)
    sums = {}
    with net.evaluating():
        for start in range(0, len(xa), batch_size):
            n = len(xa[start:start + batch_size])
            net.forward(xa[start:start + batch_size])
            for name, layer in net.routing_layers():
                own = layer.routing_measures() if hasattr(layer, "routing_measures") else {}
                routing_calls.add_measures(sums.setdefault(name, {}), own, n)
            net.release()
    return {name: routing_calls.mean_measures(own, len(xa)) for name, own in sums.items()}


def check_routing(name, samples: int = 12, tol: float = 1e-6, seed: int = 0) -> Report:
    """A routing (built-in, or registered with pycapsnet.routings.register) checked three ways, float64:
    finite differences of its layers (fully connected, shared, stacked, convolutional; each gradient
    mode), its layer on NumPy against PyTorch, and its hand-written backward against PyTorch's
    autograd of its own forward -- which checks the backward against the forward, not the forward
    against the paper.  A Report: ``passed``, and a table of every tensor."""
    routings.get(name)  # an unknown name: one line naming the registered ones
    samples = a.whole(samples, "samples", least=1, most=MAX_SAMPLES)
    tol, seed = a.real(tol, "tol", 0, open_lo=True), a.whole(seed, "seed")
    rows = routing_checks.check(name, samples, tol, seed)
    return Report(rows, f"check of routing {name!r}", "finite differences to tol of each entry, numpy vs torch to "
                  f"{routing_checks.TOLERANCE['across_backends']:g} and autograd to "
                  f"{routing_checks.TOLERANCE['autograd_reference']:g} of each tensor's largest entry")


def _refuse_beyond_memory(need: int) -> None:
    have = machine_memory()
    if have and need > have // 2:
        raise CapsNetError(f"the coefficients of these images take {need / 2**30:.1f} GiB, more than half this "
                           f"machine's {have / 2**30:.1f} GiB: give fewer images")


MAX_STEPS = 1001  # steps of Figure 4: a picture of more is not one a person reads


def figure_4(target, x, capsule=None, reach: float = 0.25, steps: int = 11, path=None):
    """The paper's Figure 4 for one image x (1, C, H, W): each dimension of a class capsule (its
    predicted class unless ``capsule``) moved over [-reach, reach] in ``steps`` steps, decoded.
    Returns (decoded (D, steps, C, H, W), the steps); ``path``: also drawn there (PNG)."""
    net = _checked_network(target, "figure_4")
    if net.decoder is None:
        raise CapsNetError("Figure 4 decodes class capsules, and this network has no decoder")
    capsule = a.whole(capsule, "capsule (a class index)", 0, net.n_classes - 1, none=True)
    reach = a.real(reach, "reach", 0, open_lo=True)
    steps = a.whole(steps, "steps", least=2, most=MAX_STEPS)
    path = None if path is None else a.file_to_write(path, "path")
    xa = images(x, net.input_shape)[:1]
    with net.evaluating():
        out = net.forward(xa)
        v = net.B.to_numpy(out.v)
        chosen = int(out.predictions[0]) if capsule is None else capsule
    net.release()
    moves = np.round(np.linspace(-reach, reach, steps), 6)
    D = v.shape[-1]
    tweaked = np.repeat(v, D * steps, axis=0)
    for d in range(D):
        tweaked[d * steps:(d + 1) * steps, chosen, d] += moves
    decoded = net.B.to_numpy(net.decode(tweaked, np.full(len(tweaked), chosen)))
    decoded = decoded.reshape(D, steps, *decoded.shape[1:])
    if path is not None:
        try:
            plots.perturbation_grid(decoded, moves, path, f"each of the {D} dimensions of capsule {chosen} "
                                    f"moved over [-{reach:g}, {reach:g}], then decoded")
        except OSError as e:
            raise CapsNetError(f"cannot write {path}: {e.strerror or e}; name another path") from None
    return decoded, moves


def inspect(model, x, y, index: int = 0, out: str = "inspect") -> list:
    """``pycapsnet inspect`` for arrays: reconstructions of the first images, Figure 4 and every
    routing layer's coupling for image ``index`` of (x, y), written into ``out``; returns the paths."""
    model = model if isinstance(model, Model) else Model(_checked_network(model, "inspect"))
    if not model.network.routing_layers():
        raise CapsNetError("this network has no routing layer (a CNN): inspect draws routing")
    xa = model._split(x, y, "x", "y")
    index = a.whole(index, "index", 0, len(xa) - 1)
    out = a.path(out, "out")
    prepare_out_dir(out)
    try:
        return draw(model.network, xa, index, model.classes, out, about=f"image {index}")
    except OSError as e:
        raise CapsNetError(f"cannot write the pictures into {out}: {e.strerror or e}; free some space or choose "
                           "another out") from None

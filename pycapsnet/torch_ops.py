"""What the torch wrapper (pycapsnet/torch.py) sees of a wrapped pycapsnet layer, network or loss:
an Op holds its parameters by slot and the state its forward leaves for its backward, which the
wrapper sets aside per graph, copies where a backward writes over it, and moves with ``.to``.
This module imports torch; ``import pycapsnet`` does not import it."""
from __future__ import annotations

import torch

from pycapsnet import backends
from .core.network import Network as CoreNetwork, Sequential

# What a forward leaves on a layer for its backward
SAVED = ("cache", "trace", "in_shape")


def objects_of(root) -> list:
    """Every pycapsnet object of a layer or network (layers, heads, losses), each once."""
    found, todo = {}, [root]
    while todo:
        obj = todo.pop()
        if id(obj) in found or not type(obj).__module__.startswith("pycapsnet."):
            continue
        found[id(obj)] = obj
        for value in vars(obj).values():
            todo.extend(value if isinstance(value, (list, tuple)) else [value])
    return list(found.values())


def slots_of(root, kind: str = "params") -> list:
    """(dotted name, owning layer, key) of every parameter (``kind`` "buffers": every buffer, batch
    norm's running statistics), in the order of ``root.params`` (``root.buffers``)."""
    if isinstance(root, CoreNetwork):
        owners = list(root.layers())
    elif isinstance(root, Sequential):
        owners = list(root.named_layers())
    else:
        owners = [("", root)]
    return [(f"{n}.{k}" if n else k, layer, k) for n, layer in owners for k in getattr(layer, kind)]


class Op:
    """A wrapped pycapsnet object seen from torch: its parameters, by slot, and its saved state."""

    def __init__(self, root, like: "Op | None" = None):
        self.root = root
        # the same layers as another op of this root (a network's outputs and its loss): found once
        self.slots, self.buffer_slots, self.objects = (like.slots, like.buffer_slots, like.objects) if like else \
            (slots_of(root), slots_of(root, "buffers"), objects_of(root))
        # Where in the saved state a backward writes (dû over û, ...): learned from the tensors'
        # version counters, so that each backward copies those alone (and what it has not seen yet)
        self.written, self.unwritten = set(), set()

    @property
    def B(self):
        """The backend the layers compute on (``move`` replaces it on every layer, the root too)."""
        return self.root.B

    def for_backward(self, saved) -> tuple:
        """(the saved state for one backward, what to learn from after it): a copy of every tensor
        a backward may write over, the rest as they are, a tensor held in two places copied once."""
        copy_all = not getattr(self.B, "tracks_writes", False)
        paths = {}  # id -> the paths of one tensor

        def find(value, path):
            if isinstance(value, torch.Tensor):
                paths.setdefault(id(value), []).append(path)
            elif isinstance(value, (tuple, list, dict)):
                for k, v in (value.items() if isinstance(value, dict) else enumerate(value)):
                    find(v, path + (k,))

        for n, (_, attrs) in enumerate(saved):
            for a, value in attrs.items():
                find(value, (n, a))
        made = {}

        def take(value):
            if isinstance(value, torch.Tensor):
                if id(value) not in made:
                    where = paths[id(value)]
                    copy = copy_all or any(p in self.written or p not in self.unwritten for p in where)
                    t = value.clone() if copy else value
                    made[id(value)] = (t, t._version, copy, where)
                return made[id(value)][0]
            if isinstance(value, (tuple, list)):
                return type(value)(take(v) for v in value)
            if isinstance(value, dict):
                return {k: take(v) for k, v in value.items()}
            return value

        state = [(obj, {a: take(v) for a, v in attrs.items()}) for obj, attrs in saved]
        return state, list(made.values())

    def learn(self, used) -> bool:
        """After a backward: note where it wrote; True if it wrote over an original (not a copy),
        which spoils the graph's state for another backward."""
        spoiled = False
        for t, version, copied, where in used:
            if t._version != version:
                self.written.update(where)
                self.unwritten.difference_update(where)
                spoiled |= not copied
            elif copied:
                self.unwritten.update(p for p in where if p not in self.written)
        return spoiled

    def bind(self, params):
        """The layers compute with these tensors (the module's parameters, without autograd)."""
        for (_, layer, k), p in zip(self.slots, params):
            layer.params[k] = p.detach()

    def saved(self) -> list:
        return [(o, {a: getattr(o, a) for a in SAVED if hasattr(o, a)}) for o in self.objects]

    @staticmethod
    def emptied(saved) -> list:
        return [(obj, {a: (v if a == "in_shape" else None) for a, v in attrs.items()}) for obj, attrs in saved]

    def restore(self, saved) -> None:
        for obj, attrs in saved:
            for a, value in attrs.items():
                setattr(obj, a, value)

    def zero_grads(self):
        for _, layer, k in self.slots:
            layer.grads[k][...] = 0

    def grads(self) -> list:
        return [layer.grads[k].clone() for _, layer, k in self.slots]

    def move(self, params) -> None:
        """After ``Module.to``: a backend of the parameters' device and dtype, every tensor the
        layers hold moved to it, gradients as zeros like their parameters, saved state dropped."""
        dtype = str(params[0].dtype).replace("torch.", "") if params else self.B.dtype
        device = str(params[0].device) if params else self.B.device
        if (device, dtype) == (self.B.device, self.B.dtype):
            return
        B = backends.get("torch", device=device, dtype=dtype)
        old = self.B
        for obj in self.objects:
            for a, value in list(vars(obj).items()):
                moved = moved_to(value, B, old)
                if moved is not value:  # what holds no tensor (a layer's Flow, sizes) is left as it is
                    setattr(obj, a, moved)
            for a in SAVED:
                if hasattr(obj, a) and a != "in_shape":
                    setattr(obj, a, None)
        self.bind(params)
        for (_, layer, k), p in zip(self.slots, params):
            layer.grads[k] = torch.zeros_like(p.detach())


def moved_to(value, B, old):
    """``value`` on backend B: a backend replaced, a tensor moved (floats to B's dtype), dicts and
    lists in place (a layer may share its dict of parameters with a part of it)."""
    if value is old:
        return B
    if isinstance(value, torch.Tensor):
        return value.to(torch.device(B.device), getattr(torch, B.dtype) if value.is_floating_point() else None)
    if isinstance(value, dict):
        for k in list(value):
            value[k] = moved_to(value[k], B, old)
    elif isinstance(value, list):
        value[:] = [moved_to(v, B, old) for v in value]
    return value


def torch_name(owner, part: str) -> str:
    """A layer's name as a submodule's: one that torch.nn.Module already uses for an attribute
    (``training``, ``forward``, ``to``) gets a trailing underscore (``to_``)."""
    while hasattr(owner, part) and part not in owner._modules:
        part += "_"
    return part


def parts_of(y) -> list:
    return list(y) if isinstance(y, (tuple, list)) else [y]


class LayerOp(Op):
    def forward(self, xs):
        y = self.root.forward(xs[0] if len(xs) == 1 else tuple(xs))
        self.tuple_out = isinstance(y, tuple)  # matrix capsules: (poses, activations)
        return parts_of(y)

    def backward(self, dys, input_grad):
        self.zero_grads()
        dx = self.root.backward(tuple(dys) if self.tuple_out else dys[0], input_grad=input_grad)
        return parts_of(dx), self.grads()


class NetworkOp(Op):
    """A network's forward: images (N, C, H, W) -> class capsules v, scores, and the reconstruction
    from the capsule of class ``labels`` (the highest-scoring one without)."""
    labels = None

    def forward(self, xs):
        net = self.root
        out = net.forward_on_device(xs[0], self.labels, reconstruct=net.decoder is not None)
        return [out.v, out.lengths] + ([out.reconstruction] if net.decoder is not None else [])

    def backward(self, dys, input_grad):
        net = self.root
        self.zero_grads()
        dx = net.outputs_backward(dys[0], dys[1], dys[2] if net.decoder is not None else None, input_grad)
        return [dx], self.grads()


class LossOp(Op):
    """A network's own loss (class loss plus weighted reconstruction) of images and ``labels``."""
    labels = None

    def forward(self, xs):
        return [self.root.loss_on_device(xs[0], self.labels).summary[0]]

    def backward(self, dys, input_grad):
        self.zero_grads()
        dx = self.root.backward(input_grad=input_grad)
        scale = dys[0]
        return [None if dx is None else dx * scale], [layer.grads[k] * scale for _, layer, k in self.slots]

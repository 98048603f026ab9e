"""``Sequential``: named layers applied in order, the composition every network's body and decoder is."""
from __future__ import annotations

from .layers import Layer
from ..errors import CapsNetError


class Sequential(Layer):
    """Layers applied in order, under names: parameters and gradients appear as ``name.param``
    (``name.child.param`` for nested containers).  forward chains; backward runs in reverse, and
    only the first layer (the first with parameters, where the input's gradient is not wanted) is
    told whether the input's gradient is wanted."""

    def __init__(self, backend, layers):
        self.B, self.cache = backend, None  # no parameters of its own: ``params`` are the children's
        self.training = all(getattr(layer, "training", True) for _, layer in layers)
        self.names, self.layers = [n for n, _ in layers], [l for _, l in layers]
        if len(set(self.names)) != len(self.names):
            raise CapsNetError(f"layer names must be unique, got {self.names}")

    def __repr__(self):
        inner = "".join(f"  {name}: " + repr(layer).replace("\n", "\n  ") + "\n" for name, layer in self)
        return f"{type(self).__name__}(\n{inner})"

    def __iter__(self):
        return iter(zip(self.names, self.layers))

    def __getitem__(self, name):
        return self.layers[self.names.index(name)]

    def named_layers(self, prefix=""):
        """(dotted name, layer) for every layer that holds parameters of its own, in forward order."""
        for name, layer in self:
            if isinstance(layer, Sequential):
                yield from layer.named_layers(f"{prefix}{name}.")
            elif layer.params:
                yield prefix + name, layer

    def leaves(self, prefix=""):
        """(dotted name, layer) for every layer that is not itself a Sequential, in forward order."""
        for name, layer in self:
            if isinstance(layer, Sequential):
                yield from layer.leaves(f"{prefix}{name}.")
            else:
                yield prefix + name, layer

    @property
    def params(self):
        return {f"{n}.{k}": p for n, l in self.named_layers() for k, p in l.params.items()}

    @property
    def grads(self):
        return {f"{n}.{k}": g for n, l in self.named_layers() for k, g in l.grads.items()}

    def forward(self, x):
        for layer in self.layers:
            x = layer.forward(x)
        return x

    def backward(self, dy, input_grad=True):
        """Where the input's gradient is not wanted (training), the layers before the first one with
        parameters (a Normalize, say) would make input gradients only: they are released instead of
        run, and that first layer is told that its input's gradient is not wanted; returns None."""
        first = 0 if input_grad else next((k for k, layer in enumerate(self.layers) if layer.params),
                                          len(self.layers))
        for k in reversed(range(first, len(self.layers))):
            dy = self.layers[k].backward(dy, input_grad=input_grad or k > first)
        for layer in self.layers[:first]:
            layer.release()
        return dy if input_grad else None

    def walk(self):
        yield self
        for layer in self.layers:
            yield from layer.walk()

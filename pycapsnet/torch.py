"""pycapsnet's layers and networks inside PyTorch models, with pycapsnet's own backward.

    from pycapsnet import backends

    import pycapsnet.torch as pct
    from pycapsnet.core.capsules import ClassCaps
    caps = pct.Layer(ClassCaps(backends.get("torch"), positions=36, types=32, in_dim=8, n_classes=10, out_dim=16))
    v = caps(u)            # u (N, 36, 32, 8): a torch tensor, from a torch stem or anything else
    loss = ...; loss.backward()   # through ClassCaps' hand-written backward

``Layer(layer)`` wraps any pycapsnet layer (a ``Sequential`` of them too) built on the torch
backend; ``Network(net)`` wraps a whole network (or the Model ``pycapsnet.build(..., backend="torch")``
gives): images (N, C, H, W) in, (v, scores,
reconstruction) out, and ``.loss(x, y)`` its own losses.  Each call is one
``torch.autograd.Function`` whose forward and backward are the layer's: nothing inside requires
grad.  The parameters are ``nn.Parameter``s over the layer's own tensors (no copies), so optimizers,
``state_dict`` and ``.to(device or dtype)`` work as on any module.

Torch's rules hold: what a forward saved is set aside with its graph, so another forward before the
backward changes nothing; a graph is backpropagated once (pycapsnet's backward consumes what its
forward saved, so each backward works on copies of what it writes over: ``retain_graph`` works); a second
derivative (create_graph=True, hessian, gradgradcheck) is refused in one line: only first derivatives are
written.  Under torch.compile, autocast, torch.func, jit, export: torch_support.py.
This module imports torch; ``import pycapsnet`` does not import it.
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch.autograd.function import once_differentiable

from .core.layers import Layer as _CoreLayer
from .core.network import Network as _CoreNetwork
from .core.checks import check_labels
from . import torch_support as support
from .errors import BackendError, CapsNetError
from .torch_ops import LayerOp, LossOp, NetworkOp, objects_of, torch_name


class _Capsule(torch.autograd.Function):
    """One call of a wrapped pycapsnet computation, its forward and backward the op's own."""

    @staticmethod
    def forward(ctx, op, n_inputs, *tensors):
        xs, params = tensors[:n_inputs], tensors[n_inputs:]
        op.bind(params)
        ys = op.forward([x.detach().clone() for x in xs])  # a layer may keep its input for backward
        ctx.op, ctx.n_inputs, ctx.saved, ctx.spoiled = op, n_inputs, op.saved(), False
        ctx.empty = op.emptied(ctx.saved)
        op.restore(ctx.empty)  # the graph holds the state, not the layers
        ctx.shapes = [tuple(y.shape) for y in ys]
        ctx.save_for_backward(*params)  # torch refuses the backward if they were changed in place since
        return tuple(y.clone() for y in ys)  # the backward may write over arrays the forward returned

    @staticmethod
    def backward(ctx, *dys):
        if torch.is_grad_enabled():  # create_graph=True: a second derivative is wanted (hessian, gradgradcheck)
            raise RuntimeError(support.ONCE)
        return _Capsule._backward(ctx, *dys)

    @staticmethod
    @once_differentiable  # first derivatives only: differentiating the gradient is refused, saying so
    def _backward(ctx, *dys):
        op, n = ctx.op, ctx.n_inputs
        if ctx.spoiled:
            raise RuntimeError("this graph's first backward wrote over what a pycapsnet layer's forward saved, so it "
                               "cannot be backpropagated again: run the forward again")
        op.bind(ctx.saved_tensors)
        # pycapsnet's backward may write over what it reads (dû over û): it gets copies of those
        # tensors, so that torch can run it again (retain_graph, gradcheck)
        state, used = op.for_backward(ctx.saved)
        op.restore(state)
        # detached: under create_graph, torch hands the backward gradients that require grad
        dys = [op.B.zeros(s) if d is None else d.detach().contiguous() for d, s in zip(dys, ctx.shapes)]
        wanted = ctx.needs_input_grad[2:2 + n]
        dxs, grads = op.backward(dys, any(wanted))
        op.restore(ctx.empty)  # nothing of this graph stays on the layers
        ctx.spoiled = op.learn(used)
        dxs = [dx if w else None for w, dx in zip(wanted, dxs)]
        return (None, None, *dxs, *grads)


class _Module(torch.nn.Module):
    def __init__(self, root, op):
        super().__init__()
        if getattr(root.B, "name", None) != "torch":
            raise CapsNetError(f"{type(root).__name__} is built on the {root.B.name} backend; pycapsnet.torch wraps "
                               "layers built on the torch backend: build it with backends.get('torch', dtype=...)")
        self._op = op
        self._names = {}  # pycapsnet's parameter and buffer names -> the module's (see torch_name)
        for name, layer, k in op.slots:
            owner, leaf = self._owner(name)
            owner.register_parameter(leaf, torch.nn.Parameter(layer.params[k]))  # the same storage
        for name, layer, k in op.buffer_slots:  # batch norm's running statistics: state_dict holds them
            owner, leaf = self._owner(name)
            owner.register_buffer(leaf, layer.buffers[k])  # the same storage: updated in place by forward

    def _owner(self, name):
        """(the submodule that holds pycapsnet's ``name``, its leaf name), made where missing."""
        *path, leaf = name.split(".")
        owner, parts = self, []
        for part in path:
            part = torch_name(owner, part)
            if part not in owner._modules:
                owner.add_module(part, torch.nn.Module())
            owner = owner._modules[part]
            parts.append(part)
        self._names[name] = ".".join([*parts, leaf])
        return owner, leaf

    @property
    def wrapped(self):
        """The pycapsnet layer or network this module runs."""
        return self._op.root

    def _params(self) -> list:
        """The tensors the layers compute with: the parameters, or what torch.func.functional_call
        put in their place."""
        return [functools.reduce(getattr, self._names[name].split("."), self) for name, _, _ in self._op.slots]

    def __prepare_scriptable__(self):
        support.refuse_scripting(self)

    def _apply(self, fn, *args, **kwargs):
        """``.to()``, ``.double()``, ``.cuda()``, ...: the parameters converted, then the layers
        moved to a backend of their device and dtype; where pycapsnet cannot compute in it
        (``.half()``), the module is left as it was and the error says why."""
        before = [p.data for p in self._params()]
        if before and getattr(fn(torch.empty(0, dtype=before[0].dtype, device=before[0].device)), "is_meta", False):
            raise CapsNetError(f"{type(self).__name__} left as it was: the meta device holds no values for "
                               "pycapsnet's kernels to compute on; keep the module on cpu or cuda")
        buffers = {name: self.get_buffer(self._names[name]) for name, _, _ in self._op.buffer_slots}
        super()._apply(fn, *args, **kwargs)
        try:
            self._op.move(self._params())
        except (BackendError, CapsNetError) as e:
            for p, old in zip(self._params(), before):
                p.data = old
            for name, old in buffers.items():
                owner, leaf = self._owner(name)
                owner._buffers[leaf] = old
            raise CapsNetError(f"{type(self).__name__} left as it was ({self._op.B.dtype} on {self._op.B.device}): "
                               f"{e}") from None
        self._bind_buffers()
        return self

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """As torch's; with ``assign=True`` the module then computes in the tensors' dtype and on their
        device (as torch keeps the state dict's properties), or, where pycapsnet cannot (float16,
        tensors of mixed dtypes or devices), is left as it was and the error says why."""
        params = {n: p for n, p in self.named_parameters()}
        buffers = {n: b for n, b in self.named_buffers()}
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        if not assign:
            return result
        tensors = [*self._params(), *(self.get_buffer(self._names[n]) for n, _, _ in self._op.buffer_slots)]
        kinds = sorted({f"{str(t.dtype)[6:]} on {t.device}" for t in tensors})
        try:
            if len(kinds) > 1:
                raise CapsNetError(f"its tensors are {' and '.join(kinds)}: give them one dtype and device")
            self._op.move(self._params())
        except (BackendError, CapsNetError) as e:
            for table, old in ((params, "_parameters"), (buffers, "_buffers")):
                for name, t in table.items():
                    *path, leaf = name.split(".")
                    getattr(functools.reduce(getattr, path, self), old)[leaf] = t
            self._bind_buffers()
            raise CapsNetError(f"load_state_dict(..., assign=True) refused, {type(self).__name__} left as it was "
                               f"({self._op.B.dtype} on {self._op.B.device}): {e}; or load without assign=True, "
                               "which converts the values to the module's dtype") from None
        self._bind_buffers()
        return result

    def _bind_buffers(self):
        """The layers compute with, and update, the module's own buffers: those ``.to()`` made, and
        those ``load_state_dict(..., assign=True)`` put in place of the ones registered."""
        for name, layer, k in self._op.buffer_slots:
            layer.buffers[k] = self.get_buffer(self._names[name])

    def train(self, mode: bool = True):
        """Training or evaluation mode, for torch's modules and the pycapsnet network alike
        (a Dropout inside drops only in training)."""
        super().train(mode)
        self._op.root.train(mode)
        return self

    @torch.compiler.disable  # torch.compile: the rest of the model compiles, this call runs as it does eagerly
    def _call(self, op, xs):
        self._bind_buffers()
        params = self._params()
        support.refuse_tracing(self, [*[x for x in xs if torch.is_tensor(x)], *params])
        xs = support.autocast_inputs(xs, op.B.dtype, op.B.device)
        with support.without_autocast(op.B.device):
            return self._apply_op(op, xs, params)

    def _apply_op(self, op, xs, params):
        B = op.B
        if getattr(op.root, "training", None) != self.training:  # the module's flag, however it was set (Lightning sets it directly)
            op.root.train(self.training)
        for x in xs:
            if not isinstance(x, torch.Tensor):
                raise CapsNetError(f"{type(self).__name__} takes torch tensors, got {type(x).__name__}: "
                                   "torch.as_tensor(x) first")
            if not x.is_floating_point():
                raise CapsNetError(f"{type(self).__name__} takes float tensors, got {str(x.dtype)[6:]}: "
                                   f"x.to(torch.{B.dtype}) (images as floats in [0, 1])")
            if x.ndim == 0 or x.shape[0] == 0:
                raise CapsNetError(f"{type(self).__name__} got a batch of no samples (shape {tuple(x.shape)}): "
                                   "give at least one")
            if str(x.dtype) != f"torch.{B.dtype}" or x.device != torch.device(B.device):
                raise CapsNetError(f"an input is {str(x.dtype)[6:]} on {x.device}, but the module computes in "
                                   f"{B.dtype} on {B.device}: x.to({B.device!r}, torch.{B.dtype}), or move the "
                                   "module with .to()")
        return _Capsule.apply(op, len(xs), *xs, *params)


class Layer(_Module):
    """A pycapsnet layer (or ``Sequential`` of layers) as a torch module: ``forward(*inputs)``
    takes what the layer's forward takes (channels-last images; matrix capsules' (poses,
    activations) as two tensors) and returns what it returns."""

    def __init__(self, layer):
        if not isinstance(layer, _CoreLayer):
            raise CapsNetError(f"pycapsnet.torch.Layer wraps a pycapsnet layer, got {type(layer).__name__}; "
                               "a whole network: pycapsnet.torch.Network")
        super().__init__(layer, LayerOp(layer))

    def forward(self, *xs):
        ys = self._call(self._op, xs)
        return ys if self._op.tuple_out else ys[0]


class Network(_Module):
    """A pycapsnet network as a torch module: ``forward(x, y=None)`` -> (v (N, J, D), scores (N, J),
    reconstruction (N, C, H, W) or None), the decoder fed the capsule of class y (the highest-scoring
    one without y); ``loss(x, y)`` is the network's own loss, a scalar tensor."""

    def __init__(self, network):
        network = getattr(network, "network", network)  # a Model of pycapsnet.build/load: its network
        if not isinstance(network, _CoreNetwork):
            raise CapsNetError(f"pycapsnet.torch.Network wraps a pycapsnet network, got {type(network).__name__}; "
                               "a layer: pycapsnet.torch.Layer")
        super().__init__(network, NetworkOp(network))
        self._loss_op = LossOp(network, like=self._op)

    def _labels(self, y, x):
        B = self._op.B
        return B.asarray(check_labels(B, self._op.root.n_classes, y, x.shape[0]))

    def _images(self, x):
        shape = self._op.root.input_shape
        if isinstance(x, torch.Tensor) and tuple(x.shape[1:]) != tuple(shape):
            raise CapsNetError(f"the network takes images (N, {', '.join(map(str, shape))}), got a tensor of shape "
                               f"{tuple(x.shape)}")

    def forward(self, x, y=None):
        self._images(x)
        self._op.labels = None if y is None else self._labels(y, x)
        ys = self._call(self._op, (x,))
        return ys[0], ys[1], ys[2] if len(ys) > 2 else None

    def loss(self, x, y):
        self._images(x)
        self._loss_op.labels = self._labels(y, x)
        return self._call(self._loss_op, (x,))[0]


@contextlib.contextmanager
def held(module):
    """Inside the block, what the wrapped layers draw (random routing's coefficients, Dropout's
    masks) is drawn once and then held, so that the module is one function of its inputs and
    ``torch.autograd.gradcheck`` can perturb them under one draw (as nn.Dropout needs a fixed seed):

        with pycapsnet.torch.held(caps):
            torch.autograd.gradcheck(caps, (u,))

    The layers draw anew, from where their generators stand, after the block."""
    if not isinstance(module, _Module):
        raise CapsNetError(f"held takes a module of pycapsnet.torch (Layer, Network), not {type(module).__name__}")
    drawing = [obj for obj in objects_of(module._op.root) if hasattr(obj, "hold")]
    was = [layer.hold for layer in drawing]  # a block inside another keeps the outer one's hold when it ends
    for layer in drawing:
        layer.hold = True
    try:
        yield module
    finally:
        for layer, before in zip(drawing, was):
            layer.hold = before
            for k in ("mask", "drawn") if not before else ():  # the next draw is a new one
                if hasattr(layer, k):
                    setattr(layer, k, None)

"""What the modules of pycapsnet.torch do under PyTorch's other machinery.  A wrapped layer runs its
own kernels (NumPy's BLAS on the CPU, views of the tensors' memory) and its own backward, which no
tracer can see inside.  So each tool that would trace it is refused in one line before it starts,
and the others are met where they can be:

    torch.compile               the module's call is left out of the graph (torch.compiler.disable):
                                the rest of the model compiles, the layer runs as it does eagerly
    autocast                    the layer computes in its own dtype: its inputs are cast to it, and
                                autocast is off inside (as torch.amp.custom_fwd(cast_inputs=...) does)
    second derivatives          refused (create_graph=True, hessian, gradgradcheck): ONCE
    torch.func (grad, vmap, ...)  refused; torch.func.functional_call alone works
    torch.jit.script / trace, torch.export, fake and meta tensors   refused
"""
from __future__ import annotations

import contextlib

import torch

from .errors import CapsNetError

ONCE = ("pycapsnet's layers differentiate once (their backward is written by hand, not traced): second "
        "derivatives -- create_graph=True, torch.autograd.functional.hessian, gradgradcheck -- are not supported")
UNTRACEABLE = ("runs its own kernels and backward, which {tool} cannot trace; {fix}")


def refuse_tracing(module, tensors) -> None:
    """CapsNetError, before anything runs, where a tracer or a transform is at work, or a tensor
    holds no values."""
    name = type(module).__name__
    if torch._C._are_functorch_transforms_active():
        raise CapsNetError(f"{name} " + UNTRACEABLE.format(
            tool="torch.func (grad, vmap, jacrev)",
            fix="differentiate with torch.autograd (loss.backward(), torch.autograd.grad); "
                "torch.func.functional_call alone works"))
    if torch.jit.is_tracing():
        raise CapsNetError(f"{name} " + UNTRACEABLE.format(
            tool="torch.jit.trace", fix="keep it out of the traced part, or save its weights with state_dict"))
    if getattr(torch.compiler, "is_exporting", lambda: False)() or any(_fake(t) for t in tensors):
        raise CapsNetError(f"{name} " + UNTRACEABLE.format(
            tool="torch.export (or a tracer with fake tensors)",
            fix="export the rest of the model, and save this module's weights with state_dict"))
    meta = next((t for t in tensors if t.is_meta), None)
    if meta is not None:
        raise CapsNetError(f"{name} got a tensor on the meta device, which holds shapes but no values: give "
                           "tensors with data (cpu or cuda)")


def _fake(t) -> bool:
    return type(t) not in (torch.Tensor, torch.nn.Parameter) and not isinstance(t, torch.nn.Parameter)


def autocast_inputs(xs, dtype: str, device: str):
    """Under autocast, the floating inputs cast to the layer's own dtype (a stem under autocast hands
    on bfloat16); elsewhere as they are."""
    kind = torch.device(device).type
    if not torch.is_autocast_enabled(kind):
        return xs
    wanted = getattr(torch, dtype)
    return tuple(x.to(wanted) if torch.is_tensor(x) and x.is_floating_point() else x for x in xs)


@contextlib.contextmanager
def without_autocast(device: str):
    """Autocast off for the layer's own computation (its kernels read float32 or float64 alone)."""
    kind = torch.device(device).type
    if torch.is_autocast_enabled(kind):
        with torch.autocast(kind, enabled=False):
            yield
    else:
        yield


def refuse_scripting(module):
    """``__prepare_scriptable__`` of the wrapped modules: torch.jit.script compiles Python source, and
    these modules call NumPy-style kernels."""
    raise CapsNetError(f"{type(module).__name__} " + UNTRACEABLE.format(
        tool="torch.jit.script", fix="script the rest of the model, and save this module's weights with state_dict"))

"""What a network description may hold, checked before anything is built (architecture.assemble
calls ``check``): every key known, every option of the type and range its layer takes, routing
iterations within MAX_ROUTING_ITERS.  A description comes from a JSON file, a checkpoint's header
or Python; whichever it is, a wrong value is one CapsNetError naming the layer, the option, what
it got and what it takes -- never a ZeroDivisionError or a string "false" read as true.
"""
from __future__ import annotations

import inspect
import json
import math
import os

import numpy as np

from ..errors import CapsNetError
from ..userfiles import read_regular
from . import routings
from .checks import MAX_ROUTING_ITERS


def _int(lo, hi=None):
    def check(v):
        ok = isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= lo and (hi is None or v <= hi)
        return None if ok else f"a whole number {f'from {lo} to {hi}' if hi else f'of at least {lo}'}"
    return check


def _number(lo, hi=math.inf, open_lo=False, open_hi=False, none=False):
    def check(v):
        if v is None and none:
            return None
        ok = isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) and math.isfinite(v) \
            and (v > lo if open_lo else v >= lo) and (v < hi if open_hi else v <= hi)
        if ok:
            return None
        low, high = f"{'(' if open_lo else '['}{lo:g}", f"{hi:g}{')' if open_hi else ']'}"
        return f"a finite number in {low}, {high}" + (" or null" if none else "")
    return check


def _choice(*allowed):
    return lambda v: None if isinstance(v, str) and v in allowed else f"one of {', '.join(map(repr, allowed))}"


def _boolean(v):
    return None if isinstance(v, bool) else "true or false (a JSON boolean, not a string)"


def _size_or_null(v):
    return None if v is None else _int(1)(v)


SIZE, ITERS = _int(1), _int(1, MAX_ROUTING_ITERS)
# Every option of every layer: what it takes.  architecture.LAYERS' builders take these names.
OPTIONS = {
    "channels": SIZE, "kernel": SIZE, "stride": SIZE, "padding": _int(0), "features": SIZE, "types": SIZE,
    "dim": SIZE, "capsules": SIZE, "iters": ITERS, "routing_grad": _choice("full", "final"),
    "share_spatial": _boolean, "init_std": _number(0, 100, open_lo=True, none=True),
    "conv": _choice("fourier", "im2col", "depthwise"), "squash": _choice("sabour", "efficient"),
    "em_lambda": _number(0, open_lo=True), "rate": _number(0, 1, open_hi=True),
    "momentum": _number(0, 1), "eps": _number(0, 1, open_lo=True), "bias": _number(-10, 10, none=True),
    "scale": _number(0, 1000, open_lo=True),
    "mean": lambda v: None if isinstance(v, list) and v and all(_number(-1e6, 1e6)(x) is None for x in v) else
    "a list of finite numbers, one per input channel",
    "std": lambda v: None if isinstance(v, list) and v and all(_number(0, 1e6, open_lo=True)(x) is None for x in v)
    else "a list of numbers above 0, one per input channel",
    "routing": lambda v: None if isinstance(v, str) and v in routings.names() else
    f"one of {', '.join(map(repr, routings.names()))}, the registered routings (a routing of your own: import the "
    "module that registers it, or --plugin MODULE)",
}
ROUTED_LAYERS = ("dynamic_caps", "conv_caps")  # their options beyond their own are their routing's
# Options whose rule differs for one layer: max_pool's stride may be null (its kernel); a conv2d
# mixes channels, so it convolves by im2col or Fourier, not depthwise
OPTION_OF = {("max_pool", "stride"): _size_or_null, ("conv2d", "conv"): _choice("im2col", "fourier")}
TOP = {"input_shape", "n_classes", "body", "head", "loss", "decoder"}
LOSS_OPTIONS = {"margin": {"m_plus": _number(0, 1), "m_minus": _number(0, 1), "lam": _number(0)},
                "spread": {}, "cross_entropy": {}, "nll": {}}
DECODER = {"hidden": None, "weight": _number(0)}


def check(arch) -> None:
    """CapsNetError naming the first thing in ``arch`` that no network could be built from."""
    if not isinstance(arch, dict):
        raise CapsNetError(f"a network description is an object (a dict), not a {type(arch).__name__}")
    unknown = sorted(map(str, set(arch) - TOP))
    if unknown:
        raise CapsNetError(f"the network description has unknown key(s) {', '.join(unknown)}; it takes "
                           f"{', '.join(sorted(TOP))} (docs/architecture.md)")
    shape, n = arch.get("input_shape"), arch.get("n_classes")
    if shape is not None and not (isinstance(shape, (list, tuple)) and len(shape) == 3 and all(SIZE(d) is None for d in shape)):
        raise CapsNetError(f"input_shape must be 3 whole numbers of at least 1 (C, H, W) or null, got {shape!r}")
    if n is not None and _int(2)(n) is not None:
        raise CapsNetError(f"n_classes must be a whole number of at least 2 or null, got {n!r}")
    body = arch.get("body")
    if not isinstance(body, list) or not body:
        raise CapsNetError("the network description needs a 'body': a non-empty list of layers")
    counts = {}
    for k, spec in enumerate(body):
        _check_layer(k, spec, counts)
    if not isinstance(arch.get("head", "lengths"), str):
        raise CapsNetError(f"head must be a name (lengths, activations or logits), got {arch.get('head')!r}")
    _check_loss(arch.get("loss"))
    _check_decoder(arch.get("decoder"))


def _check_layer(k, spec, counts, within=""):
    """A body layer: a known kind, its options known and present (architecture._options), each
    of the type and range it takes.  Named as build_body names it; ``within``: the block it is
    part of, in messages."""
    from .architecture import LAYERS, _options  # (architecture imports this module: read when called)

    if not isinstance(spec, dict) or not isinstance(spec.get("layer"), str):
        raise CapsNetError(f"{within}body layer {k + 1} must be an object with a 'layer' name, got {_short(spec)}")
    kind = spec["layer"]
    if kind not in LAYERS:
        raise CapsNetError(f"{within}body layer {k + 1}: unknown layer {kind!r}; use one of {', '.join(LAYERS)}")
    name = spec.get("name")
    if name is not None and (not isinstance(name, str) or not name or "." in name):
        raise CapsNetError(f"{within}body layer {k + 1}: its name must be a non-empty string without '.', "
                           f"got {name!r}")
    counts[kind] = counts.get(kind, 0) + 1
    label = f"{within}layer '{name or f'{kind}{counts[kind]}'}' ({kind})"
    if kind == "residual":
        _options(LAYERS[kind], spec, label)
        return _check_branches(spec, label)
    if kind in ROUTED_LAYERS and "routing" in spec:  # checked first: which options belong depends on it
        problem = OPTIONS["routing"](spec["routing"])
        if problem:
            raise CapsNetError(f"{label}: routing must be {problem}, got {_short(spec['routing'])}")
    _options(LAYERS[kind], spec, label)
    own = routing_of(spec)
    for option, value in spec.items():
        if option in ("layer", "name"):
            continue
        if own is not None and option in own.options:  # the routing's own option: the type of its default
            problem = routings.option_problem(own, option, value)
        else:
            rule = OPTION_OF.get((spec["layer"], option), OPTIONS.get(option))
            problem = None if rule is None else rule(value)  # (no rule: _options refused the unknown ones)
        if problem:
            raise CapsNetError(f"{label}: {option} must be {problem}, got {_short(value)}")


def _check_branches(spec, label):
    """A residual block's body (a non-empty list of layers) and shortcut (null or one), each layer checked."""
    for branch in ("body", "shortcut"):
        layers = spec.get(branch)
        if layers is None and branch == "shortcut":
            continue
        if not isinstance(layers, list) or not layers:
            raise CapsNetError(f"{label}: {branch} must be a non-empty list of layers"
                               + (" or null (the identity)" if branch == "shortcut" else "") + f", got {_short(layers)}")
        counts = {}
        for k, inner in enumerate(layers):
            _check_layer(k, inner, counts, f"{label}, {branch}: ")


def routing_of(spec):
    """The Routing class a routed layer's spec runs (None for other layers, or a routing unknown:
    its check names it)."""
    if spec.get("layer") not in ROUTED_LAYERS:
        return None
    name = spec.get("routing", "dynamic")
    return routings.get(name) if isinstance(name, str) and name in routings.names() else None


def _check_loss(loss):
    if loss is None:
        return
    if not isinstance(loss, dict) or loss.get("loss") not in LOSS_OPTIONS:
        raise CapsNetError(f"loss must be an object with 'loss' one of {', '.join(LOSS_OPTIONS)}, got {_short(loss)}")
    rules = LOSS_OPTIONS[loss["loss"]]
    for option, value in loss.items():
        if option == "loss":
            continue
        if option not in rules:
            raise CapsNetError(f"the {loss['loss']} loss has no option {option!r}"
                               + (f"; it takes {', '.join(rules)}" if rules else "; it takes none"))
        problem = rules[option](value)
        if problem:
            raise CapsNetError(f"the {loss['loss']} loss: {option} must be {problem}, got {_short(value)}")


def _check_decoder(decoder):
    if decoder is None:
        return
    if not isinstance(decoder, dict):
        raise CapsNetError(f"decoder must be an object (hidden, weight) or null, got {_short(decoder)}")
    unknown = sorted(map(str, set(decoder) - set(DECODER)))
    if unknown:
        raise CapsNetError(f"the decoder has unknown key(s) {', '.join(unknown)}; it takes hidden and weight")
    hidden = decoder.get("hidden", [])
    if not isinstance(hidden, (list, tuple)) or any(SIZE(h) for h in hidden):
        raise CapsNetError(f"the decoder's hidden must be a list of whole numbers of at least 1, got {_short(hidden)}")
    problem = DECODER["weight"](decoder.get("weight", 0.0005))
    if problem:
        raise CapsNetError(f"the decoder's weight must be {problem}, got {_short(decoder.get('weight'))}")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def param_shapes(arch) -> dict:
    """Name -> shape of every parameter and buffer that ``arch`` (a checked, complete description) builds,
    from its sizes alone: nothing is allocated, so that a description or a checkpoint's header can
    be weighed against memory, or against the arrays a file holds, before anything is built.  The
    walk stops where a layer does not fit its input (building says why); tests hold it to what
    ``architecture.build`` makes."""
    c, h, w = arch["input_shape"]
    shapes = {}
    kind, grid, types, dim = _walk(arch["body"], ("image", (h, w), c, 1), shapes, "") or (None, (0,), 0, 0)
    decoder = arch.get("decoder")
    if decoder and kind in ("vector", "matrix") and grid is None:
        sizes = (arch["n_classes"] * (dim if kind == "vector" else 16), *decoder.get("hidden", ()), c * h * w)
        for k, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]), start=1):
            shapes.update({f"decoder{k}.W": (a, b), f"decoder{k}.b": (b,)})
    return shapes


def _walk(body, flow, shapes, prefix):
    """The flow (kind, grid, types, dim) that ``body`` emits from ``flow``, its parameters' shapes
    added to ``shapes`` under ``prefix``; None where a layer does not fit."""
    from .architecture import LAYERS  # (architecture imports this module: read when called)

    counts = {}
    for spec in body:
        layer = spec["layer"]
        counts[layer] = counts.get(layer, 0) + 1
        name = str(spec.get("name") or f"{layer}{counts[layer]}")
        o = {p.name: p.default for p in list(inspect.signature(LAYERS[layer]).parameters.values())[3:]
             if p.kind != p.VAR_KEYWORD}
        o.update({k: v for k, v in spec.items() if k not in ("layer", "name")})
        if layer == "residual":
            out = _walk(o["body"], flow, shapes, f"{prefix}{name}.body.")
            if o["shortcut"] is not None and out is not None:
                out = out if _walk(o["shortcut"], flow, shapes, f"{prefix}{name}.shortcut.") == out else None
            if out is None:
                return None
            flow = out
            continue
        step = _STEPS.get(layer)
        if step is None:  # relu, dropout: nothing learned, nothing reshaped
            continue
        found = step(o, *flow)
        if found is None or (found[1][1] is not None and min(found[1][1]) < 1):
            return None
        params, flow = found
        shapes.update({f"{prefix}{name}.{k}": tuple(int(d) for d in s) for k, s in params.items()})
    return flow


def _out(grid, k, s, p=0):
    return ((grid[0] + 2 * p - k) // s + 1, (grid[1] + 2 * p - k) // s + 1)


def _conv2d(o, kind, grid, t, d):
    k, ch = o["kernel"], o["channels"]
    return ({"W": (k, k, t, ch), "b": (ch,)}, ("image", _out(grid, k, o["stride"], o["padding"]), ch, 1)) \
        if kind == "image" else None


def _max_pool(o, kind, grid, t, d):
    return ({}, ("image", _out(grid, o["kernel"], o["stride"] or o["kernel"]), t, 1)) if kind == "image" else None


def _flatten(o, kind, grid, t, d):
    return ({}, ("flat", None, math.prod(grid or (1,)) * t * (1 if kind in ("image", "flat") else d), 1))


def _linear(o, kind, grid, t, d):
    f = o["features"]
    return ({"W": (t, f), "b": (f,)}, ("flat", None, f, 1)) if kind == "flat" else None


def _batch_norm(o, kind, grid, t, d):
    # gamma and beta are parameters; the running statistics are buffers, saved beside them
    return ({k: (t,) for k in ("gamma", "beta", "running_mean", "running_var")}, (kind, grid, t, d)) \
        if kind in ("image", "flat") else None


def _primary_caps(o, kind, grid, t, d):
    k, n = o["kernel"], o["types"] * o["dim"]
    if kind != "image" or (o["conv"] == "depthwise" and n != t):
        return None
    return ({"W": (k, k, t) if o["conv"] == "depthwise" else (k, k, t, n), "b": (n,)},
            ("vector", _out(grid, k, o["stride"]), o["types"], o["dim"]))


def _routed(o, kind, grid, t, d, attention=False):
    if kind != "vector":
        return None
    p = 1 if o["share_spatial"] else math.prod(grid or (1,))
    params = {"W": (p, t, o["capsules"], o["dim"], d)}
    if attention:  # β_ij on the coupling coefficients
        params["bias"] = (p, t, o["capsules"])
    elif o["bias"] is not None:  # β_j on s_j
        params["bias"] = (o["capsules"], o["dim"])
    if not attention:
        params.update(_routing_params(o, (p, t), o["capsules"], o["dim"], d))
    return params, ("vector", None, o["capsules"], o["dim"])


def _routing_params(o, lead, J, D, K):
    """A routing's own parameters (routings.py): its ``params`` with one child slot, laid out on ``lead``."""
    return routings.param_shapes(o.get("routing", "dynamic"), o, lead, J, D, K)


def _conv_caps(o, kind, grid, t, d):
    k = o["kernel"]
    if kind != "vector" or grid is None:
        return None
    params = {"W": (k * k * t, o["types"], o["dim"], d), **_routing_params(o, (k * k * t,), o["types"], o["dim"], d)}
    return params, ("vector", _out(grid, k, o["stride"]), o["types"], o["dim"])


def _capsule_logits(o, kind, grid, t, d):
    return ({"W": (d,), "b": (1,)}, ("flat", None, t, 1)) if kind == "vector" and grid is None else None


def _normalize(o, kind, grid, t, d):
    return ({}, (kind, grid, t, d)) if kind == "image" and len(o["mean"]) == len(o["std"]) == t else None


def _layer_norm(o, kind, grid, t, d):
    size = d if kind == "vector" else t
    return ({"gamma": (size,), "beta": (size,)}, (kind, grid, t, d)) if kind in ("vector", "image", "flat") else None


def _primary_matrix_caps(o, kind, grid, t, d):
    n = o["types"] * 17
    return ({"W": (t, n), "b": (n,)}, ("matrix", grid, o["types"], 16)) if kind == "image" else None


def _em(slots, n):
    return {"W": (slots, n, 4, 4), "beta_u": (n,), "lambda_beta_a": (n,)}


def _conv_matrix_caps(o, kind, grid, t, d):
    k = o["kernel"]
    return (_em(k * k * t, o["types"]), ("matrix", _out(grid, k, o["stride"]), o["types"], 16)) \
        if kind == "matrix" and grid is not None else None


def _class_matrix_caps(o, kind, grid, t, d):
    return (_em(t, o["capsules"]), ("matrix", None, o["capsules"], 16)) if kind == "matrix" and grid is not None else None


_STEPS = {"conv2d": _conv2d, "max_pool": _max_pool, "batch_norm": _batch_norm, "flatten": _flatten, "linear": _linear,
          "primary_caps": _primary_caps, "dynamic_caps": _routed,
          "attention_caps": lambda o, *flow: _routed(o, *flow, attention=True), "conv_caps": _conv_caps,
          "primary_matrix_caps": _primary_matrix_caps, "conv_matrix_caps": _conv_matrix_caps,
          "class_matrix_caps": _class_matrix_caps, "capsule_logits": _capsule_logits, "layer_norm": _layer_norm,
          "normalize": _normalize}


# Descriptions the package carries, by name (pycapsnet/networks/): ``--network efficient`` when no
# file of that name is at hand.  Efficient-CapsNet (Mazzia et al. 2021), its MNIST form, set as the
# paper's code sets it: batch norm with Keras' momentum (0.99 kept, 0.01 taken) and ε (1e-3), the
# routing transforms at He's std for their fan-in, √(2/1280) ≈ 0.04 (init.routed_std's 0.63 there
# saturates the attention scores: the network stayed at chance on the embedded digits).
# capsnet-published: the paper's CapsNet as its published code builds it (docs/published-code.md).
DESCRIBED = {"efficient": "efficient.json", "capsnet-published": "capsnet-published.json"}
DESCRIPTION_LIMIT = 16 << 20  # bytes: a description is a few KB; a larger file is not one (read no further)


def load(path) -> dict:
    """A description from a JSON file, or one of DESCRIBED by name; CapsNetError naming the file
    if it is not one."""
    if isinstance(path, str) and path in DESCRIBED and not os.path.exists(path):
        path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "networks", DESCRIBED[path])
    if not os.path.exists(path):
        raise CapsNetError(f"cannot read the network description {path}: no such file; give a JSON file or "
                           f"the name of one the package carries: {', '.join(DESCRIBED)}")
    text = read_regular(path, "the network description", DESCRIPTION_LIMIT, text=True)
    try:
        arch = json.loads(text)
    except ValueError as e:
        raise CapsNetError(f"the network description {path} is not JSON ({e})") from None
    except RecursionError:
        raise CapsNetError(f"the network description {path} nests deeper than any description does") from None
    if not isinstance(arch, dict) or not isinstance(arch.get("body"), list):
        raise CapsNetError(f"the network description {path} must be a JSON object with a 'body' list of layers "
                           "(docs/architecture.md, 'Describing a network')")
    return arch

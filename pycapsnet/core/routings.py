"""The registry of routings: every routing a vector capsule layer (ClassCaps, ConvCaps) can run, by
name, the built-in ones registered here through the same ``register`` a researcher's own goes
through (pycapsnet.routings; the contract is routing_contract.Routing).

    dynamic    Sabour et al. 2017 (routing.py)
    uniform    c_ij = 1/J, one pass: no routing at all (Paik, Kwak & Kim 2019's baseline; routing.py)
    random     c_ij drawn for every sample, one pass, held constant in backward (Paik et al.; routing.py)
    attention  self-attention routing, Mazzia et al. 2021 (attention_routing.py)
    inverted   inverted dot-product attention, Tsai et al. 2020 (inverted_routing.py)
    self       self-routing, Hahn et al. 2019 (self_routing.py)
    vb         variational Bayes routing, Ribeiro et al. 2020 (vb_routing.py)

EM routing (em_routing.py) routes matrix capsules, poses and activations, in layers of its own
(matrix_capsules.py): it is not a routing of vector capsule layers, and is not registered here.
Installed packages register theirs through the entry-point group ``pycapsnet.routings``, found
the first time the registry is read.
"""
from __future__ import annotations

import contextlib
import inspect
import math
import numbers
import os
import re
import sys
from importlib import metadata

import numpy as np

from . import attention_routing, inverted_routing, routing, self_routing, vb_routing
from .routing import MODES
from .routing_contract import Routing
from .. import errors
from ..errors import CapsNetError, printable as _shown  # a file's or a third party's text, as one line

DEFAULT_ITERS = 3
ENTRY_POINTS = "pycapsnet.routings"
_REGISTRY: dict = {}
_LOADING = [False]  # while an entry point's module is imported
_FROM_ENTRY_POINT: set = set()  # names an installed package's entry point registered (an explicit import replaces them)
_SKIPPED: set = set()  # names whose installed class was skipped for an explicit one (said once)
_discovered = False
# Options of the layers that route: a routing's own option may not take one of these names
LAYER_OPTIONS = {"layer", "name", "capsules", "types", "dim", "kernel", "stride", "iters", "routing_grad",
                 "share_spatial", "init_std", "bias", "routing"}
_METHODS = ("params", "forward", "backward", "coupling")
# Names that mean something else wherever a routing's name is read (build, --routing, the study's rows)
RESERVED = {"capsnet": "the paper's network (build)", "em": "matrix capsules with EM routing",
            "cnn": "the routing study's CNN baseline", "efficient": "Efficient-CapsNet (build, --network)",
            "capsnet-published": "the paper's network as its published code builds it (build, --network)"}


def register(cls):
    """Make ``cls.name`` a routing everywhere: descriptions, ``pycapsnet.build``, ``--routing``, the
    study tools, the routing study.  Usable as a class decorator; returns ``cls``.  A name already
    taken (by another class: the same one defined again replaces itself), or a class that does not
    meet the contract (routing_contract.Routing), is refused in one CapsNetError that says what to fix."""
    problem = _contract_problem(cls)
    if problem:
        raise CapsNetError(f"cannot register {getattr(cls, '__name__', cls)!r} as a routing: {problem}")
    taken = _REGISTRY.get(cls.name)
    again = taken is not None and (taken.__module__, taken.__qualname__) == (cls.__module__, cls.__qualname__)
    if taken is not None and not again and _LOADING[0] and not is_builtin(cls.name):
        # an installed package's module, imported for its entry point: the class registered explicitly stays
        _notice(f"routing {cls.name!r}: {cls.__module__}.{cls.__qualname__}, which an installed package registers, "
                f"is skipped: {taken.__module__}.{taken.__qualname__}, registered explicitly (an import, --plugin), "
                "stays")
        _SKIPPED.add(cls.name)
        return cls
    if taken is not None and not again and cls.name in _FROM_ENTRY_POINT:
        # the rule: a class registered explicitly (an import, --plugin) replaces an installed package's
        _notice(f"routing {cls.name!r}: {cls.__module__}.{cls.__qualname__}, registered here, replaces "
                f"{taken.__module__}.{taken.__qualname__}, which an installed package registered")
    elif taken is not None and not again:  # (the same class defined again -- a notebook's cell re-run -- replaces it)
        raise CapsNetError(f"cannot register {cls.__module__}.{cls.__qualname__} as routing {cls.name!r}: the name is "
                           f"taken by {taken.__module__}.{taken.__qualname__}; give it another name")
    _FROM_ENTRY_POINT.discard(cls.name)
    _REGISTRY[cls.name] = cls
    return cls


def _contract_problem(cls) -> str | None:
    if not (inspect.isclass(cls) and issubclass(cls, Routing)):
        return "a routing is a subclass of pycapsnet.routings.Routing"
    if not isinstance(cls.name, str) or not re.fullmatch(r"[a-z][a-z0-9_-]*", cls.name):
        return f"its name must be lower-case letters, digits, '-' or '_' (starting with a letter), got {cls.name!r}"
    if cls.name in RESERVED:
        return f"the name {cls.name!r} means {RESERVED[cls.name]} in pycapsnet; give it another name"
    if re.fullmatch(r".+-\d+", cls.name):
        return (f"a name ending in '-' and a number ({cls.name!r}) means a routing at that many iterations in the "
                "routing study; give it another name")
    for attr in ("iterated", "reads_children", "takes_bias", "draws", "routes_shared"):
        if not isinstance(getattr(cls, attr), bool):
            return f"{attr} must be True or False, got {getattr(cls, attr)!r}"
    if not isinstance(cls.modes, tuple) or "full" not in cls.modes or not set(cls.modes) <= set(MODES):
        return f"modes must be a tuple holding 'full' and optionally 'final', got {cls.modes!r}"
    if not isinstance(cls.per_child, tuple) or not all(isinstance(k, str) for k in cls.per_child):
        return f"per_child must be a tuple of parameter names, got {cls.per_child!r}"
    if not isinstance(cls.options, dict):
        return f"options must be a dict of option names and defaults, got {type(cls.options).__name__}"
    for k, v in cls.options.items():
        if not isinstance(k, str) or not k.isidentifier() or k in LAYER_OPTIONS:
            return f"option {k!r} must be a Python name that is not a layer's own option ({', '.join(sorted(LAYER_OPTIONS))})"
        if v is not None and not isinstance(v, (bool, numbers.Real, str)) or \
                isinstance(v, float) and not math.isfinite(v):
            return f"option {k}'s default must be a finite number, a bool, a string or None, got {v!r}"
    for method in _METHODS:
        if getattr(cls, method) is getattr(Routing, method) and method != "params":
            return f"it must define {method}() (routing_contract.Routing says what each takes and returns)"
        if not callable(getattr(cls, method)):
            return f"{method} must be a method"
    if not (isinstance(cls.head, tuple) and len(cls.head) == 2 and cls.head[0] in ("lengths", "logits")):
        return f"head must be (head, loss) with head 'lengths' or 'logits', got {cls.head!r}"
    return None


def get(name: str):
    """The Routing class registered as ``name``; CapsNetError naming the registered ones and how to
    add one."""
    _discover()
    cls = _REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None:
        raise CapsNetError(f"unknown routing {name!r}: registered are {', '.join(_REGISTRY)}; a routing of your own "
                           "is registered by the module that defines it (import it, or --plugin MODULE on the "
                           "command line)")
    return cls


def names() -> tuple:
    """Every registered routing's name, the built-in ones first."""
    _discover()
    return tuple(_REGISTRY)


def module_of(name: str) -> str:
    return get(name).__module__


def is_builtin(name: str) -> bool:
    cls = _REGISTRY.get(name)
    return cls is not None and cls.__module__.startswith("pycapsnet.")


def _discover() -> None:
    """Import the routings installed packages declare under the entry-point group (once).  Only
    installed distributions count: the current folder, which ``python -m``, ``python -c`` and a
    notebook put on sys.path, is not searched for them (a folder a user merely stands in must not
    run code), and the modules they name are imported from the installed path alone.  A plugin that
    fails to load, or names no Routing, is one line on stderr, and the others load."""
    global _discovered
    if _discovered:
        return
    _discovered = True

    with without_current_folder() as path:
        seen = set()
        for dist in metadata.distributions(path=path):
            try:
                name = (dist.metadata["Name"] or "") if dist.metadata is not None else ""
                eps = [ep for ep in dist.entry_points if ep.group == ENTRY_POINTS]
            except Exception as e:  # noqa: BLE001 - one broken installation's metadata: said, the others read
                _notice(f"an installed package's metadata could not be read for routing plugins "
                        f"({type(e).__name__}: {_shown(errors.first_line(e))}): its routings, if any, are not loaded")
                continue
            if name.lower() in seen:  # the first on the path, as Python imports it
                continue
            seen.add(name.lower())
            for ep in eps:
                _load_entry_point(ep, name)
    for dist in metadata.distributions(path=current_folder_entries() or [os.getcwd()]):
        try:  # (the folder's own metadata may be anything: it is only named, never loaded)
            what = f"{dist.metadata['Name']} {dist.version}" if any(ep.group == ENTRY_POINTS for ep in
                                                                     dist.entry_points) else None
        except Exception:  # noqa: BLE001
            what = "a package"
        if what:
            _notice(f"the routing entry points of {_shown(what)} in the current folder are not loaded: only installed "
                    "packages' are (install it, or import its module: --plugin MODULE)")


def _load_entry_point(ep, dist) -> None:
    before = dict(_REGISTRY)
    _LOADING[0] = True
    try:
        obj = ep.load()
        _FROM_ENTRY_POINT.update(n for n in _REGISTRY if _REGISTRY[n] is not before.get(n))  # its module's own
    except Exception as e:  # noqa: BLE001 - any failure of a third party's import
        _notice(f"the routing plugin {_shown(ep.name)} ({_shown(ep.value)}, from {_shown(dist)}) did not load: "
                f"{type(e).__name__}: {_shown(errors.first_line(e))}")
        return
    finally:
        _LOADING[0] = False
    if not (inspect.isclass(obj) and issubclass(obj, Routing)):
        if not inspect.ismodule(obj):  # a module registers its routings as it is imported
            _notice(f"the routing plugin {_shown(ep.name)} ({_shown(ep.value)}, from {_shown(dist)}) names "
                    f"{type(obj).__name__} {_shown(getattr(obj, '__name__', obj))}, not a Routing class: it is skipped")
        return
    taken = _REGISTRY.get(obj.name)
    if taken is obj or taken is not None and taken is before.get(obj.name) and obj.name in _SKIPPED:
        return
    if taken is not None:  # a built-in's name, or one a module registered explicitly: that one stays
        why = "the built-in name" if is_builtin(obj.name) else \
            f"the name of {taken.__module__}.{taken.__qualname__}, registered explicitly (an import, --plugin), which"
        _notice(f"the routing plugin {_shown(ep.name)} ({_shown(ep.value)}, from {_shown(dist)}) takes {why} "
                f"{obj.name!r}" + (" stays" if not is_builtin(obj.name) else "") + ": it is skipped")
        return
    try:
        register(obj)
        _FROM_ENTRY_POINT.add(obj.name)
    except CapsNetError as e:
        _notice(f"the routing plugin {_shown(ep.name)} ({_shown(ep.value)}, from {_shown(dist)}) is skipped: {e}")


def _notice(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr, flush=True)


def current_folder_entries() -> list:
    """The entries of sys.path that stand for the current folder ('' and its path)."""
    here = os.path.realpath(os.getcwd())
    return [p for p in sys.path if p in ("", ".") or os.path.realpath(p) == here]


@contextlib.contextmanager
def without_current_folder():
    """sys.path without the current folder while the block runs (yielded); restored after it, with
    what the block added."""
    here = current_folder_entries()
    saved = list(sys.path)
    sys.path[:] = [p for p in saved if p not in here]
    try:
        yield list(sys.path)
    finally:
        added = [p for p in sys.path if p not in saved]
        sys.path[:] = saved + added


# ---- options ------------------------------------------------------------------------------------
def option_problem(cls, option: str, value) -> str | None:
    """What is wrong with ``value`` for ``cls``'s option, by the type of its default: None if nothing."""
    default = cls.options[option]
    if value is None:
        return None
    if isinstance(default, bool):
        return None if isinstance(value, (bool, np.bool_)) else "true or false"
    if isinstance(default, str):
        return None if isinstance(value, str) else "a string"
    whole = isinstance(default, numbers.Integral)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
            or whole and not isinstance(value, numbers.Integral):
        return "a whole number" if whole else "a finite number"
    return None


def options_for(name: str, given: dict, dim: int) -> dict:
    """Routing ``name``'s options: the given ones over its defaults, each of its default's type, then
    its own check (``check_options``); ValueError naming an option that is another routing's or none's."""
    cls = get(name)
    own = cls.options
    stray = sorted(k for k, v in given.items() if v is not None and k not in own)
    if stray:
        owners = {k: r for r, c in _REGISTRY.items() for k in c.options}
        raise ValueError(", ".join(f"{k} is an option of routing '{owners[k]}'" if k in owners else
                                   f"{k} is no option of any routing" for k in stray)
                         + f", not of '{name}'" + (f" (its options: {', '.join(own)})" if own else " (it has none)"))
    values = {k: (given.get(k) if given.get(k) is not None else v) for k, v in own.items()}
    for k, v in values.items():
        problem = option_problem(cls, k, v)
        if problem:
            raise ValueError(f"routing '{name}': {k} must be {problem}, got {v!r}")
    checked = cls(1, "full", values).check_options(dict(values), dim)
    return values if checked is None else checked


# ---- a layer's routing ----------------------------------------------------------------------------
def set_routing(layer, name, iters, routing_grad, options, rng, lead):
    """A routed layer's routing: its name, iterations, gradient mode, the Routing and its
    parameters (``lead``: the leading axes of the per-child ones), and for one that draws, a
    seeded generator of its own.  ValueError (which the description names the layer in) for what
    it cannot run."""
    cls = get(name)
    if routing_grad not in MODES:
        raise ValueError(f"unknown routing gradient mode {routing_grad!r}: use one of {MODES}")
    if routing_grad not in cls.modes:
        raise ValueError(f"routing '{name}' has no gradient mode {routing_grad!r}: its coefficients are learned "
                         "from the child alone, so holding them constant would stop that; use 'full'"
                         if name == "self" else f"routing '{name}' implements the gradient modes {cls.modes} only")
    if iters is None:
        iters = DEFAULT_ITERS if cls.iterated else 1
    if iters < 1:
        raise ValueError(f"routing needs at least one iteration, got {iters}")
    if not cls.iterated and iters != 1:
        raise ValueError(f"routing '{name}' routes in one pass; it takes no iters (got {iters})")
    layer.routing, layer.iters, layer.routing_grad = name, iters, routing_grad
    layer.algo = cls(iters, routing_grad, options_for(name, options, layer.D))
    own = routing_params(layer.algo, lead, layer.J, layer.D, layer.K)
    clash = sorted(set(own) & set(layer.params))
    if clash:
        raise ValueError(f"routing '{name}' names a parameter {clash[0]!r}, which the layer has already: rename it")
    for k, v in own.items():
        layer._add_param(k, v)
    layer.routing_param_names = tuple(own)
    if cls.draws:
        layer.rng, layer.hold, layer.drawn = np.random.default_rng(int(rng.integers(2**63))), False, None
        layer.capturable = False  # new coefficients every step: a recorded step would replay the old


def routing_params(algo, lead, J, D, K) -> dict:
    """``algo.params(...)`` checked: host arrays, the per-child ones led by ``lead``."""
    try:
        found = algo.params(tuple(lead), J, D, K)
    except MemoryError:
        raise CapsNetError(f"routing '{algo.name}': params() ran out of memory making the parameters of a layer of "
                           f"{'x'.join(map(str, lead))} children and {J} capsules of {D} dimensions: make them "
                           "smaller (or the layer)") from None
    except CapsNetError:
        raise
    except Exception as e:
        raise CapsNetError(f"routing '{algo.name}' failed in its params ({type(e).__name__}: "
                           f"{_shown(errors.first_line(e))}); check it with `pycapsnet check-routing {algo.name}`") from e
    if not isinstance(found, dict):
        raise ValueError(f"routing '{algo.name}': params() must return a dict of arrays, got {type(found).__name__}")
    out = {}
    for k, v in found.items():
        a = np.asarray(v, dtype=np.float64)
        if not isinstance(k, str) or not k.isidentifier():
            raise ValueError(f"routing '{algo.name}': parameter names must be Python names, got {k!r}")
        if k in algo.per_child and tuple(a.shape[:len(lead)]) != tuple(lead):
            raise ValueError(f"routing '{algo.name}': per-child parameter {k} must start with the layer's leading "
                             f"axes {tuple(lead)}, got shape {a.shape}")
        if not np.isfinite(a).all():
            raise ValueError(f"routing '{algo.name}': parameter {k} starts with NaN or inf values")
        out[k] = a
    return out


def param_shapes(name, options, lead, J, D, K) -> dict:
    """The shapes of routing ``name``'s parameters in a layer, from a call of ``params`` with one
    child slot: nothing of the layer's size is allocated (descriptions.param_shapes)."""
    cls = get(name)
    unit = cls(1, "full", {**cls.options, **{k: v for k, v in options.items() if k in cls.options}})
    found = unit.params((1,) * len(lead), J, D, K)
    return {k: tuple(lead) + tuple(np.shape(v))[len(lead):] if k in cls.per_child else tuple(np.shape(v))
            for k, v in found.items()}


def draw_coupling(layer, n, children):
    """The coefficients of a drawing routing for a batch: drawn anew, or the last ones where the
    layer holds them (a gradient check perturbs the input under one draw, as Dropout's mask)."""
    if layer.hold and layer.drawn is not None and tuple(layer.drawn.shape) == (n, layer.J, children):
        return layer.drawn
    return layer.algo.draw(layer.B, layer.rng, n, layer.J, children)


# The built-in routings, through the same door as anyone's
for _cls in (routing.Dynamic, attention_routing.Attention, routing.Uniform, routing.Random, inverted_routing.Inverted,
             self_routing.SelfRouting, vb_routing.VB):
    register(_cls)
BUILT_IN = tuple(_REGISTRY)

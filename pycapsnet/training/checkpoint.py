"""Checkpoints: one ``.npz`` of host NumPy arrays -- parameters, optimizer state, and a JSON header
with the model configuration -- so a checkpoint written on one backend loads on any other.

Writes are atomic (``files.atomic_write``): an interruption (Ctrl-C, a kill, a crash, a full disk)
leaves the previous checkpoint intact.  Nothing non-finite is written, and ``load`` checks what it
reads, so that a damaged file is one message naming it, never a traceback from deep inside.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import sys
import zipfile

import numpy as np

from . import files
from .checkpoint_header import header_problem
from .log import say
from ..core import architecture, description, routing_source, routings
from ..core.model import param_shapes, CapsNet, CapsNetConfig
from ..core.network import Network
from ..errors import printable, CapsNetError
from ..userfiles import open_regular, refuse_special

FORMAT = "pycapsnet-checkpoint-1"


def save(path: str, model: Network, optimizer=None, **meta) -> str:
    """Write ``path`` (or ``path/checkpoint.npz`` when ``path`` is a directory, as ``load`` reads it),
    making missing parent directories; returns the file's path.  ``meta`` goes into the header
    (the trainer's: epoch, test_acc, recipe, history).  A parameter or optimizer state holding NaN
    or inf is refused: a checkpoint is something to go back to, and such a model is not one."""
    if os.path.isdir(path):
        path = os.path.join(path, "checkpoint.npz")
    refuse_special(path, "the checkpoint")  # a FIFO or a device node is not replaced by a file
    arrays = {f"param/{k}": v for k, v in model.state_dict().items()}
    if optimizer is not None:
        arrays.update({f"optim/{k}": v for k, v in optimizer.state_dict().items()})
    bad = next((k for k, v in arrays.items() if not np.isfinite(v).all()), None)
    if bad is not None:
        raise CapsNetError(f"refusing to write the checkpoint {path}: {bad} holds NaN or inf values "
                           "(the model has diverged; try a lower learning rate)")
    # A built-in network is recorded by its configuration (what its flags set), any other by its
    # description (architecture.py): either rebuilds it without the user's code.
    built = {"config": model.config.to_dict()} if isinstance(model, CapsNet) else {"architecture": model.architecture}
    header = {"format": FORMAT, **built, "backend": model.B.label,
              "optimizer": type(optimizer).__name__.lower() if optimizer is not None else None, **meta}
    generators = model.generator_state()  # Dropout's and random routing's: resuming draws on from here
    if generators:
        header["generators"] = generators
    own = routings_of(model)
    if own:  # routings of a plugin: loading names the module to import, and the source it ran
        header["routings"] = own
        header["routing_sources"] = routing_source.sources(own)
    header["digest"] = digest(header, {k[6:]: v for k, v in arrays.items() if k.startswith("param/")})
    arrays["header"] = np.array(json.dumps(header, allow_nan=False))  # strict JSON: no NaN
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        files.atomic_write(path, lambda f: np.savez(f, **arrays))
    except OSError as e:
        raise CapsNetError(f"cannot write the checkpoint {path}: {e.strerror or e}"
                           + ("; the one written there before is intact" if os.path.exists(path) else "")) from e
    return path


def routings_of(model: Network) -> dict:
    """{name: module} of each routing the model's layers run that is not pycapsnet's own."""
    used = {getattr(layer, "routing", None) for _, layer in model.routing_layers() if hasattr(layer, "algo")}
    return {name: routings.module_of(name) for name in sorted(used - {None}) if not routings.is_builtin(name)}


def _unregistered(header, path) -> None:
    """Refuse, before the header's network is read, a checkpoint whose routings are not registered
    here, naming the module that registers each."""
    own = header.get("routings") if isinstance(header, dict) else None
    if own is None:
        return
    if not (isinstance(own, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in own.items())):
        raise CapsNetError(f"{path} is damaged: its record of routings is not an object of names and modules")
    odd = next(((k, v) for k, v in own.items() if not all(p.isidentifier() for p in v.split("."))), None)
    if odd:
        raise CapsNetError(f"{path} is damaged: its record of routings names the module {printable(odd[1], 80)!s} for "
                           f"routing {printable(odd[0], 40)!s}, which is no Python module name")
    missing = {name: module for name, module in own.items() if name not in routings.names()}
    if missing:
        name, module = next(iter(missing.items()))
        name = printable(name, 40)
        raise CapsNetError(f"{path} was trained with routing '{name}' of module {module}, which is not registered "
                           f"here: {_how_to_register(module)}")
    recorded = header.get("routing_sources")
    for name, was, now in routing_source.differences(recorded if isinstance(recorded, dict) else {}):
        line = printable(routing_source.said(name, was, now), 400)
        if routing_source.strict():
            raise CapsNetError(f"{path}: {line}: its results may not be reproduced by this code; register the "
                               "version it was trained with, or load it without --strict (strict=False)")
        print(f"warning: {path}: {line}; its results may not be reproduced by this code (--strict refuses it)",
              file=sys.stderr, flush=True)


def _how_to_register(module: str) -> str:
    """What makes a plugin's routing registered: its module imported, or its package installed first."""
    top = module.split(".")[0]
    try:
        found = importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        found = False
    if found:
        return f"import {module} first (on the command line: --plugin {module})"
    return (f"no module {top} is installed here (the package that holds it was uninstalled, or never installed): "
            f"install it, or give its file with --plugin PATH/{top}.py")


def load(path: str) -> dict:
    """{'header': dict, 'params': {name: array}, 'optim': {name: array}, 'path': str}; CapsNetError
    naming the file and what is wrong if it is missing, not a pycapsnet checkpoint, damaged (a
    header that is not what ``save`` writes) or holds non-finite numbers."""
    if os.path.isdir(path):
        path = os.path.join(path, "checkpoint.npz")
    if not os.path.exists(path):
        raise CapsNetError(f"checkpoint not found: {path}")
    unreadable = f"{path} is not a readable pycapsnet checkpoint"
    # The zip signature is checked first: np.load takes any other file for a pickle, and would suggest
    # loading it unsafely.  np.load gets the open file, not the path: on a damaged archive it would
    # leave its own handle open.
    try:
        with open_regular(path, "the checkpoint") as f:
            if f.read(4) != b"PK\x03\x04":
                raise CapsNetError(f"{unreadable}: it is not an .npz archive (training writes one to RUN/checkpoint.npz)")
            f.seek(0)
            try:
                with np.load(f, allow_pickle=False) as z:
                    header, files_ = _read_checked(z, path, unreadable)
            except CapsNetError:  # a ValueError, already saying what is wrong
                raise
            except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
                raise CapsNetError(f"{unreadable}: a damaged or truncated .npz archive ({type(e).__name__}: {e})") from None
    except OSError as e:  # a directory named checkpoint.npz, no permission to read
        raise CapsNetError(f"cannot read the checkpoint {path}: {e.strerror or e}") from None
    params = {k[6:]: v for k, v in files_.items() if k.startswith("param/")}
    optim = {k[6:]: v for k, v in files_.items() if k.startswith("optim/")}
    for kind, arrays in (("parameter", params), ("optimizer state", optim)):
        for k, v in arrays.items():
            if v.dtype.kind not in "fiu":
                raise CapsNetError(f"{path} is damaged: {kind} {k} holds {v.dtype} values, not numbers")
            if not np.isfinite(v).all():
                raise CapsNetError(f"{path}: {kind} {k} holds NaN or inf values (saved after its run "
                                   "diverged); use an earlier checkpoint, or train afresh")
    if "digest" not in header:
        # Nothing binds this header to these weights: readable (evaluate, predict), never resumed.
        say(f"warning: {path} carries no digest binding its header to its weights (edited, or written before "
            "pycapsnet signed checkpoints): it is read unverified, and cannot be resumed")
    elif header["digest"] != digest(header, params):
        raise CapsNetError(f"{path} is damaged: its header and its weights disagree (the network, the recipe or "
                           "the weights changed after it was written); use another checkpoint, or train afresh")
    return {"header": header, "params": params, "optim": optim, "path": path, "unverified": "digest" not in header}


def digest(header: dict, params: dict) -> str:
    """SHA-256 binding a checkpoint's network (configuration or description) and recipe to its
    weights: an edit of either side alone (a layer removed, ``iters`` changed) no longer loads as
    if nothing had happened."""
    h = hashlib.sha256()
    network = {k: header.get(k) for k in ("config", "architecture", "recipe")}
    h.update(json.dumps(network, sort_keys=True).encode())  # (a damaged header may hold NaN: still a digest)
    for name in sorted(params):
        a = np.ascontiguousarray(params[name])
        h.update(f"{name} {a.dtype.str} {a.shape}".encode())
        h.update(memoryview(a).cast("B"))
    return h.hexdigest()


HEADER_LIMIT = 2**30  # bytes a header may declare (it holds the run's records: metrics, the data's files)


def _read_checked(z, path: str, unreadable: str):
    """(header, {member: array}) of an open .npz: the header read and checked first, then every
    other member's declared size checked against what the header's network holds before any of
    it is decompressed; a member no checkpoint of that network has is refused."""
    sizes = {info.filename[:-4] if info.filename.endswith(".npy") else info.filename: info.file_size
             for info in z.zip.infolist()}
    if "header" not in sizes:
        raise CapsNetError(f"{unreadable}: an .npz archive, but without the header pycapsnet writes "
                           f"(it holds {', '.join(sorted(sizes)[:5]) or 'no arrays'})")
    if sizes["header"] > HEADER_LIMIT:
        raise CapsNetError(f"{path} is damaged: its header declares {sizes['header']:,} bytes, more than a "
                           f"header holds ({HEADER_LIMIT:,} at most)")
    _check_npy_header(z, "header", sizes["header"], path)
    try:
        header = json.loads(str(z["header"]))
    except RecursionError:
        raise CapsNetError(f"{unreadable}: its header nests deeper than a header does") from None
    except ValueError as e:
        raise CapsNetError(f"{unreadable}: its header is not JSON ({e})") from None
    if isinstance(header, dict) and header.get("format") != FORMAT:
        raise CapsNetError(f"{path}: unknown checkpoint format {header.get('format')!r} (expected {FORMAT})")
    _unregistered(header, path)
    problem = header_problem(header)
    if problem:
        raise CapsNetError(f"{path} is damaged: {problem}; use another checkpoint, or train afresh")
    shapes = param_shapes_of(header, path)
    limits = _member_limits(shapes)
    for name, size in sizes.items():
        if name == "header":
            continue
        if name not in limits:
            raise CapsNetError(f"{path} is damaged: it holds a member {name!r} that no checkpoint of its network "
                               "has; use another checkpoint, or train afresh")
        if size > limits[name]:
            raise CapsNetError(f"{path} is damaged: its member {name!r} declares {size:,} bytes, but its network's "
                               f"array there holds at most {limits[name]:,}; use another checkpoint, or train afresh")
        shape = _check_npy_header(z, name, size, path)
        if name.startswith("param/") and shape != tuple(shapes[name[6:]]):
            raise CapsNetError(f"{path} is damaged: its parameter {name[6:]} is {shape}, but its header's network has "
                               f"{tuple(shapes[name[6:]])} there; use another checkpoint, or train afresh")
    return header, {k: z[k] for k in sizes if k != "header"}


def _check_npy_header(z, name, size, path):
    """The member's own .npy header, read alone: the array it declares must fit in the bytes the
    member holds (NumPy would allocate the declared size before reading a byte)."""
    with z.zip.open(name + ".npy") as m:
        try:
            version = np.lib.format.read_magic(m)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, _, dtype = read(m)
        except ValueError as e:
            raise CapsNetError(f"{path} is damaged: its member {name!r} has no readable array header ({e})") from None
    if dtype.hasobject or math.prod(shape) * dtype.itemsize > size:
        raise CapsNetError(f"{path} is damaged: its member {name!r} declares a {dtype} array of shape {shape}, more "
                           f"than its {size:,} bytes hold; use another checkpoint, or train afresh")
    return tuple(shape)


def param_shapes_of(header: dict, path: str) -> dict:
    """Name -> shape of the parameters of the header's network, from its arithmetic alone: nothing
    is built (a header edited to a huge layer is refused by its arrays' sizes, never allocated)."""
    if "config" in header:
        return param_shapes(CapsNetConfig(**header["config"]))
    try:
        description.check(header["architecture"])
        return description.param_shapes(header["architecture"])
    except CapsNetError as e:
        raise CapsNetError(f"{path}: its recorded network cannot be rebuilt: {e}") from None


def _member_limits(shapes: dict) -> dict:
    """Member name -> the most bytes it may declare: each parameter (name -> shape) and its
    optimizer slots in float64, with room for the .npy header; the optimizer's two scalars."""
    room = 1024
    limits = {f"param/{k}": 8 * int(np.prod(s)) + room for k, s in shapes.items()}
    for slot in ("m", "v", "buf", "average"):  # Adam's and SGD's slots, and --ema's averages (optim.py)
        limits.update({f"optim/{slot}/{k}": 8 * int(np.prod(s)) + room for k, s in shapes.items()})
    limits.update({"optim/step_count": room, "optim/lr": room, "optim/averaged": room})
    return limits


def config_of(ckpt: dict) -> CapsNetConfig | None:
    """The built-in network's configuration; None for a network built from a description."""
    return CapsNetConfig(**ckpt["header"]["config"]) if "config" in ckpt["header"] else None


def model_of(ckpt: dict, backend, **overrides) -> Network:
    """The checkpoint's network rebuilt on ``backend`` (weights not loaded): a CapsNet from its
    configuration (with ``overrides`` of its fields), any other from its recorded description."""
    cfg = config_of(ckpt)
    if cfg is not None:
        return CapsNet(backend, CapsNetConfig(**{**cfg.to_dict(), **overrides}) if overrides else cfg)
    if overrides:
        raise CapsNetError(f"{ckpt['path']} holds a network built from a description: "
                           f"{', '.join(overrides)} cannot be changed on it")
    try:
        return architecture.build(ckpt["header"]["architecture"], backend)
    except CapsNetError as e:
        raise CapsNetError(f"{ckpt['path']}: its recorded network cannot be rebuilt: {e}") from None


def restore_model(ckpt: dict, model: Network) -> None:
    """The checkpoint's weights into ``model``, and its layers' generators where it kept them;
    CapsNetError naming the file on a mismatch."""
    try:
        model.load_state_dict(ckpt["params"])
    except CapsNetError as e:
        raise CapsNetError(f"{ckpt['path']}: {e}") from None
    restore_generators(ckpt, model)


def restore_generators(ckpt: dict, model: Network) -> None:
    """The states of the generators the model's layers draw from (Dropout, random routing) as the
    checkpoint kept them, so that training goes on drawing what the run would have drawn; nothing
    for a checkpoint written before they were kept (the generators start from their seeds)."""
    states = ckpt["header"].get("generators")
    if states is None:
        return
    try:
        model.set_generator_state(states)
    except CapsNetError as e:
        raise CapsNetError(f"{ckpt['path']} is damaged: {e}; use another checkpoint, or train afresh") from None


def restore_optimizer(ckpt: dict, optimizer) -> None:
    """The checkpoint's optimizer state into ``optimizer``, whose kind the header names; a
    CapsNetError naming the file if the state is missing or does not fit the model."""
    try:
        optimizer.load_state_dict(ckpt["optim"])
    except CapsNetError as e:
        raise CapsNetError(f"{ckpt['path']} is damaged: its {ckpt['header']['optimizer']} state {e}; "
                           "use another checkpoint, or train afresh") from None


def load_model(path: str, backend, **overrides) -> tuple:
    """Build the checkpoint's architecture on ``backend`` and load its weights -> (model, ckpt)."""
    ckpt = load(path)
    model = model_of(ckpt, backend, **overrides)
    restore_model(ckpt, model)
    return model, ckpt

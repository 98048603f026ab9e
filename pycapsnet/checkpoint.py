"""Checkpoints: one ``.npz`` of host NumPy arrays -- parameters, optimizer state, and a JSON header
with the model configuration -- so a checkpoint written on one backend loads on any other.

Writes are atomic: the file is written to a temporary name in the same directory, flushed to disk,
then renamed over the old one (``os.replace``), so an interruption (Ctrl-C, a crash, a full disk)
leaves the previous checkpoint intact.
"""
from __future__ import annotations

import json
import os
import tempfile
import zipfile

import numpy as np

from .errors import CapsNetError
from .model import CapsNet, CapsNetConfig

FORMAT = "pycapsnet-checkpoint-1"


def save(path: str, model: CapsNet, optimizer=None, **meta) -> str:
    """Write ``path`` (or ``path/checkpoint.npz`` when ``path`` is a directory, as ``load`` reads it),
    making missing parent directories; returns the file's path."""
    if os.path.isdir(path):
        path = os.path.join(path, "checkpoint.npz")
    arrays = {f"param/{k}": v for k, v in model.state_dict().items()}
    if optimizer is not None:
        arrays.update({f"optim/{k}": v for k, v in optimizer.state_dict().items()})
    header = {"format": FORMAT, "config": model.config.to_dict(), "backend": model.B.label,
              "optimizer": type(optimizer).__name__.lower() if optimizer is not None else None, **meta}
    arrays["header"] = np.array(json.dumps(header))
    directory = os.path.dirname(os.path.abspath(path))
    tmp = None
    try:
        os.makedirs(directory, exist_ok=True)
        # written beside the target and renamed over it: a crash or a full disk leaves the last
        # checkpoint whole, never half a new one
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".npz", dir=directory)
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise CapsNetError(f"cannot write the checkpoint {path}: {e.strerror or e}"
                           + ("; the one written there before is intact" if os.path.exists(path) else "")) from e
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    return path


def load(path: str) -> dict:
    """{'header': dict, 'params': {name: array}, 'optim': {name: array}}; CapsNetError naming the
    file if it is missing, not a pycapsnet checkpoint, or corrupt."""
    if os.path.isdir(path):
        path = os.path.join(path, "checkpoint.npz")
    if not os.path.exists(path):
        raise CapsNetError(f"checkpoint not found: {path}")
    unreadable = f"{path} is not a readable pycapsnet checkpoint"
    # The zip signature is checked first: np.load takes any other file for a pickle, and would suggest
    # loading it unsafely.  np.load gets the open file, not the path: on a damaged archive it would
    # leave its own handle open.
    with open(path, "rb") as f:
        if f.read(4) != b"PK\x03\x04":
            raise CapsNetError(f"{unreadable}: it is not an .npz archive (training writes one to RUN/checkpoint.npz)")
        f.seek(0)
        try:
            with np.load(f, allow_pickle=False) as z:
                files = {k: z[k] for k in z.files}
        except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
            raise CapsNetError(f"{unreadable}: a damaged or truncated .npz archive ({type(e).__name__}: {e})") from None
    if "header" not in files:
        raise CapsNetError(f"{unreadable}: an .npz archive, but without the header pycapsnet writes "
                           f"(it holds {', '.join(sorted(files)[:5]) or 'no arrays'})")
    try:
        header = json.loads(str(files.pop("header")))
    except ValueError as e:
        raise CapsNetError(f"{unreadable}: its header is not JSON ({e})") from None
    if header.get("format") != FORMAT:
        raise CapsNetError(f"{path}: unknown checkpoint format {header.get('format')!r} (expected {FORMAT})")
    params = {k[6:]: v for k, v in files.items() if k.startswith("param/")}
    optim = {k[6:]: v for k, v in files.items() if k.startswith("optim/")}
    return {"header": header, "params": params, "optim": optim, "path": path}


def config_of(ckpt: dict) -> CapsNetConfig:
    return CapsNetConfig(**ckpt["header"]["config"])


def load_model(path: str, backend, **overrides) -> tuple:
    """Build the checkpoint's architecture on ``backend`` and load its weights -> (model, ckpt)."""
    ckpt = load(path)
    cfg = config_of(ckpt)
    if overrides:
        cfg = CapsNetConfig(**{**cfg.to_dict(), **overrides})
    model = CapsNet(backend, cfg)
    model.load_state_dict(ckpt["params"])
    return model, ckpt

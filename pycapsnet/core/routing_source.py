"""Where a routing's code came from, so that a result can be bound to the code that made it: for a
routing that is not built in, its module, its class, the installed distribution that holds the
module (name and version, where one does) and a digest of its source -- the module's file, or the
class's own source where the module has none (a notebook's cell), or its methods' compiled code
where neither is to be had.  Checkpoints, run directories, the routing study's units and results
record it (``sources``); a checkpoint whose routing's digest differs from the registered one's is
said in one line on load (``differences``)."""
from __future__ import annotations

import hashlib
import inspect
import marshal
import sys
from importlib import metadata

from .routings import get, is_builtin


STRICT = [False]  # --strict, load(strict=True): a checkpoint whose routing's source differs is refused, not warned of


def strict(on: bool | None = None) -> bool:
    """Whether a checkpoint whose routing's source differs from the registered one is refused; with
    ``on``, set it first."""
    if on is not None:
        STRICT[0] = bool(on)
    return STRICT[0]


def source_of(name: str) -> dict:
    """{"module", "class", "distribution" (or None), "digest"} of the routing registered as ``name``."""
    cls = get(name)
    return {"module": cls.__module__, "class": cls.__qualname__, "distribution": distribution_of(cls.__module__),
            "digest": digest_of(cls)}


def sources(names) -> dict:
    """{name: source_of(name)} for each of ``names`` that is not built in."""
    return {n: source_of(n) for n in sorted(set(names)) if n is not None and not is_builtin(n)}


def digest_of(cls) -> str:
    """A digest of the code of ``cls``: its module's source, else its own, else its methods' bytecode."""
    module = sys.modules.get(cls.__module__)
    for target in (module, cls):
        try:
            text = inspect.getsource(target)
        except (OSError, TypeError):
            continue
        return hashlib.sha256(text.encode()).hexdigest()[:16]
    h = hashlib.sha256()
    for attr in sorted(vars(cls)):
        code = getattr(vars(cls)[attr], "__code__", None)
        if code is not None:
            h.update(attr.encode() + marshal.dumps(code))
    return h.hexdigest()[:16]


def distribution_of(module: str) -> str | None:
    """"NAME VERSION" of the installed distribution that holds ``module``'s top-level package, or None."""
    top = module.split(".")[0]
    mapping = getattr(metadata, "packages_distributions", None)  # (Python 3.10 on; before: not said)
    try:
        names = (mapping() if mapping else {}).get(top) or []
    except Exception:  # noqa: BLE001 - metadata of a broken installation: no distribution to name
        return None
    for name in names:
        try:
            return f"{name} {metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return None


def differences(recorded: dict) -> list:
    """[(name, recorded source, registered source)] for each recorded routing, registered here, whose
    digest differs from the one recorded."""
    out = []
    for name, was in recorded.items():
        if not isinstance(was, dict) or not isinstance(was.get("digest"), str):
            continue
        try:
            now = source_of(name)
        except Exception:  # noqa: BLE001 - not registered: the caller refuses that on its own
            continue
        if now["digest"] != was["digest"]:
            out.append((name, was, now))
    return out


def said(name: str, was: dict, now: dict) -> str:
    """One line naming both versions of a routing."""
    def one(s):
        where = f"{s.get('module')}.{s.get('class')}" + (f", {s['distribution']}" if s.get("distribution") else "")
        return f"{where}, source {s.get('digest')}"
    return f"routing '{name}' was recorded as {one(was)}, but the one registered here is {one(now)}"

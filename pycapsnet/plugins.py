"""``--plugin MODULE``: the modules a command imports before it reads its other flags, so that the
routings they register (pycapsnet.routings.register) are choices of ``--routing`` and ``--routings``
and rebuild the checkpoints trained with them.  Every command and the three training scripts take
it, as many times as there are modules.  A MODULE is an importable name (``my_routing``, searched on
sys.path and in the current folder) or a path to a ``.py`` file."""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys

from .errors import CapsNetError, first_line

FLAG = "--plugin"
HELP = ("import MODULE first (a module name, or a .py file), for the routings it registers; repeatable "
        "(installed packages' routings, in the entry-point group pycapsnet.routings, need none)")


def add_flag(parser) -> None:
    parser.add_argument(FLAG, action="append", default=[], metavar="MODULE", help=HELP)


def named_in(argv) -> list:
    """The modules ``--plugin`` names in a command line (before argparse reads it)."""
    found, args = [], list(argv)
    for k, a in enumerate(args):
        if a == FLAG and k + 1 < len(args):
            found.append(args[k + 1])
        elif a.startswith(FLAG + "="):
            found.append(a[len(FLAG) + 1:])
    return found


def load(modules) -> list:
    """Import each module (a name or a .py file); CapsNetError in one line naming the one that
    does not import, and why."""
    loaded = []
    for name in modules:
        if not name:
            raise CapsNetError(f"{FLAG} needs a module: a name such as my_routing, or a .py file")
        loaded.append(_import(name))
    return loaded


def _import(name: str):
    try:
        if name.endswith(".py") or os.sep in name:
            path = os.path.abspath(name)
            if not os.path.isfile(path):
                raise CapsNetError(f"{FLAG} {name}: no such file")
            stem = os.path.splitext(os.path.basename(path))[0]
            if stem in sys.modules and getattr(sys.modules[stem], "__file__", None) == path:
                return sys.modules[stem]
            spec = importlib.util.spec_from_file_location(stem, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[stem] = module  # its classes then pickle and reload by this name
            try:
                spec.loader.exec_module(module)
            except BaseException:
                sys.modules.pop(stem, None)
                raise
            return module
        here = os.getcwd()
        added = here not in sys.path
        if added:
            sys.path.insert(0, here)  # a console script's path does not hold the current folder
        try:
            return importlib.import_module(name)
        finally:
            if added:
                sys.path.remove(here)
    except CapsNetError as e:
        if str(e).startswith(FLAG):
            raise
        raise CapsNetError(f"{FLAG} {name}: {e}") from None
    except Exception as e:  # noqa: BLE001 - whatever the module's own code raised
        raise CapsNetError(f"{FLAG} {name}: it did not import ({type(e).__name__}: {first_line(e)}); give a module "
                           "on the Python path or in the current folder, or a .py file") from None


def load_from_argv(argv) -> None:
    """``load`` of the modules ``--plugin`` names in ``argv`` (sys.argv[1:] when None)."""
    load(named_in(sys.argv[1:] if argv is None else argv))

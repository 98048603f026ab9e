"""``--plugin MODULE``: the modules a command imports before it reads its other flags, so that the
routings they register (pycapsnet.routings.register) are choices of ``--routing`` and ``--routings``
and rebuild the checkpoints trained with them.  Every command and the three training scripts take
it, as many times as there are modules.  A MODULE is an importable name (``my_routing``: an installed
module of that name first, as Python resolves it; the current folder only where none is) or a path to
a ``.py`` file (``./my_routing.py``: that file)."""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys

from .core import routing_source, routings
from .errors import CapsNetError, first_line, printable

FLAG = "--plugin"
HELP = ("import MODULE first (a module name, or a .py file), for the routings it registers; repeatable "
        "(installed packages' routings, in the entry-point group pycapsnet.routings, need none)")
STRICT = "--strict"


def add_flag(parser) -> None:
    parser.add_argument(FLAG, action="append", default=[], metavar="MODULE", help=HELP)
    parser.add_argument(STRICT, action="store_true", default=None,
                        help="refuse a checkpoint whose routing's source differs from the one registered here "
                             "(by default, one line of warning)")


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
        return _import_name(name)
    except CapsNetError as e:
        if str(e).startswith(FLAG):
            raise
        raise CapsNetError(f"{FLAG} {name}: {e}") from None
    except SystemExit as e:  # a module that ends the process as it is imported would end the command silently
        raise CapsNetError(f"{FLAG} {name}: it called sys.exit({printable(repr(e.code), 60)}) as it was imported; a "
                           "plugin module registers its routings and returns") from None
    except Exception as e:  # noqa: BLE001 - whatever the module's own code raised
        raise CapsNetError(f"{FLAG} {name}: it did not import ({type(e).__name__}: {first_line(e)}); give a module "
                           "on the Python path or in the current folder, or a .py file") from None


def _import_name(name: str):
    """A module name resolved as Python resolves it, the installed module first: the current folder
    is searched only where nothing installed has the name, and a file there of that name which the
    installed module wins over is said in one line (``./NAME.py`` imports that file)."""
    top = name.split(".")[0]
    with routings.without_current_folder():
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is None or not (name + ".").startswith(e.name + "."):  # the module's own import failed
                raise
            module = None
    here = os.getcwd()
    local = next((p for p in (os.path.join(here, top + ".py"), os.path.join(here, top)) if os.path.exists(p)), None)
    if module is None:
        sys.path.insert(0, here)  # a console script's path does not hold the current folder
        try:
            return importlib.import_module(name)
        finally:
            sys.path.remove(here)
    found = os.path.realpath(getattr(module, "__file__", None) or "")
    if local and not found.startswith(os.path.realpath(local)):
        print(f"warning: {FLAG} {name}: imported the installed {printable(found or name)}, not "
              f"{printable(os.path.relpath(local))} in the current folder (give ./{top}.py to import that file)",
              file=sys.stderr, flush=True)
    return module


def load_from_argv(argv) -> None:
    """``load`` of the modules ``--plugin`` names in ``argv`` (sys.argv[1:] when None), and --strict."""
    argv = sys.argv[1:] if argv is None else argv
    routing_source.strict(STRICT in argv)
    load(named_in(argv))

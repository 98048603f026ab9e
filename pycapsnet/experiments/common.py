"""What the experiments share: the memory check of the data set an experiment makes, and the
writing of its results (results.json, results.md, its figure), each file written whole."""
from __future__ import annotations

import json
import os

from pycapsnet.backends.host import machine_memory

from ..errors import CapsNetError
from ..training.files import atomic_write


def write_json(path: str, record) -> None:
    """``record`` as JSON at ``path``, written whole (files.atomic_write)."""
    atomic_write(path, lambda f: json.dump(record, f, indent=1), text=True)


def write_results(module, results, out) -> None:
    """results.json, results.md (and the module's figure, where it draws one), each written whole; a
    full disk or a folder gone is one line."""
    text = module.table(results)
    try:
        write_json(os.path.join(out, "results.json"), results)
        atomic_write(os.path.join(out, "results.md"), lambda f: f.write(text + "\n"), text=True)
        if hasattr(module, "FIGURE"):  # (the others draw theirs as they run)
            module.figure(results, os.path.join(out, module.FIGURE))
    except OSError as e:
        raise CapsNetError(f"cannot write the results into {out}: {e.strerror or e}; the units are kept in "
                           f"{os.path.join(out, 'units.json')}: free some space and run the same command again") from None
    print(text)


def check_fits(what: str, images: int, side: int, fix: str) -> None:
    """Refuse, before it is made, a data set of ``images`` float32 images of side x side that would
    not fit in this machine's memory, naming the flags that set it."""
    need, have = images * side * side * 4, machine_memory()
    if have and need > have // 2:
        raise CapsNetError(f"{what}: {images:,} images of {side}x{side} take {need / 2**30:.1f} GiB, more than half this "
                           f"machine's {have / 2**30:.1f} GiB; {fix}")

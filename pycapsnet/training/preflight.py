"""What a run is checked against before it trains or evaluates: the data it reads against what its
checkpoint recorded (``checked_data``), and a fresh network's parameters against the machine's
memory (``check_parameters_fit``)."""
from __future__ import annotations

import math

import numpy as np

from pycapsnet.backends.host import machine_memory

from . import data, folder
from .log import say
from .recipe import Run
from ..core.model import param_shapes, CapsNetConfig
from ..errors import CapsNetError
from ..tools.plan import format_bytes


def check_parameters_fit(cfg: CapsNetConfig, dtype: str) -> None:
    """Refuse, before allocating, a network whose parameters with their gradients and Adam's two
    moments (and the float64 draw that initialises the largest) exceed this machine's memory: the
    per-position transforms of large images grow with H x W."""
    shapes = param_shapes(cfg).values()
    n, largest = sum(math.prod(s) for s in shapes), max(math.prod(s) for s in shapes)
    need, have = 4 * n * np.dtype(dtype).itemsize + 8 * largest, machine_memory()
    if have and need > have:
        h, w = cfg.input_shape[1:]
        share = "" if cfg.routing == "em" or cfg.share_spatial else " or --share-spatial (one transform for all positions)"
        raise CapsNetError(f"the network for {h}x{w} images holds {n:,} parameters, {format_bytes(need)} with their "
                           f"gradients and Adam's moments, more than this machine's {format_bytes(have)}: give a "
                           f"smaller --image-size H W, a larger --conv-stride{share}")


def checked_data(run: Run, train_set, test_set) -> dict:
    """What the run reads, for its checkpoint: a folder's or the IDX files' fingerprint (folder.py)
    and the changes accepted so far.  A resumed or evaluated run whose data changed since its
    checkpoint recorded them is refused, saying what changed, unless ``accept_changed_data``; then
    the change is recorded.  The embedded digits are part of the package: nothing to record."""
    if train_set.files is not None:
        now = folder.fingerprint(train_set, test_set)
    elif run.data_dir:
        now = data.idx_fingerprint(run.data_dir, run.dataset)
    else:
        return {}
    header = run.checkpoint["header"] if run.checkpoint else {}
    before = header.get("data")
    accepted = list(header.get("data_changes") or [])
    same_source = (header.get("recipe") or {}).get("dataset") == run.dataset
    if before is None or not same_source:
        if run.checkpoint and same_source:
            say(f"{run.checkpoint['path']} does not record the images its run read (an earlier pycapsnet wrote "
                "it): they cannot be checked; from now on they are recorded")
        return {"data": now, "data_changes": accepted}
    changed = folder.changes(before, now)
    if changed and not run.accept_changed_data:
        doing = "evaluating" if run.eval_only else "resuming"
        raise CapsNetError(f"the images in {run.data_dir} are not those {run.checkpoint['path']} records: "
                           f"{'; '.join(changed)}. Restore them, train afresh with --out DIR, or go on "
                           f"{doing} with --accept-changed-data (the run records it)")
    if changed:
        say(f"--accept-changed-data: the images differ from the run's record: {'; '.join(changed)}")
        accepted.append({"epoch": header.get("epoch", 0), "changes": changed})
    return {"data": now, "data_changes": accepted}

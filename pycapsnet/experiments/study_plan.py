"""Seeds from a power plan: how many seeds a record needs to detect an effect, from a pilot record's
spread.  ``pycapsnet experiment routings --plan-seeds --pilot DIR --effect E`` (or ``plan(DIR, E)``)
reads the pilot's main units (and its MultiMNIST part's, as rows "multimnist:ROW" against that
part's baseline), takes each row's paired differences to the baseline over the pilot's seeds, and
gives, from their sample sd, the seeds a paired t-test at 5% needs for 80% and 90% power to detect
a difference of E points, and the smallest difference the pilot's own seeds detect with 80% power.
A record states its effect and seeds before it trains (its README, committed before the first main
unit), or the smallest effect its seeds can detect."""
from __future__ import annotations

import os
import re

import numpy as np

from ..errors import CapsNetError
from . import study_stats as st
from .study_multimnist import PREFIX
from .study_protocol import BASELINE
from .units import FILE, Units


def plan(pilot: str, effect: float) -> dict:
    """{"effect", "pilot", "baseline", "rows": {row: {"seeds", "sd", "seeds_80", "seeds_90",
    "detectable_80"}}} from the main units of the pilot folder ``pilot``."""
    if not (isinstance(effect, (int, float)) and not isinstance(effect, bool) and effect > 0):
        raise CapsNetError(f"--effect must be a difference in points above 0, such as 0.1, got {effect!r}")
    _, units, layout = Units.read(pilot)
    main_rows = set(layout.get("rows") or []) if isinstance(layout, dict) else set()  # the sweep's are not planned
    errors = {}
    for key, unit in units.items():
        m = re.fullmatch(r"(main|multimnist) (\S+) seed (\d+)", key)
        if m and isinstance(unit, dict) and isinstance(unit.get("test_error"), (int, float)) and \
                (not main_rows or m.group(2) in main_rows):
            row = m.group(2) if m.group(1) == "main" else f"{PREFIX}{m.group(2)}"
            errors.setdefault(row, {})[int(m.group(3))] = float(unit["test_error"])
    if not any(not r.startswith(PREFIX) for r in errors):
        raise CapsNetError(f"--pilot {pilot}: {os.path.join(pilot, FILE)} holds no main unit: give a finished record")
    baselines = {}  # the main table's baseline, and the MultiMNIST part's
    for part in ("", PREFIX):
        own = [r for r in errors if r.startswith(PREFIX) == bool(part)]
        if own:
            baselines[part] = part + BASELINE if part + BASELINE in errors else own[0]
    baseline = baselines[""]
    rows = {}
    for row, by_seed in errors.items():
        base = baselines[PREFIX if row.startswith(PREFIX) else ""]
        if row == base:
            continue
        seeds = sorted(set(by_seed) & set(errors[base]))
        if len(seeds) < 2:
            continue
        sd = float(np.std([by_seed[s] - errors[base][s] for s in seeds], ddof=1))
        rows[row] = {"seeds": len(seeds), "sd": sd, "seeds_80": st.seeds_for(sd, effect, 0.8) if sd else 2,
                     "seeds_90": st.seeds_for(sd, effect, 0.9) if sd else 2,
                     "detectable_80": st.detectable(sd, len(seeds)) if sd else 0.0}
    if not rows:
        raise CapsNetError(f"--pilot {pilot}: no row shares 2 or more seeds with {baseline}: a pilot needs them")
    return {"effect": effect, "pilot": pilot, "baseline": baseline, "rows": rows}


def table(planned: dict) -> str:
    lines = [f"Seeds for a paired t-test at 5% to detect {planned['effect']:g} points against {planned['baseline']} "
             f"(a {PREFIX}ROW against the MultiMNIST part's own {planned['baseline']}), from the pilot "
             f"{planned['pilot']} (the sd of each row's paired differences over its seeds):", "",
             "| row | pilot seeds | sd of differences | seeds for 80% | seeds for 90% | smallest effect the pilot's "
             "seeds detect (80%) |", "|---|---|---|---|---|---|"]
    for row, r in planned["rows"].items():
        lines.append(f"| {row} | {r['seeds']} | {r['sd']:.3f} | {r['seeds_80'] or '> 10,000'} | "
                     f"{r['seeds_90'] or '> 10,000'} | {r['detectable_80']:.3f} |")
    most = max((r["seeds_80"] or 10**9) for r in planned["rows"].values())
    lines += ["", f"For every row at 80% power: {most if most < 10**9 else 'more than 10,000'} seeds."]
    return "\n".join(lines)

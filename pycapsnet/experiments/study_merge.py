"""``experiment routings --merge DIR ... --out MERGED``: the units of several folders (shards,
machines) into one, read as evidence (study_units.check), with the table they make.  A merge refuses
folders of other settings, code, rows or seeds; two folders with different figures for one unit; a
main or affine unit that did not run its row's chosen trial under the merged tuning's choices; and a
units file already in --out that holds units it does not.  It writes choices.json for the shards'
next step: the choices made so far, and the rows whose tuning waits for another round."""
from __future__ import annotations

import os

from . import routing_study, study_report as report, study_tuning as tuning, study_units
from .common import write_json, write_results
from .units import FILE, Units
from ..errors import printable, CapsNetError
from ..training.log import say
from ..training.run_dir import lock, out_dir_for, unlock


def merge(args) -> int:
    """--merge DIR ...: every folder's units into --out (units.json, units.csv, choices.json, results);
    rows, seeds and the sweep are read off the units themselves.  --out is locked while it is written."""
    flags, units, layout, origin = _merged(args.merge)
    out = args.out or "experiments/routings-merged"
    with out_dir_for(out):
        held = lock(out)
        try:
            _refuse_other_units(out, flags, layout, units)
            tuned = routing_study.tuned_rows(flags, layout["rows"], layout["sweep"])
            if flags["fixed_lr"] is None:
                _refuse_other_choices(units, tuned, origin, flags)
            results = report.assemble(flags, units, layout["rows"], layout["sweep"], layout["seeds"],
                                      layout["sweep_seeds"], routing_study.routing_of, tuned)
            write_json(os.path.join(out, FILE), {"flags": flags, "layout": layout, "units": units})
            study_units.write_long_form(units, out)
            results.update(command="pycapsnet experiment routings --merge " + " ".join(args.merge), merged=list(args.merge))
            if flags["fixed_lr"] is None:  # the shards' next step: another round of tuning, or the main units
                write_json(os.path.join(out, "choices.json"), routing_study.choices_record(flags, tuned, units))
            write_results(routing_study, results, out)
        finally:
            unlock(out, held)
    say(f"merged {len(units)} units of {len(args.merge)} folder(s) into {out}")
    return 0


def _merged(dirs) -> tuple:
    """(flags, units, layout, {unit: the folder it came from}) of the folders, each file checked."""
    flags, units, layout, origin = None, {}, None, {}
    for d in dirs:
        f, u, lay = Units.read(d)
        study_units.check(os.path.join(d, FILE), f, u, lay)
        if flags is None:
            flags, first, layout = f, d, lay
        elif f != flags:
            what = sorted(k for k in set(f) | set(flags) if f.get(k) != flags.get(k))
            raise CapsNetError(f"--merge: {d}'s units were run with other {' and '.join(what)} than {first}'s "
                               "(settings or code differ): merge only the folders of one study")
        elif lay != layout:
            raise CapsNetError(f"--merge: {d} is a study of other rows or seeds than {first}: merge the shards of "
                               "one command")
        for key, value in u.items():
            if key in units and _figures(units[key]) != _figures(value):
                raise CapsNetError(f"--merge: {origin[key]} and {d} hold different figures for unit '{key}': a unit "
                                   "is trained once; merge the folders of one study's shards")
            units.setdefault(key, value)
            origin.setdefault(key, d)
    if layout is None:
        raise CapsNetError(f"--merge: {first} holds no routing study's units")
    return flags, units, layout, origin


# What a unit records of how long it took and on which BLAS kernels, and the digest that covers them: a
# unit trained twice (a stopped run's last unit run again by a shard) has the same figures, not the
# same timings
TIMING = ("step", "kernels", "digest")


def _figures(unit) -> dict:
    return {k: v for k, v in unit.items() if k not in TIMING} if isinstance(unit, dict) else unit


def _refuse_other_units(out, flags, layout, units) -> None:
    """A units file already in ``out`` is replaced only by a merge that holds all of it (the same study
    merged again): hours of units are never lost to a mistyped --out."""
    path = os.path.join(out, FILE)
    if not os.path.exists(path):
        return
    try:
        f, u, lay = Units.read(out)
    except CapsNetError:
        f = u = lay = None
    if not (f == flags and lay == layout and isinstance(u, dict) and all(units.get(k) == v for k, v in u.items())):
        raise CapsNetError(f"--merge: --out {out} holds {path}, units of another study or units the merged folders "
                           "do not hold: give another --out (or merge that folder too)")


def _refuse_other_choices(units, tuned, origin, flags) -> None:
    """Every main, affine and MultiMNIST unit ran its row's choice under the choices the merged tuning units make
    (each records its trial and the choices' digest; units recorded before that, neither)."""
    results = tuning.plan(tuned, routing_study.routing_of, units)[1]
    choices = {r: t["chosen"] for r, t in results.items() if t}
    digest = tuning.digest(choices) if len(choices) == len(tuned) else None
    for key, unit in units.items():
        kind, row = key.split(" ")[:2]
        if kind == "tune" or "trial" not in unit:
            continue
        chosen = routing_study.chosen_trial(choices, kind, row, flags)
        if unit["trial"] != chosen or unit.get("choices", digest) != digest:
            raise CapsNetError(f"--merge: {os.path.join(origin[key], FILE)}: unit '{key}' ran trial "
                               f"{printable(unit['trial'], 60)}" + (f", not {chosen}, which" if chosen != unit["trial"]
                                                                    else " under other choices than those")
                               + " the merged tuning units make: its figures are not this study's; train it again "
                               "with the merged choices.json")


"""A routing study's units file read as evidence, not on trust: before its units are merged or
reused, every one is checked to be what the study writes (its fields, their types and ranges), to
agree with itself (a main unit's test error is the share of the test digits its own record of wrong
digits marks) and, where it carries one, with its digest, which the study writes as the unit ends.
A file that fails is refused in one line that names it and the unit."""
from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import numbers
import os
import re

import numpy as np

from ..backends.host import blas_kernels
from ..errors import CapsNetError, printable
from ..training.files import atomic_write
from ..training.log import say
from . import study_stats

MAX_SEEDS = 10_000  # a layout beyond this is no study's: refused before anything is made for its seeds
KEY = re.compile(r"(tune (?P<trow>\S+) (?P<trial>\S+)|(?P<kind>main|affine|multimnist) (?P<row>\S+)) seed (?P<seed>\d+)")


def digest(unit: dict) -> str:
    """A digest of a unit's figures (the unit without its own digest), as JSON writes them."""
    body = {k: v for k, v in unit.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def sealed(unit: dict) -> dict:
    """The unit with the BLAS kernels it ran on (its figures' rounding depends on them) and its digest,
    as the study records it."""
    unit = {**unit, "kernels": blas_kernels()}
    return {**unit, "digest": digest(unit)}


def check(path: str, flags, units, layout=None) -> None:
    """Refuse, naming ``path``, a units file that is not what a routing study writes."""
    def refuse(what: str):
        raise CapsNetError(f"{path} is damaged or not a routing study's units file: {what}; give the folder the "
                           "study wrote, or run its units again")

    if not isinstance(flags, dict) or not isinstance(flags.get("data"), dict):
        refuse("its flags are not the study's settings")
    n_test = _get(flags, ("data", "test", "digits"))
    if not _whole(n_test, 1):
        refuse("its settings hold no count of test digits")
    problem = _settings_problem(flags)
    if problem:
        refuse(f"its settings' {problem}")
    if layout is not None:
        _check_layout(layout, refuse)
    if not isinstance(units, dict):
        refuse("its units are not an object of named units")
    for key, unit in units.items():
        m = KEY.fullmatch(key) if isinstance(key, str) else None
        if m is None:
            refuse(f"{printable(repr(key), 80)} is no unit's name")
        problem = "it is not an object" if not isinstance(unit, dict) else _unit_problem(
            "tune" if m.group("trial") else m.group("kind"), unit, n_test)
        if problem:
            refuse(f"unit '{printable(key, 80)}': {problem}")


def _settings_problem(flags: dict) -> str | None:
    """What of the settings the table is made from is not what the study writes."""
    lr, affine, margin, dataset = flags.get("fixed_lr"), flags.get("affine"), flags.get("margin"), flags["data"].get("dataset")
    if lr is not None and not _real(lr, 0, math.inf):
        return "fixed_lr is not a rate"
    if margin is not None and not _real(margin, 0, math.inf):
        return "margin is not a number of points"
    if dataset is not None and not (isinstance(dataset, str) and re.fullmatch(r"[a-z0-9_-]{1,40}", dataset)):
        return "dataset is not a dataset's name"
    if not all(_whole(s, 0) for s in flags.get("tune_seeds") or [None]):
        return "tuning seeds are not whole numbers"
    norm = flags.get("normalize")
    if norm is not None and not (isinstance(norm, dict) and all(isinstance(norm.get(k), list) and norm[k]
                                                                 and _numbers(norm[k]) for k in ("mean", "std"))):
        return "normalisation is not a mean and a deviation per channel"
    for part in ("train", "validation", "test"):
        record = flags["data"].get(part)
        if not (isinstance(record, dict) and _whole(record.get("digits"), 1) and isinstance(record.get("per_class"), list)
                and all(_whole(c, 0) for c in record["per_class"])):
            return f"{part} split is not counted"
    if not (_whole(flags.get("epochs"), 1) and _whole(flags.get("batch_size"), 1) and _real(flags.get("val_fraction"), 0, 1)):
        return "epochs, batch size or validation share is not a number"
    if not all(isinstance(flags.get(k), list) and flags[k] for k in ("lr_grid", "tune_seeds")):
        return "grid or tuning seeds are not lists"
    if affine is not None and not (isinstance(affine, dict) and _whole(affine.get("canvas"), 1)
                                   and _real(affine.get("target"), 0, 100)):
        return "affine part is not a canvas and a target"
    pairs = flags.get("multimnist")
    if pairs is not None and not (isinstance(pairs, dict) and all(_whole(pairs.get(k), 0) for k in
                                                                  ("shift", "canvas", "pairs", "val_seed", "test_seed"))
                                  and isinstance(pairs.get("decoder"), list) and all(_whole(h, 1) for h in pairs["decoder"])):
        return "MultiMNIST part is not a shift, canvas, pairs, decoder and seeds"
    return None


def _check_layout(layout, refuse) -> None:
    if not isinstance(layout, dict):
        refuse("its layout is not an object")
    rows, sweep = layout.get("rows"), layout.get("sweep")
    for name, value in (("rows", rows), ("sweep", sweep)):
        if not isinstance(value, list) or not all(isinstance(r, str) and KEY.fullmatch(f"main {r} seed 0")
                                                  for r in value):
            refuse(f"its layout's {name} are not a list of row names")
    if not rows:
        refuse("its layout names no row")
    for name in ("seeds", "sweep_seeds"):
        if not _whole(layout.get(name), 1, MAX_SEEDS):
            refuse(f"its layout's {name} is not a whole number from 1 to {MAX_SEEDS:,} "
                   f"(got {printable(repr(layout.get(name)), 40)})")


def _unit_problem(kind: str, unit: dict, n_test: int) -> str | None:
    if "digest" in unit and unit["digest"] != digest(unit):
        return "its figures do not match its digest (edited after it was recorded)"
    if not isinstance(unit.get("kernels", ""), str):
        return "its record of the BLAS kernels it ran on is not a text"
    if kind == "affine":
        for reading in ("last", "target"):
            r = unit.get(reading)
            if r is not None and not (isinstance(r, dict) and all(_real(r.get(t), 0, 100)
                                                                  for t in ("translated", "affine"))):
                return f"its {reading} reading is not a pair of accuracies in [0, 100]"
        return None
    val = unit.get("val")
    if not (isinstance(val, list) and val and all(_real(v, 0, 1) for v in val)):
        return "its validation accuracies are not a list of numbers in [0, 1]"
    if not (_real(unit.get("step"), 0, math.inf) and _whole(unit.get("params"), 1)):
        return "its step time or parameter count is not a number"
    if kind == "tune":
        return None
    if "trial" in unit and not isinstance(unit["trial"], str):
        return "its trial is not a trial's name"
    if not _real(unit.get("test_error"), 0, 100) or not isinstance(unit.get("wrong"), str):
        return "it holds no test error and record of wrong digits"
    try:
        wrong = study_stats.unpack(unit["wrong"], n_test)
    except ValueError:
        return "its record of wrong digits is not hexadecimal"
    if len(wrong) != n_test:
        return f"its record of wrong digits covers {len(wrong)} of the {n_test} test digits"
    if not math.isclose(unit["test_error"], 100 * float(np.mean(wrong)), abs_tol=1e-9):
        return (f"its test error {unit['test_error']:g}% is not what its own record of wrong digits says "
                f"({100 * float(np.mean(wrong)):g}%)")
    if kind == "multimnist":  # (no diagnostics: its test reading is of pairs)
        return None
    measures = unit.get("measures")
    if not isinstance(measures, dict) or not all(_numbers(measures.get(k)) for k in
                                                 ("entropy", "dynamics", "starved_children", "starved_parents")):
        return "its diagnostics are not numbers"
    own = measures.get("own") or {}
    if not (isinstance(own, dict) and all(isinstance(k, str) and isinstance(v, list) and _numbers(v)
                                          for k, v in own.items())):
        return "its routing's own measures are not lists of numbers"
    return None


def diverged(desc: str, e, val_acc: list, losses: list, params: int) -> dict:
    """A tuning trial whose loss became NaN or inf (loop.Diverged ``e``): recorded with validation
    accuracy 0 after the epoch it diverged in, its curves kept (NaN as None), and the study goes on."""
    say(f"{desc}: diverged in epoch {e.epoch + 1}; recorded with validation accuracy 0, its curves kept")
    return {"val": val_acc + [0.0], "loss": [x if math.isfinite(x) else None for x in losses], "step": e.step,
            "params": params, "diverged": e.epoch + 1}


def _get(d, path):
    for k in path:
        d = d.get(k) if isinstance(d, dict) else None
    return d


def _whole(v, least, most=math.inf) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool) and least <= v <= most


def _real(v, lo, hi) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v) and lo <= v <= hi


def _numbers(v) -> bool:
    """None, a finite number, or a list of them (a diagnostic per iteration)."""
    return v is None or _real(v, -math.inf, math.inf) or isinstance(v, list) and all(
        _real(x, -math.inf, math.inf) for x in v)


COLUMNS = ("unit", "kind", "row", "routing", "iterations", "trial", "lr", "options", "seed", "val_last", "test_error",
           "translated_last", "affine_last", "params", "step_s")


def long_form(units: dict) -> str:
    """The units as a long-form CSV (a unit a line; ``pandas.read_csv`` reads it as it is): the row,
    the routing and its iterations, the trial and its options, the seed, and what was measured."""
    out = io.StringIO()
    writer = csv.DictWriter(out, COLUMNS, lineterminator="\n")
    writer.writeheader()
    for key, unit in units.items():
        m = KEY.fullmatch(key)
        kind = "tune" if m.group("trial") else m.group("kind")
        row = m.group("trow") or m.group("row")
        routing, _, k = row.rpartition("-") if re.fullmatch(r".+-\d+", row) else (row, "", "")
        routing = routing.rpartition(":")[2]  # a part's tuned row: "affine:ROW", "multimnist:ROW"
        trial = m.group("trial") or unit.get("trial", "")
        parts = dict(p.split("=", 1) for p in trial.split(",") if "=" in p)
        writer.writerow({"unit": key, "kind": kind, "row": row, "routing": routing, "iterations": k, "trial": trial,
                         "lr": parts.pop("lr", ""), "options": json.dumps(parts) if parts else "",
                         "seed": m.group("seed"), "val_last": (unit.get("val") or [""])[-1],
                         "test_error": unit.get("test_error", ""),
                         "translated_last": (unit.get("last") or {}).get("translated", ""),
                         "affine_last": (unit.get("last") or {}).get("affine", ""),
                         "params": unit.get("params", ""), "step_s": unit.get("step", "")})
    return out.getvalue()


def write_long_form(units: dict, out: str) -> None:
    """units.csv beside units.json, written whole."""
    atomic_write(os.path.join(out, "units.csv"), lambda fh: fh.write(long_form(units)), text=True)

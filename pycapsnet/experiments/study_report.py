"""The routing study's results, made from its units alone (units.json: what each network measured),
so that the units of several shards, merged, give the table one run gives: the choices on
validation, each row's test error with its uncertainty, the paired tests against the baseline
row, the diagnostics per iteration, the iteration sweep, the affine reading and the MultiMNIST part."""
from __future__ import annotations

from collections import Counter

import numpy as np

from . import study_multimnist, study_stats as st, study_tuning as tuning
from .study_protocol import BASELINE


def assemble(settings, done, rows, sweep, seeds, sweep_seeds, routing_of, tuned) -> dict:
    """results.json's content, from the units alone (``routing_of``: a row's routing, for its grid;
    ``tuned``: every tuned row, the affine and MultiMNIST parts' too)."""
    fixed = settings["fixed_lr"] is not None
    tune = {} if fixed else {r: t for r, t in tuning.plan(tuned, routing_of, done)[1].items() if t}
    main, missing = rows_of(done, rows, seeds)
    sweep_done, sweep_missing = rows_of(done, sweep, min(sweep_seeds, seeds))
    baseline = BASELINE if BASELINE in rows else rows[0]
    n_test, margin = settings["data"]["test"]["digits"], settings.get("margin")
    pair_rows = [r for r in map(study_multimnist.row_of, tuned) if r is not None]
    pairs, pairs_missing = rows_of(done, pair_rows, seeds, "multimnist")
    pair_base = BASELINE if BASELINE in pair_rows else (pair_rows or [None])[0]
    dataset = settings["data"].get("dataset", "mnist")
    return {"protocol": declared(settings, baseline), "settings": settings, "data": settings["data"],
            "dataset": dataset, "seeds": seeds, "tuning": tune, dataset: main_rows(main, baseline, n_test, margin),
            "sweep": main_rows(sweep_done, None, n_test),
            "affine": affine_rows(done, rows, seeds) if settings["affine"] else None,
            "affine_canvas": (settings["affine"] or {}).get("canvas"),
            "multimnist": {"settings": settings["multimnist"], "baseline": pair_base, "test_pairs": n_test,
                           "rows": main_rows(pairs, pair_base, n_test, margin)} if settings.get("multimnist") else None,
            "kernels": kernels_of_units(done),
            "missing": missing + sweep_missing + pairs_missing,
            "complete": not (missing or sweep_missing or pairs_missing)}


def kernels_of_units(done: dict) -> dict:
    """{BLAS kernels: how many of the units ran on them}, of the units that record it."""
    counts = Counter(u["kernels"] for u in done.values() if isinstance(u, dict) and u.get("kernels"))
    return dict(sorted(counts.items()))


def declared(settings, baseline) -> dict:
    """The protocol as it ran, in one paragraph: what ran, and nothing that did not."""
    if settings["fixed_lr"] is None:
        tuned = (f"each row's lr from {settings['lr_grid']} (VB: every lr with vb_lambda "
                 f"{list(tuning.OPEN_OPTIONS['vb']['vb_lambda'])}), extended at an edge choice by x2 or /2 up to "
                 f"{settings['lr_limits']}, on {len(settings['tune_seeds'])} tuning seeds; the rule: {tuning.RULE}; "
                 "each sweep row tuned on its own" + _parts_tuned(settings))
    else:
        tuned = f"one lr for every row, {settings['fixed_lr']:g}, given (no tuning)"
    margin = settings.get("margin")
    return {"baseline": baseline, "affine_target": (settings["affine"] or {}).get("target"), "margin": margin,
            "summary": f"validation {settings['val_fraction']:g} of the training images (stratified); {tuned}; "
                       f"the test set read once, after the last epoch of each main unit; {settings['epochs']} epochs, "
                       f"batch {settings['batch_size']}, Adam decayed 0.85 per epoch; "
                       + ("random crops from a 4-pixel padding and horizontal flips"
                          if settings.get("augment") == "crop-flip" else "random shifts of up to 2 pixels")
                       + " for every row; "
                       + ("inputs normalised per channel with the training images' statistics; "
                          if settings.get("normalize") else "")
                       + (f"the ResNet-20 backbone (stages of {settings['backbone']['widths']} channels, "
                          f"{settings['backbone']['blocks']} blocks each, batch norm); "
                          if settings["backbone"].get("kind") == "resnet20" else "")
                       + "transforms at init.routed_std "
                       f"for every row; baseline {baseline}; "
                       + (f"equivalence margin ±{margin:g} points, declared before the run" if margin is not None
                          else "no equivalence margin declared")}


def _parts_tuned(settings) -> str:
    """", and each row of the affine (and MultiMNIST) part(s) on that part's validation data"."""
    parts = [name for name, on in (("affine", (settings.get("affine") or {}).get("tuned")),
                                   ("MultiMNIST", settings.get("multimnist"))) if on]
    if not parts:
        return ""
    return f", and each row of the {' and '.join(parts)} part{'s' if len(parts) > 1 else ''} on that part's validation data"


def rows_of(units: dict, rows, seeds, kind: str = "main") -> tuple:
    """({row: [its units of ``kind``, seed order]} for rows with every seed done, [missing unit keys])."""
    done, missing = {}, []
    for row in rows:
        keys = [f"{kind} {row} seed {s}" for s in range(seeds)]
        lost = [k for k in keys if k not in units]
        missing += lost
        if not lost:
            done[row] = [units[k] for k in keys]
    return done, missing


def main_rows(done: dict, baseline: str | None, n_test: int, margin: float | None = None, seed: int = 0,
              resamples: int = st.BOOTSTRAP) -> dict:
    """Per row: its test error (%, each seed with its Wilson interval; mean, sample sd, and the 95%
    bootstrap interval over seeds and test images, which stays within [0, 100]); against the
    baseline (same seeds and images) the primary comparison -- the paired difference with its 95%
    bootstrap interval and p -- beside the paired t-test, the TOST at ``margin`` (points, declared
    before the run; None: none), each Holm-adjusted over the rows compared, and the protocol's word;
    McNemar's counts per seed, a description."""
    out = {}
    wrong = {row: np.array([st.unpack(u["wrong"], n_test) for u in us]) for row, us in done.items()}
    base = done.get(baseline)
    for row, us in done.items():
        errors = [u["test_error"] for u in us]
        wilson = [[100 * b for b in st.wilson(round(e * n_test / 100), n_test)] for e in errors]
        own = st.bootstrap(wrong[row], np.zeros_like(wrong[row]), resamples, seed)
        r = {"params": us[0]["params"], "errors": errors, "wilson95": wilson, **st.spread(errors),
             "ci95": own["ci95"], "interval": "bootstrap over seeds and test images, 95% percentile",
             "measures": _measures(us) if all("measures" in u for u in us) else None}
        if base is not None and row != baseline:
            b_errors = [u["test_error"] for u in base]
            r["vs_baseline"] = {**st.bootstrap(wrong[row], wrong[baseline], resamples, seed),
                                "t": st.paired(errors, b_errors)}
            r["tost"] = st.tost(errors, b_errors, margin) if margin is not None else None
            r["mcnemar_per_seed"] = st.mcnemar_per_seed(wrong[row], wrong[baseline])
        out[row] = r
    compared = [row for row in out if "vs_baseline" in out[row]]
    for key, get in (("p_holm", lambda r: r["vs_baseline"]["p"]), ("t_holm", lambda r: r["vs_baseline"]["t"]["p"]),
                     ("tost_holm", lambda r: (r["tost"] or {}).get("p"))):
        for row, p in zip(compared, st.holm([get(out[row]) for row in compared])):
            out[row][key] = p
    for row in compared:
        r = out[row]
        r["word"] = st.word(r["vs_baseline"]["mean"], r["p_holm"], r["tost_holm"], margin)
    return out


def _measures(us) -> dict:
    """The diagnostics averaged over seeds (each iteration's entropy and dynamics, the starved shares,
    the routing's own measures)."""
    ms = [u["measures"] for u in us]
    mean = lambda k: None if any(m.get(k) is None for m in ms) else np.mean([m[k] for m in ms], axis=0).tolist()  # noqa: E731
    own = {k: np.mean([m["own"][k] for m in ms], axis=0).tolist() for k in (ms[0].get("own") or {})
           if all(k in (m.get("own") or {}) for m in ms)}
    return {k: mean(k) for k in ("entropy", "dynamics", "starved_children", "starved_parents")} | \
        {"own": own, "note": ms[0].get("note")}


def affine_rows(units: dict, rows, seeds) -> dict:
    """Per row: its translated and affine test accuracy at its last epoch and at the first epoch that
    reached the target (mean and sd over the seeds read, how many were read, and the t interval of
    the mean clipped to [0, 100]: an accuracy's, whose t interval over a few seeds can leave it)."""
    out = {}
    for row in rows:
        keys = [f"affine {row} seed {s}" for s in range(seeds)]
        if not all(k in units for k in keys):
            continue
        us = [units[k] for k in keys]
        r = {}
        for reading in ("last", "target"):
            for test in ("translated", "affine"):
                got = [u[reading][test] for u in us if u.get(reading)]
                spread = st.spread(got) if got else {"n": 0, "mean": None, "sd": None}
                if spread.get("ci95") and spread["ci95"][0] is not None:
                    spread["ci95"] = [max(0.0, spread["ci95"][0]), min(100.0, spread["ci95"][1])]
                r[f"{reading}_{test}"] = {**spread, "values": got}
        r["target_epoch"] = [u["target"]["epoch"] if u.get("target") else None for u in us]
        out[row] = r
    return out


def table(results) -> str:
    """results.md: the protocol's choices, the test errors and tests, the diagnostics, the sweep."""
    lines = [f"Protocol: {results['protocol']['summary']}", ""]
    if results.get("kernels"):
        lines += ["The units' matrix products ran on " + "; ".join(
            f"{k} ({n} unit{'s' if n > 1 else ''})" for k, n in results["kernels"].items()) + ".", ""]
    lines += _tuning_lines(results) + _main_lines(results) + _sweep_lines(results) + _affine_lines(results)
    lines += _multimnist_lines(results)
    missing = results.get("missing") or []
    if missing:
        lines += ["", f"Not yet run ({len(missing)} units): {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else "")]
    return "\n".join(lines)


def _tuning_lines(results) -> list:
    tune = results.get("tuning") or {}
    if not tune:
        return []
    lines = ["Tuning on validation: each trial's mean last-epoch accuracy % over the tuning seeds; the chosen "
             "trial's lead over the runner-up, paired over those seeds (± its standard error); where the grid "
             "was extended, and where a limit stopped it.", "",
             "| row | trials | chosen | lead (points) | grid |", "|---|---|---|---|---|"]
    lines += [f"| {row} | " + ", ".join(f"{n}: {100 * np.mean(a):.2f}" for n, a in t["trials"].items())
              + f" | {t['chosen']} | {_lead(t.get('lead'))} | {_grid(t)} |" for row, t in tune.items()]
    return lines + [""]


def _main_lines(results) -> list:
    main = rows_table(results)
    if not main:
        return []
    base, n, what = results["protocol"]["baseline"], results["data"]["test"]["digits"], noun(results)
    margin = results["protocol"].get("margin")
    lines = [f"Test error on {n:,} test {what}, {results['seeds']} seeds: mean ± sample sd [95% bootstrap interval "
             f"over seeds and test {what}]. Against {base}, on the same seeds and {what}: the paired difference "
             f"[95% bootstrap interval] and its bootstrap p, the paired t-test over seeds, and "
             + (f"the TOST at ±{margin:g} points (declared before the run)" if margin is not None else
                "no equivalence test (no margin declared)")
             + ", each Holm-adjusted over the rows; the word is the protocol's (better or worse by the bootstrap "
             "test, equivalent by the TOST, else inconclusive). McNemar b/c per seed (b: images the row gets "
             f"wrong and {base} right; c: the reverse) describe, not test. Entropy: Paik et al.'s, the coupling's "
             "entropy over parents / ln J; dynamics (this project's measure): mean total variation of each "
             "input's coupling from the mean coupling; starved: capsules never active on any test image.", "",
             "| row | params | test error % | Δ vs baseline (points) | bootstrap p (Holm) | paired t p (Holm) "
             "| TOST p (Holm) | word | McNemar b/c per seed | entropy / iteration | dynamics / iteration "
             "| starved children / parents | the routing's own measures / iteration |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row, r in main.items():
        lines.append(f"| {row} | {r['params']:,} | {_pm(r)} | {_delta(r)} | {_p(r, 'p', 'p_holm')} | "
                     f"{_p(r, 't', 't_holm')} | {_p(r, 'tost', 'tost_holm')} | {r.get('word', '(baseline)')} | "
                     f"{_mc(r)} | {_iters(r['measures']['entropy'])} | {_iters(r['measures']['dynamics'])} | "
                     f"{_share(r['measures']['starved_children'])} / {_share(r['measures']['starved_parents'])} | "
                     f"{_own(r['measures'].get('own'))} |")
    notes = sorted({r["measures"]["note"] for r in main.values() if r["measures"].get("note")})
    return lines + [""] + [f"Note: {note}." for note in notes]


def _sweep_lines(results) -> list:
    sweep = results.get("sweep") or {}
    if not sweep:
        return []
    return ["", "Iteration sweep (each routing's chosen trial, at k iterations; its default row above):", "",
            "| row | seeds | test error % | entropy / iteration | dynamics / iteration |", "|---|---|---|---|---|"] + [
        f"| {row} | {r['n']} | {_pm(r)} | {_iters(r['measures']['entropy'])} | "
        f"{_iters(r['measures']['dynamics'])} |" for row, r in sweep.items()]


def _affine_lines(results) -> list:
    aff = results.get("affine") or {}
    if not aff:
        return []
    canvas = results["affine_canvas"]
    lines = ["", f"Affine: trained on digits placed at random on a {canvas}x{canvas} canvas; test accuracy % "
             f"(mean ± sd over the seeds read) at the last epoch, and at the first epoch reaching "
             f"{results['protocol']['affine_target']}% translated validation accuracy (a number fixed before "
             "training); [the t interval of the mean over seeds, clipped to [0, 100]]. Each row trains at "
             + ("its own choice on translated validation digits (affine:ROW above)."
                if (results["settings"].get("affine") or {}).get("tuned") else "its main table's choice."), "",
             "| row | translated, last | affine, last | translated, at target | affine, at target (seeds read) |",
             "|---|---|---|---|---|"]
    return lines + [f"| {row} | {_pm(r['last_translated'])} | {_pm(r['last_affine'])} | "
                    f"{_pm(r['target_translated'])} | {_pm(r['target_affine'])} ({r['target_affine']['n']}) |"
                    for row, r in aff.items()]


def _multimnist_lines(results) -> list:
    """The MultiMNIST part's table: its rows' share of test pairs missed, against its baseline."""
    mm = results.get("multimnist") or {}
    rows, part = mm.get("rows") or {}, mm.get("settings") or {}
    if not rows:
        return []
    margin = results["protocol"].get("margin")
    lines = ["", f"MultiMNIST (Sabour et al. §6): every row with the paper's decoder ({part['decoder'][0]}-"
             f"{part['decoder'][1]}) and objective (margin loss with both classes present, each digit reconstructed), "
             f"trained on {part['pairs']} fresh pair(s) per training digit per epoch, each digit shifted by up to "
             f"{part['shift']} pixels on a {part['canvas']}x{part['canvas']} canvas; "
             + ("its rate chosen on validation pairs" if results["settings"]["fixed_lr"] is None else "the rate given")
             + f". Test pairs missed (a pair counts only where its two longest capsules are its two classes) of "
             f"{mm['test_pairs']:,}, one per test digit, {results['seeds']} seeds: mean ± sample sd [95% bootstrap "
             f"interval over seeds and pairs]. Against {mm['baseline']}, on the same seeds and pairs: the tests and "
             "words of the table above" + (f" (the TOST at ±{margin:g} points)" if margin is not None else "") + ".",
             "", "| row | params | test pairs missed % | Δ vs baseline (points) | bootstrap p (Holm) | paired t p (Holm) "
             "| TOST p (Holm) | word |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {row} | {r['params']:,} | {_pm(r)} | {_delta(r)} | {_p(r, 'p', 'p_holm')} | {_p(r, 't', 't_holm')} | "
              f"{_p(r, 'tost', 'tost_holm')} | {r.get('word', '(baseline)')} |" for row, r in rows.items()]
    return lines


def _pm(r) -> str:
    if not r or r.get("mean") is None:
        return "not read"
    sd = f" ± {r['sd']:.2f}" if r.get("sd") is not None else ""
    ci = r.get("ci95") or [None, None]
    return f"{r['mean']:.2f}{sd}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci[0] is not None else "")


def _lead(lead) -> str:
    if not lead:
        return ""
    return f"{lead['mean']:+.2f}" + (f" ± {lead['se']:.2f}" if lead.get("se") is not None else "") + f" over {lead['over']}"


def _grid(t) -> str:
    extended = ", ".join(f"{lr:g}" for lr in t.get("extended") or [])
    capped = f"capped at its {t['capped']} limit" if t.get("capped") else ""
    return "; ".join(x for x in (f"extended to {extended}" if extended else "", capped) if x) or "interior"


def _delta(r) -> str:
    d = r.get("vs_baseline")
    if not d:
        return "(baseline)" if r else ""
    ci = d["ci95"]
    return f"{d['mean']:+.2f}" + (f" [{ci[0]:+.2f}, {ci[1]:+.2f}]" if ci[0] is not None else "")


def _p(r, key, holm) -> str:
    d = r.get("vs_baseline") or {}
    d = d if key == "p" else (d.get(key) if key == "t" else r.get(key))
    if not d or d.get("p") is None or r.get(holm) is None:
        return ""
    return f"{d['p']:.3g} ({r[holm]:.3g})"


def _mc(r) -> str:
    per_seed = r.get("mcnemar_per_seed")
    return "" if not per_seed else ", ".join(f"{m['b']}/{m['c']}" for m in per_seed)


def rows_table(results) -> dict:
    """The main table of a results.json: keyed by its dataset's name (records before that: "mnist")."""
    return results.get(results.get("dataset", "mnist")) or {}


def noun(results) -> str:
    """What the images are called in the tables: digits where the data are digits."""
    return "digits" if results.get("dataset", "mnist") in ("mnist", "embedded", "digits") else "images"


def _own(own) -> str:
    return "; ".join(f"{k}: {_iters(v)}" for k, v in (own or {}).items())


def _iters(values) -> str:
    return "" if values is None else ", ".join(f"{v:.3f}" for v in values)


def _share(v) -> str:
    return "" if v is None else f"{100 * v:.1f}%"

"""The routing study's results, made from its units alone (units.json: what each network measured),
so that the units of several shards, merged, give the table one run gives: the choices on
validation, each row's test error with its uncertainty, the paired tests against the baseline
row, the diagnostics per iteration, the iteration sweep and the affine reading."""
from __future__ import annotations

import numpy as np

from . import study_stats as st
from .study_protocol import BASELINE, choose


def tuning(units: dict, rows, trials_of, tune_seeds) -> tuple:
    """({row: {"trials": {name: [val acc per tuning seed]}, "chosen": name, "val": mean}} for rows whose
    trials are all done, [rows still missing trials])."""
    chosen, missing = {}, []
    for row in rows:
        scores = {}
        for trial in trials_of(row):
            keys = [f"tune {row} {trial} seed {s}" for s in tune_seeds]
            if not all(k in units for k in keys):
                break
            scores[trial] = [units[k]["val"][-1] for k in keys]
        else:
            name, mean = choose(scores)
            chosen[row] = {"trials": scores, "chosen": name, "val": mean}
            continue
        missing.append(row)
    return chosen, missing


def rows_of(units: dict, rows, seeds) -> tuple:
    """({row: [its main units, seed order]} for rows with every seed done, [missing unit keys])."""
    done, missing = {}, []
    for row in rows:
        keys = [f"main {row} seed {s}" for s in range(seeds)]
        lost = [k for k in keys if k not in units]
        missing += lost
        if not lost:
            done[row] = [units[k] for k in keys]
    return done, missing


def mnist_rows(done: dict, baseline: str, n_test: int) -> dict:
    """Per row: its test error (%, each seed with its Wilson interval), mean, sample sd and t interval
    over seeds, and against the baseline (same seeds): the paired difference with its t interval and
    paired t-test, and McNemar's exact test on the discordant digits pooled over seeds; both Holm-
    adjusted over the rows compared."""
    out = {}
    base = done.get(baseline)
    for row, us in done.items():
        errors = [u["test_error"] for u in us]
        wilson = [[100 * b for b in st.wilson(round(e * n_test / 100), n_test)] for e in errors]
        r = {"params": us[0]["params"], "errors": errors, "wilson95": wilson, **st.spread(errors),
             "ms_per_step": 1e3 * float(np.median([u["step"] for u in us])), "measures": _measures(us)}
        if base is not None and row != baseline:
            r["vs_baseline"] = st.paired(errors, [u["test_error"] for u in base])
            b = c = 0
            for u, v in zip(us, base):
                db, dc = st.discordant(st.unpack(u["wrong"], n_test), st.unpack(v["wrong"], n_test))
                b, c = b + db, c + dc
            r["mcnemar"] = {"b": b, "c": c, "p": st.mcnemar(b, c)}
        out[row] = r
    compared = [row for row in out if "vs_baseline" in out[row]]
    for key, get in (("t_holm", lambda r: r["vs_baseline"]["p"]), ("mcnemar_holm", lambda r: r["mcnemar"]["p"])):
        for row, p in zip(compared, st.holm([get(out[row]) for row in compared])):
            out[row][key] = p
    return out


def _measures(us) -> dict:
    """The diagnostics averaged over seeds (each iteration's entropy and dynamics, the starved shares)."""
    ms = [u["measures"] for u in us]
    mean = lambda k: None if any(m.get(k) is None for m in ms) else np.mean([m[k] for m in ms], axis=0).tolist()  # noqa: E731
    return {k: mean(k) for k in ("entropy", "dynamics", "starved_children", "starved_parents")} | \
        {"note": ms[0].get("note")}


def affine_rows(units: dict, rows, seeds) -> dict:
    """Per row: its translated and affine test accuracy at its last epoch and at the first epoch that
    reached the target (mean and sd over the seeds read, how many were read)."""
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
                r[f"{reading}_{test}"] = {**(st.spread(got) if got else {"n": 0, "mean": None, "sd": None}),
                                          "values": got}
        r["target_epoch"] = [u["target"]["epoch"] if u.get("target") else None for u in us]
        out[row] = r
    return out


def table(results) -> str:
    """results.md: the protocol's choices, the test errors and tests, the diagnostics, the sweep."""
    lines = [f"Protocol: {results['protocol']['summary']}", ""]
    tune = results.get("tuning") or {}
    if tune:
        lines += ["| row | trials on validation (last-epoch accuracy %) | chosen |", "|---|---|---|"]
        lines += [f"| {row} | " + ", ".join(f"{n}: {100 * np.mean(a):.2f}" for n, a in t["trials"].items())
                  + f" | {t['chosen']} |" for row, t in tune.items()]
        lines.append("")
    mnist = results.get("mnist") or {}
    base, n = results["protocol"]["baseline"], results["data"]["test"]["digits"]
    if mnist:
        lines += [f"Test error on {n:,} test digits, {results['seeds']} seeds (mean ± sample sd, [t 95% CI of the "
                  f"mean]); against {base}, the same seeds: the paired difference [t 95% CI], the paired t-test "
                  f"and McNemar's exact test on the digits pooled over seeds (b: digits the row gets wrong and {base} "
                  "right; c: the reverse), each Holm-adjusted over the rows; ms/step as the units ran, not a "
                  "benchmark.", "",
                  "| row | params | test error % | Δ vs baseline (points) | paired t p (Holm) | McNemar b/c, p (Holm) "
                  "| entropy / iteration | dynamics / iteration | starved children | ms/step |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for row, r in mnist.items():
            lines.append(f"| {row} | {r['params']:,} | {_pm(r)} | {_delta(r)} | {_p(r, 'vs_baseline', 't_holm')} | "
                         f"{_mc(r)} | {_iters(r['measures']['entropy'])} | {_iters(r['measures']['dynamics'])} | "
                         f"{_share(r['measures']['starved_children'])} | {r['ms_per_step']:.0f} |")
        notes = sorted({r["measures"]["note"] for r in mnist.values() if r["measures"].get("note")})
        lines += [""] + [f"Note: {note}." for note in notes]
    sweep = results.get("sweep") or {}
    if sweep:
        lines += ["", "Iteration sweep (each routing's chosen trial, at k iterations; its default row above):", "",
                  "| row | seeds | test error % | entropy / iteration | dynamics / iteration |", "|---|---|---|---|---|"]
        lines += [f"| {row} | {r['n']} | {_pm(r)} | {_iters(r['measures']['entropy'])} | "
                  f"{_iters(r['measures']['dynamics'])} |" for row, r in sweep.items()]
    aff = results.get("affine") or {}
    if aff:
        lines += ["", f"Affine: trained on digits placed at random on a {results['affine_canvas']}x"
                  f"{results['affine_canvas']} canvas; test accuracy % (mean ± sd over the seeds read) at the last "
                  f"epoch, and at the first epoch reaching {results['protocol']['affine_target']}% translated "
                  "validation accuracy (a number fixed before training).", "",
                  "| row | translated, last | affine, last | translated, at target | affine, at target (seeds read) |",
                  "|---|---|---|---|---|"]
        for row, r in aff.items():
            lines.append(f"| {row} | {_pm(r['last_translated'])} | {_pm(r['last_affine'])} | "
                         f"{_pm(r['target_translated'])} | {_pm(r['target_affine'])} ({r['target_affine']['n']}) |")
    missing = results.get("missing") or []
    if missing:
        lines += ["", f"Not yet run ({len(missing)} units): {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else "")]
    return "\n".join(lines)


def _pm(r) -> str:
    if not r or r.get("mean") is None:
        return "not read"
    sd = f" ± {r['sd']:.2f}" if r.get("sd") is not None else ""
    ci = r.get("ci95") or [None, None]
    return f"{r['mean']:.2f}{sd}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci[0] is not None else "")


def _delta(r) -> str:
    d = r.get("vs_baseline")
    if not d:
        return "(baseline)" if r else ""
    ci = d["ci95"]
    return f"{d['mean']:+.2f}" + (f" [{ci[0]:+.2f}, {ci[1]:+.2f}]" if ci[0] is not None else "")


def _p(r, key, holm) -> str:
    d = r.get(key)
    if not d or d.get("p") is None:
        return ""
    return f"{d['p']:.3g} ({r[holm]:.3g})"


def _mc(r) -> str:
    m = r.get("mcnemar")
    return "" if not m else f"{m['b']}/{m['c']}, {m['p']:.3g} ({r['mcnemar_holm']:.3g})"


def _iters(values) -> str:
    return "" if values is None else ", ".join(f"{v:.3f}" for v in values)


def _share(v) -> str:
    return "" if v is None else f"{100 * v:.1f}%"


def figure(results, path) -> None:
    """Test error per row with its t interval and each seed; the difference from the baseline with
    its interval; entropy and dynamics per iteration; the iteration sweep."""
    from ..tools import plots

    plt = plots.pyplot()
    mnist = results.get("mnist") or {}
    if not mnist:
        return
    names = list(mnist)
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.8))
    a = axes[0]
    for k, n in enumerate(names):
        r = mnist[n]
        a.plot(r["errors"], [k] * len(r["errors"]), ".", color="0.6", ms=4)
        lo, hi = r["ci95"] if r["ci95"][0] is not None else (r["mean"], r["mean"])
        a.errorbar([r["mean"]], [k], xerr=[[r["mean"] - lo], [hi - r["mean"]]], fmt="o", color="C0", capsize=3)
    a.set_yticks(range(len(names)), names, fontsize=7), a.invert_yaxis()
    a.set_xlabel("test error %\n(mean, t 95% CI; grey: each seed)", fontsize=8)
    b = axes[1]
    for k, n in enumerate(names):
        d = mnist[n].get("vs_baseline")
        if d and d["ci95"][0] is not None:
            b.errorbar([d["mean"]], [k], xerr=[[d["mean"] - d["ci95"][0]], [d["ci95"][1] - d["mean"]]], fmt="o",
                       color="C3" if mnist[n]["t_holm"] < 0.05 else "C0", capsize=3)
    b.axvline(0, color="0.5", lw=0.8)
    b.set_yticks(range(len(names)), [""] * len(names)), b.invert_yaxis()
    b.set_xlabel(f"error − {results['protocol']['baseline']}'s (points)\n(paired, t 95% CI; red: Holm p < 0.05)", fontsize=8)
    for ax, key, label in ((axes[2], "entropy", "coupling entropy / ln J"), (axes[3], "dynamics", "dynamics (TV from the mean)")):
        for n in names:
            v = mnist[n]["measures"][key]
            if v:
                ax.plot(range(1, len(v) + 1), v, "o-", label=n, lw=1, ms=3)
        ax.set_xlabel("routing iteration", fontsize=8), ax.set_ylabel(label, fontsize=8)
    axes[2].set_ylim(0, 1.05), axes[2].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    plots.save(fig, path)

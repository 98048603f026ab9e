"""The routing study's figure: the answer at a glance, drawn from the results that ``study_report``
assembles (each row's difference from the baseline and its word, each row's errors, the
diagnostics per iteration, the iteration sweep, the MultiMNIST part, the routings' own measures)."""
from __future__ import annotations

from .study_report import noun, rows_table
from ..core.routings import DEFAULT_ITERS
from ..tools import plots

WORD_COLOURS = {"better": "C2", "worse": "C3", "equivalent": "C0", "inconclusive": "0.45"}


def figure(results, path) -> None:
    """The answer at a glance: each row's difference from the baseline with its bootstrap interval,
    coloured and labelled by the protocol's word (the margin shaded); each row's test error with its
    interval and every seed; coupling entropy and dynamics per iteration; the iteration sweep; the
    MultiMNIST part's differences from its baseline.  The caption says the seeds, the data and the
    test."""
    plt = plots.pyplot()
    main = rows_table(results)
    if not main:
        return
    base, margin, what = results["protocol"]["baseline"], results["protocol"].get("margin"), noun(results)
    sweep = results.get("sweep") or {}
    own = {(n, k): v for n in main for k, v in (main[n]["measures"].get("own") or {}).items()}
    pairs = (results.get("multimnist") or {}).get("rows") or {}
    panels = 4 + bool(sweep) + bool(own) + bool(pairs)
    fig, axes = plt.subplots(1, panels, figsize=(3.9 * panels, 4.4))
    _differences(axes[0], main, base, margin, "difference from the baseline", what)
    _each_row(axes[1], main)
    _per_iteration(axes[2], main, "entropy", "coupling entropy / ln J (Paik et al.)")
    _per_iteration(axes[3], main, "dynamics", "dynamics: TV from the mean coupling\n(this project's measure)")
    axes[2].set_ylim(0, 1.05)
    if pairs:
        _differences(axes[-1 - bool(own)], pairs, results["multimnist"]["baseline"], margin,
                     "MultiMNIST: difference from the baseline", "pairs", "test pairs missed")
    if own:
        _own_measures(axes[-1], own)
    if sweep:
        _sweep(axes[4], sweep, main, results["seeds"])
    n_test, n_train = results["data"]["test"]["digits"], results["data"]["train"]["digits"]
    fig.suptitle(f"{results.get('dataset', 'mnist')}: {n_train:,} training {what}, {n_test:,} test {what}, "
                 f"{results['seeds']} seeds" + (f" (this figure: seeds {results['figure_seeds']})"
                                                if results.get("figure_seeds") else ""), fontsize=9)
    fig.tight_layout()
    plots.save(fig, path)


def _each_row(a, main) -> None:
    """Each row's test error: every seed, and the mean with its 95% bootstrap interval."""
    for k, n in enumerate(main):
        r = main[n]
        a.plot(r["errors"], [k] * len(r["errors"]), ".", color="0.6", ms=4, label="a seed" if k == 0 else None)
        a.errorbar([r["mean"]], [k], xerr=[[r["mean"] - r["ci95"][0]], [r["ci95"][1] - r["mean"]]], fmt="o",
                   color="C0", capsize=3, label="mean, 95% bootstrap" if k == 0 else None)
    a.set_yticks(range(len(main)), list(main), fontsize=7), a.invert_yaxis()
    a.set_xlabel("test error %", fontsize=8), a.set_title("each row", fontsize=9), a.legend(fontsize=6)


def _per_iteration(ax, main, key, label) -> None:
    """One diagnostic (``key`` of each row's measures) against the routing iteration, a line a row."""
    from matplotlib.ticker import MaxNLocator

    for k, n in enumerate(main):
        v = main[n]["measures"][key]
        if v:
            ax.plot(range(1, len(v) + 1), v, marker="o", label=n, lw=1, ms=4 - 0.3 * (k % 4),
                    ls=("-", "--", ":", "-.")[k % 4])
    ax.set_xlabel("routing iteration", fontsize=8), ax.set_ylabel(label, fontsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True)), ax.legend(fontsize=6, ncol=2)


def _own_measures(o, own) -> None:
    """The routings' own measures (Routing.measures), each on its own line."""
    from matplotlib.ticker import MaxNLocator

    for (n, k), v in own.items():
        o.plot(range(1, len(v) + 1), v, marker="o", lw=1, ms=3, label=f"{n}: {k}")
    o.set_xlabel("routing iteration", fontsize=8), o.set_title("the routings' own measures", fontsize=9)
    o.xaxis.set_major_locator(MaxNLocator(integer=True)), o.legend(fontsize=6)


def _sweep(s, sweep, main, seeds) -> None:
    """Test error against the number of routing iterations, each routing's own row at its default k."""
    from matplotlib.ticker import MaxNLocator

    at = {**sweep, **{f"{n}-{DEFAULT_ITERS}": main[n] for n in main}}
    for routing in sorted({n.rsplit("-", 1)[0] for n in sweep}):
        ks = sorted((int(n.rsplit("-", 1)[1]), n) for n in at if n.rsplit("-", 1)[0] == routing)
        s.errorbar([k for k, _ in ks], [at[n]["mean"] for _, n in ks],
                   yerr=[[at[n]["mean"] - at[n]["ci95"][0] for _, n in ks],
                         [at[n]["ci95"][1] - at[n]["mean"] for _, n in ks]], fmt="o-", capsize=3, label=routing)
    s.margins(x=0.15)
    s.set_xlabel("routing iterations", fontsize=8), s.set_ylabel("test error % (95% bootstrap)", fontsize=8)
    s.xaxis.set_major_locator(MaxNLocator(integer=True)), s.legend(fontsize=6)
    s.set_title(f"iteration sweep ({min(seeds, max(r['n'] for r in sweep.values()))} seeds)", fontsize=9)


def _differences(d, rows, base, margin, title, what, measure="test error") -> None:
    """Each row's difference from ``base`` with its bootstrap interval, coloured and labelled by the
    protocol's word, the equivalence margin shaded, on the axes ``d``."""
    names = list(rows)
    if margin is not None:
        d.axvspan(-margin, margin, color="C0", alpha=0.12, label=f"±{margin:g} (equivalence margin)")
    for k, n in enumerate(names):
        v = rows[n].get("vs_baseline")
        if not v:
            continue
        d.errorbar([v["mean"]], [k], xerr=[[v["mean"] - v["ci95"][0]], [v["ci95"][1] - v["mean"]]], fmt="o",
                   color=WORD_COLOURS[rows[n]["word"]], capsize=3)
    d.axvline(0, color="0.5", lw=0.8)
    d.set_yticks(range(len(names)), [f"{n}: {rows[n].get('word', 'baseline')}" for n in names], fontsize=7)
    for label, n in zip(d.get_yticklabels(), names):
        label.set_color(WORD_COLOURS.get(rows[n].get("word"), "black"))
    d.set_ylim(len(names) - 0.5, -0.5 - 0.12 * len(names))  # room above the first row for the legend
    d.set_xlabel(f"{measure} − {base}'s (points)\n95% bootstrap over seeds and {what}", fontsize=8)
    d.set_title(title, fontsize=9)
    if margin is not None:
        d.legend(fontsize=6, loc="upper center")

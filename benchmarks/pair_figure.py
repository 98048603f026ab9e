"""Two records of the same training in one picture, e.g. its last weights and their average
(--ema): validation and test accuracy per epoch from ``--from`` on, each record's epoch chosen on
validation marked, and its test accuracy there said.

    python benchmarks/pair_figure.py docs/results/mnist-efficient-24 docs/results/mnist-efficient-24-ema \
        --labels "last weights" "averaged (--ema 0.9999)" --from 19 --out docs/results/mnist-efficient-24-ema/pair.png

Each record is a folder (or run directory) holding metrics.jsonl; it measures nothing.
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pycapsnet.tools.plots import pyplot, save  # noqa: E402
from pycapsnet.training.run_dir import best_epoch, read_metrics  # noqa: E402


def chosen(history: list, first: int) -> dict:
    """The record of the best validation accuracy among epochs >= first (the earliest of equals)."""
    rows = [r for r in history if r["epoch"] >= first and "val_acc" in r]
    if not rows:
        raise ValueError(f"no epoch from {first} on has a validation accuracy")
    epoch = best_epoch(rows)
    return next(r for r in rows if r["epoch"] == epoch)


def pair_figure(runs: dict, first: int, path: str) -> dict:
    """runs: {label: metrics records}.  Draws the picture at ``path``; returns {label: chosen record}."""
    plt = pyplot()
    fig, (ax_val, ax_test) = plt.subplots(1, 2, figsize=(9, 3.4), sharex=True)
    picks = {}
    for k, (label, history) in enumerate(runs.items()):
        rows = [r for r in history if r["epoch"] >= first and "val_acc" in r and "test_acc" in r]
        pick = picks[label] = chosen(history, first)
        epochs = [r["epoch"] for r in rows]
        for ax, key in ((ax_val, "val_acc"), (ax_test, "test_acc")):
            ax.plot(epochs, [100 * r[key] for r in rows], ".-", color=f"C{k}", lw=1, label=label)
            ax.plot([pick["epoch"]], [100 * pick[key]], "o", mfc="none", ms=9, color=f"C{k}")
        ax_test.annotate(f"{100 * pick['test_acc']:.2f}%", (pick["epoch"], 100 * pick["test_acc"]),
                         textcoords="offset points", xytext=(-6, -16) if k else (6, 6),
                         ha="right" if k else "left", fontsize=7, color=f"C{k}", zorder=5,
                         bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.85))
    for ax, what in ((ax_val, "validation"), (ax_test, "test")):
        ax.set_xlabel("epoch"), ax.set_ylabel(f"{what} accuracy (%)"), ax.grid(alpha=0.3)
    ax_val.set_title("circled: the epoch each chooses on validation", fontsize=8)
    ax_test.set_title("test accuracy there, read once", fontsize=8)
    ax_val.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    save(fig, path)
    return picks


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("records", nargs=2, help="two record folders or run directories, each with metrics.jsonl")
    p.add_argument("--labels", nargs=2, metavar=("A", "B"), help="their names in the picture (default: the folders')")
    p.add_argument("--from", dest="first", type=int, default=1, help="the first epoch drawn and chosen from")
    p.add_argument("--out", required=True, help="the PNG to write")
    args = p.parse_args(argv)
    labels = args.labels or [os.path.basename(os.path.normpath(r)) for r in args.records]
    runs = {}
    for label, folder in zip(labels, args.records):
        history = read_metrics(os.path.join(folder, "metrics.jsonl"))
        if not history:
            p.error(f"{folder} holds no metrics.jsonl records")
        runs[label] = history
    try:
        picks = pair_figure(runs, args.first, args.out)
    except ValueError as e:
        p.error(str(e))
    for label, r in picks.items():
        print(f"{label}: epoch {r['epoch']} chosen on validation ({100 * r['val_acc']:.2f}%), "
              f"test {100 * r['test_acc']:.2f}%")
    print(f"picture: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

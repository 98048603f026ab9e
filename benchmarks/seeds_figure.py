"""Several runs of one command (seeds) in one picture: each run's test accuracy per epoch, the
epoch fixed in advance for reporting, the target, and the runs' mean error at that epoch.

    python benchmarks/seeds_figure.py docs/results/mnist-efficient-aug-all{,-seed1,-seed2} \
        --epoch 37 --target 99.70 --out docs/results/mnist-efficient-aug-all-seed2/seeds.png

Each argument is a record folder (or run directory) holding metrics.jsonl; it measures nothing.
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pycapsnet.tools.plots import pyplot, save  # noqa: E402
from pycapsnet.training.run_dir import read_metrics  # noqa: E402


def seeds_figure(runs: dict, epoch: int, target: float | None, path: str) -> float:
    """runs: {label: metrics records}.  Draws the picture at ``path``; returns the mean test
    error (%) of the runs at ``epoch``."""
    missing = [label for label, history in runs.items()
               if not any(r["epoch"] == epoch and r.get("test_acc") is not None for r in history)]
    if missing:
        raise ValueError(f"{', '.join(missing)} has no test accuracy at epoch {epoch}")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.4))
    at, top = [], 0.0
    for label, history in runs.items():
        rows = [r for r in history if r.get("test_acc") is not None]
        ax.plot([r["epoch"] for r in rows], [100 * r["test_acc"] for r in rows], ".-", lw=1, label=label)
        at += [100 * r["test_acc"] for r in rows if r["epoch"] == epoch]
        top = max([top] + [100 * r["test_acc"] for r in rows])
    mean_error = 100 - sum(at) / len(at)
    ax.axvline(epoch, color="0.4", ls=":", lw=1)
    ax.plot([epoch] * len(at), at, "kx", label=f"epoch {epoch}: mean error {mean_error:.3f}%")
    if target is not None:
        ax.axhline(target, color="C3", ls="--", lw=1, label=f"target {target:.2f}%")
    low = min(at + ([target] if target is not None else [])) - 0.4
    ax.set_ylim(low, min(100.0, top + 0.05))
    ax.set_xlabel("epoch"), ax.set_ylabel("test accuracy (%)"), ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    save(fig, path)
    return mean_error


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("records", nargs="+", help="record folders or run directories, each with metrics.jsonl")
    p.add_argument("--epoch", type=int, required=True, help="the epoch fixed in advance for reporting")
    p.add_argument("--target", type=float, default=None, help="the target test accuracy, in percent")
    p.add_argument("--out", required=True, help="the PNG to write")
    args = p.parse_args(argv)
    runs = {}
    for folder in args.records:
        path = os.path.join(folder, "metrics.jsonl")
        if not os.path.isfile(path):
            p.error(f"{path} does not exist: give record folders or run directories")
        runs[os.path.basename(os.path.normpath(folder))] = read_metrics(path)
    try:
        mean_error = seeds_figure(runs, args.epoch, args.target, args.out)
    except ValueError as e:
        p.error(str(e))
    print(f"mean test error at epoch {args.epoch}: {mean_error:.3f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Two readings of every recorded run: the epoch validation chooses, and the best test epoch.

    python benchmarks/readings.py                      # every record under docs/results/
    python benchmarks/readings.py docs/results/mnist-capsnet-recon-60

Per record (a folder holding metrics.jsonl, or one level further down, as mnist-capsnet-h200's
four settings): its epochs, the earliest epoch of the highest validation accuracy and the test
error there (the way every figure pycapsnet reports is read), and the lowest test error of any
epoch (the way Efficient-CapsNet's public code keeps its weights). The second reading chooses on the test
digits: it is there to set our runs beside published figures read that way, never as a result.
It measures nothing.
"""
from __future__ import annotations

import argparse
import glob
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pycapsnet.training.run_dir import best_epoch, read_metrics  # noqa: E402


def readings(history: list) -> dict:
    """epochs; validation's choice (epoch, test error %) or None; the best test epoch (epoch, error %)."""
    tested = [r for r in history if "test_acc" in r]
    if not tested:
        raise ValueError("no epoch has a test accuracy")
    best_test = max(tested, key=lambda r: (r["test_acc"], -r["epoch"]))
    chosen = best_epoch(tested)
    by_epoch = {r["epoch"]: r for r in tested}
    error = lambda r: round(100 * (1 - r["test_acc"]), 4)  # noqa: E731
    return {"epochs": len(history),
            "validation": None if chosen is None else (chosen, error(by_epoch[chosen])),
            "best_test": (best_test["epoch"], error(best_test))}


def records(paths: list) -> list:
    """The folders holding a metrics.jsonl: each path given, or the folders just below it."""
    found = []
    for path in paths:
        if os.path.isfile(os.path.join(path, "metrics.jsonl")):
            found.append(path)
        else:
            found += sorted(os.path.dirname(m) for m in glob.glob(os.path.join(path, "*", "metrics.jsonl")))
    return found


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("records", nargs="*", help="record folders (default: every one under docs/results)")
    args = p.parse_args(argv)
    paths = args.records or sorted(glob.glob(os.path.join(ROOT, "docs", "results", "*")))
    found = records(paths)
    if not found:
        p.error(f"no metrics.jsonl in {' '.join(paths)} or the folders just below")
    print("| record | epochs | validation's epoch | its test error | best test epoch | its test error |")
    print("|---|---|---|---|---|---|")
    for folder in found:
        try:
            r = readings(read_metrics(os.path.join(folder, "metrics.jsonl")))
        except ValueError as e:
            p.error(f"{folder}: {e}")
        v = ("none (no validation)", "") if r["validation"] is None else (r["validation"][0], f"{r['validation'][1]:.2f}%")
        name = os.path.relpath(folder, os.path.join(ROOT, "docs", "results"))
        print(f"| {name} | {r['epochs']} | {v[0]} | {v[1]} | {r['best_test'][0]} | {r['best_test'][1]:.2f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

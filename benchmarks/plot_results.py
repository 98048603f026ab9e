"""The benchmark's JSON as one picture: train throughput of each implementation against autograd
and against the GEMM floor, and, when the run had ``--scaling``, how throughput and memory grow.

    python benchmarks/plot_results.py                                   # benchmarks/results.json -> docs/benchmark.png
    python benchmarks/plot_results.py benchmarks/results-h100-batch64.json --out h100.png

It reads a JSON that ``benchmarks/bench.py`` wrote; it measures nothing itself.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from pycapsnet.training.argtypes import writable_file
from pycapsnet.tools.plots import pyplot  # noqa: E402  (matplotlib with the Agg backend: no display needed)


class NotAResult(ValueError):
    """The file is missing, not JSON, or not what bench.py writes."""


def load(path: str) -> dict:
    """The bench JSON at ``path``; NotAResult saying what is wrong with it."""
    try:
        with open(path) as f:
            results = json.load(f)
    except FileNotFoundError:
        raise NotAResult(f"{path} does not exist; write one with python benchmarks/bench.py --json {path}") from None
    except (OSError, ValueError) as e:
        raise NotAResult(f"cannot read {path} as JSON ({e})") from None
    if not isinstance(results, dict) or not isinstance(results.get("main"), list):
        raise NotAResult(f"{path} is not a benchmarks/bench.py result (it has no 'main' list)")
    if not any("error" not in r for r in results["main"]):
        if results.get("complete") is False:
            raise NotAResult(f"{path} is from a run that stopped before its first implementation was "
                             "finished (the rounds it measured are under 'rounds_so_far'); run it again "
                             "with a longer time limit, or fewer --rounds or --steps")
        raise NotAResult(f"{path} holds no measured implementation (every one was skipped)")
    return results


def _throughput_panel(ax, results):
    """One bar per implementation: train samples/s, labelled with its ratio to autograd, and two
    ticks per bar at the rates that matrix products alone would allow (batch size / their time):
    the im2col GEMM floor, and the products this implementation itself runs (fewer for the
    Fourier PrimaryCaps, so a hand-written bar may rise above the first tick but not the second)."""
    rows = [r for r in results["main"] if "error" not in r]
    # one line per part of the label ("torch:cuda:0", "CUDA graph"), so that neighbours do not overlap
    names = [r["label"].replace(", ", "\n") + ("" if r["impl"].startswith("autograd") else "\n(hand-written)")
             for r in rows]
    rates = [r["train_samples_per_s"] for r in rows]
    colours = ["0.6" if r["impl"].startswith("autograd") else "tab:blue" for r in rows]
    bars = ax.bar(range(len(rows)), rates, color=colours)
    tops = list(rates)
    for k, (bar, r) in enumerate(zip(bars, rows)):
        ratio = r.get("speedup_vs_autograd")
        ax.annotate(f"{ratio:.2f}x autograd" if ratio else "autograd (1x)", (bar.get_x() + bar.get_width() / 2,
                    bar.get_height()), ha="center", va="bottom", fontsize=8)
        span = [bar.get_x(), bar.get_x() + bar.get_width()]
        for key, style in (("gemm_floor_s", "k--"), ("own_floor_s", "k:")):
            if r.get(key):
                ax.plot(span, [r["batch"] / r[key]] * 2, style, lw=1.2)
                tops[k] = max(tops[k], r["batch"] / r[key])
    if any(r.get("gemm_floor_s") for r in rows):
        ax.plot([], [], "k--", lw=1.2, label="im2col GEMM floor: its products alone")
        ax.plot([], [], "k:", lw=1.2, label="the products this step runs, alone")
        ax.legend(fontsize=7, loc="upper right")
    ax.set_xticks(range(len(rows)), names, fontsize=7)
    ax.set_ylabel("train samples/s")
    s = results.get("settings", {})
    ax.set_title(f"train step, batch {s.get('batch_size', '?')}, {s.get('dtype', '?')}", fontsize=9)
    ax.set_ylim(0, max(tops) * 1.3)


def _rates_against(ax, rows, key, xlabel, title):
    """Train and eval samples/s of the scaling ``rows`` against their field ``key``."""
    xs = [r[key] for r in rows]
    ax.plot(xs, [r["train_samples_per_s"] for r in rows], "o-", label="train")
    ax.plot(xs, [r["eval_samples_per_s"] for r in rows], "s-", label="eval")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("samples/s")
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=9)


def _scaling_panels(axes, scaling):
    ok = {k: [r for r in scaling.get(k, []) if "error" not in r] for k in ("batch", "routing", "input_size")}
    _rates_against(axes[0], ok["batch"], "batch", "batch size", f"{scaling.get('impl', '')}: throughput against batch")
    axes[0].set_xscale("log", base=2)
    axes[0].set_xticks([r["batch"] for r in ok["batch"]], [str(r["batch"]) for r in ok["batch"]])

    batch = ok["routing"][0]["batch"] if ok["routing"] else "?"
    _rates_against(axes[1], ok["routing"], "routing_iters", "routing iterations",
                   f"throughput against routing iterations (batch {batch})")
    axes[1].set_xticks([r["routing_iters"] for r in ok["routing"]])

    ax = axes[2]
    for share, style in ((False, "o-"), (True, "s--")):
        rows = [r for r in ok["input_size"] if r["share_spatial"] == share]
        ax.plot([r["input_size"] for r in rows], [r["peak_train_mem_mb"] for r in rows], style,
                label="share_spatial" if share else "one transform per position")
        for r in rows:
            ax.annotate(f"{r['peak_train_mem_mb']:,.0f}", (r["input_size"], r["peak_train_mem_mb"]), fontsize=7,
                        textcoords="offset points", xytext=(4, -10 if share else 4))
    ax.set_xticks(sorted({r["input_size"] for r in ok["input_size"]}))
    ax.margins(x=0.12)  # room for the labels of the last points
    ax.set_xlabel("input side (pixels)")
    ax.set_ylabel("peak train MB")
    ax.legend(fontsize=7)
    batch = ok["input_size"][0]["batch"] if ok["input_size"] else "?"
    ax.set_title(f"memory against input size (batch {batch})", fontsize=9)


def plot(results: dict, path: str) -> str:
    plt = pyplot()
    scaling = results.get("scaling")
    if scaling:
        fig, axes = plt.subplots(2, 2, figsize=(11, 8))
        _throughput_panel(axes[0, 0], results)
        _scaling_panels([axes[0, 1], axes[1, 0], axes[1, 1]], scaling)
    else:
        fig, ax = plt.subplots(figsize=(max(6.5, 1.25 * len(results["main"])), 4.5))
        _throughput_panel(ax, results)
    machine = results.get("machine", {})
    where = machine.get("gpu") or machine.get("cpu") or machine.get("platform", "")
    stopped = ", a run stopped part-way" if results.get("complete") is False else ""
    version = results.get("code") or {}
    commit = version.get("commit")
    code = f", code {commit[:7]}{'' if version.get('clean') else ' + changes'}" if commit else ""
    fig.suptitle(f"pycapsnet benchmark ({where}, {machine.get('cpus', '?')} CPUs{code}{stopped})", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", nargs="?", default=os.path.join(ROOT, "benchmarks", "results.json"),
                   help="a JSON written by benchmarks/bench.py (default: benchmarks/results.json)")
    p.add_argument("--out", type=writable_file, default=os.path.join(ROOT, "docs", "benchmark.png"),
                   help="the PNG to write")
    args = p.parse_args(argv)
    try:
        results = load(args.json)
    except NotAResult as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    print(plot(results, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Table 1 of Sabour et al. (2017) on the embedded digits: the test error of the baseline CNN and of
CapsNet with 1 and 3 routing iterations, each with and without the reconstruction loss, over
several seeds (mean and spread), and each variant's train step time.  Training as the library's
default run: 4,000 digits shifted by up to 2 pixels, Adam 2e-3 decayed 0.85 per epoch, batch 32;
the error is the last epoch's (no choice of epoch on the test set)."""
from __future__ import annotations

import os

import numpy as np

from ..tools import plots
from ..training import data
from ..training.log import say
from . import digits, loop
from .networks import QUICK_CAPSNET, QUICK_CNN, baseline_cnn, capsnet

PAPER = {"baseline": 0.39, "r1": 0.34, "r1+recon": 0.29, "r3": 0.35, "r3+recon": 0.25}  # % MNIST test error
PAPER_SPREAD = {"r1": 0.032, "r1+recon": 0.011, "r3": 0.036, "r3+recon": 0.005}

LR = 2e-3  # Adam's rate: the library's recipe, as the built-in network trains

def variants(shape, quick):
    small, cnn = (QUICK_CAPSNET, QUICK_CNN) if quick else ({}, {})
    return {"baseline": baseline_cnn(shape, **cnn),
            **{f"r{r}{'+recon' if rec else ''}": capsnet(shape, iters=r, reconstruction=rec, **small)
               for r in (1, 3) for rec in (False, True)}}


def run(args, B, out, units) -> dict:
    train_set, test_set = digits.source(args.limit, args.data_dir)
    x_test = data.as_float(test_set.x)
    rows = {}
    for name, description in variants((1, 28, 28), args.quick).items():
        done = [units.measure(f"{name} seed {seed}", lambda seed=seed: train_one(
                    args, B, description, seed, train_set, x_test, test_set.y, f"{name} seed {seed}"))
                for seed in range(args.seeds)]
        errors = [u["error"] for u in done]
        rows[name] = {"errors": errors, "mean": float(np.mean(errors)), "std": float(np.std(errors, ddof=1))
                      if len(errors) > 1 else None, "ms_per_step": 1e3 * float(np.median([u["step"] for u in done])),
                      "params": done[0]["params"], "paper": PAPER[name], "paper_std": PAPER_SPREAD.get(name)}
    results = {"train": len(train_set), "test": len(test_set), "rows": rows}
    figure(results, os.path.join(out, "table1.png"))
    return results


def train_one(args, B, description, seed, train_set, x_test, y_test, desc) -> dict:
    """One unit: the network trained from ``seed``; its test error (%), seconds a step, parameters."""
    model, step = loop.train_network(args, B, description, seed, train_set, lambda x, r: data.random_shift(x, 2, r),
                                     desc)
    error = 100 * float(np.mean(model.predict(x_test, 100) != y_test))
    say(f"{desc}: test error {error:.2f}%")
    return {"error": error, "step": step, "params": model.n_params()}


def figure(results, path):
    """Each network's test error: its seeds as dots, their mean as a bar, the paper's as a mark."""
    plt = plots.pyplot()
    rows = results["rows"]
    fig, ax = plt.subplots(figsize=(5.5, 3))
    for k, (name, r) in enumerate(rows.items()):
        ax.bar(k, r["mean"], color="C0" if name != "baseline" else "C7", alpha=0.6)
        ax.plot([k] * len(r["errors"]), r["errors"], "o", color="k", ms=3)
        ax.plot(k, r["paper"], "_", color="C3", ms=18, mew=2, label="paper" if k == 0 else None)
    ax.set_xticks(range(len(rows)), list(rows))
    ax.set_ylabel("test error (%)")
    ax.set_title(f"Table 1 on {results['train']:,} training digits: seeds (dots), mean (bar), paper (red)", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    plots.save(fig, path)


def table(results) -> str:
    lines = ["| network | params | test error % (mean ± sd over seeds) | seeds' errors % | ms/step | paper (MNIST, 60k) |",
             "|---|---|---|---|---|---|"]
    for name, r in results["rows"].items():
        sd = "" if r["std"] is None else f" ± {r['std']:.2f}"
        paper = f"{r['paper']:.2f}" + ("" if r["paper_std"] is None else f" ± {r['paper_std']:.3f}")
        lines.append(f"| {name} | {r['params']:,} | {r['mean']:.2f}{sd} | {', '.join(f'{e:.1f}' for e in r['errors'])} "
                     f"| {r['ms_per_step']:.0f} | {paper} |")
    return "\n".join(lines)

"""Robustness to affine transformations (Sabour et al. 2017, §5.2): CapsNet and the baseline CNN,
trained on the training digits placed at random on a 40x40 canvas (new places every epoch), are
tested on the test digits placed at random (translated) and under random affine maps in affNIST's
ranges (digits.affine).  The paper: 99.23% translated and 79% affNIST for CapsNet, 99.22% and 66%
for the CNN, both stopped early at the same translated accuracy."""
from __future__ import annotations

import os

import numpy as np

from ..core import architecture as A
from ..training import data
from ..training.log import say
from . import digits, loop
from .networks import QUICK_CAPSNET, QUICK_CNN, baseline_cnn, capsnet

PAPER = {"capsnet": (99.23, 79.0), "baseline": (99.22, 66.0)}  # % accuracy: translated, affNIST

LR = 1e-3  # Adam's rate: the paper's; 2e-3 makes every class capsule long in the first steps on 40x40

def networks(shape, quick):
    small, cnn = (QUICK_CAPSNET, QUICK_CNN) if quick else ({}, {})
    return {"capsnet": capsnet(shape, **small), "baseline": baseline_cnn(shape, **cnn)}


def run(args, B, out) -> dict:
    canvas = digits.check_canvas(args.canvas or 40)
    digits.check_affine(args.max_rotation, args.max_shear, tuple(args.scale))
    train_set, test_set = digits.embedded(args.limit)
    x_te = data.as_float(test_set.x)
    translated = digits.place(x_te, canvas, np.random.default_rng(777))
    transformed = digits.affine(x_te, canvas, np.random.default_rng(778), args.max_rotation, args.max_shear,
                                tuple(args.scale))
    rows, shown = {}, {}
    for name, description in networks((1, canvas, canvas), args.quick).items():
        acc, steps = {"translated": [], "affine": []}, []
        for seed in range(args.seeds):
            model = A.build(description, B, seed=seed)
            rng = np.random.default_rng(seed)
            batches = lambda epoch: loop.shuffled(train_set.x, train_set.y, args.batch_size, rng,
                                                  lambda x, r: digits.place(data.as_float(x), canvas, r))
            _, t = loop.train(model, args.epochs, batches, loop.n_batches(len(train_set), args.batch_size),
                              lr=args.lr, desc=f"{name} seed {seed}")
            steps.append(t)
            for test_name, x in (("translated", translated), ("affine", transformed)):
                predicted = model.predict(x, 100)
                acc[test_name].append(100 * float(np.mean(predicted == test_set.y)))
            shown[name] = predicted  # the affine test set's, for the figure
            say(f"{name} seed {seed}: translated {acc['translated'][-1]:.2f}%, affine {acc['affine'][-1]:.2f}%")
        rows[name] = {"params": model.n_params(), "ms_per_step": 1e3 * float(np.median(steps)), "paper": PAPER[name],
                      **{k: {"accs": v, "mean": float(np.mean(v))} for k, v in acc.items()}}
    examples_figure(transformed, test_set.y, shown, os.path.join(out, "affine_examples.png"))
    return {"canvas": canvas, "max_rotation": args.max_rotation, "max_shear": args.max_shear,
            "scale": list(args.scale), "train_digits": len(train_set), "test_digits": len(test_set), "rows": rows}


def examples_figure(x, y, predicted, path, k=16):
    """The first k affine test digits, each titled with its label and what each network predicts
    (of the last seed), a wrong prediction in red."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = min(k, len(y))
    fig, axes = plt.subplots(2, (k + 1) // 2, figsize=(0.95 * ((k + 1) // 2), 2.6), squeeze=False)
    for i, ax in enumerate(axes.ravel()):
        ax.axis("off")
        if i >= k:
            continue
        ax.imshow(x[i, 0], cmap="gray", vmin=0, vmax=1)
        caps, cnn = predicted["capsnet"][i], predicted["baseline"][i]
        ax.set_title(f"{y[i]}: {caps}/{cnn}", fontsize=7, color="black" if caps == cnn == y[i] else "red")
    fig.suptitle("affine test digits, label: CapsNet / CNN prediction", fontsize=8)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def table(results) -> str:
    lines = ["| network | params | translated test % | affine test % | ms/step | paper (translated, affNIST) |",
             "|---|---|---|---|---|---|"]
    for name, r in results["rows"].items():
        cell = lambda k: f"{r[k]['mean']:.2f}" + (f" ({', '.join(f'{a:.1f}' for a in r[k]['accs'])})"
                                                 if len(r[k]["accs"]) > 1 else "")
        lines.append(f"| {name} | {r['params']:,} | {cell('translated')} | {cell('affine')} | {r['ms_per_step']:.0f} "
                     f"| {r['paper'][0]}, {r['paper'][1]} |")
    return "\n".join(lines)

"""Pictures (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

import numpy as np


def pyplot():
    """matplotlib.pyplot on the Agg backend, which draws to files and needs no display (the CLIs,
    CI and the benchmark's pictures run headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _img(a):
    a = np.asarray(a)
    return a[0] if a.shape[0] == 1 else np.transpose(a, (1, 2, 0))


def reconstruction_grid(images, recons, labels, preds, path, title=""):
    """Rows of (input, reconstruction) pairs, titled with label and prediction."""
    plt = pyplot()
    n = len(images)
    cols = min(n, 8)
    rows = 2 * int(np.ceil(n / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(1.3 * cols, 1.45 * rows), squeeze=False)
    for ax in axes.ravel():
        ax.axis("off")
    for i in range(n):
        r, c = 2 * (i // cols), i % cols
        ok = labels[i] == preds[i]
        axes[r, c].imshow(_img(images[i]), cmap="gray", vmin=0, vmax=1)
        axes[r, c].set_title(f"y={labels[i]} p={preds[i]}", fontsize=7, color="black" if ok else "red")
        axes[r + 1, c].imshow(_img(recons[i]), cmap="gray", vmin=0, vmax=1)
    fig.suptitle(title or "inputs (odd rows) and reconstructions from the predicted capsule", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def perturbation_grid(decoded, steps, path, title=""):
    """decoded: (dims, len(steps), C, H, W) -- one row per capsule dimension (the paper's Figure 4)."""
    plt = pyplot()
    dims, n_steps = decoded.shape[:2]
    fig, axes = plt.subplots(dims, n_steps, figsize=(0.8 * n_steps + 0.6, 0.8 * dims + 0.4), squeeze=False)
    for d in range(dims):
        for k in range(n_steps):
            ax = axes[d, k]
            ax.imshow(_img(decoded[d, k]), cmap="gray", vmin=0, vmax=1)
            ax.set_xticks([]), ax.set_yticks([])
            if d == dims - 1:
                ax.set_xlabel(f"{steps[k]:+.2f}", fontsize=6)
            if k == 0:
                ax.set_ylabel(f"dim {d}", fontsize=6)
    fig.suptitle(title or "each capsule dimension moved over [-0.25, 0.25], then decoded", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def coupling_heatmaps(couplings, grid_hw, types, path, chosen=None, title=""):
    """couplings: list over routing iterations of c_ij (I, J) for one input, I = positions * types.

    Top row: c_ij per iteration (rows = primary capsules i, columns = class capsules j), on one colour
    scale fitted to the data (the coefficients start at 1/J and move by a few hundredths, which a 0..1
    scale would hide).  Bottom row: for class ``chosen``, c_ij averaged over the capsule types at
    each position of the primary grid -- where in the image that class draws its evidence from."""
    plt = pyplot()
    R = len(couplings)
    cs = [np.asarray(c) for c in couplings]
    lo, hi = min(c.min() for c in cs), max(c.max() for c in cs)
    rows = 2 if chosen is not None else 1
    fig, axes = plt.subplots(rows, R, figsize=(2.8 * R + 1.2, 4.6 * rows), squeeze=False,
                             gridspec_kw={"height_ratios": [2, 1] if rows == 2 else [1]})
    for r, c in enumerate(cs):
        ax = axes[0, r]
        im = ax.imshow(c, aspect="auto", cmap="viridis", vmin=lo, vmax=hi, interpolation="nearest")
        ax.set_title(f"iteration {r + 1}", fontsize=9)
        ax.set_xlabel("class capsule j", fontsize=8)
        if r == 0:
            ax.set_ylabel(f"primary capsule i ({grid_hw[0]}x{grid_hw[1]} positions x {types} types)", fontsize=8)
    fig.colorbar(im, ax=axes[0].tolist(), label="c_ij")
    if chosen is not None:
        maps = [c[:, chosen].reshape(grid_hw[0], grid_hw[1], types).mean(-1) for c in cs]
        mlo, mhi = min(m.min() for m in maps), max(m.max() for m in maps)
        for r, m in enumerate(maps):
            ax = axes[1, r]
            im2 = ax.imshow(m, cmap="magma", vmin=mlo, vmax=mhi, interpolation="nearest")
            ax.set_xticks([]), ax.set_yticks([])
            ax.set_xlabel(f"c_i,{chosen} by position (mean over types)", fontsize=7)
        fig.colorbar(im2, ax=axes[1].tolist(), label=f"mean c_i,{chosen}")
    fig.suptitle(title or "coupling coefficients c_ij per routing iteration", fontsize=9)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def training_curves(metrics, path):
    """Test accuracy and train loss per epoch from metrics.jsonl records."""
    plt = pyplot()
    ep = [m["epoch"] for m in metrics]
    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3))
    a.plot(ep, [100 * m["test_acc"] for m in metrics], "o-")
    a.set_xlabel("epoch"), a.set_ylabel("test accuracy (%)"), a.grid(alpha=0.3)
    b.plot(ep, [m["train_loss"] for m in metrics], "o-", color="C1")
    b.set_xlabel("epoch"), b.set_ylabel("train loss"), b.set_yscale("log"), b.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

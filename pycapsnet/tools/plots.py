"""Pictures (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

import os

import numpy as np

from ..training import files


def pyplot():
    """matplotlib.pyplot on the Agg backend, which draws to files and needs no display (the CLIs,
    CI and the benchmark's pictures run headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: str, dpi: int = 110, **options) -> str:
    """Write ``fig`` to ``path`` atomically (never a half-drawn file) and close it; ``options`` go
    to savefig (bbox_inches="tight")."""
    try:
        fmt = os.path.splitext(path)[1][1:] or "png"
        files.atomic_write(path, lambda f: fig.savefig(f, format=fmt, dpi=dpi, **options))
    finally:
        pyplot().close(fig)
    return path


def _img(a):
    a = np.asarray(a)
    return a[0] if a.shape[0] == 1 else np.transpose(a, (1, 2, 0))


def reconstruction_grid(images, recons, labels, preds, path, title="", classes=None):
    """Rows of (input, reconstruction) pairs, each input captioned with label and prediction (red
    where they differ).  One image of all the tiles, drawn in one axes: a figure of one axes per
    tile costs most of a second to build, at every epoch.  ``recons`` None (a network without a
    decoder): the captioned inputs alone.  ``classes``: names by index, for the captions."""
    plt = pyplot()
    name = (lambda k: str(k)) if classes is None else (lambda k: str(classes[k])[:10])
    tiles = [(_img(a), None if recons is None else _img(b)) for a, b in zip(images, recons if recons is not None
                                                                          else images)]
    n, (h, w) = len(tiles), tiles[0][0].shape[:2]
    rows = 1 if recons is None else 2  # tiles per sample, one above the other
    cols = min(n, 8)
    pair_rows = int(np.ceil(n / cols))
    gap, cap = max(1, w // 14), max(6, (2 * h) // 5)  # white between tiles; room for a caption above a pair
    cell_h, cell_w = cap + rows * h + gap, w + gap
    canvas = np.ones((pair_rows * cell_h, cols * cell_w - gap) + tiles[0][0].shape[2:])
    fig, ax = plt.subplots(figsize=(1.3 * cols, 1.45 * rows * pair_rows))
    if recons is None:
        title = f"{title}: inputs, labels and predictions (this network has no decoder)" if title else ""
    for i, (x, r) in enumerate(tiles):
        top, left = (i // cols) * cell_h + cap, (i % cols) * cell_w
        canvas[top:top + h, left:left + w] = x
        if r is not None:
            canvas[top + h:top + 2 * h, left:left + w] = r
        ax.text(left + w / 2, top - 1, f"{name(labels[i])}" if labels[i] == preds[i] else
                f"{name(labels[i])}→{name(preds[i])}", ha="center", va="bottom", fontsize=7,
                color="black" if labels[i] == preds[i] else "red")
    ax.imshow(np.clip(canvas, 0, 1), cmap="gray", vmin=0, vmax=1, interpolation="nearest")
    ax.axis("off")
    fig.suptitle(title or "inputs (odd rows) and reconstructions from the predicted capsule", fontsize=9)
    fig.subplots_adjust(left=0.01, right=0.99, bottom=0.01, top=1 - 0.3 / (1.45 * rows * pair_rows))
    return save(fig, path)


def confusion_matrix(counts, classes, path, title=""):
    """Counts (true class rows, predicted class columns) as a heat map, each row scaled by its
    class's images, the counts written in the cells (where there is room)."""
    plt = pyplot()
    counts = np.asarray(counts)
    J = len(classes)
    share = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    side = min(16, 2 + 0.45 * J)
    fig, ax = plt.subplots(figsize=(side + 1, side))
    im = ax.imshow(share, cmap="Blues", vmin=0, vmax=1)
    ticks = np.arange(J)
    names = [str(c)[:16] for c in classes]
    ax.set_xticks(ticks, names, rotation=90 if J > 6 else 0, fontsize=7)
    ax.set_yticks(ticks, names, fontsize=7)
    ax.set_xlabel("predicted class"), ax.set_ylabel("true class")
    if J <= 30:
        for i in range(J):
            for j in range(J):
                if counts[i, j]:
                    ax.text(j, i, str(counts[i, j]), ha="center", va="center", fontsize=7,
                            color="white" if share[i, j] > 0.5 else "black")
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="share of the true class's images")
    ax.set_title(title or "confusion matrix", fontsize=9)
    fig.tight_layout()
    return save(fig, path)


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
    return save(fig, path)


def coupling_heatmaps(couplings, grid_hw, types, path, chosen=None, title="", symbol="c_ij", child="primary capsule",
                      row_label=None, columns=None, parent="class capsule j"):
    """couplings: list over routing iterations of c_ij (I, J) for one input, I = positions * types
    (``row_label``: another description of the rows; ``columns``: names of the J parents, e.g. the
    classes; ``parent``: what the columns are).

    Top row: c_ij per iteration (rows = primary capsules i, columns = class capsules j), on one colour
    scale fitted to the data (the coefficients start at 1/J and move by a few hundredths, which a 0..1
    scale would hide).  Bottom row: for class ``chosen``, c_ij averaged over the capsule types at
    each position of the primary grid -- where in the image that class draws its evidence from."""
    plt = pyplot()
    R = len(couplings)
    cs = [np.asarray(c) for c in couplings]
    lo, hi = min(c.min() for c in cs), max(c.max() for c in cs)
    chosen = None if grid_hw[0] * grid_hw[1] == 1 else chosen  # no grid: no map of where the evidence is
    rows = 2 if chosen is not None else 1
    fig, axes = plt.subplots(rows, R, figsize=(2.8 * R + 1.2, 4.6 * rows), squeeze=False,
                             gridspec_kw={"height_ratios": [2, 1] if rows == 2 else [1]})
    for r, c in enumerate(cs):
        ax = axes[0, r]
        im = ax.imshow(c, aspect="auto", cmap="viridis", vmin=lo, vmax=hi, interpolation="nearest")
        ax.set_title(f"iteration {r + 1}", fontsize=9)
        ax.set_xlabel(parent, fontsize=8)
        if columns is not None and len(columns) <= 40:
            ax.set_xticks(range(len(columns)), [str(n) for n in columns], fontsize=6,
                          rotation=90 if max(len(str(n)) for n in columns) > 2 else 0)
        if r == 0:
            ax.set_ylabel(row_label or f"{child} i ({grid_hw[0]}x{grid_hw[1]} positions x {types} types)", fontsize=8)
    fig.colorbar(im, ax=axes[0].tolist(), label=symbol)
    if chosen is not None:
        maps = [c[:, chosen].reshape(grid_hw[0], grid_hw[1], types).mean(-1) for c in cs]
        mlo, mhi = min(m.min() for m in maps), max(m.max() for m in maps)
        for r, m in enumerate(maps):
            ax = axes[1, r]
            im2 = ax.imshow(m, cmap="magma", vmin=mlo, vmax=mhi, interpolation="nearest")
            ax.set_xticks([]), ax.set_yticks([])
            ax.set_xlabel(f"{symbol[0]}_i,{chosen} by position (mean over types)", fontsize=7)
        fig.colorbar(im2, ax=axes[1].tolist(), label=f"mean {symbol[0]}_i,{chosen}")
    fig.suptitle(title or f"{symbol} per routing iteration", fontsize=9)
    return save(fig, path)


def activation_bars(activations, path, names, label=None, chosen=None, title=""):
    """EM routing's class activations a_j after each iteration's M-step: one bar chart per iteration
    (activations: list of (J,) arrays), the label's bar and the predicted one marked."""
    plt = pyplot()
    R = len(activations)
    fig, axes = plt.subplots(1, R, figsize=(max(7.0, 2.6 * R + 0.6), 2.8), squeeze=False, sharey=True)
    for r, a in enumerate(activations):
        ax = axes[0, r]
        colours = ["C2" if j == label else "C3" if j == chosen else "C0" for j in range(len(a))]
        ax.bar(range(len(a)), a, color=colours)
        ax.set_xticks(range(len(a)), [str(n) for n in names], fontsize=6, rotation=90 if len(a) > 12 else 0)
        ax.set_ylim(0, 1), ax.set_title(f"iteration {r + 1}", fontsize=9)
        if r == 0:
            ax.set_ylabel("a_j", fontsize=8)
    fig.suptitle(title or "class activations a_j per routing iteration (green: label, red: predicted if not)", fontsize=9)
    fig.tight_layout()
    return save(fig, path)


def training_curves(metrics, path):
    """Accuracy per epoch (train, and validation and test where the run has them) and train loss
    per epoch from metrics.jsonl records; whole epochs on the axis."""
    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

    ep = [m["epoch"] for m in metrics]
    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3))
    for key, label in (("train_acc", "train"), ("val_acc", "validation"), ("test_acc", "test")):
        if all(m.get(key) is not None for m in metrics):
            a.plot(ep, [100 * m[key] for m in metrics], "o-", label=label)
    a.set_xlabel("epoch"), a.set_ylabel("accuracy (%)"), a.grid(alpha=0.3), a.legend(fontsize=7)
    losses = [(e, m["train_loss"]) for e, m in zip(ep, metrics) if m.get("train_loss") is not None]
    if losses:  # (a record written by checkpoint.save with a history of its own may hold none)
        b.plot(*zip(*losses), "o-", color="C3")
        b.set_yscale("log")
    b.set_xlabel("epoch"), b.set_ylabel("train loss"), b.grid(alpha=0.3)
    for ax in (a, b):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    return save(fig, path)

"""What a run says of its test predictions: per-class accuracy and the confusion matrix (evaluate),
and the warning when every test image falls into one class (after each epoch)."""
from __future__ import annotations

import json
import os

import numpy as np

from . import files
from .log import say
from ..errors import CapsNetError
from ..tools import plots

CONFUSION = ("confusion.json", "confusion.png")


def per_class(confusion: np.ndarray, classes, out_dir: str) -> None:
    """A line per class (its accuracy and images), then confusion.json and confusion.png in ``out_dir``."""
    n = confusion.sum(axis=1)
    width = max(len(str(c)) for c in classes)
    for k, name in enumerate(classes):
        acc = f"{100 * confusion[k, k] / n[k]:6.2f}%" if n[k] else "   --  "
        worst = np.argsort(-np.where(np.arange(len(classes)) == k, -1, confusion[k]), kind="stable")[0]
        mistaken = (f"  most often taken for {classes[worst]} ({confusion[k, worst]})"
                    if n[k] and confusion[k, worst] > 0 and worst != k else "")
        say(f"  {str(name):<{width}}  {acc}  of {n[k]} image{'s' if n[k] != 1 else ''}{mistaken}")
    record = {"classes": [str(c) for c in classes], "rows": "true class", "columns": "predicted class",
              "counts": confusion.tolist()}
    paths = [os.path.join(out_dir, name) for name in CONFUSION]
    try:
        files.atomic_write(paths[0], lambda f: f.write(json.dumps(record, indent=1).encode()))

        plots.confusion_matrix(confusion, classes, paths[1],
                               title=f"test accuracy {100 * np.trace(confusion) / max(confusion.sum(), 1):.2f}%")
    except OSError as e:
        raise CapsNetError(f"cannot write the confusion matrix into {out_dir}: {e.strerror or e}") from None
    say(f"confusion matrix: {paths[0]}, {paths[1]}")


def collapse(confusion: np.ndarray, classes, steps: int) -> None:
    """One line when every test image is predicted as one class (of several): the network tells
    the classes apart no better than a constant, most often because it has taken few steps."""
    predicted = confusion.sum(axis=0)
    if len(classes) < 2 or np.count_nonzero(predicted) != 1 or np.count_nonzero(confusion.sum(axis=1)) < 2:
        return
    only = classes[int(np.flatnonzero(predicted)[0])]
    say(f"warning: all {int(predicted.sum())} test images are predicted as {only} after {steps} training "
        f"step{'s' if steps != 1 else ''}: the network does not tell the classes apart yet. Give it more steps "
        "(--epochs, or a smaller --batch-size when there are few images); if it stays so, lower --lr or add "
        "images per class")

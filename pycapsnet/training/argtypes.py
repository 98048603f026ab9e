"""argparse types for the command lines' numeric flags and output files.

Each refuses an impossible value when the command line is parsed, so the user gets argparse's
line ``error: train_numpy.py: argument --batch-size: must be at least 1, got 0 (--help ...)`` and exit code 2, instead
of a traceback from deep inside a step, or, worse, a run that silently does something else (a
negative ``--limit`` slicing from the end, a negative ``--lr`` climbing the loss), or a long
benchmark that ends by failing to write its result.
"""
from __future__ import annotations

import argparse
import errno
import math
import os
import tempfile


def _parse(kind, text: str):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, "
                                         f"got {text!r}") from None


def positive_int(text: str) -> int:
    """An integer >= 1 (sizes, counts, iterations)."""
    value = _parse(int, text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def nonnegative_int(text: str) -> int:
    """An integer >= 0 (seeds, pixel shifts, warm-up steps)."""
    value = _parse(int, text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (learning rates, tolerances)."""
    value = _parse(float, text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text}")
    return value


def nonnegative_float(text: str) -> float:
    """A finite number >= 0 (loss weights, where 0 turns a term off)."""
    value = _parse(float, text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of 0 or more, got {text}")
    return value


def fraction(text: str) -> float:
    """A number strictly between 0 and 1 (a share of a dataset)."""
    value = _parse(float, text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be a number between 0 and 1, got {text}")
    return value


def percent(text) -> float:
    """A number above 0 and at most 100 (an accuracy in %)."""
    value = _parse(float, text)
    if not 0 < value <= 100:
        raise argparse.ArgumentTypeError(f"must be a percentage above 0 and at most 100, got {text}")
    return value


def name_and_factor(text: str) -> tuple:
    """NAME=FACTOR -> (NAME, FACTOR), FACTOR a finite number; NAME alone means FACTOR 1.01."""
    name, sep, factor = text.partition("=")
    if not name:
        raise argparse.ArgumentTypeError(f"expected NAME=FACTOR, e.g. primary.W=1.01, got {text!r}")
    value = _parse(float, factor) if sep else 1.01
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"FACTOR must be a finite number, got {factor}")
    return name, value


def writable_file(text: str) -> str:
    """A file the command writes when it is done: its directory is made now and must take a new
    file, so that minutes of work are not lost to a bad path at the end."""
    path = os.path.abspath(text)
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text} is a directory; name the file to write")
    try:
        make_writable_dir(os.path.dirname(path))
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot write {text}: {e.strerror or e}") from None
    return text


def make_writable_dir(directory: str) -> None:
    """Make ``directory`` and its missing parents, and check that it takes a new file.  OSError if
    not; a file that stands where the directory or a parent would go is named (NotADirectoryError),
    where the OS says only 'File exists' or 'Not a directory'.  Used for every output path."""
    path = os.path.abspath(directory)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise NotADirectoryError(errno.ENOTDIR, f"{path} is a file, not a directory")
    os.makedirs(directory, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-test-"):
        pass


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser whose refusal of a command line is one line, as every other error of the
    command line is -- the problem, and where the options are listed -- and exit 2, without
    argparse's usage block before it."""

    def error(self, message):
        self.exit(2, f"error: {self.prog}: {message} (--help lists every option)\n")

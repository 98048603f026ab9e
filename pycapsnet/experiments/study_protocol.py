"""The routing study's protocol: what is fixed before any network trains, and the order that keeps
the test set out of every choice.

    1. The data.  The training digits (``--limit``: a stratified, seeded subset of them), of which a
       stratified share (``--val-fraction``, 10%) is held out for validation; the test set is the
       dataset's whole test split (``--limit-test`` only where asked).  Each split is recorded by its
       class counts and a digest of its images and labels.
    2. Tuning, on validation only (study_tuning.py): every row, and every row of the iteration
       sweep, gets the same grid of rates (and any option its paper leaves open), each trial on
       three tuning seeds; a choice at the grid's edge extends it until the choice is interior or a
       declared limit is reached; the rule and its tie-break are fixed there, before any run.
    3. The test set, read once, after every choice is fixed (``SealedTest``): each row trained on
       the main seeds with its chosen trial, scored on the test digits after its last epoch, which is
       the reading (no epoch is chosen); the affine part reads each network at its last epoch and at
       the first epoch whose translated validation accuracy reaches AFFINE_TARGET, a number fixed
       here, before anything trains.
    4. Statistics against the baseline row (study_stats.py), named in the table.
"""
from __future__ import annotations

import hashlib

import numpy as np

from ..errors import CapsNetError

BASELINE = "uniform"
VAL_FRACTION = 0.1
AFFINE_TARGET = 97.0  # % translated validation accuracy at which the affine part reads a network
DIAGNOSTIC_DIGITS = 1000  # coupling entropy and dynamics on the first this many test digits
CHILD_ACTIVE = 0.05  # a child capsule is active on a digit where its length (EM: activation) exceeds this
PARENT_ACTIVE = 0.5  # a class capsule is, where its length exceeds this (the margin loss's middle)


def digest(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(memoryview(a).cast("B"))
    return h.hexdigest()[:16]


def stratified(split, n: int, seed: int):
    """At most n images of ``split``, each class in proportion (largest remainders first), seeded."""
    if n >= len(split):
        return split
    counts = np.bincount(split.y, minlength=len(split.classes))
    quota = n * counts / len(split)
    take = np.floor(quota).astype(int)
    rng = np.random.default_rng([seed, n, 7])
    order = np.lexsort((rng.random(len(counts)), -(quota - take)))
    take[order[:n - take.sum()]] += 1
    return split.take(split.drawn(take, rng))


def record_of(split) -> dict:
    return {"digits": len(split), "per_class": np.bincount(split.y, minlength=len(split.classes)).tolist(),
            "digest": digest(split.x, split.y)}


def split_data(train, test, limit, limit_test, val_fraction, seed=0):
    """(train, validation, test, {their records}): the protocol's data, step 1."""
    _check_classes(train, test)
    if limit is not None:
        train = stratified(train, limit, seed)
    if limit_test is not None:
        test = stratified(test, limit_test, seed)
    if min(np.bincount(train.y, minlength=len(train.classes))) < 2:
        raise CapsNetError(f"the study's {len(train)} training digits leave a class with fewer than 2: give more "
                           "(--limit)")
    train, val = train.held_out(val_fraction, seed, what=f"the study's validation share {val_fraction}")
    return train, val, test, {"train": record_of(train), "validation": record_of(val), "test": record_of(test),
                              "validation_of": "a stratified, seeded share of the training digits"}


def _check_classes(train, test) -> None:
    """Every class the network scores has training images, and every label names one of them."""
    counts = np.bincount(train.y, minlength=len(train.classes))
    if len(counts) > len(train.classes) or test.y.size and int(test.y.max()) >= len(train.classes):
        raise CapsNetError(f"the labels name {max(len(counts), int(test.y.max(initial=0)) + 1)} classes but the data "
                           f"have {len(train.classes)}: give labels 0 to {len(train.classes) - 1}")
    absent = [train.classes[k] for k in np.flatnonzero(counts == 0)]
    if absent:
        raise CapsNetError(f"class {absent[0]!r} has no training image (of {len(train.classes)} classes, labels 0 to "
                           f"{len(train.classes) - 1}): every class the network scores needs training images; give "
                           "them, or labels without that class")


class SealedTest:
    """The test split, handed out only once every choice is fixed: reading it earlier raises."""

    def __init__(self, split):
        self._split, self.choices = split, None

    def fix(self, choices: dict, rows) -> None:
        """Every row's choice fixed (a trial's name each): then, and only then, the test set opens."""
        lost = [r for r in rows if not isinstance((choices or {}).get(r), str)]
        if not rows or lost:
            raise CapsNetError(f"the routing study reads its test set only after every row's choice is fixed; "
                               f"{', '.join(lost) or 'no row'} has none")
        self.choices = dict(choices)

    def open(self):
        if self.choices is None:
            raise CapsNetError("the routing study reads its test set only after every choice is fixed on "
                               "validation (the tuning units); nothing read it")
        return self._split

    def __len__(self):
        return len(self._split)

"""The routing study's protocol: what is fixed before any network trains, and the order that keeps
the test set out of every choice.

    1. The data.  The training digits (``--limit``: a stratified, seeded subset of them), of which a
       stratified share (``--val-fraction``, 10%) is held out for validation; the test set is the
       dataset's whole test split (``--limit-test`` only where asked).  Each split is recorded by its
       class counts and a digest of its images and labels.
    2. Tuning, on validation only.  Every row gets the same budget: BUDGET trials from its grid
       (the learning rates LR_GRID; a row whose paper leaves an option open, OPEN_OPTIONS, spends its
       trials on rates and that option), each trained on TUNE_SEEDS seeds for the study's epochs and
       scored on validation after its last epoch.  The rule, stated here: the trial with the highest
       mean last-epoch validation accuracy; a tie goes to the trial listed first.
    3. The test set, read once, after every choice is fixed (``SealedTest``): each row trained on
       the main seeds with its chosen trial, scored on the test digits after its last epoch, which is
       the reading (no epoch is chosen); the affine part reads each network at its last epoch and at
       the first epoch whose translated validation accuracy reaches AFFINE_TARGET, a number fixed
       here, before anything trains.
    4. Statistics against the baseline row (study_stats.py), named in the table.
"""
from __future__ import annotations

import hashlib
import itertools

import numpy as np

from ..errors import CapsNetError

BASELINE = "uniform"
LR_GRID = (5e-4, 1e-3, 2e-3, 4e-3)
BUDGET = len(LR_GRID)  # trials per row
# An option a routing's paper leaves open (or whose library default was set with the test set in view):
# tuned on validation within the same budget: two rates and each of its values.
OPEN_OPTIONS = {"vb": {"vb_lambda": (0.1, 1.0)}}
OPEN_OPTION_LRS = (1e-3, 2e-3)
TUNE_SEEDS = (1000,)  # seeds of the tuning trials: none is a main seed
VAL_FRACTION = 0.1
AFFINE_TARGET = 97.0  # % translated validation accuracy at which the affine part reads a network
DIAGNOSTIC_DIGITS = 1000  # coupling entropy and dynamics on the first this many test digits
CHILD_ACTIVE = 0.05  # a child capsule is active on a digit where its length (EM: activation) exceeds this
PARENT_ACTIVE = 0.5  # a class capsule is, where its length exceeds this (the margin loss's middle)


def trials(row_routing: str, grid=LR_GRID) -> list:
    """The row's tuning trials, in the order a tie is broken: [{"lr": .., option: ..}, ...]."""
    open_ = OPEN_OPTIONS.get(row_routing)
    if not open_ or len(grid) != BUDGET:
        return [{"lr": lr} for lr in grid]
    (option, values), = open_.items()
    return [{"lr": lr, option: v} for lr, v in itertools.product(OPEN_OPTION_LRS, values)]


def trial_name(trial: dict) -> str:
    return ",".join(f"{k}={v:g}" for k, v in trial.items())


def choose(scores: dict) -> tuple:
    """The rule: {trial name: [last-epoch validation accuracy per tuning seed]} (in grid order) ->
    (the chosen trial's name, its mean).  Highest mean; a tie goes to the one listed first."""
    best, best_mean = None, -1.0
    for name, accs in scores.items():
        m = float(np.mean(accs))
        if m > best_mean:
            best, best_mean = name, m
    return best, best_mean


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
    return split.take(split._drawn(take, rng))


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

    def fix(self, choices: dict) -> None:
        self.choices = dict(choices)

    def open(self):
        if self.choices is None:
            raise CapsNetError("the routing study reads its test set only after every choice is fixed on "
                               "validation (the tuning units); nothing read it")
        return self._split

    def __len__(self):
        return len(self._split)

"""The routing study's MultiMNIST part (``--multimnist``): Sabour et al. (2017, §6) claim what routing
buys on two overlapping digits, so the study asks there too, under the same protocol as its main
table (study_protocol.py):

    rows      the study's rows with vector class capsules (not em or cnn: neither has capsules to mask
              for a decoder), each on the study's backbone with the paper's decoder (512-1024; --quick
              32-64) and the paper's objective for every row, as ``experiment multimnist`` trains
              CapsNet: the margin loss on capsule lengths with both digits' classes present, each
              digit reconstructed from its own class capsule (multimnist.py)
    data      training pairs made afresh each epoch from the study's training digits (--pairs per
              digit, each digit shifted by up to --shift pixels on a canvas of 28 + 2 --shift);
              validation pairs, one per validation digit (seed VAL_SEED); test pairs, one per test
              digit (seed TEST_SEED, the multimnist experiment's), made only once the test set opens
    tuning    each row as "multimnist:ROW", on the main table's grid, tuning seeds and rule, scored by
              the share of validation pairs recognised after the last epoch
    main      each row at its MultiMNIST choice on the main seeds, read once after the last epoch:
              which test pairs it misses (a pair counts only where its two longest capsules are
              exactly its two classes)
    table     the main table's statistics against the baseline row (uniform where it is a row): the
              paired bootstrap over seeds and pairs, the paired t-test, the TOST at --margin, Holm
              over the rows, the protocol's four words

Units: ``tune multimnist:ROW TRIAL seed S`` and ``multimnist ROW seed S``."""
from __future__ import annotations

import argparse

import numpy as np

from . import digits, loop, multimnist, study_units
from .common import check_fits
from .study_networks import params_of, row_spec
from .study_stats import pack
from ..core import architecture as A
from ..errors import CapsNetError
from ..training import data
from ..training.log import say

PREFIX = "multimnist:"  # a tuned row of this part: PREFIX + the row's name
DECODER, QUICK_DECODER = (512, 1024), (32, 64)  # the paper's decoder, and --quick's
SHIFT, PAIRS, QUICK_PAIRS = 4, 2, 1  # the multimnist experiment's defaults
VAL_SEED, TEST_SEED = 12344, 12345


def settings(args) -> dict | None:
    """The part's settings as the study records them (None: the part is off); --shift and --pairs
    without --multimnist are refused (they would be recorded without changing anything)."""
    if not getattr(args, "multimnist", None):
        given = [f"--{k}" for k in ("shift", "pairs") if getattr(args, k, None) is not None]
        if given:
            raise CapsNetError(f"experiment routings reads {' and '.join(given)} in its MultiMNIST part only: add "
                               "--multimnist, or drop them")
        return None
    shift = SHIFT if args.shift is None else args.shift
    pairs = args.pairs if args.pairs is not None else (QUICK_PAIRS if args.quick else PAIRS)
    canvas = digits.DIGIT + 2 * shift
    digits.check_multimnist(shift, canvas, pairs)
    return {"shift": shift, "canvas": canvas, "pairs": pairs, "decoder": list(QUICK_DECODER if args.quick else DECODER),
            "val_seed": VAL_SEED, "test_seed": TEST_SEED}


def capsule_rows(rows) -> list:
    """The rows with vector class capsules."""
    return [r for r in rows if row_spec(r)[0] == "vector"]


def tuned_rows(part: dict | None, rows) -> list:
    """The part's tuned rows ("multimnist:ROW"), none where the part is off."""
    return [PREFIX + r for r in capsule_rows(rows)] if part else []


def row_of(tuned: str) -> str | None:
    """The study row of a tuned row of this part, None for another."""
    return tuned[len(PREFIX):] if tuned.startswith(PREFIX) else None


def check(study) -> None:
    """Refuse, before any unit trains, data or rows the part cannot take, and pairs that would not fit."""
    part = study.settings_multimnist
    x = study.train.x
    if x.shape[1:] != (1, digits.DIGIT, digits.DIGIT):
        raise CapsNetError(f"the MultiMNIST part overlays two {digits.DIGIT}x{digits.DIGIT} one-channel digits, and "
                           f"these images are {'x'.join(map(str, x.shape[1:]))}: drop --multimnist")
    if not capsule_rows(study.rows):
        raise CapsNetError("the MultiMNIST part trains rows with class capsules, and --routings names none (em and cnn "
                           "have none): add one, such as uniform, or drop --multimnist")
    made = len(study.train) * part["pairs"] + len(study.val) + len(study.test)
    check_fits("routings", 3 * made, part["canvas"], "give fewer --pairs or a smaller --limit")


class Part:
    """The part's data and units for one Study: the validation pairs at once, the test pairs when
    the test set opens."""

    def __init__(self, study):
        self.study, self.part = study, study.settings_multimnist
        self.x_tr = data.as_float(study.train.x)
        self.val = digits.multimnist(data.as_float(study.val.x), study.val.y, 1,
                                     np.random.default_rng(self.part["val_seed"]), self.part["shift"], self.part["canvas"])
        self._test = None

    def network(self, row, trial) -> dict:
        """Row ``row``'s network on the canvas, with the paper's decoder and objective."""
        c = self.part["canvas"]
        return self.study.network(row, (1, c, c), trial, decoder=tuple(self.part["decoder"]),
                                  head=("lengths", A.margin_loss()))

    def unit(self, row, trial, seed, key, test=False) -> dict:
        """A tuning trial (validation after each epoch) or, with ``test``, a main unit: the same, and
        then the one reading of the test pairs."""
        args = argparse.Namespace(**{**vars(self.study.args), "shift": self.part["shift"]})
        val_acc, losses = [], []

        def score(model, epoch):
            val_acc.append(1 - float(np.mean(multimnist.wrong_pairs(model, self.val))))

        description = self.network(row, trial)
        try:
            model, step = multimnist.trained_on_pairs(args, self.study.B, description, seed, self.x_tr,
                                                      self.study.train.y, self.part["pairs"], self.part["canvas"],
                                                      trial["lr"], key, after_epoch=score, curve=losses)
        except loop.Diverged as e:
            if test:
                raise
            return study_units.diverged(key, e, val_acc, losses, params_of(description))
        out = {"val": val_acc, "loss": losses, "step": step, "params": model.n_params()}
        if test:
            wrong = multimnist.wrong_pairs(model, self.test_pairs())
            out.update(test_error=100 * float(np.mean(wrong)), wrong=pack(wrong))
            say(f"{key}: validation pairs {100 * val_acc[-1]:.2f}%, test pairs missed {out['test_error']:.2f}%")
        model.release()
        return out

    def test_pairs(self):
        """One pair per test digit, made when the sealed test set first opens (raises before)."""
        if self._test is None:
            test = self.study.test.open()
            self._test = digits.multimnist(data.as_float(test.x), test.y, 1, np.random.default_rng(self.part["test_seed"]),
                                           self.part["shift"], self.part["canvas"])
        return self._test


def main_keys(part, rows, seeds) -> list:
    """The part's main units, row by row (none where the part is off)."""
    return [f"multimnist {r} seed {s}" for r in capsule_rows(rows) for s in range(seeds)] if part else []

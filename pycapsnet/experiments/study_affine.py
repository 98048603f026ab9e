"""The routing study's affine part (on unless ``--no-affine``): Sabour et al. (2017, §5.2) claim that
routing buys robustness to affine change, so every row is trained on digits placed at random on a
canvas (--canvas, 40) and read on the test digits translated and affinely moved (digits.py):

    tuning    each row as "affine:ROW", on the main table's grid, tuning seeds and rule, scored by the
              translated validation accuracy after the last epoch: a rate chosen on 28x28 digits can
              be too fast for a larger canvas (a pilot's uniform row collapsed at its main choice)
    main      each row at its affine choice on the main seeds, read on the translated and affine test
              digits at its last epoch and at the first epoch whose translated validation accuracy
              reaches the target (--affine-target, 97%: fixed before anything trains)

Units: ``tune affine:ROW TRIAL seed S`` and ``affine ROW seed S``.  Studies recorded before the part
was tuned (their settings' affine part has no "tuned") ran each row at its main choice."""
from __future__ import annotations

import argparse

import numpy as np

from . import digits, loop, study_units
from .study_networks import params_of
from ..training import data

PREFIX = "affine:"  # a tuned row of this part: PREFIX + the row's name
VAL_SEED, TEST_SEEDS = 776, {"translated": 777, "affine": 778}


def tuned_rows(part: dict | None, rows) -> list:
    """The part's tuned rows ("affine:ROW"), none where the part is off or was not tuned."""
    return [PREFIX + r for r in rows] if part and part.get("tuned") else []


def row_of(tuned: str) -> str | None:
    """The study row of a tuned row of this part, None for another."""
    return tuned[len(PREFIX):] if tuned.startswith(PREFIX) else None


class Part:
    """The part's data for one Study: the validation digits placed on the canvas at once, the
    translated and affine test digits once the test set opens (each made once, for every unit)."""

    def __init__(self, study):
        self.study, self.canvas = study, study.args.canvas
        self.val = (digits.place(data.as_float(study.val.x), self.canvas, np.random.default_rng(VAL_SEED)), study.val.y)
        self._test = None

    def test_sets(self) -> dict:
        """{"translated", "affine"}: (images, labels), made when the sealed test set first opens (raises before)."""
        if self._test is None:
            test = self.study.test.open()
            x = data.as_float(test.x)
            self._test = {"translated": (digits.place(x, self.canvas, np.random.default_rng(TEST_SEEDS["translated"])),
                                         test.y),
                          "affine": (digits.affine(x, self.canvas, np.random.default_rng(TEST_SEEDS["affine"])), test.y)}
        return self._test

    def unit(self, row, trial, seed, key, test=False) -> dict:
        """A tuning trial (translated validation accuracy after each epoch, as a share) or, with
        ``test``, a main unit: the test digits (translated, affine) read at the first epoch reaching
        the target and at the last."""
        study, canvas, val = self.study, self.canvas, self.val
        target, epochs = study.affine_target, study.args.epochs
        sets = self.test_sets() if test else None
        read, val_acc, losses = {"target": None, "last": None}, [], []

        def score(model, epoch):
            acc = 100 * float(np.mean(model.predict(val[0], 100) == val[1]))
            val_acc.append(acc / 100)
            last, reached = epoch == epochs - 1, read["target"] is None and acc >= target
            if sets is not None and (reached or last):
                scores = {k: 100 * float(np.mean(model.predict(x, 100) == y)) for k, (x, y) in sets.items()}
                if reached:
                    read["target"] = {**scores, "epoch": epoch + 1, "val": acc}
                if last:
                    read["last"] = {**scores, "val": acc}

        run = argparse.Namespace(**{**vars(study.args), "lr": trial["lr"]})
        description = study.network(row, (1, canvas, canvas), trial)
        try:
            model, step = loop.train_network(run, study.B, description, seed, study.train,
                                             lambda x, r: digits.place(data.as_float(x), canvas, r), key,
                                             after_epoch=score, curve=losses)
        except loop.Diverged as e:
            if test:
                raise
            return study_units.diverged(key, e, val_acc, losses, params_of(description))
        model.release()
        if test:
            return read
        return {"val": val_acc, "loss": losses, "step": step, "params": model.n_params()}

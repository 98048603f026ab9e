"""Scoring a model over a split: accuracy and mean loss in evaluation mode, batch by batch, a batch
that does not fit the device scored in halves."""
from __future__ import annotations

import numpy as np

from . import data
from .graph import CapturedEval
from .log import progress


EVAL_BATCH = 100  # images per evaluation batch


def evaluate(model, split: data.Split, batch_size: int = EVAL_BATCH, show: bool = False, group=None,
             captured: CapturedEval | None = None, confusion: np.ndarray | None = None):
    """(accuracy, mean loss) over a split; the loss uses the label mask, as in training.  A model
    whose outputs overflow gives a non-finite loss, without warnings: the caller checks it.  With a
    ``group`` (data-parallel training) each process scores its shard and the sums are shared.
    ``captured``: a recorded evaluation (graph.py), which scores the batches of its size.
    ``confusion`` (J, J): the counts of (true class, predicted class) are added into it."""
    n_all = len(split)
    if group is not None:
        split = split.take(group.part(n_all))
    correct, loss_sum = 0, 0.0
    n_batches = (len(split) + batch_size - 1) // batch_size
    with model.evaluating():  # Dropout, if any, drops nothing; training's generators are left where they stand
        for x, y in progress(data.batches(split, batch_size), n_batches, "eval", not show, batch=batch_size):
            for out, y_part in _scored(model, x, y, captured):
                correct += int((out.predictions == y_part).sum())
                loss_sum += out.loss * len(y_part)
                if confusion is not None:
                    np.add.at(confusion, (y_part, out.predictions), 1)
    model.release()  # no backward follows: do not carry forward's caches into the next train step
    if group is not None:
        correct, loss_sum = group.sum_values([correct, loss_sum])
        if confusion is not None:
            confusion[...] = group.sum_values(confusion.ravel()).reshape(confusion.shape)
    return correct / n_all, loss_sum / n_all


def _scored(model, x, y, captured=None) -> list:
    """[(outputs, labels)] of one evaluation batch.  A batch that does not fit the device's memory
    (evaluation keeps each layer's forward for a backward, EVAL_BATCH images of it, which can be
    more than a train step at a small batch holds) is scored in halves instead, each the same
    per image: the accuracy is unchanged, the loss's sum differs in its last bits."""
    try:
        with model.B.quiet_float_errors():
            replay = captured is not None and len(y) == captured.batch_size
            return [(captured(x, y) if replay else model.loss(x, y), y)]
    except Exception as e:
        if len(y) < 2 or not model.B.out_of_memory(e):
            raise
    model.release()  # what the failed forward kept
    h = len(y) // 2
    return _scored(model, x[:h], y[:h]) + _scored(model, x[h:], y[h:])

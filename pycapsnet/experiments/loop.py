"""The experiments' training loop: Adam with the library's recipe (lr 2e-3, decayed 0.85 per epoch),
batches from a function of the epoch (fresh shifts and pairs each epoch), and a step that is
``train_step_grads`` unless the experiment brings its own objective (MultiMNIST's two digits).
Progress is a line per tenth of an epoch and one per epoch, in a terminal or a log alike."""
from __future__ import annotations

import time

import numpy as np

from ..core import architecture
from ..errors import CapsNetError
from ..training import data, optim
from ..training.log import say, Lines


class Diverged(CapsNetError):
    """A network's loss became NaN or inf: ``epoch`` (0-based) is the epoch it happened in, ``step``
    the median seconds per step until then (a study's tuning trial records it, and goes on)."""

    def __init__(self, message: str, epoch: int, step: float):
        super().__init__(message)
        self.epoch, self.step = epoch, step


def default_step(model, batch):
    x, y = batch
    return model.train_step_grads(x, y).loss


def train(model, epochs: int, batches, n_batches: int, step=default_step, lr=2e-3, decay=0.85, desc="train",
          after_epoch=None, curve=None):
    """Train ``model`` for ``epochs``; ``batches(epoch)`` yields what ``step(model, batch)`` takes, which
    fills the gradients and returns the loss; ``after_epoch(epoch)`` is called after each, and each
    epoch's mean loss is appended to the list ``curve`` if given.  Returns (mean loss of the last
    epoch, seconds per step)."""
    opt = optim.make("adam", model, lr)
    step_times, loss = [], float("nan")
    for epoch in range(epochs):
        opt.lr = optim.exponential_lr(lr, decay, epoch)
        model.set_epoch(epoch)
        losses = []
        shown = Lines(batches(epoch), n_batches, f"{desc} epoch {epoch + 1}/{epochs}")
        for batch in shown:
            t0 = time.perf_counter()
            losses.append(step(model, batch))
            opt.step()
            model.B.synchronize()
            step_times.append(time.perf_counter() - t0)
            shown.set_postfix(loss=f"{np.mean(losses[-20:]):.4f}")
        loss = float(np.mean(losses))
        if curve is not None:
            curve.append(loss)
        if not np.isfinite(loss):
            raise Diverged(f"{desc}: the loss became {loss} in epoch {epoch + 1}: lower --lr", epoch,
                           float(np.median(step_times)))
        say(f"{desc} epoch {epoch + 1}/{epochs}: loss {loss:.4f}, {np.median(step_times[-len(losses):]) * 1e3:.0f} ms/step")
        if after_epoch is not None:
            after_epoch(epoch)
    # the first steps of a run warm caches and allocators: the median step is the step's cost
    return loss, float(np.median(step_times))


def shuffled(x, y, batch_size, rng, transform=None):
    """(x, y) batches in a random order, each image through ``transform(images, rng)`` if given."""
    order = rng.permutation(len(y))
    for a in range(0, len(y), batch_size):
        idx = order[a:a + batch_size]
        xb = x[idx] if transform is None else transform(x[idx], rng)
        yield xb.astype(np.float32, copy=False), y[idx]


def n_batches(n, batch_size):
    return -(-n // batch_size)


def train_network(args, B, description, seed, train_set, transform, desc, after_epoch=None, curve=None):
    """The described network built from ``seed`` and trained for --epochs on ``train_set``, each batch
    through ``transform(images, rng)`` (shifts, a canvas): (model, seconds per step)."""
    model = architecture.build(description, B, seed=seed)
    rng = np.random.default_rng(seed)
    batches = lambda epoch: shuffled(train_set.x, train_set.y, args.batch_size, rng,  # noqa: E731
                                     lambda x, r: transform(data.as_float(x), r))
    _, step = train(model, args.epochs, batches, n_batches(len(train_set), args.batch_size), lr=args.lr, desc=desc,
                    after_epoch=None if after_epoch is None else lambda epoch: after_epoch(model, epoch), curve=curve)
    return model, step

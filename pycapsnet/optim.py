"""Optimizers for a training loop of your own, and the batches ``Model.fit`` trains on, so that a
loop written by hand can be compared step for step with ``fit`` (docs/architecture.md, "A loop of
your own"; the same weights, bit for bit, on the same batches).

    import pycapsnet
    from pycapsnet.optim import Adam, batches, exponential_lr

    model = pycapsnet.build("capsnet", seed=0)
    net = model.network
    opt = Adam(net, lr=2e-3)
    for epoch in range(3):
        opt.lr = exponential_lr(2e-3, 0.85, epoch)           # fit's schedule: ×0.85 after each epoch
        for x, y in batches(x_train, y_train, 32, epoch):     # fit's shuffles and shifts (seed 0)
            out = net.train_step_grads(x, y)                 # zero_grad, loss, backward
            opt.step()

``Adam(net, lr, betas, eps, ema)`` and ``SGD(net, lr, momentum, ema)`` update the network's own
parameters in place from its gradients (``net.grads``); ``state_dict`` / ``load_state_dict`` keep
their state.  ``ema``: an exponential moving average of the weights (``use_average(True)`` swaps it in).
"""
from __future__ import annotations

import numpy as np

from . import arguments as a
from .arrays import _host, images, labels
from .errors import CapsNetError
from .training import data
from .training.optim import SGD, Adam, exponential_lr  # noqa: F401  (the public names)

__all__ = ["Adam", "SGD", "exponential_lr", "batches"]


def batches(x, y, batch_size: int = 32, epoch: int = 0, seed: int = 0, shift: int = 2, augment: str = "shift"):
    """The batches ``fit`` trains on in epoch ``epoch`` (0-based) with ``seed``: the images shuffled
    by a generator of (seed, epoch), each batch shifted by up to ``shift`` pixels (``augment``
    "efficient": Efficient-CapsNet's transforms).  Yields (x (B, C, H, W) float32, y (B,) int64)."""
    xa = _host(x, "x")
    if xa.ndim not in (3, 4):
        raise CapsNetError(f"x must be images, (N, C, H, W) or (N, H, W), got shape {tuple(xa.shape)}")
    xa = images(xa, xa.shape[1:] if xa.ndim == 4 else (1, *xa.shape[1:]))
    split = data.Split(xa, labels(y, len(xa), None), "arrays")
    rng = np.random.default_rng([a.whole(seed, "seed"), a.whole(epoch, "epoch")])
    batch_size, shift = a.whole(batch_size, "batch_size", least=1), a.whole(shift, "shift")
    augment = a.choice(augment, "augment", data.AUGMENTS)
    return data.batches(split, batch_size, rng, shift, None, augment)

"""Optimizers over a model's ``params`` / ``grads`` dicts, updating the parameters in place.

Adam keeps per-parameter first and second moments for the whole run, with bias correction
(pyCapsNet re-zeroes its moments on every call, which turns Adam into a sign-SGD of sorts).
``state_dict``/``load_state_dict`` move that state through checkpoints as host arrays.

A step is two halves: ``prepare`` on the host (the step count, and the scalars that change from
step to step -- learning rate, bias corrections -- written into a small device array) and ``apply``,
device work only, which reads those scalars from the device.  ``step`` runs both.  The split lets a
captured train step (``pycapsnet.training.graph``) replay ``apply`` with this step's scalars.

``ema``: Polyak averaging.  After every update the optimizer also moves an exponential moving
average of the weights, w̄ <- β_t w̄ + (1 - β_t) w, with β_t = min(ema, (1 + t) / (10 + t)) at step
t (tf.train.ExponentialMovingAverage's ramp: early averages forget the random start quickly).
``use_average(True)`` trades the contents of the parameters and the averages, so that the model
evaluates, is checkpointed and predicts with w̄; ``use_average(False)`` trades them back before
training goes on.  Batch norm's running statistics are not averaged: they are the live weights'.
"""
from __future__ import annotations

import math

import numpy as np

from ..arguments import is_sequence
from ..core.network import Network
from ..errors import CapsNetError


def _check_hyperparameter(name: str, value, low: float, high: float, high_included: bool = False,
                          low_included: bool = True):
    """Refuse ``value`` unless it is a finite number in [low, high) (or (low, ...), ..., high])."""
    ok = isinstance(value, (int, float, np.number)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (low <= value if low_included else low < value)
    if not (ok and (value <= high if high_included else value < high)):
        opening = "[" if low_included else "("
        where = (f"{'>=' if low_included else '>'} {low:g}" if high == math.inf
                 else f"in {opening}{low:g}, {high:g}{']' if high_included else ')'}")
        raise CapsNetError(f"{name} must be a finite number {where}, got {value!r}")


class Optimizer:
    moments: tuple = ()  # the subclass's per-parameter state slots

    def __init__(self, model, lr: float, ema: float | None = None):
        model = _network(model, type(self).__name__)
        _check_hyperparameter("lr", lr, 0, math.inf, low_included=False)  # lr 0: steps that move nothing
        if ema is not None:
            _check_hyperparameter("ema", ema, 0, 1, low_included=False)  # ema 1: an average that never moves
        self.model, self.lr, self.step_count, self.ema = model, lr, 0, ema
        self.state: dict = {}
        self.averaged = False  # whether the parameters hold the averages now (use_average)
        if ema is not None:  # w̄ starts at the weights the run starts from
            self.state["average"] = {k: model.B.xp.asarray(p, copy=True) for k, p in model.params.items()}

    def _slots(self):
        return self.moments + (("average",) if self.ema is not None else ())

    def _scalars(self, n):
        """A device array of n scalars and a view of each, shaped (1,) so that it broadcasts; with
        ``ema``, one more (1 - β_t, the average's step), kept by the optimizer itself."""
        n += self.ema is not None
        self._scalar_values = self.model.B.zeros((n,))
        views = [self._scalar_values[k:k + 1] for k in range(n)]
        if self.ema is not None:
            self._mix = views.pop()
        return views

    def _write_scalars(self, *values):
        B = self.model.B
        if self.ema is not None:
            t = self.step_count  # (0 before the first step: nothing moves)
            values += (t and 1 - min(self.ema, (1 + t) / (10 + t)),)
        with np.errstate(over="ignore"):
            host = np.array(values).astype(B.dtype)
        if not np.isfinite(host).all():  # an lr like 1e300 has no float32 value: say so, once
            raise CapsNetError(f"the learning rate {self.lr:g} makes a step size beyond the range of "
                               f"{B.dtype} (largest {np.finfo(B.dtype).max:.3g}); use a lower lr")
        self._scalar_values[...] = B.asarray(host)

    def step(self):
        self.prepare()
        self.apply()

    def prepare(self):
        if self.averaged:  # a step would move the averages as if they were the weights
            raise CapsNetError("the parameters hold the weights' averages (use_average(True)): call "
                               "use_average(False) before training")
        self.step_count += 1
        self._prepare()

    def _prepare(self):
        raise NotImplementedError

    def apply(self):
        raise NotImplementedError

    def _apply_average(self):
        """w̄ <- w̄ + (1 - β_t)(w - w̄), after the update (none without ``ema``)."""
        if self.ema is None:
            return
        B, params, average = self.model.B, self.model.params, self.state["average"]

        def update(k, block):
            w, a = (B.xp.reshape(x, (-1,))[block] for x in (params[k], average[k]))
            a += self._mix * (w - a)

        B.over_blocks(update, _sizes(params))

    def use_average(self, on: bool = True) -> None:
        """Make the parameters hold the averages (on) or the live weights (off), trading the two
        sets of arrays' contents in place (a recorded step keeps its arrays); nothing without ``ema``."""
        if self.ema is None or self.averaged == on:
            return
        xp = self.model.B.xp
        for k, w in self.model.params.items():
            a = self.state["average"][k]
            live = xp.asarray(w, copy=True)
            w[...] = a
            a[...] = live
        self.averaged = on

    def state_dict(self) -> dict:
        B = self.model.B
        out = {"step_count": np.array(self.step_count), "lr": np.array(self.lr)}
        for slot in self._slots():
            for k, v in self.state[slot].items():
                out[f"{slot}/{k}"] = B.to_numpy(v)
        if self.ema is not None:  # while averaged, average/ holds the live weights
            out["averaged"] = np.array(int(self.averaged))
        return out

    def load_state_dict(self, state: dict):
        """Restore ``state_dict``'s arrays, after the model's weights; CapsNetError saying what is
        missing or misshapen.  With ``ema``, a state without averages (a run trained without it)
        starts them from the weights the model holds now."""
        B = self.model.B
        slots = self._slots()
        if self.ema is not None and not any(k.startswith("average/") for k in state):
            slots = self.moments
            for k, p in self.model.params.items():  # in place, as use_average trades them
                self.state["average"][k][...] = p
        shapes = {"step_count": (), "lr": ()}
        shapes.update({f"{slot}/{k}": tuple(v.shape) for slot in slots for k, v in self.state[slot].items()})
        missing = [k for k in shapes if k not in state]
        wrong = [f"{k} is {np.shape(state[k])}, not {shape}" for k, shape in shapes.items()
                 if k in state and tuple(np.shape(state[k])) != shape]
        if missing or wrong:
            raise CapsNetError("; ".join(([f"lacks {', '.join(missing[:3])}" + (f" and {len(missing) - 3} more"
                                                                               if len(missing) > 3 else "")]
                                          if missing else []) + wrong[:3]))
        step_count, lr = state["step_count"], state["lr"]
        if step_count.dtype.kind not in "iu" or step_count < 0 or not (np.isfinite(lr) and lr > 0):
            raise CapsNetError(f"has step_count {step_count} and lr {lr}: not a count and a positive rate")
        self.step_count = int(step_count)
        self.lr = float(lr)
        for slot in slots:
            for k in self.state[slot]:
                self.state[slot][k][...] = B.asarray(state[f"{slot}/{k}"])
        if "average" in slots:
            self.averaged = bool(state.get("averaged", 0))


class Adam(Optimizer):
    """m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2;
    w <- w - lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)   (Kingma & Ba 2015, as torch.optim.Adam)."""

    moments = ("m", "v")

    def __init__(self, model, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, ema=None):
        super().__init__(model, lr, ema)
        model = self.model  # a Model's network
        if not is_sequence(betas, 2):
            raise CapsNetError(f"betas must be a pair (b1, b2) such as (0.9, 0.999), got {betas!r}")
        for k, beta in enumerate(betas):
            _check_hyperparameter(f"betas[{k}]", beta, 0, 1)  # beta = 1 would divide by 1 - beta^t = 0
        _check_hyperparameter("eps", eps, 0, math.inf, low_included=False)  # eps 0: 0/0 where a gradient is 0
        B = model.B
        if not np.asarray(eps, dtype=B.dtype) > 0:  # the same 0/0, where the weights' dtype rounds eps to 0
            raise CapsNetError(f"eps must be a number that {B.dtype} holds above 0 (the least is "
                               f"{float(np.finfo(B.dtype).smallest_subnormal):.3g}), got {eps!r}: it rounds to 0")
        self.b1, self.b2, self.eps = betas[0], betas[1], eps
        self.state.update({"m": {k: B.zeros(p.shape) for k, p in model.params.items()},
                           "v": {k: B.zeros(p.shape) for k, p in model.params.items()}})
        self._step_size, self._c2 = self._scalars(2)  # lr / (1 - b1^t) and 1 - b2^t, on the device
        self._write_scalars(0.0, 1.0)  # until the first prepare(): an apply() moves no weight

    def _prepare(self):
        t = self.step_count
        self._write_scalars(self.lr / (1 - self.b1 ** t), 1 - self.b2 ** t)

    def apply(self):
        B, params, grads = self.model.B, self.model.params, self.model.grads

        def update(k, block):
            # views of one block of each array: the in-place updates write through to them
            w, g, m, v = (B.xp.reshape(a, (-1,))[block] for a in (params[k], grads[k], self.state["m"][k],
                                                                  self.state["v"][k]))
            m *= self.b1
            m += (1 - self.b1) * g
            v *= self.b2
            v += (1 - self.b2) * (g * g)
            w -= self._step_size * m / (B.xp.sqrt(v / self._c2) + self.eps)

        # update() over blocks, or a backend's fused kernel for the same step (B.adam)
        B.adam(update, _sizes(params), (params, grads, self.state["m"], self.state["v"]), self.lr,
               (self.b1, self.b2), self.eps, self.step_count, scalars=(self._step_size, self._c2))
        self._apply_average()


class SGD(Optimizer):
    """Momentum SGD: buf <- mu buf + g;  w <- w - lr buf   (torch.optim.SGD's convention)."""

    moments = ("buf",)

    def __init__(self, model, lr=0.01, momentum=0.9, ema=None):
        super().__init__(model, lr, ema)
        model = self.model  # a Model's network
        _check_hyperparameter("momentum", momentum, 0, 1, high_included=True)
        self.momentum = momentum
        self.state["buf"] = {k: model.B.zeros(p.shape) for k, p in model.params.items()}
        (self._lr,) = self._scalars(1)

    def _prepare(self):
        self._write_scalars(self.lr)

    def apply(self):
        B, params, grads = self.model.B, self.model.params, self.model.grads

        def update(k, block):
            w, g, buf = (B.xp.reshape(a, (-1,))[block] for a in (params[k], grads[k], self.state["buf"][k]))
            buf *= self.momentum
            buf += g
            w -= self._lr * buf

        B.over_blocks(update, _sizes(params))
        self._apply_average()


def _network(model, who: str):
    """The network an optimizer updates: a Network, or the one a Model (pycapsnet.build, load) holds."""
    net = getattr(model, "network", model)
    if not isinstance(net, Network) and not all(hasattr(net, k) for k in ("B", "params", "grads")):
        raise CapsNetError(f"{who} updates a network's parameters: give it a Model (pycapsnet.build(...)) or its "
                           f".network, not {type(model).__name__}")
    return net


def _sizes(params) -> dict:
    """Elements of each parameter: the flat arrays the optimizers update block by block."""
    return {k: math.prod(p.shape) for k, p in params.items()}


NAMES = ("adam", "sgd")


def make(name: str, model, lr: float, ema: float | None = None):
    if name == "adam":
        return Adam(model, lr, ema=ema)
    if name == "sgd":
        return SGD(model, lr, ema=ema)
    raise ValueError(f"unknown optimizer {name!r}: use one of {NAMES}")


def exponential_lr(base_lr: float, decay: float, epoch: int, floor: float | None = None) -> float:
    """Learning rate of epoch ``epoch`` (0-based): base_lr * decay^epoch, and never below ``floor``."""
    lr = base_lr * decay ** epoch
    return lr if floor is None else max(lr, floor)

"""A whole train step -- loss, backward and optimizer update -- recorded once and replayed; and the
evaluation forward likewise.

On a GPU, a CapsNet step at batch 64 is some 900 small array operations.  Launching them one by one
from Python takes longer than running them: on an H100, torch:cuda's step took 7.8 ms op by op and
4.2 ms replayed (benchmarks/results-h100-batch64.json).  ``CapturedStep`` records the step's device
work once, through the backend's ``capture`` (a CUDA graph on torch:cuda and CuPy), and each call
then copies the batch into the recording's fixed input arrays, writes the optimizer's scalars of
this step and replays the recording.

The math is the same code as the ordinary step: what is recorded is ``Network.train_step_grads_on_device``
(zero_grad, forward, both losses, backward) followed by ``Optimizer.apply``.  Only the host-side
parts stay outside: the input checks and ``Optimizer.prepare`` (step count, learning rate, bias
corrections).  So ::

    step = CapturedStep(model, opt, batch_size=64)
    out = step(x, y)          # the same as: out = model.train_step_grads(x, y); opt.step()

for batches of that size.  ``out`` holds the recording's output arrays, which the next call
overwrites: read what you need from it (``out.loss``, ``out.lengths``) before calling again.

``CapturedEval`` records the evaluation of a batch the same way: ``model.loss_on_device`` (forward with the
label mask, both losses, the predicted classes), no backward, no update.  Evaluating op by op, a GPU
waits on the launches just as a train step does.

On a backend without graphs (``backend.can_capture`` False) ``capture`` runs the step again on each
call, with host transfers refused: the tests use that to show, on the CPU, that the recorded part
does no host work (which a CUDA graph could not replay).
"""
from __future__ import annotations

import numpy as np

from ..errors import CapsNetError
from ..core.checks import require_batch_size
from ..core.model import Outputs


class _Recording:
    """``work()`` recorded once on fixed input arrays ``x`` (N, C, H, W) and ``y`` (N,); each call
    copies a batch of that size into them and replays the recording."""

    def __init__(self, model, batch_size: int, compile: bool = False):
        require_batch_size(batch_size)
        B = model.B
        self.model, self.batch_size, self.compile = model, batch_size, compile
        # the recording reads its batch from these arrays, at these addresses, on every replay
        self.x = B.zeros((batch_size, *model.input_shape))          # (N, C, H, W)
        self.y = B.asarray(np.zeros(batch_size, np.int64))                  # (N,) labels
        self._out = None
        self._replay = None
        self.needs_labels = True

    def _record(self, work):
        if self.compile:  # fused kernels of the same work, then recorded like it (backend.compile)
            work()  # once as is first: constants a layer builds on its first call come from the host
            work = self.model.B.compile(work)

        def run():
            self._out = work()

        self._replay = self.model.B.capture(run)

    def _before_replay(self):
        """Host work of each call (the optimizer's scalars for this step)."""

    def __call__(self, x, y=None) -> Outputs:
        x, y = self.model.checked(x, y)
        if x.shape[0] != self.batch_size:
            raise CapsNetError(f"this captured {self.what} takes batches of {self.batch_size}, got {x.shape[0]}; "
                               f"run other sizes {self.otherwise}")
        if y is None and self.needs_labels:
            raise CapsNetError(f"this captured {self.what} takes labels y with the images")
        self.x[...] = x
        if y is not None:
            self.y[...] = y
        self._before_replay()
        self._replay()
        return self._out.renewed()  # the recording's arrays, now holding this call's values


class CapturedStep(_Recording):
    what, otherwise = "step", "with model.train_step_grads + optimizer.step"

    def __init__(self, model, optimizer, batch_size: int, compile: bool = False):
        super().__init__(model, batch_size, compile)
        B = model.B
        self.optimizer = optimizer

        def step():
            out = model.train_step_grads_on_device(self.x, self.y)
            optimizer.apply()
            return out

        # Capturing runs the step (warm-up runs, or the step itself without graphs), which changes
        # the weights, the running statistics and the optimizer's moments: keep them on the host, put
        # them back after.
        arrays = [*model.params.values(), *model.buffers.values(),  # batch norm's running statistics too
                  *(a for slot in optimizer._slots() for a in optimizer.state[slot].values())]
        saved = [np.array(B.to_numpy(a)) for a in arrays]  # copies (NumPy's to_numpy returns the array)
        self._record(step)
        for a, host in zip(arrays, saved):
            a[...] = B.asarray(host)

    def _before_replay(self):
        self.optimizer.prepare()


class CapturedEval(_Recording):
    """The evaluation of a batch with its labels, ``model.loss(x, y)``, recorded: ``out.loss``,
    ``out.parts`` and ``out.predictions`` as op by op.  With ``labels=False``, the forward that
    ``model.predict`` runs (no decoder, no losses), called without labels: ``out.predictions``.
    Nothing is updated, so recording changes nothing.  Like any forward, each call keeps what a
    backward would need: ``model.release()`` after the evaluation (the recording's own arrays live
    as long as it does)."""
    what, otherwise = "evaluation", "with model.loss or model.predict"

    def __init__(self, model, batch_size: int, labels: bool = True, compile: bool = False):
        super().__init__(model, batch_size, compile)
        self.needs_labels = labels
        if labels:
            self._record(lambda: model.loss_on_device(self.x, self.y))
        else:
            self._record(lambda: model.forward_on_device(self.x, None, reconstruct=False))
        model.release()

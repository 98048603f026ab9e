"""Data-parallel training on torch.distributed.

Every process ("rank") runs the same hand-written step on its shard of each global batch; the
gradients are summed across the ranks and every rank applies the same optimizer update, so all
ranks hold the same weights throughout.  ``torchrun --nproc_per_node N train_numpy.py ...``
launches it: torchrun sets WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, and the
trainer finds them (``launched``).  The collectives act on torch tensors that share the backend's
memory (``Backend.as_torch``): NumPy arrays as ``torch.from_numpy`` views over gloo, torch tensors
as they are (gloo on the CPU, NCCL on CUDA), CuPy arrays through DLPack over NCCL.

Why it is exact.  The losses are means over a batch, so rank k's gradient g_k is the mean over its
n_k images, and the global batch's mean gradient is g = sum_k (n_k / n) g_k with n = sum_k n_k.
Each rank scales its gradients by n_k / n and the sum over ranks is g: what one process computes
for the whole global batch, up to the order of the additions.  The shuffle and the augmentation's
shifts are drawn from the seeded generator for the whole global batch on every rank, which keeps
its shard's (``data.batches``' ``part``): the images are those of one process's batch.
"""
from __future__ import annotations

import datetime
import os

import numpy as np

from ..errors import CapsNetError

ENVIRONMENT = ("WORLD_SIZE", "RANK", "LOCAL_RANK")
# How long a collective waits for the other processes (seconds), e.g. while rank 0 writes a
# checkpoint; after that the run stops with GroupFailed.  PYCAPSNET_COLLECTIVE_TIMEOUT overrides.
TIMEOUT = 600


class GroupFailed(RuntimeError):
    """A collective with the other processes failed: one of them stopped, or cannot be reached."""


# SIGTERM is torchrun's word to the surviving processes when one of them fails (and a scheduler's
# before a kill).  The handler only notes it; the process stops at its next collective, between
# two steps.  Raising from the handler instead would land wherever Python happens to be: inside
# the except clause of a collective that failed at the same moment, in a finalizer ("Exception
# ignored ..."), or in an atexit hook, and the exit code would depend on which came first.
_told_to_stop: list[int] = []


def note_stop(signum, frame):
    _told_to_stop.append(signum)


def _stop_if_told():
    if _told_to_stop:
        raise GroupFailed("another process of this run stopped: torchrun (or a scheduler) told this one to stop "
                          "with SIGTERM")


def launched() -> bool:
    """Whether this process is one of several that torchrun (or the same variables) started."""
    return all(k in os.environ for k in ENVIRONMENT) and int(os.environ["WORLD_SIZE"]) > 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def shard(n: int, rank: int, world: int) -> slice:
    """Rank ``rank``'s part of n items, in order: sizes differ by at most one (np.array_split's)."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (rank < extra))


class Group:
    """This process's place in the run, and the collectives the trainer needs."""

    def __init__(self, backend):
        try:
            import torch
            import torch.distributed as dist
        except ImportError:
            raise CapsNetError("training on several processes runs on torch.distributed, and PyTorch is not "
                               "installed: pip install torch (a single process needs no torch)") from None
        self.torch, self.dist, self.B = torch, dist, backend
        self.world, self.rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        self.kind = backend.collective_backend
        timeout = datetime.timedelta(seconds=float(os.environ.get("PYCAPSNET_COLLECTIVE_TIMEOUT", TIMEOUT)))
        if self.kind == "nccl":
            torch.cuda.set_device(local_rank())
        try:
            dist.init_process_group(self.kind, rank=self.rank, world_size=self.world, timeout=timeout)
        except (RuntimeError, ValueError) as e:
            raise GroupFailed(f"could not join the other {self.world - 1} processes of this run: "
                              f"{str(e).splitlines()[0]}") from None

    @property
    def writes(self) -> bool:
        """Rank 0 alone writes the run's files and prints."""
        return self.rank == 0

    def part(self, n: int) -> slice:
        return shard(n, self.rank, self.world)

    def sum_(self, x):
        """``x`` (a backend array) summed over the ranks, in place: every rank ends with the sum."""
        self._run(self.dist.all_reduce, x)
        return x

    def broadcast_(self, x, src: int = 0):
        """``x`` replaced by rank ``src``'s ``x`` on every rank."""
        self._run(self.dist.broadcast, x, src=src)
        return x

    def sum_values(self, values) -> np.ndarray:
        """Host numbers summed over the ranks (in float64 on the backend's device)."""
        x = self.B.asarray(np.asarray(values, np.float64), dtype="float64")
        return self.B.to_numpy(self.sum_(x))

    def agree(self, error: Exception | None) -> None:
        """Every rank says whether it can go on; all stop if one cannot.  The rank that failed
        raises its own error; the others say which rank stopped."""
        failed = self.B.asarray(np.array([self.rank + 1 if error else 0], np.float64), dtype="float64")
        self._run(self.dist.all_reduce, failed, op=self.dist.ReduceOp.MAX)
        if error is not None:
            raise error
        first = int(self.B.to_numpy(failed)[0])
        if first:
            raise GroupFailed(f"process {first - 1} of this run stopped (its message says why); stopping too")

    def _run(self, collective, x, **kwargs):
        _stop_if_told()
        self.B.synchronize()  # the backend's queued work on x is done before the collective reads it
        tensor = self.B.as_torch(x)
        try:
            collective(tensor, **kwargs)
        except (RuntimeError, ValueError) as e:  # gloo: "Connection closed by peer", timeouts; NCCL errors
            _stop_if_told()  # both at once: one message whichever came first
            raise GroupFailed(f"another process of this run stopped or cannot be reached "
                              f"({str(e).splitlines()[0]})") from None
        if tensor.is_cuda:  # NCCL ran on torch's stream; the backend may read x from another
            self.torch.cuda.synchronize(tensor.device)

    def close(self):
        if self.dist.is_initialized():
            self.dist.destroy_process_group()


def data_parallel_grads(model, group, x, y, n):
    """This process's shard (x, y) of a global batch of n images: every process ends with the
    global batch's mean gradient in ``model.grads`` (each shard's mean gradient weighted by its
    share of the batch, summed over the processes: the module's docstring says why that is exact).
    Returns the global batch's (loss sum, correct predictions)."""
    if len(y):
        out = model.train_step_grads(x, y)
        model.flat_grads *= len(y) / n
        mine = [out.loss * len(y), int((out.predictions == y).sum())]
    else:  # a last batch smaller than the number of processes leaves some without images
        model.zero_grad()
        mine = [0.0, 0]
    group.sum_(model.flat_grads)
    loss_sum, correct = group.sum_values(mine)
    return float(loss_sum), int(correct)


def share_rank0_state(group, model, opt):
    """Rank 0's weights and optimizer state on every process.  They are equal already (the same
    seed, or the same checkpoint); this makes it so whatever each process read."""
    for a in [*model.params.values(), *model.buffers.values(),
              *(a for state in opt.state.values() for a in state.values())]:
        group.broadcast_(a)


def average_buffers(group, model):
    """At an epoch's end: each process's running statistics (batch norm's, gathered from its own
    shards) replaced by their mean over the processes, so that every process evaluates, and the
    checkpoint keeps, the same."""
    for b in model.buffers.values():
        group.sum_(b)
        b /= group.world

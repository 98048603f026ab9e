"""Where a data-parallel step's time goes: computing the shard's gradients, summing them across the
processes, and the optimizer's update, against one process doing the whole global batch.

    python benchmarks/distributed_step.py --global-batch 64                         # one process
    torchrun --standalone --nproc_per_node 2 benchmarks/distributed_step.py --global-batch 64
    torchrun --standalone --nproc_per_node 1 benchmarks/distributed_step.py --backend torch --device cuda
        # one GPU through the distributed path (NCCL), against the same without torchrun

The paper's CapsNet in float32 on the numpy backend (--backend torch for torch); times per step,
medians over --steps steps after 2 warm-up steps.  Rank 0 prints one line of JSON, and appends it
to --json FILE if given.  torchrun gives each process one thread unless OMP_NUM_THREADS says
otherwise; the single process uses the machine's threads.

    torchrun --standalone --nproc_per_node 2 benchmarks/distributed_step.py --overlap
        # the sum started early for the gradients that are final first, against the sum at the end

--overlap times gradients + sum both ways, alternating step by step: the trainer's way (one sum of
the flat gradient after the backward) and with the gradients of ClassCaps and the decoder (the
flat gradient's tail, final once ClassCaps' backward returns) summed asynchronously while
PrimaryCaps and conv1 run their backward, the rest summed at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

from pycapsnet import backends  # noqa: I001  (before NumPy: it sets NumPy's BLAS thread timeout, see backends/__init__.py)
import numpy as np

if __package__ in (None, ""):  # run by path (torchrun): the repository root, for benchmarks.provenance
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pycapsnet.backends.host import cpu_info  # noqa: E402
from benchmarks.provenance import code_version  # noqa: E402
from pycapsnet.training.argtypes import positive_int, writable_file  # noqa: E402


def cpu_model() -> str:
    """The CPU's name with its family, model and widest vector unit, e.g. "AMD EPYC (family 25 model
    17, AVX-512)": a virtual machine often names only the brand, and two machines named alike can
    differ in what decides the benchmarks (AVX-512 or not, and so which BLAS kernels run)."""
    info = cpu_info()
    name = info.get("model name") or platform.processor() or "unknown CPU"
    flags = info.get("flags", "").split()
    vector = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else None
    detail = [f"family {info['cpu family']} model {info['model']}" if "cpu family" in info and "model" in info else None,
              vector]
    detail = ", ".join(d for d in detail if d)
    return f"{name} ({detail})" if detail else name


def _gpu_name(B):
    if "cuda" not in str(B.device):
        return None
    import torch

    return torch.cuda.get_device_name()


def measure(backend: str, global_batch: int, steps: int, device: str | None = None) -> dict:
    from pycapsnet.training import data, distributed
    from pycapsnet.core.model import CapsNet
    from pycapsnet.training.optim import Adam

    # Under torchrun the group is made even for one process (the trainer then takes the plain path):
    # that is how the distributed path's own cost on one GPU is measured.
    launched = "WORLD_SIZE" in os.environ
    B = backends.get(backend, device=backends.device_for_rank(device, distributed.local_rank(), backend)
                     if launched else device, dtype="float32")
    group = distributed.Group(B) if launched else None
    train, _ = data.load_embedded()
    model = CapsNet(B)
    opt = Adam(model)
    rng = np.random.default_rng(0)
    part = group.part(global_batch) if group else slice(None)
    times = {"compute": [], "sum": [], "update": [], "step": []}
    for step in range(steps + 2):
        idx = rng.integers(0, len(train), global_batch)[part]
        x, y = train.x[idx], train.y[idx]
        B.synchronize()
        t0 = time.perf_counter()
        if group is None:
            model.train_step_grads(x, y)
            B.synchronize()
            t1 = t2 = time.perf_counter()
        else:  # distributed.data_parallel_grads, timed in its two parts
            out = model.train_step_grads(x, y)
            model.flat_grads *= len(y) / global_batch
            out.loss  # the loss is read in the trainer's step too
            B.synchronize()
            t1 = time.perf_counter()
            group.sum_(model.flat_grads)
            group.sum_values([0.0, 0])
            t2 = time.perf_counter()
        opt.step()
        B.synchronize()
        t3 = time.perf_counter()
        if step >= 2:
            for k, v in zip(times, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
                times[k].append(v)
    med = {k: statistics.median(v) for k, v in times.items()}
    world = group.world if group else 1
    result = {"backend": B.label, "processes": world, "global_batch": global_batch,
              "threads_per_process": B.threads, "cpu": cpu_model(), "gpu": _gpu_name(B), "steps": steps,
              **{f"{k}_ms": round(1e3 * v, 1) for k, v in med.items()},
              "sum_share": round(med["sum"] / med["step"], 3),
              "samples_per_s": round(global_batch / med["step"], 1),
              "gradient_mb": round(model.flat_grads.nbytes / 2**20, 1) if hasattr(model.flat_grads, "nbytes") else None}
    if group:
        group.close()
    return result


def overlap(backend: str, global_batch: int, steps: int, device: str | None = None) -> dict:
    """Gradients + sum per step (ms, medians), the sum at the end against the tail's sum overlapped."""
    import torch.distributed as dist

    from pycapsnet.training import data, distributed
    from pycapsnet.core.model import CapsNet

    B = backends.get(backend, device=backends.device_for_rank(device, distributed.local_rank(), backend),
                     dtype="float32")
    group = distributed.Group(B)
    train, _ = data.load_embedded()
    model = CapsNet(B)
    sizes = [sum(int(np.prod(p.shape)) for p in layer.params.values()) for _, layer in model.layers()]
    names = [name for name, _ in model.layers()]
    cut = sum(sizes[:names.index("classcaps")])  # ClassCaps and the decoder lie after PrimaryCaps
    rng = np.random.default_rng(0)
    part = group.part(global_batch)
    pending, mode = [], ["end"]
    share = None
    classcaps_backward = model.classcaps.backward

    def backward_then_start_tail(*args, **kwargs):
        out = classcaps_backward(*args, **kwargs)
        if mode[0] == "overlap":
            tail = model.flat_grads[cut:]
            tail *= share
            B.synchronize()
            pending.append(dist.all_reduce(B.as_torch(tail), async_op=True))
        return out

    model.classcaps.backward = backward_then_start_tail
    times = {"end": [], "overlap": []}
    sums = {}
    for step in range(2 * (steps + 2)):
        mode[0] = "end" if step % 2 == 0 else "overlap"
        if step < 2 * (steps + 1) or mode[0] == "end":  # the last two steps: the same batch both ways
            idx = rng.integers(0, len(train), global_batch)[part]
        share = len(idx) / global_batch
        B.synchronize()
        t0 = time.perf_counter()
        model.train_step_grads(train.x[idx], train.y[idx])
        if mode[0] == "end":
            model.flat_grads *= share
            group.sum_(model.flat_grads)
        else:
            head = model.flat_grads[:cut]
            head *= share
            group.sum_(head)
            for work in pending:
                work.wait()
            pending.clear()
        B.synchronize()
        if 2 <= step < 2 * (steps + 1):
            times[mode[0]].append(time.perf_counter() - t0)
        sums[mode[0]] = B.to_numpy(model.flat_grads).copy()
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {"backend": B.label, "processes": group.world, "global_batch": global_batch,
              "cpu": cpu_model(), "gpu": _gpu_name(B), "steps": steps,
              "gradients_and_sum_ms": round(1e3 * med["end"], 1),
              "overlapped_ms": round(1e3 * med["overlap"], 1),
              "overlapped_share_of_gradient": round(1 - cut / sum(sizes), 3),
              "same_sum": bool(np.array_equal(sums["end"], sums["overlap"]))}  # of one batch, both ways
    group.close()
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="numpy", choices=backends.NAMES)
    p.add_argument("--device", default=None, help="torch: cpu (default) or cuda")
    p.add_argument("--global-batch", type=positive_int, default=64)
    p.add_argument("--steps", type=positive_int, default=8)
    p.add_argument("--json", type=writable_file, default=None, help="append the result line to this file")
    p.add_argument("--overlap", action="store_true", help="under torchrun: the sum at the end against the "
                   "sum of ClassCaps' and the decoder's gradients overlapped with the rest of the backward")
    args = p.parse_args(argv)
    if args.overlap and "WORLD_SIZE" not in os.environ:
        p.exit(2, f"{p.prog}: error: --overlap measures a data-parallel run: start it with torchrun\n")
    result = (overlap if args.overlap else measure)(args.backend, args.global_batch, args.steps, args.device)
    if int(os.environ.get("RANK", 0)) == 0:  # the code it measured: read once, by the rank that reports
        result = {"code": code_version(), **result}
        print(json.dumps(result))
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()

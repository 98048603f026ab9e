"""What pycapsnet.torch costs: a train step's gradients of the paper's network through the torch
wrapper (pct.Network(model).loss(x, y).backward()) against the same layers called directly
(model.train_step_grads(x, y)), on the torch backend, same weights and batch.

    python benchmarks/torch_wrapper.py [--device cpu|cuda] [--batch 32] [--steps 5]

Prints the median step of each and the wrapper's overhead; the wrapper's extra work is copying
the input, the outputs and, for each backward, what the forward saved (the backward consumes it)."""
import argparse
import platform
import statistics
import subprocess
import time

import numpy as np

from pycapsnet import backends
import pycapsnet.torch as pct
from pycapsnet import CapsNet


def _step_times(fn, steps, sync):
    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return times


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    B = backends.get("torch", device=args.device, dtype=args.dtype)
    torch = B.torch
    model = CapsNet(B, seed=0)
    module = pct.Network(model)
    rng = np.random.default_rng(0)
    x_host, y_host = rng.random((args.batch, 1, 28, 28)).astype(args.dtype), rng.integers(0, 10, args.batch)
    x, y = B.asarray(x_host), torch.as_tensor(y_host, device=B.device)

    def direct():
        model.train_step_grads(x, y_host)

    def wrapped():
        module.zero_grad(set_to_none=True)
        module.loss(x, y).backward()

    sync = B.synchronize
    rows = {"direct": [], "wrapper": []}
    for name, fn in (("direct", direct), ("wrapper", wrapped)):
        _step_times(fn, 1, sync)  # warm-up
    for _ in range(args.steps):  # alternate steps: the machine's drift falls on both alike
        for name, fn in (("direct", direct), ("wrapper", wrapped)):
            rows[name].extend(_step_times(fn, 1, sync))
    d, w = statistics.median(rows["direct"]), statistics.median(rows["wrapper"])
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("Model name")),
                      platform.processor())
    device = torch.cuda.get_device_name() if B.device.startswith("cuda") else f"{model_name}, {torch.get_num_threads()} threads"
    print(f"paper network, torch:{B.device} {args.dtype}, batch {args.batch}, {device}")
    print(f"direct  {1e3 * d:8.1f} ms/step (median of {len(rows['direct'])})")
    print(f"wrapper {1e3 * w:8.1f} ms/step (median of {len(rows['wrapper'])})")
    print(f"overhead {100 * (w / d - 1):+.1f}%")


if __name__ == "__main__":
    main()

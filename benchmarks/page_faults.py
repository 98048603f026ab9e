"""Whether a train step touches fresh memory: the paper CapsNet's step (batch 64, float32) on one
backend, and per step the process's CPU time, its user and kernel parts and its minor page faults
(getrusage), over --steps steps after --warmup warm-up steps (default 3).  A step that took fresh
pages for its buffers would fault once per 4 KB page it writes (about 100,000 a step) and spend tens
of milliseconds in the kernel clearing them; docs/performance.md quotes it.  ``--each`` prints every
step from the first, with the process's resident size: how long the heap takes to stop growing.

    OMP_NUM_THREADS=1 PYCAPSNET_THREADS=1 python benchmarks/page_faults.py [--backend torch] [--steps 8]
    OMP_NUM_THREADS=1 PYCAPSNET_THREADS=1 python benchmarks/page_faults.py --backend torch --routing vb \
        --each --steps 12
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __package__ in (None, ""):
    sys.path.insert(0, ROOT)

from pycapsnet import backends  # noqa: I001  (before NumPy: it sets NumPy's BLAS thread timeout)
import numpy as np

from pycapsnet.backends.host import process_memory
from pycapsnet.core.model import CapsNet
from pycapsnet.training import data
from pycapsnet.training.optim import Adam


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="numpy", choices=("numpy", "torch"))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--routing", default="dynamic", help="the paper network's class layer routed by NAME")
    ap.add_argument("--each", action="store_true", help="every step from the first, with the resident size")
    args = ap.parse_args()
    B = backends.get(args.backend, dtype="float32")
    train, _ = data.load_embedded()
    idx = np.random.default_rng(0).integers(0, len(train), 64)
    x, y = data.as_float(train.x[idx]), train.y[idx]
    model = CapsNet(B, routing=args.routing)
    opt = Adam(model, 1e-3)
    for k in range(args.warmup + args.steps if args.each else args.warmup):
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.process_time()
        model.train_step_grads(x, y)
        opt.step()
        if args.each:
            r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.process_time()
            rss = process_memory()["current"] / 2**20
            print(f"step {k + 1}: CPU {1e3 * (t1 - t0):.0f} ms (kernel {1e3 * (r1.ru_stime - r0.ru_stime):.0f}), "
                  f"{r1.ru_minflt - r0.ru_minflt} minor page faults, resident {rss:.0f} MB", flush=True)
    if args.each:
        return
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.process_time()
    for _ in range(args.steps):
        model.train_step_grads(x, y)
        opt.step()
    r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.process_time()
    per = lambda a, b: 1e3 * (b - a) / args.steps  # noqa: E731
    print(f"{args.backend}: per step CPU {per(t0, t1):.1f} ms (user {per(r0.ru_utime, r1.ru_utime):.1f}, kernel "
          f"{per(r0.ru_stime, r1.ru_stime):.1f}), minor page faults {(r1.ru_minflt - r0.ru_minflt) / args.steps:.0f}")

if __name__ == "__main__":
    main()

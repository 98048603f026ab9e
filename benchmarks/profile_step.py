"""Where a train step's time goes: each layer's forward and backward timed inside real steps.

    python benchmarks/profile_step.py                  # numpy, paper CapsNet, float32, batch 64
    python benchmarks/profile_step.py --backend torch --batch-size 32
    python benchmarks/profile_step.py --network efficient   # a described network: each of its layers

Times are per step, averaged over --steps steps after 2 warm-up steps.  "rest" is the step minus the
timed parts: the decoder, the losses, masking and the glue between layers.  "products" is the part
of each spent in the backend's matrix products (B.matmul and B.predictions, û = W u, called from the
step's own thread; products inside split_batch's blocks count as the rest of their layer), so
"other" is the memory-bound work around them: copies, the routing passes, squash, Adam.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __package__ in (None, ""):  # run by path: the repository root, for benchmarks.bench
    sys.path.insert(0, ROOT)

from pycapsnet import backends  # noqa: I001  (before NumPy: it sets NumPy's BLAS thread timeout, see backends/__init__.py)
import numpy as np

from pycapsnet.training.argtypes import positive_int


def profile(backend="numpy", batch=64, steps=4, warmup=2, network=None):
    from pycapsnet.training import data
    from pycapsnet.core.model import CapsNet
    from pycapsnet.training.optim import Adam

    B = backends.get(backend, dtype="float32")
    train, _ = data.load_embedded()
    idx = np.random.default_rng(0).integers(0, len(train), batch)
    x, y = train.x[idx], train.y[idx]
    if network is None:
        model = CapsNet(B)
    else:
        from pycapsnet.core import architecture

        model = architecture.build(dict(architecture.load(network), input_shape=[1, 28, 28], n_classes=10), B)
    opt = Adam(model)
    spent, in_products = {}, {}
    main_thread, products = threading.main_thread(), [0.0]  # seconds in B.matmul, on the step's thread

    def timed(obj, method, label):
        inner = getattr(obj, method)

        def wrapper(*args, **kwargs):
            B.synchronize()
            t, p = time.perf_counter(), products[0]
            out = inner(*args, **kwargs)
            B.synchronize()
            spent[label] = spent.get(label, 0.0) + time.perf_counter() - t
            in_products[label] = in_products.get(label, 0.0) + products[0] - p
            return out
        setattr(obj, method, wrapper)

    depth = [0]  # B.predictions may call B.matmul: count the outer call only

    def timed_product(inner):
        def product(*args, **kwargs):
            if threading.current_thread() is not main_thread or depth[0]:
                return inner(*args, **kwargs)
            B.synchronize()
            t, depth[0] = time.perf_counter(), 1
            try:
                out = inner(*args, **kwargs)
                B.synchronize()
            finally:
                depth[0] = 0
            products[0] += time.perf_counter() - t
            return out
        return product
    B.matmul, B.predictions = timed_product(B.matmul), timed_product(B.predictions)

    parts = [(model.conv1, "conv1"), (model.primary, "PrimaryCaps (convolution + squash)"),
             (model.classcaps, "ClassCaps (u_hat = W u, routing)")] if network is None else \
        [(layer, f"{name} ({type(layer).__name__})") for name, layer in model.body]
    for layer, label in parts:
        timed(layer, "forward", f"{label} forward")
        timed(layer, "backward", f"{label} backward")
    timed(opt, "step", "Adam")
    for k in range(warmup + steps):
        if k == warmup:
            spent.clear()
            in_products.clear()
            products[0] = 0.0
            B.synchronize()
            start = time.perf_counter()
        model.train_step_grads(x, y)
        opt.step()
    B.synchronize()
    step = (time.perf_counter() - start) / steps
    rows = [(label, t / steps, in_products[label] / steps) for label, t in spent.items()]
    rows.append(("rest (decoder, losses, glue)", step - sum(t for _, t, _ in rows),
                 (products[0] - sum(in_products.values())) / steps))
    return step, rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="numpy", help="numpy, torch, torch:cuda or cupy")
    p.add_argument("--batch-size", type=positive_int, default=64)
    p.add_argument("--steps", type=positive_int, default=4)
    p.add_argument("--network", default=None, help="a described network (a JSON file, or efficient) for 28x28 digits")
    args = p.parse_args(argv)
    from benchmarks.bench import thread_counts, threads_text

    try:
        B = backends.get(args.backend, dtype="float32")
        step, rows = profile(B, args.batch_size, args.steps, network=args.network)
    except backends.BackendError as e:  # unknown name, missing library or GPU
        p.exit(2, f"{p.prog}: error: {e}\n")
    print(f"{args.backend}, batch {args.batch_size}: {step:.3f} s per train step "
          f"({args.batch_size / step:.1f} samples/s); threads: {threads_text(thread_counts(B))}")
    print(f"  {'':44s} {'time':>8s} {'share':>6s} {'products':>9s} {'other':>7s}")
    for label, t, p in rows + [("step", step, sum(p for _, _, p in rows))]:
        print(f"  {label:44s} {t:6.3f} s {100 * t / step:5.1f}% {p:7.3f} s {t - p:5.3f} s")


if __name__ == "__main__":
    main()

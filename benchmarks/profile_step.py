"""Where a train step's time goes: each layer's forward and backward timed inside real steps.

    python benchmarks/profile_step.py                  # numpy, paper CapsNet, float32, batch 64
    python benchmarks/profile_step.py --backend torch --batch-size 32
    python benchmarks/profile_step.py --network efficient   # a described network: each of its layers

Times are per step, averaged over --steps steps after 2 warm-up steps.  "rest" is the step minus the
timed parts: the decoder, the losses, masking and the glue between layers.  "products" is the part
of each spent in the backend's matrix products (B.matmul and B.predictions, û = W u, called from the
step's own thread; products inside split_batch's blocks count as the rest of their layer), so
"other" is the memory-bound work around them: copies, the routing passes, squash, Adam.  "CPU" is
the process's CPU time (every thread's), which a busy machine disturbs far less than wall time.
For the paper network, "floor" is the CPU time of the part's own matrix products on preallocated
operands (bench.step_products, timed in the same process after the steps) and "CPU / floor" how
far the part is from it: the products' floor only, not the bytes the elementwise passes must move.
"ideal" is the same products' FLOPs at the rate of a 2048x2048x2048 product on this machine: what
they would cost at the BLAS's best shape.  "bound" adds what the products leave out, as a fused
implementation would have to pay it: the routing passes' and Adam's FLOPs at that rate, and each
part's compulsory bytes at the memory bandwidth the same run measures (``bandwidth``; ``BYTES``
says which bytes count), so "CPU / bound" is the part's distance from this machine's physical limit.
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
    spent, in_products, cpu, sizes = {}, {}, {}, {}  # sizes: label -> (bytes in, bytes out) of one call
    main_thread, products = threading.main_thread(), [0.0]  # seconds in B.matmul, on the step's thread

    def timed(obj, method, label):
        inner = getattr(obj, method)

        def wrapper(*args, **kwargs):
            B.synchronize()
            t, c, p = time.perf_counter(), time.process_time(), products[0]
            out = inner(*args, **kwargs)
            B.synchronize()
            sizes.setdefault(label, (_nbytes(args[:1]), _nbytes(out)))
            spent[label] = spent.get(label, 0.0) + time.perf_counter() - t
            cpu[label] = cpu.get(label, 0.0) + time.process_time() - c
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
            for d in (spent, in_products, cpu):
                d.clear()
            products[0] = 0.0
            B.synchronize()
            start, start_cpu = time.perf_counter(), time.process_time()
        model.train_step_grads(x, y)
        opt.step()
    B.synchronize()
    step, step_cpu = (time.perf_counter() - start) / steps, (time.process_time() - start_cpu) / steps
    rows = [(label, t / steps, in_products[label] / steps, cpu[label] / steps) for label, t in spent.items()]
    rows.append(("rest (decoder, losses, glue)", step - sum(r[1] for r in rows),
                 (products[0] - sum(in_products.values())) / steps, step_cpu - sum(r[3] for r in rows)))
    return (step, step_cpu), rows, traffic(model, parts, sizes), pass_gflop(model, batch) if network is None else {}


def _nbytes(value) -> int:
    """Bytes of the arrays in ``value`` (an array, a tuple of them, None or a scalar)."""
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    return int(getattr(value, "nbytes", 0) or 0)


# The compulsory bytes of each part, what a fully fused step must still move through memory: forward
# reads its input and parameters and writes its output; backward reads the output gradient, its input
# again (for dW) and its parameters, and writes the input gradient and dW; Adam reads θ, g, m and v and
# writes θ, m and v; the rest moves the decoder's parameters as a layer does.  Intermediates (û, the
# columns of a convolution) do not count: a fused kernel keeps them in cache.
BYTES = "forward: x + y + θ; backward: dy + dx + x + θ + dθ; Adam: 7 θ; rest: 3 θ of the decoder"


def traffic(model, parts, sizes) -> dict:
    """{label: compulsory bytes per step} (BYTES) of the timed parts, Adam and the rest."""
    param_bytes = lambda layer: sum(_nbytes(p) for p in layer.params.values())  # noqa: E731
    out, parts_params = {}, 0
    for layer, label in parts:
        (x, y), (dy, dx), theta = sizes[f"{label} forward"], sizes[f"{label} backward"], param_bytes(layer)
        out[f"{label} forward"] = x + y + theta
        out[f"{label} backward"] = dy + dx + x + 2 * theta
        parts_params += theta
    total = sum(_nbytes(p) for p in model.params.values())
    out["Adam"] = 7 * total
    out["rest (decoder, losses, glue)"] = 3 * (total - parts_params)
    return out


# The products of bench.step_products that each part of the paper network runs (Fourier PrimaryCaps)
FLOOR_OF = {"conv1 forward": ("conv1 forward",), "conv1 backward": ("conv1 dW",),
            "PrimaryCaps (convolution + squash) forward": (
                "fourier input transform", "fourier kernel transform (forward)", "fourier forward",
                "fourier output transform"),
            "PrimaryCaps (convolution + squash) backward": (
                "fourier output transform dY", "fourier dW", "fourier kernel gradient transform",
                "fourier kernel transform (again, for dX)", "fourier dX", "fourier input transform dX"),
            "ClassCaps (u_hat = W u, routing) forward": ("classcaps u_hat",),
            "ClassCaps (u_hat = W u, routing) backward": ("classcaps dW", "classcaps du"),
            "rest (decoder, losses, glue)": ("decoder",)}


def floors(backend, batch):
    """({part: CPU seconds of its products on preallocated operands}, {part: their GFLOP}) for the
    paper network (FLOOR_OF), and the GFLOP/s of a 2048^3 product with the backend's matmul, in CPU
    time too: on one thread, what other processes on the machine cannot stretch."""
    from benchmarks.bench import gemm_floor

    per = gemm_floor(backend, batch, "float32", 3, {})["products"]
    mine = lambda labels: [v for k, v in per.items() if any(k.startswith(p) for p in labels)]  # noqa: E731
    B = backends.get(backend, dtype="float32")
    a = B.asarray(np.random.default_rng(0).standard_normal((2048, 2048)).astype(np.float32))
    B.matmul(a, a)
    best = float("inf")
    for _ in range(3):
        B.synchronize()
        c = time.process_time()
        B.matmul(a, a)
        B.synchronize()
        best = min(best, time.process_time() - c)
    return ({part: sum(v["cpu_s"] for v in mine(labels)) for part, labels in FLOOR_OF.items()},
            {part: sum(v["gflops"] for v in mine(labels)) for part, labels in FLOOR_OF.items()},
            2 * 2048 ** 3 / 1e9 / best)


def pass_gflop(model, batch) -> dict:
    """GFLOP per step of the paper network's work outside its products: dynamic routing's passes over
    û (3 iterations: three weighted sums s_j = Σ_i c_ij û_j|i and two agreements û_j|i · v_j, 2 FLOPs a
    value each; backward twice that) and Adam (about 12 FLOPs a parameter)."""
    c = model.classcaps
    u_hat = batch * model.n_positions * c.T * c.J * c.D
    routing = (2 * c.iters - 1) * 2 * u_hat / 1e9
    return {"ClassCaps (u_hat = W u, routing) forward": routing, "ClassCaps (u_hat = W u, routing) backward":
            2 * routing, "Adam": 12 * sum(int(np.prod(p.shape)) for p in model.params.values()) / 1e9}


def bandwidth(mb: int = 256, reps: int = 5) -> float:
    """GB/s of this process streaming through memory on one thread: a += b over arrays far larger than
    any cache (two reads and a write per value; in place, as Adam's updates and the layers' gradient
    sums are, so no cache line is fetched only to be overwritten), the best of ``reps`` in CPU time."""
    n = mb * 2 ** 20 // 4
    a, b = np.ones(n, np.float32), np.ones(n, np.float32)
    best = float("inf")
    for _ in range(reps):
        t = time.process_time()
        np.add(a, b, out=a)
        best = min(best, time.process_time() - t)
    return 3 * 4 * n / 1e9 / best


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="numpy", help="numpy, torch, torch:cuda or cupy")
    p.add_argument("--batch-size", type=positive_int, default=64)
    p.add_argument("--steps", type=positive_int, default=4)
    p.add_argument("--network", default=None, help="a described network (a JSON file, or efficient) for 28x28 digits")
    args = p.parse_args(argv)
    from benchmarks.bench import thread_counts, threads_text
    from benchmarks.distributed_step import cpu_model
    from benchmarks.provenance import code_version

    try:
        B = backends.get(args.backend, dtype="float32")
        (step, step_cpu), rows, moved, extra = profile(B, args.batch_size, args.steps, network=args.network)
    except backends.BackendError as e:  # unknown name, missing library or GPU
        p.exit(2, f"{p.prog}: error: {e}\n")
    floor, gflop, peak = floors(args.backend, args.batch_size) if args.network is None else ({}, {}, None)
    floor["step"], gflop["step"] = sum(floor.values()), sum(gflop.values())
    extra["step"] = sum(extra.values())
    moved["step"], bw = sum(moved.values()), bandwidth()
    code = code_version()
    print(f"{cpu_model()}, commit {code['commit'][:7]}{'' if code.get('clean') else ' (with changes)'}: "
          f"{args.backend}, batch {args.batch_size}: {step:.3f} s per train step "
          f"({args.batch_size / step:.1f} samples/s), {step_cpu:.3f} s of CPU; threads: {threads_text(thread_counts(B))}"
          + (f"; a 2048^3 product: {peak:.0f} GFLOP/s" if peak else "") + f"; memory: {bw:.1f} GB/s")
    print(f"  {'':44s} {'time':>8s} {'share':>6s} {'products':>9s} {'other':>7s} {'CPU':>8s} {'floor':>8s} "
          f"{'CPU / floor':>11s} {'ideal':>8s} {'CPU / ideal':>11s} {'MB':>6s} {'bound':>8s} {'CPU / bound':>11s}")
    for label, t, p, c in rows + [("step", step, sum(r[2] for r in rows), step_cpu)]:
        f, ideal = floor.get(label), gflop.get(label, 0) / peak if peak else None
        bound = (ideal or 0) + (extra.get(label, 0) / peak if peak else 0) + moved.get(label, 0) / 1e9 / bw
        print(f"  {label:44s} {t:6.3f} s {100 * t / step:5.1f}% {p:7.3f} s {t - p:5.3f} s {c:6.3f} s "
              + (f"{f:6.3f} s {c / f:11.2f} {ideal:6.3f} s {c / ideal:11.2f}" if f else f"{'':42s}")
              + f" {moved.get(label, 0) / 1e6:6.1f} {bound:6.3f} s {c / bound:11.2f}")

if __name__ == "__main__":
    main()

"""Benchmark: pycapsnet's hand-written backends against a PyTorch-autograd CapsNet, and against the
GEMM floor of a train step.

    python benchmarks/bench.py                         # numpy + torch vs autograd, batch 64, float32
    python benchmarks/bench.py --backends cupy cupy+eager torch:cuda torch:cuda+eager --ref-device cuda   # on a GPU
    python benchmarks/bench.py --scaling               # + throughput vs batch / routing, memory vs size
    python benchmarks/bench.py --quick                 # a seconds-long smoke run (used by the tests)
    python benchmarks/bench.py --reference both        # + the reference under torch.compile (compiles first)

Every implementation runs in its own fresh process (so memory is measured cleanly) with the same
seeded weights (pycapsnet's initialisation, copied into the reference) and the same batch of real
digits.  Throughput is the median over --steps timed steps after --warmup untimed ones; a train
step is forward + loss + backward + Adam update.  Peak memory is the process's resident-set
high-water mark during the timed steps minus its size before the model was built (so it counts
parameters, gradients, optimizer state and every temporary); on a GPU, the allocator's peak.  On
the CPU it is measured in a separate run with glibc's mmap threshold fixed at 1 MiB
(MALLOC_MMAP_THRESHOLD_), so that freed arrays leave the resident set and the high-water mark
measures live memory, not what the allocator happened to retain; that setting slows every
implementation (page faults), so throughput comes from a run without it.  In the speed run every
implementation, the autograd reference included, runs with the allocator setting the CPU backends
make (``backends.host.keep_freed_memory``: freed blocks are reused instead of returned to the OS).

The GEMM floor is the time of the step's unavoidable matrix products alone, on preallocated
operands, with the backend's own matmul: conv1 forward and weight gradient, the PrimaryCaps
convolution's three products (forward, weight gradient, input gradient), the routing transforms
(û = W u, dW, du) and the decoder's (forward, dW, dX).  efficiency = floor / step time.  Each
speed run times the floor in its own process right after its steps.  step / own products is taken
in pairs (``paired_steps``): one train step, then one pass over the products that step runs, --steps
times in each run; it is the median over every pair of every round, the range the rounds' medians.
On a shared machine whose speed drifts within seconds, a step and a floor timed apart would move
the ratio as much as the step's own work does; the two halves of a pair are seconds apart at most.
Results: a table on stdout and JSON (--json, default benchmarks/results.json).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np
from threadpoolctl import threadpool_info

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __package__ in (None, ""):  # run by path: the repository root, for benchmarks.distributed_step
    sys.path.insert(0, ROOT)

from pycapsnet.backends import NAMES
from pycapsnet.backends.base import FLOAT_DTYPES
from pycapsnet.backends.host import kernels_of
from pycapsnet.backends.torch_backend import is_torch_device  # (imports no torch)
from benchmarks.distributed_step import cpu_model
from benchmarks.provenance import code_version
from pycapsnet.training.argtypes import nonnegative_int, positive_int, writable_file
from pycapsnet.core.capsules import PrimaryCaps
from pycapsnet.tools.tables import format_table
from pycapsnet.core.model import routing_names

QUICK = dict(conv_channels=16, primary_types=4)


# ---------------------------------------------------------------------------------------------
# workers: one measurement each, in a fresh process
# ---------------------------------------------------------------------------------------------
def _batch(n, size=28, seed=0):
    from pycapsnet.training import data

    tr, _ = data.load_embedded()
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(tr), n)
    x, y = tr.x[idx], tr.y[idx]
    if size != 28:  # larger inputs for the memory scaling: the digit on a bigger canvas
        big = np.zeros((n, 1, size, size), np.float32)
        o = (size - 28) // 2
        big[:, :, o:o + 28, o:o + 28] = x
        x = big
    return x, y


def _median_time(fn, warmup, steps, sync, cpu=None):
    """(median wall seconds of fn, each call's); ``cpu``: a list that gets each call's process CPU
    seconds (every thread's), which a busy machine disturbs far less than wall time."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(steps):
        t, c = time.perf_counter(), time.process_time()
        fn()
        sync()
        times.append(time.perf_counter() - t)
        if cpu is not None:
            cpu.append(time.process_time() - c)
    return float(np.median(times)), times


def worker(impl, batch, dtype, warmup, steps, config, input_size=28, floor=False):
    """Measure one implementation: 'numpy', 'torch', 'torch:cuda', 'cupy', 'autograd', 'autograd:cuda'.
    With ``floor``, then also the GEMM floor (``gemm_floor``) and the pairs of a step and its own
    products (``paired_steps``), in the same process right after the steps."""
    from pycapsnet.backends.host import keep_freed_memory, process_memory

    keep_freed_memory()  # what the CPU backends do (backends/numpy_backend.py): the reference gets it too
    x, y = _batch(batch, input_size)
    cfg = dict(config, input_shape=(1, input_size, input_size))
    setup = _reference_step if impl.startswith("autograd") else _pycapsnet_step
    made = setup(impl, batch, dtype, cfg, x, y)
    if "error" in made:
        return made
    train, evaluate, sync, reset, mem_fn = made["train"], made["evaluate"], made["sync"], made["reset"], made["mem_fn"]

    # warm up, then measure the train step's peak memory over the timed steps
    for _ in range(warmup):
        train()
    sync()
    reset()
    cpu = []
    t_train, all_train = _median_time(train, 0, steps, sync, cpu)
    if mem_fn is None:
        peak = process_memory()["peak"] - made["mem0"]
    else:
        peak = mem_fn()
    t_eval, _ = _median_time(evaluate, 1, steps, sync)
    out = {"impl": impl, "label": made["label"], "batch": batch, "dtype": dtype, "input_size": input_size,
           "threads": thread_counts(made.get("backend")), "params": int(made["n_params"]),
           "train_step_s": t_train, "train_samples_per_s": batch / t_train,
           "train_cpu_step_s": float(np.median(cpu)),  # on a GPU: the host's share only
           "train_step_all_s": all_train, "eval_samples_per_s": batch / t_eval,
           "peak_train_mem_mb": peak / 2**20, "routing_iters": made["routing_iters"],
           "share_spatial": bool(cfg.get("share_spatial", False)), "compile_s": made.get("compile_s")}
    if floor:
        operands = _floor_operands(impl, batch, dtype, config)
        out["floor"] = gemm_floor(impl, batch, dtype, steps, config, operands)
        if "error" not in operands:
            out["pairs"] = paired_steps(train, sync, operands, _runs_fourier(impl, config), steps)
    return out


def thread_counts(B):
    """The thread counts a measurement ran with: pycapsnet's own host threads (the backend's
    split_batch and over_blocks; None for the reference), PyTorch's intra-op threads where torch is
    loaded, and each BLAS library's, with the kernels it runs."""
    out = {"pycapsnet": getattr(B, "threads", None) if B is not None and B.device == "cpu" else None}
    if "torch" in sys.modules:
        out["torch"] = sys.modules["torch"].get_num_threads()
    # the kernels a BLAS runs (OpenBLAS: the core it detected, or the one OPENBLAS_CORETYPE forces; on
    # an AVX-512 CPU forced to Haswell's the products run at about half their rate): part of the machine
    out["blas"] = {f"{kernels_of(i)} kernels ({os.path.basename(i['filepath'])})": i["num_threads"]
                   for i in threadpool_info() if i.get("user_api") == "blas"}
    return out


def _reference_step(impl, batch, dtype, cfg, x, y):
    """The autograd reference's train step and evaluation, with what worker() needs to time them
    (a dict; {'impl', 'error'} when it cannot run here)."""
    import torch

    from pycapsnet.backends.host import process_memory, reset_process_peak
    from pycapsnet.tools.reference import AutogradCapsNet, AutogradNetwork

    device = impl.split(":", 1)[1] if ":" in impl else "cpu"
    compiled = impl.startswith(COMPILED)
    cuda = device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        return {"impl": impl, "error": "no CUDA GPU for the autograd reference"}
    mem0 = process_memory()["current"]
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    host = _network("numpy", cfg)  # pycapsnet's initialisation, copied over
    if "network" in cfg or cfg.get("routing", "dynamic") not in ("dynamic", "em", "attention"):  # a description, or a built-in one written as one
        ref = AutogradNetwork.from_model(host, device=device, dtype=getattr(torch, dtype))
    else:
        ref = AutogradCapsNet(host.config, host.state_dict(), device=device, dtype=getattr(torch, dtype))
    del host
    opt = torch.optim.Adam(ref.parameters(), 1e-3)
    xt = torch.as_tensor(x, dtype=getattr(torch, dtype), device=device)
    yt = torch.as_tensor(y, device=device)

    # --reference compiled: the same model's loss and forward under torch.compile (default mode);
    # autograd still makes the backward, which AOTAutograd compiles along.  Compiling happens in the
    # first calls, here, untimed; compile_s says how long they took.
    loss_fn, forward_fn, compile_s = ref.loss, ref.forward, None
    if compiled:
        loss_fn, forward_fn = torch.compile(ref.loss), torch.compile(ref.forward)

    def train():
        opt.zero_grad(set_to_none=False)
        loss, _, _ = loss_fn(xt, yt)
        loss.backward()
        opt.step()

    def evaluate():
        with torch.no_grad():
            forward_fn(xt)[1].argmax(1)

    if compiled:
        t = time.perf_counter()
        try:
            train()
            evaluate()
        except Exception as e:  # an op inductor cannot lower, no C++ compiler, ...: a skipped row, with why
            return {"impl": impl, "error": f"torch.compile failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        compile_s = time.perf_counter() - t
    label = f"autograd torch:{device}" + (", torch.compile" if compiled else "")
    return {"train": train, "evaluate": evaluate, "label": label, "mem0": mem0, "compile_s": compile_s,
            "routing_iters": ref.cfg.routing_iters if ref.cfg else None,
            "sync": (lambda: torch.cuda.synchronize()) if cuda else (lambda: None),
            "mem_fn": (lambda: torch.cuda.max_memory_allocated()) if cuda else None,
            "reset": (lambda: torch.cuda.reset_peak_memory_stats()) if cuda else reset_process_peak,
            "n_params": sum(p.numel() for p in ref.parameters())}


def _pycapsnet_step(impl, batch, dtype, cfg, x, y):
    """pycapsnet's train step (recorded where the trainer records it) and evaluation, as
    ``_reference_step`` returns them."""
    from pycapsnet import backends
    from pycapsnet.backends.host import process_memory, reset_process_peak
    from pycapsnet.training import optim
    from pycapsnet.training.graph import CapturedEval, CapturedStep

    # "+eager": op by op where the trainer records the step (torch:cuda, cupy); "+graph": recorded
    # where it does not (on the CPU the recording is a re-run); "+compile": the train step compiled
    # (train --compile), then recorded where the trainer records; the evaluation as without it
    name, _, mode = impl.partition("+")
    try:
        B = backends.get(name, dtype=dtype)
    except backends.BackendError as e:
        return {"impl": impl, "error": str(e)}
    mem0 = process_memory()["current"]
    B.reset_peak_memory()
    model = _network(B, cfg)
    opt = optim.Adam(model, 1e-3)
    xb = B.asarray(x)
    graph = mode == "graph" or (B.can_capture and mode != "eager")
    compiled, compile_s = mode == "compile", None
    if graph or compiled:
        t0 = time.perf_counter()
        captured = CapturedStep(model, opt, batch, compile=compiled)
        if compiled:
            compile_s = time.perf_counter() - t0

        def train():
            captured(xb, y)
    else:
        def train():
            model.train_step_grads(xb, y)
            opt.step()

    if graph:  # model.predict's forward, recorded too
        recorded_eval = CapturedEval(model, batch, labels=False)

        def evaluate():
            recorded_eval(xb).predictions
    else:
        def evaluate():
            model.predict(xb)

    on_gpu = B.device.startswith("cuda")
    recorded = ", CUDA graph" if on_gpu else ", recorded"  # on the CPU: a re-run, host transfers refused
    # a CUDA graph allocates while it is recorded, not when replayed: its peak counts from the
    # model's creation (on the CPU a "recording" re-runs the step, which allocates as it goes)
    return {"train": train, "evaluate": evaluate, "mem0": mem0, "sync": B.synchronize,
            "routing_iters": model.config.routing_iters if hasattr(model, "config") else None,
            "label": B.label.replace(f"/{dtype}", "") + (", compiled" if compiled else "")
            + (recorded if graph else ", op by op" if mode == "eager" else ""),
            "compile_s": compile_s,
            "backend": B,
            "mem_fn": (lambda: B.memory()["peak"]) if on_gpu else None,
            "reset": (lambda: None) if graph and on_gpu else B.reset_peak_memory if on_gpu else reset_process_peak,
            "n_params": model.n_params()}


def _network(B, cfg):
    """The measured network, seeded: a built-in CapsNet of ``cfg``'s fields, or the description
    ``cfg["network"]`` (--network) for ``cfg``'s input shape and 10 classes."""
    from pycapsnet import CapsNet
    from pycapsnet.core import architecture

    if "network" not in cfg:
        return CapsNet(B, seed=0, **cfg)
    arch = dict(cfg["network"], input_shape=list(cfg["input_shape"]), n_classes=cfg["network"].get("n_classes") or 10)
    return architecture.build(arch, B, seed=0)


def step_products(cfg, n, dtype):
    """The matrix products of a train step at batch n: ([(label, m, k, n, batch dims)], how many of
    them come first as the im2col formulation's; the rest are what the Fourier PrimaryCaps runs
    instead of the three PrimaryCaps products)."""
    from pycapsnet.core.fourier import FourierConv2d, half_spectrum, phase_grid, spectrum_mb
    from pycapsnet.core.model import decoder_sizes, geometry

    P, _ = geometry(cfg)
    c, h, w = cfg.input_shape
    k1, C1, k2, s2 = cfg.conv_kernel, cfg.conv_channels, cfg.primary_kernel, cfg.primary_stride
    T, K, J, D = cfg.primary_types, cfg.primary_dim, cfg.n_classes, cfg.class_dim
    h1 = (h - k1 + 1) * (w - k1 + 1)
    products = []

    def mm(label, m, k, cols, batch_dims=()):
        products.append((label, m, k, cols, batch_dims))

    mm("conv1 forward", n * h1, k1 * k1 * c, C1)
    mm("conv1 dW", k1 * k1 * c, n * h1, C1)
    mm("primary forward", n * P, k2 * k2 * C1, T * K)
    mm("primary dW", k2 * k2 * C1, n * P, T * K)
    mm("primary dX", n * P, T * K, k2 * k2 * C1)
    mm("classcaps u_hat", n, K, J * D, (P, T))
    mm("classcaps dW", J * D, n, K, (P, T))
    mm("classcaps du", n, J * D, K, (P, T))
    for a, b in decoder_sizes(cfg):
        mm(f"decoder {a}->{b} forward", n, a, b)
        mm(f"decoder {a}->{b} dW", a, n, b)
        mm(f"decoder {a}->{b} dX", n, b, a)
    direct = len(products)  # the products above: the floor of the im2col formulation

    # What the step runs with primary_conv="fourier" instead of the three PrimaryCaps products
    # (pycapsnet/core/fourier.py): the grid transforms of input, kernel and output, and per frequency
    # one product of stacked real and imaginary blocks each for forward, weight gradient and input
    # gradient.
    oh, ow, kq, n_h, n_w = phase_grid(h - k1 + 1, w - k1 + 1, k2, s2)
    F = len(half_spectrum(n_h, n_w)[1])
    Cp, O = s2 * s2 * C1, T * K
    mm("fourier input transform", 2 * F, n_h * n_w, n * Cp)
    mm("fourier kernel transform (forward)", 2 * F, kq * kq, Cp * O)   # real and imaginary rows
    if spectrum_mb(F, Cp, O, np.dtype(dtype).itemsize) > FourierConv2d.keep_spectrum_mb:
        mm("fourier kernel transform (again, for dX)", 2 * F, kq * kq, Cp * O)  # V not kept for dX
    mm("fourier kernel gradient transform", kq * kq, 2 * F, Cp * O)  # dws = Fw^T dV, both parts
    mm("fourier forward", 2 * O, Cp, 2 * n, (F,))                    # [V_r^T; V_i^T] [X_r^T  X_i^T]
    mm("fourier dW", 2 * O, 2 * n, Cp, (F,))                         # [dV_r^T; dV_i^T]
    mm("fourier dX", 2 * n, 2 * O, Cp, (F,))                         # [dX_r; dX_i]
    mm("fourier output transform", oh * ow, 2 * F, n * O)
    mm("fourier output transform dY", 2 * F, oh * ow, n * O)
    mm("fourier input transform dX", n_h * n_w, 2 * F, n * Cp)
    return products, direct


def _floor_operands(impl, batch, dtype, config):
    """The step's products (``step_products``) on preallocated random operands, and the product and
    sync to run them with: a dict, or {'impl', 'error'} where the backend cannot run here."""
    from pycapsnet import backends

    # the autograd references' products are torch's (autograd:cuda, autograd-compiled:cpu -> torch:cuda, torch:cpu)
    name = "torch" + impl[impl.index(":"):] if impl.startswith("autograd") else impl.partition("+")[0]
    try:
        B = backends.get(name, dtype=dtype)
    except backends.BackendError as e:
        return {"impl": impl, "error": str(e)}
    from pycapsnet.core.model import CapsNetConfig

    shapes, direct = step_products(CapsNetConfig(**config), batch, dtype)  # the geometry only: no model
    rng = np.random.default_rng(0)
    r = lambda *s: B.asarray(rng.standard_normal(s).astype(dtype))
    products = [(label, r(*bd, m, k), r(*bd, k, n)) for label, m, k, n, bd in shapes]  # (name, A, B): A @ B
    labels = [p[0] for p in products]
    im2col = labels[:direct]
    # the backend's products as its step runs them (B.matmul: NumPy splits batches of small products
    # over its threads, PyTorch's CPU backend may hand them to NumPy's BLAS); the references', torch's @
    return {"product": (lambda a, b: a @ b) if impl.startswith("autograd") else B.matmul, "sync": B.synchronize,
            "products": products, "im2col": im2col,
            "fourier": [k for k in im2col if not k.startswith("primary")] + labels[direct:]}


def _runs_fourier(impl, config) -> bool:
    """Whether this implementation's step runs the Fourier PrimaryCaps' products (see step_products):
    the autograd reference and primary_conv=im2col run the im2col ones."""
    return not impl.startswith("autograd") and config.get("primary_conv", "fourier") == "fourier"


def gemm_floor(impl, batch, dtype, reps, config, operands=None):
    """Seconds of a train step's unavoidable matrix products, with the backend's own matmul."""
    operands = operands or _floor_operands(impl, batch, dtype, config)
    if "error" in operands:
        return operands
    product, products = operands["product"], operands["products"]
    per = {}
    for label, A, Bm in products:
        cpu = []
        t, _ = _median_time(lambda: product(A, Bm), 1, reps, operands["sync"], cpu)
        flops = 2 * np.prod(A.shape[:-1]) * A.shape[-1] * Bm.shape[-1]
        per[label] = {"s": t, "cpu_s": float(np.median(cpu)), "gflops": flops / 1e9, "gflop_per_s": flops / 1e9 / t}

    def floor(labels):
        t = sum(per[k]["s"] for k in labels)
        g = sum(per[k]["gflops"] for k in labels)
        return t, g

    total, gflop = floor(operands["im2col"])
    f_total, f_gflop = floor(operands["fourier"])
    return {"impl": impl, "floor_s": total, "gflop": gflop, "gflop_per_s": gflop / total,
            "fourier_floor_s": f_total, "fourier_gflop": f_gflop, "products": per}


def paired_steps(train, sync, operands, fourier: bool, pairs: int) -> list:
    """[step s, own products s] ``pairs`` times: one train step, then one pass over the products that
    step runs (``_floor_operands``; each called once untimed, then timed).  The two halves of a pair
    run within seconds of each other, so a drift in the machine's speed moves both."""
    product, psync = operands["product"], operands["sync"]
    own = set(operands["fourier" if fourier else "im2col"])
    out = []
    for _ in range(pairs):
        step, _ = _median_time(train, 0, 1, sync)
        products_s = sum(_median_time(lambda: product(A, Bm), 1, 1, psync)[0]
                         for label, A, Bm in operands["products"] if label in own)
        out.append([step, products_s])
    return out


# ---------------------------------------------------------------------------------------------
# the driver
# ---------------------------------------------------------------------------------------------
LIVE_MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": str(2**20)}


def _spawn(kind, impl, args, env_extra=None, **extra):
    payload = {"kind": kind, "impl": impl, "batch": args.batch_size, "dtype": args.dtype, "warmup": args.warmup,
               "steps": args.steps, "config": args.config, **extra}
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env_extra or {}))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(payload)],
                          capture_output=True, text=True, env=env, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"impl": impl, "error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(lines[-1])


def _median_run(runs):
    """Of several speed runs of one implementation, the one with the median train throughput, with
    every run's throughputs attached (``*_rounds``); the first error if any run failed."""
    bad = [r for r in runs if "error" in r]
    if bad:
        return bad[0]
    ordered = sorted(runs, key=lambda r: r["train_samples_per_s"])
    out = dict(ordered[(len(ordered) - 1) // 2])
    out["train_samples_per_s_rounds"] = [r["train_samples_per_s"] for r in runs]
    out["eval_samples_per_s"] = float(np.median([r["eval_samples_per_s"] for r in runs]))
    out["eval_samples_per_s_rounds"] = [r["eval_samples_per_s"] for r in runs]
    if all("train_cpu_step_s" in r for r in runs):
        out["train_cpu_step_s_rounds"] = [r["train_cpu_step_s"] for r in runs]
        out["train_cpu_step_s"] = float(np.median(out["train_cpu_step_s_rounds"]))
    if all("floor_s" in r.get("floor", {}) for r in runs):  # each round's own floor (worker), without its products
        out["train_step_s_rounds"] = [r["train_step_s"] for r in runs]
        out["floor_rounds"] = [{k: r["floor"][k] for k in ("floor_s", "fourier_floor_s")} for r in runs]
    if all("pairs" in r for r in runs):  # step / own products, in pairs (paired_steps)
        out["pairs_rounds"] = [r["pairs"] for r in runs]
        out.pop("pairs", None)
    return out


def _measure(impl, args, speed=None, **extra):
    """Throughput from one fresh process (or ``speed``, measured already); peak memory from another
    with LIVE_MEMORY_ENV."""
    speed = speed or _spawn("step", impl, args, **extra)
    if "error" in speed:
        return speed
    mem_args = argparse.Namespace(**{**vars(args), "warmup": 1, "steps": min(args.steps, 2)})
    mem = _spawn("step", impl, mem_args, env_extra=LIVE_MEMORY_ENV, **extra)
    if "error" not in mem:
        speed["peak_train_mem_mb"] = mem["peak_train_mem_mb"]
    return speed


def _run_worker(payload):
    p = json.loads(payload)
    print(json.dumps(worker(p["impl"], p["batch"], p["dtype"], p["warmup"], p["steps"], p["config"],
                            p.get("input_size", 28), p.get("floor", False))))


def backend_spec(text: str) -> str:
    """An implementation to measure: NAME[:DEVICE][+eager|+graph], NAME a backend.  A misspelt name is refused
    here; a known one whose library or GPU is missing runs as a 'skipped' row with the reason."""
    name_device, _, mode = text.partition("+")
    if name_device.split(":")[0] not in NAMES or mode not in ("", "eager", "graph", "compile"):
        raise argparse.ArgumentTypeError(f"unknown backend {text!r}: choose from {', '.join(NAMES)}, each with "
                                         "an optional :DEVICE and +eager, +graph or +compile (e.g. torch:cuda+eager)")
    return text


def torch_device(text: str) -> str:
    """The autograd reference's device: cpu, cuda or cuda:N, as for the torch backend."""
    if not is_torch_device(text):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text


COMPILED = "autograd-compiled"  # the autograd reference under torch.compile (--reference compiled)


def _gpu_name(impls):
    """The GPU's name where an implementation runs on one (torch's name for it), else None."""
    if not any("cuda" in impl or impl.startswith("cupy") for impl in impls):
        return None
    try:
        import torch

        return torch.cuda.get_device_name()
    except Exception as e:  # no torch, or it sees no GPU: the workers report their own errors
        return f"unknown GPU ({type(e).__name__})"


def _ratio(r, other):
    """Median over rounds of r's train throughput over other's, and the per-round ratios."""
    per_round = [a / b for a, b in zip(r["train_samples_per_s_rounds"], other["train_samples_per_s_rounds"])]
    return float(np.median(per_round)), per_round


def _ratio_text(median, per_round, unit="x"):
    return (f"{median:.2f}{unit}" if len(per_round) == 1
            else f"{median:.2f}{unit} ({min(per_round):.2f}-{max(per_round):.2f})")


def table_row(r, ref, floor, args, compiled=None):
    """One implementation's row of the printed table; adds the derived ratios to its result ``r``
    (against the eager autograd reference ``ref`` and, where it ran, the compiled one)."""
    if "error" in r:
        return {"implementation": r["impl"], "train samples/s": "skipped: " + r["error"][:70]}
    row = {"implementation": r["label"] + (" (hand-written)" if not r["impl"].startswith("autograd") else ""),
           "train samples/s": f"{r['train_samples_per_s']:.1f}", "eval samples/s": f"{r['eval_samples_per_s']:.1f}",
           "peak train MB": f"{r['peak_train_mem_mb']:.0f}"}
    # seconds for one pass over MNIST's 60,000 training digits at this throughput (steps only:
    # no data loading, evaluation or logging)
    r["epoch_60k_s"] = 60000 / r["train_samples_per_s"]
    row["60k epoch s"] = f"{r['epoch_60k_s']:.1f}"
    if "train_cpu_step_s" in r:
        rounds = r.get("train_cpu_step_s_rounds", [])
        row["CPU s/step"] = f"{r['train_cpu_step_s']:.3f}" + (
            f" ({min(rounds):.3f}-{max(rounds):.3f})" if len(rounds) > 1 else "")
    if ref and r is not ref:
        r["speedup_vs_autograd"], r["speedup_vs_autograd_rounds"] = _ratio(r, ref)
        r["memory_vs_autograd"] = r["peak_train_mem_mb"] / ref["peak_train_mem_mb"]
        row["train vs autograd"] = _ratio_text(r["speedup_vs_autograd"], r["speedup_vs_autograd_rounds"])
        row["memory vs autograd"] = f"{r['memory_vs_autograd']:.2f}x"
    if compiled and r is not compiled:
        r["speedup_vs_compiled"], r["speedup_vs_compiled_rounds"] = _ratio(r, compiled)
        row["train vs compiled"] = _ratio_text(r["speedup_vs_compiled"], r["speedup_vs_compiled_rounds"])
    if r.get("compile_s") is not None:
        row["compile s"] = f"{r['compile_s']:.0f}"
    if "floor_s" in floor:
        r["gemm_floor_s"] = floor["floor_s"]
        r["step_over_floor"] = r["train_step_s"] / floor["floor_s"]
        row["GEMM floor s"] = f"{floor['floor_s']:.3f} ({floor['gflop_per_s']:.0f} GFLOP/s)"
        row["step / floor"] = f"{r['step_over_floor']:.2f}"
        # the products this step itself runs (_runs_fourier)
        key = "fourier_floor_s" if _runs_fourier(r["impl"], {"primary_conv": args.primary_conv}) else "floor_s"
        r["own_floor_s"] = floor[key]
        # step / own products: the median over every pair of every round (paired_steps), each round's
        # median for the range; without pairs, the reported step over its own round's floor.  The
        # column beside it shows the products' time of the same pairs (their median)
        pairs = r.get("pairs_rounds", [])
        if pairs:
            ratios = [[s / p for s, p in round_pairs] for round_pairs in pairs]
            per_round = [float(np.median(round_ratios)) for round_ratios in ratios]
            r["step_over_own_floor"] = float(np.median(sum(ratios, [])))
            r["own_products_paired_s"] = float(np.median([p for round_pairs in pairs for _, p in round_pairs]))
        else:
            per_round = [r["train_step_s"] / floor[key]]
            r["step_over_own_floor"] = per_round[0]
        row["own products s"] = f"{r.get('own_products_paired_s', floor[key]):.3f}"
        r["step_over_own_floor_rounds"] = per_round
        row["step / own"] = _ratio_text(r["step_over_own_floor"], per_round, unit="")
        if "train_cpu_step_s" in r:  # CPU time per step over the products' (one thread: both one core's seconds)
            r["cpu_step_over_own_floor"] = r["train_cpu_step_s"] / r.get("own_products_paired_s", floor[key])
            row["CPU step / own"] = f"{r['cpu_step_over_own_floor']:.2f}"
    return row


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", nargs="+", type=backend_spec, default=["numpy", "torch"],
                   help="numpy, torch, torch:cuda, cupy (default: numpy torch); torch:cuda and cupy run their step "
                        "as a CUDA graph, with +eager op by op; +graph records the step on any backend; "
                        "torch+compile compiles it (train --compile)")
    p.add_argument("--ref-device", type=torch_device, default="cpu", help="device of the autograd reference (cpu or cuda)")
    p.add_argument("--no-reference", action="store_true", help="skip the autograd reference")
    p.add_argument("--reference", choices=("eager", "compiled", "both"), default="eager",
                   help="the autograd reference op by op (eager, the default), under torch.compile "
                        "(compiled; it compiles in its warm-up, untimed, and reports how long), or both")
    p.add_argument("--batch-size", type=positive_int, default=64)
    p.add_argument("--dtype", default="float32", choices=FLOAT_DTYPES)
    p.add_argument("--warmup", type=nonnegative_int, default=2)
    p.add_argument("--steps", type=positive_int, default=5, help="timed steps; the median is reported")
    p.add_argument("--rounds", type=positive_int, default=3,
                   help="speed runs per implementation, taken in turn (numpy, torch, reference, numpy, ...); "
                        "the table reports medians over rounds, and each ratio is the median of the "
                        "ratios within a round, so that a machine's drift affects both sides alike (default 3)")
    p.add_argument("--scaling", action="store_true", help="also the scaling tables (several minutes)")
    p.add_argument("--quick", action="store_true", help="tiny model, 1 timed step: a smoke run")
    p.add_argument("--primary-conv", choices=PrimaryCaps.FULL_CONVS, default="fourier",
                   help="how the hand-written PrimaryCaps convolves (default fourier, as in training)")
    p.add_argument("--routing", choices=routing_names(), default="dynamic",
                   help="the network: dynamic (default), em or attention; each against an autograd "
                        "implementation of the same network (pycapsnet/tools/reference.py)")
    p.add_argument("--network", default=None, metavar="FILE.json",
                   help="a described network instead (a JSON file, or a built-in description: efficient), "
                        "against pycapsnet/tools/reference.py's autograd network of the same description")
    p.add_argument("--routing-iters", type=positive_int, default=None,
                   help="routing iterations (default: the network's own; EM's is 2, the paper's 3)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="host threads the numpy and torch backends split their memory-bound work over "
                        "(sets PYCAPSNET_THREADS for every run; default: the cores this process may use); "
                        "PyTorch's and the BLAS's own threads are left as they are")
    p.add_argument("--json", type=writable_file, default=None,
                   help="where the results go (default: benchmarks/results.json, the README's; "
                        "benchmarks/results-ROUTING.json for --routing em or attention)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    if args.worker:
        _run_worker(args.worker)
        return 0
    if args.threads is not None:
        os.environ["PYCAPSNET_THREADS"] = str(args.threads)  # the workers inherit it
    args.config = dict(QUICK) if args.quick else {}
    args.config["primary_conv"] = args.primary_conv
    if args.routing != "dynamic":
        args.config["routing"] = args.routing
        if args.quick:  # the tiny model's sizes are dynamic routing's; the EM network keeps its own
            args.config = {k: v for k, v in args.config.items() if args.routing != "em" or k not in
                           ("conv_channels", "conv_kernel", "primary_types")}
    if args.routing_iters is not None:
        args.config["routing_iters"] = args.routing_iters
    if args.network:
        from pycapsnet.core import architecture

        args.config = {"network": architecture.load(args.network)}  # the workers get the description itself
    if args.json is None:
        name = "results.json" if args.routing == "dynamic" and not args.network else \
            f"results-{os.path.splitext(os.path.basename(args.network))[0] if args.network else args.routing}.json"
        args.json = os.path.join(ROOT, "benchmarks", name)
    if args.quick:
        args.warmup, args.steps, args.batch_size, args.rounds = 1, 1, min(args.batch_size, 8), min(args.rounds, 2)

    refs = [] if args.no_reference else [name for name, kinds in (("autograd", ("eager", "both")),
                                                                   (COMPILED, ("compiled", "both")))
                                         if args.reference in kinds]
    impls = list(args.backends) + [f"{name}:{args.ref_device}" for name in refs]
    results = {"code": code_version(), "machine": {"cpu": cpu_model(), "gpu": _gpu_name(impls),
                           "platform": platform.platform(), "processor": platform.processor(),
                           "cpus": os.cpu_count(), "python": platform.python_version(),
                           # set by `import backends` (through pycapsnet.tools.cli above); the workers inherit it
                           "OPENBLAS_THREAD_TIMEOUT": os.environ.get("OPENBLAS_THREAD_TIMEOUT"),
                           "PYCAPSNET_THREADS": os.environ.get("PYCAPSNET_THREADS"),
                           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")},
               "settings": {k: v for k, v in vars(args).items() if k != "worker"}, "main": [], "floor": {}}
    runs = {impl: [] for impl in impls}
    for k in range(args.rounds):
        for impl in impls:
            print(f"measuring {impl} (round {k + 1} of {args.rounds}) ...", file=sys.stderr, flush=True)
            # the GEMM floor models dynamic routing's products (step_products); none for the other networks
            runs[impl].append(_spawn("step", impl, args, floor=args.routing == "dynamic" and not args.network))
        # what is measured so far, in case the run is stopped (a time limit): "complete" says
        _save(args.json, dict(results, complete=False, rounds_so_far=runs))
    for impl in impls:
        print(f"measuring {impl}: memory ...", file=sys.stderr, flush=True)
        speed = _median_run(runs[impl])
        # the floor measured in the same process as the reported step (see worker)
        results["floor"][impl] = speed.pop("floor", None) or {}
        results["main"].append(_measure(impl, args, speed=speed))
        _save(args.json, dict(results, complete=False, rounds_so_far=runs))
    ref, compiled = (next((r for r in results["main"] if r["impl"].split(":")[0] == name and "error" not in r), None)
                     for name in ("autograd", COMPILED))
    rows = [table_row(r, ref, results["floor"].get(r["impl"], {}), args, compiled) for r in results["main"]]
    cfg_txt = f"the network {args.network} describes" if args.network else \
        ("tiny model (--quick)" if args.quick else "paper MNIST CapsNet") + f", {args.routing} routing"
    machine = results["machine"]
    print(f"\n{machine['gpu'] + ', ' if machine['gpu'] else ''}{machine['cpu']} ({machine['cpus']} CPUs)")
    print(f"{cfg_txt}, {args.dtype}, batch {args.batch_size}, median of {args.steps} steps after {args.warmup} warm-up,"
          f" median of {args.rounds} rounds (ratio range in brackets)"
          + ("" if args.network else f"; hand-written PrimaryCaps: {args.primary_conv}"))
    threads = {r["impl"]: r["threads"] for r in results["main"] if r.get("threads")}
    if threads:
        print("threads: " + "; ".join(f"{impl}: {threads_text(t)}" for impl, t in threads.items()))
    print(format_table(rows, ["implementation", "train samples/s", "60k epoch s", "CPU s/step", "eval samples/s",
                              "peak train MB",
                            "train vs autograd", "train vs compiled", "compile s", "memory vs autograd",
                            "GEMM floor s", "step / floor", "own products s", "step / own", "CPU step / own"]))

    if args.scaling:
        results["scaling"] = scaling(args)
    _save(args.json, dict(results, complete=True))
    print(f"\nJSON: {args.json}")
    return 0


def threads_text(t):
    """thread_counts' dict as one line: 'pycapsnet 4, torch 16, openblas (...) 16'."""
    parts = [f"pycapsnet {t['pycapsnet']}"] if t.get("pycapsnet") else []
    parts += [f"torch {t['torch']}"] if "torch" in t else []
    parts += [f"{name} {n}" for name, n in t.get("blas", {}).items()]
    return ", ".join(parts) or "-"


def _save(path, results):
    """Write the JSON whole or not at all (a temporary file renamed over it), so that a run stopped
    part-way leaves the last phase's results readable."""
    tmp = f"{path}.part"
    with open(tmp, "w") as f:  # --json's directory was made and tried when the command line was read
        json.dump(results, f, indent=1)
    os.replace(tmp, path)


def scaling(args):
    """Throughput vs batch size and routing iterations; memory vs input size (+/- share_spatial)."""
    impl = args.backends[0]
    out = {"impl": impl, "batch": [], "routing": [], "input_size": []}
    base = dict(args.config)
    batches = [16, 32, 64, 128, 256] if not args.quick else [4, 8]
    for b in batches:
        a = argparse.Namespace(**{**vars(args), "batch_size": b})
        out["batch"].append(_measure(impl, a))
    for iters in ([1, 2, 3, 4, 5] if not args.quick else [1, 3]):
        a = argparse.Namespace(**{**vars(args), "config": {**base, "routing_iters": iters}})
        out["routing"].append(_spawn("step", impl, a))
    sizes = [28, 64, 128] if not args.quick else [28, 36]
    small_batch = 8 if not args.quick else 2
    for size in sizes:
        for share in (False, True):
            a = argparse.Namespace(**{**vars(args), "batch_size": small_batch, "warmup": 1, "steps": 2 if not args.quick else 1,
                                      "config": {**base, "share_spatial": share}})
            out["input_size"].append(_measure(impl, a, input_size=size))

    def ok(r):
        return "error" not in r

    print(f"\nscaling ({impl}, {args.dtype}):")
    print(format_table([{"batch": r["batch"], "train samples/s": f"{r['train_samples_per_s']:.1f}",
                       "eval samples/s": f"{r['eval_samples_per_s']:.1f}", "peak train MB": f"{r['peak_train_mem_mb']:.0f}"}
                      for r in out["batch"] if ok(r)], ["batch", "train samples/s", "eval samples/s", "peak train MB"]))
    print()
    print(format_table([{"routing iterations": r["routing_iters"], "train samples/s": f"{r['train_samples_per_s']:.1f}",
                       "eval samples/s": f"{r['eval_samples_per_s']:.1f}"} for r in out["routing"] if ok(r)],
                     ["routing iterations", "train samples/s", "eval samples/s"]))
    print()
    print(format_table([{"input": f"{r['input_size']}x{r['input_size']}", "share_spatial": r["share_spatial"],
                       "parameters": f"{r['params']:,}", "peak train MB": f"{r['peak_train_mem_mb']:.0f}",
                       "train samples/s": f"{r['train_samples_per_s']:.2f}"} for r in out["input_size"] if ok(r)],
                     ["input", "share_spatial", "parameters", "peak train MB", "train samples/s"]))
    print(f"(input-size rows: batch {small_batch})")
    return out


if __name__ == "__main__":
    sys.exit(main())

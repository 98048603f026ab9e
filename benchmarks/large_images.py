"""A train step (Adam included) of a share_spatial CapsNet on large RGB images: time and peak memory.

    python -m benchmarks.large_images --side 224 --batch-size 2 --classes 276    (from the repository root)
    python -m benchmarks.large_images --side 224 --batch-size 32 --backend torch --device cuda
    python -m benchmarks.large_images --side 224 --batch-size 8 --reference --device cuda

One line of JSON: the median of --steps steps after one warm-up step, and the peak memory of the
steps: on the CPU the process's peak RSS from the step's start (weights, optimizer state, the step's
arrays, and the interpreter's own), on a GPU the backend's peak of device memory.  Float32.
``--reference`` times the PyTorch-autograd model of the same network instead (pycapsnet.tools.reference,
written the usual way: W_tj tiled over positions, so û is formed) with torch.optim.Adam.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from pycapsnet import backends  # noqa: I001  (before NumPy: it sets NumPy's BLAS thread timeout, see backends/__init__.py)
import numpy as np

from benchmarks.provenance import code_version
from pycapsnet.training.argtypes import positive_int


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--side", type=positive_int, default=224)
    p.add_argument("--batch-size", type=positive_int, default=2)
    p.add_argument("--classes", type=positive_int, default=276)
    p.add_argument("--steps", type=positive_int, default=2)
    p.add_argument("--backend", default="numpy", choices=backends.NAMES)
    p.add_argument("--primary-conv", default="fourier", choices=("fourier", "im2col"))
    p.add_argument("--device", default=None, help="cpu (default) or cuda[:N], for torch and the reference")
    p.add_argument("--reference", action="store_true", help="time the autograd reference instead")
    args = p.parse_args(argv)
    from pycapsnet.backends.host import process_memory
    from benchmarks.distributed_step import cpu_model
    from pycapsnet import CapsNet
    from pycapsnet.training.optim import Adam

    B = backends.get(args.backend, dtype="float32", device=args.device)
    cfg = dict(share_spatial=True, input_shape=(3, args.side, args.side), n_classes=args.classes,
               primary_conv=args.primary_conv)
    rng = np.random.default_rng(0)
    x = rng.random((args.batch_size, 3, args.side, args.side), dtype=np.float32)
    y = np.arange(args.batch_size) % args.classes
    if args.reference:  # bench.py's autograd step: the same model, the same seeded weights
        from benchmarks.bench import _reference_step

        made = _reference_step(f"autograd:{args.device or 'cpu'}", args.batch_size, "float32", cfg, x, y)
        if "error" in made:
            raise SystemExit(made["error"])
        step, sync, reset, label, n_params = made["train"], made["sync"], made["reset"], made["label"], made["n_params"]
        peak = made["mem_fn"] or (lambda: process_memory()["peak"])
    else:
        model = CapsNet(B, **cfg)
        opt = Adam(model)
        n_params = model.n_params()

        def step():
            model.train_step_grads(x, y)
            opt.step()
        sync, label = B.synchronize, B.label
        peak, reset = (lambda: B.memory()["peak"]), B.reset_peak_memory
    reset()
    times = []
    for k in range(args.steps + 1):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        if k:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    on_gpu = (args.device or "cpu").startswith("cuda") or args.backend == "cupy"
    print(json.dumps({"code": code_version(), "side": args.side,
                      "primary_conv": None if args.reference else args.primary_conv,
                      "batch_size": args.batch_size, "classes": args.classes, "backend": label,
                      "cpu": cpu_model(), "parameters": n_params, "step_s": round(step_s, 2),
                      "samples_per_s": round(args.batch_size / step_s, 3),
                      ("peak_gpu_mb" if on_gpu else "peak_rss_mb"): round(peak() / 2**20)}))


if __name__ == "__main__":
    main()

"""A train step (Adam included) of a share_spatial CapsNet on large RGB images: time and peak memory.

    python -m benchmarks.large_images --side 224 --batch-size 2 --classes 276    (from the repository root)

One line of JSON: the median of --steps steps after one warm-up step, and the process's peak RSS
(the whole process: weights, optimizer state, the step's arrays).  numpy backend, float32.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import backends  # noqa: I001  (before NumPy: it sets NumPy's BLAS thread timeout, see backends/__init__.py)
import numpy as np

from pycapsnet.argtypes import positive_int


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--side", type=positive_int, default=224)
    p.add_argument("--batch-size", type=positive_int, default=2)
    p.add_argument("--classes", type=positive_int, default=276)
    p.add_argument("--steps", type=positive_int, default=2)
    p.add_argument("--backend", default="numpy", choices=backends.NAMES)
    p.add_argument("--primary-conv", default="fourier", choices=("fourier", "im2col"))
    args = p.parse_args(argv)
    from benchmarks.distributed_step import cpu_model
    from pycapsnet import CapsNet
    from pycapsnet.optim import Adam

    B = backends.get(args.backend, dtype="float32")
    model = CapsNet(B, share_spatial=True, input_shape=(3, args.side, args.side), n_classes=args.classes,
                    primary_conv=args.primary_conv)
    opt = Adam(model)
    rng = np.random.default_rng(0)
    x = rng.random((args.batch_size, 3, args.side, args.side), dtype=np.float32)
    y = np.arange(args.batch_size) % args.classes
    times = []
    for step in range(args.steps + 1):
        B.synchronize()
        t0 = time.perf_counter()
        model.train_step_grads(x, y)
        opt.step()
        B.synchronize()
        if step:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    print(json.dumps({"side": args.side, "primary_conv": args.primary_conv, "batch_size": args.batch_size, "classes": args.classes, "backend": B.label,
                      "cpu": cpu_model(), "parameters": model.n_params(), "step_s": round(step_s, 2),
                      "samples_per_s": round(args.batch_size / step_s, 3),
                      "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}))


if __name__ == "__main__":
    main()

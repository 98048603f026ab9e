"""``pycapsnet plan`` against a measured train step: one line of JSON per run.

    python benchmarks/plan_check.py --side 224 --classes 276 --batch-size 2 [--primary-conv im2col]
    python benchmarks/plan_check.py --routing em --side 64 --classes 10 --batch-size 16

The measured peak is the most bytes of NumPy arrays alive at once during a train step with Adam
(tracemalloc, from before the model is built: ``pycapsnet.tools.plan.measured_peak``); the process's peak
RSS is reported beside it (it adds the interpreter and its libraries).  RGB, float32, numpy
backend; ``share_spatial`` with dynamic and attention routing (the EM network has its own sizes).
Results: benchmarks/results-plan.jsonl, docs/performance.md.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys

from pycapsnet import backends  # noqa: F401,I001  (before NumPy: it sets NumPy's BLAS thread timeout, see backends/__init__.py)

if __package__ in (None, ""):  # run by path: the repository root, for benchmarks.distributed_step
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.provenance import code_version
from pycapsnet.training.argtypes import positive_int


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--side", type=positive_int, default=224)
    p.add_argument("--classes", type=positive_int, default=276)
    p.add_argument("--batch-size", type=positive_int, default=2)
    p.add_argument("--primary-conv", default="fourier", choices=("fourier", "im2col"))
    p.add_argument("--routing", default="dynamic", choices=("dynamic", "attention", "em"))
    args = p.parse_args(argv)
    from benchmarks.distributed_step import cpu_model
    from pycapsnet.core.model import CapsNetConfig
    from pycapsnet.tools.plan import measured_peak, plan

    vector = {} if args.routing == "em" else dict(share_spatial=True, primary_conv=args.primary_conv)
    cfg = CapsNetConfig(input_shape=(3, args.side, args.side), n_classes=args.classes, routing=args.routing, **vector)
    planned = plan(cfg, args.batch_size)
    measured = measured_peak(cfg, args.batch_size)
    mb = 2**20
    print(json.dumps({"code": code_version(), "side": args.side, "classes": args.classes, "batch_size": args.batch_size,
                      "routing": args.routing, "primary_conv": vector.get("primary_conv"), "cpu": cpu_model(),
                      "plan_peak_mb": round(planned.peak / mb), "plan_per_image_mb": round(planned.per_image / mb, 1),
                      "measured_peak_mb": round(measured / mb), "plan_over_measured": round(planned.peak / measured, 3),
                      "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}))


if __name__ == "__main__":
    main()

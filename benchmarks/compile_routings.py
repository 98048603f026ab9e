"""``--compile`` per routing: each routing's small network (gradcheck.SMALL_BY_ROUTING) compiled by
torch.compile as the train loop compiles it (CapturedStep(..., compile=True)), the seconds that
took, and three compiled steps against three plain ones (the loss's largest relative difference,
float32); or, where torch.compile cannot compile it, the one line the train loop then says (the
step runs uncompiled).  One line of JSON per routing.

    python benchmarks/compile_routings.py [--routings vb self ...] [--device cpu|cuda] [--json FILE]

A first compile is cold; Inductor caches what it compiled on disk (under /tmp/torchinductor_USER),
so a second run of the same code takes seconds.  Results: docs/performance.md ("A compiled step").
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

from pycapsnet import backends  # noqa: F401,I001  (before NumPy: it sets NumPy's BLAS thread timeout)

if __package__ in (None, ""):  # run by path: the repository root, for benchmarks.*
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from benchmarks.provenance import code_version


def measure(routing: str, device: str) -> dict:
    from pycapsnet import CapsNet
    from pycapsnet.backends.base import CompileWarning
    from pycapsnet.tools.gradcheck import SMALL_BY_ROUTING
    from pycapsnet.training import optim
    from pycapsnet.training.graph import CapturedStep

    B = backends.get("torch", device=device, dtype="float32")
    config = SMALL_BY_ROUTING[routing]
    plain, comp = CapsNet(B, seed=5, **config), CapsNet(B, seed=5, **config)
    opt_p, opt_c = optim.Adam(plain, 1e-2), optim.Adam(comp, 1e-2)
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CompileWarning)
        step = CapturedStep(comp, opt_c, batch_size=4, compile=True)
    seconds = time.perf_counter() - t0
    fallback = [str(w.message) for w in caught if issubclass(w.category, CompileWarning)]
    if fallback:  # the loop's fallback: the step runs uncompiled, after this one line
        return {"routing": routing, "device": B.label, "compiled": False, "why": fallback[0]}
    rng, worst = np.random.default_rng(0), 0.0
    for _ in range(3):
        x = rng.random((4, *comp.config.input_shape)).astype("float32")
        y = rng.integers(0, comp.config.n_classes, 4)
        a = plain.train_step_grads(x, y)
        opt_p.step()
        worst = max(worst, abs(step(x, y).loss - a.loss) / abs(a.loss))
    return {"routing": routing, "device": B.label, "compiled": True, "compile_s": round(seconds, 1),
            "loss_rel_diff": worst}


def main(argv=None):
    from pycapsnet.tools.gradcheck import SMALL_BY_ROUTING
    from pycapsnet.training.argtypes import writable_file

    recorded = sorted(r for r in SMALL_BY_ROUTING if r != "random")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--routings", nargs="+", default=recorded, choices=recorded, metavar="NAME",
                   help="default: all but random (whose step is never recorded)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", type=writable_file, default=None, help="append the lines to this file too")
    args = p.parse_args(argv)
    code = code_version()
    for routing in args.routings:
        line = json.dumps({**measure(routing, args.device), "code": code})
        print(line, flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()

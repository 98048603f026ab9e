"""One routing layer's forward + backward, timed alone: the paper's 1,152 children (6×6 positions,
32 types of 8D) routed to 10 class capsules of 16D, batch 64, float32.  Prints the median and the
fastest of REPS repetitions (the first two warm up), in ms.  Run it from two trees in alternating
processes to compare commits (docs/performance.md):
    PYTHONPATH=TREE python benchmarks/routing_layer.py torch vb 25
"""
import statistics
import sys
import time

import numpy as np

import backends
from pycapsnet.core.capsules import AttentionCaps, ClassCaps


def main(backend: str, routing: str, reps: int) -> None:
    B = backends.get(backend, dtype="float32")
    rng = np.random.default_rng(0)
    # AttentionCaps is the attention layer at every commit (older ClassCaps refuse routing="attention")
    layer = (AttentionCaps(B, 36, 32, 8, 10, 16, rng=rng, init_std=0.05) if routing == "attention" else
             ClassCaps(B, 36, 32, 8, 10, 16, iters=None, routing=routing, rng=rng, init_std=0.05))
    data = np.random.default_rng(1)
    u = B.asarray(data.standard_normal((64, 36, 32, 8)).astype(np.float32) * 0.3)   # u_i (N, P, T, K)
    dv = B.asarray(data.standard_normal((64, 10, 16)).astype(np.float32) * 0.01)    # dL/dv_j (N, J, D)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        layer.forward(u)
        layer.backward(dv)
        times.append(time.perf_counter() - t)
    print(f"{backend} {routing}: median {statistics.median(times[2:]) * 1e3:.2f} ms, fastest {min(times) * 1e3:.2f} ms")


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: python benchmarks/routing_layer.py BACKEND ROUTING REPS")
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))

"""Two ways to move less memory in the routing layer, timed against what ClassCaps does today, at
the paper network's shapes (1,152 children of 8D routed to 10 classes of 16D, three iterations of
dynamic routing, batch 64, float32):

    today        û (47 MB) formed whole by one batch of products, routed block by block
                 (B.split_batch), dû written over it, then dW and du as whole-batch products
    recompute    û formed inside each routing block from u and W and never stored; backward forms
                 it again, writes the block's dû over it, and adds the block's dW and du at once
    du-per-block today's forward; du made from each block's dû while it is in cache (only dW
                 reads dû whole)

    OMP_NUM_THREADS=1 PYCAPSNET_THREADS=1 python benchmarks/routing_alternatives.py [--backend numpy] [--reps 15]

CPU time of a forward + backward (medians of --reps after two untimed calls), alternating the
three layers in each round; every variant's gradients are compared with today's first.  The
variants are written for this comparison only: one thread (their dW sum is not ordered across
threads), dynamic routing without bias.  docs/performance.md quotes it.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __package__ in (None, ""):
    sys.path.insert(0, ROOT)

from pycapsnet import backends  # noqa: F401,I001  (before NumPy: it sets NumPy's BLAS thread timeout)
import numpy as np

from pycapsnet.core import routing_calls
from pycapsnet.core.capsules import ClassCaps


class Recompute(ClassCaps):
    """û formed per routing block from u and W, and formed again in backward."""

    def forward(self, u):
        xp, n = self.B.xp, u.shape[0]
        ut = xp.permute_dims(u, (1, 2, 0, 3))                                       # (P, T, N, K)
        Wm = xp.reshape(self.params["W"], (-1, self.T, self.J * self.D, self.K))    # (P, T, J*D, K)
        self.cache = (ut, self.B.contiguous(xp.matrix_transpose(Wm)))
        v, parts = self.B.empty((n, self.J, self.D)), []

        def run(sl):
            v[sl], trace = routing_calls.run_forward(self.algo, self.B, self.u_hat(sl), {}, None, None)
            parts.append((sl, trace))

        self.B.split_batch(run, n, self.P * self.T * self.J * self.D)
        self.trace = parts
        return v

    def u_hat(self, sl):
        """û_j|i of the samples sl: (I, n, J, D), laid out as B.predictions lays it."""
        ut, Wt = self.cache
        return self.B.xp.reshape(self.B.predictions(ut[:, :, sl], Wt), (self.P * self.T, -1, self.J, self.D))

    def backward(self, dv, input_grad=True):
        B, xp = self.B, self.B.xp
        ut, _ = self.cache
        Wm = xp.reshape(self.params["W"], (-1, self.T, self.J * self.D, self.K))
        dW, du = B.zeros(tuple(Wm.shape)), B.empty(tuple(ut.shape))

        def run(sl):
            trace = next(t for s, t in self.trace if s == sl)
            u_hat = self.u_hat(sl)
            routing_calls.run_backward(self.algo, B, u_hat, None, trace, dv[sl], {}, out=u_hat)
            dh = xp.reshape(u_hat, (self.P, self.T, -1, self.J * self.D))           # dû of the block
            dW[...] += B.matmul(xp.matrix_transpose(dh), ut[:, :, sl])
            du[:, :, sl] = B.matmul(dh, Wm)

        B.split_batch(run, dv.shape[0], self.P * self.T * self.J * self.D)
        self.cache = None
        self.grads["W"] += xp.reshape(dW, self.params["W"].shape)
        return xp.permute_dims(du, (2, 0, 1, 3))


class InputGradPerBlock(ClassCaps):
    """Today's forward; du made from each block's dû as the routing backward writes it."""

    def backward(self, dv, input_grad=True):
        B, xp = self.B, self.B.xp
        ut, u_hat, _ = self.cache
        Wm = xp.reshape(self.params["W"], (-1, self.T, self.J * self.D, self.K))
        du = B.empty(tuple(ut.shape))

        def run(sl):
            trace = next(t for s, t in self.trace if s == sl)
            routing_calls.run_backward(self.algo, B, B.route_block(u_hat, sl), None, trace, dv[sl], {},
                                       out=u_hat[:, sl])
            du[:, :, sl] = B.matmul(xp.reshape(u_hat[:, sl], (self.P, self.T, -1, self.J * self.D)), Wm)

        B.split_batch(run, dv.shape[0], self.P * self.T * self.J * self.D)
        self.cache = None
        dh = xp.reshape(u_hat, (self.P, self.T, -1, self.J * self.D))
        self.grads["W"] += xp.reshape(B.matmul(xp.matrix_transpose(dh), ut), self.params["W"].shape)
        return xp.permute_dims(du, (2, 0, 1, 3))


VARIANTS = {"today": ClassCaps, "recompute": Recompute, "du-per-block": InputGradPerBlock}


def layers(B):
    return {name: cls(B, 36, 32, 8, 10, 16, iters=3, routing="dynamic", rng=np.random.default_rng(0), init_std=0.05)
            for name, cls in VARIANTS.items()}


def agree(B) -> float:
    """The largest difference of any variant's du and dW from today's, in float64."""
    data = np.random.default_rng(1)
    u = B.asarray(data.standard_normal((8, 36, 32, 8)) * 0.3)
    dv = B.asarray(data.standard_normal((8, 10, 16)))
    found = {}
    for name, layer in layers(B).items():
        layer.forward(u)
        found[name] = (B.to_numpy(layer.backward(dv)), B.to_numpy(layer.grads["W"]))
    return max(float(np.abs(a - b).max()) for name in VARIANTS for a, b in zip(found[name], found["today"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="numpy", choices=("numpy", "torch"))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    print(f"largest difference from today's gradients (float64): {agree(backends.get(args.backend, dtype='float64')):.1e}")
    B = backends.get(args.backend, dtype="float32")
    data = np.random.default_rng(1)
    u = B.asarray(data.standard_normal((args.batch, 36, 32, 8)).astype(np.float32) * 0.3)
    dv = B.asarray(data.standard_normal((args.batch, 10, 16)).astype(np.float32) * 0.01)
    built = layers(B)
    times = {name: [] for name in built}
    for rep in range(args.reps + 2):
        for name, layer in built.items():
            t = time.process_time()
            layer.forward(u)
            t1 = time.process_time()
            layer.backward(dv)
            if rep >= 2:
                times[name].append((t1 - t, time.process_time() - t1))
    for name, ts in times.items():
        f, b = (1e3 * float(np.median([x[k] for x in ts])) for k in (0, 1))
        print(f"{args.backend} {name:>13}: forward {f:5.1f}  backward {b:5.1f}  total {f + b:5.1f} ms CPU")


if __name__ == "__main__":
    main()

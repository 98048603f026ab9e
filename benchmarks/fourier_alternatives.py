"""Two ways to fewer FLOPs in the Fourier PrimaryCaps, timed against what it does today, at the
paper network's shapes (batch 64: F = 52 frequencies, C' = 1,024 phase channels, 256 outputs, a
10 x 10 phase grid, 5 x 5 taps per phase):

    gauss   a complex product by three real products (Gauss) instead of one stacked product of
            four blocks, per frequency; the sums V_r + V_i and V_i - V_r timed apart
    fft     the input grid's and the kernel's transforms by real FFTs (NumPy's and PyTorch's)
            instead of products with the DFT matrices (fourier.dft_matrices)

    OMP_NUM_THREADS=1 python benchmarks/fourier_alternatives.py [--batch 64] [--reps 3]

CPU time per call (medians of --reps after one untimed call); the FFTs' results would still need
a transpose into the per-frequency layout, which is not counted.  docs/performance.md quotes it.
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

from pycapsnet.core.fourier import dft_matrices


def cpu_ms(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        t = time.process_time()
        fn()
        times.append(time.process_time() - t)
    return 1e3 * float(np.median(times))


def gauss(n, reps, F=52, C=256, Cp=1024):
    rng = np.random.default_rng(0)
    VT = rng.standard_normal((F, 2 * C, Cp), dtype=np.float32)     # [V_r^T; V_i^T] per frequency
    X = rng.standard_normal((F, 2 * n, Cp), dtype=np.float32)      # [X_r; X_i]
    Vr, Vi = VT[:, :C], VT[:, C:]
    Sp, Sm = Vr + Vi, Vi - Vr

    def today():
        P = VT @ X.transpose(0, 2, 1)
        return P[:, :C, :n] - P[:, C:, n:], P[:, C:, :n] + P[:, :C, n:]

    def three():
        Xr, Xi = X[:, :n], X[:, n:]
        k1 = Vr @ (Xr + Xi).transpose(0, 2, 1)
        return k1 - Sp @ Xi.transpose(0, 2, 1), k1 + Sm @ Xr.transpose(0, 2, 1)

    Yr, Yi = today()
    Gr, Gi = three()
    assert np.allclose(Yr, Gr, rtol=1e-3, atol=1e-2) and np.allclose(Yi, Gi, rtol=1e-3, atol=1e-2)
    return {"today (one stacked product)": cpu_ms(today, reps), "Gauss (three products)": cpu_ms(three, reps),
            "Gauss's sums of V": cpu_ms(lambda: (Vr + Vi, Vi - Vr), reps)}


def fft(n, reps, Cp=1024, C=256):
    rng = np.random.default_rng(0)
    Fx, Fw, _ = (a.astype(np.float32) for a in dft_matrices(10, 10, 5, 6, 6))
    xs = rng.standard_normal((100, n * Cp), dtype=np.float32)
    wsT = rng.standard_normal((25, C * Cp), dtype=np.float32)
    xg = np.ascontiguousarray(xs.T).reshape(-1, 10, 10)
    wg = np.ascontiguousarray(wsT.T).reshape(-1, 5, 5)
    out = {"input grid: DFT-matrix product": cpu_ms(lambda: Fx @ xs, reps),
           "input grid: numpy.fft.rfft2": cpu_ms(lambda: np.fft.rfft2(xg), reps),
           "kernel: DFT-matrix product": cpu_ms(lambda: Fw @ wsT, reps),
           "kernel: numpy.fft.rfft2": cpu_ms(lambda: np.fft.rfft2(wg, s=(10, 10)), reps)}
    try:
        import torch
    except ImportError:
        return out
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    txg, twg = torch.from_numpy(xg), torch.from_numpy(wg)
    out["input grid: torch.fft.rfft2"] = cpu_ms(lambda: torch.fft.rfft2(txg), reps)
    out["kernel: torch.fft.rfft2"] = cpu_ms(lambda: torch.fft.rfft2(twg, s=(10, 10)), reps)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args(argv)
    for name, part in (("gauss", gauss), ("fft", fft)):
        for k, v in part(a.batch, a.reps).items():
            print(f"{name:5s}  {k:34s} {v:8.1f} ms CPU")


if __name__ == "__main__":
    main()

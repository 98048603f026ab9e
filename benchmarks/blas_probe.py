"""The same matrix products through NumPy's BLAS and through PyTorch's, on the shapes a train step
of the paper's CapsNet runs (batch 64, float32): why the torch backend trails the NumPy backend on
a CPU where the two libraries bring different BLAS (on the project's AMD machine, NumPy's OpenBLAS
against the torch wheel's MKL).

    python benchmarks/blas_probe.py

It also times a transform product from NumPy placed between two torch operations, against the
same three steps in torch: what handing torch's products to NumPy's BLAS (zero-copy) would cost
once both libraries' thread pools are awake, and the Fourier input gradient's product with half
its terms subnormal (about 1e-42) against the same product on ordinary numbers: some CPUs multiply
subnormal floats in microcode, many times slower (docs/performance.md, "What limits each machine").
Medians of --reps runs, milliseconds.

Both run as in a train step: ``backends`` is imported before NumPy (it sets OpenBLAS's thread
timeout) and freed memory is kept for reuse (``keep_freed_memory``, as both CPU backends ask).
Without that, every product's output is fresh pages that the kernel must fault in, and the probe
times the page faults: torch's ClassCaps product read 19 ms against 3 ms with reuse.
"""
from __future__ import annotations

import argparse

from pycapsnet import backends  # noqa: F401,I001  (imported for its effect, before NumPy: see backends/__init__.py)
import numpy as np

from pycapsnet.backends.host import keep_freed_memory
from pycapsnet.training.argtypes import positive_int
from bench import _median_time  # (run as a script: benchmarks/ is on the path)


def _median_ms(fn, reps):
    """Median milliseconds of ``reps`` runs after one warm-up run (CPU work: nothing to sync)."""
    return 1e3 * _median_time(fn, 1, reps, lambda: None)[0]


def main(argv=None):
    import torch

    keep_freed_memory()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=positive_int, default=15)
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    # (label, batch dims, m, k, n): A (batch, m, k) @ B (batch, k, n)
    shapes = [
        ("PrimaryCaps input transform Fx @ xs", (), 104, 100, 64 * 1024),
        ("PrimaryCaps kernel transform Fw @ ws (one chunk)", (), 26, 25, 1024 * 256),
        ("PrimaryCaps output transform Fy @ Y", (), 36, 104, 64 * 256),
        ("PrimaryCaps per-frequency forward X V", (13,), 128, 1024, 256),
        ("PrimaryCaps per-frequency dX, dY (V_r|V_i)^T", (13,), 128, 256, 1024),
        ("ClassCaps u_hat = u W (k = 8)", (1152,), 64, 8, 160),
    ]
    print(f"torch {torch.__version__} ({torch.get_num_threads()} threads), numpy {np.__version__}")
    print(f"{'product':52s} {'GFLOP':>6s} {'numpy ms':>9s} {'torch ms':>9s} {'torch/numpy':>11s}")
    for label, batch, m, k, n in shapes:
        a = rng.standard_normal((*batch, m, k), dtype=np.float32)
        b = rng.standard_normal((*batch, k, n), dtype=np.float32)
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        gflop = 2 * int(np.prod(batch or (1,))) * m * k * n / 1e9
        t_np, t_torch = _median_ms(lambda: a @ b, args.reps), _median_ms(lambda: ta @ tb, args.reps)
        print(f"{label:52s} {gflop:6.2f} {t_np:9.1f} {t_torch:9.1f} {t_torch / t_np:10.2f}x")

    a = torch.randn(104, 100)
    b = torch.randn(100, 64 * 1024)
    big = torch.randn(1152 * 64 * 160)  # a û-sized tensor: torch's elementwise ops wake its threads
    a_np, b_np = a.numpy(), b.numpy()

    def torch_only():
        big.mul_(1.0001)
        a @ b
        big.mul_(0.9999)

    def numpy_between():
        big.mul_(1.0001)
        a_np @ b_np
        big.mul_(0.9999)

    print("\nthe input transform between two torch elementwise passes over 47 MB:")
    print(f"  torch product          {_median_ms(torch_only, args.reps):7.1f} ms")
    print(f"  NumPy product (shared) {_median_ms(numpy_between, args.reps):7.1f} ms")

    # (13, 128, 512) @ (13, 512, 1024): a quarter of the dX product's frequencies. Even columns of M
    # and even rows of V scaled so that their products (1e-24 * 1e-18) fall below float32's
    # smallest normal number (1.2e-38), as the transforms' quarter-turn residues once made them.
    m = rng.standard_normal((13, 128, 512), dtype=np.float32)
    v = rng.standard_normal((13, 512, 1024), dtype=np.float32)
    m_sub, v_sub = m.copy(), v.copy()
    m_sub[..., ::2] *= np.float32(1e-24)
    v_sub[:, ::2, :] *= np.float32(1e-18)
    assert 0 < abs(float(m_sub[0, 0, 0] * v_sub[0, 0, 0])) < np.finfo(np.float32).tiny
    t_normal = _median_ms(lambda: m @ v, args.reps)
    t_sub = _median_ms(lambda: m_sub @ v_sub, args.reps)
    print("\nthe dX product (13, 128, 512) @ (13, 512, 1024), NumPy:")
    print(f"  ordinary numbers            {t_normal:7.1f} ms")
    print(f"  half the terms subnormal    {t_sub:7.1f} ms  ({t_sub / t_normal:.2f}x)")


if __name__ == "__main__":
    main()

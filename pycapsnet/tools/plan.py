"""Will it fit?  The memory of a training step, worked out from the configuration alone.

``plan(config, batch_size)`` walks one train step (forward, losses, backward, optimizer) of a
built-in network layer by layer, and keeps a ledger (ledger.py) of the arrays alive, as the layers'
code allocates and frees them.  This module walks the vector-capsule networks (dynamic and
attention routing), plan_em.py the EM network.  The ledger's parts:

* **state**, held for the whole run: the parameters, their gradients, the optimizer's slots (Adam:
  two per parameter), and per-shape constants (the Fourier convolution's transform matrices, and the
  kernel spectrum V or grid ws it keeps between forward and backward);
* **kept**: what each layer's forward keeps for its backward (its cache), which grows with the batch;
* **work**: the largest set of temporaries inside one layer's forward or backward, on top of
  everything alive at that moment.  Where a layer works in chunks (im2col bands, routing chunks of
  positions, Fourier frequency chunks) this is bounded by the chunk setting, not by the image.

The step's peak is the largest (state + kept so far + work) over the walk.  Nothing is allocated.

The ledger follows the NumPy backend's allocations (each temporary of an expression is its own
array).  The torch backend frees temporaries the same way, but on the CPU it convolves with
PyTorch's kernels, which make no im2col matrix: there a conv layer's work is an upper bound.  GPU
allocators cache and round blocks, so read a GPU plan as a lower bound.  ``tests/test_plan.py``
checks the peak against a measured step (tracemalloc, which sees every NumPy array) within 15%;
docs/performance.md compares the two from 28x28 to 224x224.
"""
from __future__ import annotations

import math
import tracemalloc
from dataclasses import dataclass, field

import numpy as np

from pycapsnet import backends
from pycapsnet.backends.host import cpu_threads
from pycapsnet.backends.numpy_backend import NumpyBackend

from .ledger import conv_shape, decoder, im2col_work, LayerMemory, Ledger, OPTIMIZER_SLOTS
from .plan_em import walk_em
from ..core.capsules import ClassCaps
from ..core.fourier import phase_grid, FourierConv2d
from ..core.model import geometry, param_shapes, CapsNet, CapsNetConfig
from ..training import optim

SEARCH_CAP = 1 << 40  # largest_batch searches no further


@dataclass
class Plan:
    config: CapsNetConfig
    batch_size: int
    itemsize: int
    optimizer: str
    layers: list = field(default_factory=list)
    state: int = 0           # parameters, gradients, optimizer slots, per-shape constants
    peak: int = 0            # the step's estimated peak, bytes
    peak_at: str = ""        # where in the step it falls

    @property
    def n_params(self) -> int:
        return sum(layer.params for layer in self.layers)

    @property
    def per_image(self) -> float:
        """What one more image adds to the peak (bytes): the peak's slope in the batch size."""
        return _slope(self.config, self.batch_size, self.itemsize, self.optimizer)

    def largest_batch(self, budget: int) -> int:
        """The largest batch whose estimated peak fits ``budget`` bytes (0 if not even one;
        SEARCH_CAP if that many fit: the search stops there)."""
        fits = lambda n: _walk(self.config, n, self.itemsize, self.optimizer)[0] <= budget  # noqa: E731
        if not fits(1):
            return 0
        if fits(SEARCH_CAP):
            return SEARCH_CAP
        lo, hi = 1, 2
        while fits(hi):
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo


def plan(config: CapsNetConfig, batch_size: int, dtype: str = "float32", optimizer: str = "adam") -> Plan:
    """The memory plan of one training step of ``config`` at ``batch_size`` (see the module docstring)."""
    if optimizer not in OPTIMIZER_SLOTS:
        raise ValueError(f"unknown optimizer {optimizer!r}: use one of {tuple(OPTIMIZER_SLOTS)}")
    itemsize = np.dtype(dtype).itemsize
    peak, where, layers, state = _walk(config, batch_size, itemsize, optimizer)
    return Plan(config, batch_size, itemsize, optimizer, layers, state, peak, where)


def _slope(cfg, n, itemsize, optimizer):
    a, b = max(1, n), max(1, n) + 8
    return (_walk(cfg, b, itemsize, optimizer)[0] - _walk(cfg, a, itemsize, optimizer)[0]) / (b - a)


def _walk(cfg: CapsNetConfig, n: int, b: int, optimizer: str):
    """(peak, where, layers, state) of a train step at batch n with itemsize b."""
    return (walk_em if cfg.routing == "em" else _walk_vector)(cfg, n, b, optimizer)


def _walk_vector(cfg: CapsNetConfig, n: int, b: int, optimizer: str):
    """The vector-capsule networks (dynamic and attention routing).  It walks the step in the order
    the step allocates, forward then backward, one block per layer, so that it reads against
    model.py and the layers side by side; each layer's sizes come from a helper below."""
    shapes = param_shapes(cfg)
    count = {k: int(np.prod(s)) for k, s in shapes.items()}
    c, h, w = cfg.input_shape
    k1, s1, c1 = cfg.conv_kernel, cfg.conv_stride, cfg.conv_channels
    h1, w1 = (h - k1) // s1 + 1, (w - k1) // s1 + 1
    P, _ = geometry(cfg)
    T = cfg.primary_types
    caps = T * cfg.primary_dim
    L = Ledger()
    layers = []

    # ---- state: parameters, gradients, optimizer slots ---------------------------------------------
    state = (2 + OPTIMIZER_SLOTS[optimizer]) * sum(count.values()) * b
    L.add(state)
    L.add(n * c * h * w * b)                               # the batch x

    # ---- conv1 (im2col) + ReLU -----------------------------------------------------------------------
    f1, b1, out1 = im2col_work(conv_shape(k1, s1, c, c1), n, h, w, b)
    L.touch(f1, "conv1 forward")
    L.add(out1)                                            # ReLU's output, kept for its backward
    L.touch(out1, "relu1 forward")                         # with conv1's output, freed after
    layers.append(LayerMemory("conv1", count["conv1.W"] + count["conv1.b"], kept=out1, work=max(f1, b1)))

    # ---- PrimaryCaps -----------------------------------------------------------------------------------
    s_bytes = n * P * caps * b                              # s_i (also u_i's size)
    squash_kept = s_bytes + n * P * T * b                   # s and |s|
    prim = LayerMemory("primary", count["primary.W"] + count["primary.b"])
    if cfg.primary_conv == "im2col":
        fwd, bwd, _ = im2col_work(conv_shape(cfg.primary_kernel, cfg.primary_stride, c1, caps), n, h1, w1, b)
        kept_conv = 0                                       # keeps its input, ReLU's output
        bwd += out1                                         # dx, the size of its input
    else:
        fwd, bwd, kept_conv, consts, kept_kernel, angles = _primary_fourier(cfg, n, b, h1, w1, c1, caps)
        prim.state = consts + kept_kernel
        L.add(consts)
        state += consts
        L.touch(angles, "primary transforms (first step)")
    L.touch(fwd, "primary forward")
    L.add(kept_conv + squash_kept)
    L.touch(2 * s_bytes, "primary squash")                  # s*s, then u
    L.add(s_bytes)                                          # u_i, alive until the step's forward ends
    prim.kept, prim.work = kept_conv + squash_kept, max(fwd, bwd)
    layers.append(prim)

    # ---- ClassCaps -------------------------------------------------------------------------------------
    kept_cc, fwd_cc, bwd_cc = _classcaps_work(cfg, n, b, P, s_bytes)
    L.add(kept_cc)
    L.touch(fwd_cc, "classcaps forward")
    layers.append(LayerMemory("classcaps", count["classcaps.W"] + count.get("classcaps.bias", 0),
                              kept=kept_cc, work=max(fwd_cc, bwd_cc)))

    # ---- decoder, losses ---------------------------------------------------------------------------------
    decoder(L, cfg, n, b, count, layers, returned=s_bytes)  # u_i: the forward has returned

    # ---- backward: ClassCaps, PrimaryCaps, ReLU, conv1 ------------------------------------------------------
    L.touch(bwd_cc, "classcaps backward")
    L.add(-kept_cc + s_bytes)                               # du_i
    L.touch(3 * s_bytes, "primary squash backward")
    L.add(-squash_kept)
    L.touch(bwd, "primary backward")
    L.add(-kept_conv - s_bytes + out1)                      # dx of PrimaryCaps, the size of ReLU's output
    L.touch(out1 + out1 // b, "relu1 backward")            # its mask (bytes) and the product
    L.add(-out1)
    L.touch(b1, "conv1 backward")

    # ---- optimizer -------------------------------------------------------------------------------------------
    # Adam's scratch block (SGD's one temporary) on each thread (B.over_blocks)
    L.touch(NumpyBackend.elementwise_block * b * cpu_threads(), "optimizer")
    return L.peak, L.at, layers, state


def _primary_fourier(cfg: CapsNetConfig, n: int, b: int, h1: int, w1: int, c1: int, caps: int):
    """PrimaryCaps by the Fourier convolution (fourier.py): (forward work, backward work, kept,
    per-shape constants, the kernel part of kept, the first step's float64 angles), in bytes."""
    k2, st = cfg.primary_kernel, cfg.primary_stride
    oh, ow, kq, n_h, n_w = phase_grid(h1, w1, k2, st)
    grid = n_h * n_w
    F = (grid + (2 - n_h % 2) * (2 - n_w % 2)) // 2     # one of each pair {f, -f}: fourier.half_spectrum
    c_phase = st * st * c1
    fit = (st * n_h, st * n_w) != (h1, w1)
    x_grid = n * grid * c_phase * b                     # the phase grid xs, and X = Fx xs as large
    fw = FourierConv2d
    consts = (2 * F * grid + oh * ow * 2 * F + kq * kq * 2 * F) * b        # Fx, Fy, Fw^T
    spectrum = 2 * F * c_phase * caps * b
    keep_V = spectrum <= fw.keep_spectrum_mb * 2**20
    kept_kernel = spectrum if keep_V else kq * kq * c_phase * caps * b    # V, or the kernel grid ws
    chunk_V = 2 * min(fw.freq_chunk, F) * c_phase * caps * b
    Y = 2 * F * n * caps * b
    out = n * oh * ow * caps * b
    fwd = max((x_grid if fit else 0) + 2 * x_grid,      # the fitted input, xs and X
              # V kept: made whole (kept_kernel); else a chunk of it at a time
              x_grid + kept_kernel + Y + (0 if keep_V else chunk_V) + 2 * min(fw.freq_chunk, F) * 2 * n * caps * b,
              x_grid + kept_kernel + Y + 2 * out)       # y = Fy Y, then with the bias
    dY = 2 * F * n * caps * b
    block = min(conv_shape(k2, st, c1, caps, fw).weight_grad_block(F, b, n), c_phase)
    bwd = max(out + 3 * dY + (F + kq * kq) * 2 * caps * block * b,   # dyg, dY, its block matrix M, a block of dV^T, dws
              # then X is freed, and dX made (in one product, or a chunk of V and its product at a
              # time), transformed back and cropped
              out + 2 * dY + (0 if keep_V else chunk_V + min(fw.freq_chunk, F) * 2 * n * c_phase * b),
              x_grid + (n * st * n_h * st * n_w * c1 * b if fit else 0))
    angles = 2 * min(1024, F) * grid * 8                # float64 angles, made by blocks
    return fwd, bwd, x_grid + kept_kernel, consts, kept_kernel, angles   # kept: X, and V or ws


def _classcaps_work(cfg: CapsNetConfig, n: int, b: int, P: int, s_bytes: int):
    """ClassCaps: (kept, forward work, backward work) in bytes, for dynamic or attention routing,
    with or without share_spatial."""
    T, K, J, D = cfg.primary_types, cfg.primary_dim, cfg.n_classes, cfg.class_dim
    attention = cfg.routing == "attention"  # one pass, û always formed (AttentionCaps)
    iters = 1 if attention else cfg.routing_iters
    if cfg.share_spatial and not attention:
        chunk = min(P, ClassCaps.positions_per_chunk(ClassCaps.chunk_bytes, n, T, J, b))
        c_chunk = n * T * chunk * J * b                     # coupling coefficients of a chunk of positions
        trace = iters * (2 * n * T * J * K + 3 * n * J * D) * b   # A and z, s, |s|, v per iteration
        u_chunk = n * T * chunk * K * b
        return (s_bytes + trace,                            # u transposed, contiguous
                3 * c_chunk + u_chunk,                      # a chunk's logits, their exponentials, c
                s_bytes + 3 * c_chunk + 2 * u_chunk)        # du, and a chunk's c, dc, db (softmax backward)
    u_hat = n * P * T * J * D * b
    c_all = n * J * P * T * b
    trace = iters * (2 * c_all + 3 * n * J * D * b)        # c and b per iteration; attention: c and c + β
    # routing runs on blocks of the batch, each read in place (NumPy stores û sample-major,
    # B.predictions), and writes dû over û.  Attention's scores, their scaling and softmax; in
    # backward dĉ, the softmax's backward and the ones that scale dS (attention_routing.py)
    fwd = (3 if attention else 2) * c_all
    bwd = (4 if attention else 3) * c_all + s_bytes
    if cfg.share_spatial:  # attention: W shared, û formed all the same; dW per position, then summed
        bwd = max(bwd, P * T * J * D * K * b)
    return u_hat + trace, fwd, bwd


def measured_peak(config: CapsNetConfig, batch_size: int, dtype: str = "float32", optimizer: str = "adam",
                  steps: int = 2) -> int:
    """The measured counterpart of ``plan(...).peak``: the most bytes of arrays alive at once during
    a train step (optimizer step included) of the NumPy backend, seen by tracemalloc, from before the
    model is built (so its parameters and optimizer state count).  The largest of ``steps`` steps
    (the first makes the per-shape constants).  Random images and labels; NumPy backend only."""
    B = backends.get("numpy", dtype=dtype)
    c, h, w = config.input_shape
    rng = np.random.default_rng(0)
    x = rng.random((batch_size, c, h, w)).astype(dtype)
    y = np.arange(batch_size) % config.n_classes
    tiny = CapsNet(B, CapsNetConfig(n_classes=2, conv_channels=4, primary_types=2, decoder_hidden=(4, 4)))
    tiny.train_step_grads(np.zeros((1, 1, 28, 28), dtype), np.zeros(1, np.int64))
    del tiny  # a first step imports what a step imports: those modules are not the step's memory
    tracemalloc.start()
    try:
        model = CapsNet(B, config)
        opt = optim.make(optimizer, model, 1e-3)
        for _ in range(steps):
            model.train_step_grads(x, y)
            opt.step()
        return tracemalloc.get_traced_memory()[1] + x.nbytes  # the batch was made before tracing began
    finally:
        tracemalloc.stop()


def format_bytes(nbytes: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:,.1f} {unit}"
    return f"{nbytes:,.0f} B"


def parse_memory(text: str) -> int:
    """'80GB', '512MB', '1.5 GiB', '4e9' -> bytes.  The units are powers of 1024, GB as GiB: what
    ``format_bytes`` prints, and what a GPU's or a machine's memory is quoted in."""
    units = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20, "MIB": 2**20,
             "G": 2**30, "GB": 2**30, "GIB": 2**30, "T": 2**40, "TB": 2**40, "TIB": 2**40}
    t = str(text).strip().upper().replace(" ", "")
    number = t.rstrip("KMGTIB")
    unit = t[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = math.nan
    if unit not in units or not math.isfinite(value) or value <= 0:
        raise ValueError(f"cannot read memory size {text!r}: write it as e.g. 80GB, 512MB or 1.5GiB")
    return int(value * units[unit])

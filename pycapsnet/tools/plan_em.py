"""The memory ledger of a train step of the EM network (matrix capsules, model.py's "em"): conv1,
PrimaryMatrixCaps, two ConvMatrixCaps, ClassMatrixCaps, the decoder; plan.py's walk for the vector
networks, read against matrix_capsules.py and em_routing.py.

Every routed layer holds its votes V_ij (N, P, I, C, 16) and, per iteration, the assignments R_ij
(N, P, I, C) for its backward; its backward makes dV as large as V.  EM routing's own temporaries
(d²_ijh, the E-step's log-likelihoods, in backward d, q and dL q) are made a block of samples at a
time on each host thread (B.split_batch), so they grow with the block, not with the batch.
"""
from __future__ import annotations

import numpy as np

from pycapsnet.backends.host import cpu_threads, sample_parts
from pycapsnet.backends.numpy_backend import NumpyBackend

from ..core.model import EM_KERNELS, em_grids, param_shapes
from .ledger import OPTIMIZER_SLOTS, LayerMemory, Ledger, conv_shape, decoder, im2col_work


def _block_samples(n, sample_size):
    """Samples whose routing temporaries are alive at once: the largest of the NumPy backend's
    blocks (B.split_batch) on each host thread."""
    threads = cpu_threads()
    parts = sample_parts(n, sample_size, NumpyBackend.sample_block, threads)
    return min(n, threads * -(-n // parts))                   # the largest of even_slices' parts


def _routed(L: Ledger, name, n, P, I, C, iters, b, slots_in, count, layers, forward_extra=0):
    """One routed layer's forward on ``L``: votes from its input slots (N, P, I, 16), routing; returns
    (what it keeps, its output, V's size (dV's), its backward's routing temporaries)."""
    vote, assign = n * P * I * C * 16 * b, n * P * I * C * b
    per_iter = assign + (2 * 16 + 3) * n * P * C * b          # R, μ, σ², r, z, a
    m = _block_samples(n, P * I * C * 16)
    vote_blk, assign_blk = m * P * I * C * 16 * b, m * P * I * C * b
    routing = vote_blk + 5 * assign_blk                       # d², and the E-step's ln p, L, e, R
    routing_back = 3 * vote_blk + 6 * assign_blk              # d, q, dL q; dL, dw, dR' and their kin
    L.touch(vote + forward_extra, f"{name} votes")
    kept = slots_in + vote + n * P * I * b + iters * per_iter  # M in slots, V, a_in, the trace
    L.add(kept)
    L.touch(routing, f"{name} routing")
    out = n * P * C * 17 * b                                 # μ and a
    L.add(out)
    layers.append(LayerMemory(name, count[f"{name}.W"] + 2 * count[f"{name}.beta_u"], kept=kept,
                              work=max(routing, vote + routing_back)))     # backward's on top of dV
    return kept, out, vote, routing_back


def walk_em(cfg, n: int, b: int, optimizer: str):
    """(peak, where, layers, state) of a train step of the EM network at batch n, itemsize b."""
    count = {k: int(np.prod(s)) for k, s in param_shapes(cfg).items()}
    c, h, w = cfg.input_shape
    k1, s1, A = cfg.conv_kernel, cfg.conv_stride, cfg.conv_channels
    grids = em_grids(cfg)
    T, J, iters = cfg.primary_types, cfg.n_classes, cfg.routing_iters
    types = (T, *cfg.matrix_types)
    L, layers = Ledger(), []
    state = (2 + OPTIMIZER_SLOTS[optimizer]) * sum(count.values()) * b
    L.add(state + n * c * h * w * b)                          # and the batch x

    # ---- conv1 (im2col) + ReLU, PrimaryMatrixCaps (a 1x1 linear layer: T*16 pose entries, T logits) ----
    f1, b1, out1 = im2col_work(conv_shape(k1, s1, c, A), n, h, w, b)
    L.touch(f1, "conv1 forward")
    L.add(out1)                                               # ReLU's output, kept (and read by the linear layer)
    L.touch(out1, "relu1 forward")
    layers.append(LayerMemory("conv1", count["conv1.W"] + count["conv1.b"], kept=out1, work=max(f1, b1)))
    rows = n * grids[0][0] * grids[0][1]
    y = rows * T * 17 * b                                     # x W, then + b; the poses are a view of it
    L.touch(2 * y, "primary forward")
    a_prim = rows * T * b                                     # a = sigmoid(logits): output, and kept
    L.add(y + a_prim)
    layers.append(LayerMemory("primary", count["primary.W"] + count["primary.b"], kept=a_prim, work=2 * y))

    # ---- the routed layers: a convolutional one copies its input into window slots, which frees it ---------
    backs, prev_out = [], y                                   # the primary poses, a view of y
    for k, (kernel, stride) in enumerate(EM_KERNELS, start=1):
        (gh, gw), (oh, ow) = grids[k - 1], grids[k]
        P, I = oh * ow, kernel * kernel * types[k - 1]
        slots = n * P * I * 16 * b                            # M in window slots (im2col)
        L.touch(slots + n * P * I * b, f"convcaps{k} slots")
        kept, out, vote, back = _routed(L, f"convcaps{k}", n, P, I, types[k], iters, b, slots, count, layers,
                                        forward_extra=slots)
        L.add(-prev_out)
        backs.append((f"convcaps{k}", kept, vote, back, slots + n * gh * gw * types[k - 1] * 17 * b))
        prev_out = out
    gh, gw = grids[-1]
    I = gh * gw * types[-1]
    kept, out, vote, back = _routed(L, "classcaps", n, 1, I, J, iters, b, 0, count, layers)  # coordinates added in place
    # its cache holds its input as it came (the poses a view, a reshaped): freed with the rest of it
    backs.append(("classcaps", kept + prev_out, vote, back, n * I * 16 * b))

    # ---- decoder, losses; then the routed layers' backward, last first ----------------------------------------
    decoder(L, cfg, n, b, count, layers, returned=out)        # the class poses and activations
    for name, kept, vote, back, grads_in in reversed(backs):
        L.touch(vote + back, f"{name} backward")
        L.touch(vote + grads_in, f"{name} backward")          # dV, then dM in slots and back on the grid
        L.add(-kept)
    L.touch(rows * T * 17 * b * 2 + out1, "primary backward")  # dy, and dh
    L.add(-a_prim)
    L.touch(out1 + out1 // b, "relu1 backward")
    L.add(-out1)
    L.touch(b1, "conv1 backward")
    # Adam's scratch block (SGD's one temporary) on each thread (B.over_blocks)
    L.touch(NumpyBackend.elementwise_block * b * cpu_threads(), "optimizer")
    return L.peak, L.at, layers, state

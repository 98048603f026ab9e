"""The bookkeeping that ``plan`` walks a train step with: a ledger of the bytes alive, one row per
layer, and the temporaries of the im2col convolution that every built-in network starts with."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.layers import Conv2d
from ..core.model import decoder_sizes

OPTIMIZER_SLOTS = {"adam": 2, "sgd": 1}


@dataclass
class LayerMemory:
    name: str
    params: int = 0          # parameter count
    kept: int = 0            # bytes its forward keeps for its backward (the whole batch)
    work: int = 0            # bytes of its largest set of temporaries, forward or backward
    state: int = 0           # bytes held whatever the batch (constants, a kept kernel spectrum)


class Ledger:
    """Bytes alive, and the largest total seen (with the place it was seen)."""

    def __init__(self):
        self.live, self.peak, self.at = 0, 0, ""

    def add(self, nbytes):
        self.live += nbytes

    def touch(self, extra, at):
        """Temporaries of ``extra`` bytes exist on top of what is alive, at ``at``."""
        if self.live + extra > self.peak:
            self.peak, self.at = self.live + extra, at


def conv_shape(kernel, stride, c_in, c_out, cls=Conv2d):
    """A Conv2d's geometry without its parameters: enough for ``output_hw``, ``chunks`` and
    ``FourierConv2d.weight_grad_block``."""
    conv = cls.__new__(cls)
    conv.k, conv.stride, conv.padding, conv.c_in, conv.c_out = kernel, stride, 0, c_in, c_out
    return conv


def im2col_work(conv: Conv2d, n, h, w, b):
    """(forward, backward) temporaries of ``Conv2d`` on (n, h, w, C_in), with its output (the
    forward makes the output, then adds the bias into a second array)."""
    c_in, c_out = conv.c_in, conv.c_out
    oh, ow = conv.output_hw(h, w)
    images, band_rows, n_chunks = conv.chunk_shape(n, h, w, b)
    x_chunk = images * band_rows * ow * conv.k * conv.k * c_in * b  # one chunk's im2col matrix
    y_chunk = images * band_rows * ow * c_out * b
    out = n * oh * ow * c_out * b
    forward = max(out + x_chunk + (y_chunk if n_chunks > 1 else 0), 2 * out)
    band_in = images * min(h, conv.stride * (band_rows - 1) + conv.k) * w * c_in * b
    backward = x_chunk + max(band_in, conv.k * conv.k * c_in * c_out * b)  # X and dW's part, then dX and its col2im
    return forward, backward, out


def decoder(L: Ledger, cfg, n, b, count, layers, returned=0):
    """The masked decoder's forward and backward (with the reconstruction error), on ``L``; the
    forward's end frees ``returned`` bytes (what lived only until the network's forward returned)."""
    image = n * int(np.prod(cfg.input_shape)) * b
    sizes = decoder_sizes(cfg)
    dec_kept = 0
    for k, (a, o) in enumerate(sizes, start=1):
        kept = n * (a + o) * b                              # its input, and its activation's output
        dec_kept += kept
        W = count[f"decoder{k}.W"] * b
        layers.append(LayerMemory(f"decoder{k}", count[f"decoder{k}.W"] + count[f"decoder{k}.b"], kept=kept,
                                  work=max(W, 3 * n * o * b)))    # dW = x^T dy, made then added
    L.add(dec_kept + image)                                 # and the reconstruction error x_hat - x
    L.add(-returned)
    top = sizes[-1]
    L.touch(3 * n * top[1] * b, "decoder backward")        # dL/dx_hat and the sigmoid's backward
    L.touch(n * top[1] * b + count[f"decoder{len(sizes)}.W"] * b, "decoder backward")
    L.add(-dec_kept - image)

"""The two networks the paper's experiments compare (Sabour, Frosst & Hinton 2017, §5 and §6), as
descriptions (architecture.py) for any input size:

    capsnet       conv1 9x9/1, 256, ReLU -> PrimaryCaps 9x9/2, 32 x 8D -> 10 class capsules of 16D,
                  routing r times (r = 1: the mean of the predictions, no agreement); decoder
                  512-1024 on the masked class capsules, or none (Table 1's "no reconstruction")
    baseline_cnn  three 5x5/1 convolutions ('same' padding) of 256, 256 and 128 channels, the first
                  two max-pooled 2x2, each ReLU'd, two fully connected layers of 328 and 192,
                  dropout before the last (10-way) layer, softmax cross-entropy: the paper's
                  baseline, whose pooling the paper does not give.  Pooling before the ReLU is the
                  same function (max and ReLU commute) at a quarter of the ReLU's work.  The
                  convolutions of many input channels run by the convolution theorem (FOURIER_FROM).
"""
from __future__ import annotations

from ..core import architecture as A

# --quick: the same networks narrowed to run in seconds (what the test suite runs)
QUICK_CAPSNET = dict(decoder_hidden=(32, 64), conv_channels=16, primary_types=4)
QUICK_CNN = dict(channels=(8, 8, 8), hidden=(16, 12))
# The baseline's convolutions of this many input channels or more convolve by the convolution theorem
# (the same layer, with a complex product per frequency for the 25 products per position of a 5x5
# kernel); below it the transforms cost more than the products they save (measured in
# docs/performance.md, the CNN row).
FOURIER_FROM = 64


def capsnet(input_shape, n_classes=10, iters=3, reconstruction=True, decoder_hidden=(512, 1024), conv_channels=256,
            primary_types=32):
    body = [A.conv2d(conv_channels, 9, name="conv1"), A.relu(name="relu1"),
            A.primary_caps(primary_types, 8, kernel=9, stride=2, name="primary"),
            A.dynamic_caps(n_classes, 16, iters=iters, init_std=0.01, name="classcaps")]  # the paper's W_ij init
    return A.network(body, decoder=A.decoder(decoder_hidden) if reconstruction else None,
                     input_shape=input_shape, n_classes=n_classes)


def baseline_cnn(input_shape, n_classes=10, channels=(256, 256, 128), hidden=(328, 192), kernel=5, dropout=0.5,
                 pooled=2):
    """``pooled``: how many of the convolutions (the first ones) are max-pooled 2x2."""
    body, c_in = [], input_shape[0]
    for k, c in enumerate(channels, start=1):
        conv = "fourier" if c_in >= FOURIER_FROM else None
        body.append(A.conv2d(c, kernel, padding=kernel // 2, conv=conv, name=f"conv{k}"))
        c_in = c
        if k <= pooled:
            body.append(A.max_pool(2, name=f"pool{k}"))
        body.append(A.relu(name=f"relu{k}"))
    body.append(A.flatten(name="flatten"))
    for k, h in enumerate(hidden, start=1):
        body += [A.linear(h, name=f"fc{k}"), A.relu(name=f"fc{k}_relu")]
    body += [A.dropout(dropout, name="dropout"), A.linear(n_classes, name="logits")]
    return A.network(body, head="logits", decoder=None, input_shape=input_shape, n_classes=n_classes)

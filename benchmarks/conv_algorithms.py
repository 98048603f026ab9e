"""A convolution's two algorithms side by side: im2col products (``Conv2d``) against the convolution
theorem (``FourierConv2d``), the same layer, at the shapes of the study's networks.  For each shape,
one forward and backward at batch 32 (with the input's gradient but for a first layer), process CPU
time, the fastest of --repeats after one untimed; float32, one thread unless the environment says
otherwise.  This is what ``networks.FOURIER_FROM`` (the input channels from which the baseline CNN
convolves by Fourier) rests on:

    OMP_NUM_THREADS=1 PYCAPSNET_THREADS=1 python benchmarks/conv_algorithms.py [--backend torch]
"""
import argparse
import time

import numpy as np

from pycapsnet import backends
from pycapsnet.core.fourier import FourierConv2d
from pycapsnet.core.layers import Conv2d

# (what, C_in, C_out, H = W, kernel, input gradient): 'same' padding, stride 1
SHAPES = [
    ("matched CNN conv1, CIFAR-10", 3, 158, 32, 5, False),
    ("matched CNN conv2, CIFAR-10", 158, 158, 16, 5, True),
    ("matched CNN conv3, CIFAR-10", 158, 79, 8, 5, True),
    ("matched CNN conv1, MNIST", 1, 142, 28, 5, False),
    ("matched CNN conv2, MNIST", 142, 142, 14, 5, True),
    ("matched CNN conv3, MNIST", 142, 71, 7, 5, True),
    ("ResNet-20 stage 1", 16, 16, 32, 3, True),
    ("ResNet-20 stage 2", 32, 32, 16, 3, True),
    ("ResNet-20 stage 3", 64, 64, 8, 3, True),
]


def cpu_ms(layer, x, dy, input_grad, repeats):
    times = []
    for _ in range(repeats + 1):
        t = time.process_time()
        layer.forward(x)
        layer.backward(dy, input_grad)
        times.append(time.process_time() - t)
    return 1e3 * min(times[1:])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="numpy", choices=("numpy", "torch"))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    B = backends.get(a.backend, dtype="float32")
    rng = np.random.default_rng(0)
    print(f"{a.backend}, batch {a.batch}, CPU ms of forward + backward (fastest of {a.repeats})")
    print("| shape | C_in -> C_out, H x W, k x k | im2col | fourier | fourier / im2col |\n|---|---|---|---|---|")
    for what, c_in, c_out, h, k, input_grad in SHAPES:
        x = B.asarray(rng.standard_normal((a.batch, h, h, c_in)).astype(np.float32))
        dy = B.asarray(rng.standard_normal((a.batch, h, h, c_out)).astype(np.float32))
        ms = [cpu_ms(cls(B, c_in, c_out, k, 1, k // 2, rng=np.random.default_rng(1)), x, dy, input_grad, a.repeats)
              for cls in (Conv2d, FourierConv2d)]
        print(f"| {what} | {c_in} -> {c_out}, {h}x{h}, {k}x{k} | {ms[0]:.1f} | {ms[1]:.1f} | {ms[1] / ms[0]:.2f} |",
              flush=True)


if __name__ == "__main__":
    main()

"""What --augment efficient does to digits, as one picture: the first embedded training digits
(left column) and five draws of Efficient-CapsNet's augmentation of each (pycapsnet/training/augment.py).

    python benchmarks/augment_figure.py                 # -> docs/augment-efficient.png
    python benchmarks/augment_figure.py --out a.png --digits 6 --draws 8 --seed 1
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from pycapsnet.tools import plots  # noqa: E402
from pycapsnet.training import augment, data  # noqa: E402
from pycapsnet.training.argtypes import positive_int, writable_file  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=writable_file, default=os.path.join(ROOT, "docs", "augment-efficient.png"))
    p.add_argument("--digits", type=positive_int, default=8)
    p.add_argument("--draws", type=positive_int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    train, _ = data.load_embedded()
    x = data.as_float(train.x[:args.digits])
    rng = np.random.default_rng(args.seed)
    columns = [x] + [augment.efficient(x, rng) for _ in range(args.draws)]
    plt = plots.pyplot()
    fig, axes = plt.subplots(args.digits, len(columns), figsize=(1.1 * len(columns), 1.1 * args.digits),
                             squeeze=False)
    for i in range(args.digits):
        for j, images in enumerate(columns):
            axes[i, j].imshow(images[i, 0], cmap="gray", vmin=0, vmax=1)
            axes[i, j].set_xticks([])
            axes[i, j].set_yticks([])
    axes[0, 0].set_title("digit", fontsize=9)
    for j in range(1, len(columns)):
        axes[0, j].set_title(f"draw {j}", fontsize=9)
    fig.suptitle("--augment efficient: rotate (half), shift within the margins, squeeze, erase 4x4", fontsize=9)
    fig.tight_layout()
    print(plots.save(fig, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

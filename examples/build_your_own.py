#!/usr/bin/env python
"""Build your own capsule networks from pycapsnet's parts and train them with its trainer.

    python examples/build_your_own.py                 # both networks, 3 epochs each, embedded digits
    python examples/build_your_own.py --quick         # a few batches each: a smoke test

Two networks:
  two-routing   conv1 -> PrimaryCaps -> 32 capsules of 12D -> 10 of 16D: dynamic routing twice
  convcaps      conv1 -> PrimaryCaps -> ConvCaps 3x3 (routing per window) -> 10 of 16D
Each run's directory holds what any run's does (checkpoint.npz, metrics.jsonl, curves.png,
reconstructions.png); the checkpoint records the network, so these work without this script:

    pycapsnet evaluate runs/examples/convcaps
    pycapsnet inspect runs/examples/convcaps --out inspect/
    python train_numpy.py --resume runs/examples/convcaps --epochs 5
"""
import argparse
import json
import os
import sys

from pycapsnet import CapsNetError
from pycapsnet.core import architecture as A
from pycapsnet.training.trainer import fit

stem = [A.conv2d(128, 9, name="conv1"), A.relu(name="relu1"),
        A.primary_caps(16, 8, kernel=9, stride=2, name="primary")]          # 6x6 grid of 16 types of 8D
NETWORKS = {
    "two-routing": A.network(stem + [A.dynamic_caps(32, 12, name="caps1"),
                                     A.dynamic_caps(10, 16, name="classcaps")]),
    "convcaps": A.network(stem + [A.conv_caps(16, 8, kernel=3, stride=1, name="convcaps"),  # 4x4 grid
                                  A.dynamic_caps(10, 16, name="classcaps")]),
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1 epoch on 64 training and 32 test digits")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--out", default=os.path.join("runs", "examples"))
    p.add_argument("--save-descriptions", action="store_true",
                   help="also write each network's JSON description (for train_*.py --network FILE)")
    args = p.parse_args(argv)
    flags = dict(epochs=1, limit=64, limit_test=32, batch_size=16) if args.quick else dict(epochs=args.epochs)
    for name, description in NETWORKS.items():
        out = os.path.join(args.out, name)
        if args.save_descriptions:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"{name}.json"), "w") as f:
                json.dump(description, f, indent=1)
        try:
            last = fit(description, out=out, overwrite=True, **flags)
        except CapsNetError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"{name}: test accuracy {100 * last['test_acc']:.2f}% after {last['epoch']} epoch(s), in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

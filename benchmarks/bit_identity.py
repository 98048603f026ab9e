#!/usr/bin/env python
"""Did a change move the built-in networks' numbers?  Dump, in float64, every variant's losses, class
capsules, reconstruction, input gradient, every parameter gradient and predictions on NumPy and
PyTorch, from one tree, then compare two dumps bit for bit.

    PYTHONPATH=/path/to/old/checkout python benchmarks/bit_identity.py dump old.npz
    python benchmarks/bit_identity.py dump new.npz
    python benchmarks/bit_identity.py compare old.npz new.npz      # exit 1 if any array differs

Only the public API of the built-in networks is used (CapsNet, loss, backward, predict), so a dump
from an older checkout compares with one from this tree.
"""
import argparse
import sys

from pycapsnet import backends  # noqa: F401  (first: it sets NumPy's BLAS thread timeout)
import numpy as np


def dump(path):
    from pycapsnet import CapsNet
    try:
        from pycapsnet.tools.gradcheck import SMALL, SMALL_EM
    except ImportError:  # a checkout from before the subpackages (d4f17c0 ... 58d41c4)
        from pycapsnet.gradcheck import SMALL, SMALL_EM

    variants = {
        "dynamic_full": dict(SMALL, routing_grad="full"), "dynamic_final": dict(SMALL, routing_grad="final"),
        "dynamic_shared": dict(SMALL, share_spatial=True),
        "dynamic_shared_final": dict(SMALL, share_spatial=True, routing_grad="final"),
        "dynamic_im2col": dict(SMALL, primary_conv="im2col"),
        "attention": dict(SMALL, routing="attention"), "attention_shared": dict(SMALL, routing="attention", share_spatial=True),
        "em_full": dict(SMALL_EM, routing_grad="full"), "em_final": dict(SMALL_EM, routing_grad="final"),
        "paper": {},  # the paper's 8.2 M-parameter network, NumPy only
    }
    out = {}
    for backend in ("numpy", "torch"):
        for name, config in variants.items():
            if name == "paper" and backend == "torch":
                continue
            B = backends.get(backend, dtype="float64")
            model = CapsNet(B, seed=3, **config)
            rng = np.random.default_rng(1)
            x = rng.random((4, *model.config.input_shape))
            y = rng.integers(0, model.config.n_classes, 4)
            model.zero_grad()
            o = model.loss(x, y)
            dx = model.backward(input_grad=True)
            key = f"{backend}/{name}"
            out[f"{key}/loss"] = np.array([o.loss, *o.parts.values()])
            out[f"{key}/v"], out[f"{key}/reconstruction"] = B.to_numpy(o.v), B.to_numpy(o.reconstruction)
            out[f"{key}/dx"] = B.to_numpy(dx)
            out.update({f"{key}/grad/{k}": np.array(B.to_numpy(g)) for k, g in model.grads.items()})
            out[f"{key}/predictions"] = model.predict(x)
    np.savez(path, **out)
    print(f"{len(out)} arrays in {path}")
    return 0


def compare(a_path, b_path):
    a, b = np.load(a_path), np.load(b_path)
    only = sorted(set(a.files) ^ set(b.files))
    differ = [k for k in sorted(set(a.files) & set(b.files)) if not np.array_equal(a[k], b[k])]
    print(f"{len(set(a.files) & set(b.files))} arrays compared: {len(differ)} differ, {len(only)} in one dump only")
    for k in differ[:20] + only[:20]:
        print("  " + k)
    return 1 if differ or only else 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("dump").add_argument("out")
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    args = p.parse_args(argv)
    return dump(args.out) if args.command == "dump" else compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())

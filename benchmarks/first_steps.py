"""The class capsules' lengths |v_j| through the first Adam steps of the experiments' CapsNet, on
the embedded digits placed at random on a canvas (28: as they are).

    python benchmarks/first_steps.py --side 40 --steps 40 [--lr 2e-3] [--every 5]

Every ``--every`` steps it prints, for 64 fixed training digits, the mean length of all ten
capsules, of the true class's, and the share of capsules longer than 0.5, then that step's loss.
It shows how fast the lengths grow when many primary capsules feed each class capsule: the first
Adam steps move every W_ij by about lr, and s_j sums P*T such moves (docs/experiments.md)."""
import argparse

from pycapsnet import backends  # noqa: F401,I001  (before NumPy: see backends/__init__.py)
import numpy as np

from pycapsnet.core import architecture as A
from pycapsnet.experiments import digits, networks
from pycapsnet.training import optim
from pycapsnet.training.argtypes import positive_float, positive_int


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--side", type=positive_int, default=40)
    p.add_argument("--steps", type=positive_int, default=40)
    p.add_argument("--every", type=positive_int, default=5)
    p.add_argument("--lr", type=positive_float, default=2e-3)
    p.add_argument("--batch-size", type=positive_int, default=32)
    args = p.parse_args(argv)
    if args.side < 28:
        p.error(f"--side {args.side} is smaller than a digit (28): give 28 or more")
    train, _ = digits.source()
    x, y = train.x, train.y
    rng = np.random.default_rng(0)
    on_canvas = (lambda im: im) if args.side == 28 else (lambda im: digits.place(im, args.side, rng))
    net = A.build(networks.capsnet((1, args.side, args.side)), "numpy", seed=0)
    opt = optim.make("adam", net, args.lr)
    probe, probe_y = on_canvas(x[:64]).astype(np.float32), y[:64]
    print(f"side {args.side}, lr {args.lr}, batch {args.batch_size}")
    print("step  mean |v_j|  true class |v_j|  share > 0.5  loss")
    for step in range(args.steps + 1):
        if step % args.every == 0:
            lengths = np.asarray(net.scores(probe))   # evaluation mode; restored after
            line = (f"{step:4d}  {lengths.mean():10.3f}  {lengths[np.arange(64), probe_y].mean():16.3f}  "
                    f"{(lengths > 0.5).mean():11.2f}")
        if step == args.steps:
            print(line)
            break
        idx = rng.integers(0, len(y), args.batch_size)
        loss = net.train_step_grads(on_canvas(x[idx]).astype(np.float32), y[idx]).loss
        opt.step()
        if step % args.every == 0:
            print(f"{line}  {float(loss):.3f}", flush=True)


if __name__ == "__main__":
    main()

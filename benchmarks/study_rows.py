"""The cost of each row of the routing study: one training step (forward, backward, Adam) of each
row's network at the study's backbone, in process CPU time, the rows in alternating rounds so that
a busy machine slows them all alike; float32, batch 32 (the study's), one thread unless the
environment says otherwise.  Prints a table (ms of CPU time per step: the median over rounds, and
each row's ratio to uniform coupling's) with the CPU and the commit, and writes it as JSON:

    OMP_NUM_THREADS=1 PYCAPSNET_THREADS=1 python benchmarks/study_rows.py --out benchmarks/results-study-rows.json

Any "x times uniform's step" claim about the study comes from here (docs/performance.md), not from
the units' timings, which ran beside other work.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import time

import numpy as np

from pycapsnet import backends
from pycapsnet.core import architecture
from pycapsnet.experiments import routing_study, study_networks
from pycapsnet.training.optim import Adam


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def step_of(row, backbone, batch, shape=(1, 28, 28), seed=0, backend="numpy", normalize=False):
    """A function that runs one training step of ``row``'s network (behind the study's per-channel
    normalisation where ``normalize``: --normalize), and the network."""
    B = backends.get(backend, dtype="float32")
    description = study_networks.network(row, shape, backbone)
    if normalize:  # as routing_study does, with the training images' statistics (here 0.5 and 0.25)
        description = study_networks.normalized(description, [0.5] * shape[0], [0.25] * shape[0])
    net = architecture.build(description, B, seed=seed)
    opt = Adam(net, lr=1e-3)
    rng = np.random.default_rng(seed)
    x = rng.random((batch, *shape)).astype(np.float32)
    y = rng.integers(0, 10, batch)

    def step():
        net.train_step_grads(x, y)
        opt.step()
    return step, net


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", nargs="+", default=list(routing_study.DEFAULT_ROWS))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=5,
                   help="timed steps a row a round (after one untimed; --warmup before the first)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=4, help="untimed steps of each row before its first round")
    p.add_argument("--quick", action="store_true", help="the --quick backbone (a toy size)")
    p.add_argument("--backbone", default="capsnet", choices=tuple(study_networks.BACKBONES))
    p.add_argument("--data", default="mnist", choices=("mnist", "cifar10"), help="the images' shape: 1x28x28 "
                   "(MNIST, Fashion-MNIST) or 3x32x32 (CIFAR-10)")
    p.add_argument("--backend", default="numpy", choices=("numpy", "torch"))
    p.add_argument("--normalize", action="store_true", help="the per-channel normalisation in front (the study's --normalize)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    backbone = study_networks.BACKBONES[a.backbone][1 if a.quick else 0]
    shape = (1, 28, 28) if a.data == "mnist" else (3, 32, 32)
    steps = {row: step_of(row, backbone, a.batch, shape, backend=a.backend, normalize=a.normalize) for row in a.rows}
    per_round = {row: [] for row in a.rows}
    for k in range(a.rounds):
        for row, (step, _) in steps.items():
            # untimed: caches and workspaces of this row; in the first round until the heap has grown
            # to the step's high water (EM's first steps page in fresh memory, zeroed by the kernel)
            for _ in range(a.warmup if k == 0 else 1):
                step()
            t = time.process_time()
            for _ in range(a.steps):
                step()
            per_round[row].append(1e3 * (time.process_time() - t) / a.steps)
    base = statistics.median(per_round["uniform"]) if "uniform" in per_round else None
    rows = {row: {"cpu_ms_per_step": statistics.median(ms), "rounds": ms, "params": steps[row][1].n_params(),
                  "vs_uniform": statistics.median(ms) / base if base else None} for row, ms in per_round.items()}
    record = {"cpu": cpu_model(), "commit": commit(), "batch": a.batch, "steps": a.steps, "rounds": a.rounds,
              "warmup": a.warmup,
              "threads": os.environ.get("PYCAPSNET_THREADS", "default"), "backbone": backbone, "data": a.data,
              "backend": a.backend, "normalize": a.normalize, "rows": rows,
              "command": "python benchmarks/study_rows.py " + " ".join(
                  f"--{k} {v}" for k, v in (("batch", a.batch), ("steps", a.steps), ("rounds", a.rounds),
                                            ("warmup", a.warmup),
                                            ("backbone", a.backbone), ("data", a.data), ("backend", a.backend)))
              + (" --normalize" if a.normalize else "")}
    print(f"{record['cpu']}, commit {record['commit']}, {a.backend}, {a.backbone} backbone on {a.data}'s shape"
          f"{' behind --normalize' if a.normalize else ''}, "
          f"batch {a.batch}, float32, threads {record['threads']}: "
          "CPU ms per training step (median over rounds)")
    print("| row | parameters | CPU ms/step | × uniform's |\n|---|---|---|---|")
    for row, r in rows.items():
        ratio = f"{r['vs_uniform']:.2f}" if r["vs_uniform"] else ""
        print(f"| {row} | {r['params']:,} | {r['cpu_ms_per_step']:.1f} | {ratio} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()

"""A stratified subset of CIFAR-10's binary version, written in the authors' format, for a machine
that reaches no registry (the GPU machine carries at most 64 MiB with the working tree):

    python benchmarks/cifar_subset.py SRC OUT [--train 8000] [--test 10000] [--seed 0]

SRC holds cifar-10-batches-bin/ (`bash ../shared/data/cifar10/fetch.sh DIR`, or `pycapsnet data
cifar10 DIR`); OUT/cifar-10-batches-bin/ gets --train training records (each class in proportion,
spread over the five data_batch files), --test test records, and batches.meta.txt.  Records are
copied byte for byte; pycapsnet reads OUT as it reads the whole set (--dataset cifar10 --data-dir OUT).
"""
import argparse
import os

import numpy as np

from pycapsnet.training import cifar10


def _stratified(labels, n, rng):
    """Indices of n records, each class in proportion (the remainder to the first classes), sorted."""
    per_class = [np.flatnonzero(labels == c) for c in range(10)]
    quota = [n // 10 + (1 if c < n % 10 else 0) for c in range(10)]
    return np.sort(np.concatenate([rng.permutation(idx)[:q] for idx, q in zip(per_class, quota)]))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src")
    p.add_argument("out")
    p.add_argument("--train", type=int, default=8000)
    p.add_argument("--test", type=int, default=10000)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    src = cifar10.folder_of(a.src)
    rng = np.random.default_rng(a.seed)
    raw = {part: np.concatenate([np.fromfile(os.path.join(src, n), np.uint8).reshape(-1, cifar10.RECORD)
                                 for n in names]) for part, names in (("train", cifar10.TRAIN), ("test", cifar10.TEST))}
    out = os.path.join(a.out, cifar10.FOLDER)
    os.makedirs(out, exist_ok=True)
    train = raw["train"][_stratified(raw["train"][:, 0], min(a.train, len(raw["train"])), rng)]
    for k, part in enumerate(np.array_split(rng.permutation(len(train)), len(cifar10.TRAIN))):
        train[np.sort(part)].tofile(os.path.join(out, cifar10.TRAIN[k]))
    raw["test"][_stratified(raw["test"][:, 0], min(a.test, len(raw["test"])), rng)].tofile(
        os.path.join(out, cifar10.TEST[0]))
    with open(os.path.join(out, cifar10.META), "w") as f:
        f.write("\n".join(cifar10.classes_of(src)) + "\n")
    size = sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out))
    print(f"{out}: {len(train):,} training and {min(a.test, len(raw['test'])):,} test records, {size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()

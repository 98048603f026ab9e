"""The routing study's tuning, on validation only (protocol step 2): every row -- and every row of the
iteration sweep, each k on its own -- gets the same grid, brackets its choice and states how far the
choice leads.

    grid      the learning rates LR_GRID; an option a routing's paper leaves open (OPEN_OPTIONS: VB's
              λ) joins it on equal terms, every rate with every value
    seeds     each trial is trained on every TUNE_SEEDS seed (none a main seed) and scored on
              validation after its last epoch
    rule      the highest mean last-epoch validation accuracy over the tuning seeds; a tie goes to
              the higher worst seed, then to the trial whose name's SHA-256 is lowest: an order
              fixed in advance that neither the listing nor the library's defaults set
    bracket   a choice at the grid's highest (lowest) rate adds the rate twice (half) as high, every
              option value with it, and the rule is applied again, until the choice is interior or
              the rate would leave LR_LIMITS: the result says where the limit was hit ("capped")
    lead      the chosen trial's mean lead over the runner-up, paired over the tuning seeds, with its
              standard error (points of validation accuracy)

Tuning runs in rounds: a round's trials are known only once the round before it is complete.  The
keys of every round of every row are listed round by round (``plan``), so that shards which know the
same finished units list the same keys in the same order.
"""
from __future__ import annotations

import hashlib
import itertools
import math

import numpy as np

LR_GRID = (5e-4, 1e-3, 2e-3, 4e-3)
LR_LIMITS = (1.25e-4, 1.6e-2)  # two steps beyond the grid each way
OPEN_OPTIONS = {"vb": {"vb_lambda": (0.1, 1.0)}}
TUNE_SEEDS = (1000, 1001, 1002)
RULE = ("the highest mean last-epoch validation accuracy over the tuning seeds; ties: the higher worst seed, then "
        "the lowest SHA-256 of the trial's name")


def trial_name(trial: dict) -> str:
    return ",".join(f"{k}={v:g}" for k, v in trial.items())


def parse(name: str) -> dict:
    """A trial's name back into its values: {"lr": ..., option: ...}."""
    return {k: float(v) for k, v in (part.split("=") for part in name.split(","))}


def trials(routing: str, lrs=LR_GRID) -> list:
    """The trials of a row routed by ``routing`` over the rates ``lrs``: [{"lr": .., option: ..}, ...]."""
    lrs = sorted(lrs)
    open_ = OPEN_OPTIONS.get(routing)
    if not open_:
        return [{"lr": lr} for lr in lrs]
    (option, values), = open_.items()
    return [{"lr": lr, option: v} for lr, v in itertools.product(lrs, values)]


def choose(scores: dict) -> tuple:
    """The rule: {trial name: [last-epoch validation accuracy per tuning seed]} -> (name, its mean)."""
    def rank(name):
        accs = scores[name]
        return (-float(np.mean(accs)), -float(np.min(accs)), hashlib.sha256(name.encode()).hexdigest())

    best = min(scores, key=rank)
    return best, float(np.mean(scores[best]))


def lead(scores: dict, chosen: str) -> dict | None:
    """The chosen trial's lead over the runner-up (the next by the rule), in points of validation
    accuracy, paired over the tuning seeds: {"over", "mean", "se"} (se None with one seed)."""
    others = {k: v for k, v in scores.items() if k != chosen}
    if not others:
        return None
    second, _ = choose(others)
    d = 100 * (np.asarray(scores[chosen]) - np.asarray(scores[second]))
    return {"over": second, "mean": float(d.mean()),
            "se": float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else None}


def beyond(chosen_lr: float, lrs) -> tuple:
    """(the rate to add, None) where ``chosen_lr`` is at an edge of ``lrs`` within LR_LIMITS;
    (None, "highest"/"lowest") where that rate would leave them; (None, None) inside the grid."""
    lrs = sorted(lrs)
    if math.isclose(chosen_lr, lrs[-1]):
        nxt = 2 * lrs[-1]
        return (nxt, None) if nxt <= LR_LIMITS[1] * (1 + 1e-9) else (None, "highest")
    if math.isclose(chosen_lr, lrs[0]):
        nxt = lrs[0] / 2
        return (nxt, None) if nxt >= LR_LIMITS[0] * (1 - 1e-9) else (None, "lowest")
    return None, None


def plan(rows, routing_of, known: dict, seeds=TUNE_SEEDS) -> tuple:
    """(every tuning key known to be needed, round by round, {row: its result, or None while a
    round is missing units}) from the units ``known`` ({key: unit with "val"})."""
    lrs = {row: list(LR_GRID) for row in rows}
    results = {row: None for row in rows}
    open_ = list(rows)
    keys = []
    while open_:
        advanced = []
        for row in open_:
            names = [trial_name(t) for t in trials(routing_of(row), lrs[row])]
            row_keys = [f"tune {row} {n} seed {s}" for n in names for s in seeds]
            keys += [k for k in row_keys if k not in keys]
            if not all(k in known for k in row_keys):
                continue  # this row waits for its round
            scores = {n: [known[f"tune {row} {n} seed {s}"]["val"][-1] for s in seeds] for n in names}
            chosen, mean = choose(scores)
            nxt, capped = beyond(parse(chosen)["lr"], lrs[row])
            if nxt is not None:
                lrs[row].append(nxt)
                advanced.append(row)
                continue
            results[row] = {"trials": scores, "chosen": chosen, "val": mean, "lead": lead(scores, chosen),
                            "extended": sorted(lr for lr in lrs[row] if lr not in LR_GRID), "capped": capped}
        open_ = advanced
    return keys, results


def digest(choices: dict) -> str:
    """A digest of a set of choices ({row: trial}): what each main unit records it ran under."""
    return hashlib.sha256(repr(sorted(choices.items())).encode()).hexdigest()[:16]

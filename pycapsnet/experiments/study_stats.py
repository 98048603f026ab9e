"""The routing study's statistics (scipy.stats), each the textbook form, named where it is used:

    wilson(k, n)            the Wilson score 95% interval of an error rate k / n (one network's test
                            error on n digits: binomial noise)
    spread(values)          n, mean, the sample standard deviation (ddof 1) and the t 95% interval of
                            the mean over seeds
    paired(a, b)            the paired difference a - b over seeds: its mean, t 95% interval and the
                            paired t-test's two-sided p (scipy.stats.ttest_rel)
    mcnemar(b, c)           McNemar's exact test on discordant pairs: b digits that row A gets wrong
                            and B right, c the other way; two-sided p = min(1, 2 P(X <= min(b, c))),
                            X ~ Binomial(b + c, 1/2)
    holm(ps)                Holm's step-down adjustment of a family of p-values

Per-digit outcomes are pooled over seeds by summing each seed's discordant counts (the same test
digits, independent trainings): the test then asks whether one row errs where the other does not
more often than the reverse, over every seed's test pass.
"""
from __future__ import annotations

import math

import numpy as np
from scipy import stats

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile


def wilson(k: int, n: int) -> tuple:
    """The Wilson score 95% interval of the proportion k / n, in [0, 1]."""
    if n <= 0:
        return (0.0, 1.0)
    p = k / n
    centre = (p + Z95 ** 2 / (2 * n)) / (1 + Z95 ** 2 / n)
    half = Z95 * math.sqrt(p * (1 - p) / n + Z95 ** 2 / (4 * n * n)) / (1 + Z95 ** 2 / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def _t_interval(values) -> tuple:
    v = np.asarray(values, np.float64)
    if len(v) < 2:
        return (None, None)
    half = stats.t.ppf(0.975, len(v) - 1) * v.std(ddof=1) / math.sqrt(len(v))
    return (float(v.mean() - half), float(v.mean() + half))


def spread(values) -> dict:
    """{"n", "mean", "sd" (sample, ddof 1), "ci95" (t interval of the mean)} over seeds."""
    v = np.asarray(values, np.float64)
    return {"n": int(len(v)), "mean": float(v.mean()), "sd": float(v.std(ddof=1)) if len(v) > 1 else None,
            "ci95": list(_t_interval(v))}


def paired(a, b) -> dict:
    """The paired difference a - b (same seeds): {"n", "mean", "sd", "ci95", "p"} with the paired
    t-test's two-sided p (None with fewer than 2 pairs, or when every difference is the same)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    d = a - b
    out = spread(d)
    p = None
    if len(d) > 1 and np.ptp(d) > 0:
        p = float(stats.ttest_rel(a, b).pvalue)
    elif len(d) > 1:
        p = 1.0 if d[0] == 0 else 0.0  # no spread: every seed differs by the same amount (or none)
    return {**out, "p": p}


def mcnemar(b: int, c: int) -> float:
    """McNemar's exact two-sided p for b and c discordant pairs (1 where there are none)."""
    if b + c == 0:
        return 1.0
    return float(min(1.0, 2 * stats.binom.cdf(min(b, c), b + c, 0.5)))


def discordant(wrong_a, wrong_b) -> tuple:
    """(b, c): digits wrong for A and right for B, and right for A and wrong for B (boolean arrays)."""
    wrong_a, wrong_b = np.asarray(wrong_a, bool), np.asarray(wrong_b, bool)
    return int(np.sum(wrong_a & ~wrong_b)), int(np.sum(~wrong_a & wrong_b))


def holm(ps) -> list:
    """Holm's adjusted p-values, in the order given (None stays None)."""
    given = [(p, k) for k, p in enumerate(ps) if p is not None]
    m = len(given)
    out = [None] * len(ps)
    running = 0.0
    for rank, (p, k) in enumerate(sorted(given)):
        running = max(running, min(1.0, (m - rank) * p))
        out[k] = running
    return out


def pack(wrong) -> str:
    """A boolean vector (a network's wrong test digits) as hex, for the record (10,000 digits: 2,500 chars)."""
    return np.packbits(np.asarray(wrong, bool)).tobytes().hex()


def unpack(text: str, n: int) -> np.ndarray:
    return np.unpackbits(np.frombuffer(bytes.fromhex(text), np.uint8))[:n].astype(bool)

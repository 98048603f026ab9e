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
    bootstrap(wa, wb)       the primary comparison: the paired difference in error (points) of two
                            rows over the same seeds and test images, its 95% percentile interval and
                            two-sided p from a bootstrap that resamples seeds and images together
    tost(a, b, margin)      two one-sided paired t-tests: is the difference within ±margin?
    word(...)               the protocol's four words: better, worse, equivalent, inconclusive
    seeds_for(sd, effect)   the seeds a paired t-test needs to detect ``effect`` with the power asked
    detectable(sd, n)       the smallest effect n seeds detect with that power

McNemar's test is a description per seed (``mcnemar`` on one seed's discordant digits): pooled over
seeds it would treat every (network, image) pair as independent, which the networks of one row are
not.
"""
from __future__ import annotations

import math

import numpy as np
from scipy import optimize, stats

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


BOOTSTRAP = 10_000  # resamples of the primary interval
ALPHA = 0.05


def bootstrap(wrong_a, wrong_b, resamples: int = BOOTSTRAP, seed: int = 0) -> dict:
    """The paired difference a - b in test error (points) of two rows, each (seeds, images) booleans
    (wrong or not) over the same seeds and images: {"mean", "ci95", "p", "resamples", "seed"}.  Each
    resample draws the seeds (pairs kept together) and the images (the same for every seed) with
    replacement, so the interval holds the variation of training and of the test set alike; the
    percentile interval, and p = 2 min(share <= 0, share >= 0) (at least 1/resamples)."""
    full = np.asarray(wrong_a, np.float64) - np.asarray(wrong_b, np.float64)       # (S, N)
    S, N = full.shape
    # only the images on which the rows ever differ move the statistic: their counts are drawn (the
    # rest pooled in one category, so the counts are the full multinomial's)
    d = full[:, np.any(full != 0, axis=0)]                                          # (S, K)
    probs = np.append(np.full(d.shape[1], 1 / N), 1 - d.shape[1] / N)
    rng = np.random.default_rng([seed, 2024])
    stats_, left = [], resamples
    while left:
        k = min(left, 500)
        images = rng.multinomial(N, probs, size=k)[:, :-1].T.astype(np.float64)     # (K, k) counts
        seeds = rng.multinomial(S, np.full(S, 1 / S), size=k).astype(np.float64)      # (k, S) counts
        stats_.append(np.einsum("ks,sk->k", seeds, d @ images) * 100 / (S * N))
        left -= k
    t = np.concatenate(stats_)
    lo, hi = np.percentile(t, [2.5, 97.5])
    p = min(1.0, max(2 * min(np.mean(t <= 0), np.mean(t >= 0)), 1 / resamples))
    return {"mean": float(100 * full.mean()), "ci95": [float(lo), float(hi)], "p": float(p),
            "resamples": resamples, "seed": seed}


def tost(a, b, margin: float) -> dict:
    """Two one-sided paired t-tests of the difference a - b over seeds against ±margin (scipy's
    ttest_rel with one-sided alternatives): {"margin", "p"} with p the larger of the two (the
    difference lies within ±margin where p < alpha), and the 90% t interval it implies."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if len(a) < 2 or np.ptp(a - b) == 0:
        inside = bool(np.all(np.abs(a - b) < margin))
        return {"margin": margin, "p": 0.0 if inside and len(a) > 1 else 1.0, "ci90": [None, None]}
    low = stats.ttest_rel(a, b - margin, alternative="greater").pvalue   # H0: a - b <= -margin
    high = stats.ttest_rel(a, b + margin, alternative="less").pvalue     # H0: a - b >= +margin
    d = a - b
    half = stats.t.ppf(0.95, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d))
    return {"margin": margin, "p": float(max(low, high)), "ci90": [float(d.mean() - half), float(d.mean() + half)]}


def word(diff: float, p_primary, p_tost, margin) -> str:
    """The protocol's word for a row against the baseline: "better" or "worse" where the primary test
    (Holm-adjusted) rejects no difference, "equivalent" where the TOST (Holm-adjusted) at the margin
    declared before the run passes, else "inconclusive" (no margin declared: never "equivalent")."""
    if p_primary is not None and p_primary < ALPHA:
        return "better" if diff < 0 else "worse"
    if margin is not None and p_tost is not None and p_tost < ALPHA:
        return "equivalent"
    return "inconclusive"


def _power(n: int, sd: float, effect: float) -> float:
    """The power of a two-sided paired t-test on n pairs at ALPHA to detect a mean difference
    ``effect`` when the differences' sd is ``sd`` (the noncentral t)."""
    df, nc = n - 1, effect / (sd / math.sqrt(n))
    crit = stats.t.ppf(1 - ALPHA / 2, df)
    power = stats.nct.sf(crit, df, nc) + stats.nct.cdf(-crit, df, nc)
    return 1.0 if not np.isfinite(power) else float(power)  # (scipy's nct gives nan far in its tail)


def seeds_for(sd: float, effect: float, power: float = 0.8, most: int = 10_000) -> int | None:
    """The fewest seeds (pairs) whose paired t-test detects ``effect`` with ``power`` (None beyond ``most``)."""
    n = 2
    while n <= most:
        if _power(n, sd, effect) >= power:
            return n
        n += 1
    return None


def detectable(sd: float, n: int, power: float = 0.8) -> float:
    """The smallest mean difference n seeds' paired t-test detects with ``power``."""
    high = sd
    while _power(n, sd, high) < power:
        high *= 2
    return float(optimize.brentq(lambda e: _power(n, sd, e) - power, 1e-9 * sd, high))


def mcnemar_per_seed(wrong_a, wrong_b) -> list:
    """[{"b", "c", "p"} per seed]: each seed's discordant digits and McNemar's exact p, a description."""
    out = []
    for wa, wb in zip(wrong_a, wrong_b):
        b, c = discordant(wa, wb)
        out.append({"b": b, "c": c, "p": mcnemar(b, c)})
    return out

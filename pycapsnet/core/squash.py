"""The squash non-linearity (Sabour et al. 2017, eq. 1) and its gradient.

    v = |s|^2 / (1 + |s|^2) * s / |s|  =  f(n) s,   n = |s|,   f(n) = n / (1 + n^2)

Written as f(n) s it is finite at s = 0 (v = 0), with no epsilon added to |s|.
Its Jacobian is  dv/ds = f(n) I + (f'(n) / n) s s^T,  f'(n) = (1 - n^2) / (1 + n^2)^2, so

    ds = f(n) dv + g(n) (s . dv) s,     g(n) = f'(n) / n = (1 - n^2) / (n (1 + n^2)^2).

g(n) blows up as n -> 0 but (s . dv) s shrinks like n^2, and the exact limit of the second term
is 0; at n = 0 exactly we use that limit, so the gradient is finite (and equal to 0 there:
v = O(|s|^2) near the origin).
"""
from __future__ import annotations

from .fusable import fusable


@fusable
def squash(xp, s, axis=-1):
    """v = squash(s) over ``axis``.  Returns (v, n) with n = |s| (kept dims) for the backward."""
    n = xp.sqrt(xp.sum(s * s, axis=axis, keepdims=True))
    return s * (n / (1 + n * n)), n


@fusable
def squash_backward(xp, s, n, dv, axis=-1):
    """dL/ds from dL/dv, given s and n = |s| from the forward."""
    n2 = n * n
    f = n / (1 + n2)
    safe_n = xp.where(n > 0, n, 1)
    g = xp.where(n > 0, (1 - n2) / (safe_n * (1 + n2) ** 2), 0)
    return f * dv + g * xp.sum(s * dv, axis=axis, keepdims=True) * s


# ---- Efficient-CapsNet's squash (Mazzia et al. 2021), for self-attention routing -------------------
#     v = (1 - e^-n) s / n  =  h(n) s,   h(n) = -expm1(-n) / n  (h(0) = 1: v ~ s near the origin)
# Its length 1 - e^-|s| rises faster than n^2 / (1 + n^2) near 0 and never quite reaches 1.
# Jacobian as above: ds = h(n) dv + k(n) (s . dv) s with k(n) = h'(n) / n = (n e^-n + expm1(-n)) / n^3.
# The closed form of k cancels below n ~ 1e-2 (its numerator is -n^2/2 + ..., from terms of size n),
# so there its series is used:  k(n) = -1/(2n) + 1/3 - n/8 + n^2/30 - n^3/144 + n^4/840 - ...
# (the coefficient of n^(m-2) is m (-1)^m / (m+1)!).  Cut after n^4, it is off by n^5/5760, which
# enters ds times n^2: below 1e-17 of ds at n = 1e-2.  (Two terms would be off by n^3/8 of ds,
# 1e-7 there: finite differences see that.)  (s . dv) s shrinks like n^2, so the term vanishes at s = 0.

def _exp_factor(xp, n):
    """h(n) = (1 - e^-n) / n, and its limit 1 at n = 0."""
    return xp.where(n > 0, -xp.expm1(-n) / xp.where(n > 0, n, 1), 1)


def squash_exp(xp, s, axis=-1):
    """v = (1 - e^-|s|) s / |s| over ``axis``.  Returns (v, n) with n = |s| (kept dims)."""
    n = xp.sqrt(xp.sum(s * s, axis=axis, keepdims=True))
    return s * _exp_factor(xp, n), n


def squash_exp_backward(xp, s, n, dv, axis=-1):
    """dL/ds from dL/dv for ``squash_exp``, given s and n = |s|."""
    small = n < 1e-2
    safe_n = xp.where(n > 0, n, 1)
    h = _exp_factor(xp, n)
    big_n = xp.where(small, 1, n)
    series = -0.5 / safe_n + 1 / 3 + n * (-1 / 8 + n * (1 / 30 + n * (-1 / 144 + n / 840)))
    k = xp.where(small, xp.where(n > 0, series, 0),
                 (big_n * xp.exp(-big_n) + xp.expm1(-big_n)) / big_n ** 3)
    return h * dv + k * xp.sum(s * dv, axis=axis, keepdims=True) * s

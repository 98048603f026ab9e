"""Margin loss (Sabour et al. 2017, eq. 4), spread loss (Hinton et al. 2018), reconstruction loss, and
softmax cross-entropy for the baseline CNN.
Each is a mean over the batch;
``backward()`` returns the gradient of that mean."""
from __future__ import annotations

import numpy as np

from .checks import check_setting


class MarginLoss:
    """L = mean_n sum_k  T_k max(0, m+ - |v_k|)^2 + lam (1 - T_k) max(0, |v_k| - m-)^2

    with T the one-hot label, m+ = 0.9, m- = 0.1, lam = 0.5.  Gradient per length:
    dL/d|v_k| = (-2 T_k max(0, m+ - |v_k|) + 2 lam (1 - T_k) max(0, |v_k| - m-)) / N.
    """

    name = "margin"

    def __init__(self, backend, m_plus=0.9, m_minus=0.1, lam=0.5):
        self.B = backend
        self.m_plus, self.m_minus = check_setting("m_plus", m_plus, 0, 1), check_setting("m_minus", m_minus, 0, 1)
        self.lam = check_setting("lam", lam)
        self.cache = None

    def set_epoch(self, epoch: int):
        """The margin loss has no schedule."""

    def forward(self, lengths, onehot):
        xp = self.B.xp
        present = xp.clip(self.m_plus - lengths, min=0.0)   # max(m+ - |v_j|, 0)  (N, J)
        absent = xp.clip(lengths - self.m_minus, min=0.0)   # max(|v_j| - m-, 0)
        self.cache = (present, absent, onehot, lengths.shape[0])
        per_sample = xp.sum(onehot * present ** 2 + self.lam * (1 - onehot) * absent ** 2, axis=1)
        return xp.mean(per_sample)

    def backward(self):
        present, absent, onehot, n = self.cache
        self.cache = None
        return (-2 * onehot * present + 2 * self.lam * (1 - onehot) * absent) / n


class ReconstructionLoss:
    """L = weight * mean_n sum_pixels (x_hat - x)^2: the sum of squared errors per image, as in the
    paper, scaled by weight = 0.0005 so that it does not dominate the margin loss.
    Gradient: dL/dx_hat = weight * 2 (x_hat - x) / N."""

    def __init__(self, backend, weight=0.0005):
        self.B, self.weight = backend, check_setting("the reconstruction loss weight (recon_weight)", weight)
        self.cache = None

    def forward(self, recon, target):
        xp = self.B.xp
        diff = recon - target
        self.cache = diff
        n = diff.shape[0]
        return self.weight * xp.sum(diff * diff) / n

    def backward(self):
        diff, self.cache = self.cache, None
        return (2 * self.weight / diff.shape[0]) * diff


class SpreadLoss:
    """Spread loss (Hinton et al. 2018), the EM network's class loss, on the class activations a (N, J):

        L = mean_n sum_{j != t} max(0, m - (a_t - a_j))^2,        t the label

    which pushes the target's activation a margin m above every other.  Gradient per sample, with
    e_j = max(0, m - (a_t - a_j)) for j != t:  dL/da_j = 2 e_j / N,  dL/da_t = -2 sum_{j != t} e_j / N.

    The margin grows during training (``margin_at``); it lives in a device array so that a captured
    step (graph.py) reads the current value rather than the one it was recorded with."""

    name = "spread"

    def __init__(self, backend, m_start=0.2, m_end=0.9, m_step=0.1):
        self.B, self.m_start, self.m_end, self.m_step = backend, m_start, m_end, m_step
        self.margin = backend.asarray(np.full((), m_start))
        self.cache = None

    def margin_at(self, epoch: int) -> float:
        """m = 0.2 + 0.1 x (epochs done), up to 0.9: a small margin first, while the activations
        separate, then the paper's final 0.9.  (The paper says only that m grows from 0.2 to 0.9.)"""
        return min(self.m_end, self.m_start + self.m_step * epoch)

    def set_epoch(self, epoch: int):
        self.margin[...] = self.margin_at(epoch)

    def forward(self, a, onehot):
        xp = self.B.xp
        a_t = xp.sum(a * onehot, axis=1, keepdims=True)                 # (N, 1)
        e = xp.clip(self.margin - (a_t - a), min=0.0) * (1 - onehot)   # e_j, 0 at j = t
        self.cache = (e, onehot, a.shape[0])
        return xp.mean(xp.sum(e * e, axis=1))

    def backward(self):
        e, onehot, n = self.cache
        self.cache = None
        return (2 * e - 2 * onehot * self.B.xp.sum(e, axis=1, keepdims=True)) / n


class SoftmaxCrossEntropy:
    """The baseline CNN's loss on class logits z (N, J), with p = softmax(z):

        L = mean_n ( log sum_j e^{z_nj} - z_nt ) = mean_n -log p_nt,        t the label

    computed from z - max_j z (the same L, no overflow).  Gradient:  dL/dz = (p - T) / N, T one-hot.
    ``onehot`` may hold several 1s per row (a sample of two digits): L then sums -log p over them."""

    name = "cross_entropy"

    def __init__(self, backend):
        self.B, self.cache = backend, None

    def set_epoch(self, epoch: int):
        """Cross-entropy has no schedule."""

    def forward(self, z, onehot):
        xp = self.B.xp
        shifted = z - xp.max(z, axis=1, keepdims=True)
        log_norm = xp.log(xp.sum(xp.exp(shifted), axis=1, keepdims=True))   # log sum_j e^{z_j - max}
        log_p = shifted - log_norm                                          # (N, J)
        self.cache = (xp.exp(log_p), onehot, z.shape[0])
        return -xp.sum(onehot * log_p) / z.shape[0]

    def backward(self):
        p, onehot, n = self.cache
        self.cache = None
        return (p * self.B.xp.sum(onehot, axis=1, keepdims=True) - onehot) / n


class NegativeLogLikelihood:
    """Self-routing's class loss (Hahn et al. 2019) on class scores that form a distribution over the
    classes (its parents' activations a_j, which sum to 1):

        L = mean_n -log a_nt,        t the label;        dL/da_nt = -1 / (N a_nt), 0 elsewhere

    A score of 0 for the target gives an infinite loss, which the trainer stops on."""

    name = "nll"

    def __init__(self, backend):
        self.B, self.cache = backend, None

    def set_epoch(self, epoch: int):
        """The negative log-likelihood has no schedule."""

    def forward(self, a, onehot):
        xp = self.B.xp
        a_t = xp.sum(a * onehot, axis=1)
        self.cache = (a_t, onehot, a.shape[0])
        return -xp.sum(xp.log(a_t)) / a.shape[0]

    def backward(self):
        a_t, onehot, n = self.cache
        self.cache = None
        return -onehot / (n * a_t[:, None])

"""Margin loss (Sabour et al. 2017, eq. 4) and reconstruction loss.  Both are means over the batch;
``backward()`` returns the gradient of that mean."""
from __future__ import annotations


class MarginLoss:
    """L = mean_n sum_k  T_k max(0, m+ - |v_k|)^2 + lam (1 - T_k) max(0, |v_k| - m-)^2

    with T the one-hot label, m+ = 0.9, m- = 0.1, lam = 0.5.  Gradient per length:
    dL/d|v_k| = (-2 T_k max(0, m+ - |v_k|) + 2 lam (1 - T_k) max(0, |v_k| - m-)) / N.
    """

    def __init__(self, backend, m_plus=0.9, m_minus=0.1, lam=0.5):
        self.B, self.m_plus, self.m_minus, self.lam = backend, m_plus, m_minus, lam
        self.cache = None

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
        self.B, self.weight = backend, weight
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

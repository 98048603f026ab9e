"""What a network's class scores are (its head: capsule lengths, EM's activations or a CNN's logits),
the masked decoder of Sabour et al., and ``Outputs``, what a forward and a loss return."""
from __future__ import annotations

import numpy as np

from .capsules import CapsuleLength
from .layers import Layer
from .sequential import Sequential


# ---- heads: what the class scores are -------------------------------------------------------------
class LengthHead(Layer):
    """Vector capsules v (N, J, D) -> (v, |v_j| (N, J)): a capsule's length is its class's score."""

    def __init__(self, backend):
        super().__init__(backend)

        self.length = CapsuleLength(backend)

    def forward(self, v):
        return v, self.length.forward(v)

    def backward(self, dv, dscores):
        return dv + self.length.backward(dscores)


class ActivationHead(Layer):
    """Matrix capsules (μ (N, J, 16), a (N, J)) -> themselves: the activation a_j is the score."""

    def forward(self, z):
        return z

    def backward(self, dv, dscores):
        return dv, dscores


class LogitsHead(Layer):
    """A CNN's class logits z (N, J) -> (z, z): no capsules, the logits are the scores."""

    def forward(self, z):
        return z, z

    def backward(self, dv, dscores):
        return dv + dscores


class MaskedDecoder(Sequential):
    """The reconstruction network of Sabour et al.: class capsules v (N, J, D), all but one per
    sample masked to 0, flattened (N, J*D), through its layers (Linear, ReLU, ..., Sigmoid) to pixels."""

    def decode(self, v, mask, image_shape):
        """mask (N, J): one-hot rows -> reconstruction (N, *image_shape)."""
        xp = self.B.xp
        z = xp.reshape(v * mask[..., None], (v.shape[0], -1))           # masked capsules (N, J*D)
        return xp.reshape(self.forward(z), (v.shape[0], *image_shape))

    def decode_backward(self, d_recon, v_shape, mask):
        """dL/d reconstruction -> dL/dv through the mask (the mask is a constant)."""
        xp = self.B.xp
        dz = self.backward(xp.reshape(d_recon, (v_shape[0], -1)))
        return xp.reshape(dz, tuple(v_shape)) * mask[..., None]


class Outputs:
    """What ``forward`` and ``loss`` return: class capsules v_j (N, J, D), their scores (N, J) (the
    lengths |v_j|, or EM's activations) and the reconstruction (N, C, H, W) or None, on the device.
    After ``loss``, the loss values and the predicted classes stay on the device too until read:
    ``loss`` (the total), ``parts`` (class loss, reconstruction) and ``predictions`` fetch all of
    them with one transfer, so a GPU step is not held up mid-way, nor read twice."""

    @property
    def scores(self):
        """The class scores (N, J): ``lengths`` under the name ``predict_scores`` and ``Network.scores`` use."""
        return self.lengths

    def __init__(self, B, v, lengths, reconstruction=None, loss_name="margin"):
        self.v, self.lengths, self.reconstruction = v, lengths, reconstruction
        self.loss_name = loss_name  # the class loss's: "margin", or "spread" (EM)
        self.summary = None  # device array (3 + N,): total, class loss, reconstruction, predicted classes
        self._B, self._host = B, None

    def set_losses(self, total, margin, recon):
        xp = self._B.xp
        self._host = None
        predicted = xp.astype(xp.argmax(self.lengths, axis=1), total.dtype)  # class indices, exact in floats
        self.summary = xp.concat([xp.stack([total, margin, recon]), predicted])

    def renewed(self) -> "Outputs":
        """The same arrays with the host copy of the summary dropped: for arrays that were
        overwritten in place (a replayed captured step), so that ``loss`` reads them again."""
        out = Outputs(self._B, self.v, self.lengths, self.reconstruction, self.loss_name)
        out.summary = self.summary
        return out

    def _fetch(self):
        if self._host is None:
            self._host = None if self.summary is None else self._B.to_numpy(self.summary).astype(np.float64)
        return self._host

    @property
    def loss(self):
        host = self._fetch()
        return None if host is None else float(host[0])

    @property
    def parts(self) -> dict:
        host = self._fetch()
        return {} if host is None else {self.loss_name: float(host[1]), "reconstruction": float(host[2])}

    @property
    def predictions(self):
        """The highest-scoring class of each sample: host int64 (N,)."""
        host = self._fetch()
        if host is None:  # a forward without losses
            return np.argmax(self._B.to_numpy(self.lengths), axis=1)
        return host[3:].astype(np.int64)

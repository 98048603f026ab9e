"""Networks as compositions of layers: ``Sequential`` (sequential.py) chains layers; a ``Network`` is a body (a
Sequential from images to class capsules), a head (class scores), a class loss and, optionally, the
masked decoder with its reconstruction loss.  The three built-in networks (model.py) and any network
a user describes (architecture.py) are Networks; the trainer, the checks and the tools take any.

    x (N, C, H, W) --channels last--> body --> z --head--> v (N, J, D), scores (N, J)
    loss = class_loss(scores, y)  [+ decoder's reconstruction loss: |decode(v masked by y) - x|^2]

Between layers flows an array, or a tuple of arrays where a layer's data is a pair (matrix
capsules' poses and activations); a Sequential passes either along without looking inside.
"""
from __future__ import annotations

import contextlib

import numpy as np

from .checks import check_capsules, check_images, check_labels, require_batch_size
from .heads import ActivationHead, LengthHead, LogitsHead, MaskedDecoder, Outputs  # noqa: F401  (this module's names too)
from .sequential import Sequential  # noqa: F401  (likewise)
from ..errors import CapsNetError


class Network:
    """A trainable composition: ``body`` (a Sequential from channels-last images to class capsules),
    ``head`` (LengthHead or ActivationHead: the class scores), ``class_loss`` (margin or spread) and
    an optional ``decoder`` (MaskedDecoder) whose ``recon_loss`` is added to the class loss.
    ``architecture`` is the description it was built from (architecture.py), which checkpoints
    record so that a run rebuilds it without the user's code.  Built by ``architecture.build``."""

    def __init__(self, backend, body, head, class_loss, decoder=None, recon_loss=None, *, input_shape,
                 n_classes, class_dim, architecture=None):
        self.B, self.body, self.head, self.class_loss = backend, body, head, class_loss
        self.decoder, self.recon_loss = decoder, recon_loss
        self.input_shape, self.n_classes, self.class_dim = tuple(input_shape), n_classes, class_dim
        self.architecture = architecture
        self.training = True
        self._eye = backend.asarray(np.eye(n_classes))  # row j: the one-hot mask of class j
        self.cache = None
        named = list(self.layers())
        clash = sorted({n for n, _ in named if sum(m == n for m, _ in named) > 1})
        if clash:
            raise CapsNetError(f"layer names must be unique across the body and the decoder: {', '.join(clash)}")
        # Every gradient is a view into one flat array: one buffer to zero, and one to sum across
        # the processes of a data-parallel run (pycapsnet.training.distributed) without copying.
        self.flat_grads = backend.zeros((self.n_params(),))
        offset = 0
        for _, layer in named:
            for k, g in layer.grads.items():
                size = int(np.prod(g.shape))
                layer.grads[k] = backend.xp.reshape(self.flat_grads[offset:offset + size], tuple(g.shape))
                offset += size

    def __repr__(self):
        parts = [f"  {name}: " + repr(layer).replace("\n", "\n  ") for name, layer in self.body]
        parts += [f"  head: {type(self.head).__name__}, loss: {type(self.class_loss).__name__}"
                  + (f", decoder: {' -> '.join(str(l.params['W'].shape[1]) for _, l in self.decoder.named_layers())}"
                     if self.decoder is not None else "")]
        return (f"Network({'x'.join(map(str, self.input_shape))} -> {self.n_classes} classes, "
                f"{self.n_params():,} parameters on {self.B.label}\n" + "\n".join(parts) + "\n)")

    # ---- structure ------------------------------------------------------------------------------
    def layers(self):
        """(name, layer) for every layer with parameters, in forward order (body, then decoder)."""
        yield from self.body.named_layers()
        if self.decoder is not None:
            yield from self.decoder.named_layers()

    def routing_layers(self):
        """(name, layer) for every layer of the body that routes (keeps a ``trace``), in order."""
        return [(n, l) for n, l in self.body.named_layers() if hasattr(l, "trace")]

    @property
    def params(self) -> dict:
        return {f"{n}.{k}": p for n, l in self.layers() for k, p in l.params.items()}

    @property
    def grads(self) -> dict:
        return {f"{n}.{k}": g for n, l in self.layers() for k, g in l.grads.items()}

    @property
    def buffers(self) -> dict:
        """State that gradients do not learn (batch norm's running statistics), named as parameters are."""
        return {f"{n}.{k}": b for n, l in self.layers() for k, b in l.buffers.items()}

    def parts(self):
        """Every layer of the network, parameters or not (the body's, the head, the decoder's)."""
        for part in (self.body, self.head, self.decoder):
            if part is not None:
                yield from part.walk()

    def train(self, mode: bool = True):
        """Training (True, the default) or evaluation mode: Dropout drops only in training, and
        BatchNorm normalises by the batch's statistics in training, by its running ones in evaluation."""
        self.training = mode
        for layer in self.parts():
            layer.training = mode

    @contextlib.contextmanager
    def evaluating(self):
        """Evaluation mode for a block (Dropout drops nothing, batch norm reads its running
        statistics and leaves them be), the mode before it restored after.  What the block draws
        (random routing's coefficients) is drawn from where training's generators stand and leaves
        them there: scoring, pictures and predictions never change what training draws next, so a
        run resumed from a checkpoint draws what the uninterrupted run drew."""
        mode, kept = self.training, self.generator_state()
        self.train(False)
        try:
            yield self
        finally:
            self.train(mode)
            self.set_generator_state(kept)

    # ---- generators: what a layer draws from while training (Dropout, random routing) ------------
    def generators(self) -> dict:
        """{dotted layer name: its NumPy generator} of every layer that draws as it runs."""
        return {name: layer.rng for name, layer in self.body.leaves()
                if isinstance(getattr(layer, "rng", None), np.random.Generator)}

    def generator_state(self) -> dict:
        """Each generator's state (``bit_generator.state``: plain Python, JSON-able), by layer name;
        what a checkpoint keeps so that resuming draws on where the run stopped."""
        return {name: g.bit_generator.state for name, g in self.generators().items()}

    def set_generator_state(self, states: dict) -> None:
        """Put back ``generator_state``'s states; CapsNetError naming a layer that has no generator,
        one missing, or a state its generator cannot take."""
        own = self.generators()
        if not isinstance(states, dict) or set(states) != set(own):
            names = sorted(states) if isinstance(states, dict) else states
            raise CapsNetError(f"generator states for layers {names} do not match this network's "
                               f"({sorted(own)})")
        for name, state in states.items():
            try:
                own[name].bit_generator.state = state
            except (TypeError, ValueError, KeyError) as e:
                raise CapsNetError(f"the generator state of layer {name} is not one its generator takes ({e})") \
                    from None

    @property
    def capturable(self) -> bool:
        """Whether a step can be recorded once and replayed (graph.py): not through a Dropout."""
        return all(getattr(layer, "capturable", True) for layer in self.parts())

    def n_params(self) -> int:
        return int(sum(np.prod(p.shape) for p in self.params.values()))

    def zero_grad(self):
        self.flat_grads[...] = 0

    def state_dict(self) -> dict:
        """Parameters and buffers as host NumPy arrays (backend-neutral)."""
        return {k: self.B.to_numpy(v) for k, v in {**self.params, **self.buffers}.items()}

    def load_state_dict(self, state: dict):
        """Copy host arrays into the parameters and buffers; raises CapsNetError listing every mismatch."""
        own = {**self.params, **self.buffers}
        problems = [f"missing {k} (model has {tuple(p.shape)})" for k, p in own.items() if k not in state]
        problems += [f"unexpected {k} {tuple(np.shape(v))}" for k, v in state.items() if k not in own]
        problems += [f"{k}: checkpoint {tuple(np.shape(state[k]))} vs model {tuple(p.shape)}"
                     for k, p in own.items() if k in state and tuple(np.shape(state[k])) != tuple(p.shape)]
        if problems:  # one line, as every error a command prints
            raise CapsNetError("checkpoint does not match this architecture: " + "; ".join(problems)
                               + "; build the model with the checkpoint's configuration")
        for k, p in own.items():
            p[...] = self.B.asarray(state[k])

    def checked(self, x, y=None):
        """x and y checked (checks.py) and on the device, as the *_on_device methods take them."""
        x = check_images(self.B, self.input_shape, x)
        return x, None if y is None else self.B.asarray(check_labels(self.B, self.n_classes, y, x.shape[0]))

    # ---- forward / backward -----------------------------------------------------------------------
    # forward, loss and train_step_grads check their input on the host and hand the backend's arrays
    # to the *_on_device methods, which do device work only: that part is what a captured step
    # (pycapsnet.training.graph) records, and what the torch wrapper calls with its tensors.
    def forward(self, x, y=None, reconstruct=True) -> Outputs:
        """x: (N, C, H, W) floats in [0, 1].  With labels y the decoder sees the true class capsule
        (training); without, the highest-scoring one (evaluation).  Keeps what ``backward`` needs."""
        return self.forward_on_device(*self.checked(x, y), reconstruct)

    def forward_on_device(self, x, y, reconstruct=True) -> Outputs:
        """``forward`` of arrays already checked and on the backend (``checked``)."""
        xp = self.B.xp
        v, scores = self.head.forward(self.body.forward(self.channels_last(x)))
        out = Outputs(self.B, v, scores, loss_name=self.class_loss.name)
        self.cache = {"x": x, "v": v, "mask": None}
        if reconstruct:
            chosen = y if y is not None else xp.argmax(scores, axis=1)
            self.cache["mask"] = self.one_hot(chosen)                  # (N, J), one-hot rows
            if self.decoder is not None:
                out.reconstruction = self.decoder.decode(v, self.cache["mask"], self.input_shape)
        return out

    def decode(self, v, classes):
        """Reconstruction from class capsules v (N, J, D), keeping only capsule ``classes[n]`` of
        each sample (the others masked to 0), as the decoder sees them."""
        if self.decoder is None:
            raise CapsNetError("this network has no decoder: it does not reconstruct its input")
        classes = check_capsules(v, classes, self.n_classes, self.class_dim)
        mask = self.one_hot(self.B.asarray(classes))
        return self.decoder.decode(self.B.asarray(v), mask, self.input_shape)

    def channels_last(self, x):
        """Images (N, C, H, W) as the body takes them, (N, H, W, C), in that order in memory: a
        convolution's windows over a permuted view would gather C-strided single values (for
        colour images, conv1's im2col 4x slower)."""
        return self.B.contiguous(self.B.xp.permute_dims(x, (0, 2, 3, 1)))

    def one_hot(self, classes):
        """(N, J) one-hot rows of class indices ``classes`` (N,), a backend array: the decoder's masks."""
        return self.B.xp.take(self._eye, classes, axis=0)

    def set_epoch(self, epoch: int):
        """Tell the loss which epoch is starting (the spread loss's margin grows with it)."""
        self.class_loss.set_epoch(epoch)

    def loss(self, x, y) -> Outputs:
        """Forward with the label mask plus the losses; ``backward()`` then fills the gradients."""
        return self.loss_on_device(*self.checked(x, y))

    def loss_on_device(self, x, y) -> Outputs:
        """``loss`` of arrays already checked and on the backend (``checked``)."""
        out = self.forward_on_device(x, y)
        onehot = self.cache["mask"]  # with labels, the decoder's mask is the one-hot target
        class_loss = self.class_loss.forward(out.lengths, onehot)
        recon = (self.recon_loss.forward(out.reconstruction, x) if self.decoder is not None
                 else self.B.zeros(tuple(class_loss.shape)))
        out.set_losses(class_loss + recon, class_loss, recon)
        return out

    def backward(self, input_grad: bool = False):
        """Gradients of the last ``loss()`` added into ``grads``; returns dL/dx (N, C, H, W) when
        ``input_grad`` (only gradient checks need it), else None."""
        d_recon = self.recon_loss.backward() if self.decoder is not None else None  # dL/dx_hat (N, C, H, W)
        dx = self.outputs_backward(None, self.class_loss.backward(), d_recon, input_grad)
        # x is also the reconstruction target: L depends on it through -(x_hat - x) as well
        return dx if dx is None or d_recon is None else dx - d_recon

    def outputs_backward(self, dv, dscores, dreconstruction=None, input_grad: bool = True):
        """Backward of the last forward from the gradients of its outputs: dv (N, J, D) (None: no
        gradient reaches v but through the scores and the reconstruction), dscores (N, J) and, with
        a decoder, the reconstruction's (N, C, H, W).  Adds into ``grads``; returns dL/dx (N, C, H,
        W) through the network (not through x as a reconstruction target) when ``input_grad``."""
        xp = self.B.xp
        v, mask = self.cache["v"], self.cache["mask"]
        if dreconstruction is not None:
            back = self.decoder.decode_backward(dreconstruction, v.shape, mask)
            dv = back if dv is None else dv + back
        elif dv is None:
            dv = self.B.zeros(tuple(v.shape))
        dx = self.body.backward(self.head.backward(dv, dscores), input_grad)
        self.cache = None
        return None if dx is None else xp.permute_dims(dx, (0, 3, 1, 2))

    def train_step_grads(self, x, y) -> Outputs:
        """zero_grad + loss + backward: the gradient of one batch, ready for an optimizer."""
        return self.train_step_grads_on_device(*self.checked(x, y))

    def train_step_grads_on_device(self, x, y) -> Outputs:
        """``train_step_grads`` of arrays already checked and on the backend (``checked``)."""
        self.zero_grad()
        out = self.loss_on_device(x, y)
        self.backward()
        return out

    def scores(self, x, batch_size: int = 256) -> np.ndarray:
        """Class scores (host (N, J)), ``batch_size`` images at a time: a forward holds some MB per
        28x28 image (û alone is I x J x D floats), so a whole test set at once would hold gigabytes."""
        require_batch_size(batch_size)
        x = check_images(self.B, self.input_shape, x)
        with self.evaluating():
            return np.concatenate([self._scores_of(x[a:a + batch_size]) for a in range(0, x.shape[0], batch_size)])

    def _scores_of(self, x) -> np.ndarray:
        """One batch's scores; a batch too large for the device's memory is scored in halves (each
        image's scores are its own, whatever the batch)."""
        try:
            return self.B.to_numpy(self.forward_on_device(x, None, reconstruct=False).lengths)
        except Exception as e:
            if x.shape[0] < 2 or not self.B.out_of_memory(e):
                raise
        finally:
            self.release()
        h = x.shape[0] // 2
        return np.concatenate([self._scores_of(x[:h]), self._scores_of(x[h:])])

    def predict(self, x, batch_size: int = 256):
        """Class indices (host int64 array) by the highest class score (``scores``)."""
        return np.argmax(self.scores(x, batch_size), axis=1).astype(np.int64)

    def release(self):
        """Drop what forward kept for a backward (the PrimaryCaps spectra and û alone are hundreds
        of MB at batch 64), e.g. after an evaluation, so that it is not held into the next step."""
        for part in (self.body, self.head, self.decoder):
            if part is not None:
                part.release()
        self.cache = None

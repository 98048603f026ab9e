"""Does routing help?  Every routing as the class layer of one shared backbone, under one protocol
fixed before anything trains (study_protocol.py): the same data, recipe, tuning budget and epochs,
choices on validation only, the test set read once, statistics that name their tests
(study_stats.py), the literature's diagnostics (study_diagnostics.py).

    backbone   capsnet (the default): conv1 9x9/1, C channels, ReLU -> primary capsules 9x9/2, T types
               of K dims; resnet20 (--backbone resnet20, Hahn et al.'s for SR-CapsNet): conv 3x3 of 16,
               batch norm, ReLU, three stages of three basic blocks (16, 32, 64 channels; the 2nd and 3rd
               stride 2 with a 1x1 projection) -> primary capsules 3x3/1 on the 8x8 map, 32 types of
               16 dims; then (EM: 1x1 matrix capsules on the same map) -> 10 class capsules of D dims, routed by
               the row's routing with its paper's head (Routing.head: inverted's logits, self's NLL),
               the transforms W_ij of every row at init.routed_std (the same rule for all; the
               dynamic-routing paper's network starts them at 0.01), no decoder
    rows       a registered routing by name (its default iterations), NAME-k (k iterations), "em"
               (matrix capsules; "em-k"), "cnn" (the baseline CNN's shape, its widths scaled to the
               parameters of the "dynamic" row's network)

Units (units.json, one network trained from one seed; a stopped run goes on where it stopped, a
unit is the unit of work of ``--shard K/N`` too):
    tune ROW TRIAL seed S   a tuning trial: the last epoch's validation accuracy
    main ROW seed S         the row at its chosen trial: validation per epoch, then the one test pass
                            (errors per digit, diagnostics); the iteration sweep's rows are main rows
                            (NAME-k) at their routing's chosen trial
    tune affine:ROW TRIAL seed S, affine ROW seed S
                            the affine part (study_affine.py): its own tuning on translated
                            validation digits, then trained on digits placed at random on a canvas,
                            read on the translated and affine test digits at the last epoch and at
                            the protocol's target
    tune multimnist:ROW TRIAL seed S, multimnist ROW seed S
                            the MultiMNIST part (--multimnist; study_multimnist.py): its own tuning
                            on validation pairs, then its main units on the test pairs
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os

import numpy as np

import pycapsnet

from . import digits, loop, study_affine, study_multimnist, study_protocol as protocol, study_report as report
from . import study_figure, study_tuning as tuning, study_units
from .common import check_fits, write_json
from .study_networks import BACKBONES, network, normalized, params_of, row_spec
from .study_diagnostics import TestPass
from .study_stats import pack
from .units import FILE, Units
from ..core import routing_source, routings
from ..errors import first_line, printable, CapsNetError
from ..training import augment as augmentation, data
from ..training.log import say
from ..training.run_dir import lock, unlock

LR = None  # tuned per row on validation (study_protocol); --lr fixes one rate for every row instead
OWN_UNITS = True  # its units file holds the settings (data, code) a unit depends on: Study makes it
FIGURE = "routings.png"
table, figure = report.table, study_figure.figure  # what common.py calls on an experiment
DEFAULT_ROWS = ("uniform", "dynamic", "attention", "inverted", "self", "vb", "random", "em", "cnn")
SWEEP_ROUTINGS = ("dynamic", "vb")  # --sweep K...: these routings at K iterations
VERSION = 3  # of the protocol: units of another version are not reused


def check_rows(chosen) -> list:
    rows = list(DEFAULT_ROWS if chosen is None else chosen)
    if not rows:
        raise CapsNetError("--routings needs at least one row")
    for r in rows:
        row_spec(r)
    return rows


# ---- the units ----------------------------------------------------------------------------------------
def _trained(args, B, description, seed, lr, train_set, val, transform, desc, test=None):
    """The network trained for --epochs at ``lr``; validation accuracy (%) after each epoch; with
    ``test`` (an opened SealedTest), its one test pass after the last."""
    val_acc, losses = [], []

    def score(model, epoch):
        val_acc.append(float(np.mean(model.predict(val[0], 100) == val[1])))

    run = argparse.Namespace(**{**vars(args), "lr": lr})
    try:
        model, step = loop.train_network(run, B, description, seed, train_set, transform, desc, after_epoch=score,
                                         curve=losses)
    except loop.Diverged as e:
        if test is not None:
            raise
        return study_units.diverged(desc, e, val_acc, losses, params_of(description))
    out = {"val": val_acc, "loss": losses, "step": step, "params": model.n_params()}
    if test is None:  # a tuning trial's diagnostics, on validation: a collapse can be read from them
        out["measures"] = TestPass(model).run(val[0][:protocol.DIAGNOSTIC_DIGITS],
                                              val[1][:protocol.DIAGNOSTIC_DIGITS]).measures()
    else:
        x_test = data.as_float(test.x)
        done = TestPass(model).run(x_test, test.y)
        out.update(test_error=100 * float(np.mean(done.wrong)), wrong=protocol_pack(done.wrong),
                   measures=done.measures())
        say(f"{desc}: validation {100 * val_acc[-1]:.2f}%, test error {out['test_error']:.2f}%")
    return out


def protocol_pack(wrong):
    return pack(wrong)


def _shift(x, r):
    return data.random_shift(data.as_float(x), 2, r)


def _crop_flip(x, r):
    return augmentation.crop_flip(data.as_float(x), r)


AUGMENTS = {"shift": _shift, "crop-flip": _crop_flip}  # --augment: every row's training images, alike


class Study:
    """One run's data, rows, settings and units; ``run`` trains the units this process runs."""

    def __init__(self, args, B, units_cls, out):
        self.args, self.B, self.out = args, B, out
        train, test = _source(args)
        self.train, self.val, test, self.records = protocol.split_data(
            train, test, args.limit, args.limit_test, args.val_fraction)
        self.records["dataset"] = dataset_name(args)
        self.test = protocol.SealedTest(test)
        self.rows = check_rows(args.routings)
        self.sweep = [f"{r}-{k}" for r in SWEEP_ROUTINGS if r in self.rows for k in (args.sweep or ())
                      if k != routings.DEFAULT_ITERS]
        self.backbone = backbone_of(args)
        self.affine_target = args.affine_target or protocol.AFFINE_TARGET
        self.augment = AUGMENTS[args.augment or "shift"]
        self.norm = data.channel_stats(self.train.x) if args.normalize else None  # on the training images alone
        if not args.no_affine:  # every argument checked before the first unit trains
            if self.train.x.shape[1] != 1:
                raise CapsNetError(f"the affine part places digits on a canvas and moves them: it reads one-channel "
                                   f"images, and these have {self.train.x.shape[1]} channels: give --no-affine")
            digits.check_canvas(args.canvas, "--canvas")
            check_fits("routings", 3 * len(self.test) + 2 * len(self.val), args.canvas, "give a smaller --canvas")
        self.settings_multimnist = study_multimnist.settings(args)
        if self.settings_multimnist:
            study_multimnist.check(self)
        self.settings = self._settings()
        self.units = units_cls(out, self.settings, {"rows": self.rows, "seeds": args.seeds, "sweep": self.sweep,
                                                    "sweep_seeds": args.sweep_seeds})
        if self.units.done:
            study_units.check(self.units.path, self.settings, self.units.done)
        self.merged = {}
        self.merged = self._given_choices(args.choices) if args.choices and args.lr is None else {}
        self.affine = None if args.no_affine else study_affine.Part(self)
        self.multimnist = study_multimnist.Part(self) if self.settings_multimnist else None

    def _settings(self) -> dict:
        a = self.args
        return {"version": VERSION, "code": code_digest(), "backend": self.B.label, "data": self.records,
                "epochs": a.epochs, "batch_size": a.batch_size, "backbone": self.backbone, "fixed_lr": a.lr,
                "lr_grid": list(tuning.LR_GRID), "lr_limits": list(tuning.LR_LIMITS),
                "open_options": tuning.OPEN_OPTIONS, "tune_seeds": list(tuning.TUNE_SEEDS), "rule": tuning.RULE,
                "val_fraction": a.val_fraction, "margin": a.margin, "augment": a.augment or "shift",
                "normalize": self.norm,
                "affine": None if a.no_affine else {"canvas": a.canvas, "target": self.affine_target, "tuned": True},
                "multimnist": self.settings_multimnist,
                # a routing of the user's own, by its source: units of another version are not mixed
                "routings": routing_source.sources(row_spec(r)[1] for r in self.rows if row_spec(r)[0] == "vector")}

    def network(self, row, shape, trial, decoder=None, head=None) -> dict:
        d = network(row, shape, self.backbone, _options(trial), decoder, len(self.train.classes), head)
        if self.norm is not None and shape[0] == len(self.norm["mean"]):  # every row's input alike
            d = normalized(d, self.norm["mean"], self.norm["std"])
        return d

    def tuned(self) -> list:
        """The rows that are tuned: every row, each row of the sweep on its own, and each of the
        affine and MultiMNIST parts'."""
        return tuned_rows(self.settings, self.rows, self.sweep)

    def known(self) -> dict:
        """Every finished unit this run knows: its folder's, and the merged tuning units of --choices."""
        return {**self.merged, **self.units.done}

    def main_keys(self) -> list:
        """The units after the tuning, in the order the shards split them: main, sweep, affine, MultiMNIST."""
        seeds, sweep_seeds = range(self.args.seeds), range(min(self.args.sweep_seeds, self.args.seeds))
        return ([f"main {r} seed {s}" for r in self.rows for s in seeds]
                + [f"main {r} seed {s}" for r in self.sweep for s in sweep_seeds]
                + ([] if self.args.no_affine else [f"affine {r} seed {s}" for r in self.rows for s in seeds])
                + study_multimnist.main_keys(self.settings_multimnist, self.rows, self.args.seeds))

    def mine(self, key, keys) -> bool:
        k, n = self.args.shard or (1, 1)
        return keys.index(key) % n == k - 1

    def choices(self) -> dict | None:
        """{row: the trial it runs} once every tuned row's choice is made (None before)."""
        if self.args.lr is not None:
            return {r: f"lr={self.args.lr:g}" for r in self.tuned()}
        results = tuning.plan(self.tuned(), routing_of, self.known())[1]
        return None if any(r is None for r in results.values()) else {r: t["chosen"] for r, t in results.items()}

    def run(self) -> None:
        val = (data.as_float(self.val.x), self.val.y)
        shape = tuple(self.train.x.shape[1:])
        if self.args.lr is None:
            self._tune(val, shape)
        choices = self.choices()
        if choices is not None and self.args.lr is None:
            self._write_choices()
        if choices is None:
            say("tuning: this shard's trials are done; the others' are needed before the next round or any test "
                "image is read: merge the shards' folders (--merge), then run each shard again with --choices "
                "MERGED/choices.json")
            return
        self.test.fix(choices, self.tuned())
        digest, keys = tuning.digest(choices), self.main_keys()
        for key in keys:
            if not self.mine(key, keys):
                continue
            kind, row, _, s = key.split(" ")
            chosen = chosen_trial(choices, kind, row, self.settings)
            if key in self.units.done:
                unit = self.units.done[key]
                if (unit.get("trial"), unit.get("choices")) != (chosen, digest):  # reused only under today's choices
                    raise CapsNetError(f"{self.units.path}: unit '{key}' ran trial {printable(unit.get('trial'), 60)} "
                                       f"under other choices than this run's ({chosen}): give another --out")
                continue
            t, ran = tuning.parse(chosen), {"trial": chosen, "choices": digest}  # each unit records what it ran
            if kind == "main":
                self.units.measure(key, lambda row=row, t=t, s=int(s), key=key: study_units.sealed({**_trained(
                    self.args, self.B, self.network(row, shape, t), s, t["lr"], self.train, val,
                    self.augment, key, test=self.test.open()), **ran}))
            elif kind == "multimnist":
                self.units.measure(key, lambda row=row, t=t, s=int(s), key=key: study_units.sealed(
                    {**self.multimnist.unit(row, t, s, key, test=True), **ran}))
            else:
                self.units.measure(key, lambda row=row, t=t, s=int(s), key=key: study_units.sealed(
                    {**self.affine.unit(row, t, s, key, test=True), **ran}))

    def _tune(self, val, shape) -> None:
        """This run's share of the tuning units, round after round while the next round is known."""
        while True:
            known = self.known()
            keys, _ = tuning.plan(self.tuned(), routing_of, known)
            todo = [k for k in keys if k not in known and self.mine(k, keys)]
            if not todo:
                return
            for key in todo:
                _, row, name, _, s = key.split(" ")
                t, pair_row, moved_row = tuning.parse(name), study_multimnist.row_of(row), study_affine.row_of(row)
                if pair_row is not None:
                    self.units.measure(key, lambda t=t, s=int(s), key=key, row=pair_row: study_units.sealed(
                        self.multimnist.unit(row, t, s, key)))
                    continue
                if moved_row is not None:
                    self.units.measure(key, lambda t=t, s=int(s), key=key, row=moved_row: study_units.sealed(
                        self.affine.unit(row, t, s, key)))
                    continue
                self.units.measure(key, lambda t=t, s=int(s), key=key, row=row: study_units.sealed(_trained(
                    self.args, self.B, self.network(row, shape, t), s, t["lr"], self.train, val, self.augment, key)))

    def _given_choices(self, path) -> dict:
        """The tuning units a merged run's choices.json was made from (its units.json beside it), each
        checked against the digest the file lists, and the file's choices recomputed from them by the
        rule: a file that does not follow from its units, or whose units are absent, is refused."""
        def refuse(what):
            raise CapsNetError(f"--choices {path}: {what}; give the choices.json a merge wrote, beside its units.json")

        try:
            with open(path) as f:
                given = json.load(f)
        except (OSError, ValueError, RecursionError) as e:
            refuse(f"cannot read it ({printable(first_line(e) if not isinstance(e, RecursionError) else 'nested')})")
        if not isinstance(given, dict) or given.get("settings") != json.loads(json.dumps(self.settings)):
            refuse("its choices were made under other settings or code than this run's")
        listed = given.get("tuning_units")
        if not (isinstance(listed, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in listed.items())):
            refuse("it lists no tuning units")
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isfile(os.path.join(folder, FILE)):  # a copy of the file, away from its merge's folder
            refuse(f"no {FILE} beside it in {folder} (the tuning units its choices were made from)")
        flags, units, _ = Units.read(folder)
        study_units.check(os.path.join(folder, FILE), flags, units)
        absent = [k for k, d in listed.items() if not isinstance(units.get(k), dict) or units[k].get("digest") != d]
        if absent:
            refuse(f"its tuning unit '{printable(absent[0], 80)}' is absent from {os.path.join(folder, FILE)} or differs")
        merged = {k: units[k] for k in listed}
        record = choices_record(self.settings, self.tuned(), merged)
        if {k: given.get(k) for k in ("choices", "pending")} != {k: record[k] for k in ("choices", "pending")}:
            refuse("its choices do not follow from its tuning units by the protocol's rule")
        clash = [k for k in merged if k in self.units.done and self.units.done[k] != merged[k]]
        if clash:
            refuse(f"its unit '{clash[0]}' differs from the one in {self.units.path}")
        return merged

    def _write_choices(self) -> None:
        write_json(os.path.join(self.out, "choices.json"), choices_record(self.settings, self.tuned(), self.known()))


def backbone_of(args) -> dict:
    """--backbone's sizes (--quick: a toy size), with --primary-types, --primary-dim, --class-dim and
    (CapsNet-style only) --conv-channels given in their place."""
    name = getattr(args, "backbone", None) or "capsnet"
    sizes = BACKBONES[name][1 if args.quick else 0]
    if "conv_channels" not in sizes and getattr(args, "conv_channels", None):
        raise CapsNetError(f"--conv-channels sets the CapsNet-style backbone's first convolution; the {name} "
                           f"backbone's widths are its paper's {sizes['widths']}: drop --conv-channels")
    return {k: getattr(args, k, None) or v for k, v in sizes.items()}


def _options(trial: dict) -> dict:
    return {k: v for k, v in trial.items() if k != "lr"}


def routing_of(row) -> str:
    """The routing a row's grid is drawn for ("cnn" and "em" for theirs; an affine or MultiMNIST row
    its row's)."""
    part_row = study_multimnist.row_of(row) or study_affine.row_of(row)
    return routing_of(part_row) if part_row is not None else row_spec(row)[1] or row


def tuned_rows(settings, rows, sweep) -> list:
    """The rows a study of ``settings`` tunes: its rows, its sweep's, its affine and MultiMNIST parts'."""
    return [*rows, *sweep, *study_affine.tuned_rows(settings.get("affine"), rows),
            *study_multimnist.tuned_rows(settings.get("multimnist"), rows)]


def chosen_trial(choices: dict, kind: str, row: str, settings: dict) -> str | None:
    """The trial a main, affine or multimnist unit of ``row`` runs: its row's choice (a sweep row's
    routing's; an affine or MultiMNIST unit's, its part's own, unless ``settings`` are of a study
    whose affine part was not tuned)."""
    if kind == "multimnist":
        return choices.get(study_multimnist.PREFIX + row)
    if kind == "affine" and (settings.get("affine") or {}).get("tuned"):
        return choices.get(study_affine.PREFIX + row)
    return choices[row] if row in choices else choices.get(row.rsplit("-", 1)[0])


def choices_record(settings, tuned, known) -> dict:
    """choices.json: the settings, the digest of every tuning unit the choices follow from, each
    tuned row's choice where its tuning is done, and the rows still waiting for a round."""
    keys, results = tuning.plan(tuned, routing_of, known)
    return {"settings": settings, "tuning_units": {k: known[k].get("digest", "") for k in keys if k in known},
            "choices": {r: t["chosen"] for r, t in results.items() if t},
            "pending": [r for r, t in results.items() if t is None]}


def code_digest() -> str:
    """A digest of the library's source (pycapsnet and its backends): units of other code are not mixed."""
    root = os.path.dirname(os.path.abspath(pycapsnet.__file__))
    h = hashlib.sha256()
    for base in (root, os.path.realpath(os.path.join(root, "backends"))):
        for d, _, files in sorted(os.walk(base)):
            for f in sorted(files):
                if f.endswith(".py"):
                    with open(os.path.join(d, f), "rb") as fh:
                        h.update(os.path.relpath(os.path.join(d, f), base).encode() + fh.read())
    return h.hexdigest()[:16]


def dataset_name(args) -> str:
    """The data's name in the records and the tables: the --dataset, or "arrays" for data given in Python."""
    if getattr(args, "data", None) is not None:
        return "arrays"
    return args.dataset or ("mnist" if args.data_dir else "embedded")


def _source(args):
    """(train, test) Splits: arrays given in Python, or --dataset / --data-dir."""
    if getattr(args, "data", None) is not None:
        return args.data
    dataset = args.dataset or ("mnist" if args.data_dir else "embedded")
    if dataset in ("embedded", "digits"):
        if args.data_dir:
            raise CapsNetError("--dataset embedded reads no --data-dir: give --dataset mnist (or fashion-mnist, folder)")
        return data.load_embedded()
    return data.load(dataset, args.data_dir)


def run(args, B, out, units=None) -> dict:
    """The study's units this process runs into ``out``, which it locks meanwhile: two runs with one
    --out (two shards) would each write the file the other is writing."""
    held = lock(out)
    try:
        study = Study(args, B, lambda out, settings, layout: Units(out, flags=settings, layout=layout), out)
        study.run()
        study_units.write_long_form(study.units.done, out)
        return report.assemble(study.settings, study.units.done, study.rows, study.sweep, args.seeds,
                               args.sweep_seeds, routing_of, study.tuned())
    finally:
        unlock(out, held)

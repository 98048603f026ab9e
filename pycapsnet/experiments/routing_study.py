"""Does routing help?  Every routing as the class layer of one shared backbone, under one protocol
fixed before anything trains (study_protocol.py): the same data, recipe, tuning budget and epochs,
choices on validation only, the test set read once, statistics that name their tests
(study_stats.py), the literature's diagnostics (study_diagnostics.py).

    backbone   conv1 9x9/1, C channels, ReLU -> primary capsules 9x9/2, T types of K dims (EM: 1x1
               matrix capsules on the same convolution) -> 10 class capsules of D dims, routed by
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
    affine ROW seed S       trained on digits placed at random on a canvas, read on the translated and
                            affine test digits at the last epoch and at the protocol's target
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys

import numpy as np

from ..core import architecture as A, routings
from ..core.description import param_shapes
from ..errors import CapsNetError, printable
from ..training import data
from ..training.log import say
from . import check_fits, digits, loop, study_protocol as protocol, study_report as report, study_units
from .networks import baseline_cnn
from .study_diagnostics import TestPass

LR = None  # tuned per row on validation (study_protocol); --lr fixes one rate for every row instead
OWN_UNITS = True  # its units file holds the settings (data, code) a unit depends on: Study makes it
FIGURE = "routings.png"
table, figure = report.table, report.figure
QUICK_BACKBONE = dict(conv_channels=8, primary_types=2, primary_dim=8, class_dim=16)
BACKBONE = dict(conv_channels=64, primary_types=16, primary_dim=8, class_dim=16)
DEFAULT_ROWS = ("uniform", "dynamic", "attention", "inverted", "self", "vb", "random", "em", "cnn")
SWEEP_ROUTINGS = ("dynamic", "vb")  # --sweep K...: these routings at K iterations
VERSION = 2  # of the protocol: units of another version are not reused


def row_spec(name: str) -> tuple:
    """("cnn" | "em" | "vector", routing, iterations or None) of a row name; CapsNetError if none."""
    if name == "cnn":
        return "cnn", None, None
    m = re.fullmatch(r"(.+)-(\d+)", name)
    base, iters = (m.group(1), int(m.group(2))) if m else (name, None)
    if base == "em":
        return "em", "em", iters or 2
    if base in routings.names() and (iters is None or routings.get(base).iterated):
        return "vector", base, iters
    raise CapsNetError(f"--routings {name}: not a row of the study; give a registered routing "
                       f"({', '.join(routings.names())}), NAME-k for an iterated one at k iterations, em or cnn")


def check_rows(chosen) -> list:
    rows = list(DEFAULT_ROWS if chosen is None else chosen)
    if not rows:
        raise CapsNetError("--routings needs at least one row")
    for r in rows:
        row_spec(r)
    return rows


def network(row, shape, backbone, options=None, decoder=None, n_classes=10) -> dict:
    """The description of ``row``'s network on the backbone (``options``: its routing's own)."""
    kind, routing, iters = row_spec(row)
    if kind == "cnn":
        return matched_cnn(shape, backbone, n_classes)
    stem = [A.conv2d(backbone["conv_channels"], 9, name="conv1"), A.relu(name="relu1")]
    if kind == "em":
        body = stem + [A.primary_matrix_caps(backbone["primary_types"], name="primary"),
                       A.class_matrix_caps(n_classes, iters=iters, name="classcaps")]
        return A.network(body, head="activations", loss=A.spread_loss(), decoder=None, input_shape=shape,
                         n_classes=n_classes)
    body = stem + [A.primary_caps(backbone["primary_types"], backbone["primary_dim"], kernel=9, stride=2, name="primary"),
                   A.dynamic_caps(n_classes, backbone["class_dim"], iters=iters, routing=routing, name="classcaps",
                                  **(options or {}))]
    head, loss = routings.get(routing).head
    if head == "logits":
        body.append(A.capsule_logits(name="logits"))
    loss = A.margin_loss() if loss == "margin" else {"loss": loss}
    return A.network(body, head=head, loss=loss, decoder=decoder and A.decoder(decoder), input_shape=shape,
                     n_classes=n_classes)


def matched_cnn(shape, backbone, n_classes=10) -> dict:
    """The baseline CNN (networks.baseline_cnn) with its widths scaled by one factor so that its
    parameters come closest to those of the "dynamic" row's network."""
    target = _params(network("dynamic", shape, backbone, n_classes=n_classes))
    best = None
    for f in np.geomspace(0.02, 1.5, 200):
        w = lambda n: max(1, int(round(n * f)))  # noqa: E731
        d = baseline_cnn(shape, n_classes, channels=(w(256), w(256), w(128)), hidden=(w(328), w(192)))
        gap = abs(_params(d) - target)
        if best is None or gap < best[0]:
            best = (gap, d)
    return best[1]


def _params(description) -> int:
    return int(sum(np.prod(s) for s in param_shapes(description).values()))


# ---- the units ----------------------------------------------------------------------------------------
def _trained(args, B, description, seed, lr, train_set, val, transform, desc, test=None):
    """The network trained for --epochs at ``lr``; validation accuracy (%) after each epoch; with
    ``test`` (an opened SealedTest), its one test pass after the last."""
    val_acc, losses = [], []

    def score(model, epoch):
        val_acc.append(float(np.mean(model.predict(val[0], 100) == val[1])))

    run = argparse.Namespace(**{**vars(args), "lr": lr})
    model, step = loop.train_network(run, B, description, seed, train_set, transform, desc, after_epoch=score,
                                     curve=losses)
    out = {"val": val_acc, "loss": losses, "step": step, "params": model.n_params()}
    if test is not None:
        x_test = data.as_float(test.x)
        done = TestPass(model).run(x_test, test.y)
        out.update(test_error=100 * float(np.mean(done.wrong)), wrong=protocol_pack(done.wrong),
                   measures=done.measures())
        say(f"{desc}: validation {100 * val_acc[-1]:.2f}%, test error {out['test_error']:.2f}%")
    return out


def protocol_pack(wrong):
    from .study_stats import pack

    return pack(wrong)


def _shift(x, r):
    return data.random_shift(data.as_float(x), 2, r)


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
        self.backbone = {k: getattr(args, k) or v for k, v in (QUICK_BACKBONE if args.quick else BACKBONE).items()}
        self.affine_target = args.affine_target or protocol.AFFINE_TARGET
        if not args.no_affine:  # every argument checked before the first unit trains
            digits.check_canvas(args.canvas, "--canvas")
            check_fits("routings", 3 * len(self.test) + 2 * len(self.val), args.canvas, "give a smaller --canvas")
        self.settings = self._settings()
        self.units = units_cls(out, self.settings, {"rows": self.rows, "seeds": args.seeds, "sweep": self.sweep,
                                                    "sweep_seeds": args.sweep_seeds})
        if self.units.done:
            study_units.check(self.units.path, self.settings, self.units.done)
        self.given = self._given_choices(args.choices) if args.choices and args.lr is None else None

    def _settings(self) -> dict:
        a = self.args
        return {"version": VERSION, "code": code_digest(), "backend": self.B.label, "data": self.records,
                "epochs": a.epochs, "batch_size": a.batch_size, "backbone": self.backbone, "fixed_lr": a.lr,
                "lr_grid": list(protocol.LR_GRID), "open_options": protocol.OPEN_OPTIONS,
                "tune_seeds": list(protocol.TUNE_SEEDS), "val_fraction": a.val_fraction, "margin": a.margin,
                "affine": None if a.no_affine else {"canvas": a.canvas, "target": self.affine_target}}

    def network(self, row, shape, trial) -> dict:
        return network(row, shape, self.backbone, _options(trial), n_classes=len(self.train.classes))

    def trials_of(self, row) -> list:
        if self.args.lr is not None:
            return []
        return [protocol.trial_name(t) for t in protocol.trials(row_spec(row)[1] or row)]

    def keys(self) -> list:
        """Every unit of the run, in the order the shards split them: tuning, main, sweep, affine."""
        tune = [f"tune {r} {t} seed {s}" for r in self.rows for t in self.trials_of(r) for s in protocol.TUNE_SEEDS]
        main = [f"main {r} seed {s}" for r in self.rows for s in range(self.args.seeds)]
        sweep = [f"main {r} seed {s}" for r in self.sweep for s in range(min(self.args.sweep_seeds, self.args.seeds))]
        affine = [] if self.args.no_affine else [f"affine {r} seed {s}" for r in self.rows for s in range(self.args.seeds)]
        return tune + main + sweep + affine

    def mine(self, key) -> bool:
        k, n = self.args.shard or (1, 1)
        return self.keys().index(key) % n == k - 1

    def choices(self) -> dict | None:
        """{row: the trial it runs}, once every row's tuning is done (None before); or those of a
        merged run's choices.json (--choices), made under the same settings."""
        if self.args.lr is not None:
            return {r: f"lr={self.args.lr:g}" for r in self.rows}
        if self.given is not None:
            return self.given
        chosen, missing = report.tuning(self.units.done, self.rows, self.trials_of, protocol.TUNE_SEEDS)
        return None if missing else {r: c["chosen"] for r, c in chosen.items()}

    def run(self) -> None:
        val = (data.as_float(self.val.x), self.val.y)
        shape = tuple(self.train.x.shape[1:])
        for row in self.rows:
            for t in protocol.trials(row_spec(row)[1] or row) if self.args.lr is None else ():
                for s in protocol.TUNE_SEEDS:
                    key = f"tune {row} {protocol.trial_name(t)} seed {s}"
                    if self.mine(key):
                        self.units.measure(key, lambda t=t, s=s, key=key: study_units.sealed(_trained(
                            self.args, self.B, self.network(row, shape, t), s, t["lr"],
                            self.train, val, _shift, key)))
        choices = self.choices()
        if choices is None:
            say("tuning: this shard's trials are done; the others' are needed before any test digit is read: merge "
                "the shards' folders (--merge), then run each shard again with --choices MERGED/choices.json")
            return
        self.test.fix(choices)
        self._write_choices(choices)
        for key in self.keys():
            if key.startswith("tune") or not self.mine(key):
                continue
            kind, row, _, s = key.split(" ")
            base = row if row in choices else row.rsplit("-", 1)[0]
            if key in self.units.done:
                ran = self.units.done[key].get("trial", choices[base])
                if ran != choices[base]:  # a finished unit is reused only where it ran the trial chosen now
                    raise CapsNetError(f"{self.units.path}: unit '{key}' ran trial {printable(ran, 60)}, not "
                                       f"{choices[base]}, which is chosen now: give another --out")
                continue
            t, trial = _parse_trial(choices[base]), {"trial": choices[base]}  # each unit records the trial it ran
            if kind == "main":
                self.units.measure(key, lambda row=row, t=t, s=int(s), key=key: study_units.sealed({**_trained(
                    self.args, self.B, self.network(row, shape, t), s, t["lr"], self.train, val,
                    _shift, key, test=self.test.open()), **trial}))
            else:
                self.units.measure(key, lambda row=row, t=t, s=int(s), key=key: study_units.sealed(
                    {**self._affine_unit(row, t, s, key), **trial}))

    def _given_choices(self, path) -> dict:
        try:
            with open(path) as f:
                given = json.load(f)
        except (OSError, ValueError) as e:
            raise CapsNetError(f"--choices {path}: cannot read it ({e}); give the choices.json a merge wrote") from None
        if not isinstance(given, dict) or given.get("settings") != json.loads(json.dumps(self.settings)):
            raise CapsNetError(f"--choices {path}: its choices were made under other settings or code than this "
                               "run's: give the merged folder of this study's own shards")
        chosen = given.get("choices")
        lost = [r for r in self.rows if not isinstance(chosen, dict) or r not in chosen]
        if lost:
            raise CapsNetError(f"--choices {path} holds no choice for {', '.join(lost)}")
        for r in self.rows:
            if chosen[r] not in self.trials_of(r):  # a value, checked as the protocol's own trials
                raise CapsNetError(f"--choices {path}: {r}'s choice {printable(repr(chosen[r]), 60)} is none of its "
                                   f"trials ({', '.join(self.trials_of(r))}); give the choices.json a merge wrote")
        return {r: chosen[r] for r in self.rows}

    def _write_choices(self, choices) -> None:
        from ..training.files import atomic_write

        record = {"settings": self.settings, "choices": choices}
        atomic_write(os.path.join(self.out, "choices.json"), lambda f: json.dump(record, f, indent=1), text=True)

    def _affine_unit(self, row, t, seed, desc) -> dict:
        """Trained on digits placed at random on the canvas; translated validation after each epoch;
        the test digits (translated, affine) read at the first epoch reaching the target and at the last."""
        canvas = self.args.canvas
        test = self.test.open()
        x_te = data.as_float(test.x)
        sets = {"translated": (digits.place(x_te, canvas, np.random.default_rng(777)), test.y),
                "affine": (digits.affine(x_te, canvas, np.random.default_rng(778)), test.y)}
        val = (digits.place(data.as_float(self.val.x), canvas, np.random.default_rng(776)), self.val.y)
        read = {"target": None, "last": None}

        def score(model, epoch):
            acc = 100 * float(np.mean(model.predict(val[0], 100) == val[1]))
            last = epoch == self.args.epochs - 1
            reached = read["target"] is None and acc >= self.affine_target
            if reached or last:
                scores = {k: 100 * float(np.mean(model.predict(x, 100) == y)) for k, (x, y) in sets.items()}
                if reached:
                    read["target"] = {**scores, "epoch": epoch + 1, "val": acc}
                if last:
                    read["last"] = {**scores, "val": acc}

        run = argparse.Namespace(**{**vars(self.args), "lr": t["lr"]})
        description = self.network(row, (1, canvas, canvas), t)
        loop.train_network(run, self.B, description, seed, self.train, lambda x, r: digits.place(data.as_float(x), canvas, r),
                           desc, after_epoch=score)
        return read


def _options(trial: dict) -> dict:
    return {k: v for k, v in trial.items() if k != "lr"}


def _parse_trial(name: str) -> dict:
    return {k: float(v) for k, v in (part.split("=") for part in name.split(","))}


def code_digest() -> str:
    """A digest of the library's source (pycapsnet and its backends): units of other code are not mixed."""
    import pycapsnet

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
    from .units import Units
    from ..training.run_dir import lock, unlock

    held = lock(out)
    try:
        study = Study(args, B, lambda out, settings, layout: Units(out, flags=settings, layout=layout), out)
        study.run()
        write_long_form(study.units.done, out)
        return assemble(study.settings, study.units.done, study.rows, study.sweep, args.seeds, args.sweep_seeds)
    finally:
        unlock(out, held)


def merge(args) -> int:
    """--merge DIR ...: the units of every folder, which must share their settings and code, into --out
    (units.json, results); rows, seeds and the sweep are read off the units themselves.  Each file is
    checked first (study_units), and every main unit must have run the trial its tuning chose; --out
    is locked while it is written, and a units file there of anything else is refused."""
    from . import write_results
    from .units import FILE
    from ..training.run_dir import lock, out_dir_for, unlock

    flags, units, layout, origin = _merged(args.merge)
    out = args.out or "experiments/routings-merged"
    with out_dir_for(out):
        held = lock(out)
        try:
            _refuse_other_units(out, flags, layout, units)
            results = assemble(flags, units, layout["rows"], layout["sweep"], layout["seeds"], layout["sweep_seeds"])
            _refuse_other_trials(flags, units, layout, results["tuning"], origin)
            _write(os.path.join(out, FILE), {"flags": flags, "layout": layout, "units": units})
            write_long_form(units, out)
            results.update(command="pycapsnet experiment routings --merge " + " ".join(args.merge), merged=list(args.merge))
            if results["tuning"] and set(results["tuning"]) >= set(layout["rows"]):  # every choice made: the shards' next step
                _write(os.path.join(out, "choices.json"),
                       {"settings": flags, "choices": {r: t["chosen"] for r, t in results["tuning"].items()}})
            write_results(sys.modules[__name__], results, out)
        finally:
            unlock(out, held)
    say(f"merged {len(units)} units of {len(args.merge)} folder(s) into {out}")
    return 0


def _merged(dirs) -> tuple:
    """(flags, units, layout, {unit: the folder it came from}) of the folders, each file checked."""
    from .units import FILE, Units

    flags, units, layout, origin = None, {}, None, {}
    for d in dirs:
        f, u, lay = Units.read(d)
        study_units.check(os.path.join(d, FILE), f, u, lay)
        if flags is None:
            flags, first, layout = f, d, lay
        elif f != flags:
            what = sorted(k for k in set(f) | set(flags) if f.get(k) != flags.get(k))
            raise CapsNetError(f"--merge: {d}'s units were run with other {' and '.join(what)} than {first}'s "
                               "(settings or code differ): merge only the folders of one study")
        elif lay != layout:
            raise CapsNetError(f"--merge: {d} is a study of other rows or seeds than {first}: merge the shards of "
                               "one command")
        for key, value in u.items():
            if key in units and units[key] != value:
                raise CapsNetError(f"--merge: {origin[key]} and {d} hold different figures for unit '{key}': a unit "
                                   "is trained once; merge the folders of one study's shards")
            units.setdefault(key, value)
            origin.setdefault(key, d)
    if layout is None:
        raise CapsNetError(f"--merge: {first} holds no routing study's units")
    return flags, units, layout, origin


def _refuse_other_units(out, flags, layout, units) -> None:
    """A units file already in ``out`` is replaced only by a merge that holds all of it (the same study
    merged again): hours of units are never lost to a mistyped --out."""
    from .units import FILE, Units

    path = os.path.join(out, FILE)
    if not os.path.exists(path):
        return
    try:
        f, u, lay = Units.read(out)
    except CapsNetError:
        f = u = lay = None
    if not (f == flags and lay == layout and isinstance(u, dict) and all(units.get(k) == v for k, v in u.items())):
        raise CapsNetError(f"--merge: --out {out} holds {path}, units of another study or units the merged folders "
                           "do not hold: give another --out (or merge that folder too)")


def _refuse_other_trials(flags, units, layout, tuning, origin) -> None:
    """Every main and affine unit that records its trial ran the one its tuning chose (or --lr's)."""
    for key, unit in units.items():
        kind, row = key.split(" ")[:2]
        if kind == "tune" or "trial" not in unit:
            continue
        base = row if row in layout["rows"] else row.rsplit("-", 1)[0]
        chosen = f"lr={flags['fixed_lr']:g}" if flags.get("fixed_lr") is not None else \
            (tuning.get(base) or {}).get("chosen")
        if chosen is not None and unit["trial"] != chosen:
            raise CapsNetError(f"--merge: {os.path.join(origin[key], 'units.json')}: unit '{key}' ran trial "
                               f"{printable(unit['trial'], 60)}, not {chosen}, which its row's tuning chose: its "
                               "figures are not this study's; train it again with the merged choices.json")


def write_long_form(units, out) -> None:
    """units.csv beside units.json: a unit a line, its row, routing, trial, options and seed as fields."""
    from ..training.files import atomic_write

    atomic_write(os.path.join(out, "units.csv"), lambda fh: fh.write(study_units.long_form(units)), text=True)


def _write(path, record) -> None:
    from ..training.files import atomic_write

    atomic_write(path, lambda fh: json.dump(record, fh, indent=1), text=True)


def assemble(settings, done, rows, sweep, seeds, sweep_seeds) -> dict:
    """results.json's content, from the units alone."""
    trials_of = lambda row: [] if settings["fixed_lr"] is not None else [  # noqa: E731
        protocol.trial_name(t) for t in protocol.trials(row_spec(row)[1] or row)]
    tune, _ = report.tuning(done, rows, trials_of, protocol.TUNE_SEEDS) if settings["fixed_lr"] is None else ({}, [])
    main, missing = report.rows_of(done, rows, seeds)
    sweep_done, sweep_missing = report.rows_of(done, sweep, min(sweep_seeds, seeds))
    baseline = protocol.BASELINE if protocol.BASELINE in rows else rows[0]
    n_test, margin = settings["data"]["test"]["digits"], settings.get("margin")
    dataset = settings["data"].get("dataset", "mnist")
    return {"protocol": _declared(settings, baseline), "settings": settings, "data": settings["data"],
            "dataset": dataset, "seeds": seeds, "tuning": tune, dataset: report.main_rows(main, baseline, n_test, margin),
            "sweep": report.main_rows(sweep_done, None, n_test),
            "affine": report.affine_rows(done, rows, seeds) if settings["affine"] else None,
            "affine_canvas": (settings["affine"] or {}).get("canvas"),
            "missing": missing + sweep_missing, "complete": not (missing or sweep_missing)}


def _declared(settings, baseline) -> dict:
    grid = f"lr from {settings['lr_grid']} ({len(settings['lr_grid'])} trials; VB: lr {list(protocol.OPEN_OPTION_LRS)} x " \
           f"vb_lambda {list(protocol.OPEN_OPTIONS['vb']['vb_lambda'])})" if settings["fixed_lr"] is None else \
        f"one lr for every row, {settings['fixed_lr']:g}, given (no tuning)"
    return {"baseline": baseline, "affine_target": (settings["affine"] or {}).get("target"),
            "margin": settings.get("margin"),
            "summary": f"validation {settings['val_fraction']:g} of the training digits (stratified); {grid}, on "
                       f"{len(settings['tune_seeds'])} tuning seed(s), the highest last-epoch validation accuracy "
                       f"chosen (ties: the first listed); the test set read once, after the last epoch of each main "
                       f"unit; {settings['epochs']} epochs, batch {settings['batch_size']}, Adam decayed 0.85 per epoch; "
                       f"transforms at init.routed_std for every row; baseline {baseline}"}

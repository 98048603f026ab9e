"""Generated hostile inputs, run in-process one after another: network descriptions given to the
trainer and checkpoint headers given to evaluate.  Each must end in success (exit 0) or one line
on stderr with exit 2; anything else -- an exception, another exit code, more lines -- is printed
as a failure.  Run by tests/test_fuzz.py in a subprocess under a memory and a time limit:

    python -m tests.fuzz_worker SEED CASES WORKDIR
"""
import contextlib
import io
import json
import math
import os
import random
import shutil
import sys

import numpy as np

import pycapsnet
import pycapsnet.routings as routings
from pycapsnet import BackendError, CapsNetError, TrainingDiverged
from pycapsnet.core import architecture as A
from pycapsnet.training import data, trainer
from pycapsnet.tools import cli

DATA = ["--limit", "8", "--limit-test", "4", "--batch-size", "4", "--no-progress", "--epochs", "1"]
BASES = {
    "dynamic": A.network([A.conv2d(4, 9, init_std=0.05, bias=0.1, name="conv1"), A.relu(),
                          A.primary_caps(2, 4, kernel=9, stride=2, init_std=0.1, bias=0.1, scale=1 / 32),
                          A.dynamic_caps(10, 8, init_std=0.1, bias=0.1, name="classcaps")], decoder=A.decoder((16,))),
    "convcaps": A.network([A.conv2d(4, 9), A.relu(), A.primary_caps(2, 4, kernel=9, stride=2), A.conv_caps(2, 4),
                           A.attention_caps(10, 8)], decoder=None),
    "em": A.network([A.conv2d(4, 5, stride=2), A.relu(), A.primary_matrix_caps(2), A.conv_matrix_caps(2, 3, 2),
                     A.class_matrix_caps(10)], head="activations", decoder=None),
    "cnn": A.network([A.conv2d(4, 5, stride=2), A.relu(), A.max_pool(2), A.flatten(), A.dropout(0.3), A.linear(10)],
                     head="logits", decoder=None),
}
VALUES = [0, -1, 1, 2, 3, 1.5, 10**9, 2**62, "3", "false", None, True, False, math.nan, math.inf, [], {}, [3], "x" * 300]
KINDS = list(A.LAYERS)


def mutate(arch, rng):
    """One to three random edits of a description."""
    arch = json.loads(json.dumps(arch))
    for _ in range(rng.randint(1, 3)):
        move = rng.choice(["option", "option", "drop", "unknown", "insert", "swap", "top", "decoder"])
        body = arch["body"] if isinstance(arch.get("body"), list) else []
        spec = rng.choice(body) if body else {}
        spec = spec if isinstance(spec, dict) else {}
        if move == "option" and len(spec) > 1:
            spec[rng.choice([k for k in spec if k != "layer"] or ["name"])] = rng.choice(VALUES)
        elif move == "drop" and spec:
            spec.pop(rng.choice(list(spec)))
        elif move == "unknown":
            spec[rng.choice(["colour", "kernels", "iter"])] = rng.choice(VALUES)
        elif move == "insert":
            body.insert(rng.randrange(len(body) + 1), {"layer": rng.choice(KINDS + ["lstm"]),
                                                        **({"types": 2, "dim": 4} if rng.random() < 0.5 else {})})
        elif move == "swap" and body:
            spec["layer"] = rng.choice(KINDS)
        elif move == "top":
            arch[rng.choice(["head", "loss", "n_classes", "input_shape", "body", "extra"])] = rng.choice(VALUES)
        elif move == "decoder" and isinstance(arch, dict):
            arch["decoder"] = rng.choice([None, {"hidden": [rng.choice(VALUES)]}, {"weight": rng.choice(VALUES)},
                                          {"hidden": [8], "typo": 1}, rng.choice(VALUES)])
    return arch


def mutate_header(header, rng):
    header = json.loads(json.dumps(header))
    where = rng.choice(["architecture", "recipe", "epoch", "history", "record", "classes", "top"])
    if where == "record" and header.get("history"):
        record = header["history"][-1]
        record[rng.choice(list(record))] = rng.choice(VALUES)
    elif where == "architecture" and isinstance(header.get("architecture"), dict):
        header["architecture"] = mutate(header["architecture"], rng)
    elif where == "recipe" and isinstance(header.get("recipe"), dict):
        header["recipe"][rng.choice(list(header["recipe"]))] = rng.choice(VALUES)
    elif where == "top":
        header[rng.choice(["format", "optimizer", "backend", "data"])] = rng.choice(VALUES)
    else:
        header[where] = rng.choice(VALUES)
    return header


# Python API arguments: what a notebook might pass -- NumPy scalars, arrays where scalars go, strings.
API_VALUES = VALUES + [np.int64(3), np.int32(-2), np.float32(0.5), np.float64(2.0), np.array([1, 2]), np.array(3),
                       np.array([1.0, 28.0, 28.0]), (1, 28, 28), [1, 28, 28], "1x28x28", b"3", object()]
BUILD = {"input_shape": (1, 28, 28), "n_classes": 10, "seed": 0, "classes": None, "dtype": "float32"}
FIT = {"epochs": 1, "batch_size": 4, "lr": 2e-3, "lr_decay": 0.85, "lr_min": None, "ema": None, "optimizer": "adam",
       "shift": 2, "augment": "shift", "seed": 0, "early_stop": None}


def api_case(rng, x, y):
    """build and fit, one keyword of either set to a generated value: success, or CapsNetError."""
    build, fit = dict(BUILD), dict(FIT)
    target = rng.choice([build, fit])
    key = rng.choice(list(target))
    value = rng.choice(API_VALUES + [np.array(rng.choice(["a", "b"] * 5)) if key == "classes" else None])
    if key == "epochs" and isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value > 2:
        value = np.int64(2)  # a valid huge count would train for as long as it says
    target[key] = value
    model = pycapsnet.build(A.network([A.conv2d(4, 9), A.relu(), A.primary_caps(2, 4, kernel=9, stride=2),
                                       A.dynamic_caps(10, 4)], decoder=None), **build)
    model.fit(x, y, progress=False, **fit)
    return f"{key}={value!r}"


def python_case(rng, x, y, model, work):
    """One of the Python face's functions (datasets, optim, study) with one argument set to a generated
    value, the others small: it succeeds or raises CapsNetError (issue 95 item 22)."""
    from pycapsnet import datasets, optim, study

    calls = {
        "load_folder": (lambda **k: datasets.load_folder(work, **k), {"image_size": None, "channels": None,
                                                                       "test_fraction": 0.2, "seed": 0}),
        "multimnist": (lambda **k: datasets.multimnist(x, y, **k), {"pairs": 1, "seed": 0, "shift": 4, "canvas": 36}),
        "affine": (lambda **k: datasets.affine(x[:2], **k), {"seed": 0, "canvas": 40, "max_rotation": 20.0,
                                                               "max_shear": 45.0, "scale": (0.8, 1.2)}),
        "batches": (lambda **k: list(optim.batches(x, y, **k)), {"batch_size": 4, "epoch": 0, "seed": 0, "shift": 2,
                                                                  "augment": "shift"}),
        "adam": (lambda **k: optim.Adam(model, **k), {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "ema": None}),
        "figure_4": (lambda **k: study.figure_4(model, x[:1], **k), {"capsule": None, "reach": 0.25, "steps": 3,
                                                                     "path": None}),
        "gradcheck": (lambda **k: study.gradcheck(model, **k), {"samples": 1, "seed": 0, "tol": 1e-6, "batch": 1}),
        "crosscheck": (lambda **k: study.crosscheck(model, "numpy", "numpy", **k), {"dtype": "float64", "batch": 1,
                                                                                    "seed": 0, "rtol": None}),
        "coupling": (lambda **k: study.coupling(model, x[:2], **k), {"batch_size": 2}),
        "inspect": (lambda **k: study.inspect(model, x[:4], y[:4], **k), {"index": 0, "out": os.path.join(work, "i")}),
        "routings.layer": (lambda **k: routings.layer(k.pop("name"), **k),
                           {"name": "dynamic", "children": (6, 4), "capsules": 3, "dim": 4, "seed": 0, "iters": None,
                            "init_std": None, "routing_grad": "full"}),
    }
    name = rng.choice(sorted(calls))
    fn, kwargs = calls[name]
    key = rng.choice(sorted(kwargs))
    value = rng.choice(API_VALUES)
    if name in ("multimnist", "batches", "gradcheck", "crosscheck", "coupling") and isinstance(value, (int, np.integer)) \
            and not isinstance(value, bool) and value > 64:
        value = np.int64(3)  # a valid large count would work for as long as it says
    kwargs = {**kwargs, key: value}
    return f"{name}({key}={value!r})"[:200], lambda: fn(**kwargs)


STUDY = ["experiment", "routings", "--quick", "--seeds", "1", "--epochs", "1", "--limit", "40", "--limit-test", "20",
         "--no-affine", "--routings", "uniform"]


def study_file_case(rng, k, work):
    """A finished tiny study's units.json or choices.json with one field set to a generated value, then
    merged or run with --choices: it succeeds or is refused in one line (issue 103 items 6, 7, 15, 16)."""
    base = os.path.join(work, "study")
    folder = os.path.join(work, f"study{k}")
    shutil.copytree(base, folder)
    which = rng.choice(["units.json", "choices.json"])
    path = os.path.join(folder, which)
    with open(path) as f:
        record = json.load(f)
    places = [(record, key) for key in record]
    for key, value in list(record.items()):
        if isinstance(value, dict):
            places += [(value, k2) for k2 in value]
            places += [(v2, k3) for v2 in value.values() if isinstance(v2, dict) for k3 in v2]
    target, key = rng.choice(places)
    target[key] = rng.choice(VALUES + ["lr=0.002,iters=7", "lr=1e+09", "zz", [1], {"a": None}])
    with open(path, "w") as f:
        json.dump(record, f)
    if which == "units.json":
        argv = ["experiment", "routings", "--merge", folder, "--out", os.path.join(work, f"merged{k}")]
    else:  # a new folder's run with the merged choices: refused, or the main units trained under them
        argv = [*STUDY, "--out", os.path.join(work, f"chosen{k}"), "--choices", path]
    return f"{which}: {key} = {target[key]!r}"[:200], argv


def torch_round_trip(rng):
    """The torch wrapper's state_dict with batch norm: trained a few steps, saved, loaded into another
    network of the same description, evaluated: the same scores."""
    import io as _io

    import torch

    import pycapsnet.torch as pct

    body = [A.conv2d(rng.choice([2, 4]), rng.choice([3, 5]), stride=2), A.batch_norm(momentum=rng.random()), A.relu()]
    if rng.random() < 0.5:
        body += [A.dropout(0.3)]
    body += [A.primary_caps(2, 4, kernel=3, stride=2), A.dynamic_caps(10, 4)]
    arch = A.network(body, decoder=None, input_shape=(1, 28, 28), n_classes=10)
    net = pct.Network(pycapsnet.build(arch, backend="torch", seed=rng.randrange(100)))
    x = torch.rand(8, 1, 28, 28)
    net.train()
    for _ in range(rng.randint(1, 3)):
        net(x)
    net.eval()
    expected = net(x)[1]
    blob = _io.BytesIO()
    torch.save(net.state_dict(), blob)
    other = pct.Network(pycapsnet.build(arch, backend="torch", seed=rng.randrange(100, 200)))
    other.load_state_dict(torch.load(_io.BytesIO(blob.getvalue())))
    other.eval()
    return bool(torch.equal(other(x)[1], expected))


def run(argv, call):
    """(exit code, stderr) of ``call(argv)``; an exception is the failure it stands for."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = call(argv)
    return code, err.getvalue()


OUTCOMES = {"trained or scored": 0, "refused in one line": 0}


def judge(label, code, err):
    if code == 0 or (code == 2 and err.startswith("error: ") and err.count("\n") == 1):
        OUTCOMES["trained or scored" if code == 0 else "refused in one line"] += 1
        return True
    print(f"FAIL {label}: exit {code}: {err[-500:]!r}", flush=True)
    return False


def main():
    seed, cases, work = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    rng = random.Random(seed)
    ok = True
    base_run = os.path.join(work, "base")
    (open(os.path.join(work, "base.json"), "w")).write(json.dumps(BASES["dynamic"]))
    assert trainer.main("numpy", [*DATA, "--network", os.path.join(work, "base.json"), "--out", base_run]) == 0
    assert run([*STUDY, "--out", os.path.join(work, "study")], cli.main)[0] == 0
    from tests.test_faults import _rewrite_header

    train, _ = data.load_embedded()
    x, y = train.images(slice(0, 8)), train.y[:8]
    small = pycapsnet.build("capsnet", conv_channels=4, primary_types=2, decoder_hidden=(8, 16))

    for k in range(cases):
        name = rng.choice(list(BASES))
        path = os.path.join(work, f"net{k}.json")
        with open(path, "w") as f:
            json.dump(mutate(BASES[name], rng), f)
        try:
            code, err = run([*DATA, "--network", path, "--out", os.path.join(work, f"run{k}")],
                            lambda a: trainer.main("numpy", a))
        except BaseException as e:  # noqa: BLE001 -- what the user would have seen as a traceback
            code, err = f"{type(e).__name__}", str(e)
        ok &= judge(f"description {k} (from {name}) {open(path).read()[:300]}", code, err)
        ck = os.path.join(work, f"ck{k}.npz")
        with open(os.path.join(base_run, "checkpoint.npz"), "rb") as src, open(ck, "wb") as dst:
            dst.write(src.read())
        _rewrite_header(ck, lambda h: mutate_header(h, rng), rebind=rng.random() < 0.7)
        try:
            code, err = run(["evaluate", ck], cli.main)
        except BaseException as e:  # noqa: BLE001
            code, err = f"{type(e).__name__}", str(e)
        ok &= judge(f"header {k}", code, err)
        try:
            api_case(rng, x, y)
            OUTCOMES["trained or scored"] += 1
        except (CapsNetError, BackendError, TrainingDiverged) as e:  # the documented exceptions, each one line
            ok &= judge(f"API case {k}", 2, f"error: {e}\n")
        except BaseException as e:  # noqa: BLE001
            ok &= judge(f"API case {k}", type(e).__name__, str(e))
        label, call = python_case(rng, x, y, small, work)
        try:
            call()
            OUTCOMES["trained or scored"] += 1
        except CapsNetError as e:  # the documented refusal, one line
            ok &= judge(f"Python case {k} {label}", 2, f"error: {e}\n")
        except BaseException as e:  # noqa: BLE001
            ok &= judge(f"Python case {k} {label}", type(e).__name__, str(e))
        label, argv = study_file_case(rng, k, work)
        try:
            code, err = run(argv, cli.main)
        except BaseException as e:  # noqa: BLE001
            code, err = f"{type(e).__name__}", str(e)
        ok &= judge(f"study file {k} {label}", code, err)
        if k % 5 == 0:
            try:
                same = torch_round_trip(rng)
            except ImportError:
                same = True
            if not same:
                print(f"FAIL state_dict round trip {k}: evaluation scores changed", flush=True)
                ok = False
    print(f"fuzz: {', '.join(f'{v} {k}' for k, v in OUTCOMES.items())}; "
          + ("no failure" if ok else "failures above"), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

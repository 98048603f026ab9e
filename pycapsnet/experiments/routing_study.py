"""Does routing help?  Every routing the library has as the class layer of one shared backbone, the
same data, recipe and epochs, several seeds (Paik, Kwak & Kim 2019; Gu & Tresp 2020):

    backbone   conv1 9x9/1, C channels, ReLU -> primary capsules 9x9/2, T types of 8D (EM: 1x1 matrix
               capsules on the same convolution) -> 10 class capsules of 16D, routed by:
    dynamic-1, dynamic-3 (Sabour et al.), attention (Efficient-CapsNet's), inverted (Tsai et al.),
    self (Hahn et al.), vb (Ribeiro et al.), em (Hinton et al.), and the baselines uniform and random
    coupling.  Shared head: the capsule lengths and the margin loss, no decoder (EM: its activations
    and the spread loss).  Where a routing's paper has a head of its own, it runs with it too
    ("inverted, its head": a shared linear map to logits and cross-entropy; "self, its head":
    -log a_j); the table's main rows are the shared head's.

Per routing and seed, three units (units.py: a stopped run goes on where it stopped):
    mnist    trained on the digits shifted by up to 2 pixels, the last epoch's test error (no epoch
             is chosen on the test set); then the entropy of each routing iteration's coefficients
             (c_ij; VB and EM: R_ij), per child over the parents, in units of ln J (1: uniform),
             averaged over the first test digits -- Paik et al.'s measure of polarisation
    affine   trained on digits placed at random on a 40x40 canvas, scored after each epoch on
             translated held-out digits; each network is read at the first epoch that reaches one
             target accuracy (affine.reading_target: --affine-target, else the lowest of the best
             validation accuracies within 10 points of the highest; the same translated accuracy
             for all, chosen without a test set), on translated and on affinely moved test
             digits; a network that never reaches it is not read
    multimnist the routings of vector capsules (not EM), each with the paper's decoder, trained on
             MultiMNIST as the multimnist experiment trains CapsNet (both digits reconstructed, Adam
             at its 1e-3); a pair counts only if its two longest capsules are its two classes
"""
from __future__ import annotations

import math
import os

import numpy as np

from ..core import architecture as A
from ..errors import CapsNetError
from ..tools import plots
from ..training import data
from ..training.log import say
from . import affine, check_fits, digits, loop, multimnist

LR = 2e-3
QUICK_BACKBONE = dict(conv_channels=8, primary_types=2)
BACKBONE = dict(conv_channels=64, primary_types=16)
ROUTINGS = {"dynamic-1": ("dynamic", 1), "dynamic-3": ("dynamic", 3), "attention": ("attention", None),
            "inverted": ("inverted", 3), "self": ("self", None), "vb": ("vb", 3), "em": ("em", 2),
            "uniform": ("uniform", None), "random": ("random", None)}
DECODER, QUICK_DECODER = (512, 1024), (32, 64)  # MultiMNIST's decoder: the paper's, and --quick's
MULTIMNIST_LR = multimnist.LR  # its units' Adam rate: the multimnist experiment's (the paper's)
OWN_HEADS = ("inverted", "self")  # rows "NAME, its head" beside the shared head's
ENTROPY_DIGITS = 100
VAL_FRACTION = 0.1


def network(name, shape, conv_channels, primary_types, own_head=False, decoder=None) -> dict:
    """The description of routing ``name``'s network on the shared backbone; ``decoder``: its hidden
    sizes, for the reconstruction decoder MultiMNIST trains (none elsewhere)."""
    routing, iters = ROUTINGS[name]
    stem = [A.conv2d(conv_channels, 9, name="conv1"), A.relu(name="relu1")]
    if routing == "em":
        body = stem + [A.primary_matrix_caps(primary_types, name="primary"),
                       A.class_matrix_caps(10, iters=iters, name="classcaps")]
        return A.network(body, head="activations", loss=A.spread_loss(), decoder=None, input_shape=shape,
                         n_classes=10)
    body = stem + [A.primary_caps(primary_types, 8, kernel=9, stride=2, name="primary")]
    if routing == "attention":
        body.append(A.attention_caps(10, 16, name="classcaps"))
    else:
        body.append(A.dynamic_caps(10, 16, iters=iters, routing=routing, name="classcaps"))
    head, loss = "lengths", A.margin_loss()
    if own_head and routing == "inverted":
        body.append(A.capsule_logits(name="logits"))
        head, loss = "logits", A.cross_entropy()
    elif own_head and routing == "self":
        loss = A.nll_loss()
    return A.network(body, head=head, loss=loss, decoder=decoder and A.decoder(decoder), input_shape=shape,
                     n_classes=10)


def variants(shape, backbone, chosen=None) -> dict:
    """Row name -> description: every routing (or those ``chosen``) with the shared head, then the
    papers' own heads."""
    names = [n for n in ROUTINGS if chosen is None or n in chosen]
    rows = {name: network(name, shape, **backbone) for name in names}
    rows.update({f"{name}, its head": network(name, shape, own_head=True, **backbone) for name in OWN_HEADS
                 if name in names})
    return rows


def check_routings(chosen) -> None:
    """Refuse, before anything is trained, a routing name the study does not have."""
    unknown = [n for n in chosen or () if n not in ROUTINGS]
    if chosen is not None and (unknown or not chosen):
        raise CapsNetError(f"--routings {' '.join(unknown) or '(none)'}: the study's routings are "
                           f"{', '.join(ROUTINGS)}; give one or more of them (a routing's own head runs with it)")


def reconstructing(shape, backbone, quick, chosen=None) -> dict:
    """Row name -> description with the decoder: the routings of vector capsules, shared head."""
    hidden = QUICK_DECODER if quick else DECODER
    return {name: network(name, shape, decoder=hidden, **backbone) for name in ROUTINGS
            if name != "em" and (chosen is None or name in chosen)}


def coefficients(layer) -> list:
    """A routing layer's coefficients of each iteration, (..., parents) with rows summing to 1: what
    ``inspect`` draws (c_ij; EM: R_ij), attention's without its learned bias."""
    from ..core.capsules import AttentionCaps
    from ..tools.inspect_run import _coefficients

    xp = layer.B.xp
    if isinstance(layer, AttentionCaps):  # its coupling adds the learned bias: the softmax alone
        return [layer.B.to_numpy(xp.permute_dims(c, (0, 2, 1))) for c in layer.traced(1)]
    return [layer.B.to_numpy(c) for c in _coefficients(layer)]


def entropy(c) -> float:
    """Mean over samples and children of -Σ_j c_ij ln c_ij / ln J."""
    c = np.clip(np.asarray(c, np.float64), 1e-300, 1)
    return float(np.mean(-np.sum(c * np.log(c), axis=-1)) / math.log(c.shape[-1]))


def mnist_unit(args, B, description, seed, train_set, x_test, y_test, desc) -> dict:
    losses = []
    model, step = loop.train_network(args, B, description, seed, train_set, lambda x, r: data.random_shift(x, 2, r),
                                     desc, curve=losses)
    error = 100 * float(np.mean(model.predict(x_test, 100) != y_test))
    with model.evaluating():
        model.forward(x_test[:ENTROPY_DIGITS])
    name, layer = model.routing_layers()[-1]
    ent = [entropy(c) for c in coefficients(layer)]
    model.release()
    say(f"{desc}: test error {error:.2f}%, coupling entropy per iteration {', '.join(f'{e:.3f}' for e in ent)}")
    return {"error": error, "entropy": ent, "step": step, "params": model.n_params(), "losses": losses}


def affine_unit(args, B, description, seed, train_set, scored, canvas, desc) -> dict:
    curve, losses = [], []

    def score(model, epoch):
        curve.append({k: 100 * float(np.mean(model.predict(x, 100) == y)) for k, (x, y) in scored.items()})

    loop.train_network(args, B, description, seed, train_set, lambda x, r: digits.place(x, canvas, r), desc,
                       after_epoch=score, curve=losses)
    return {"curve": curve, "losses": losses}


def run(args, B, out, units) -> dict:
    backbone = QUICK_BACKBONE if args.quick else BACKBONE
    train_set, test_set = digits.source(args.limit, args.data_dir)
    x_test = data.as_float(test_set.x)
    check_routings(args.routings)
    rows = variants((1, 28, 28), backbone, args.routings)
    mnist = {name: [units.measure(f"mnist {name} seed {seed}", lambda d=d, seed=seed: mnist_unit(
                 args, B, d, seed, train_set, x_test, test_set.y, f"mnist {name} seed {seed}"))
                    for seed in range(args.seeds)]
             for name, d in rows.items()}
    results = {"backbone": backbone, "train": len(train_set), "test": len(test_set), "mnist": {}, "affine": None}
    for name, done in mnist.items():
        errors = [u["error"] for u in done]
        results["mnist"][name] = {"params": done[0]["params"], "errors": errors, **_spread(errors),
                                  "entropy": np.mean([u["entropy"] for u in done], axis=0).tolist(),
                                  "ms_per_step": 1e3 * float(np.median([u["step"] for u in done]))}
    if not args.no_affine:
        results["affine"] = _affine(args, B, units, train_set, test_set, backbone)
    results["multimnist"] = None if args.no_multimnist else _multimnist(args, B, units, train_set, test_set)
    figure(results, os.path.join(out, "routings.png"))
    return results


def _affine(args, B, units, train_set, test_set, backbone) -> dict:
    canvas = digits.check_canvas(args.canvas)
    check_fits("routings", 3 * len(test_set) + args.batch_size, canvas, "give a smaller --canvas or --limit")
    train_set, val_set = train_set.held_out(VAL_FRACTION, 0)
    x_te = data.as_float(test_set.x)
    scored = {"val": (digits.place(data.as_float(val_set.x), canvas, np.random.default_rng(776)), val_set.y),
              "translated": (digits.place(x_te, canvas, np.random.default_rng(777)), test_set.y),
              "affine": (digits.affine(x_te, canvas, np.random.default_rng(778)), test_set.y)}
    curves = {name: [units.measure(f"affine {name} seed {seed}", lambda d=d, seed=seed: affine_unit(
                  args, B, d, seed, train_set, scored, canvas, f"affine {name} seed {seed}"))["curve"]
                     for seed in range(args.seeds)]
              for name, d in variants((1, canvas, canvas), backbone, args.routings).items()}
    return read_affine(curves, args.seeds, args.affine_target)


def read_affine(curves, seeds, given=None) -> dict:
    """affine.read's readings, with each network's spread over the seeds read."""
    read_at, rows = affine.read(curves, seeds, given)
    for seed, target in enumerate(read_at):
        missed = [n for n, r in rows.items() if r["stop_epoch"][seed] is None]
        say(f"affine seed {seed}: networks read at validation {target:.2f}%"
            + (f"; not reached by {', '.join(missed)}" if missed else ""))
    return {"read_at": read_at, "rows": {name: {**r, "affine_mean": _spread_of_read(r["affine"]),
                                                "translated_mean": _spread_of_read(r["translated"])}
                                         for name, r in rows.items()}}


def _multimnist(args, B, units, train_set, test_set) -> dict:
    """Each reconstructing routing on MultiMNIST as the multimnist experiment trains CapsNet: pairs
    shifted by up to --shift pixels on a canvas of 28 + 2 --shift, both digits reconstructed."""
    canvas = digits.DIGIT + 2 * args.shift
    pairs = args.pairs if args.pairs is not None else (1 if args.quick else 2)
    digits.check_multimnist(args.shift, canvas, pairs)
    check_fits("routings", 3 * (len(train_set) * pairs + len(test_set)), canvas, "give fewer --pairs or a --limit")
    x_tr = data.as_float(train_set.x)
    test = digits.multimnist(data.as_float(test_set.x), test_set.y, 1, np.random.default_rng(12345), args.shift, canvas)
    rows = reconstructing((1, canvas, canvas), QUICK_BACKBONE if args.quick else BACKBONE, args.quick, args.routings)
    out = {}
    for name, d in rows.items():
        done = [units.measure(f"multimnist {name} seed {seed}", lambda d=d, seed=seed: multimnist.train_one(
                    args, B, seed, x_tr, train_set.y, test, pairs, None, description=d, canvas=canvas,
                    lr=MULTIMNIST_LR, desc=f"multimnist {name} seed {seed}")) for seed in range(args.seeds)]
        errors = [u["error"] for u in done]
        out[name] = {"params": done[0]["params"], "errors": errors, **_spread(errors),
                     "ms_per_step": 1e3 * float(np.median([u["step"] for u in done]))}
    return {"canvas": canvas, "shift": args.shift, "pairs_per_train_digit_per_epoch": pairs, "lr": MULTIMNIST_LR,
            "test_pairs": len(test[1]), "rows": out}


def _spread(values) -> dict:
    return {"mean": float(np.mean(values)), "std": float(np.std(values, ddof=1)) if len(values) > 1 else None}


def _spread_of_read(values) -> dict:
    """_spread over the seeds whose network was read (not None), and how many those are."""
    read = [v for v in values if v is not None]
    return {**(_spread(read) if read else {"mean": None, "std": None}), "read": len(read), "seeds": len(values)}


def _affine_cell(a) -> str:
    """The affine column: mean ± std over the seeds read; how many, where not all; where none, the
    network's best validation accuracy, short of the target."""
    if a is None:
        return ""
    m = a["affine_mean"]
    if not m["read"]:
        return f"not read (best validation {max(a['best_val']):.1f}%)"
    spread = f" ± {m['std']:.2f}" if m["std"] is not None else ""
    return f"{m['mean']:.2f}{spread}" + (f" ({m['read']} of {m['seeds']} seeds)" if m["read"] < m["seeds"] else "")


def table(results) -> str:
    mnist, read = results["mnist"], (results["affine"] or {}).get("rows", {})
    multi = (results.get("multimnist") or {}).get("rows", {})
    best = min(mnist, key=lambda n: mnist[n]["mean"])
    spread = lambda r: f" ± {r['std']:.2f}" if r["std"] is not None else ""  # noqa: E731
    lines = ["| routing | parameters | test error % | within the best's spread | affine test % | MultiMNIST error % "
             "| coupling entropy per iteration | ms/step |", "|---|---|---|---|---|---|---|---|"]
    for name, r in mnist.items():
        near = abs(r["mean"] - mnist[best]["mean"]) <= max(r["std"] or 0, mnist[best]["std"] or 0)
        cell, m = _affine_cell(read.get(name)), multi.get(name)
        multi_cell = f"{m['mean']:.2f}{spread(m)}" if m else ""
        lines.append(f"| {name} | {r['params']:,} | {r['mean']:.2f}{spread(r)} | {'yes' if near else 'no'} | {cell} | "
                     f"{multi_cell} | {', '.join(f'{e:.3f}' for e in r['entropy'])} | {r['ms_per_step']:.0f} |")
    return "\n".join(lines)


def figure(results, path):
    """Each test error per routing with its spread (MNIST; affine and MultiMNIST where run), and the
    coupling entropy of each iteration."""
    plt = plots.pyplot()
    mnist = results["mnist"]
    names = list(mnist)
    panels = [("MNIST test error %", {n: (r["mean"], r["std"]) for n, r in mnist.items()})]
    read = {n: (100 - r["affine_mean"]["mean"], r["affine_mean"]["std"])
            for n, r in (results["affine"] or {}).get("rows", {}).items() if r["affine_mean"]["read"]}
    if read:
        panels.append(("affine test error %", read))
    if results.get("multimnist"):
        panels.append(("MultiMNIST test error %", {n: (r["mean"], r["std"])
                                                   for n, r in results["multimnist"]["rows"].items()}))
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(3.6 * (len(panels) + 1), 3.6))
    for a, (label, rows) in zip(axes, panels):
        means = [rows[n][0] if n in rows else np.nan for n in names]
        stds = [(rows[n][1] or 0) if n in rows else 0 for n in names]
        a.errorbar(means, range(len(names)), xerr=stds, fmt="o", color="C0", ms=4, capsize=2)
        a.grid(axis="x", alpha=0.3)
        shown = [m for m in means if m == m]
        if min(shown) > 0 and max(shown) > 10 * min(shown):  # a failed row would flatten the rest
            a.set_xscale("log")
        a.set_yticks(range(len(names)), names if a is axes[0] else [""] * len(names), fontsize=7)
        a.invert_yaxis(), a.set_xlabel(f"{label}\n(mean ± std over seeds)", fontsize=8)
    b = axes[-1]
    for n in names:
        ent = mnist[n]["entropy"]
        b.plot(range(1, len(ent) + 1), ent, "o-", label=n, lw=1, ms=3)
    b.set_xticks(range(1, 1 + max(len(mnist[n]["entropy"]) for n in names)))
    b.set_xlabel("routing iteration", fontsize=8), b.set_ylabel("coupling entropy / ln J"), b.set_ylim(0, 1.05)
    b.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    plots.save(fig, path)

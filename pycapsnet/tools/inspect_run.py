"""``pycapsnet inspect RUN``: pictures of what a trained network does with one test image.

    reconstructions.png   the first test images and their reconstructions
    perturbation.png      Figure 4: each dimension of a class capsule moved over [-R, R], decoded
    coupling.png          the class layer's coupling coefficients c_ij (EM: assignments R_ij) per
                          routing iteration, the classes named; coupling.npz holds the arrays
    coupling_<layer>.png  the same for every other routing layer (a ConvCaps layer's averaged over
                          its window positions), with coupling_<layer>.npz
    coupling_grad.npz     with --coupling-grad: dL/dc_ij of every iteration of every routing layer
                          (the image's own loss; a constant coefficient, such as c^0 = 1/J, has none)
    activations.png       EM: the class activations a_j after each iteration
"""
from __future__ import annotations

import os

import numpy as np

from pycapsnet import backends

from ..core.capsules import AttentionCaps
from ..errors import CapsNetError
from ..training import checkpoint as ckpt_mod, data, files
from ..training.preflight import checked_data
from ..training.recipe import data_options, settle
from ..training.run_dir import out_dir_for, save_reconstructions
from . import coupling, plots


def inspect_run(args) -> int:
    try:
        with out_dir_for(args.out):  # made before the loading, so that a bad --out fails at once
            return _inspect(args)
    except OSError as e:  # writing the pictures: a full disk, a folder gone
        raise CapsNetError(f"cannot write into --out {args.out}: {e.strerror or e}; free some space or choose "
                           "another --out") from None


def _inspect(args) -> int:
    B = backends.get(args.backend, device=args.device, dtype="float32")
    model, ckpt = ckpt_mod.load_model(args.checkpoint, B)
    if not model.routing_layers():
        raise CapsNetError(f"{ckpt['path']} holds a network without capsule routing (a CNN): inspect draws "
                           "routing; score it with pycapsnet evaluate")
    args.eval_only = True
    run = settle(args, ckpt)  # --dataset / --data-dir left out: the run's
    if model.input_shape != (1, 28, 28) and not run.data_dir:
        raise CapsNetError(f"this checkpoint expects {model.input_shape} images; give --data-dir")
    train, test = data.load(run.dataset, run.data_dir, **data_options(run))
    checked_data(run, train, test)
    if not 0 <= args.index < len(test):
        raise CapsNetError(f"--index must be in [0, {len(test) - 1}], got {args.index}")
    names = ckpt["header"].get("classes") or test.classes  # class names, by index
    capsule = getattr(args, "capsule", None)
    if capsule is not None and capsule >= model.n_classes:
        raise CapsNetError(f"--capsule must be a class index 0..{model.n_classes - 1}, got {capsule}")
    for p in draw(model, test, args.index, names, args.out, capsule, getattr(args, "perturb_range", 0.25),
                  f"test image {args.index}", where=f"the model in {ckpt['path']}"):
        print(p)
    if getattr(args, "coupling_grad", False):
        print(coupling_grads(model, test, args.index, args.out))
    with model.evaluating():  # a routing's own measures (Routing.measures), where it declares some
        model.forward(test.images(slice(args.index, args.index + 1)))
        for name, layer in model.routing_layers():
            for k, v in (layer.routing_measures() if hasattr(layer, "routing_measures") else {}).items():
                print(f"{name}: {k} per routing iteration: {', '.join(f'{x:.4g}' for x in v)}")
        model.release()
    return 0


def coupling_grads(model, split, index, out) -> str:
    """coupling_grad.npz: each routing layer's dL/dc_ij of every iteration for image ``index`` (its own
    loss, study.coupling(..., grad=True)); returns the path, after a line per layer of mean |dL/dc|."""
    x, y = split.images(slice(index, index + 1)), split.y[index:index + 1]
    grads = coupling.grads(model, x, y, 1)
    arrays = {f"{layer}/iteration_{r + 1}": g[0] for layer, gs in grads.items() for r, g in enumerate(gs)
              if g is not None}
    for layer, gs in grads.items():
        said = ", ".join("constant" if g is None else f"{np.abs(g).mean():.3g}" for g in gs)
        print(f"{layer}: mean |dL/dc_ij| per iteration: {said}")
    path = os.path.join(out, "coupling_grad.npz")
    files.atomic_write(path, lambda f: np.savez(f, **arrays))
    return path


def draw(model, split, index, names, out, capsule=None, reach=0.25, about="image", where="the model") -> list:
    """The pictures of image ``index`` of ``split`` into ``out`` (reconstructions of the split's first
    images, Figure 4, each routing layer's coupling, EM's activations); returns their paths.  The
    command line's ``inspect`` and ``study.inspect`` both draw with it."""
    B = model.B
    x, y = split.images(slice(index, index + 1)), int(split.y[index])
    with model.evaluating(), B.quiet_float_errors():  # no dropout, batch norm's running statistics
        out_ = model.forward(x)
        v = B.to_numpy(out_.v)                                   # (1, J, D)
        if not np.isfinite(v).all():
            raise CapsNetError(f"{where} gives class capsules that are not finite for {about}: there is nothing to "
                               "draw; inspect an earlier checkpoint")
        pred = int(out_.predictions[0])
        # every routing layer's coefficients, copied before the reconstructions' forward reuses the buffers
        routed = [(name, layer, [np.array(B.to_numpy(c)[0]) for c in coupling.coefficients(layer)])
                  for name, layer in model.routing_layers()]
        activations = [np.array(B.to_numpy(a)[0]) for a in getattr(routed[-1][1], "activations", [])]  # EM
    model.release()
    about = f"{about} (label {names[y]}, predicted {names[pred]})"
    written = [save_reconstructions(model, split, os.path.join(out, "reconstructions.png"))]
    if model.decoder is not None:  # the paper's Figure 4
        chosen = pred if capsule is None else capsule
        written.append(figure_4(model, v, chosen, reach, os.path.join(out, "perturbation.png"), about, names[chosen]))
    written += coupling_pictures(routed, out, about, names, pred, em=bool(activations))
    if activations:
        written.append(plots.activation_bars(activations, os.path.join(out, "activations.png"), names, y, pred,
                                             f"class activations a_j per EM iteration, {about}"))
    return written


def figure_4(model, v, capsule, reach, path, about, name):
    """Each dimension of class capsule ``capsule`` moved over [-reach, reach] in ten steps, decoded."""
    steps = np.round(np.linspace(-reach, reach, 11), 6)
    D, B = v.shape[-1], model.B
    tweaked = np.repeat(v, D * len(steps), axis=0)  # (D*S, J, D)
    for d in range(D):
        tweaked[d * len(steps):(d + 1) * len(steps), capsule, d] += steps
    decoded = B.to_numpy(model.decode(tweaked, np.full(len(tweaked), capsule)))
    decoded = decoded.reshape(D, len(steps), *decoded.shape[1:])
    return plots.perturbation_grid(decoded, steps, path, f"{about}: each of the {D} dimensions of capsule "
                                   f"{name} moved over [-{reach:g}, {reach:g}], then decoded")


def coupling_pictures(routed, out, about, names, pred, em=False) -> list:
    """coupling.png and .npz for the class layer (the last routing layer), coupling_<layer>.png and
    .npz for each other; returns the paths written."""
    written = []
    for k, (name, layer, couplings) in enumerate(routed):
        last = k == len(routed) - 1
        attention = isinstance(layer, AttentionCaps)  # its coupling coefficients carry the learned bias
        symbol = "R_ij" if em else "c_ij + β_ij" if attention else \
            {"vb": "R_ij", "inverted": "r_ij", "self": "r_ij"}.get(getattr(layer, "routing", None), "c_ij")
        stem = "coupling" if last else f"coupling_{name}"
        children = layer.in_flow
        if couplings[0].ndim == 3:  # a convolutional layer's (P, I, C): averaged over the window positions
            couplings = [c.mean(axis=0) for c in couplings]
            kk = int(round((couplings[0].shape[0] / children.types) ** 0.5))
            rows, grid, types = f"window slot i ({kk}x{kk} offsets x {children.types} types)", (1, 1), children.types
        else:
            rows, grid, types = None, children.grid or (1, 1), children.types
        kind = "EM assignments R_ij" if em else f"coupling coefficients {symbol}"
        what = (f"{kind} of the class layer" if em else kind) if last else \
            f"{kind} of layer '{name}'" + (" (mean over its positions)" if rows else "")
        written.append(plots.coupling_heatmaps(
            couplings, grid, types, os.path.join(out, f"{stem}.png"), pred if last and not rows else None,
            f"{what}, {about}", symbol=symbol, child="child capsule" if em else "input capsule", row_label=rows,
            columns=list(names) if last else None, parent="class capsule j" if last else f"capsule j of '{name}'"))
        arrays = {f"iteration_{r + 1}": c for r, c in enumerate(couplings)}
        path = os.path.join(out, f"{stem}.npz")
        files.atomic_write(path, lambda f: np.savez(f, **arrays))
        i, j = couplings[0].shape
        print(f"{path}: the {what} of {about.split(' (')[0]}, one array per routing iteration ({', '.join(arrays)}), each ({i}, {j}): "
              f"{i} {'child' if em else 'input'} capsules x {j} {'classes' if last else 'capsules'}")
    return written

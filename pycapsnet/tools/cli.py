"""``pycapsnet``: the study tools on the command line.

    pycapsnet gradcheck  [--backend numpy] [--dtype float64]         finite differences vs backward
    pycapsnet crosscheck --a numpy --b torch:cuda [--checkpoint C]   same batch on two backends
    pycapsnet inspect    CHECKPOINT --out DIR                        reconstructions, Figure 4, c_ij
    pycapsnet train      [--backend numpy] [training flags]          the trainer of the train_*.py scripts
    pycapsnet evaluate   CHECKPOINT [--backend torch --device cuda]  test accuracy of a checkpoint
    pycapsnet plan       --input-shape 3 224 224 --classes 276       will a train step fit? memory per layer
    pycapsnet experiment table1|affine|multimnist|routings [--quick] the paper's experiments, does routing help?
    pycapsnet data       mnist|fashion-mnist [DIR]                   fetch the full set, verified by digest
    pycapsnet check-routing NAME [--plugin MODULE]                   a routing checked three ways (your own too)

Every command takes --plugin MODULE: a module that registers routings of your own (pycapsnet.routings).

Exit codes: 0 success, 1 a check failed, 2 bad input or a damaged checkpoint (the message says
what and how to fix it), 3 the model's numbers are not finite (train, evaluate), 130 Ctrl-C.
"""
from __future__ import annotations

import argparse
import sys

from pycapsnet import backends
from pycapsnet.backends import NAMES
from pycapsnet.backends.base import FLOAT_DTYPES
from pycapsnet.backends.host import machine_memory

from . import gradcheck
from .crosscheck import crosscheck, is_em, lower_precision, EM_FLOAT32_TOLERANCE, TOLERANCE
from .inspect_run import inspect_run
from .plan import format_bytes, measured_peak, parse_memory, plan, SEARCH_CAP
from .plan_measured import measure_step, measured_batches, plan_network
from .predict import cmd_predict
from .tables import format_table
from .. import __version__, plugins
from ..core import architecture
from ..core.capsules import PrimaryCaps
from ..core.model import builtin_architecture, routing_names, CapsNetConfig
from ..errors import first_line, BackendError, CapsNetError
from ..experiments import add_parser as add_experiment
from ..study import check_routing
from ..training import data, download
from ..training.argtypes import name_and_factor, nonnegative_int, positive_float, positive_int, OneLineParser
from ..training.download import FETCHABLE
from ..training.flags import add_accept_changed_data, add_arguments, add_limit_test
from ..training.log import drop_stdout
from ..training.optim import NAMES as OPTIMIZERS
from ..training.recipe import refuse_ignored_flags, ARCHITECTURE
from ..training.trainer import run, sigterm_as_ctrl_c

def _backend(spec, dtype, device=None):
    return backends.get(spec, device=device, dtype=dtype)


# ---- gradcheck ---------------------------------------------------------------------------------
def cmd_gradcheck(args):
    B = _backend(args.backend, args.dtype)
    gradcheck.require_float64(B)  # before the table's header: a float32 run is refused in one line
    cols = {"layer": 40, "tensor": 22, "max abs err": 11, "rounding": 8, "max rel err": 11, "entries": 7, "kinks": 5,
            "result": 6}
    print(f"finite-difference checks on {B.label} ({args.samples} sampled entries per tensor, "
          f"fourth-order central differences)")
    print("  ".join(c.ljust(w) for c, w in cols.items()).rstrip())
    print("  ".join("-" * w for w in cols.values()), flush=True)

    def row(r):  # printed as each tensor is checked: the whole run takes minutes
        cells = [r.layer, r.tensor, f"{r.max_abs:.2e}", f"{r.rounding:.1e}", f"{r.max_rel:.2e}", r.n_checked, r.kinks,
                 "pass" if r.passed else "FAIL"]
        print("  ".join(str(v).ljust(w) for v, w in zip(cells, cols.values())).rstrip(), flush=True)

    if args.network:
        if args.routing:
            raise CapsNetError("--routing picks built-in networks to check; --network brings its own: give one or the other")
        results = gradcheck.run_network(B, args.network, samples=args.samples, tol=args.tol, seed=args.seed, report=row)
    else:
        results = gradcheck.run_all(B, samples=args.samples, tol=args.tol, seed=args.seed,  # refuses float32
                                    routing=args.routing, report=row)
    failed = [r for r in results if not r.passed]
    print(f"\n{len(results) - len(failed)} passed, {len(failed)} failed (tolerance {results[0].tol:g} relative, "
          f"counted beyond the differences' own rounding: pycapsnet/tools/gradcheck.py)")
    return 1 if failed else 0


# ---- crosscheck --------------------------------------------------------------------------------
def cmd_crosscheck(args):
    dtypes = args.dtype if args.dtype_b in (None, args.dtype) else f"{args.dtype} vs {args.dtype_b}"
    if args.checkpoint and args.routing:
        raise CapsNetError("--routing builds a seeded network; a --checkpoint brings its own: give one or the other")
    rows, models, about = crosscheck(args.a, args.b, args.dtype, args.checkpoint, args.batch, args.seed, args.perturb,
                              config={"routing": args.routing} if args.routing else None, dtype_b=args.dtype_b)
    low = lower_precision(args.dtype, args.dtype_b)
    tol = (args.rtol if args.rtol is not None else EM_FLOAT32_TOLERANCE
           if low == "float32" and is_em(models[0]) else TOLERANCE[low])
    src = args.checkpoint or f"seeded initialisation (seed {args.seed})"
    print(f"{models[0].B.label}  vs  {models[1].B.label}: {about}, weights from {src}")
    table = [{"tensor": r["tensor"], "kind": r["kind"], "max |a-b|": f"{r['max_abs']:.2e}",
              "max |a-b| / max |a|": f"{r['max_rel']:.2e}", "result": "agree" if r["max_rel"] <= tol else "DISAGREE"}
             for r in rows]
    print(format_table(table, ["tensor", "kind", "max |a-b|", "max |a-b| / max |a|", "result"]))
    bad = [r for r in rows if r["max_rel"] > tol]
    print(f"\n{len(rows) - len(bad)} agree, {len(bad)} disagree (tolerance {tol:g} of each tensor's scale, {dtypes})")
    return 1 if bad else 0


# ---- check-routing ---------------------------------------------------------------------------------
def cmd_check_routing(args):
    print(f"routing {args.name!r} checked three ways (float64): finite differences of its layers, numpy against "
          "torch, and its backward against PyTorch's autograd of its own forward", flush=True)
    report = check_routing(args.name, samples=args.samples, tol=args.tol, seed=args.seed)
    print(repr(report))
    return 0 if report.passed else 1


# ---- inspect -----------------------------------------------------------------------------------
def cmd_inspect(args):
    return inspect_run(args)


# ---- train / evaluate ----------------------------------------------------------------------------
def cmd_train(args):
    return run(args, args.backend)


def cmd_evaluate(args):
    args.resume, args.eval_only = args.checkpoint, True
    args.out, args.no_progress = None, False  # dtype and data left out: recipe.settle takes the run's
    return run(args, args.backend)


def _predict(args):
    return cmd_predict(args)


# ---- plan ---------------------------------------------------------------------------------------
def cmd_data(args):
    sigterm_as_ctrl_c()  # a kill ends as a Ctrl-C does: the download's temporary is removed
    folder = download.download(args.name, args.dir, progress=not args.quiet)
    print(f"{args.name}: its files are in {folder}"
          + ("" if args.dir else f"; --dataset {args.name} now finds them there"))
    return 0


def cmd_plan(args):
    budget = parse_memory(args.memory) if args.memory else machine_memory()
    p, shrink, measure = (_plan_described if args.network else _plan_builtin)(args)
    n = args.batch_size
    rows = [{"layer": layer.name, "parameters": f"{layer.params:,}", "kept per image": format_bytes(layer.kept / n),
             f"working memory at batch {n}": format_bytes(layer.work),
             "held whatever the batch": format_bytes(layer.state) if layer.state else ""}
            for layer in p.layers]
    print(format_table(rows, list(rows[0])))
    print(f"\nparameters: {p.n_params:,}")
    print(f"parameters, gradients, optimizer state and constants: {format_bytes(p.state)}")
    print(f"peak of the step at batch {n}: {format_bytes(p.peak)} (during {p.peak_at})")
    print(f"each further image adds: {format_bytes(p.per_image)}")
    if budget:
        most = p.largest_batch(budget)
        where = f"{args.memory}" if args.memory else f"{format_bytes(budget)} (this machine's memory; --memory to set)"
        print(f"largest batch within {where}: " + (
            f"{most:,} or more (the search stops there)" if most == SEARCH_CAP else f"{most:,}" if most else
            "none: not even one image fits" + (f"; {' and '.join(shrink)} shrink the step" if shrink else "")))
    if args.measure:
        measured = measure()
        print(f"measured (NumPy backend, tracemalloc): {format_bytes(measured)}, "
              f"plan/measured {p.peak / measured:.3f}")
    return 0


def _plan_builtin(args):
    """(plan, flags that would shrink the step, the measurement) of a built-in network."""
    routing = args.routing or "dynamic"
    given = {k: getattr(args, k) for k in ARCHITECTURE if k != "routing" and getattr(args, k, None) is not None}
    refuse_ignored_flags(given, routing)   # e.g. --share-spatial with --routing em: one line, as train says
    cfg = CapsNetConfig(input_shape=tuple(args.input_shape or (1, 28, 28)), n_classes=args.classes or 10,
                        routing=routing, **given)
    if routing not in ("dynamic", "em", "attention"):  # no ledger of their own: measured (plan_measured.py)
        return _plan_arch(builtin_architecture(cfg), f"CapsNet routed by {routing}", args)
    p = plan(cfg, args.batch_size, args.dtype, args.optimizer)
    c, h, w = cfg.input_shape
    how = "matrix capsules, EM routing" if cfg.routing == "em" else (
        f"{cfg.routing} routing{', share_spatial' if cfg.share_spatial else ''}, PrimaryCaps by {cfg.primary_conv}")
    print(f"a train step of CapsNet on {c}x{h}x{w} images, {cfg.n_classes} classes, {how}, "
          f"{args.dtype}, {args.optimizer}, batch {args.batch_size}")
    shrink = [] if cfg.routing == "em" else [f for f, on in (
        ("--share-spatial", cfg.share_spatial), ("--primary-conv im2col", cfg.primary_conv == "im2col")) if not on]
    return p, shrink, lambda: measured_peak(cfg, args.batch_size, args.dtype, args.optimizer)


def _plan_described(args):
    """(plan, [], the measurement) of a described network: its step run at small batches (plan_measured.py)."""
    flags = sorted("--" + k.replace("_", "-") for k in ARCHITECTURE if getattr(args, k, None) is not None)
    if flags:
        raise CapsNetError(f"{', '.join(flags)} set{'s' if len(flags) == 1 else ''} a built-in network; "
                           f"a described one has its layers in {args.network}: plan it without "
                           f"{'that flag' if len(flags) == 1 else 'those flags'}")
    arch = dict(architecture.load(args.network))
    arch["input_shape"] = tuple(args.input_shape or arch.get("input_shape") or (1, 28, 28))
    arch["n_classes"] = args.classes or arch.get("n_classes") or 10
    return _plan_arch(arch, args.network, args)


def _plan_arch(arch, what, args):
    """(plan, [], the measurement) of the network ``arch`` describes, measured at small batches."""
    c, h, w = arch["input_shape"]
    a, b = measured_batches()
    how = "measured" if args.batch_size <= b else f"measured at batches {a} and {b}, extrapolated"
    print(f"a train step of {what} on {c}x{h}x{w} images, {arch['n_classes']} classes, {args.dtype}, "
          f"{args.optimizer}, batch {args.batch_size} ({how} on the NumPy backend)", flush=True)
    p = plan_network(arch, args.batch_size, args.dtype, args.optimizer)
    return p, [], lambda: measure_step(arch, args.batch_size, args.dtype, args.optimizer)["peak"]


def _data_flags(p):
    """--dataset / --data-dir of the commands that read a checkpoint: left out, the run's own data
    (saved in the checkpoint), so that a model is scored on its own test split."""
    p.add_argument("--dataset", choices=data.DATASETS, help="default: the data the run trained on")
    p.add_argument("--data-dir", default=None, help="the data directory: IDX files or a folder of images "
                                                    "(default: the run's)")


def build_parser():
    """Every subcommand and its flags: a table of add_argument calls, long on purpose and read top
    to bottom."""
    p = OneLineParser(prog="pycapsnet", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)

    p.add_argument("--version", action="version", version=f"pycapsnet {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    specs = ", ".join(sorted({*NAMES, "torch:cuda"}))  # what --backend, --a and --b take

    g = sub.add_parser("gradcheck", help="finite-difference checks of every layer and the full loss")
    g.add_argument("--backend", default="numpy", help=f"{specs} (default: numpy)")
    g.add_argument("--dtype", default="float64", choices=FLOAT_DTYPES, metavar="float64",
                   help="float64 only: float32 rounding swamps finite differences, so it is refused")
    g.add_argument("--samples", type=positive_int, default=20, help="entries sampled per tensor (default: 20)")
    g.add_argument("--tol", type=positive_float, default=1e-6, help="max relative error (default: 1e-6)")
    g.add_argument("--seed", type=nonnegative_int, default=0)
    g.add_argument("--routing", choices=routing_names(), default=None,
                   help="only this routing's layers and networks (default: every layer, every network)")
    g.add_argument("--network", default=None, metavar="FILE.json",
                   help="check the network this description gives, or a built-in description (efficient, capsnet-published): "
                        "each of its layers, then its whole loss (input_shape and n_classes left null: "
                        "1x28x28 and 10)")
    g.set_defaults(fn=cmd_gradcheck)

    c = sub.add_parser("crosscheck", help="same weights and batch on two backends or devices")
    c.add_argument("--a", default="numpy", help=f"first side: {specs} (default: numpy)")
    c.add_argument("--b", default="torch", help="second side (default: torch)")
    c.add_argument("--checkpoint", default=None, help="weights from this checkpoint (default: seeded initialisation)")
    c.add_argument("--dtype", default="float64", choices=FLOAT_DTYPES)
    c.add_argument("--dtype-b", default=None, choices=FLOAT_DTYPES,
                   help="side b's dtype, if not --dtype: --dtype float64 --dtype-b float32 checks a float32 "
                        "backward against the float64 one (which gradcheck checks)")
    c.add_argument("--rtol", type=positive_float, default=None,
                   help="tolerance (default: 1e-9 float64, 1e-4 when a side is float32, 2e-3 for EM routing then)")
    c.add_argument("--routing", choices=routing_names(), default=None,
                   help="the seeded network of this routing (default: dynamic; a --checkpoint brings its own)")
    c.add_argument("--batch", type=positive_int, default=8)
    c.add_argument("--seed", type=nonnegative_int, default=0)
    c.add_argument("--perturb-grad", dest="perturb", metavar="NAME=FACTOR", type=name_and_factor, default=None,
                   help="multiply side b's gradient NAME by FACTOR, 1.01 if left out (shows that a "
                        "disagreement is caught)")
    c.set_defaults(fn=cmd_crosscheck)

    i = sub.add_parser("inspect", help="PNGs: reconstructions, capsule-dimension perturbations, coupling c_ij "
                                       "(EM: assignments R_ij and class activations per iteration)")
    i.add_argument("checkpoint")
    i.add_argument("--out", default="inspect", help="output directory (default: ./inspect)")
    i.add_argument("--index", type=nonnegative_int, default=0, help="which test image to perturb and route (default: 0)")
    i.add_argument("--capsule", type=nonnegative_int, default=None,
                   help="the class capsule whose dimensions Figure 4 moves (default: the predicted one)")
    i.add_argument("--range", type=positive_float, default=0.25, dest="perturb_range",
                   help="Figure 4 moves each dimension over [-R, R], in ten steps (default: 0.25, the paper's)")
    i.add_argument("--coupling-grad", action="store_true",
                   help="also dL/dc_ij of every routing iteration for the image (coupling_grad.npz; autograd of the "
                        "routing's own forward, needs PyTorch)")
    i.add_argument("--backend", default="numpy", choices=NAMES)
    i.add_argument("--device", default=None)
    _data_flags(i)
    add_accept_changed_data(i)
    i.set_defaults(fn=cmd_inspect)

    t = sub.add_parser("train", help="train (the same trainer as train_<backend>.py)")
    add_arguments(t, None)
    t.set_defaults(fn=cmd_train)

    e = sub.add_parser("evaluate", help="test accuracy of a checkpoint")
    e.add_argument("checkpoint")
    e.add_argument("--backend", default="numpy", choices=NAMES)
    e.add_argument("--device", default=None)
    _data_flags(e)
    e.add_argument("--dtype", choices=FLOAT_DTYPES, help="default: the dtype the run trained in")
    add_limit_test(e)
    add_accept_changed_data(e)
    e.set_defaults(fn=cmd_evaluate)

    pr = sub.add_parser("predict", help="the classes of image files, read as the run read its images")
    pr.add_argument("run", help="a run's directory (or its checkpoint.npz)")
    pr.add_argument("images", nargs="+", metavar="IMAGE_OR_DIR", help="image files, or directories searched for them")
    pr.add_argument("--top", type=int, default=1, help="the K best classes of each image (default: 1)")
    pr.add_argument("--json", action="store_true", help="a JSON object per line instead of tab-separated text")
    pr.add_argument("--backend", default="numpy", choices=NAMES)
    pr.add_argument("--device", default=None)
    pr.add_argument("--batch-size", type=positive_int, default=64, help="images per forward (default: 64)")
    pr.set_defaults(fn=_predict)


    pl = sub.add_parser("plan", help="will it fit? the memory of a train step, per layer, and the largest batch")
    pl.add_argument("--input-shape", type=positive_int, nargs=3, metavar=("C", "H", "W"), default=None,
                    help="image channels, height, width (default: a description's own, else 1 28 28)")
    pl.add_argument("--classes", type=positive_int, default=None,
                    help="number of classes (default: a description's own, else 10)")
    pl.add_argument("--routing", choices=routing_names(), default=None,
                    help="the built-in network to plan (default: dynamic)")
    pl.add_argument("--share-spatial", action="store_true", default=None,
                    help="one ClassCaps transform per capsule type (dynamic and attention routing)")
    pl.add_argument("--primary-conv", choices=PrimaryCaps.FULL_CONVS, default=None, help="default: fourier")
    routing_default = "(default: the routing's, as train's)"
    pl.add_argument("--routing-iters", type=positive_int, default=None, help=routing_default)
    pl.add_argument("--conv-channels", type=positive_int, default=None, help=routing_default)
    pl.add_argument("--conv-kernel", type=positive_int, default=None, help=routing_default)
    pl.add_argument("--conv-stride", type=positive_int, default=None, help=routing_default)
    pl.add_argument("--primary-types", type=positive_int, default=None, help=routing_default)
    pl.add_argument("--batch-size", type=positive_int, default=32, help="batch to plan (default: 32)")
    pl.add_argument("--dtype", choices=FLOAT_DTYPES, default="float32")
    pl.add_argument("--optimizer", choices=OPTIMIZERS, default="adam")
    pl.add_argument("--memory", default=None,
                    help="budget for the largest batch, e.g. 80GB or 512MB, in powers of 1024 (GB as GiB) "
                         "(default: this machine's memory)")
    pl.add_argument("--network", default=None, metavar="FILE.json",
                    help="a described network (a JSON file, or the name of one the package carries): its step "
                         "is run at two small batches on the NumPy backend and extrapolated")
    pl.add_argument("--measure", action="store_true",
                    help="also run the step on the NumPy backend and report its measured peak")
    pl.set_defaults(fn=cmd_plan)


    add_experiment(sub, specs)

    da = sub.add_parser("data", help="fetch MNIST, Fashion-MNIST or CIFAR-10 (binary) from their public addresses, "
                                     "verified by digest")
    da.add_argument("name", choices=tuple(FETCHABLE))
    da.add_argument("dir", nargs="?", default=None,
                    help="where to store the files (default: $PYCAPSNET_DATA/NAME, else ~/.cache/pycapsnet/NAME, "
                         "where --dataset NAME looks when no --data-dir is given)")
    da.add_argument("--quiet", action="store_true", help="no progress, only what was fetched")
    da.set_defaults(fn=cmd_data)

    cr = sub.add_parser("check-routing", help="a routing (your own: --plugin MODULE) checked three ways: finite "
                                              "differences, numpy against torch, its backward against autograd")
    cr.add_argument("name", help="a registered routing")
    cr.add_argument("--samples", type=positive_int, default=12, help="entries sampled per tensor (default: 12)")
    cr.add_argument("--tol", type=positive_float, default=1e-6, help="finite differences' tolerance (default: 1e-6)")
    cr.add_argument("--seed", type=nonnegative_int, default=0)
    cr.set_defaults(fn=cmd_check_routing)


    for parser in sub.choices.values():  # every command takes --plugin (train's has it from add_arguments)
        if not any(plugins.FLAG in action.option_strings for action in parser._actions):
            plugins.add_flag(parser)
    return p


def main(argv=None) -> int:
    try:  # before the parser is made: its --routing choices hold the routings the plugins register
        plugins.load_from_argv(argv)
    except CapsNetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):  # bare ``pycapsnet``: what it can do
        parser.print_help()
        return 0
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except (CapsNetError, BackendError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except MemoryError as e:  # train's and evaluate's are OutOfMemory (a CapsNetError) with their batch
        print(f"error: out of memory ({first_line(e)}): give a smaller --batch-size where the command takes one",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader stopped (``| head``): stop as a program killed by SIGPIPE would

        drop_stdout()
        return 141


if __name__ == "__main__":
    sys.exit(main())

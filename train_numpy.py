#!/usr/bin/env python
"""Train a CapsNet on the numpy backend.  `python train_numpy.py --help` lists the flags."""
import sys

from pycapsnet.training.trainer import main

if __name__ == "__main__":
    sys.exit(main("numpy"))

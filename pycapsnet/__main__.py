"""``python -m pycapsnet``: the ``pycapsnet`` command (pycapsnet/tools/cli.py)."""
import sys

from .tools.cli import main

sys.exit(main())

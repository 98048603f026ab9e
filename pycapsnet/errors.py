"""Errors pycapsnet raises for bad input.  Each message names the problem and the fix."""
from pycapsnet.backends.base import BackendError  # noqa: F401  (re-exported)


class CapsNetError(ValueError):
    """Bad input to a pycapsnet model, loss, dataset or checkpoint."""

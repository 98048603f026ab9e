"""Run the tutorials in docs/tutorials/ in a real Jupyter kernel, as a user runs them, and keep their
outputs in the files.

    python benchmarks/notebooks.py                   # every tutorial, full size, outputs written into it
    python benchmarks/notebooks.py --quick --check   # small size, nothing written (the test suite's run)

Each notebook runs in a fresh IPython kernel (nbclient; the kernel of this Python), its working
folder a temporary one, so that what a tutorial writes lands there; what its cells print, their
values and the figures they draw become their outputs, as Jupyter shows them.
PYCAPSNET_TUTORIAL_QUICK=1 (``--quick``) asks the tutorials for their small size.  A cell that
raises stops the run with the cell and the error: a tutorial that no longer runs fails the suite
(tests/test_study.py).
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TUTORIALS = os.path.join(ROOT, "docs", "tutorials")
CELL_TIMEOUT_S = 1800  # a full-size study cell takes minutes


def run_notebook(path: str, write: bool, cwd: str | None = None) -> None:
    """Run ``path`` in a fresh kernel whose working folder is ``cwd`` (a temporary one if None);
    with ``write``, its outputs are written back into the file."""
    import nbformat
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory() as tmp:
        # the kernel talks over local sockets (IPC), not TCP: nothing of it is reachable from elsewhere
        km = KernelManager(kernel_name="python3", transport="ipc", ip=os.path.join(tmp, "kernel"))
        client = NotebookClient(nb, km=km, timeout=CELL_TIMEOUT_S, resources={"metadata": {"path": cwd or tmp}})
        try:
            client.execute()
        except CellExecutionError as e:
            raise RuntimeError(f"{os.path.basename(path)} failed in a cell:\n{e}") from None
        finally:
            if km.has_kernel:  # (a kernel manager given to nbclient is the giver's to shut down)
                km.shutdown_kernel(now=True)
    if write:
        nbformat.write(nb, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("notebooks", nargs="*", help="default: every docs/tutorials/*.ipynb")
    p.add_argument("--quick", action="store_true", help="the tutorials' small size (PYCAPSNET_TUTORIAL_QUICK=1)")
    p.add_argument("--check", action="store_true", help="run them, write nothing")
    args = p.parse_args(argv)
    if args.quick:
        os.environ["PYCAPSNET_TUTORIAL_QUICK"] = "1"
    os.environ.setdefault("MPLBACKEND", "Agg")
    for path in args.notebooks or sorted(glob.glob(os.path.join(TUTORIALS, "*.ipynb"))):
        run_notebook(path, write=not args.check)
        print(f"{path}: ran{'' if args.check else ', outputs written'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Run the tutorials in docs/tutorials/ as a notebook would, and keep their outputs in the files.

    python benchmarks/notebooks.py                   # every tutorial, full size, outputs written into it
    python benchmarks/notebooks.py --quick --check   # small size, nothing written (the test suite's run)

Each notebook's code cells run in order in one namespace, in this process (no Jupyter kernel
needed): what a cell prints, its last expression's value and the figures it draws become its outputs,
as Jupyter shows them.  PYCAPSNET_TUTORIAL_QUICK=1 (``--quick``) asks the tutorials for their small
size.  A cell that raises stops the run with the cell's number and the error: a tutorial that no
longer runs fails the suite (tests/test_docs.py).
"""
from __future__ import annotations

import argparse
import ast
import base64
import contextlib
import glob
import io
import json
import os
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TUTORIALS = os.path.join(ROOT, "docs", "tutorials")


def _figures() -> list:
    """Every open matplotlib figure as PNG bytes, closed after."""
    if "matplotlib.pyplot" not in sys.modules:
        return []
    import matplotlib.pyplot as plt

    pngs = []
    for n in plt.get_fignums():
        buf = io.BytesIO()
        plt.figure(n).savefig(buf, format="png", dpi=80, bbox_inches="tight")
        pngs.append(buf.getvalue())
    plt.close("all")
    return pngs


def run_cell(source: str, namespace: dict, number: int) -> list:
    """A code cell run in ``namespace``: its outputs in the notebook format."""
    tree = ast.parse(source)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    out, value = io.StringIO(), None
    with contextlib.redirect_stdout(out):
        exec(compile(tree, f"<cell {number}>", "exec"), namespace)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), f"<cell {number}>", "eval"), namespace)
    outputs = []
    if out.getvalue():
        outputs.append({"output_type": "stream", "name": "stdout", "text": out.getvalue()})
    for png in _figures():
        outputs.append({"output_type": "display_data", "metadata": {},
                        "data": {"image/png": base64.b64encode(png).decode(), "text/plain": "<Figure>"}})
    if value is not None:
        outputs.append({"output_type": "execute_result", "execution_count": number, "metadata": {},
                        "data": {"text/plain": repr(value)}})
    return outputs


def run_notebook(path: str, write: bool) -> None:
    with open(path) as f:
        nb = json.load(f)
    namespace = {"__name__": "__main__"}
    number = 0
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        number += 1
        try:
            cell["outputs"] = run_cell("".join(cell["source"]), namespace, number)
        except Exception:  # noqa: BLE001 -- said with its cell, then the run fails
            raise RuntimeError(f"{os.path.basename(path)}, cell {number} failed:\n{traceback.format_exc()}") from None
        cell["execution_count"] = number
    if write:
        with open(path, "w") as f:
            json.dump(nb, f, indent=1, ensure_ascii=False)
            f.write("\n")


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

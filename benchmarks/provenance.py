"""Which code a benchmark measured: the git commit, whether the working tree was clean, and the
git tree id of the files as they were.

Every JSON a benchmark writes carries ``code_version()`` under "code", so that a figure can be
tied to the code that produced it.  "tree" is what ``git add -A && git write-tree`` would give
(computed in a scratch index; the checkout's own index is not touched): a copy of the working
tree whose ``.git`` lags behind its files (a GPU machine sent the files of a newer commit) still
names the code exactly, since ``git log --format='%H %T'`` finds the commit with that tree.
A copy without ``.git`` says which commit it is in the environment:
``PYCAPSNET_CODE_VERSION="<commit> clean"`` (or ``"<commit> dirty"``), set by whoever copied it;
the JSON then says the version came from there, not from git.
"""
from __future__ import annotations

import os
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _git(root, *args, env=None):
    try:
        out = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=60, env=env)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def _working_tree(root):
    """The git tree id of HEAD with every change and untracked, unignored file added, or None."""
    with tempfile.TemporaryDirectory() as scratch:
        env = dict(os.environ, GIT_INDEX_FILE=os.path.join(scratch, "index"))
        if _git(root, "read-tree", "HEAD", env=env) is None or _git(root, "add", "-A", env=env) is None:
            return None
        tree = _git(root, "write-tree", env=env)
    return tree.strip() if tree else None


def code_version(root: str = ROOT) -> dict:
    """{"commit", "clean", "tree", "source"}: commit None where neither git nor the environment says."""
    commit = _git(root, "rev-parse", "HEAD")
    if commit is not None:
        # tracked files changed or staged make the tree dirty; untracked files (results, logs) do not
        status = _git(root, "status", "--porcelain", "--untracked-files=no")
        return {"commit": commit.strip(), "clean": status == "", "tree": _working_tree(root), "source": "git"}
    stated = os.environ.get("PYCAPSNET_CODE_VERSION", "").split()
    if len(stated) == 2 and stated[1] in ("clean", "dirty"):
        return {"commit": stated[0], "clean": stated[1] == "clean", "tree": None, "source": "PYCAPSNET_CODE_VERSION"}
    return {"commit": None, "clean": None, "tree": None, "source": "unknown: no git history and no PYCAPSNET_CODE_VERSION"}

"""Which code a benchmark measured: the git commit and whether the working tree was clean.

Every JSON a benchmark writes carries ``code_version()`` under "code", so that a figure can be
tied to the code that produced it.  Read from git where the checkout has its history.  A copy of
the tree without ``.git`` (a GPU machine that is sent the working tree) says which commit it is
in the environment: ``PYCAPSNET_CODE_VERSION="<commit> clean"`` (or ``"<commit> dirty"``), set
by whoever copied it; the JSON then says the version came from there, not from git.
"""
from __future__ import annotations

import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _git(*args):
    try:
        out = subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def code_version() -> dict:
    """{"commit", "clean", "source"}: commit None where neither git nor the environment says."""
    commit = _git("rev-parse", "HEAD")
    if commit is not None:
        # tracked files changed or staged make the tree dirty; untracked files (results, logs) do not
        status = _git("status", "--porcelain", "--untracked-files=no")
        return {"commit": commit.strip(), "clean": status == "", "source": "git"}
    stated = os.environ.get("PYCAPSNET_CODE_VERSION", "").split()
    if len(stated) == 2 and stated[1] in ("clean", "dirty"):
        return {"commit": stated[0], "clean": stated[1] == "clean", "source": "PYCAPSNET_CODE_VERSION"}
    return {"commit": None, "clean": None, "source": "unknown: no git history and no PYCAPSNET_CODE_VERSION"}

"""Generated descriptions and checkpoint headers (tests/fuzz_worker.py), run under a memory limit
(RLIMIT_AS) and a time limit: each ends in success or one line with exit 2, never a traceback or a
blow-up.  The default is a few dozen cases; for a night, PYCAPSNET_FUZZ_CASES=5000 (and
PYCAPSNET_FUZZ_SEED to vary them)."""
import os
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MEMORY = 6 << 30  # bytes of address space the worker may map


def _limited():
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))


def test_generated_descriptions_and_headers_end_in_success_or_one_line(tmp_path):
    cases = int(os.environ.get("PYCAPSNET_FUZZ_CASES", "30"))
    seed = os.environ.get("PYCAPSNET_FUZZ_SEED", "20261127")
    # run in tmp_path: a generated path ("3", "false") is a file the worker may rightly write
    done = subprocess.run([sys.executable, "-m", "tests.fuzz_worker", seed, str(cases), str(tmp_path)],
                          cwd=str(tmp_path), env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])},
                          capture_output=True, text=True, preexec_fn=_limited, timeout=60 + 10 * cases)
    report = [line for line in done.stdout.splitlines() if line.startswith(("FAIL", "fuzz:"))]
    assert done.returncode == 0, "\n".join(report) + done.stderr[-3000:]
    assert report[-1].endswith("no failure") and "refused in one line" in report[-1]

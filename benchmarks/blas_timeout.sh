#!/usr/bin/env bash
# What OpenBLAS's idle-thread timeout costs the paper network's step, and whether importing NumPy
# before pycapsnet (a notebook's first line) still gets the short one (backends/__init__.py).
# Three ways, in alternating processes, ROUNDS rounds each (bench.py, no autograd reference):
#   spin       OPENBLAS_THREAD_TIMEOUT=28: OpenBLAS's own default, which a user's setting keeps
#   numpy1st   NumPy imported first, the variable unset: pycapsnet has OpenBLAS re-read it
#   short      OPENBLAS_THREAD_TIMEOUT=16 in the environment from the start
#     bash benchmarks/blas_timeout.sh [ROUNDS=5] [OUT=blas-timeout]
set -euo pipefail
rounds=${1:-5}; out=$(realpath -m "${2:-blas-timeout}")
cd "$(dirname "$0")/.."
site=$(mktemp -d); trap 'rm -rf "$site"' EXIT
# where NUMPY_FIRST is set, every process of the run (bench.py's workers too, which would inherit the
# variable pycapsnet sets) imports NumPy first, the variable unset
printf 'import os\nif os.environ.get("NUMPY_FIRST"):\n    os.environ.pop("OPENBLAS_THREAD_TIMEOUT", None)\n    import numpy\n' \
  > "$site/sitecustomize.py"
mkdir -p "$out"
for r in $(seq "$rounds"); do
  for way in spin numpy1st short; do
    case $way in
      spin) env=(OPENBLAS_THREAD_TIMEOUT=28);; numpy1st) env=(NUMPY_FIRST=1);; short) env=(OPENBLAS_THREAD_TIMEOUT=16);;
    esac
    env -u OPENBLAS_THREAD_TIMEOUT PYTHONPATH="$site:$PWD" "${env[@]}" python benchmarks/bench.py --no-reference \
      --backends numpy torch --rounds 1 --steps 10 --json "$out/$way-$r.json" > "$out/$way-$r.txt" 2>&1
  done
done
python - "$out" <<'PY'
import glob, json, statistics, sys
out = sys.argv[1]
step = lambda f, impl: next(r for r in json.load(open(f))["main"] if r["impl"] == impl)["train_step_s"]
for impl in ("numpy", "torch"):
    for way in ("spin", "numpy1st", "short"):
        s = [step(f, impl) for f in sorted(glob.glob(f"{out}/{way}-*.json"))]
        ratios = [step(f, impl) / step(f.replace(f"/{way}-", "/short-"), impl) for f in sorted(glob.glob(f"{out}/{way}-*.json"))]
        print(f"{impl:6s} {way:9s} step s {' '.join(f'{x:.3f}' for x in s)}  median {statistics.median(s):.3f}  "
              f"vs short, per round: median {statistics.median(ratios):.3f}")
PY

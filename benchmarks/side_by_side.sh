#!/usr/bin/env bash
# The paper network's step, this tree against another commit, measured side by side: bench.py (no
# autograd reference) in alternating processes, ROUNDS rounds each, JSONs in OUT; further arguments
# go to bench.py (another network: --routing em).
#   bash benchmarks/side_by_side.sh d4f17c0 [ROUNDS=3] [OUT=side-by-side] [BENCH FLAGS...]
set -euo pipefail
base=${1:?usage: side_by_side.sh COMMIT [ROUNDS] [OUT] [BENCH FLAGS...]}; rounds=${2:-3}; out=$(realpath -m "${3:-side-by-side}")
extra=("${@:4}")
here=$(git rev-parse --show-toplevel); other=$(mktemp -d)
trap 'git -C "$here" worktree remove --force "$other"' EXIT
git -C "$here" worktree add --detach "$other" "$base" >/dev/null
mkdir -p "$out"
for r in $(seq "$rounds"); do
  for side in base head; do
    root=$([ "$side" = base ] && echo "$other" || echo "$here")
    (cd "$root" && PYTHONPATH="$root" python benchmarks/bench.py --no-reference --backends numpy torch --rounds 1 \
      --steps 5 "${extra[@]}" --json "$out/$side-$r.json" > "$out/$side-$r.txt" 2>&1)
  done
done
python - "$out" "$base" <<'PY'
import glob, json, statistics, sys
out, base = sys.argv[1:]
for impl in ("numpy", "torch"):
    for side in ("base", "head"):
        runs = [r for f in sorted(glob.glob(f"{out}/{side}-*.json")) for r in json.load(open(f))["main"] if r["impl"] == impl]
        steps = [r["train_step_s"] for r in runs]
        if not steps:  # a backend left out by the flags (--backends torch)
            continue
        print(f"{impl:6s} {base if side == 'base' else 'this tree':10s} step s per round "
              f"{' '.join(f'{s:.3f}' for s in steps)}  median {statistics.median(steps):.3f}  "
              f"peak MB {max(r['peak_train_mem_mb'] for r in runs):.0f}")
PY

#!/usr/bin/env bash
# One device call's worth of GPU work, run side by side rather than in turn (gpu_check.sh runs its
# parts one after another, and a session is lent 15 minutes of device time in all):
#
#     bash benchmarks/gpu_session.sh OUTDIR          # about 9 minutes on an H100 or H200
#
#  checks         while the runs train ($CHECKS=0: not at all), the GPU tests (pytest -k "cupy or cuda"), float64 gradcheck of every
#                 layer and network on cupy and torch:cuda (and the efficient description), the four
#                 crosschecks of gpu_check.sh
#  sweep          the paper's network on full MNIST, one run per $SWEEP entry (LR:DECAY, default
#                 "1e-3:0.9 2e-3:0.9 1e-3:0.95 2e-3:0.95"; LR:DECAY:RECON also sets --recon-weight,
#                 e.g. 2e-3:0.95:0.01, its published code's weighting; $NETWORK=FILE.json or a name trains that
#                 description instead, e.g. capsnet-published, the network as the paper's
#                 published code builds it: docs/results/mnist-capsnet-published)
#                 at batch $BATCH (128), $EPOCHS (30) epochs
#                 or until $TRAIN_S (360) seconds after the start, whichever comes first; a run cut by
#                 the limit keeps its finished epochs (metrics.jsonl, best.npz). The learning rate,
#                 its decay and the epoch are chosen afterwards on the 5,001 validation digits only.
#  efficient      with $EFFICIENT=1, also Efficient-CapsNet beside them: its paper's recipe and augmentation
#                 (--network efficient --lr 5e-4 --lr-decay 0.97 --lr-min 5e-5 --batch-size 16 --augment efficient)
#  epoch 1 again  each run's first epoch from the same command, to say whether it reproduces on the GPU
#  bench          the step at batch 64 and 256, torch:cuda and cupy against eager autograd, on a
#                 GPU nothing else uses by then
#  records        benchmarks/record_run.py for each run, then OUTDIR.tar.gz without checkpoints
#
# `python` on PATH must have NumPy, CuPy, torch, array_api_compat and mlxtend (gpu_check.sh says how
# without internet).  $MNIST_DIR holds the four IDX files (default ../shared/data/mnist); $COMMIT names the code when
# the tree came without .git.  Every command has its own time limit; the exit code counts failures.
set -u
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_session.sh OUTDIR}
data=${MNIST_DIR:-../shared/data/mnist}
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
batch=${BATCH:-128}
epochs=${EPOCHS:-30}
train_s=${TRAIN_S:-360}
device=${DEVICE:-cuda}    # DEVICE=cpu RUN_FLAGS="--limit 256 --limit-test 128": a toy run, to catch a typo
sweep=${SWEEP:-1e-3:0.9 2e-3:0.9 1e-3:0.95 2e-3:0.95}
val=${VAL:-0.08333}  # VAL=0: no validation split, all 60,000 digits train (a setting chosen before)
mkdir -p "$out"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
start=$SECONDS
failed=0

job() {  # job NAME SECONDS COMMAND...: in the background, logged to $out/NAME.log, its exit in NAME.rc
    local name=$1 limit=$2
    shift 2
    echo "[$((SECONDS - start)) s] start $name: $*"
    ( timeout "$limit" "$@" >"$out/$name.log" 2>&1; echo $? >"$out/$name.rc" ) &
}
report() {  # report NAME TAIL: its exit and the last lines of its log
    local rc
    rc=$(cat "$out/$1.rc" 2>/dev/null || echo none)
    echo "=== $1: exit $rc"
    tail -n "$2" "$out/$1.log"
    [ "$rc" = 0 ] || failed=$((failed + 1))
}

python -c "import numpy, torch, array_api_compat, mlxtend$([ "$device" = cpu ] || echo ', cupy')" ||
    { echo "gpu_session.sh: the python on PATH lacks a package named above (see the header)"; exit 2; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python -c "import sys, numpy, cupy, torch; print('python', sys.version.split()[0], '| numpy', numpy.__version__,
'| cupy', cupy.__version__, '| torch', torch.__version__, '| CUDA', torch.version.cuda)" | tee -a "$out/gpu.txt"
lscpu | grep -m1 'Model name' | tee -a "$out/gpu.txt"
echo "code $commit" | tee -a "$out/gpu.txt"

flags="--dataset mnist --data-dir $data $([ "$val" = 0 ] || echo "--val-fraction $val") --batch-size $batch --no-progress --overwrite ${RUN_FLAGS:-}"
names=() runflags=()  # each run: its name, and the flags it adds to $flags
for cfg in $sweep; do  # LR:DECAY, or LR:DECAY:RECON with the reconstruction loss's weight (--recon-weight)
    IFS=: read -r lr decay recon <<<"$cfg"
    net=${NETWORK:+-$(basename "$NETWORK" .json)}
    names+=("lr$lr-d$decay${recon:+-r$recon}$net")
    runflags+=("--lr $lr --lr-decay $decay${recon:+ --recon-weight $recon}${NETWORK:+ --network $NETWORK}")
done
if [ "${EFFICIENT:-0}" = 1 ]; then  # Efficient-CapsNet, its paper's recipe and augmentation (a later flag wins)
    names+=(efficient); runflags+=("--network efficient --lr 5e-4 --lr-decay 0.97 --lr-min 5e-5 --batch-size 16 --augment efficient")
fi
for k in "${!names[@]}"; do
    job "mnist_${names[k]}" $((train_s - (SECONDS - start))) python train_torch.py --device $device $flags \
        ${runflags[k]} --epochs "$epochs" --out "$out/mnist-${names[k]}"
done
if [ "${CHECKS:-1}" = 1 ]; then  # CHECKS=0: the runs alone
    job tests_gpu $((train_s - 20)) python -m pytest -q -rs -k "cupy or cuda" tests
    job gradcheck_cupy $((train_s - 20)) python -m pycapsnet gradcheck --backend cupy --dtype float64
    job gradcheck_torch_cuda $((train_s - 20)) python -m pycapsnet gradcheck --backend torch:cuda --dtype float64
    job gradcheck_efficient $((train_s - 20)) bash -c "python -m pycapsnet gradcheck --backend cupy --dtype float64 --network efficient; r=\$?
        python -m pycapsnet gradcheck --backend torch:cuda --dtype float64 --network efficient && exit \$r"
    job crosscheck $((train_s - 20)) bash -c "set -e
        python -m pycapsnet crosscheck --a numpy --b cupy --dtype float32
        python -m pycapsnet crosscheck --a torch:cpu --b torch:cuda --dtype float32
        python -m pycapsnet crosscheck --a numpy --b cupy --dtype-b float32
        python -m pycapsnet crosscheck --a torch:cpu --b torch:cuda --dtype-b float32"
fi
wait
[ "${CHECKS:-1}" = 1 ] && for name in tests_gpu gradcheck_cupy gradcheck_torch_cuda gradcheck_efficient crosscheck; do report $name 6; done
for name in "${names[@]}"; do report "mnist_$name" 2; done

echo "[$((SECONDS - start)) s] epoch 1 again"
for k in "${!names[@]}"; do
    job "again_${names[k]}" 90 python train_torch.py --device $device $flags ${runflags[k]} --epochs 1 \
        --out "$out/again-${names[k]}"
done
wait
python - "$out" "${names[@]}" <<'EOF'
import json, pathlib, sys
out, keys = pathlib.Path(sys.argv[1]), ("train_loss", "train_acc", "val_acc", "test_acc")
for name in sys.argv[2:]:
    runs = [out / f"{kind}-{name}" / "metrics.jsonl" for kind in ("mnist", "again")]
    if not all(r.exists() for r in runs):
        print(f"{name}: epoch 1 again: missing run"); continue
    a, b = (json.loads(r.read_text().splitlines()[0]) for r in runs)
    same = all(a.get(k) == b.get(k) for k in keys)
    print(f"{name}: epoch 1 again {'identical' if same else 'DIFFERS'}:",
          {k: (a[k], b[k]) for k in keys})
    rows = [json.loads(l) for l in runs[0].read_text().splitlines()]
    if "val_acc" in rows[0]:
        best = max(rows, key=lambda r: r["val_acc"])    # chosen on validation; test read, not used
        print(f"    {len(rows)} epochs; best validation {100 * best['val_acc']:.2f}% at epoch {best['epoch']}")
EOF

echo "[$((SECONDS - start)) s] bench"
for b in 64 256; do
    (( SECONDS - start < 480 )) || { echo "bench_b$b: skipped, no time left"; continue; }
    job "bench_b$b" 70 python benchmarks/bench.py --backends torch:cuda cupy --ref-device cuda --reference eager \
        --batch-size "$b" --warmup 5 --steps 20 --rounds 1 --json "$out/bench_b$b.json"
    wait
    report "bench_b$b" 12
done

for k in "${!names[@]}"; do
    python benchmarks/record_run.py "$out/mnist-${names[k]}" "$out/record-${names[k]}" \
        --command "python train_torch.py --device $device $flags ${runflags[k]} --epochs $epochs --out OUT" \
        --data-dir "$data" --commit "$commit" --log "$out/mnist_${names[k]}.log" >/dev/null || failed=$((failed + 1))
done
tar czf "$out.tar.gz" --exclude='*.npz' -C "$(dirname "$out")" "$(basename "$out")"
echo "[$((SECONDS - start)) s] commands failed: $failed"
exit "$failed"

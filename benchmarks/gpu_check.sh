#!/usr/bin/env bash
# Everything this project checks on a CUDA GPU machine (on an H100: tests 1 min, gradcheck 5,
# crosscheck 2, bench 12, profile 1, train 1, cpu 6, cpuprofile 5; give a 10-minute slot one part or a few):
#
#     bash benchmarks/gpu_check.sh [OUTDIR [PART ...]]     # OUTDIR default: gpu-results; all parts
#
#  tests       every test parametrized over cupy / torch:cuda: im2col and col2im, the Fourier
#              convolution, forward and gradients against NumPy, the captured step against the
#              step op by op, the CLI's CPU-vs-GPU crosscheck, the training scripts on the GPU, and
#              every routing (each layer, dense and convolutional, and each small network against
#              NumPy in float64 and float32; each network's step recorded as a CUDA graph)
#  gradcheck   finite differences in float64 on both GPU backends (pycapsnet gradcheck)
#  crosscheck  NumPy vs CuPy and torch CPU vs CUDA on the paper architecture, float32, and each
#              GPU's float32 against the CPU's float64
#  bench       CuPy and torch:cuda (hand-written; each as a CUDA graph and op by op) against PyTorch
#              autograd on the same GPU, eager and under torch.compile, batch 64 and 256, each also
#              as a picture (the JSON is written after every phase: a stopped run keeps its rounds);
#              bench64 and bench256 run one batch size each (about 6 minutes each)
#  compiled    torch:cuda's step compiled (train --compile: torch.compile, then a CUDA graph) against
#              the plain one and autograd, eager and compiled, batch 64 and 256 (compiles first)
#  profile     where a step's time goes, op by op (benchmarks/profile_step.py)
#  train       two epochs per GPU backend on the embedded digits
#  cpu         the machine's host CPU: numpy and torch against autograd at batch 64, with
#              pycapsnet's default host threads and with one per core
#  cpuprofile  the host CPU step's profile (products and the rest, per layer) for 4, 8 and one
#              thread per core, and torch's with NumPy's products and routing (its choice on AMD
#              CPUs only; PYCAPSNET_TORCH_CPU_MATMUL=numpy)
#  mnist       the paper's network on full MNIST (the IDX files in $MNIST_DIR, default
#              ../shared/data/mnist), its recipe and a 5,001-digit validation split, $MNIST_EPOCHS
#              (30) epochs, then its record for docs/results (benchmarks/record_run.py) and epoch 1
#              again, to show that it reproduces
#  mnist_sweep the paper network's --lr and --lr-decay chosen on validation: $SWEEP_LRS (1e-3 2e-3 4e-3)
#              x $SWEEP_DECAYS (0.9 0.96), $SWEEP_EPOCHS (6) epochs each, then each one's best
#              validation accuracy (no test accuracy); pass the winner to mnist as $MNIST_LR, $MNIST_DECAY
#  efficient   the same for Efficient-CapsNet (--network efficient, its paper's recipe), $EFFICIENT_EPOCHS (30);
#              EFFICIENT_AUGMENT=efficient trains on its paper's augmentation (default: shift)
#  table1, affine, multimnist, routings   the experiments from full MNIST ($EXP_EPOCHS epochs, 5;
#              $EXP_SEEDS seeds, 3), results in OUTDIR/NAME; one cut by its time limit goes on from
#              its finished units (OUTDIR/NAME/units.json) when run again into the same OUTDIR
#  routings_full  the routing study under its fixed protocol at full scale (docs/experiments.md, "Does
#              routing help?"): all 60,000 training digits (a tenth held out, stratified, for every
#              choice), the 10,000 test digits read once, $STUDY_EPOCHS (10) epochs, $STUDY_SEEDS (5) seeds,
#              the record's rows and iteration sweep, on torch:$DEVICE; a call cut by its time limit goes
#              on from its finished units when run again into the same OUTDIR: give it as many calls as
#              it takes (each unit a few minutes); $STUDY_SHARD (K/N) splits it over machines (--merge)
#  routings_pairs the routing study's affine and MultiMNIST parts (--multimnist) on full MNIST, where
#              Sabour et al. claim what routing buys: rows $PAIRS_ROWS (uniform dynamic vb), each part
#              tuned on its own validation data, margin $STUDY_MARGIN (0.5), $STUDY_EPOCHS (10) epochs,
#              $STUDY_SEEDS (5) seeds, $STUDY_PAIRS (2) fresh pairs per digit per epoch; resumable by
#              calls and shards as routings_full
#  routings_cifar the routing study on CIFAR-10 (the binary files in $CIFAR_DIR, default data/cifar10:
#              the GPU machine reaches no registry, so a call carries them (run's carry=["data/cifar10"]) -- `python
#              benchmarks/cifar_subset.py SRC data/cifar10` writes a stratified 8,000 of the training
#              images and the 10,000 test images in the authors' format, 55 MiB, within what a call
#              carries), crop-flip and per-channel normalisation for every row, margin $STUDY_MARGIN
#              (0.5), $STUDY_EPOCHS (10) epochs, $STUDY_SEEDS (5) seeds, the default rows, on
#              $STUDY_BACKBONE (resnet20: SR-CapsNet's; capsnet: the CapsNet-style one); cut by its
#              time limit, it goes on from its finished units when run again into the same OUTDIR
#  The runs take $DEVICE (cuda) and extra flags in $RUN_FLAGS: DEVICE=cpu RUN_FLAGS="--limit 64
#  --limit-test 32" runs them at toy size on a CPU, to catch a typo before the GPU's minutes.
#
# `python` on PATH must be the interpreter that has NumPy, CuPy and torch (a machine's plain
# `python` may be another one: put the right one's bin/ first on PATH).  Each bench JSON records
# the code it measured (benchmarks/provenance.py); where the tree was copied without its .git, set
# PYCAPSNET_CODE_VERSION="<commit> clean".
# Without internet, install the wheels of array_api_compat and mlxtend first (pip install -e .
# fetches them where it can): pip install --no-deps --target /tmp/site WHEELS, and put /tmp/site
# on PYTHONPATH.
#
# Each command runs under its own time limit and the script goes on after a failure; the exit code
# is the number of commands that failed.  Logs and the benchmark's JSON go to OUTDIR.
set -u
cd "$(dirname "$0")/.."
out=${1:-gpu-results}
shift || true
parts=${*:-tests gradcheck crosscheck bench profile train cpu cpuprofile}
device=${DEVICE:-cuda}
data=${MNIST_DIR:-../shared/data/mnist}
commit=$(git rev-parse --short HEAD 2>/dev/null || echo "${PYCAPSNET_CODE_VERSION:-unknown}")
mkdir -p "$out"
failed=0
export PYTHONUNBUFFERED=1

want() { [[ " $parts " == *" $1 "* ]]; }

run() {  # run NAME SECONDS TAIL COMMAND...: log to $out/NAME.log, print its last TAIL lines
    local name=$1 limit=$2 tail=$3
    shift 3
    echo "=== $name: $*"
    local t0=$SECONDS
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    tail -n "$tail" "$out/$name.log"
    echo "=== $name: exit $rc after $((SECONDS - t0)) s"
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
python -c "import sys, numpy, cupy, torch; print('python', sys.version.split()[0], '| numpy', numpy.__version__,
'| cupy', cupy.__version__, '| torch', torch.__version__, '| CUDA', torch.version.cuda)"

if want tests; then
    run tests_gpu 300 8 python -m pytest -q -rs -n 0 -k "cupy or cuda" tests  # -n 0: one process, as measured on the H100
fi
if want gradcheck; then
    run gradcheck_cupy 300 12 python -m pycapsnet gradcheck --backend cupy --dtype float64
    run gradcheck_torch_cuda 300 12 python -m pycapsnet gradcheck --backend torch:cuda --dtype float64
fi
if want crosscheck; then
    run crosscheck_numpy_cupy 120 6 python -m pycapsnet crosscheck --a numpy --b cupy --dtype float32
    run crosscheck_torch_cpu_cuda 120 6 python -m pycapsnet crosscheck --a torch:cpu --b torch:cuda --dtype float32
    # the GPUs' float32 backward against the float64 one on the CPU, which gradcheck checks
    run crosscheck_cupy_f32_vs_numpy_f64 120 6 python -m pycapsnet crosscheck --a numpy --b cupy --dtype-b float32
    run crosscheck_cuda_f32_vs_cpu_f64 120 6 python -m pycapsnet crosscheck --a torch:cpu --b torch:cuda --dtype-b float32
fi
if want bench || want bench64; then
    run bench_b64 420 16 python benchmarks/bench.py --backends cupy cupy+eager torch:cuda torch:cuda+eager --ref-device cuda \
        --reference both --warmup 5 --steps 30 --rounds 2 --json "$out/bench_b64.json"
fi
if want bench || want bench256; then
    run bench_b256 420 16 python benchmarks/bench.py --backends cupy cupy+eager torch:cuda torch:cuda+eager --ref-device cuda \
        --reference both --batch-size 256 --warmup 5 --steps 20 --rounds 2 --json "$out/bench_b256.json"
fi
if want compiled; then
    for b in 64 256; do
        run "bench_compiled_b$b" 480 16 python benchmarks/bench.py --backends torch:cuda torch:cuda+compile cupy \
            --ref-device cuda --reference both --batch-size "$b" --warmup 5 --steps 20 --rounds 2 \
            --json "$out/bench_compiled_b$b.json"
    done
fi
if want bench || want bench64 || want bench256; then
    for b in b64 b256; do
        [ -f "$out/bench_$b.json" ] && run "plot_$b" 60 1 python benchmarks/plot_results.py "$out/bench_$b.json" \
            --out "$out/bench_$b.png"
    done
fi
if want profile; then
    run profile_cupy 60 10 python benchmarks/profile_step.py --backend cupy --steps 20
    run profile_torch_cuda 60 10 python benchmarks/profile_step.py --backend torch:cuda --steps 20
fi
if want train; then
    run train_torch_cuda 120 6 python train_torch.py --device cuda --epochs 2 --batch-size 64 \
        --out "$out/run_torch_cuda" --no-progress --overwrite
    run train_cupy 120 6 python train_cupy.py --epochs 2 --batch-size 64 --out "$out/run_cupy" --no-progress --overwrite
fi
if want cpu; then
    cores=$(nproc)
    run cpu_bench 300 8 python benchmarks/bench.py --backends numpy torch --rounds 2 --steps 8 --json "$out/cpu_b64.json"
    run cpu_bench_threads_$cores 300 8 python benchmarks/bench.py --backends numpy torch --rounds 2 --steps 8 \
        --threads "$cores" --json "$out/cpu_b64_threads_$cores.json"
fi
if want cpuprofile; then
    cores=$(nproc)
    for t in 4 8 "$cores"; do
        for b in numpy torch; do
            PYCAPSNET_THREADS=$t run "cpu_profile_${b}_threads_$t" 120 12 python benchmarks/profile_step.py --backend $b --steps 6
        done
    done
    for m in torch numpy; do
        PYCAPSNET_TORCH_CPU_MATMUL=$m run "cpu_profile_torch_products_$m" 120 12 python benchmarks/profile_step.py \
            --backend torch --steps 6
    done
fi
full_mnist() {  # full_mnist NAME EPOCHS FLAGS: a full-MNIST run, its record, and its epoch 1 again, compared
    local name=$1 epochs=$2
    local flags="--dataset mnist --data-dir $data --val-fraction 0.08333 --no-progress --overwrite $3 ${RUN_FLAGS:-}"
    run "mnist_$name" 420 4 python train_torch.py --device "$device" $flags --epochs "$epochs" --out "$out/mnist-$name"
    run "mnist_${name}_record" 30 4 python benchmarks/record_run.py "$out/mnist-$name" "$out/record-mnist-$name" \
        --command "python train_torch.py --device $device $flags --epochs $epochs --out OUT" \
        --data-dir "$data" --commit "$commit" --log "$out/mnist_$name.log"
    run "mnist_${name}_epoch1_again" 100 2 python train_torch.py --device "$device" $flags --epochs 1 \
        --out "$out/mnist-$name-e1"
    run "mnist_${name}_epoch1_same" 20 2 python -c "import json, sys; a, b = ([json.loads(open(f'$out/{d}/metrics.jsonl').readline())
for d in ('mnist-$name', 'mnist-$name-e1')]); keys = ('train_loss', 'train_acc', 'val_acc', 'test_acc');
print({k: (a[k], b[k]) for k in keys}); sys.exit(any(a[k] != b[k] for k in keys))"
}
mnist_sweep() {  # the paper network's learning rate and decay, chosen on the validation split only
    local flags="--dataset mnist --data-dir $data --val-fraction 0.08333 --no-progress --overwrite ${RUN_FLAGS:-}"
    for lr in ${SWEEP_LRS:-1e-3 2e-3 4e-3}; do
        for decay in ${SWEEP_DECAYS:-0.9 0.96}; do
            run "sweep_lr${lr}_decay$decay" 150 2 python train_torch.py --device "$device" $flags --lr "$lr" \
                --lr-decay "$decay" --epochs "${SWEEP_EPOCHS:-6}" --out "$out/sweep/lr$lr-decay$decay"
        done
    done
    # validation accuracy only: the test digits choose nothing
    run sweep_table 20 20 python -c "import json, pathlib
rows = [(max(json.loads(l)['val_acc'] for l in open(d / 'metrics.jsonl')), d.name)
        for d in sorted(pathlib.Path('$out/sweep').iterdir()) if (d / 'metrics.jsonl').exists()]
for acc, name in sorted(rows, reverse=True): print(f'{name}: best validation {100 * acc:.2f}%')"
}
want mnist_sweep && mnist_sweep
want mnist && full_mnist capsnet "${MNIST_EPOCHS:-30}" "${MNIST_LR:+--lr $MNIST_LR} ${MNIST_DECAY:+--lr-decay $MNIST_DECAY}"
# Efficient-CapsNet with its paper's recipe: Adam at 5e-4 decayed 0.97 an epoch, batch 16
want efficient && full_mnist efficient "${EFFICIENT_EPOCHS:-30}" "--network efficient --lr 5e-4 --lr-decay 0.97 --batch-size 16 --augment ${EFFICIENT_AUGMENT:-shift}"
for name in table1 affine multimnist routings; do
    if want $name; then
        backend=$([ "$device" = cpu ] && echo numpy || echo "torch:$device")
        run "experiment_$name" 560 14 python -m pycapsnet experiment $name --backend "$backend" --data-dir "$data" \
            --epochs "${EXP_EPOCHS:-5}" --seeds "${EXP_SEEDS:-3}" --out "$out/$name" ${EXP_FLAGS:-}
    fi
done
if want routings_full; then
    backend=$([ "$device" = cpu ] && echo numpy || echo "torch:$device")
    run routings_full 590 20 python -m pycapsnet experiment routings --backend "$backend" --dataset mnist \
        --data-dir "$data" --epochs "${STUDY_EPOCHS:-10}" --seeds "${STUDY_SEEDS:-5}" --no-affine \
        --routings uniform dynamic attention inverted self vb cnn --sweep 1 2 4 5 --sweep-seeds 2 \
        ${STUDY_SHARD:+--shard $STUDY_SHARD} --out "$out/routings_full" ${EXP_FLAGS:-}
fi
if want routings_pairs; then
    backend=$([ "$device" = cpu ] && echo numpy || echo "torch:$device")
    run routings_pairs 590 20 python -m pycapsnet experiment routings --backend "$backend" --dataset mnist \
        --data-dir "$data" --epochs "${STUDY_EPOCHS:-10}" --seeds "${STUDY_SEEDS:-5}" --multimnist \
        --pairs "${STUDY_PAIRS:-2}" --margin "${STUDY_MARGIN:-0.5}" --routings ${PAIRS_ROWS:-uniform dynamic vb} \
        ${STUDY_SHARD:+--shard $STUDY_SHARD} --out "$out/routings_pairs" ${EXP_FLAGS:-}
fi
if want routings_cifar; then
    backend=$([ "$device" = cpu ] && echo numpy || echo "torch:$device")
    run routings_cifar 590 20 python -m pycapsnet experiment routings --backend "$backend" --dataset cifar10 \
        --data-dir "${CIFAR_DIR:-data/cifar10}" --augment crop-flip --normalize --no-affine \
        --margin "${STUDY_MARGIN:-0.5}" --epochs "${STUDY_EPOCHS:-10}" --seeds "${STUDY_SEEDS:-5}" \
        --backbone "${STUDY_BACKBONE:-resnet20}" \
        ${STUDY_SHARD:+--shard $STUDY_SHARD} --out "$out/routings_cifar" ${EXP_FLAGS:-}
fi
echo "commands failed: $failed"
exit "$failed"

#!/usr/bin/env bash
set -u
cd /tmp/rec/code
export PYTHONPATH=/tmp/rec/code OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 PYCAPSNET_THREADS=1
FLAGS="--dataset mnist --data-dir /work/shared/data/mnist --limit 12000 --epochs 5 --seeds 15 --no-affine --routings uniform dynamic vb"
for k in 1 2; do
  python -m pycapsnet experiment routings $FLAGS --shard $k/2 --choices /tmp/conf/choices.json --out /tmp/conf/shard$k > /tmp/conf/main$k.log 2>&1 &
done
wait
python -m pycapsnet experiment routings --merge /tmp/conf/shard1 /tmp/conf/shard2 --out /tmp/conf/final > /tmp/conf/final.log 2>&1
echo finished > /tmp/conf/DONE

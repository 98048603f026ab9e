#!/usr/bin/env bash
# The routing study's record on full MNIST: 12,000 training digits (1,200 of them held out for validation),
# the 10,000 test digits, 5 epochs, 5 seeds; two shards, one thread each, in parallel (2 cores).
set -u
cd /work/main
FLAGS="--dataset mnist --data-dir ../shared/data/mnist --limit 12000 --epochs 5 --seeds 5 --no-affine \
 --routings uniform dynamic attention inverted self vb cnn --sweep 1 2 4 5 --sweep-seeds 2"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 PYCAPSNET_THREADS=1
for k in 1 2; do
  python -m pycapsnet experiment routings $FLAGS --shard $k/2 --out /tmp/rec/shard$k > /tmp/rec/tune$k.log 2>&1 &
done
wait
python -m pycapsnet experiment routings --merge /tmp/rec/shard1 /tmp/rec/shard2 --out /tmp/rec/merged > /tmp/rec/merge1.log 2>&1
for k in 1 2; do
  python -m pycapsnet experiment routings $FLAGS --shard $k/2 --choices /tmp/rec/merged/choices.json --out /tmp/rec/shard$k > /tmp/rec/main$k.log 2>&1 &
done
wait
python -m pycapsnet experiment routings --merge /tmp/rec/shard1 /tmp/rec/shard2 --out /tmp/rec/merged > /tmp/rec/merge2.log 2>&1
echo finished > /tmp/rec/DONE
#!/usr/bin/env bash
# Phase 2 of the record, run from the code the tuning ran (a worktree of 06a3922), so that every unit
# has the same code digest: wait for the tuning shards, merge, then the main and sweep units in two
# shards, one thread each, then the final merge.
set -u
cd /tmp/rec/code
export PYTHONPATH=/tmp/rec/code
while kill -0 17474 2>/dev/null || kill -0 17475 2>/dev/null; do sleep 10; done
FLAGS="--dataset mnist --data-dir /work/shared/data/mnist --limit 12000 --epochs 5 --seeds 5 --no-affine \
 --routings uniform dynamic attention inverted self vb cnn --sweep 1 2 4 5 --sweep-seeds 2"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 PYCAPSNET_THREADS=1
python -m pycapsnet experiment routings --merge /tmp/rec/shard1 /tmp/rec/shard2 --out /tmp/rec/merged > /tmp/rec/merge1.log 2>&1
for k in 1 2; do
  python -m pycapsnet experiment routings $FLAGS --shard $k/2 --choices /tmp/rec/merged/choices.json --out /tmp/rec/shard$k > /tmp/rec/main$k.log 2>&1 &
done
wait
python -m pycapsnet experiment routings --merge /tmp/rec/shard1 /tmp/rec/shard2 --out /tmp/rec/merged > /tmp/rec/merge2.log 2>&1
echo finished > /tmp/rec/DONE
# Phase 3: the machine restarted during shard 1's last unit (vb-5 seed 1); the same shard command, run
# again from /tmp/rec/code, reused its 39 finished units and trained that one; then the final merge.
cd /tmp/rec/code
python -m pycapsnet experiment routings $FLAGS --shard 1/2 --choices /tmp/rec/merged/choices.json --out /tmp/rec/shard1 > /tmp/rec/main1b.log 2>&1
python -m pycapsnet experiment routings --merge /tmp/rec/shard1 /tmp/rec/shard2 --out /tmp/rec/final > /tmp/rec/final.log 2>&1

#!/bin/bash
# interleaved A/B of libgomp's spin count for the whole server (default drafter threads)
cd /tmp/exp2
export PYTHONPATH=/tmp/exp2
OUT=/tmp/exp2/out; mkdir -p $OUT
for rep in 1 2; do
  for arm in default spin20k; do
    [ $rep = 2 ] && { [ $arm = default ] && arm=spin20k || arm=default; }
    top -bn1 | head -12 > $OUT/top-before-r$rep-$arm.txt
    if [ $arm = spin20k ]; then export GOMP_SPINCOUNT=20000; else unset GOMP_SPINCOUNT; fi
    .venv/bin/python -m benchmarks.bench_small_trees http --datasets mt-bench gsm8k sharegpt --prompts 4 \
      --max-tokens 64 --passes 2 --out $OUT/r$rep-$arm.json > $OUT/r$rep-$arm.log 2>&1
  done
done
unset GOMP_SPINCOUNT

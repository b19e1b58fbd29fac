#!/bin/bash
# interleaved A/B of --drafter-placement through HTTP (default server otherwise); 4 pairs, order alternating
cd /tmp/exp
export PYTHONPATH=/tmp/exp
OUT=/tmp/exp/out; mkdir -p $OUT
for rep in 1 2 3 4; do
  arms="verifier process"; [ $((rep % 2)) = 0 ] && arms="process verifier"
  for arm in $arms; do
    top -bn1 | head -12 > $OUT/top-before-r$rep-$arm.txt
    .venv/bin/python -m benchmarks.bench_small_trees http --datasets mt-bench gsm8k sharegpt --prompts 4 \
      --max-tokens 64 --passes 2 --out $OUT/r$rep-$arm.json --serve-args --drafter-placement $arm > $OUT/r$rep-$arm.log 2>&1
    top -bn1 | head -12 > $OUT/top-after-r$rep-$arm.txt
  done
done

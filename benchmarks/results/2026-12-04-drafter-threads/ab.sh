#!/bin/bash
# interleaved A/B of --drafter-threads through HTTP (default server otherwise)
cd /tmp/exp
export PYTHONPATH=/tmp/exp
OUT=/tmp/exp/out; mkdir -p $OUT
for rep in 1 2 3; do
  for th in 1 2; do
    [ $rep = 2 ] && th=$((3 - th))
    top -bn1 | head -15 > $OUT/top-before-r$rep-t$th.txt
    .venv/bin/python -m benchmarks.bench_small_trees http --datasets mt-bench gsm8k sharegpt --prompts 4 \
      --max-tokens 64 --passes 2 --out $OUT/r$rep-threads$th.json --serve-args --drafter-threads $th > $OUT/r$rep-threads$th.log 2>&1
    top -bn1 | head -15 > $OUT/top-after-r$rep-t$th.txt
  done
done

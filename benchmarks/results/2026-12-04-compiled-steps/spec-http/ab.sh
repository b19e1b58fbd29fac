#!/bin/bash
# default server (compiled steps) vs --no-compile, speculation vs ar through HTTP; interleaved A B B A A B
cd "$(dirname "$0")/../../../.."
OUT=benchmarks/results/2026-12-04-compiled-steps/spec-http
for arm in compiled eager eager compiled compiled eager; do
  n=$(ls $OUT/*-$arm.json 2>/dev/null | wc -l); rep=$((n + 1))
  extra=(); [ $arm = eager ] && extra=(--serve-args --no-compile)
  top -bn1 | head -12 > $OUT/top-before-r$rep-$arm.txt
  .venv/bin/python -m benchmarks.bench_small_trees http --datasets mt-bench gsm8k sharegpt --prompts 4 \
    --max-tokens 64 --passes 2 --out $OUT/r$rep-$arm.json "${extra[@]}" > $OUT/r$rep-$arm.log 2>&1
  top -bn1 | head -12 > $OUT/top-after-r$rep-$arm.txt
done

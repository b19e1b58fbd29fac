#!/bin/bash
# First starts of the default server with and without the verifier's restart after a cold compile,
# in the order without, with, with, without. Each run removes the cached weight choice, step cost
# model, calibration and inductor's compiled kernels first (the converted target and q4 packs stay).
cd "$(dirname "$0")/../../.."
OUT=benchmarks/results/2026-12-05-first-start-restart
i=0
for arm in without with with without; do
  i=$((i+1))
  rm -rf ~/.cache/dartree/{weights_choice.json,cost_model.json,calibration.json,inductor}
  if [ $arm = without ]; then export DARTREE_RESTART_AFTER_COMPILE=false; else unset DARTREE_RESTART_AFTER_COMPILE; fi
  top -bn2 -d0.5 | grep Cpu | tail -1 > $OUT/top-$i-$arm.txt
  timeout 400 .venv/bin/python benchmarks/results/2026-12-03-first-start/measure.py --label first-start-$arm \
      --out $OUT/first-$i-$arm.json > $OUT/first-$i-$arm.log 2>&1
done

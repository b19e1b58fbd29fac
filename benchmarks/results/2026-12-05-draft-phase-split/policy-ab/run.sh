#!/bin/bash
# A/B of the goodput policy: old = f5c377d (before the nearest-shift and per-node draft price), new = HEAD
# OLD: a worktree of f5c377d (git worktree add $OLD f5c377d); run from the repository root
for i in 1 2 3 4 5 6; do
  for arm in old new; do
    dir=/work/main; [ $arm = old ] && dir=$OLD
    top -bn2 -d0.5 | grep Cpu | tail -1 > benchmarks/results/2026-12-05-draft-phase-split/policy-ab/top-$arm-$i.txt
    (cd $dir && /work/main/.venv/bin/python -m benchmarks.bench_small_trees e2e --weights q4 --datasets gsm8k \
      --prompts 6 --max-tokens 64 --settings 3/4 --repeats 2 --threads 2 --compile --out benchmarks/results/2026-12-05-draft-phase-split/policy-ab/e2e-$arm-$i.json \
      > benchmarks/results/2026-12-05-draft-phase-split/policy-ab/e2e-$arm-$i.log 2>&1)
  done
done
echo done > benchmarks/results/2026-12-05-draft-phase-split/policy-ab/done

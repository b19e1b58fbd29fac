#!/bin/bash
# the default server through HTTP, before (OLD_ROOT: a checkout of the parent of the bookkeeping
# commit, `git worktree add OLD_ROOT 5ae058d`) and after it; old new new old
cd "$(dirname "$0")/../../../.."
OUT=benchmarks/results/2026-12-04-step-bookkeeping/spec-http
OLD_ROOT=${OLD_ROOT:-/tmp/s2/old}
rep=0
for arm in old new new old; do
  rep=$((rep + 1))
  extra=(); [ $arm = old ] && extra=(--server-root "$OLD_ROOT")
  top -bn1 | head -12 > $OUT/top-before-ab$rep-$arm.txt
  .venv/bin/python -m benchmarks.bench_small_trees http --datasets mt-bench gsm8k sharegpt --prompts 4 \
    --max-tokens 64 --passes 2 --out $OUT/ab$rep-$arm.json "${extra[@]}" > $OUT/ab$rep-$arm.log 2>&1
  top -bn1 | head -12 > $OUT/top-after-ab$rep-$arm.txt
done

#!/usr/bin/env bash
# Issue 14 item 2: drafters TRAINED at each draft vocabulary size on the same budget.
# Each size warm-starts from the same full-vocabulary export (--init-from; a reduced size keeps the
# logits of its ids, so all start at the same tau), then trains STEPS steps on the same shards, seed,
# lr / lambda schedule and thread count; the final held-out replayed tau (B = 8 and 64) is in
# <work>/<size>/eval.jsonl. Resumable: a size whose export exists is skipped; a killed run resumes.
#   STEPS=600 bash benchmarks/vocab_trained_compare.sh [work-dir] [sizes...]
set -euo pipefail
STEPS=${STEPS:-600}
INIT=${INIT:-models/smollm2-135m-dartree-drafter}
WORK=${1:-data/vocab_cmp}
shift || true
SIZES=${*:-8192 16384 0}
PY=${PY:-.venv/bin/python}
mkdir -p "$WORK"
for n in $SIZES; do
  d="$WORK/$n"
  if [ -f "$d/export/config.json" ] && grep -q '"final": true' "$d/export/config.json"; then
    echo "[vocab-cmp] size $n done"; continue
  fi
  mkdir -p "$d"
  # the held-out greedy references are the same for every size: reuse a cached copy
  [ -f data/train/heldout_turns.pt ] && [ ! -f "$d/heldout_turns.pt" ] && cp data/train/heldout_turns.pt "$d/"
  echo "[vocab-cmp] size $n: $STEPS steps from $INIT"
  "$PY" -m services.cli train-drafter --resume --init-from "$INIT" --work-dir "$d" --out "$d/export" \
    --draft-vocab "$n" --lr 5e-4 --warmup 50 --schedule-steps "$STEPS" --max-steps "$STEPS" \
    --lambda-start 0.5 --lambda-end 0.2 --eval-every 0 --threads 1 --seed 0
done
for n in $SIZES; do
  echo "size $n: $(tail -1 "$WORK/$n/eval.jsonl")"
done

#!/usr/bin/env bash
# Drafters TRAINED at each draft vocabulary size on the same budget.
# Each size warm-starts from the same full-vocabulary export (--init-from; a reduced size keeps the
# logits of its ids, so all start at the same tau), then trains STEPS steps on the same shards, seed,
# lr / lambda schedule and thread count; the final held-out replayed tau (B = 8 and 64) is the last
# line of <work>/<size>/eval.jsonl.
# The shard list (symlinks in <work>/feats) and the token counts (<work>/vocab_counts.pt) are pinned
# by the first run of a work dir, so later sizes see the same data even while featurize adds shards.
# Resumable: a size counts as done when its eval.jsonl ends with a step-STEPS evaluation after a final
# export of STEPS steps; an unfinished size resumes from its ckpt.pt.
#   STEPS=600 bash benchmarks/vocab_trained_compare.sh [work-dir] [sizes...]   (sizes: 0 = full)
set -euo pipefail
STEPS=${STEPS:-600}
INIT=${INIT:-models/smollm2-135m-dartree-drafter}
FEATS=${FEATS:-data/feats}
COUNTS=${COUNTS:-data/vocab_counts.pt}
WORK=${1:-data/vocab_cmp}
shift || true
SIZES=${*:-8192 16384 0}
PY=${PY:-.venv/bin/python}
mkdir -p "$WORK"
if [ ! -d "$WORK/feats" ]; then  # pin the training shards (and the held-out shard) of this comparison
  mkdir -p "$WORK/feats.tmp"
  for f in "$FEATS"/*.pt; do ln -s "$(realpath "$f")" "$WORK/feats.tmp/$(basename "$f")"; done
  mv "$WORK/feats.tmp" "$WORK/feats"
fi
[ -f "$WORK/vocab_counts.pt" ] || cp "$COUNTS" "$WORK/vocab_counts.pt"
done_size() {  # 0 when <work>/<size> holds a finished STEPS-step run and its final evaluation
  "$PY" - "$1" "$STEPS" <<'PYEOF'
import json, sys
from pathlib import Path
d, steps = Path(sys.argv[1]), int(sys.argv[2])
try:
    t = json.loads((d / "export" / "config.json").read_text()).get("training", {})
    last = json.loads((d / "eval.jsonl").read_text().strip().splitlines()[-1])
except (OSError, ValueError, IndexError):
    sys.exit(1)
sys.exit(0 if t.get("final") is True and t.get("steps") == steps and last.get("step") == steps else 1)
PYEOF
}
for n in $SIZES; do
  d="$WORK/$n"
  if done_size "$d"; then echo "[vocab-cmp] size $n done"; continue; fi
  mkdir -p "$d"
  # the held-out greedy references are the same for every size: reuse a cached copy
  if [ -f data/train/heldout_turns.pt ] && [ ! -f "$d/heldout_turns.pt" ]; then cp data/train/heldout_turns.pt "$d/"; fi
  echo "[vocab-cmp] size $n: $STEPS steps from $INIT"
  "$PY" -m services.cli train-drafter --resume --init-from "$INIT" --work-dir "$d" --out "$d/export" \
    --feat-dir "$WORK/feats" --vocab-counts "$WORK/vocab_counts.pt" \
    --draft-vocab "$n" --lr 5e-4 --warmup 50 --schedule-steps "$STEPS" --max-steps "$STEPS" \
    --lambda-start 0.5 --lambda-end 0.2 --eval-every 0 --threads 1 --seed 0
done
for n in $SIZES; do
  echo "size $n: $(tail -1 "$WORK/$n/eval.jsonl")"
done

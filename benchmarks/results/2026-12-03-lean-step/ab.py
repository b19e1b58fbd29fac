"""Interleaved A/B of the runner's lean Llama step against the HF modules' step, in one process.

Decodes a chat prompt (optionally padded to ``--context`` tokens) with greedy ``ar`` steps through
the runner, alternating blocks of ``--steps`` steps with the lean step and with the modules, for
``--rounds`` rounds; each block continues its own request (two slots). Checks that both arms'
logits are bitwise equal at every step, and prints per-block medians and the median of the paired
per-round ratios as one JSON line.

    python benchmarks/results/2026-12-03-lean-step/ab.py --threads 2 [--context 2000]
"""
import argparse, json, os, statistics, time
import torch
from services.generate import build_inprocess, encode
from services.tree.batch import causal_segment
from services.weights import compute_dtype

ap = argparse.ArgumentParser()
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--context", type=int, default=0)
ap.add_argument("--steps", type=int, default=24)
ap.add_argument("--rounds", type=int, default=6)
ap.add_argument("--weights", default="q4")
a = ap.parse_args()
torch.set_num_threads(a.threads)
engine, tok, _ = build_inprocess(None, None, compute_dtype(a.weights), weights=a.weights)
runner = engine.runner
lean = runner.lean
assert lean is not None, "the lean step is off (DARTREE_LEAN_STEP=0?)"
text = "Explain, step by step, how a hash table handles collisions."
filler = ("A hash table stores keys in buckets chosen by a hash function; two keys may land in the "
          "same bucket, and the table must then keep both and find each again. ")
while a.context and len(tok(text)["input_ids"]) < a.context:
    text = filler + text
ids = encode(tok, text, chat=True)
state = {}
for arm in ("lean", "modules"):
    runner.lean = lean if arm == "lean" else None
    slot = runner.cache.alloc()
    for c in range(0, len(ids), 256):
        out = runner.execute([causal_segment(ids[c:c + 256], c, slot)], torch.tensor([len(ids[c:c + 256]) - 1]))
        runner.cache.extend(slot, len(ids[c:c + 256]))
    state[arm] = [slot, int(out.logits[-1].argmax()), len(ids), []]
medians = {"lean": [], "modules": []}
load0 = os.getloadavg()[0]
with torch.inference_mode():
    for r in range(a.rounds):
        for arm in (("lean", "modules") if r % 2 == 0 else ("modules", "lean")):
            runner.lean = lean if arm == "lean" else None
            slot, t, pos, logs = state[arm]
            times = []
            for _ in range(a.steps):
                t0 = time.perf_counter()
                out = runner.execute([causal_segment([t], pos, slot)])
                times.append(time.perf_counter() - t0)
                runner.cache.extend(slot, 1)
                logs.append(out.logits[-1])
                t, pos = int(out.logits[-1].argmax()), pos + 1
            state[arm][1:3] = [t, pos]
            medians[arm].append(1000 * statistics.median(times))
n = min(len(state["lean"][3]), len(state["modules"][3]))
equal = all(torch.equal(x, y) for x, y in zip(state["lean"][3][:n], state["modules"][3][:n]))
ratios = [m / l for l, m in zip(medians["lean"], medians["modules"])]
rec = {"weights": a.weights, "threads": a.threads, "prompt_tokens": len(ids), "steps_per_block": a.steps,
       "lean_ms": [round(x, 2) for x in medians["lean"]], "modules_ms": [round(x, 2) for x in medians["modules"]],
       "lean_median_ms": round(statistics.median(medians["lean"]), 2),
       "modules_median_ms": round(statistics.median(medians["modules"]), 2),
       "modules_over_lean_paired_median": round(statistics.median(ratios), 3), "logits_bitwise_equal": equal,
       "load_before": round(load0, 2), "load_after": round(os.getloadavg()[0], 2), "torch": torch.__version__,
       "date": time.strftime("%Y-%m-%d %H:%M")}
print(json.dumps(rec))

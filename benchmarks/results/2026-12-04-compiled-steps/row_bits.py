"""Are a verify's root-row logits bitwise the logits plain decoding computes at the same position?

For 4 GSM8K + 4 ShareGPT prompts (64 tokens each, T = 0, SmolLM2-135M q4), the in-process engine
runs ``ar`` and ``dartree-pruned`` at fixed budgets 1, 2, 3, 4, 8; every step's logits of the row at
its first position (``ar``: the step's only row; a verify: the root) are recorded by position, and
each verify root is compared with ``ar``'s row at that position, up to the first token where the two
answers part. ``THREADS``: torch threads; ``c``: compiled steps, ``e``: eager.

    python benchmarks/results/2026-12-04-compiled-steps/row_bits.py THREADS {c,e}

Prints per budget ``[rows compared, bitwise equal]``.
"""
import sys, torch, time
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
torch.set_num_threads(int(sys.argv[1]))
from services.generate import build_inprocess
from services.weights import compute_dtype
from services.params import SamplingParams, SpecParams
engine, tok, _ = build_inprocess(None, None, compute_dtype("q4"), weights="q4", compile=sys.argv[2] == "c")
run = engine.runner
inner = run._lean_call if run.compiled else run.lean
rec = {}; mode = {"m": None}
def wrapped(ids_, pos, keep):
    out = inner(ids_, pos, keep)
    if keep.numel() and int(keep[0]) == 0 and ids_.shape[1] <= 32:
        rec.setdefault((mode["m"], int(pos[0, 0])), out[0, 0].clone())
    return out
if run.compiled: run._lean_call = wrapped
else: run.lean = type("L", (), {"compiled": False, "__call__": lambda self, *a: wrapped(*a)})()
def toks(ids, method, budget=None):
    return [t for o in engine.generate(f"r{method}{budget}{time.time()}", ids, SamplingParams(max_tokens=64, ignore_eos=True), SpecParams(method, budget=budget)) for t in o.token_ids]
from benchmarks.bench_small_trees import _prompts
from services.models.registry import resolve_target
ps = [ids for _, ids in _prompts(resolve_target(None), ["gsm8k", "sharegpt"], 4)]
cmp = same = 0
per = {}
for i, p in enumerate(ps):
    text = p
    rec.clear()
    mode["m"] = "ar"; a = toks(text, "ar")
    for b in (1, 2, 3, 4, 8):
        mode["m"] = f"s{b}"; s = toks(text, "dartree-pruned", b)
        n = next((j for j, (x, y) in enumerate(zip(a, s)) if x != y), len(a))
        for (m, pos), v in rec.items():
            if m == f"s{b}" and ("ar", pos) in rec and pos < n + len(text):
                eq = torch.equal(rec[("ar", pos)], v); cmp += 1; same += eq; per.setdefault(b, [0, 0]); per[b][0] += 1; per[b][1] += eq
        print(i, b, "tokens equal", a == s, flush=True)
print(sys.argv, "row0 compared", cmp, "bitwise equal", same, per)

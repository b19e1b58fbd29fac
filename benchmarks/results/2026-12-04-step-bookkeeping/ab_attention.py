"""In-process A/B of the slot attention's body, interleaved in one process (same machine state).

    python benchmarks/results/2026-12-04-step-bookkeeping/ab_attention.py 8

``old``: the body before the change (all segments' K/V written by ``SlotKVCache.write_block``, then
each slot read by ``read_slot``, both since removed and inlined here, and attended by
``grouped_attention`` with its argument checks); ``new``: the shipped
``services.verifier.runner._slot_attention_eager`` (one ``write_read`` and one ``attend`` per
request). The compiled step's opaque op calls the body through the module global, so swapping it
swaps what every layer runs. Plain decoding, 128 tokens a run, the arms alternating (ABBA ...), then
64 tokens with each to check that they emit the same tokens.
"""
import statistics, sys, torch
import torch.nn.functional as F
torch.set_num_threads(2)
from benchmarks.bench_step import engine_stats, PROMPT
from services.generate import build_inprocess, encode
from services.weights import compute_dtype
from services import hf_compat
import services.verifier.runner as R
from services.verifier.attention import grouped_attention

def old_eager(layer, query, key, value, attention_mask, module=None, **kwargs):
    step = getattr(R._ACTIVE, "step", None)
    if step is None:
        return hf_compat.sdpa_attention(module, query, key, value, attention_mask, **kwargs)
    cache, p, parts, fixed = step
    scale = kwargs.get("scaling")
    for a, b, slot, start, length, _, _ in parts:  # the removed SlotKVCache.write_block
        cache.keys[layer][slot, :, start:start + b - a] = key[0, :, a:b]
        cache.values[layer][slot, :, start:start + b - a] = value[0, :, a:b]
    outs = []
    for a, b, slot, _, length, mask, bias in parts:  # the removed SlotKVCache.read_slot
        k, v = cache.keys[layer][slot:slot + 1, :, :length], cache.values[layer][slot:slot + 1, :, :length]
        if bias is not None:
            outs.append(grouped_attention(query[:, :, a:b], k, v, bias, scale if scale is not None else k.shape[-1] ** -0.5))
            continue
        outs.append(F.scaled_dot_product_attention(query[:, :, a:b], k, v, attn_mask=mask, scale=scale,
                                                   enable_gqa=k.shape[1] != query.shape[1]))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2), None

new_eager = R._slot_attention_eager
engine, tok, _ = build_inprocess(None, None, compute_dtype("q4"), weights="q4", compile=None)
ids = encode(tok, PROMPT, chat=True)
engine_stats(engine, ids, 16, "ar")
res = {"old": [], "new": []}
toks = {}
for rep in range(int(sys.argv[1]) if len(sys.argv) > 1 else 6):
    for name, fn in (("old", old_eager), ("new", new_eager)) if rep % 2 == 0 else (("new", new_eager), ("old", old_eager)):
        R._slot_attention_eager = fn
        r = engine_stats(engine, ids, 128, "ar")
        res[name].append((r["ms_per_token"], r["forward_ms"][1]))
        print(name, round(r["ms_per_token"], 3), round(r["forward_ms"][1], 3), flush=True)
for name, v in res.items():
    print(name, "median ms/token", round(statistics.median(x for x, _ in v), 3), "median forward", round(statistics.median(f for _, f in v), 3))
from services.params import SamplingParams, SpecParams
def tokens(fn, rid):
    R._slot_attention_eager = fn
    engine.add_request(rid, ids, SamplingParams(max_tokens=64, ignore_eos=True), SpecParams("ar"))
    out = []
    while True:
        o = engine.step_batch([rid])[rid]
        if o is None: continue
        out += o.token_ids
        if o.finish_reason: return out
print("same tokens old/new:", tokens(old_eager, "t-old") == tokens(new_eager, "t-new"))
R._slot_attention_eager = new_eager

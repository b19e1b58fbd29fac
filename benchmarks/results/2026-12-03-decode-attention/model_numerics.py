"""q4 SmolLM2-135M through the runner, grouped attention vs SDPA: logits and greedy tokens.

Prefills a ~``--context``-token prompt with each attention path and decodes ``--tokens`` greedy
``ar`` tokens; prints the max |logit diff| of the prompt's last row, the first divergent token (if
any) and, as the last line, one JSON object.

    python benchmarks/results/2026-12-03-decode-attention/model_numerics.py --context 600 --tokens 64
"""

from __future__ import annotations

import argparse
import json

import torch

from services.generate import build_inprocess
from services.tree.batch import causal_segment
from services.verifier import attention as A
from services.params import SamplingParams, SpecParams

TEXT = ("A hash table stores keys in buckets chosen by a hash function; when two keys land in the same "
        "bucket the table resolves the collision by chaining or by open addressing. ")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    torch.set_num_threads(2)
    engine, tok, _ = build_inprocess(None, None, torch.bfloat16, weights="q4")
    ids = tok.encode(TEXT * (a.context // 20 + 4))[:a.context]
    runner, logits, tokens = engine.runner, {}, {}
    for on in (True, False):
        A.GROUPED_ATTENTION = on
        slot = runner.cache.alloc()
        logits[on] = runner.execute([causal_segment(ids, 0, slot)], torch.tensor([len(ids) - 1])).logits[0]
        runner.cache.free(slot)
        runner.cache.prefix = type(runner.cache.prefix)()  # no prefix hit across the two paths
        tokens[on] = [t for o in engine.generate(f"g{on}", ids, SamplingParams(max_tokens=a.tokens, ignore_eos=True),
                                                 SpecParams("ar")) for t in o.token_ids]
    diff = (logits[True] - logits[False]).abs().max().item()
    first = next((i for i, (x, y) in enumerate(zip(tokens[True], tokens[False])) if x != y), None)
    print(f"context {len(ids)}: max |logit diff| {diff:.4f} (logit range {logits[False].min():.1f}..{logits[False].max():.1f}); "
          f"greedy tokens identical for {first if first is not None else a.tokens} of {a.tokens}")
    print(json.dumps(dict(context=len(ids), max_logit_diff=round(diff, 5), tokens=a.tokens, first_divergence=first)))


if __name__ == "__main__":
    main()

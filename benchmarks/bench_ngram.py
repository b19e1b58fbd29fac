"""Accept length with and without n-gram chains (``--ngram-draft``), on one in-process engine.

Greedy, SmolLM2-135M-Instruct target and the shipped drafter (``services.generate.build_inprocess``),
the fixed policy (every round verifies its whole tree), one request at a time. For each prompt and
each setting it reports rounds, tau (tokens per round, bonus included), mean verified nodes per
round and the chains' proposed / accepted node counts; the tokens of both settings must be equal.
Counts only, no timings::

    python -m benchmarks.bench_ngram --max-tokens 96 --budget 8
"""

from __future__ import annotations

import argparse
import json

import torch

REPEAT = ("Rename the variable `count` to `total` in this function and return the whole function:\n\n"
          "def tally(items):\n    count = 0\n    for item in items:\n        if item.valid:\n"
          "            count += item.weight\n        else:\n            count -= 1\n    return count\n")
SUMMARY = ("Repeat the following sentence three times, word for word: The quick brown fox jumps over the "
           "lazy dog while the cat sleeps on the warm windowsill.")
CHAT = "Give me three tips for learning a new programming language."
PROMPTS = {"code edit": REPEAT, "repeat": SUMMARY, "chat": CHAT}


def run(engine, ids: list[int], max_tokens: int, rid: str) -> dict:
    """One greedy request: its tokens, rounds, tau and mean verified nodes per round."""
    from services.params import SamplingParams, SpecParams

    toks, rounds, emitted, nodes = [], 0, 0, 0
    for out in engine.generate(rid, ids, SamplingParams(max_tokens=max_tokens), SpecParams("dartree-pruned")):
        toks += out.token_ids
        if not out.is_prefill:
            rounds += 1
            emitted += len(out.token_ids) + (out.finish_reason == "stop")
            nodes += out.num_draft_tokens
    return {"tokens": toks, "rounds": rounds, "tau": round(emitted / max(rounds, 1), 3),
            "nodes_per_round": round(nodes / max(rounds, 1), 2)}


def main() -> None:
    """Entry: prints one JSON line per prompt and setting."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--budget", type=int, default=8)
    p.add_argument("--prompts", nargs="+", choices=list(PROMPTS), default=list(PROMPTS))
    a = p.parse_args()
    from services.drafter.ngram_drafts import NgramDrafts
    from services.generate import build_inprocess, encode
    from services.spec import TreeKnobs, default_tree_knobs

    defaults = TreeKnobs(budget=a.budget).filled_from(default_tree_knobs("cpu"))
    engine, tok, note = build_inprocess(None, None, torch.float32, defaults)
    svc = engine.drafter.service
    for name in a.prompts:
        ids = encode(tok, PROMPTS[name], chat=True)
        seen = {}
        for on in (False, True):
            svc.ngram = NgramDrafts() if on else None
            r = run(engine, ids, a.max_tokens, f"{name}-{on}")
            seen[on] = r.pop("tokens")
            if on:
                r["ngram_proposed"], r["ngram_accepted"] = svc.ngram.counts()
            print(json.dumps({"prompt": name, "ngram_draft": "on" if on else "off", "budget": a.budget, **r}))
        assert seen[True] == seen[False], f"{name}: the tokens differ with n-gram chains"


if __name__ == "__main__":
    main()

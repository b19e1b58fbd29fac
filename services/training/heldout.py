"""The training's held-out estimate: the engine's replayed τ on held-out prompts.

Last time the teacher-forced chain estimate misled (it sees chains only, on teacher-forced
contexts); this runs what ``dartree bench --tau-replay`` runs -- the engine's drafter service and
tree builders, rounds replayed against the target's greedy (``ar``) output (:mod:`services.replay`)
-- on prompts the training never reads (:func:`services.datasets.load_heldout`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class HeldoutTurn:
    """One held-out prompt and the target's greedy output (``ref``: terminator excluded, ``finish``)."""

    uid: str
    prompt_ids: list[int]
    ref: list[int]
    finish: str | None


def heldout_prompt_ids(target_dir: Path, n: int, max_prompt_tokens: int = 384) -> list[tuple[str, list[int]]]:
    """``(uid, prompt ids)`` of ``n`` held-out prompts, chat-templated with the target's tokenizer."""
    from transformers import AutoTokenizer

    from services.datasets import load_heldout
    from services.training.datagen import encode_prompt

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    return [(p.uid, encode_prompt(tok, p, max_prompt_tokens)) for p in load_heldout(n)]


def greedy_turns(target, prompts: list[tuple[str, list[int]]], max_tokens: int, cache: Path | None = None
                 ) -> list[HeldoutTurn]:
    """The target's ``ar`` output for each prompt (the engine at T = 0), cached in ``cache`` (a .pt file).

    The cache is reused only when its prompts and ``max_tokens`` equal these.
    """
    from services.verifier.build import build_engine
    from services.params import SamplingParams, SpecParams
    from services.spec import Method

    key = {"prompts": [list(p) for _, p in prompts], "max_tokens": max_tokens}
    if cache is not None and cache.exists():
        saved = torch.load(cache, weights_only=False)
        if saved.get("key") == key:
            return [HeldoutTurn(**t) for t in saved["turns"]]
    engine = build_engine(target, None, packed_gemm=False)
    turns = []
    for uid, ids in prompts:
        outs = list(engine.generate(f"heldout-{uid}", list(ids), SamplingParams(max_tokens=max_tokens),
                                    SpecParams(Method.AR)))
        turns.append(HeldoutTurn(uid, list(ids), [t for o in outs for t in o.token_ids], outs[-1].finish_reason))
    if cache is not None:
        torch.save({"key": key, "turns": [t.__dict__ for t in turns]}, cache)
    return turns


@torch.no_grad()
def replayed_tau(drafter, target, turns: list[HeldoutTurn], method: str = "dartree-pruned", budget: int = 8,
                 width: int = 12, max_draft_depth: int = 16) -> float:
    """Replayed τ (tokens emitted / rounds, all turns pooled) of ``drafter`` with ``method`` at (B, W).

    The drafter is used in eval mode and put back in its previous mode; its weights are not copied
    (a fresh :class:`DrafterService` without GEMM packing each call).
    """
    from services.drafter.build import build_drafter
    from services.replay import replay_tau
    from services.verifier.drafter_client import InprocDrafterClient
    from services.verifier.build import build_engine
    from services.params import SpecParams

    was_training = drafter.training
    try:
        svc = build_drafter(drafter, target.embed_tokens(), target.lm_head(), packed_gemm=False)
        engine = build_engine(target, InprocDrafterClient(svc), max_draft_depth=max_draft_depth, packed_gemm=False)
        spec = SpecParams(method, budget=budget, width=width)
        rounds = emitted = 0
        for k, t in enumerate(turns):
            r, e = replay_tau(engine, t.prompt_ids, t.ref, t.finish, spec, f"heldout-replay-{k}")
            rounds, emitted = rounds + r, emitted + e
        return emitted / rounds if rounds else float("nan")
    finally:
        drafter.train(was_training)


def load_prompt_file(path: Path) -> list[tuple[str, list[int]]]:
    """``(uid, ids)`` from a JSON list of token-id lists (``--replay-prompt-file``)."""
    return [(f"file/{i}", [int(x) for x in ids]) for i, ids in enumerate(json.loads(Path(path).read_text()))]

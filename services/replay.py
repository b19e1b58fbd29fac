"""Replayed acceptance at T = 0: the engine's drafter and tree builders against a greedy reference.

At T = 0 the engine's output is the greedy continuation whatever the method (lossless), so the round
structure is fixed by the reference: round k drafts from the committed prefix, accepts the longest
tree path equal to the reference and emits it plus the bonus token. :func:`replay_rounds` runs the
engine's own drafter client and ``draft_depth`` with the drafter context fed from ONE teacher-forced
target forward over ``prompt + ref`` instead of per-round tree verifies, so the τ equals the live
engine's up to float near-ties (tests/bench/test_replay.py). Used by ``dartree bench --tau-replay``
(benchmarks/bench_run.replay_turn) and by the training's held-out estimate
(services/training/train_loop.py ``evaluate``); it measures no time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch


def accepted_nodes(tokens: list[int], parents: list[int], accepted: list[int]) -> list[int]:
    """Tree node indices of the path whose tokens are ``accepted`` (siblings carry distinct tokens)."""
    path, parent = [], -1
    for t in accepted:
        nxt = next((i for i, (tk, p) in enumerate(zip(tokens, parents)) if p == parent and tk == t), None)
        if nxt is None:
            break
        path.append(nxt)
        parent = nxt
    return path


def walk_reference(tree, seq: list[int], i: int) -> list[int]:
    """Node indices of the longest tree path whose tokens equal ``seq[i + 1], seq[i + 2], ...``."""
    toks, pars = tree.draft_tokens.tolist(), tree.parents.tolist()
    return accepted_nodes(toks, pars, seq[i + 1:i + 1 + len(toks)])


@dataclass
class ReplayRound:
    """One replayed round: ``tree`` drafted after ``seq[: i + 1]``; ``accepted`` tree nodes matched the
    reference; ``emitted`` tokens (accepted + bonus, cut at the reference's end); ``hits_stop``: the
    round emits the terminator; ``timings``: the drafter's (``draft``, ``tree_build`` seconds);
    ``seq``: the replayed sequence (``ref`` plus the terminator when it stopped), shared by all rounds."""

    i: int
    tree: object
    timings: dict
    accepted: int
    emitted: int
    hits_stop: bool
    seq: list


@torch.inference_mode()
def replay_rounds(engine, prompt_ids: list[int], ref: list[int], finish: str | None, spec,
                  request_id: str) -> Iterator[ReplayRound]:
    """Replay the rounds of one turn (see the module docstring); ``seq`` is ``ref`` plus the terminator
    when ``finish == "stop"`` (the target's greedy token after ``ref``, counted as emitted like the engine).

    Args:
        engine: anything with ``target`` (``teacher_forced``), ``drafter`` (a drafter client: ``submit``,
            ``collect``, ``release``), ``draft_depth(start)`` and ``policy.defaults`` (the resolved
            default knobs), e.g. :class:`services.verifier.engine.SpecEngine`.
        ref: the ``ar`` output token ids (terminator excluded, as the engine returns them).
        spec: the request's speculation knobs (``method, budget, width, depth_bonus, candidates``;
            an unset knob takes the engine policy's default: every round drafts the whole tree).
    Yields:
        :class:`ReplayRound` per round; the drafter context is released when the generator ends or closes.
    """
    from services.tree import DraftTree
    from services.verifier.drafter_client import DraftJob
    from services.verifier.policy import resolve_knobs

    knobs = resolve_knobs(spec, engine.policy.defaults)
    seq = list(ref)
    argmax, feats = engine.target.teacher_forced(list(prompt_ids) + seq)
    if finish == "stop":
        seq.append(int(argmax[-1]))
    p0 = len(prompt_ids)
    ctx_ids, ctx_feats = list(prompt_ids), feats[:p0]
    i = 0
    try:
        while i + 1 < len(seq):
            start = p0 + i
            depth = engine.draft_depth(start)
            tree, dt = DraftTree.empty(), {}
            if depth > 0:
                job = DraftJob(request_id, ctx_ids, ctx_feats, seq[i], start, spec.method, knobs, depth)
                tree, dt = engine.drafter.collect(engine.drafter.submit([job])[0])
            a = len(walk_reference(tree, seq, i))
            emitted = min(a + 1, len(seq) - (i + 1))
            hits_stop = finish == "stop" and i + emitted == len(seq) - 1
            yield ReplayRound(i, tree, dt, a, emitted, hits_stop, seq)
            ctx_ids, ctx_feats = seq[i:i + a + 1], feats[start:start + a + 1]
            i += a + 1
    finally:
        engine.drafter.release(request_id)


def replay_tau(engine, prompt_ids: list[int], ref: list[int], finish: str | None, spec,
               request_id: str) -> tuple[int, int]:
    """``(rounds, tokens emitted)`` of one replayed turn (τ = emitted / rounds)."""
    rounds = emitted = 0
    for r in replay_rounds(engine, prompt_ids, ref, finish, spec, request_id):
        rounds, emitted = rounds + 1, emitted + r.emitted
    return rounds, emitted

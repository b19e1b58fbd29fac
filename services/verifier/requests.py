"""A running request's state in the engine, its commit rule, and what a step reports.

:class:`RequestState` groups a request's concerns: prompt progress and committed positions here,
sampling state in its :class:`~services.verifier.sampling.Sampler`, the drafter's outbox in its
:class:`~services.verifier.drafts.DraftOutbox`, prefix sharing in ``wait_for`` / ``wait_len`` /
``cached`` (:mod:`services.verifier.prefix_cache`).

Commit is token by token (:func:`commit_tokens`): EOS, stop token ids and ``max_tokens`` take
effect at the exact token; nothing after (and including) a terminator is emitted, counted in
usage, or counted in the round statistics.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from services.params import SamplingParams, SpecParams
from services.spec import Method
from services.tree import walk
from services.verifier.drafts import DraftOutbox
from services.verifier.sampling import Sampler, TokenLogprobs
from services.verifier.scheduler import RoundInfo


@dataclass
class RoundOutput:
    """What one request's part of a step emitted.

    Attributes:
        token_ids: emitted tokens (accepted drafts + bonus), cut before any terminator / at max_tokens.
        finish_reason: None while running, "stop" (EOS or stop id) or "length".
        stop_token_id: with ``finish_reason`` "stop", the entry of ``stop_token_ids`` that ended the
            request (excluded from ``token_ids``); None for EOS, a grammar's end, or another finish.
        num_draft_tokens: draft nodes verified this round (0 for prefill and AR rounds).
        accept_length: accepted draft tokens among ``token_ids`` (bonus excluded).
        accepted_per_depth: ``[1] * accept_length`` (depth d accepted), for per-depth counters.
        timings: seconds per phase: draft, tree_build, verify, commit, total.
        prefill_seconds: > 0 only for the prefill step (which emits the first token).
        is_prefill: this step ran the prompt and emitted the first token (not a speculative round).
        logprobs: one row per ``token_ids`` entry when the request asked for logprobs, else None.
        grammar_masked: draft nodes the request's grammar forbade (never accepted; 0 without a grammar).
        drafted: the round called the drafter (False for plain rounds the policy chose, ``ar``, prefill).
        predicted_tau: the policy's expected emitted tokens of the verified tree (None: no prediction).
        cached_tokens: with ``is_prefill``, the prompt tokens that were not prefilled (reused in place
            or copied from another slot; :mod:`services.verifier.prefix_cache`).
    """

    token_ids: list[int]
    finish_reason: str | None
    num_draft_tokens: int = 0
    accept_length: int = 0
    accepted_per_depth: list[int] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    prefill_seconds: float = 0.0
    is_prefill: bool = False
    logprobs: TokenLogprobs | None = None
    drafted: bool = False
    predicted_tau: float | None = None
    grammar_masked: int = 0
    cached_tokens: int = 0
    stop_token_id: int | None = None


@dataclass(frozen=True)
class StepStats:
    """What the last :meth:`SpecEngine.step` ran (for metrics and the benchmarks).

    Attributes:
        requests: requests in the step; rows: rows of its forward; prefill_tokens: prompt-chunk rows;
        forward_seconds: the target forward; draft_seconds: the drafter's own compute for this step's
        trees (draft + tree build, wherever it ran); draft_wait_seconds: how long this step waited for
        them (with overlap, less than draft_seconds: the rest was hidden behind other forwards);
        decoding: requests running a decode round (not a prompt chunk); drafting: those that called
        the drafter; speculating: those that verified >= 1 draft node; wall_seconds: the whole step
        (draft, forward, walk, commit); predicted_seconds: the policy's prediction of wall_seconds
        (None for the fixed policy); draft_owed: context tokens the drafting requests' drafters had
        not seen before this step's drafts (their catch-up); device_rounds: decode rounds committed
        on the device (:mod:`services.verifier.step_commit`; the others walked on the host);
        round_reads: device-to-host copies of those rounds' outcome (1 when any ran).
    """

    requests: int = 0
    rows: int = 0
    prefill_tokens: int = 0
    forward_seconds: float = 0.0
    draft_seconds: float = 0.0
    draft_wait_seconds: float = 0.0
    decoding: int = 0
    drafting: int = 0
    speculating: int = 0
    wall_seconds: float = 0.0
    predicted_seconds: float | None = None
    draft_owed: int = 0
    device_rounds: int = 0
    round_reads: int = 0


@dataclass
class RequestState:
    """One admitted request.

    Attributes:
        prompt_ids, sampling, spec: as admitted; method: ``spec``'s method (the default filled in);
        sampler: its sampling state; slot: its KV slot; prefilled: prompt tokens already in the slot
        (chunked prefill); start: committed length (the root sits at this position); root: the last
        committed token; generated: tokens emitted; hist_ids: the ids of the committed positions
        (from the prompt on); prefill_seconds: forward time of its prompt chunks; cached: prompt
        positions not prefilled (reused in place or copied); stop_token_id: the stop id (not EOS)
        that ended it; wait_for / wait_len: the request whose prefill this one waits for, until it
        has committed this many shared prompt positions (prefix sharing); drafts: its drafter outbox.
    """

    prompt_ids: list[int]
    sampling: SamplingParams
    spec: SpecParams
    method: Method
    sampler: Sampler
    slot: int = -1
    prefilled: int = 0
    start: int = 0
    root: int = -1
    generated: int = 0
    hist_ids: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    cached: int = 0
    stop_token_id: int | None = None
    wait_for: str | None = None
    wait_len: int = 0
    drafts: DraftOutbox = field(default_factory=DraftOutbox)

    @property
    def decoding(self) -> bool:
        """The prompt is in: the request runs decode rounds."""
        return self.prefilled >= len(self.prompt_ids)

    @property
    def remaining(self) -> int:
        """Tokens it may still emit."""
        return self.sampling.max_tokens - self.generated

    def round_info(self, rid: str, can_draft: bool, owed: int) -> RoundInfo:
        """The request as the policy sees it in a decode round."""
        return RoundInfo(rid, self.method, self.sampling.temperature, can_draft=can_draft,
                         explicit_budget=self.spec.budget is not None, owed=owed, remaining=self.remaining)


def commit_tokens(req: RequestState, tokens: list[int], eos_token_ids) -> tuple[list[int], str | None]:
    """Commit ``tokens`` in order: ``(emitted, finish_reason)``.

    Cut at the first terminator (excluded) or when ``max_tokens`` is reached. With a grammar, EOS
    always ends the request and so does the grammar's last token (included). A stop id that is not
    an EOS the request stops on is kept in ``req.stop_token_id``. Advances ``req.generated`` and the
    grammar.
    """
    s, grammar = req.sampling, req.sampler.grammar
    out: list[int] = []
    for tok in tokens:
        eos = tok in eos_token_ids and (not s.ignore_eos or grammar is not None)
        if eos or tok in s.stop_token_ids:
            req.stop_token_id = None if eos else tok
            return out, "stop"
        out.append(tok)
        req.generated += 1
        if grammar is not None:
            grammar.advance(tok)
            if grammar.finished:
                return out, "stop"
        if req.generated >= s.max_tokens:
            return out, "length"
    return out, None


@dataclass
class Committed:
    """What :func:`commit_round` committed: ids: the emitted tokens (cut at a terminator /
    ``max_tokens``); finish: the finish reason (None: running); path: the tokens after the root
    (accepted drafts + bonus, before the cut); accepted: accepted draft tokens on the path; rows:
    ``[n]`` the verify rows of the committed positions (root first); sampling_seconds: the
    sampling of the verify rows (logit processors and grammar masks included)."""

    ids: list[int]
    finish: str | None
    path: list[int]
    accepted: int
    rows: torch.Tensor
    sampling_seconds: float = 0.0


def commit_round(req: RequestState, buffers, logits: torch.Tensor, feats: torch.Tensor, cache, eos_token_ids,
                 skipped: bool, drafted: bool, with_drafter: bool) -> Committed:
    """One decode round after the forward on the host path: sample every verify row (``logits
    [R, V]``), walk the tree on the host (:func:`~services.tree.walk`), commit the accepted path's
    KV (``cache``, :meth:`~services.verifier.kv_cache.SlotKVCache.commit`) and tokens, and add the
    committed positions (features ``feats [R, F]``) to the request's history and drafter outbox.
    :func:`services.verifier.step_commit.commit_rounds` does the same for a whole step on the device.

    Args:
        buffers: the round's verify buffers; skipped: the plan gave a drafting method a plain round;
        drafted: the round's tree came from the drafter; with_drafter: the engine has a drafter.
    """
    t0 = time.perf_counter()
    target_tokens = req.sampler.sample(logits, req.start + 1 + buffers.position_offsets, buffers)
    sampled = time.perf_counter() - t0
    res = walk(buffers, target_tokens.cpu())
    cache.commit(req.slot, req.start, res.accepted_rows)
    return commit_path(req, res.accepted_rows.tolist(), res.bonus_token, buffers.input_ids.tolist(), feats,
                       eos_token_ids, (skipped, drafted, with_drafter), sampled)


def commit_path(req: RequestState, rows: list[int], bonus: int, row_ids: list[int], feats: torch.Tensor,
                eos_token_ids, flags: tuple[bool, bool, bool], sampled: float = 0.0) -> Committed:
    """The host side of a round whose accepted path is known (its KV already committed): commit
    the tokens (:func:`commit_tokens`) and add the committed positions to the request's history and
    drafter outbox. Reads no tensor value.

    Args:
        rows: the accepted path's verify rows, root (0) first; bonus: the target's token after it;
        row_ids: the verify rows' tokens (root first), as a list; feats: ``[R, F]`` the round's
        features; flags: ``(skipped, drafted, with_drafter)`` as in :func:`commit_round`;
        sampled: seconds the sampling took.
    """
    skipped, drafted, with_drafter = flags
    new_ids = [row_ids[r] for r in rows]
    path = new_ids[1:] + [bonus]
    ids, finish = commit_tokens(req, path, eos_token_ids)
    req.sampler.count(ids)
    resend = not drafted and req.method.drafts and with_drafter  # a plain round the drafter never heard of
    req.drafts.after_round(new_ids, feats[torch.tensor(rows, device=feats.device)], skipped, resend, with_drafter)
    req.hist_ids.extend(new_ids)
    req.start += len(new_ids)
    req.root = bonus
    return Committed(ids, finish, path, len(rows) - 1, torch.tensor(rows, dtype=torch.long), sampled)


def commit_prefill(req: RequestState, logits: torch.Tensor, eos_token_ids, with_drafter: bool) -> tuple[list[int], str | None]:
    """The prompt is in: sample the first token from the prompt's last row (``logits [1, V]``),
    commit it, and hand the drafter outbox the prompt. Returns ``(emitted ids, finish_reason)``."""
    n = len(req.prompt_ids)
    first = int(req.sampler.sample(logits, torch.tensor([n]), host_positions=[n])[0])  # its one read
    req.start, req.root = len(req.prompt_ids), first
    req.drafts.after_prefill(req.prompt_ids, with_drafter)
    req.hist_ids = list(req.prompt_ids)
    ids, finish = commit_tokens(req, [first], eos_token_ids)
    req.sampler.count(ids)
    return ids, finish

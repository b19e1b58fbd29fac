"""The speculative decode loop: draft -> verify -> walk -> commit, one round per ``step``.

One loop for every method (architecture.md). Commit is token by token: EOS, stop token ids and
``max_tokens`` take effect at the exact token; nothing after (and including) a terminator is
emitted, counted in usage, or counted in the round statistics. Clock rules: algorithms.md §6.

Logprobs (only when a request asks): the raw target distribution, ``log_softmax`` of the logits
before temperature / top-p / top-k (vLLM's default), at the row that produced each emitted token:
an accepted draft's parent row on the accepted path, the last accepted row for the bonus token,
the prompt's last position for the first token (bug-classes B19: never the draft's q or a constant).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from math import isfinite

import torch

from services.drafter.service import METHODS
from services.protocol import LOGPROB_FLOOR, MAX_TOP_LOGPROBS
from services.tree import DraftTree, derive_buffers, sample_target_tokens, walk
from services.verifier.drafter_client import DrafterClient
from services.verifier.schedule import check_tree_knobs


@dataclass
class SamplingParams:
    """Per-request sampling. ``temperature == 0`` is greedy.

    Raises:
        ValueError: one-line reason for an out-of-range field.
    """

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k: each emitted token's raw logprob and its top-k alternatives

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer (got {self.max_tokens!r})")
        if not isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (got {self.temperature!r})")
        if not isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p!r})")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (got {self.top_k!r})")
        for name in ("temperature", "top_p"):
            if isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a number (got {getattr(self, name)!r})")
        lp = self.logprobs
        if lp is not None and (not isinstance(lp, int) or isinstance(lp, bool) or not 0 <= lp <= MAX_TOP_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}] or None (got {lp!r})")
        self.stop_token_ids = tuple(self.stop_token_ids)


@dataclass
class SpecParams:
    """Speculation knobs of one request (``None`` = the server default)."""

    method: str = "dartree-pruned"
    budget: int | None = None
    width: int | None = None
    depth_bonus: float | None = None
    candidates: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown speculative method {self.method!r} (choose from {', '.join(METHODS)})")
        check_tree_knobs(self.budget, self.width, self.depth_bonus, self.candidates)


@dataclass
class TokenLogprobs:
    """Raw target logprobs of a round's emitted tokens, one row per token (see the module docstring).

    Attributes:
        logprobs: each emitted token's logprob, clamped to ``[LOGPROB_FLOOR, 0]``.
        top_ids, top_logprobs: the k most likely tokens of the same row, most likely first.
    """

    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


def token_logprobs(logits: torch.Tensor, token_ids: list[int], k: int) -> TokenLogprobs:
    """``log_softmax`` of ``logits [n, V]`` (row i produced ``token_ids[i]``) at the tokens, plus top-k."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    lp = torch.nan_to_num(lp, nan=LOGPROB_FLOOR).clamp_(LOGPROB_FLOOR, 0.0)
    chosen = lp.gather(1, torch.tensor(token_ids, dtype=torch.long, device=lp.device)[:, None])[:, 0]
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    return TokenLogprobs(chosen.cpu().tolist(), top_i.cpu().tolist(), top_v.cpu().tolist())


@dataclass
class RoundOutput:
    """What one ``step`` emitted.

    Attributes:
        token_ids: emitted tokens (accepted drafts + bonus), cut before any terminator / at max_tokens.
        finish_reason: None while running, "stop" (EOS or stop id) or "length".
        num_draft_tokens: draft nodes verified this round (0 for prefill and AR rounds).
        accept_length: accepted draft tokens among ``token_ids`` (bonus excluded).
        accepted_per_depth: ``[1] * accept_length`` (depth d accepted), for per-depth counters.
        timings: seconds per phase: draft, tree_build, verify, commit, total.
        prefill_seconds: > 0 only for the prefill step (which emits the first token).
        is_prefill: this step ran the prompt and emitted the first token (not a speculative round).
        logprobs: one row per ``token_ids`` entry when the request asked for logprobs, else None.
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


def _fill_knobs(spec: SpecParams, tree_knobs: tuple[int, int] | None) -> SpecParams:
    """``spec`` with its unset budget / width taken from ``tree_knobs`` (explicit values win)."""
    if tree_knobs is None or (spec.budget is not None and spec.width is not None):
        return spec
    budget, width = tree_knobs
    return dataclasses.replace(spec, budget=budget if spec.budget is None else spec.budget,
                               width=width if spec.width is None else spec.width)


@dataclass
class _Request:
    prompt_ids: list[int]
    sampling: SamplingParams
    spec: SpecParams
    cache: object = None
    start: int = 0
    root: int = -1
    ctx_ids: list[int] = field(default_factory=list)
    ctx_feats: torch.Tensor | None = None
    generated: int = 0
    generator: torch.Generator | None = None


@dataclass(frozen=True)
class EngineConfig:
    """Engine limits. ``max_context`` defaults to the target's position limit."""

    max_context: int | None = None


class SpecEngine:
    """Runs requests round by round over a :class:`TargetModel` and a :class:`DrafterClient`.

    Args:
        target: the verifier's target model; drafter: drafter client (None = AR only).
    """

    def __init__(self, target, drafter: DrafterClient | None, config: EngineConfig = EngineConfig(),
                 max_draft_depth: int = 16, drafter_max_position: int | None = None):
        self.target, self.drafter = target, drafter
        if drafter_max_position is None and hasattr(drafter, "info"):
            drafter_max_position = int(drafter.info().get("max_position") or 0) or None
        self.drafter_max_position = drafter_max_position  # no draft token at a position >= this
        self.vocab_size = target.vocab_size
        self.max_context = min(config.max_context or target.max_context, target.max_context)
        self.eos_token_ids = target.eos_token_ids
        self.max_draft_depth = max_draft_depth
        self._reqs: dict[str, _Request] = {}

    def num_active(self) -> int:
        """Requests holding state (KV cache or pending prefill)."""
        return len(self._reqs)

    def add_request(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                    spec: SpecParams) -> None:
        """Admit a request (prefill happens at its first ``step``).

        Raises:
            ValueError: empty prompt, ids outside the vocabulary, prompt + max_tokens beyond the
                context window, a drafting method without a drafter, or a duplicate id.
        """
        if request_id in self._reqs:
            raise ValueError(f"request id {request_id!r} is already active")
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if any((not isinstance(t, int)) or t < 0 or t >= self.vocab_size for t in prompt_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        if len(prompt_ids) + sampling.max_tokens > self.max_context:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({sampling.max_tokens}) exceeds the "
                             f"context window of {self.max_context} tokens")
        if spec.method != "ar" and self.drafter is None:
            raise ValueError(f"method {spec.method!r} needs a drafter; this server runs without one")
        gen = None
        if sampling.temperature > 0:
            gen = torch.Generator(device=self.target.device)
            gen.manual_seed(sampling.seed if sampling.seed is not None else int(torch.randint(0, 2**62, ()).item()))
        self._reqs[request_id] = _Request(list(prompt_ids), sampling, spec, generator=gen)

    def abort(self, request_id: str) -> None:
        """Free a request's KV cache and drafter context (idempotent)."""
        req = self._reqs.pop(request_id, None)
        if req is not None and self.drafter is not None and req.spec.method != "ar":
            self.drafter.release(request_id)

    def step(self, request_id: str, tree_knobs: tuple[int, int] | None = None) -> RoundOutput:
        """Run one round of a request (its first step prefills and emits the first token).

        Args:
            tree_knobs: ``(budget, width)`` for this round only, filling what the request's
                ``SpecParams`` leaves unset (the verifier's load schedule); None = drafter defaults.
        Raises:
            KeyError: unknown request id.
        """
        req = self._reqs[request_id]
        try:
            out = self._prefill(req) if req.cache is None else self._round(request_id, req, tree_knobs)
        except BaseException:
            self.abort(request_id)
            raise
        if out.finish_reason is not None:
            self.abort(request_id)
        return out

    def _sample(self, req: _Request, logits: torch.Tensor) -> torch.Tensor:
        s = req.sampling
        return sample_target_tokens(logits, s.temperature, s.top_p, s.top_k, req.generator)

    def _emit(self, req: _Request, tokens: list[int]) -> tuple[list[int], str | None]:
        """Commit semantics: cut at the first terminator (excluded) or when max_tokens is reached."""
        s = req.sampling
        out: list[int] = []
        for tok in tokens:
            if (tok in self.eos_token_ids and not s.ignore_eos) or tok in s.stop_token_ids:
                return out, "stop"
            out.append(tok)
            req.generated += 1
            if req.generated >= s.max_tokens:
                return out, "length"
        return out, None

    @staticmethod
    def _logprobs(req: _Request, logits: torch.Tensor, rows: torch.Tensor, ids: list[int]) -> TokenLogprobs | None:
        """Logprobs of the emitted ``ids``; ``ids[i]`` came from ``logits[rows[i]]`` (None unless asked)."""
        k = req.sampling.logprobs
        return None if k is None else token_logprobs(logits[rows[:len(ids)].to(logits.device)], ids, k)

    def _prefill(self, req: _Request) -> RoundOutput:
        t0 = time.perf_counter()
        req.cache = self.target.new_cache()
        logits, feats = self.target.prefill(req.prompt_ids, req.cache)
        first = int(self._sample(req, logits[None])[0])
        req.start, req.root = len(req.prompt_ids), first
        req.ctx_ids, req.ctx_feats = list(req.prompt_ids), feats
        ids, finish = self._emit(req, [first])
        dt = time.perf_counter() - t0
        return RoundOutput(ids, finish, timings={"total": dt}, prefill_seconds=dt, is_prefill=True,
                           logprobs=self._logprobs(req, logits[None], torch.zeros(1, dtype=torch.long), ids))

    def draft_depth(self, start: int) -> int:
        """Deepest draft allowed for a root at position ``start``: the positions left after the root
        in the target's context and below the drafter's position limit, capped at ``max_draft_depth``
        (<= 0: a plain round)."""
        room = self.max_context - start - 1
        if self.drafter_max_position:
            room = min(room, self.drafter_max_position - start - 1)
        return min(room, self.max_draft_depth)

    def _round(self, request_id: str, req: _Request, tree_knobs: tuple[int, int] | None) -> RoundOutput:
        t0 = time.perf_counter()
        timings: dict[str, float] = {}
        depth = self.draft_depth(req.start)
        tree = DraftTree.empty()
        if req.spec.method != "ar" and depth > 0:
            tree, dt = self.drafter.draft(request_id, req.ctx_ids, req.ctx_feats, req.root, req.start,
                                          _fill_knobs(req.spec, tree_knobs), max_depth=depth)
            timings.update(dt)
        t1 = time.perf_counter()
        buffers = derive_buffers(tree, req.root)
        logits, feats = self.target.verify(buffers, req.cache, req.start)
        target_tokens = self._sample(req, logits)
        res = walk(buffers, target_tokens.cpu())
        t2 = time.perf_counter()
        self.target.commit(req.cache, req.start, res.accepted_rows)
        rows = res.accepted_rows
        accepted = buffers.input_ids[rows[1:]].tolist()
        ids, finish = self._emit(req, accepted + [res.bonus_token])
        req.ctx_ids = buffers.input_ids[rows].tolist()
        req.ctx_feats = feats[rows.to(feats.device)]
        req.start += rows.numel()
        req.root = res.bonus_token
        t3 = time.perf_counter()
        n_acc = min(len(ids), len(accepted))
        timings.update(verify=t2 - t1, commit=t3 - t2, total=t3 - t0)
        return RoundOutput(ids, finish, num_draft_tokens=tree.num_nodes, accept_length=n_acc,
                           accepted_per_depth=[1] * n_acc, timings=timings,
                           logprobs=self._logprobs(req, logits, rows, ids))

    def generate(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, spec: SpecParams):
        """Yield :class:`RoundOutput` until the request finishes (convenience for CLI and tests)."""
        self.add_request(request_id, prompt_ids, sampling, spec)
        while True:
            out = self.step(request_id)
            yield out
            if out.finish_reason is not None:
                return

"""The speculative decode loop in batched steps: draft -> one target forward -> walk -> commit.

One loop for every method (docs/design.md, "One engine loop"). A *step* is one forward of the
target for every
scheduled request (:class:`ModelRunner` over a slot KV cache); a *round* is one request's
draft -> verify -> walk -> commit inside a step; prompts are prefilled in chunks that ride along
with the other requests' rounds. Commit is token by token: EOS, stop token ids and
``max_tokens`` take effect at the exact token; nothing after (and including) a terminator is
emitted, counted in usage, or counted in the round statistics. Clock rules: docs/algorithms.md §6.

Logprobs (only when a request asks): the raw target distribution, ``log_softmax`` of the logits
before the logit processors, temperature / top-p / top-k / min_p (vLLM's default), at the row that
produced each emitted token:
an accepted draft's parent row on the accepted path, the last accepted row for the bonus token,
the prompt's last position for the first token (docs/design.md, "Logprobs come from the
target": never the draft's q or a constant).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from math import isfinite

import torch

from services.spec import MAX_BUDGET, METHODS, check_tree_knobs
from services.protocol import LOGPROB_FLOOR, MAX_TOP_LOGPROBS
from services.tree import DraftTree, derive_buffers, sample_target_tokens, walk
from services.tree.accept import position_uniforms
from services.tree.batch import Segment, causal_segment
from services.tree.grammar import GrammarState, mask_logits
from services.tree.logit_processors import LogitOptions, path_counts, process_logits, sample_processed, token_counts
from services.verifier.drafter_client import DraftJob, DrafterClient
from services.verifier.policy import Drafted, FixedPolicy, RoundInfo
from services.verifier.prefix_cache import Placement, common_prefix
from services.verifier.runner import ModelRunner
from services.verifier.remote_drafter import DrafterUnavailable
from services.verifier.scheduler import Candidate, StepPlan, plan_step

log = logging.getLogger(__name__)


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
    presence_penalty: float = 0.0    # [-2, 2], over output tokens (logit_processors.py, as every option below)
    frequency_penalty: float = 0.0   # [-2, 2], times each output token's count
    repetition_penalty: float = 1.0  # > 0, over prompt + output tokens
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> bias in [-100, 100]
    min_tokens: int = 0              # EOS / stop ids masked before this many output tokens
    min_p: float = 0.0               # [0, 1], relative probability floor (T > 0)
    grammar: str | None = None       # an llguidance grammar the output must match (services/tree/grammar.py)

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
        for name, lo, hi in (("presence_penalty", -2, 2), ("frequency_penalty", -2, 2), ("min_p", 0, 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not isfinite(v) or not lo <= v <= hi:
                raise ValueError(f"{name} must be a number in [{lo}, {hi}] (got {v!r})")
        r = self.repetition_penalty
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not isfinite(r) or r <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0 (got {r!r})")
        m = self.min_tokens
        if not isinstance(m, int) or isinstance(m, bool) or not 0 <= m <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens] (got {m!r})")
        self.logit_bias = dict(self.logit_bias)
        for t, b in self.logit_bias.items():
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0 (got {t!r})")
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not isfinite(b) or not -100 <= b <= 100:
                raise ValueError(f"logit_bias[{t}] must be a number in [-100, 100] (got {b!r})")


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
    """``log_softmax`` of ``logits [n, V]`` (row i produced ``token_ids[i]``) at the tokens, plus top-k.

    Ties are broken by ascending token id, the way greedy decoding breaks them (``torch.argmax``
    takes the first maximum): equal logprobs are listed lowest id first, and where more tokens tie
    at the k-th value than fit, the lowest ids are kept. So at T = 0 a row's first entry is the
    token plain decoding emits (``torch.topk`` alone leaves both orders unspecified).
    """
    lp = torch.log_softmax(logits.float(), dim=-1)
    lp = torch.nan_to_num(lp, nan=LOGPROB_FLOOR).clamp_(LOGPROB_FLOOR, 0.0)
    chosen = lp.gather(1, torch.tensor(token_ids, dtype=torch.long, device=lp.device)[:, None])[:, 0]
    top_ids, top_lps = [], []
    if k:
        kth = lp.topk(k, dim=-1).values[:, -1]
        for row, v in zip(lp, kth):
            above = (row > v).nonzero()[:, 0]  # ascending ids, fewer than k
            ids = torch.cat([above, (row == v).nonzero()[:, 0][:k - above.numel()]]).sort().values
            vals = row[ids]
            order = vals.argsort(descending=True, stable=True)  # by value, ties by ascending id
            top_ids.append(ids[order].cpu().tolist())
            top_lps.append(vals[order].cpu().tolist())
    else:
        top_ids = top_lps = [[] for _ in token_ids]
    return TokenLogprobs(chosen.cpu().tolist(), top_ids, top_lps)


@dataclass
class RoundOutput:
    """What one ``step`` emitted.

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


@dataclass
class _Request:
    prompt_ids: list[int]
    sampling: SamplingParams
    spec: SpecParams
    slot: int = -1
    prefilled: int = 0                 # prompt tokens already in the slot (chunked prefill)
    start: int = 0                     # committed length (the root sits at this position)
    root: int = -1
    ctx_ids: list[int] = field(default_factory=list)   # committed since the last draft (for the drafter)
    ctx_feats: torch.Tensor | None = None              # [len(ctx_ids) - owed rows, F]
    owed_feats: list[torch.Tensor] = field(default_factory=list)  # rows of plain rounds, concatenated at the next draft
    chunk_feats: list[torch.Tensor] = field(default_factory=list)
    hist_ids: list[int] = field(default_factory=list)  # ids of the committed positions (from the prompt on)
    hist_feats: list[torch.Tensor] = field(default_factory=list)  # their features (kept only with a drafter)
    pending: object = None             # a submitted draft for the next round (overlap), or None
    skip_round: bool = False           # the policy chose a plain round (decided before the batched draft)
    resync: bool = False               # the drafter lost this request's context: next draft sends the history
    prefill_seconds: float = 0.0
    generated: int = 0
    sample_seed: int = 0               # T > 0: the token at position t is drawn with position_uniforms(sample_seed, t)
    logit_opts: LogitOptions | None = None  # None: the raw logits are sampled (no processor is on)
    out_counts: torch.Tensor | None = None  # [V] float, emitted tokens (with a penalty on)
    prompt_mask: torch.Tensor | None = None  # [V] bool, prompt tokens (with repetition_penalty)
    grammar: GrammarState | None = None     # the output's grammar, at the emitted tokens
    grammar_masked: int = 0                 # draft nodes the grammar forbade in the last round
    wait_for: str | None = None             # the request whose prefill this one waits for (prefix sharing)
    wait_len: int = 0                       # ... until it has committed this many shared prompt positions
    cached: int = 0                         # prompt positions not prefilled (reused in place or copied)
    stop_token_id: int | None = None        # the stop id (not EOS) that ended the request

    @property
    def decoding(self) -> bool:
        return self.prefilled >= len(self.prompt_ids)


@dataclass(frozen=True)
class EngineConfig:
    """Engine limits.

    Attributes:
        max_context: context window (None = the target's position limit).
        max_running: KV slots, i.e. requests holding state at once (``--max-running``).
        prefill_chunk: prompt tokens a request prefills per step (chunked prefill, vLLM v1's default).
        max_step_tokens: rows one step may hold in all (verify rows + prompt chunks); a step always
            holds at least one request.
        kv_bucket: a step's KV length is rounded up to a multiple of this (fewer shapes).
        overlap: submit each request's next draft right after its commit, so the drafter
            drafts while the target verifies other
            requests; the caller alternates groups of requests between steps (the verifier worker
            does). Tokens are unchanged: the same draft is computed, only earlier.
        compile: run the runner's steps through ``torch.compile`` (:class:`ModelRunner`; on a CUDA
            target: CUDA graphs of padded steps).
        cuda_graphs: pad every step to a bucket and run it through CUDA graphs (:class:`ModelRunner`'s
            ``cuda_graphs``; None = on with ``compile`` on CUDA; True off CUDA runs the padded steps
            eagerly, the CPU test of the padding).
        prefix_cache: a finished request's slot keeps its committed KV (and target features) as a
            cached prefix; a new request takes the free slot sharing the longest prefix with its
            prompt, or copies the leading columns another slot has committed, or waits for a
            request prefilling the same prompt, and prefills only the rest
            (:mod:`services.verifier.prefix_cache`). Same tokens. False: every prompt is prefilled.
    """

    max_context: int | None = None
    max_running: int = 8
    prefill_chunk: int = 256
    max_step_tokens: int = 512
    kv_bucket: int = 64
    overlap: bool = False
    compile: bool = False
    cuda_graphs: bool | None = None
    prefix_cache: bool = True

    def __post_init__(self) -> None:
        for name in ("max_running", "prefill_chunk", "max_step_tokens", "kv_bucket"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)})")


@dataclass(frozen=True)
class StepStats:
    """What the last :meth:`SpecEngine.step_batch` ran (for metrics and the benchmarks).

    Attributes:
        requests: requests in the step; rows: rows of its forward; prefill_tokens: prompt-chunk rows;
        forward_seconds: the target forward; draft_seconds: the drafter's own compute for this step's
        trees (draft + tree build, wherever it ran); draft_wait_seconds: how long this step waited for
        them (with overlap, less than draft_seconds: the rest was hidden behind other forwards);
        decoding: requests running a decode round (not a prompt chunk); drafting: those that called
        the drafter; speculating: those that verified >= 1 draft node; wall_seconds: the whole step
        (draft, forward, walk, commit); predicted_seconds: the policy's prediction of wall_seconds
        (None for the fixed policy); draft_owed: context tokens the drafting requests' drafters had
        not seen before this step's drafts (their catch-up).
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


@dataclass
class _Planned:
    """One request's part of a step (engine-internal)."""

    rid: str
    req: _Request
    segment: Segment
    buffers: object = None             # VerifyBuffers of a decode round; None for a prompt chunk
    tree: DraftTree | None = None
    timings: dict = field(default_factory=dict)
    final_chunk: bool = False
    drafted: bool = False              # the drafter was called (or its overlapped draft collected)
    skipped: bool = False              # the policy chose a plain round for a drafting method
    predicted_tau: float | None = None


class SpecEngine:
    """Runs requests in batched steps over a :class:`TargetModel` and a :class:`DrafterClient`.

    A *step* is one target forward (:class:`ModelRunner`) holding every scheduled request's rows: a
    *round* (draft -> verify -> walk -> commit) for each decoding request and a prompt chunk for each
    request being prefilled. A request's tokens never depend on who else is in the step.

    Args:
        target: the verifier's target model; drafter: drafter client (None = AR only).
        max_draft_depth: deepest draft (the drafter's slots); drafter_max_position: no draft token
            at a position >= this (None: from ``drafter.info()`` when it has one).
        policy: who drafts, with which resolved knobs, which nodes are verified
            (``services.verifier.policy``; default :class:`FixedPolicy` over
            :data:`services.spec.DEFAULT_KNOBS`: every drafting request drafts its whole tree).
        runner: the :class:`ModelRunner` (None = a new one for ``config``); servers, tools and
            benchmarks build theirs with :func:`services.verifier.build.build_engine`.
        grammar_tokenizer: the llguidance tokenizer of requests with a grammar (None: built on the
            first such request from ``tokenizer.json`` in the target's directory).
    Raises:
        MemoryError: the slot KV cache does not fit (one line).
    """

    def __init__(self, target, drafter: DrafterClient | None, config: EngineConfig = EngineConfig(),
                 max_draft_depth: int = 16, drafter_max_position: int | None = None, policy=None,
                 runner: ModelRunner | None = None, grammar_tokenizer=None):
        self.target, self.drafter = target, drafter
        self._grammar_tokenizer = grammar_tokenizer
        self.policy = policy if policy is not None else FixedPolicy()
        if drafter_max_position is None and drafter is not None:
            drafter_max_position = int(drafter.info().get("max_position") or 0) or None
        self.drafter_max_position = drafter_max_position  # no draft token at a position >= this
        self.vocab_size = target.vocab_size
        self.config = config
        self.max_context = min(config.max_context or target.max_context, target.max_context)
        if config.max_context and config.max_context > target.max_context:
            log.warning("max_context %d is above the target's %d positions: serving %d", config.max_context,
                        target.max_context, self.max_context)
        self.eos_token_ids = target.eos_token_ids
        self.max_draft_depth = max_draft_depth
        self.runner = runner if runner is not None else ModelRunner(
            target, config.max_running, self.kv_positions(target, config), config.kv_bucket, compile=config.compile,
            cuda_graphs=config.cuda_graphs)
        self.runner.cache.prefix.enabled = bool(config.prefix_cache)
        self._reqs: dict[str, _Request] = {}
        self.last_step = StepStats()
        self.drafter_up = drafter is not None  # drafts may be requested (see set_drafter_up)
        self._forget_contexts = False  # the drafter went down: release every request's context

    def set_drafter_up(self, up: bool) -> None:
        """Say whether the drafter is reachable (the verifier worker calls this from its drafter
        heartbeat thread). While it is down, every round is a plain round: the output is the same
        tokens (speculation is lossless), only slower. A draft that fails with
        :class:`~services.verifier.remote_drafter.DrafterUnavailable` sets it down too, until the
        next ``set_drafter_up(True)``; each request whose drafter context was lost (a drafter
        restart) sends its whole committed history with its next draft (docs/design.md, "A drafter
        failure never fails a request"). Going down also releases every running request's drafter
        context (at the next step, on the compute thread): a draining drafter then need not wait
        for requests that no longer draft."""
        up = bool(up) and self.drafter is not None
        if self.drafter_up and not up:
            self._forget_contexts = True  # on the compute thread, at the next step (the client is its own)
        elif up and not self.drafter_up:
            log.info("drafter is back: speculative decoding resumes")
        self.drafter_up = up

    @staticmethod
    def kv_positions(target, config: EngineConfig) -> int:
        """Positions per KV slot: the context window plus room past it for the widest step segment
        (verify rows sit past the committed length: the widest tree a request may ask for)."""
        max_context = min(config.max_context or target.max_context, target.max_context)
        return max_context + max(MAX_BUDGET + 1, config.prefill_chunk)

    def num_active(self) -> int:
        """Requests holding state (KV slot or pending prefill)."""
        return len(self._reqs)

    def num_free_slots(self) -> int:
        """KV slots not held by a request."""
        return self.runner.cache.num_free()

    def prefix_cache_stats(self) -> tuple[int, int, int, int, int, int]:
        """``(queried, hits, evictions, cached, copied, waits)``: prompt tokens looked up in the
        prefix cache, those not prefilled (reused in place or copied), prefixes evicted, positions
        cached now, prompt tokens copied from another slot, requests that waited for another's
        prefill (running totals but ``cached``; :class:`~services.verifier.prefix_cache.PrefixStats`)."""
        pc = self.runner.cache.prefix
        st = pc.stats
        return st.queried_tokens, st.hit_tokens, st.evictions, pc.cached_tokens(), st.copied_tokens, st.waits

    def add_request(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                    spec: SpecParams) -> None:
        """Admit a request and give it a KV slot (prefill happens over its first steps). With the
        prefix cache only the part of the prompt no slot holds yet is prefilled (:meth:`_place`).

        Raises:
            ValueError: empty prompt, ids outside the vocabulary, prompt + max_tokens beyond the
                context window, a drafting method without a drafter, a duplicate id, or no free slot.
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
        bad = [t for t in sampling.logit_bias if t >= self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if self.runner.cache.num_free() == 0:
            raise ValueError(f"all {self.config.max_running} KV slots are in use (max_running)")
        grammar = None if sampling.grammar is None else self.compile_grammar(sampling.grammar)
        seed = sampling.seed  # unseeded T > 0: a seed from torch's global RNG (torch.manual_seed fixes it)
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()).item()) if sampling.temperature > 0 else 0
        req = _Request(list(prompt_ids), sampling, spec, sample_seed=seed)
        self._place(request_id, req)
        req.grammar = grammar
        self._set_logit_opts(req)
        self._reqs[request_id] = req

    # ------------------------------------------------------------------ prefix sharing (prefix_cache.py)

    def _place(self, rid: str, req: _Request) -> None:
        """Give a new request its slot and the prompt positions it need not prefill: a cached
        prefix reused in place, or the leading columns another slot has committed copied into its
        own slot (:meth:`PrefixCache.plan`); or, when a request still prefilling shares at least
        ``min_copy`` positions more, wait for that prefill (:meth:`_resolve_waits`). With a drafter
        the reused positions' target features come along, so the drafter's context is rebuilt from
        exactly the rows a cold prefill would produce."""
        cache = self.runner.cache
        pc, need = cache.prefix, self.drafter is not None
        plan = pc.plan(cache.free_slots(), req.prompt_ids, need, self._committed(rid) if pc.enabled else None)
        lead, lead_len = self._leader(rid, req.prompt_ids) if pc.enabled else (None, 0)
        if lead is not None and lead_len >= max(plan.reused, plan.copied) + pc.min_copy:
            plan = Placement(pc.victim(cache.free_slots()))
            req.wait_for, req.wait_len = lead, lead_len
            pc.stats.waits += 1
        req.slot = plan.slot
        req.prefilled, feats = cache.take(plan)
        req.cached = req.prefilled
        if need and plan.copied and feats is None:
            feats = self._committed_feats(plan.source, plan.copied)
        if req.prefilled and feats is not None:
            req.chunk_feats.append(feats)

    def _committed(self, exclude: str) -> dict[int, list[int]]:
        """``{slot: ids}`` of every other running request's committed positions (copy sources)."""
        out = {}
        for rid, r in self._reqs.items():
            ids = r.hist_ids if r.decoding else r.prompt_ids[:r.prefilled]
            if rid != exclude and r.wait_for is None and ids:
                out[r.slot] = ids
        return out

    def _committed_feats(self, slot: int, n: int) -> torch.Tensor:
        """``[n, F]`` target features of the first ``n`` committed positions of the running request
        in ``slot`` (a copy, never a view of its step's features)."""
        req = next(r for r in self._reqs.values() if r.slot == slot and r.wait_for is None)
        parts, have = [], 0
        for f in (req.hist_feats if req.decoding else req.chunk_feats):
            if have >= n:
                break
            parts.append(f[:n - have])
            have += parts[-1].shape[0]
        return torch.cat(parts)

    def _leader(self, rid: str, prompt: list[int]) -> tuple[str | None, int]:
        """``(request id, n)``: the other request still prefilling (and not waiting itself) whose
        prompt shares the most leading positions with ``prompt``, ``n`` capped at ``len(prompt) - 1``."""
        best, best_len = None, 0
        for other, r in self._reqs.items():
            if other != rid and not r.decoding and r.wait_for is None:
                n = min(common_prefix(r.prompt_ids, prompt), len(prompt) - 1)
                if n > best_len:
                    best, best_len = other, n
        return best, best_len

    def _resolve_waits(self, force: frozenset[str] = frozenset()) -> None:
        """Start every waiting request whose leader has committed the shared positions, finished,
        or left (abort, error: the waiting request then takes whatever another slot has committed,
        waits for another request prefilling the prompt, or prefills it itself; nothing an aborted
        request wrote is read). A request in ``force`` starts now, from what is committed."""
        cache = self.runner.cache
        pc, need = cache.prefix, self.drafter is not None
        for rid, req in list(self._reqs.items()):
            if req.wait_for is None:
                continue
            lead = self._reqs.get(req.wait_for)
            if rid not in force and lead is not None and not lead.decoding and lead.prefilled < req.wait_len:
                continue
            req.wait_for = None
            sources = {**pc.copy_sources(cache.free_slots(), need), **self._committed(rid)}
            src, n = pc.longest(req.prompt_ids, sources)
            lead, lead_len = self._leader(rid, req.prompt_ids) if rid not in force else (None, 0)
            if lead is not None and lead_len >= n + pc.min_copy:
                req.wait_for, req.wait_len = lead, lead_len
            elif n >= pc.min_copy:
                feats = cache.copy_prefix(src, req.slot, n)
                req.prefilled = req.cached = n
                if need:
                    req.chunk_feats = [feats if feats is not None else self._committed_feats(src, n)]

    def compile_grammar(self, grammar: str) -> GrammarState:
        """A request's :class:`GrammarState` for an llguidance ``grammar`` (a JSON schema's, from
        ``llguidance.LLMatcher.grammar_from_json_schema``; docs/serving.md "Structured output").

        Raises:
            ValueError: the grammar does not compile, or the engine has no grammar tokenizer.
        """
        import llguidance

        tok = self.grammar_tokenizer()
        return GrammarState(llguidance.LLMatcher(tok, grammar, log_level=0), self.vocab_size, tok.vocab_size)

    def grammar_tokenizer(self):
        """The ``llguidance.LLTokenizer`` of grammar requests: the one given, else built once (about
        0.4 s for a 49k vocabulary) from the target directory's ``tokenizer.json``, EOS = the target's
        first EOS id.

        Raises:
            ValueError: none was given and the target's directory has no ``tokenizer.json`` or no EOS.
        """
        if self._grammar_tokenizer is None:
            from pathlib import Path

            import llguidance

            path = Path(getattr(getattr(self.target, "config", None), "_name_or_path", "") or ".") / "tokenizer.json"
            if not path.is_file() or not self.eos_token_ids:
                raise ValueError("this server cannot constrain output to a grammar: the target has no "
                                 "tokenizer.json or no EOS token")
            self._grammar_tokenizer = llguidance.LLTokenizer(path.read_text(), n_vocab=self.vocab_size,
                                                             eos_token=self.eos_token_ids[0])
        return self._grammar_tokenizer

    def _set_logit_opts(self, req: _Request) -> None:
        """The request's :class:`LogitOptions` and count tensors (left None when nothing is on)."""
        s = req.sampling
        terminators = tuple(dict.fromkeys((() if s.ignore_eos else tuple(self.eos_token_ids)) + s.stop_token_ids))
        opts = LogitOptions(float(s.presence_penalty), float(s.frequency_penalty), float(s.repetition_penalty),
                            tuple((int(t), float(b)) for t, b in s.logit_bias.items()), s.min_tokens, terminators,
                            float(s.min_p))
        if not (opts.changes_logits or opts.min_p > 0):
            return
        req.logit_opts = opts
        if opts.needs_counts:
            req.out_counts = token_counts([], self.vocab_size)
            req.prompt_mask = token_counts(req.prompt_ids, self.vocab_size) > 0

    def abort(self, request_id: str) -> None:
        """Free a request's KV slot and drafter context (idempotent); the slot caches nothing."""
        self._release(request_id, keep=False)

    def _release(self, request_id: str, keep: bool) -> None:
        """Free a request's KV slot and drafter context (idempotent). ``keep``: a finished request
        leaves its committed positions (ids, KV, features) as the slot's cached prefix."""
        req = self._reqs.pop(request_id, None)
        if req is None:
            return
        tokens = feats = None
        if keep and req.decoding and req.hist_ids:
            tokens = req.hist_ids
            if self.drafter is not None:
                feats = torch.cat(req.hist_feats)  # a copy: never a view pinning a whole step's features
        self.runner.cache.free(req.slot, tokens, feats)
        self.policy.release(request_id)
        if req.pending is not None and not isinstance(req.pending, BaseException):
            self.drafter.discard(req.pending)
        if self.drafter is not None and req.spec.method != "ar" and req.decoding:
            self.drafter.release(request_id)

    def step(self, request_id: str) -> RoundOutput:
        """Run one request alone until it emits (its first call prefills, in chunks, and emits the
        first token; later calls run one round).

        Raises:
            KeyError: unknown request id; whatever its round raised (the request is then freed).
        """
        self._resolve_waits(force=frozenset([request_id]))  # alone: no other request's prefill to wait for
        while True:
            out = self.step_batch([request_id])[request_id]
            if isinstance(out, BaseException):
                raise out
            if out is not None:
                return out

    def step_batch(self, request_ids: list[str]) -> dict[str, RoundOutput | BaseException | None]:
        """One step: plan (:meth:`plan_step`), draft for the decoding requests, one target forward
        for every scheduled row, then walk / commit / emit per request.

        Requests are taken in the plan's order while the step has rows left (``max_step_tokens``;
        the first always runs): decoding requests' verify rows first, then prompt chunks of
        requests being prefilled (``prefill_chunk`` each at most). A request waiting for another's
        prefill (prefix sharing: :meth:`_place`) sits steps out until that prefill has committed
        the prompt positions they share; then the positions are copied into its slot and it
        prefills the rest.

        Args:
            request_ids: candidates in priority order (each at most once).

        Returns:
            For each request that ran: its :class:`RoundOutput`, ``None`` for a prompt chunk that
            emitted nothing yet, or the exception its round raised (that request is freed; the
            others are unaffected). Requests left out of the step (or waiting) are absent.
        Raises:
            KeyError: unknown request id. An error of the shared forward itself propagates (every
            request of the step is freed).
        """
        t_step = time.perf_counter()
        if self._forget_contexts and not self.drafter_up:
            self._forget_contexts = False
            self._release_drafter_contexts()
        self._resolve_waits()
        plan = self.plan_step([r for r in request_ids if self._reqs[r].wait_for is None])
        reqs = {e.rid: self._reqs[e.rid] for e in plan.entries}
        infos = {e.rid: RoundInfo(e.rid, reqs[e.rid].spec.method, reqs[e.rid].sampling.temperature,
                                  can_draft=e.can_draft, explicit_budget=reqs[e.rid].spec.budget is not None,
                                  owed=e.owed, remaining=reqs[e.rid].sampling.max_tokens - reqs[e.rid].generated)
                 for e in plan.decodes}
        self.policy.begin_step(list(infos.values()), extra_rows=plan.chunk_rows, num_running=len(self._reqs))
        results: dict[str, RoundOutput | BaseException | None] = {}
        t_sub = time.perf_counter()
        self._submit_drafts(plan, reqs)
        submit_wait = time.perf_counter() - t_sub  # an in-process drafter drafts right here
        items = self._decode_rounds(plan, reqs, infos, results)
        items += self._prompt_chunks(plan, reqs, items)
        if not items:  # every request waited (prefix sharing) or failed its draft: an empty step
            self.last_step = StepStats()
            return results
        self._execute(items, results)
        self._resolve_waits()  # copy a just-committed prefix now: a later admission may take its slot
        draft_s = sum(p.timings.get("draft", 0.0) + p.timings.get("tree_build", 0.0) for p in items)
        wait_s = submit_wait + sum(p.timings.get("draft_wait", 0.0) for p in items)
        self.last_step = StepStats(len(items), sum(p.segment.num_rows for p in items),
                                   sum(p.segment.num_rows for p in items if p.buffers is None),
                                   items[0].timings["verify"], draft_s, wait_s,
                                   decoding=sum(1 for p in items if p.buffers is not None),
                                   drafting=sum(1 for p in items if p.drafted),
                                   draft_owed=sum(infos[p.rid].owed for p in items if p.drafted),
                                   speculating=sum(1 for p in items if p.tree is not None and p.tree.num_nodes),
                                   wall_seconds=time.perf_counter() - t_step,
                                   predicted_seconds=self.policy.predicted_step_seconds())
        self.policy.observe_step(self.last_step)
        return results

    def _submit_drafts(self, plan: StepPlan, reqs: dict[str, _Request]) -> None:
        """Every decode round's draft that is not already in flight, as ONE drafter call (a request
        the policy gives a plain round is marked to skip its drafter call)."""
        pairs = []
        for e in plan.decodes:
            req = reqs[e.rid]
            if req.pending is None and e.can_draft:
                job = self._draft_job(e.rid, req)
                if job is None:
                    req.skip_round = True  # the policy chose a plain round: no drafter call
                else:
                    pairs.append((req, job))
        self._submit(pairs)

    def _decode_rounds(self, plan: StepPlan, reqs: dict[str, _Request], infos: dict[str, RoundInfo],
                       results: dict) -> list[_Planned]:
        """The decode rounds that fit (``nodes + 1`` rows each while rows are left; the first always
        runs) with their trees collected, cut by the policy and laid out as verify segments. A round
        whose draft failed is freed and its error put in ``results``."""
        items: list[_Planned] = []
        left = plan.max_step_tokens
        for e in plan.decodes:
            if left > 0 or not items:
                try:
                    item = self._plan_round(e.rid, reqs[e.rid])
                except Exception as exc:
                    self.abort(e.rid)
                    results[e.rid] = exc
                    continue
                items.append(item)
                left -= item.tree.num_nodes + 1
        if items:  # the policy cuts each tree to its budget (prefix-closed), then the rows are laid out
            chosen = self.policy.select([Drafted(infos[p.rid], p.tree, p.drafted) for p in items])
            for p in items:
                sel = chosen[p.rid]
                p.tree, p.predicted_tau = sel.tree, sel.predicted_tau
                p.buffers = derive_buffers(p.tree, p.req.root)
                b = p.buffers
                p.segment = Segment(b.input_ids, b.position_offsets, b.tree_mask, p.req.start, p.req.slot,
                                    b.parent_rows)
        return items

    def _prompt_chunks(self, plan: StepPlan, reqs: dict[str, _Request], rounds: list[_Planned]) -> list[_Planned]:
        """The prompt chunks, each shrunk to the rows the decode ``rounds`` left (at least one row
        each while any are left; the first entry of a step always runs)."""
        items: list[_Planned] = []
        left = plan.max_step_tokens - sum(p.segment.num_rows for p in rounds)
        for e in plan.chunks:
            if left > 0 or not (rounds or items):
                req, (first, most) = reqs[e.rid], e.chunk
                n = min(most, max(left, 1))
                items.append(_Planned(e.rid, req, causal_segment(req.prompt_ids[first:first + n], first, e.slot),
                                      final_chunk=first + n == len(req.prompt_ids)))
                left -= n
        return items

    def _execute(self, items: list[_Planned], results: dict) -> None:
        """The step's one forward, then walk / commit / emit per request into ``results`` (a finished
        or failed request is freed), then the overlapped next drafts as one submission."""
        self._next_jobs: list[tuple[_Request, DraftJob]] = []
        out = self._forward(items)
        for item, (logits, feats) in zip(items, out):
            try:
                results[item.rid] = self._finish(item, logits, feats)
            except Exception as exc:
                self.abort(item.rid)
                results[item.rid] = exc
                continue
            if isinstance(results[item.rid], RoundOutput) and results[item.rid].finish_reason is not None:
                self._release(item.rid, keep=True)
        self._submit(self._next_jobs)

    def plan_step(self, request_ids: list[str]) -> StepPlan:
        """The :class:`StepPlan` of a step over ``request_ids`` (priority order; repeats ignored):
        each request's slot, prompt progress, whether a decode round may draft, and its drafter's
        owed context (:func:`services.verifier.scheduler.plan_step`).

        Raises:
            KeyError: unknown request id.
        """
        cands = []
        for rid in dict.fromkeys(request_ids):
            req = self._reqs[rid]
            can_draft = req.decoding and req.spec.method != "ar" and self.drafter_up \
                and self.draft_depth(req.start) > 0
            cands.append(Candidate(rid, req.slot, len(req.prompt_ids), req.prefilled, can_draft, len(req.ctx_ids)))
        return plan_step(cands, self.config.max_step_tokens, self.config.prefill_chunk)

    def _forward(self, plan: list[_Planned]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The step's one target forward: ``(logits [rows needing logits, V], features [R_i, F])`` per item."""
        sizes = [p.segment.num_rows for p in plan]
        cu = [0]
        for n in sizes:
            cu.append(cu[-1] + n)
        keep, spans = [], []
        for p, a, b in zip(plan, cu[:-1], cu[1:]):
            rows = list(range(a, b)) if p.buffers is not None else ([b - 1] if p.final_chunk else [])
            spans.append((len(keep), len(keep) + len(rows)))
            keep.extend(rows)
        try:
            step = self.runner.execute([p.segment for p in plan], torch.tensor(keep, dtype=torch.long))
        except BaseException:
            for p in plan:
                self.abort(p.rid)
            raise
        for p in plan:
            p.timings["verify"] = step.seconds
        return [(step.logits[s:e], step.features[a:b]) for (s, e), a, b in zip(spans, cu[:-1], cu[1:])]

    @staticmethod
    def _sample(req: _Request, logits: torch.Tensor, positions: torch.Tensor, buffers=None) -> torch.Tensor:
        """One token per row of ``logits [R, V]``; row i predicts the token at absolute position
        ``positions[i]`` (``[R]`` long) and, at T > 0, draws it with that position's uniform, so a
        seeded request's tokens do not depend on how many rows a round verifies (accept.py).

        With logit processors on, each row's logits are processed as if its path had been emitted
        token by token (``buffers``: the round's verify buffers; None for the prompt's last row). A
        grammar masks each row first, at its own path's state (services/tree/grammar.py).
        """
        s = req.sampling
        u = None if s.temperature == 0 else position_uniforms(req.sample_seed, positions)
        if req.grammar is not None:
            if buffers is None:
                allowed, req.grammar_masked = req.grammar.current_mask(), 0
            else:
                allowed, req.grammar_masked = req.grammar.tree_masks(buffers.input_ids, buffers.parent_rows)
            logits = mask_logits(logits, allowed)
        opts = req.logit_opts
        if opts is None:
            return sample_target_tokens(logits, s.temperature, s.top_p, s.top_k, uniforms=u)
        counts = None
        if opts.needs_counts:
            if req.out_counts.device != logits.device:  # once: the counts live with the logits
                req.out_counts, req.prompt_mask = req.out_counts.to(logits.device), req.prompt_mask.to(logits.device)
            counts = (req.out_counts[None, :] if buffers is None
                      else path_counts(req.out_counts, buffers.input_ids, buffers.tree_mask))
        out_index = positions - len(req.prompt_ids)
        x = process_logits(logits, opts, counts, None if req.prompt_mask is None else req.prompt_mask, out_index)
        return sample_processed(x, s.temperature, s.top_p, s.top_k, opts.min_p, uniforms=u)

    @staticmethod
    def _count(req: _Request, ids: list[int]) -> None:
        """Add emitted ``ids`` to the request's output counts (a penalty is on)."""
        if req.out_counts is not None and ids:
            req.out_counts += token_counts(ids, req.out_counts.shape[0], device=req.out_counts.device)

    def _emit(self, req: _Request, tokens: list[int]) -> tuple[list[int], str | None]:
        """Commit semantics: cut at the first terminator (excluded) or when max_tokens is reached.
        With a grammar, EOS always ends the request and so does the grammar's last token (included).
        A stop id that is not an EOS the request stops on is kept in ``req.stop_token_id``."""
        s = req.sampling
        out: list[int] = []
        for tok in tokens:
            eos = tok in self.eos_token_ids and (not s.ignore_eos or req.grammar is not None)
            if eos or tok in s.stop_token_ids:
                req.stop_token_id = None if eos else tok
                return out, "stop"
            out.append(tok)
            req.generated += 1
            if req.grammar is not None:
                req.grammar.advance(tok)
                if req.grammar.finished:
                    return out, "stop"
            if req.generated >= s.max_tokens:
                return out, "length"
        return out, None

    @staticmethod
    def _logprobs(req: _Request, logits: torch.Tensor, rows: torch.Tensor, ids: list[int]) -> TokenLogprobs | None:
        """Logprobs of the emitted ``ids``; ``ids[i]`` came from ``logits[rows[i]]`` (None unless asked)."""
        k = req.sampling.logprobs
        return None if k is None else token_logprobs(logits[rows[:len(ids)].to(logits.device)], ids, k)

    def draft_depth(self, start: int) -> int:
        """Deepest draft allowed for a root at position ``start``: the positions left after the root
        in the target's context and below the drafter's position limit, capped at ``max_draft_depth``
        (<= 0: a plain round)."""
        room = self.max_context - start - 1
        if self.drafter_max_position:
            room = min(room, self.drafter_max_position - start - 1)
        return min(room, self.max_draft_depth)

    def _plan_round(self, rid: str, req: _Request) -> _Planned:
        """Collect the request's submitted draft (none: ``ar``, no room, or the policy chose a plain
        round: an empty tree); the verify rows are laid out by ``step_batch`` once the policy has
        cut the tree."""
        t0 = time.perf_counter()
        timings: dict[str, float] = {}
        tree = DraftTree.empty()
        drafted = skipped = False
        if req.pending is not None:
            handle, req.pending = req.pending, None
            try:
                if isinstance(handle, BaseException):
                    raise handle
                tree, dt = self.drafter.collect(handle)
                timings.update(dt)
                drafted = True
            except DrafterUnavailable as exc:
                self._drafter_lost(exc)  # this round (and each other pending one) runs plainly
        elif req.skip_round:
            req.skip_round, skipped = False, True
        timings["draft_wait"] = time.perf_counter() - t0
        timings["_t0"] = t0
        return _Planned(rid, req, None, tree=tree, timings=timings, drafted=drafted, skipped=skipped)

    def _drafter_lost(self, exc: Exception) -> None:
        """A draft failed with :class:`DrafterUnavailable`: stop drafting until the drafter is up
        again (:meth:`set_drafter_up`) and release every request's drafter context, which turns every
        other submitted draft into a plain round (their replies cannot come either: the client has
        dropped the connection)."""
        if self.drafter_up:
            log.warning("drafter unavailable, decoding plainly until it is back: %s", exc)
        self.drafter_up, self._forget_contexts = False, False
        self._release_drafter_contexts()

    def _release_drafter_contexts(self) -> None:
        """Release every running request's drafter context and discard its submitted draft (their
        next drafts resend the history)."""
        for rid, r in self._reqs.items():
            if r.decoding and r.spec.method != "ar":
                if r.pending is not None and not isinstance(r.pending, BaseException):
                    self.drafter.discard(r.pending)
                r.pending, r.resync = None, True
                self.drafter.release(rid)

    def _resync(self, rid: str, req: _Request) -> None:
        """Make the request's next draft carry its whole committed history (a drafter that lost its
        context rebuilds it from these ids and features, as after a prefill)."""
        self.drafter.release(rid)  # the client forgets the old drafter process's context
        req.ctx_feats = torch.cat(req.hist_feats) if len(req.hist_feats) > 1 else req.hist_feats[0]
        req.hist_feats = [req.ctx_feats]
        req.ctx_ids, req.owed_feats, req.resync = list(req.hist_ids), [], False

    def _draft_job(self, rid: str, req: _Request) -> DraftJob | None:
        """The next draft of a decoding request (None: ``ar``, no room left for a draft, the
        drafter is down, or the policy chose a plain round)."""
        depth = self.draft_depth(req.start)
        if req.spec.method == "ar" or depth <= 0 or not self.drafter_up:
            return None
        knobs = self.policy.draft_knobs(rid, req.spec)  # resolved; None: the policy chose a plain round
        if knobs is None:
            return None
        if req.resync:
            self._resync(rid, req)
        return DraftJob(rid, list(req.ctx_ids), self._ctx_feats(req), req.root, req.start, req.spec.method, knobs,
                        depth)

    @staticmethod
    def _ctx_feats(req: _Request) -> torch.Tensor | None:
        """The request's context features for a draft, with the rows of plain rounds since the last
        draft appended (once, here: a per-round ``torch.cat`` would copy the whole context every round).

        The context's parts are also the last entries of ``hist_feats`` (the same tensors), which
        then take the concatenation in their place: the history keeps the same rows without a
        second copy of them (after a prompt, ``F`` x 2 bytes a prompt position in bfloat16).
        """
        if req.owed_feats:
            parts = [req.ctx_feats, *req.owed_feats]
            req.ctx_feats = torch.cat(parts)
            req.owed_feats = []
            tail = req.hist_feats[-len(parts):]
            if len(tail) == len(parts) and all(a is b for a, b in zip(tail, parts)):
                req.hist_feats[-len(parts):] = [req.ctx_feats]
        return req.ctx_feats

    def _submit(self, pairs: list[tuple[_Request, DraftJob]]) -> None:
        """Start the drafts of ``pairs`` as ONE batched drafter call; each request's round collects
        its own. A failed submission fails those requests' next round."""
        if not pairs:
            return
        try:
            handles = self.drafter.submit([job for _, job in pairs])
        except Exception as exc:
            handles = [exc] * len(pairs)
        for (req, _), h in zip(pairs, handles):
            req.pending = h

    def _queue_next(self, rid: str, req: _Request) -> None:
        """With overlap: queue the request's next draft, submitted for the whole step at its end."""
        if self.config.overlap:
            job = self._draft_job(rid, req)
            if job is not None:
                self._next_jobs.append((req, job))

    def _finish(self, item: _Planned, logits: torch.Tensor, feats: torch.Tensor) -> RoundOutput | None:
        """Per request after the forward: the first token of a finished prefill, or walk + commit + emit."""
        req = item.req
        if item.buffers is None:
            return self._finish_chunk(item, logits, feats)
        t2 = time.perf_counter()
        buffers, timings = item.buffers, item.timings
        target_tokens = self._sample(req, logits, req.start + 1 + buffers.position_offsets, buffers)
        if req.logit_opts is not None or req.grammar is not None:
            timings["sampling"] = time.perf_counter() - t2  # logit processors + grammar masks + sampling
        res = walk(buffers, target_tokens.cpu())
        self.runner.cache.commit(req.slot, req.start, res.accepted_rows)
        rows = res.accepted_rows
        accepted = buffers.input_ids[rows[1:]].tolist()
        ids, finish = self._emit(req, accepted + [res.bonus_token])
        self._count(req, ids)
        new_ids, new_feats = buffers.input_ids[rows].tolist(), feats[rows.to(feats.device)]
        if item.skipped and req.ctx_feats is not None:  # no drafter call: its context still owes these
            req.ctx_ids.extend(new_ids)
            req.owed_feats.append(new_feats)
        else:
            req.ctx_ids, req.ctx_feats, req.owed_feats = new_ids, new_feats, []
            if not item.drafted and req.spec.method != "ar" and self.drafter is not None:
                req.resync = True  # a plain round the drafter never heard of (it was down): resend the history
        req.hist_ids.extend(new_ids)
        if self.drafter is not None:
            req.hist_feats.append(new_feats)
        req.start += rows.numel()
        self.policy.observe_round(item.rid, accepted + [res.bonus_token])
        req.root = res.bonus_token
        if finish is None:
            self._queue_next(item.rid, req)
        t3 = time.perf_counter()
        n_acc = min(len(ids), len(accepted))
        t0 = timings.pop("_t0")
        timings.update(commit=t3 - t2, total=t3 - t0)
        return RoundOutput(ids, finish, num_draft_tokens=item.tree.num_nodes, accept_length=n_acc,
                           accepted_per_depth=[1] * n_acc, timings=timings,
                           logprobs=self._logprobs(req, logits, rows, ids), drafted=item.drafted,
                           predicted_tau=item.predicted_tau, grammar_masked=req.grammar_masked,
                           stop_token_id=req.stop_token_id)

    def _finish_chunk(self, item: _Planned, logits: torch.Tensor, feats: torch.Tensor) -> RoundOutput | None:
        req = item.req
        n = item.segment.num_rows
        self.runner.cache.extend(req.slot, n)
        req.prefilled += n
        if self.drafter is not None:
            req.chunk_feats.append(_owned(feats))
        req.prefill_seconds += item.timings["verify"]
        if not item.final_chunk:
            return None
        t0 = time.perf_counter()
        first = int(self._sample(req, logits, torch.tensor([len(req.prompt_ids)]))[0])
        req.start, req.root = len(req.prompt_ids), first
        req.ctx_ids = list(req.prompt_ids)
        req.ctx_feats = None if not req.chunk_feats else \
            torch.cat(req.chunk_feats) if len(req.chunk_feats) > 1 else req.chunk_feats[0]
        req.chunk_feats = []
        req.hist_ids = list(req.prompt_ids)
        req.hist_feats = [req.ctx_feats] if self.drafter is not None else []
        ids, finish = self._emit(req, [first])
        self._count(req, ids)
        if finish is None:
            self._queue_next(item.rid, req)
        dt = req.prefill_seconds + time.perf_counter() - t0
        return RoundOutput(ids, finish, timings={"total": dt}, prefill_seconds=dt, is_prefill=True,
                           logprobs=self._logprobs(req, logits, torch.zeros(1, dtype=torch.long), ids),
                           cached_tokens=req.cached, stop_token_id=req.stop_token_id)

    def generate(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, spec: SpecParams):
        """Yield :class:`RoundOutput` until the request finishes (convenience for CLI and tests)."""
        self.add_request(request_id, prompt_ids, sampling, spec)
        while True:
            out = self.step(request_id)
            yield out
            if out.finish_reason is not None:
                return


def _owned(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when it spans its whole storage, else a copy: a prompt chunk's ``[n, F]``
    features are a slice of its step's ``[R, F]`` features, which the slice would keep alive
    (every request of the step until each has finished its prefill)."""
    whole = t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t if whole and t.is_contiguous() else t.clone()

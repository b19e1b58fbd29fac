"""The speculative decode loop in batched steps: draft -> one target forward -> walk -> commit.

One loop for every method (docs/design.md, "One engine loop"). A *step* is one forward of the
target for every request of a :class:`~services.verifier.scheduler.StepPlan` (:class:`ModelRunner`
over a slot KV cache); a *round* is one request's draft -> verify -> walk -> commit inside a step;
prompts are prefilled in chunks that ride along with the other requests' rounds. The verifier
worker makes the plan (``scheduler.make_plan`` over :meth:`SpecEngine.candidates`) and
:meth:`SpecEngine.step` runs exactly it. Clock rules: docs/algorithms.md §6.

The concerns around the step live beside this file: a request's state and its commit rule
(``requests.py``), each request's part of a step and the bookkeeping around the forward
(``step_items.py``), the device commit (``step_commit.py``), the drafter's outbox and link
(``drafts.py``), per-path sampling and logprobs (``sampling.py``), prefix placement
(``prefix_cache.py``), the plan (``scheduler.py``), the policy (``policy.py``).
"""

from __future__ import annotations

import logging
import time

import torch

from services.params import SamplingParams, SpecParams
from services.spec import MAX_BUDGET
from services.tree.grammar import GrammarState
from services.verifier import prefix_cache
from services.verifier.config import EngineConfig
from services.verifier.drafter_client import DraftJob, DrafterClient
from services.verifier.drafts import DrafterLink, owned
from services.verifier.policy import Drafted, FixedPolicy
from services.verifier.requests import RequestState, RoundOutput, StepStats, commit_prefill, commit_round
from services.verifier.runner import ModelRunner
from services.verifier.sampling import (Sampler, TokenLogprobs, compile_grammar, grammar_tokenizer,  # noqa: F401
                                        token_logprobs)
from services.verifier.scheduler import Candidate, RoundInfo, StepPlan, make_plan
from services.verifier.step_commit import HostReads
from services.verifier.step_items import (StepItem, commit_on_device, lay_out_round, logit_rows, prompt_chunks,
                                          step_stats)

log = logging.getLogger(__name__)


class SpecEngine:
    """Runs requests in batched steps over a :class:`TargetModel` and a :class:`DrafterClient`.

    A *step* is one target forward (:class:`ModelRunner`) holding every planned request's rows: a
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
        self.target = target
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
        self._reqs: dict[str, RequestState] = {}
        self.last_step = StepStats()
        self.round_reads = HostReads()  # device-to-host copies of committed rounds (one per step)
        self.drafts = DrafterLink(drafter, self.draft_depth)
        self._next_jobs: list[tuple[RequestState, DraftJob]] = []

    @property
    def drafter(self) -> DrafterClient | None:
        """The drafter client (None = AR only); assignable, e.g. to wrap it in a recording proxy."""
        return self.drafts.drafter

    @drafter.setter
    def drafter(self, client: DrafterClient | None) -> None:
        self.drafts.drafter = client

    @property
    def drafter_up(self) -> bool:
        """Whether drafts may be requested (:meth:`set_drafter_up`)."""
        return self.drafts.up

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
        self.drafts.set_up(up)

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
        prefix cache only the part of the prompt no slot holds yet is prefilled
        (:func:`services.verifier.prefix_cache.place`).

        Raises:
            ValueError: empty prompt, ids outside the vocabulary, a parameter out of range
                (:class:`~services.params.ParamError` from their ``check()``), prompt + max_tokens
                beyond the context window, a drafting method without a drafter, a duplicate id, or
                no free slot.
        """
        if request_id in self._reqs:
            raise ValueError(f"request id {request_id!r} is already active")
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if any((not isinstance(t, int)) or t < 0 or t >= self.vocab_size for t in prompt_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        sampling.check(self.vocab_size)
        spec.check()
        method = spec.method_or()
        if len(prompt_ids) + sampling.max_tokens > self.max_context:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({sampling.max_tokens}) exceeds the "
                             f"context window of {self.max_context} tokens")
        if method.drafts and self.drafter is None:
            raise ValueError(f"method {method.value!r} needs a drafter; this server runs without one")
        if self.runner.cache.num_free() == 0:
            raise ValueError(f"all {self.config.max_running} KV slots are in use (max_running)")
        grammar = None if sampling.grammar is None else self.compile_grammar(sampling.grammar)
        sampler = Sampler(sampling, prompt_ids, self.vocab_size, self.eos_token_ids, grammar)
        req = RequestState(list(prompt_ids), sampling, spec, method, sampler)
        prefix_cache.place(self.runner.cache, self._reqs, request_id, req, self.drafter is not None)
        self._reqs[request_id] = req

    def compile_grammar(self, grammar: str) -> GrammarState:
        """A request's :class:`GrammarState` for an llguidance ``grammar`` (:func:`compile_grammar`
        with the grammar tokenizer given, else built once from the target's directory).

        Raises:
            ValueError: the grammar does not compile, or the target has no grammar tokenizer.
        """
        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = grammar_tokenizer(self.target, self.vocab_size, self.eos_token_ids)
        return compile_grammar(self._grammar_tokenizer, grammar, self.vocab_size)

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
                feats = torch.cat(req.drafts.hist_feats)  # a copy: never a view pinning a whole step's features
        self.runner.cache.free(req.slot, tokens, feats)
        self.policy.release(request_id)
        self.drafts.release(request_id, req)

    def draft_depth(self, start: int) -> int:
        """Deepest draft allowed for a root at position ``start``: the positions left after the root
        in the target's context and below the drafter's position limit, capped at ``max_draft_depth``
        (<= 0: a plain round)."""
        room = self.max_context - start - 1
        if self.drafter_max_position:
            room = min(room, self.drafter_max_position - start - 1)
        return min(room, self.max_draft_depth)

    # ------------------------------------------------------------------------------------- a step

    def candidates(self, request_ids: list[str], alone: bool = False) -> list[Candidate]:
        """The requests of ``request_ids`` (priority order; repeats ignored) that may run in the next
        step, as the planner sees them (``scheduler.make_plan``): slot, prompt progress, whether a
        decode round may draft, its drafter's owed context, a draft already in flight.

        Before that, on this (the compute) thread: a drafter that went down has every request's
        drafter context released, and waiting requests whose leader has committed the shared
        prompt start (prefix sharing); a request still waiting is left out. ``alone``: the
        requests run without the others (:meth:`generate`): a waiting one starts now from what is
        committed.

        Raises:
            KeyError: unknown request id.
        """
        if self.drafts.forget_contexts and not self.drafts.up:
            self.drafts.forget_contexts = False
            self.drafts.release_all(self._reqs)
        force = frozenset(request_ids) if alone else frozenset()
        prefix_cache.resolve_waits(self.runner.cache, self._reqs, self.drafter is not None, force)
        out = []
        for rid in dict.fromkeys(request_ids):
            req = self._reqs[rid]
            if req.wait_for is not None:
                continue
            can, owed = self.drafts.can_draft(req), len(req.drafts.ctx_ids)
            out.append(Candidate(rid, req.slot, len(req.prompt_ids), req.prefilled, can, owed,
                                 info=req.round_info(rid, can, owed) if req.decoding else None, spec=req.spec,
                                 depth=self.draft_depth(req.start), tree=req.method.is_tree,
                                 in_flight=req.drafts.pending_knobs if req.drafts.pending is not None else None))
        return out

    def plan(self, request_ids: list[str], alone: bool = False) -> StepPlan:
        """The plan of a step over ``request_ids`` with this engine's policy and limits
        (``scheduler.make_plan`` over :meth:`candidates`): what the verifier worker does itself.

        Raises:
            KeyError: unknown request id.
        """
        return make_plan(self.candidates(request_ids, alone), self.policy, self.config.max_step_tokens,
                         self.config.prefill_chunk, len(self._reqs))

    def step_batch(self, request_ids: list[str], alone: bool = False) -> dict[str, RoundOutput | BaseException | None]:
        """:meth:`step` of :meth:`plan` (tools, tests and benchmarks that do not plan themselves)."""
        return self.step(self.plan(request_ids, alone))

    def step(self, plan: StepPlan) -> dict[str, RoundOutput | BaseException | None]:
        """Run ``plan``: draft for its decode rounds (one drafter call, with each entry's knobs; an
        entry without knobs is a plain round), one target forward for every entry's rows, then walk /
        commit / emit per request. Prompt chunks are exactly the plan's.

        Returns:
            For each request that ran: its :class:`RoundOutput`, ``None`` for a prompt chunk that
            emitted nothing yet, or the exception its round raised (that request is freed; the
            others are unaffected).
        Raises:
            KeyError: a request of the plan is not running. An error of the shared forward itself
            propagates (every request of the step is freed).
        """
        t_step = time.perf_counter()
        reqs = {e.rid: self._reqs[e.rid] for e in plan.entries}
        infos = {e.rid: reqs[e.rid].round_info(e.rid, e.can_draft, e.owed) for e in plan.decodes}
        results: dict[str, RoundOutput | BaseException | None] = {}
        t_sub = time.perf_counter()
        self._submit_drafts(plan, reqs)
        submit_wait = time.perf_counter() - t_sub  # an in-process drafter drafts right here
        items = self._decode_rounds(plan, reqs, infos, results)
        items += prompt_chunks(plan, reqs)
        if not items:  # every round failed its draft: an empty step
            self.last_step = StepStats()
            return results
        reads = self.round_reads.count
        self._execute(items, results)
        prefix_cache.resolve_waits(self.runner.cache, self._reqs, self.drafter is not None)  # before an admission
        self.last_step = step_stats(items, infos, submit_wait, time.perf_counter() - t_step,
                                    self.round_reads.count - reads, self.device_walk,
                                    self.policy.predicted_step_seconds())
        self.policy.observe_step(self.last_step)
        return results

    def _submit_drafts(self, plan: StepPlan, reqs: dict[str, RequestState]) -> None:
        """Every decode round's draft that is not already in flight, with the plan's knobs, as ONE
        drafter call (a drafting round the plan gave no knobs is marked a plain round)."""
        jobs = []
        for e in plan.decodes:
            req = reqs[e.rid]
            if req.drafts.pending is not None:
                continue
            if e.knobs is not None:
                jobs.append((req, self.drafts.job(e.rid, req, e.knobs)))
            elif e.can_draft:
                req.drafts.skip_round = True  # the policy chose a plain round: no drafter call
        self.drafts.submit(jobs)

    def _decode_rounds(self, plan: StepPlan, reqs: dict[str, RequestState], infos: dict[str, RoundInfo],
                       results: dict) -> list[StepItem]:
        """The plan's decode rounds with their trees collected, cut by the policy and laid out as
        verify segments. A round whose draft failed is freed and its error put in ``results``."""
        items: list[StepItem] = []
        for e in plan.decodes:
            try:
                tree, timings, drafted, skipped = self.drafts.collect(reqs[e.rid], self._reqs)
            except Exception as exc:
                self.abort(e.rid)
                results[e.rid] = exc
                continue
            items.append(StepItem(e.rid, reqs[e.rid], None, tree=tree, timings=timings, drafted=drafted,
                                  skipped=skipped))
        if items:  # the policy cuts each tree to its budget (prefix-closed), then the rows are laid out
            chosen = self.policy.select([Drafted(infos[p.rid], p.tree, p.drafted) for p in items])
            for p in items:
                lay_out_round(p, chosen[p.rid].tree, chosen[p.rid].predicted_tau)
        return items

    @property
    def device_walk(self) -> bool:
        """Whether decode rounds commit on the device (:mod:`~services.verifier.step_commit`):
        ``config.device_walk``, where None = on unless the target runs on the CPU (there a plain step
        spends ~0.8 ms outside its forward with the host walk, ~1.9 ms with the device walk:
        ``docs/roofline.md``, "Committing a round")."""
        if self.config.device_walk is not None:
            return self.config.device_walk
        return torch.device(self.target.device).type != "cpu"

    def _execute(self, items: list[StepItem], results: dict) -> None:
        """The step's one forward, then walk / commit / emit per request into ``results`` (a finished
        or failed request is freed), then the overlapped next drafts as one submission."""
        self._next_jobs = []
        out = self._forward(items)
        committed = commit_on_device(items, out, self.runner.cache, self.eos_token_ids, self.round_reads,
                                     self.drafter is not None) if self.device_walk else {}
        for item, (logits, feats) in zip(items, out):
            try:
                results[item.rid] = self._finish(item, logits, feats, committed.get(item.rid))
            except Exception as exc:
                self.abort(item.rid)
                results[item.rid] = exc
                continue
            if isinstance(results[item.rid], RoundOutput) and results[item.rid].finish_reason is not None:
                self._release(item.rid, keep=True)
        self.drafts.submit(self._next_jobs)

    def _forward(self, plan: list[StepItem]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The step's one target forward: ``(logits [rows needing logits, V], features [R_i, F])`` per item."""
        keep, spans, cu = logit_rows(plan)
        try:
            step = self.runner.execute([p.segment for p in plan], torch.tensor(keep, dtype=torch.long))
        except BaseException:
            for p in plan:
                self.abort(p.rid)
            raise
        for p in plan:
            p.timings["verify"] = step.seconds
        return [(step.logits[s:e], step.features[a:b]) for (s, e), a, b in zip(spans, cu[:-1], cu[1:])]

    def _queue_next(self, rid: str, req: RequestState) -> None:
        """With overlap: queue the request's next draft, submitted for the whole step at its end, with
        the knobs the policy resolves now (the next step's plan carries them as the draft in flight)."""
        if self.config.overlap and self.drafts.can_draft(req):
            knobs = self.policy.draft_knobs(rid, req.spec)  # None: the policy chose a plain round
            if knobs is not None:
                self._next_jobs.append((req, self.drafts.job(rid, req, knobs)))

    def _finish(self, item: StepItem, logits: torch.Tensor, feats: torch.Tensor, c=None) -> RoundOutput | None:
        """Per request after the forward: the first token of a finished prefill, or commit + emit (``c``:
        the round committed on the device, a :class:`Committed` or the exception it raised; None: walk
        and commit on the host now, :func:`commit_round`)."""
        req = item.req
        if item.buffers is None:
            return self._finish_chunk(item, logits, feats)
        if isinstance(c, BaseException):
            raise c
        t2 = time.perf_counter() - item.timings.pop("_commit", 0.0)
        timings = item.timings
        if c is None:
            c = commit_round(req, item.buffers, logits, feats, self.runner.cache, self.eos_token_ids, item.skipped,
                             item.drafted, self.drafter is not None)
        if req.sampler.processes:
            timings["sampling"] = c.sampling_seconds  # logit processors + grammar masks + sampling
        self.policy.observe_round(item.rid, c.path)
        if c.finish is None:
            self._queue_next(item.rid, req)
        t3 = time.perf_counter()
        n_acc = min(len(c.ids), c.accepted)
        timings.update(commit=t3 - t2, total=t3 - timings.pop("_t0"))
        return RoundOutput(c.ids, c.finish, num_draft_tokens=item.tree.num_nodes, accept_length=n_acc,
                           accepted_per_depth=[1] * n_acc, timings=timings,
                           logprobs=req.sampler.logprobs(logits, c.rows, c.ids), drafted=item.drafted,
                           predicted_tau=item.predicted_tau, grammar_masked=req.sampler.grammar_masked,
                           stop_token_id=req.stop_token_id)

    def _finish_chunk(self, item: StepItem, logits: torch.Tensor, feats: torch.Tensor) -> RoundOutput | None:
        """A prompt chunk is in the slot; after the last one, sample and emit the first token."""
        req = item.req
        n = item.segment.num_rows
        self.runner.cache.extend(req.slot, n)
        req.prefilled += n
        if self.drafter is not None:
            req.drafts.chunk_feats.append(owned(feats))
        req.prefill_seconds += item.timings["verify"]
        if not item.final_chunk:
            return None
        t0 = time.perf_counter()
        ids, finish = commit_prefill(req, logits, self.eos_token_ids, self.drafter is not None)
        if finish is None:
            self._queue_next(item.rid, req)
        dt = req.prefill_seconds + time.perf_counter() - t0
        return RoundOutput(ids, finish, timings={"total": dt}, prefill_seconds=dt, is_prefill=True,
                           logprobs=req.sampler.logprobs(logits, torch.zeros(1, dtype=torch.long), ids),
                           cached_tokens=req.cached, stop_token_id=req.stop_token_id)

    def generate(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, spec: SpecParams):
        """Yield :class:`RoundOutput` until the request finishes, running it alone (its first output
        comes after its prefill, in chunks; convenience for the CLI, tools and tests).

        Raises:
            ValueError: as :meth:`add_request`; whatever a round raised (the request is then freed).
        """
        self.add_request(request_id, prompt_ids, sampling, spec)
        while True:
            out = self.next_output(request_id)
            yield out
            if out.finish_reason is not None:
                return

    def next_output(self, request_id: str) -> RoundOutput:
        """Run request ``request_id`` alone until it emits: its prefill (in chunks) and first token,
        or one round; a request waiting for another's prefill starts from what is committed.

        Raises:
            KeyError: unknown request id; whatever its round raised (the request is then freed).
        """
        while True:
            out = self.step_batch([request_id], alone=True)[request_id]
            if isinstance(out, BaseException):
                raise out
            if out is not None:
                return out

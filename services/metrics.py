"""Speculative-decoding counters (plain ints) and the Prometheus adapters of each process.

Every metric name is defined here once (docs/design.md "Metrics"). Each process
owns a disjoint set and exports it from its own registry:

- verifier: ``dartree_spec_*``, ``dartree_emitted_tokens_total{phase}``, ``dartree_round_seconds{phase}``,
  ``dartree_step_seconds``, ``dartree_request_queue_seconds``,
  ``dartree_num_requests_running`` / ``_waiting``, ``dartree_aborts_total{reason}``,
  ``dartree_spec_scheduled_budget`` / ``_width`` (the ``--tree-schedule`` pick at the current load);
  the speculation policy's ``dartree_spec_policy_*`` (budget per round, predicted vs realised tau,
  predicted vs measured step seconds, steps with / without speculation); ``dartree_verifier_drafter_up``
  (0 while the drafter is unreachable and every round decodes without speculation, and without a drafter);
  ``dartree_verifier_drafter_out_of_memory_total`` (drafts failed because the drafter ran out of device memory);
- gateway: ``dartree_time_to_first_token_seconds``, ``dartree_inter_token_latency_seconds`` (time
  between two streamed rounds of one request), ``dartree_e2e_request_latency_seconds``,
  ``dartree_requests_total{finish_reason}``, ``dartree_prompt_tokens_total``,
  ``dartree_generation_tokens_total``, ``dartree_discarded_tokens_total{reason}``,
  ``dartree_rejected_requests_total{reason}``;
- drafter: ``dartree_drafter_*``, ``dartree_ngram_proposed_nodes_total`` /
  ``dartree_ngram_accepted_nodes_total`` (n-gram drafting: nodes its chains added to trees, and those
  of them on the path the target then emitted); every process: ``dartree_ipc_errors_total{peer}``, ``dartree_info``.

Counting convention (docs/serving.md "Metrics"; held by ``tests/reliability/test_counters.py``):

- ``dartree_generation_tokens_total`` (gateway) counts the completion tokens handed to clients:
  ``usage.completion_tokens`` of each non-streamed response, the tokens of each stream event
  written. The sum of ``usage.completion_tokens`` over requests equals its rise exactly (a stream
  its client closes counts the events written before).
- ``dartree_prompt_tokens_total`` (gateway) counts a request's prompt tokens when its first round
  comes back, i.e. once the verifier ran its prefill (requests closed while queued add nothing).
- ``dartree_emitted_tokens_total{phase}`` (verifier) counts the tokens the verifier sent (prefill:
  each request's first token; round: the tokens of decode rounds); ``dartree_discarded_tokens_total
  {reason}`` (gateway) the ones no client received (past a stop string, or rounds that arrived after
  an abort). So emitted = sum(completion_tokens) + discarded once no request is in flight.
- The verifier's spec counters count decode rounds after their own cut (EOS, stop ids, max_tokens):
  ``accept_length`` counts accepted draft tokens emitted (bonus excluded); the acceptance-length
  histogram observes tokens emitted per round (bonus included), so its mean is tau.
  ``dartree_spec_cut_rounds_total{reason}`` counts the finished rounds that emitted no bonus token,
  so rounds + accepted = acceptance_length_sum + cut rounds.
- ``dartree_round_seconds{phase}`` observes each phase once per decode round that has it (prefill:
  once per prefill); ``dartree_step_seconds`` once per batched step.

PromQL recipes (windows are examples)::

    # tau, mean tokens emitted per round (bonus included)
    sum(rate(dartree_spec_acceptance_length_sum[5m])) / sum(rate(dartree_spec_acceptance_length_count[5m]))
    # the same from counters (cut rounds emitted no bonus token)
    (sum(rate(dartree_spec_rounds_total[5m])) + sum(rate(dartree_spec_accepted_tokens_total[5m]))
      - sum(rate(dartree_spec_cut_rounds_total[5m]))) / sum(rate(dartree_spec_rounds_total[5m]))
    # draft acceptance rate (accepted draft tokens per proposed tree node)
    sum(rate(dartree_spec_accepted_tokens_total[5m])) / sum(rate(dartree_spec_draft_tokens_total[5m]))
    # acceptance by depth d (fraction of rounds whose accepted path reached depth d)
    sum by (depth) (rate(dartree_spec_accepted_tokens_per_depth_total[5m])) / scalar(sum(rate(dartree_spec_rounds_total[5m])))
    # mean round time by phase
    sum by (phase) (rate(dartree_round_seconds_sum[5m])) / sum by (phase) (rate(dartree_round_seconds_count[5m]))
    # p99 time to first token
    histogram_quantile(0.99, sum by (le) (rate(dartree_time_to_first_token_seconds_bucket[5m])))
    # generation throughput (tokens/s)
    sum(rate(dartree_generation_tokens_total[1m]))
    # goodput policy: mean |predicted tau - realised tau| per round, and its bias
    sum(rate(dartree_spec_policy_tau_abs_error_sum[5m])) / sum(rate(dartree_spec_policy_tau_abs_error_count[5m]))
    (sum(rate(dartree_spec_policy_predicted_tau_total[5m])) - sum(rate(dartree_spec_policy_realised_tau_total[5m])))
      / sum(rate(dartree_spec_policy_tau_abs_error_count[5m]))
    # measured / predicted step seconds, and the fraction of steps without speculation
    sum(rate(dartree_spec_policy_step_seconds_total{kind="measured"}[5m]))
      / sum(rate(dartree_spec_policy_step_seconds_total{kind="predicted"}[5m]))
    sum(rate(dartree_spec_policy_steps_total{speculation="none"}[5m])) / sum(rate(dartree_spec_policy_steps_total[5m]))
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

disable_created_metrics()  # no *_created series: they double the exposition and no dashboard uses them

SPEC_ROUNDS = "dartree_spec_rounds_total"
SPEC_DRAFT_TOKENS = "dartree_spec_draft_tokens_total"
SPEC_ACCEPTED_TOKENS = "dartree_spec_accepted_tokens_total"
SPEC_ACCEPTED_PER_DEPTH = "dartree_spec_accepted_tokens_per_depth_total"
SPEC_ACCEPTANCE_LENGTH = "dartree_spec_acceptance_length"
SPEC_GRAMMAR_MASKED = "dartree_spec_grammar_masked_tokens_total"
SPEC_CUT_ROUNDS = "dartree_spec_cut_rounds_total"
EMITTED_TOKENS = "dartree_emitted_tokens_total"
DISCARDED_TOKENS = "dartree_discarded_tokens_total"
ROUND_SECONDS = "dartree_round_seconds"
STEP_SECONDS = "dartree_step_seconds"
QUEUE_SECONDS = "dartree_request_queue_seconds"
REQUESTS_RUNNING = "dartree_num_requests_running"
REQUESTS_WAITING = "dartree_num_requests_waiting"
SCHEDULED_BUDGET = "dartree_spec_scheduled_budget"
SCHEDULED_WIDTH = "dartree_spec_scheduled_width"
ABORTS = "dartree_aborts_total"
TTFT = "dartree_time_to_first_token_seconds"
ITL = "dartree_inter_token_latency_seconds"
E2E = "dartree_e2e_request_latency_seconds"
REQUESTS = "dartree_requests_total"
PROMPT_TOKENS = "dartree_prompt_tokens_total"
GENERATION_TOKENS = "dartree_generation_tokens_total"
REJECTED = "dartree_rejected_requests_total"
IPC_ERRORS = "dartree_ipc_errors_total"
INFO = "dartree_info"
DRAFTER_CONTEXTS = "dartree_drafter_contexts"
STEP_REQUESTS = "dartree_step_requests"
STEP_ROWS = "dartree_step_rows"
GRAPH_EAGER_STEPS = "dartree_graph_eager_steps_total"
ROUND_WALKS = "dartree_verifier_rounds_total"
ROUND_READS = "dartree_verifier_round_reads_total"
COMPILED_STEP = "dartree_compiled_step"
PREFILL_CHUNK_TOKENS = "dartree_prefill_chunk_tokens_total"
DRAFTER_WAIT = "dartree_verifier_drafter_wait_seconds_total"
DRAFTER_BUSY = "dartree_verifier_drafter_busy_seconds_total"
DRAFTER_UP = "dartree_verifier_drafter_up"
DRAFTER_OOM = "dartree_verifier_drafter_out_of_memory_total"
DRAFTER_OUT_OF_MEMORY = "dartree_drafter_out_of_memory_total"
KV_SLOTS = "dartree_kv_slots"
PREFIX_QUERIED = "dartree_prefix_cache_queried_tokens_total"
PREFIX_HITS = "dartree_prefix_cache_hit_tokens_total"
PREFIX_COPIED = "dartree_prefix_cache_copied_tokens_total"
PREFIX_WAITS = "dartree_prefix_cache_prefill_waits_total"
PREFIX_EVICTIONS = "dartree_prefix_cache_evictions_total"
PREFIX_CACHED = "dartree_prefix_cache_cached_tokens"
PREFIX_BYTES = "dartree_prefix_cache_bytes"
PREFIX_RAM_BYTES = "dartree_prefix_cache_ram_bytes"
PREFIX_RAM_SAVED = "dartree_prefix_cache_ram_saved_total"
PREFIX_RAM_HITS = "dartree_prefix_cache_ram_hit_tokens_total"
PREFIX_RAM_EVICTIONS = "dartree_prefix_cache_ram_evictions_total"
STEP_REQUEST_BUCKETS = (1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 64.0)
STEP_ROW_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0)
DRAFTER_CALLS = "dartree_drafter_calls_total"
POLICY_BUDGET = "dartree_spec_policy_budget"
POLICY_TAU_ERROR = "dartree_spec_policy_tau_abs_error"
POLICY_PREDICTED_TAU = "dartree_spec_policy_predicted_tau_total"
POLICY_REALISED_TAU = "dartree_spec_policy_realised_tau_total"
POLICY_STEP_SECONDS = "dartree_spec_policy_step_seconds_total"
POLICY_STEPS = "dartree_spec_policy_steps_total"
BUDGET_BUCKETS = (0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 64.0, 128.0)
TAU_ERROR_BUCKETS = (0.05, 0.1, 0.15, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
DRAFTER_ERRORS = "dartree_drafter_errors_total"
NGRAM_PROPOSED = "dartree_ngram_proposed_nodes_total"
NGRAM_ACCEPTED = "dartree_ngram_accepted_nodes_total"

ACCEPTANCE_BUCKETS = tuple(float(i) for i in range(1, 18)) + (24.0, 32.0, 65.0)
ROUND_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


@dataclass
class SpecStats:
    """Plain counters of emitted speculative rounds (the engine's own count; no Prometheus here)."""

    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0
    accepted_per_depth: list[int] = field(default_factory=list)  # [d - 1] = rounds that accepted depth d

    def observe_round(self, num_draft_tokens: int, accept_length: int, accepted_per_depth: list[int],
                      num_emitted: int) -> None:
        """Count one round; all arguments describe *emitted* tokens only (see module docstring)."""
        if accept_length > num_emitted or len(accepted_per_depth) > num_emitted:
            raise ValueError(f"accept_length {accept_length} / depths {len(accepted_per_depth)} "
                             f"exceed the {num_emitted} tokens emitted")
        self.rounds += 1
        self.draft_tokens += num_draft_tokens
        self.accepted_tokens += accept_length
        self.emitted_tokens += num_emitted
        if len(self.accepted_per_depth) < len(accepted_per_depth):
            self.accepted_per_depth.extend([0] * (len(accepted_per_depth) - len(self.accepted_per_depth)))
        for i, hit in enumerate(accepted_per_depth):
            self.accepted_per_depth[i] += int(hit)

    @property
    def mean_acceptance_length(self) -> float:
        """tau: tokens emitted per round, bonus included (0.0 before the first round)."""
        return self.emitted_tokens / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens per proposed draft node (0.0 when nothing was drafted)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0


def _info(registry: CollectorRegistry, **labels: str) -> None:
    Gauge(INFO, "Static process information (value is always 1).", list(labels), registry=registry
          ).labels(**labels).set(1)


def _ipc_errors(registry: CollectorRegistry) -> Counter:
    return Counter(IPC_ERRORS, "Malformed, refused or timed-out messages on a ZMQ link.", ["peer"],
                   registry=registry)


def _advance(counters: tuple, now: tuple[int, ...], seen: tuple[int, ...]) -> tuple[int, ...]:
    """Advance each Prometheus counter by how far its running total in ``now`` passed the one in
    ``seen`` (the totals of the last call); returns the new ``seen`` (never lower than before)."""
    for counter, value, before in zip(counters, now, seen):
        if value > before:
            counter.inc(value - before)
    return tuple(max(a, b) for a, b in zip(now, seen))


class VerifierMetrics:
    """Prometheus adapter of the verifier: rounds, acceptance, phases, queue and request gauges."""

    def __init__(self, registry: CollectorRegistry | None = None, **info: str):
        r = self.registry = registry or CollectorRegistry()
        self.stats = SpecStats()
        self.rounds = Counter(SPEC_ROUNDS, "Speculative rounds run (one verify each).", ["method"], registry=r)
        self.draft_tokens = Counter(SPEC_DRAFT_TOKENS, "Draft tree nodes proposed.", ["method"], registry=r)
        self.accepted = Counter(SPEC_ACCEPTED_TOKENS, "Accepted draft tokens emitted (bonus excluded).",
                                ["method"], registry=r)
        self.per_depth = Counter(SPEC_ACCEPTED_PER_DEPTH, "Rounds whose emitted accepted path reached a depth.",
                                 ["method", "depth"], registry=r)
        self.grammar_masked = Counter(SPEC_GRAMMAR_MASKED, "Draft tree nodes a request's grammar forbade (never "
                                      "accepted; structured output and tool calls).", ["method"], registry=r)
        self.acceptance = Histogram(SPEC_ACCEPTANCE_LENGTH, "Tokens emitted per round, bonus included (mean = tau).",
                                    ["method"], buckets=ACCEPTANCE_BUCKETS, registry=r)
        self.cut_rounds = Counter(SPEC_CUT_ROUNDS, "Rounds that ended their request before emitting the bonus "
                                  "token of their verified path, by finish reason (stop: EOS, a stop id or the "
                                  "grammar's end; length: max_tokens).", ["method", "reason"], registry=r)
        self.emitted = Counter(EMITTED_TOKENS, "Tokens the verifier sent to the gateway (after EOS, stop ids and "
                               "max_tokens), by phase: prefill (each request's first token) or round.", ["phase"],
                               registry=r)
        self.round_seconds = Histogram(ROUND_SECONDS, "Per-round time by phase (one observation per decode round "
                                       "that has the phase; prefill: one per request's prefill).", ["phase"],
                                       buckets=ROUND_BUCKETS, registry=r)
        self.step_seconds = Histogram(STEP_SECONDS, "Target forward time of one batched step (shared by every "
                                      "request of the step).", buckets=ROUND_BUCKETS, registry=r)
        self.queue = Histogram(QUEUE_SECONDS, "Time from arrival at the verifier to the first round.",
                               buckets=TTFT_BUCKETS, registry=r)
        self.running = Gauge(REQUESTS_RUNNING, "Requests being decoded.", registry=r)
        self.waiting = Gauge(REQUESTS_WAITING, "Requests waiting for admission.", registry=r)
        self.drafter_up = Gauge(DRAFTER_UP, "1 while the drafter answers; 0 while every round decodes without "
                                "speculation (same tokens, slower), or when no drafter runs.", registry=r)
        self.drafter_oom = Counter(DRAFTER_OOM, "Drafts that failed because the drafter ran out of device memory "
                                   "(their requests end with a drafter_out_of_memory error).", registry=r)
        self.scheduled_budget = Gauge(SCHEDULED_BUDGET, "Tree budget the load schedule picks at the current running "
                                      "count, for requests that set none (0 = no schedule: drafter default).",
                                      registry=r)
        self.scheduled_width = Gauge(SCHEDULED_WIDTH, "Tree width the load schedule picks at the current running "
                                     "count, for requests that set none (0 = no schedule: drafter default).",
                                     registry=r)
        self.aborts = Counter(ABORTS, "Requests aborted before they finished.", ["reason"], registry=r)
        self.step_requests = Histogram(STEP_REQUESTS, "Requests in one batched step (one target forward).",
                                       buckets=STEP_REQUEST_BUCKETS, registry=r)
        self.step_rows = Histogram(STEP_ROWS, "Rows of one batched step (verify rows + prompt chunk tokens).",
                                   buckets=STEP_ROW_BUCKETS, registry=r)
        self.graph_eager_steps = Counter(GRAPH_EAGER_STEPS, "Padded steps run eagerly (uncaptured) because their "
                                         "bucket was past the CUDA graphs captured.", registry=r)
        self._graph_eager_seen = 0
        self.round_walks = Counter(ROUND_WALKS, "Decode rounds by where their accept walk and KV commit ran (device: "
                                   "batched per step; host: per request).", ["walk"], registry=r)
        self.round_reads = Counter(ROUND_READS, "Device-to-host copies of committed rounds (one per step on the "
                                   "device walk).", registry=r)
        self.compiled_step = Gauge(COMPILED_STEP, "1 while the target's steps run compiled; 0 on the eager step "
                                   "(e.g. until a compile built off the critical path is swapped in).", registry=r)
        self.prefill_chunk_tokens = Counter(PREFILL_CHUNK_TOKENS, "Prompt tokens prefilled inside batched steps.",
                                            registry=r)
        self.drafter_wait = Counter(DRAFTER_WAIT, "Seconds the verifier's steps waited for drafts.", registry=r)
        self.drafter_busy = Counter(DRAFTER_BUSY, "Drafter compute seconds (draft + tree build) behind the "
                                    "verifier's steps; 1 - wait / busy = the fraction hidden by overlap.", registry=r)
        self.kv_slots = Gauge(KV_SLOTS, "KV-cache slots by state (used / free).", ["state"], registry=r)
        self.prefix_queried = Counter(PREFIX_QUERIED, "Prompt tokens of admitted requests looked up in the prefix "
                                      "cache.", registry=r)
        self.prefix_hits = Counter(PREFIX_HITS, "Prompt tokens served from a cached prefix (not prefilled); "
                                   "hit / queried = the prefix-cache hit rate.", registry=r)
        self.prefix_copied = Counter(PREFIX_COPIED, "Of the hit tokens, those copied from another KV slot (a "
                                     "running request's committed prompt or another slot's cached prefix) instead "
                                     "of reused in place; hit - copied = the in-place hits.", registry=r)
        self.prefix_waits = Counter(PREFIX_WAITS, "Requests that waited for another request's prefill of the prompt "
                                    "they share (n choices, identical concurrent prompts) instead of prefilling it.",
                                    registry=r)
        self.prefix_evictions = Counter(PREFIX_EVICTIONS, "Cached prefixes dropped to give their slot to another "
                                        "request or to stay within --prefix-cache-mib.", registry=r)
        self.prefix_cached = Gauge(PREFIX_CACHED, "Positions cached in free KV slots.", registry=r)
        self.prefix_bytes = Gauge(PREFIX_BYTES, "Bytes cached prefixes hold beyond the reserved KV slots (target "
                                  "feature rows and token ids), bounded by --prefix-cache-mib.", registry=r)
        self._prefix_seen = (0, 0, 0, 0, 0)
        self.prefix_ram_bytes = Gauge(PREFIX_RAM_BYTES, "Bytes of the host-RAM store of prefixes evicted from their "
                                      "KV slot (K, V, feature rows, token ids), bounded by --prefix-cache-ram-mib.",
                                      registry=r)
        self.prefix_ram_saved = Counter(PREFIX_RAM_SAVED, "Cached prefixes saved to host RAM when their KV slot "
                                        "was taken.", registry=r)
        self.prefix_ram_hits = Counter(PREFIX_RAM_HITS, "Of the hit tokens, those restored from host RAM into "
                                       "a KV slot.", registry=r)
        self.prefix_ram_evictions = Counter(PREFIX_RAM_EVICTIONS, "Host-RAM prefixes dropped to stay within "
                                            "--prefix-cache-ram-mib.", registry=r)
        self._prefix_ram_seen = (0, 0, 0)
        self.policy_budget = Histogram(POLICY_BUDGET, "Draft nodes verified per decode round, as the speculation "
                                       "policy chose them (0 = plain decoding).", ["method"], buckets=BUDGET_BUCKETS,
                                       registry=r)
        self.policy_tau_error = Histogram(POLICY_TAU_ERROR, "|predicted tau - realised tau| per round the policy "
                                          "predicted (realised = tokens the verify produced, bonus included).",
                                          buckets=TAU_ERROR_BUCKETS, registry=r)
        self.policy_predicted_tau = Counter(POLICY_PREDICTED_TAU, "Sum of the policy's predicted tau over rounds.",
                                            registry=r)
        self.policy_realised_tau = Counter(POLICY_REALISED_TAU, "Sum of realised tau over the same rounds.",
                                           registry=r)
        self.policy_step_seconds = Counter(POLICY_STEP_SECONDS, "Step wall seconds predicted by the policy's cost "
                                           "model and measured, over steps with a prediction.", ["kind"], registry=r)
        self.policy_steps = Counter(POLICY_STEPS, "Batched steps by whether any request verified draft nodes.",
                                    ["speculation"], registry=r)
        self.ipc_errors = _ipc_errors(r)
        _info(r, role="verifier", **info)

    def observe_graph_eager_steps(self, total: int) -> None:
        """The runner's running total of padded steps run eagerly past its captured graphs
        (``ModelRunner.num_eager_steps``): the counter advances by what changed since the last call."""
        if total > self._graph_eager_seen:
            self.graph_eager_steps.inc(total - self._graph_eager_seen)
            self._graph_eager_seen = total

    def observe_prefix_cache(self, queried: int, hits: int, evictions: int, cached: int, copied: int = 0,
                             waits: int = 0) -> None:
        """The prefix cache's running totals (:class:`services.verifier.prefix_cache.PrefixStats`;
        ``copied``: hit tokens copied from another slot, ``waits``: requests that waited for another's
        prefill): the counters advance by what changed since the last call; ``cached`` positions
        set the gauge."""
        counters = (self.prefix_queried, self.prefix_hits, self.prefix_evictions, self.prefix_copied,
                    self.prefix_waits)
        self._prefix_seen = _advance(counters, (queried, hits, evictions, copied, waits), self._prefix_seen)
        self.prefix_cached.set(cached)

    def observe_prefix_ram(self, saved: int, hit_tokens: int, evictions: int, nbytes: int) -> None:
        """The host-RAM prefix store's running totals (:class:`services.verifier.prefix_store.StoreStats`):
        the counters advance by what changed since the last call; ``nbytes`` sets the gauge."""
        counters = (self.prefix_ram_saved, self.prefix_ram_hits, self.prefix_ram_evictions)
        self._prefix_ram_seen = _advance(counters, (saved, hit_tokens, evictions), self._prefix_ram_seen)
        self.prefix_ram_bytes.set(nbytes)

    def observe_policy_round(self, method: str, num_draft_tokens: int, predicted_tau: float | None,
                             realised_tau: int) -> None:
        """A decode round's chosen budget and, when the policy predicted one, its tau error."""
        self.policy_budget.labels(method).observe(num_draft_tokens)
        if predicted_tau is not None:
            self.policy_tau_error.observe(abs(predicted_tau - realised_tau))
            self.policy_predicted_tau.inc(predicted_tau)
            self.policy_realised_tau.inc(realised_tau)

    def observe_policy_step(self, speculating: int, predicted_seconds: float | None, wall_seconds: float) -> None:
        """A step: with or without speculation; predicted vs measured seconds when predicted."""
        self.policy_steps.labels("some" if speculating else "none").inc()
        if predicted_seconds is not None and wall_seconds > 0:
            self.policy_step_seconds.labels("predicted").inc(predicted_seconds)
            self.policy_step_seconds.labels("measured").inc(wall_seconds)

    def observe_prefill(self, num_emitted: int, seconds: float) -> None:
        """A request's prefill: its first token (0 when the prompt ended at once) and its time."""
        self.emitted.labels("prefill").inc(num_emitted)
        if seconds > 0:
            self.round_seconds.labels("prefill").observe(seconds)

    def observe_round(self, method: str, num_draft_tokens: int, accept_length: int,
                      accepted_per_depth: list[int], num_emitted: int, timings: dict[str, float],
                      prefill_seconds: float = 0.0, grammar_masked: int = 0,
                      finish_reason: str | None = None) -> None:
        """Record one engine decode round (a ``RoundOutput``'s fields; ``timings`` include
        ``sampling``, the logit processors and grammar masks, when a request has them). A finished
        round that emitted no bonus token (``num_emitted == accept_length``) is a cut round of its
        ``finish_reason``: rounds + accepted = emitted + cut rounds (docs/serving.md "Metrics")."""
        self.stats.observe_round(num_draft_tokens, accept_length, accepted_per_depth, num_emitted)
        self.rounds.labels(method).inc()
        self.emitted.labels("round").inc(num_emitted)
        if finish_reason is not None and num_emitted == accept_length:
            self.cut_rounds.labels(method, finish_reason).inc()
        if grammar_masked:
            self.grammar_masked.labels(method).inc(grammar_masked)
        self.draft_tokens.labels(method).inc(num_draft_tokens)
        self.accepted.labels(method).inc(accept_length)
        for depth, hit in enumerate(accepted_per_depth, start=1):
            if hit:
                self.per_depth.labels(method, str(depth)).inc()
        self.acceptance.labels(method).observe(num_emitted)
        for phase, seconds in timings.items():
            self.round_seconds.labels(phase).observe(seconds)
        if prefill_seconds > 0:
            self.round_seconds.labels("prefill").observe(prefill_seconds)


class GatewayMetrics:
    """Prometheus adapter of the gateway: client-visible latencies, finish reasons, token counts."""

    def __init__(self, registry: CollectorRegistry | None = None, **info: str):
        r = self.registry = registry or CollectorRegistry()
        self.ttft = Histogram(TTFT, "Arrival at the gateway to the first streamed token.", buckets=TTFT_BUCKETS,
                              registry=r)
        self.itl = Histogram(ITL, "Time between two consecutive rounds of a request.", buckets=ITL_BUCKETS,
                             registry=r)
        self.e2e = Histogram(E2E, "Arrival at the gateway to the last token.", buckets=E2E_BUCKETS, registry=r)
        self.requests = Counter(REQUESTS, "Finished requests by finish reason.", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter(PROMPT_TOKENS, "Prompt tokens of requests whose prefill ran "
                                     "(counted when the first round arrives).", registry=r)
        self.generation_tokens = Counter(GENERATION_TOKENS, "Completion tokens handed to clients (usage of "
                                         "non-streamed responses, tokens of written stream events).", registry=r)
        self.discarded_tokens = Counter(DISCARDED_TOKENS, "Tokens the verifier emitted that no client received, "
                                        "by reason: stop_string (past a stop string's match, in its round and in "
                                        "rounds run before the abort reached the verifier), or the abort reason "
                                        "(client, deadline...) of rounds that arrived after the request was "
                                        "aborted.", ["reason"], registry=r)
        self.rejected = Counter(REJECTED, "Requests refused before generation, by reason.", ["reason"], registry=r)
        self.in_flight = Gauge("dartree_gateway_requests_in_flight", "Requests the gateway is serving.",
                               registry=r)
        self.ipc_errors = _ipc_errors(r)
        _info(r, role="gateway", **info)


class DrafterMetrics:
    """Prometheus adapter of the drafter: live contexts, calls and errors."""

    def __init__(self, registry: CollectorRegistry | None = None, **info: str):
        r = self.registry = registry or CollectorRegistry()
        self.contexts = Gauge(DRAFTER_CONTEXTS, "Requests with a live drafter context.", registry=r)
        self.calls = Counter(DRAFTER_CALLS, "Messages handled by type.", ["type"], registry=r)
        self.errors = Counter(DRAFTER_ERRORS, "Draft calls that raised.", registry=r)
        self.out_of_memory = Counter(DRAFTER_OUT_OF_MEMORY, "Drafts (one per request) that ran out of device "
                                     "memory (also counted in dartree_drafter_errors_total).", registry=r)
        self.batch_jobs = Histogram("dartree_drafter_batch_jobs", "Requests drafted in one batched drafter forward.",
                                    buckets=(1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0), registry=r)
        self.seconds = Histogram("dartree_drafter_seconds", "Drafter compute time by phase.", ["phase"],
                                 buckets=ROUND_BUCKETS, registry=r)
        self.ipc_errors = _ipc_errors(r)
        _info(r, role="drafter", **info)

    def track_ngram(self, counts) -> None:
        """Export the n-gram chains' counts: ``counts()`` returns ``(proposed, accepted)`` node totals
        (:meth:`services.drafter.ngram_drafts.NgramDrafts.counts`), read at every scrape."""
        self.registry.register(_NgramCollector(counts))


class _NgramCollector:
    """``dartree_ngram_*`` counters read from the drafter's running totals at scrape time."""

    def __init__(self, counts):
        self.counts = counts

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        proposed, accepted = self.counts()
        yield CounterMetricFamily(NGRAM_PROPOSED.removesuffix("_total"), "Draft nodes n-gram chains added to "
                                  "trees (before the verifier's policy cut any).", value=proposed)
        yield CounterMetricFamily(NGRAM_ACCEPTED.removesuffix("_total"), "n-gram draft nodes on the path the "
                                  "target emitted.", value=accepted)

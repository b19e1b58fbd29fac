"""SpecStats arithmetic and the Prometheus adapters' names and values."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from services import metrics as m


def test_spec_stats_arithmetic():
    s = m.SpecStats()
    assert s.mean_acceptance_length == 0.0 and s.acceptance_rate == 0.0
    s.observe_round(num_draft_tokens=8, accept_length=3, accepted_per_depth=[1, 1, 1], num_emitted=4)
    s.observe_round(num_draft_tokens=8, accept_length=0, accepted_per_depth=[], num_emitted=1)
    # last round cut by EOS inside the accepted path: 2 accepted emitted, no bonus
    s.observe_round(num_draft_tokens=8, accept_length=2, accepted_per_depth=[1, 1], num_emitted=2)
    assert (s.rounds, s.draft_tokens, s.accepted_tokens, s.emitted_tokens) == (3, 24, 5, 7)
    assert s.accepted_per_depth == [2, 2, 1]
    assert s.mean_acceptance_length == pytest.approx(7 / 3)
    assert s.acceptance_rate == pytest.approx(5 / 24)
    assert sum(s.accepted_per_depth) == s.accepted_tokens


def test_spec_stats_refuses_impossible_rounds():
    with pytest.raises(ValueError):
        m.SpecStats().observe_round(4, 3, [1, 1, 1], num_emitted=2)


def _value(registry, name, **labels):
    v = registry.get_sample_value(name, labels)
    return 0.0 if v is None else v


def test_verifier_adapter_exports_the_documented_names():
    vm = m.VerifierMetrics(model="tiny")
    vm.observe_round("dartree-pruned", 8, 3, [1, 1, 1], 4, {"draft": 0.01, "verify": 0.02, "total": 0.035},
                     prefill_seconds=0.1)
    vm.observe_round("dartree-pruned", 8, 1, [1], 2, {"total": 0.02})
    r = vm.registry
    assert _value(r, m.SPEC_ROUNDS, method="dartree-pruned") == 2
    assert _value(r, m.SPEC_DRAFT_TOKENS, method="dartree-pruned") == 16
    assert _value(r, m.SPEC_ACCEPTED_TOKENS, method="dartree-pruned") == 4
    assert _value(r, m.SPEC_ACCEPTED_PER_DEPTH, method="dartree-pruned", depth="1") == 2
    assert _value(r, m.SPEC_ACCEPTED_PER_DEPTH, method="dartree-pruned", depth="3") == 1
    # tau from the histogram equals SpecStats' own count
    tau = (_value(r, m.SPEC_ACCEPTANCE_LENGTH + "_sum", method="dartree-pruned")
           / _value(r, m.SPEC_ACCEPTANCE_LENGTH + "_count", method="dartree-pruned"))
    assert tau == pytest.approx(vm.stats.mean_acceptance_length) == 3.0
    assert _value(r, m.ROUND_SECONDS + "_count", phase="total") == 2
    assert _value(r, m.ROUND_SECONDS + "_count", phase="prefill") == 1
    vm.running.set(3)
    text = generate_latest(r).decode()
    for name in ("dartree_spec_rounds_total", "dartree_spec_acceptance_length_bucket", "dartree_round_seconds_bucket",
                 "dartree_num_requests_running", "dartree_num_requests_waiting", "dartree_request_queue_seconds",
                 'dartree_info{model="tiny",role="verifier"}'):
        assert name in text


def test_gateway_and_drafter_adapters_have_separate_registries():
    g, d = m.GatewayMetrics(), m.DrafterMetrics()
    g.requests.labels("stop").inc()
    g.generation_tokens.inc(5)
    text = generate_latest(g.registry).decode()
    for name in ("dartree_time_to_first_token_seconds", "dartree_inter_token_latency_seconds",
                 "dartree_e2e_request_latency_seconds", 'dartree_requests_total{finish_reason="stop"} 1.0',
                 "dartree_prompt_tokens_total", "dartree_generation_tokens_total 5.0"):
        assert name in text
    assert "dartree_spec" not in text
    assert "dartree_drafter_contexts" in generate_latest(d.registry).decode()


def test_cut_rounds_emitted_tokens_and_step_seconds():
    """A finished round that emitted no bonus token is a cut round of its finish reason, so rounds +
    accepted == emitted + cut rounds; prefill tokens are counted apart; steps have their own histogram."""
    vm = m.VerifierMetrics()
    vm.observe_prefill(1, 0.05)
    vm.observe_round("ddtree", 8, 3, [1, 1, 1], 4, {"total": 0.01})                       # full round
    vm.observe_round("ddtree", 8, 2, [1, 1], 2, {"total": 0.01}, finish_reason="stop")    # EOS after 2 accepted
    vm.observe_round("ddtree", 8, 1, [1], 2, {"total": 0.01}, finish_reason="length")     # bonus emitted: not cut
    vm.observe_round("ddtree", 8, 0, [], 0, {"total": 0.01}, finish_reason="stop")        # EOS as the bonus
    vm.step_seconds.observe(0.02)
    r = vm.registry
    assert _value(r, m.SPEC_CUT_ROUNDS, method="ddtree", reason="stop") == 2
    assert _value(r, m.SPEC_CUT_ROUNDS, method="ddtree", reason="length") == 0
    assert _value(r, m.EMITTED_TOKENS, phase="prefill") == 1 and _value(r, m.EMITTED_TOKENS, phase="round") == 8
    rounds, accepted = _value(r, m.SPEC_ROUNDS, method="ddtree"), _value(r, m.SPEC_ACCEPTED_TOKENS, method="ddtree")
    emitted = _value(r, m.SPEC_ACCEPTANCE_LENGTH + "_sum", method="ddtree")
    assert rounds + accepted == emitted + 2
    assert _value(r, m.ROUND_SECONDS + "_count", phase="total") == rounds
    assert _value(r, m.ROUND_SECONDS + "_count", phase="prefill") == 1
    assert _value(r, m.STEP_SECONDS + "_count") == 1



def test_drafter_exports_the_ngram_counts_at_scrape_time():
    d = m.DrafterMetrics()
    counts = [3, 1]
    d.track_ngram(lambda: tuple(counts))
    assert _value(d.registry, m.NGRAM_PROPOSED) == 3 and _value(d.registry, m.NGRAM_ACCEPTED) == 1
    counts[:] = [7, 4]
    assert _value(d.registry, m.NGRAM_PROPOSED) == 7 and _value(d.registry, m.NGRAM_ACCEPTED) == 4
    assert b"# TYPE dartree_ngram_proposed_nodes_total counter" in generate_latest(d.registry)

"""``GET /health/generate`` on a scripted engine: a real generation request, 200 or an OpenAI-shaped 503.

The process-level checks (a healthy tiny server, a SIGSTOPped drafter or verifier) are in
``tests/reliability/test_faults.py``.
"""

from __future__ import annotations

import asyncio
import time

from .conftest import GatewayHarness
from .fakes import Script

ERROR_KEYS = {"message", "type", "param", "code"}


def run(coro):
    return asyncio.run(coro)


def test_ok_is_a_two_token_greedy_generation_outside_the_request_metrics(bytelevel_dir):
    h = GatewayHarness(bytelevel_dir, api_key="sekrit")  # open without the key, like /health/ready
    r = run(h.client.get("/health/generate"))
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "ok" and r.json()["latency_ms"] >= 0
    (gen,) = h.engine.generated
    assert gen.request_id.startswith("health-") and gen.prompt_ids
    assert gen.sampling.max_tokens == 2 and gen.sampling.temperature == 0.0 and gen.sampling.ignore_eos
    assert gen.spec.method is None  # the server's default method: a draft round after the prefill
    metrics = run(h.client.get("/metrics", headers={"Authorization": "Bearer sekrit"})).text
    assert "dartree_time_to_first_token_seconds_count 0.0" in metrics
    assert "dartree_requests_total{" not in metrics and "dartree_generation_tokens_total 0.0" in metrics
    assert h.gateway.in_flight == 0


def test_engine_failure_is_a_503_with_the_reason(bl_harness):
    h = bl_harness
    h.script = lambda gen: Script([5, 6], error_after_rounds=1, error_status=503)
    r = run(h.client.get("/health/generate"))
    err = r.json()["error"]
    assert r.status_code == 503 and set(err) == ERROR_KEYS
    assert err["code"] == "health_check_failed" and "scripted failure" in err["message"]
    h.engine.is_ready = False
    r = run(h.client.get("/health/generate"))
    assert r.status_code == 503 and "not ready" in r.json()["error"]["message"]


def test_a_short_answer_is_a_failure(bl_harness):
    bl_harness.script = lambda gen: Script([5], finish_reason="stop")  # 1 token where 2 were asked for
    r = run(bl_harness.client.get("/health/generate"))
    assert r.status_code == 503 and "1 tokens came back" in r.json()["error"]["message"]


def test_a_hung_engine_is_a_503_at_the_probe_deadline_and_the_request_is_aborted(bytelevel_dir):
    h = GatewayHarness(bytelevel_dir, health_generate_timeout_s=0.2)
    h.script = lambda gen: Script([5, 6], round_sizes=[1], delay_s=30)
    t0 = time.monotonic()
    r = run(h.client.get("/health/generate"))
    elapsed = time.monotonic() - t0
    assert r.status_code == 503 and "no answer within 0.2 s" in r.json()["error"]["message"]
    assert 0.15 < elapsed < 2.0
    assert [a.reason for a in h.engine.aborts] == ["deadline"]


def test_concurrent_probes_share_one_generation_and_draining_is_a_503(bytelevel_dir):
    h = GatewayHarness(bytelevel_dir)
    h.script = lambda gen: Script([5, 6], round_sizes=[1], delay_s=0.05)

    async def go():
        return await asyncio.gather(*(h.client.get("/health/generate") for _ in range(5)))

    assert [r.status_code for r in run(go())] == [200] * 5
    assert len(h.engine.generated) == 1  # an open route cannot be used to multiply engine work
    h.gateway.begin_drain()
    r = run(h.client.get("/health/generate"))
    assert r.status_code == 503 and "draining" in r.json()["error"]["message"]
    assert len(h.engine.generated) == 1

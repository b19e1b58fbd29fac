"""The 1-minute load test of issue 7 on the tiny models (``benchmarks/load_test.py``; ``slow``, and
``make test`` runs the same load for 20 s; the full one runs on SmolLM2 by the command in the
README): concurrent streaming clients with mixed lengths and
temperatures, zero errors, every greedy answer equal to its solo answer, RSS growth < 10 % after
warm-up. ``DARTREE_LOAD_SECONDS`` shortens it for local runs.

The load test's own bookkeeping (requests in flight at the deadline are awaited and counted, the
wait is bounded by ``--request-timeout``, errors are counted by kind) is checked in seconds against
the gateway on a scripted engine."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks import load_test

from .conftest import API_KEY

pytestmark = pytest.mark.e2e


def _load(rel_server, capsys, seconds: float) -> None:
    code = load_test.main(["--url", rel_server.base, "--server-pid", str(rel_server.proc.pid), "--api-key", API_KEY,
                           "--clients", "8", "--duration", str(seconds), "--warmup", str(seconds / 4),
                           "--prompts", "5", "--max-tokens", "16", "64", "160", "--request-timeout", "30"])
    out = capsys.readouterr()
    summary = json.loads(out.out.strip().splitlines()[-1])
    print(out.err)
    assert summary["errors"] == 0, summary["error_samples"]
    assert summary["greedy_mismatches"] == 0 and summary["greedy_checked"] > 0
    assert summary["completed"] >= 8 and summary["wall_s"] < seconds + 35
    assert set(summary["rss"]) == {"gateway", "verifier", "drafter"}
    for role, r in summary["rss"].items():
        assert r["growth"] < 0.10, (role, r)
    assert code == 0 and summary["ok"]


def test_concurrent_streams(rel_server, capsys):
    """The same load for 20 s (5 s warm-up) in ``make test``; the full minute is ``slow`` (below)."""
    _load(rel_server, capsys, float(os.environ.get("DARTREE_LOAD_SECONDS", "20")))


@pytest.mark.slow
def test_one_minute_of_concurrent_streams(rel_server, capsys):
    _load(rel_server, capsys, float(os.environ.get("DARTREE_LOAD_SECONDS", "60")))


def test_identical_greedy_requests_sent_together_get_identical_answers(rel_server):
    """N copies of one greedy request (streamed and not, several methods) interleaved with other
    requests in the verifier's round-robin: every copy equals the solo answer (B11/B18 classes)."""
    import asyncio

    import httpx

    from .conftest import AUTH

    body = {"prompt": "你好 world 😀", "max_tokens": 64, "temperature": 0, "return_token_ids": True}
    solo = httpx.post(rel_server.base + "/v1/completions", headers=AUTH, json=body, timeout=60).json()
    solo_ids, solo_text = solo["choices"][0]["token_ids"], solo["choices"][0]["text"]

    async def one(c, i):
        method = ["dartree-pruned", "ddtree", "dflash", "ar"][i % 4]
        req = {**body, "speculative": {"method": method}}
        if i % 2:
            r = await c.post("/v1/completions", headers=AUTH, json={**req, "stream": True})
            events = [json.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: {")]
            return ("".join(e["choices"][0]["text"] for e in events),
                    [t for e in events for t in e["choices"][0]["token_ids"]])
        r = (await c.post("/v1/completions", headers=AUTH, json=req)).json()["choices"][0]
        return r["text"], r["token_ids"]

    async def noise(c, i):  # different prompts, lengths and temperatures in the same rounds
        await c.post("/v1/completions", headers=AUTH, json={"prompt": f"noise {i}", "max_tokens": 16 + 8 * i,
                                                             "temperature": 0.9 if i % 2 else 0.0, "seed": i})

    async def go():
        async with httpx.AsyncClient(base_url=rel_server.base, timeout=60) as c:
            out = await asyncio.gather(*(one(c, i) for i in range(16)), *(noise(c, i) for i in range(6)))
        return out[:16]

    answers = asyncio.run(go())
    assert all(a == (solo_text, solo_ids) for a in answers), [a for a in answers if a != (solo_text, solo_ids)][:2]


# ------------------------------------------------------------------ the load test's own bookkeeping
def _fake_gateway(tmp_path, delay_s: float):
    """The real gateway on a scripted engine: 13 tokens per answer, one per round, ``delay_s`` apart."""
    from gateway.app import create_app
    from gateway.config import GatewayConfig
    from gateway.text import TextModel
    from tests.service.fakes import FakeEngineClient, Script, bytelevel_model_dir, verifier_info

    model_dir = bytelevel_model_dir(tmp_path / "tok")
    text = TextModel(model_dir)
    ids = text.encode("steady answer", add_special_tokens=False)
    engine = FakeEngineClient(verifier_info(text.vocab_size),
                              lambda gen: Script(ids, round_sizes=[1], delay_s=delay_s))
    return create_app(GatewayConfig(target=str(model_dir), served_model_name="tiny"), engine, text)


def _run(base: str, capsys, *flags: str) -> tuple[int, dict]:
    """``flags`` come last, so a test's own ``--duration`` overrides the 0.3 s default."""
    code = load_test.main(["--url", base, "--clients", "3", "--duration", "0.3", "--warmup", "0", "--prompts", "1",
                           "--max-tokens", "16", *flags])
    return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_requests_in_flight_at_the_deadline_are_awaited_and_counted(tmp_path, capsys):
    from services.testing import run_uvicorn

    with run_uvicorn(_fake_gateway(tmp_path, delay_s=0.08)) as base:  # ~0.8 s per request > the 0.3 s run
        code, summary = _run(base, capsys, "--temperatures", "0")
    assert summary["request_timeout_s"] == 600.0  # the OpenAI client's default
    assert summary["in_flight_at_deadline"] == 3 and summary["unfinished"] == 0
    assert summary["requests"] == summary["completed"] == 3 and summary["errors"] == 0
    assert summary["greedy_checked"] == 3 and summary["ttft_ms"]["n"] == 3 and summary["wall_s"] > 0.5
    assert code == 0 and summary["ok"]


@pytest.mark.parametrize("delay_s,duration_s,timeout_s,kind",
                         [(0.25, 0.3, 1.0, "unfinished"), (10.0, 1.0, 1.5, "ReadTimeout")])
def test_the_wait_is_bounded_by_the_request_timeout_and_errors_are_counted_by_kind(tmp_path, capsys, delay_s,
                                                                                   duration_s, timeout_s, kind):
    """0.25 s between rounds: each read is in time but the request outlives deadline + timeout (cut);
    10 s before the first round: the client's read timeout. Each case keeps ≥ 0.7 s between the two
    outcomes (a request starts within duration / 10 of the run's start), so a stalled event loop on a
    busy machine does not turn one kind into the other."""
    from services.testing import run_uvicorn

    with run_uvicorn(_fake_gateway(tmp_path, delay_s=delay_s)) as base:
        code, summary = _run(base, capsys, "--temperatures", "1.0", "--request-timeout", str(timeout_s),
                             "--duration", str(duration_s))
    assert summary["errors_by_kind"] == {kind: 3} and summary["completed"] == 0
    assert summary["wall_s"] < duration_s + timeout_s + 0.5
    assert code == 1 and not summary["ok"]

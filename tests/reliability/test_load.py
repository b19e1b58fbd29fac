"""The 1-minute load test of issue 7 on the tiny models (``benchmarks/load_test.py``; the full one runs on
SmolLM2 by the command in the README): concurrent streaming clients with mixed lengths and
temperatures, zero errors, every greedy answer equal to its solo answer, RSS growth < 10 % after
warm-up. ``DARTREE_LOAD_SECONDS`` shortens it for local runs."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks import load_test

from .conftest import API_KEY

pytestmark = pytest.mark.e2e


def test_one_minute_of_concurrent_streams(rel_server, capsys):
    seconds = float(os.environ.get("DARTREE_LOAD_SECONDS", "60"))
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

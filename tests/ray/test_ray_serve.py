"""Scale-out on Ray Serve, end to end on loopback: a local Ray cluster started here, tiny random models.

Default suite (one app with two AR-only units, ~1-2 min on 2 cores): the openai client through
Ray's HTTP proxy (completions and chat, stream == non-stream, /v1/models), requests spread over both
replicas (each 30-70 % of 40 at c = 4), greedy answers equal to plain decoding of the target, the
metrics targets (every replica's registries, scrapeable, with a replica label), and the drain of
the app (a stream in flight finishes). ``slow``: kill -9 of a unit's verifier under load loses no
request that had not started streaming and a unit killed whole is replaced by Ray; autoscaling
1 -> 2 -> 1 under load.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from services.testing import served_ar_reference

from .conftest import APP_NAME, REPLICA_HEADER, RayAppConfig, ScaleConfig, UnitSpec, run_app, serve, unit_flags

pytestmark = pytest.mark.e2e
PROMPTS = ["Hello world", "The cat sat", "abc", "Once upon a time", "1 2 3 4", "def f(x):", "zzz", "Ray"]


@pytest.fixture(scope="module")
def app(cluster, tiny, tmp_path_factory):
    """Two fixed replicas, AR-only tiny units; deleted (drained) by the last default test."""
    logs = tmp_path_factory.mktemp("unit-logs")
    scale = ScaleConfig(replicas=2, num_cpus=0.5, health_check_period_s=2, health_check_timeout_s=20)
    base = run_app(cluster, RayAppConfig(UnitSpec(unit_flags(tiny[0])), scale, str(logs)))
    yield base
    if APP_NAME in serve.status().applications:
        serve.delete(APP_NAME)


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)


def _ar_reference(target_dir: Path, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Plain greedy decoding of the tiny target in this process (what a single unit serves)."""
    return served_ar_reference(target_dir, prompt_ids, max_tokens)


async def _fire(base: str, n: int, concurrency: int, max_tokens: int = 8, stream: bool = False) -> list[httpx.Response]:
    """``n`` completions at ``concurrency``; the responses (bodies read)."""
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=180, trust_env=False) as c:
        async def one(i: int) -> httpx.Response:
            async with sem:
                body = {"model": "tiny", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens,
                        "stream": stream}
                return await c.post("/v1/completions", json=body)
        return await asyncio.gather(*(one(i) for i in range(n)))


def test_openai_client_stream_and_not_through_ray(app):
    client = _client(app)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    plain = client.completions.create(model="tiny", prompt="Hello world", max_tokens=16)
    chunks = list(client.completions.create(model="tiny", prompt="Hello world", max_tokens=16, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert plain.usage.completion_tokens == 16
    msgs = [{"role": "user", "content": "Hi there"}]
    chat = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12)
    stream = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError):  # the unit's validation reaches the client unchanged
        client.completions.create(model="tiny", prompt="x", max_tokens=4, best_of=2)


def test_requests_spread_over_both_replicas(app):
    responses = asyncio.run(_fire(app, 40, 4))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    per_replica = collections.Counter(r.headers[REPLICA_HEADER] for r in responses)
    assert len(per_replica) == 2, per_replica
    assert all(12 <= n <= 28 for n in per_replica.values()), per_replica  # each gets 30-70 % of 40


def test_greedy_answers_equal_a_single_unit(app, tiny):
    from gateway.text import TextModel

    text = TextModel(tiny[0])
    replicas = set()
    with httpx.Client(base_url=app, timeout=120, trust_env=False) as c:
        for prompt in PROMPTS[:4]:
            want = _ar_reference(tiny[0], text.encode(prompt), 20)
            for _ in range(2):  # likely both replicas
                r = c.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 20,
                                                    "return_token_ids": True})
                assert r.status_code == 200, r.text
                replicas.add(r.headers[REPLICA_HEADER])
                assert r.json()["choices"][0]["token_ids"] == want, prompt
    assert replicas


def test_metrics_targets_cover_every_replica_and_are_scrapeable(app):
    deadline = time.monotonic() + 30
    while True:  # replicas register on their first health check (period 2 s)
        groups = httpx.get(app + "/metrics/targets", timeout=30, trust_env=False).json()
        if len({g["labels"]["replica"] for g in groups}) == 2 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert len({g["labels"]["replica"] for g in groups}) == 2, groups
    assert sorted({g["labels"]["process"] for g in groups}) == ["gateway", "verifier"]
    for g in groups:
        text = httpx.get(f"http://{g['targets'][0]}/metrics", timeout=10, trust_env=False).text
        want = "dartree_spec_rounds_total" if g["labels"]["process"] == "verifier" else "dartree_"
        assert want in text, g


def test_delete_drains_a_stream_in_flight(app):
    """serve.delete stops the replicas: a stream that runs at that moment still finishes with [DONE]."""
    out: dict = {}

    def stream():
        with httpx.Client(base_url=app, timeout=120, trust_env=False) as c:
            with c.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 200,
                                                            "stream": True, "ignore_eos": True}) as r:
                out["status"] = r.status_code
                out["text"] = "".join(r.iter_text())

    t = threading.Thread(target=stream)
    t.start()
    time.sleep(1.0)
    serve.delete(APP_NAME)
    t.join(120)
    assert out.get("status") == 200, out
    assert out["text"].rstrip().endswith("data: [DONE]"), out["text"][-300:]
    assert "server_shutdown" not in out["text"]

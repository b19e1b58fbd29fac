"""Cancellation and hung workers against a running ``dartree serve`` (tiny models).

- 100 streams whose clients hang up at random points (before the response starts, after k events,
  after a random delay: mid-round included) leave nothing behind: the gateway's in-flight gauge,
  the verifier's running/waiting gauges and the drafter's per-request contexts return to zero, and
  the next greedy request with the same prompt returns what a fresh server returned (B20 class).
- A hung verifier (SIGSTOP) is detected by a deadline, never waited on forever: in-flight streams end
  with an error event, readiness goes false, and after SIGCONT the server is ready and serves again.
- A hung or killed drafter costs speed, never a request: in-flight and new requests decode without
  speculation (the same text as plain decoding), readiness stays 200 with the reason in its detail,
  and speculation comes back with the drafter (the same one after SIGCONT, a new one after kill -9).
- ``GET /health/generate`` runs a real generation through the verifier and the drafter (their
  counters move, the gateway's request counters do not) and answers 503 within its deadline while
  either worker is stopped, then 200 again after SIGCONT.

``kill -9`` of a worker and the SIGTERM drain are in ``tests/service/test_e2e_tiny.py``.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time

import httpx
import pytest

from .conftest import AUTH, metric_total, scrape, start_tiny_server

pytestmark = pytest.mark.e2e
PROMPTS = ["The quick brown fox", "你好，世界", "Emoji 😀🎉 party", "def f(x):", "STOP here. END"]
STREAMS, CONCURRENCY, BUDGET_S = 100, 10, 90.0
PROBE_TIMEOUT_S = 2.0


def _greedy(base: str, prompt: str, n: int = 48, method: str = "dartree-pruned") -> list[int]:
    r = httpx.post(base + "/v1/completions", headers=AUTH, timeout=60, json={
        "prompt": prompt, "max_tokens": n, "temperature": 0, "return_token_ids": True,
        "speculative": {"method": method}})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


async def _hang_up_before_response(base: str, body: dict, delay: float) -> str:
    """Raw HTTP: send the request, wait ``delay`` (prefill may be running), close the socket."""
    host, port = base.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Authorization: {AUTH['Authorization']}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    await writer.drain()
    await asyncio.sleep(delay)
    writer.transport.abort()  # RST-like close, no FIN handshake niceties
    return "pre-response"


async def _hang_up_mid_stream(client: httpx.AsyncClient, body: dict, events: int | None, seconds: float | None) -> str:
    async with client.stream("POST", "/v1/completions", json=body, headers=AUTH) as r:
        if r.status_code != 200:
            return f"status {r.status_code}"
        n, t0 = 0, time.monotonic()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                n += 1
                if line == "data: [DONE]":
                    return "finished"
            if (events is not None and n >= events) or (seconds is not None and time.monotonic() - t0 >= seconds):
                return "cut"  # leaving the block closes the connection mid-stream
    return "finished"


async def _chaos(base: str, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    sem = asyncio.Semaphore(CONCURRENCY)
    outcome: dict[str, int] = {}

    async def one(i: int, client: httpx.AsyncClient) -> None:
        body = {"prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(40, 200), "stream": True,
                "temperature": rng.choice([0.0, 0.0, 0.8]), "seed": i,
                "speculative": {"method": rng.choice(["dartree-pruned", "ddtree", "dflash", "ar"])}}
        kind = rng.random()
        async with sem:
            try:
                if kind < 0.2:
                    res = await _hang_up_before_response(base, body, rng.uniform(0.0, 0.05))
                elif kind < 0.6:
                    res = await _hang_up_mid_stream(client, body, rng.randint(1, 12), None)
                else:
                    res = await _hang_up_mid_stream(client, body, None, rng.uniform(0.0, 0.3))
            except (httpx.HTTPError, OSError) as exc:
                res = f"client error {type(exc).__name__}"
        outcome[res] = outcome.get(res, 0) + 1

    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        await asyncio.wait_for(asyncio.gather(*(one(i, client) for i in range(STREAMS))), BUDGET_S)
    return outcome


def _state(server) -> dict[str, float]:
    m = scrape(server)
    return {"gateway_in_flight": metric_total(m["gateway"], "dartree_gateway_requests_in_flight"),
            "running": metric_total(m["verifier"], "dartree_num_requests_running"),
            "waiting": metric_total(m["verifier"], "dartree_num_requests_waiting"),
            "drafter_contexts": metric_total(m["drafter"], "dartree_drafter_contexts"),
            "client_aborts": metric_total(m["verifier"], "dartree_aborts_total", reason="client")}


def _wait_idle(server, timeout: float = 15.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        s = _state(server)
        if s["gateway_in_flight"] == s["running"] == s["waiting"] == s["drafter_contexts"] == 0:
            return s
        if time.monotonic() > deadline:
            return s
        time.sleep(0.1)


def test_random_client_disconnects_leave_no_state_behind(rel_server):
    fresh = {p: _greedy(rel_server.base, p) for p in PROMPTS[:2]}
    before = _state(rel_server)
    t0 = time.monotonic()
    outcome = asyncio.run(_chaos(rel_server.base, seed=1234))
    elapsed = time.monotonic() - t0
    assert sum(outcome.values()) == STREAMS and elapsed < BUDGET_S
    assert not any(k.startswith("status") or k.startswith("client error") for k in outcome), outcome
    assert outcome.get("cut", 0) + outcome.get("pre-response", 0) >= 50, outcome
    after = _wait_idle(rel_server)
    assert after["gateway_in_flight"] == after["running"] == after["waiting"] == after["drafter_contexts"] == 0, after
    assert after["client_aborts"] - before["client_aborts"] >= outcome.get("cut", 0) // 2, (before, after, outcome)
    for prompt, ids in fresh.items():  # same greedy answer as before the chaos, and with another method
        assert _greedy(rel_server.base, prompt) == ids
        assert _greedy(rel_server.base, prompt, method="ar") == ids
    assert httpx.get(rel_server.base + "/health/ready").status_code == 200


# ------------------------------------------------------------------------------------ hung workers
@pytest.fixture(scope="module")
def hang_server(tiny_models, tmp_path_factory):
    target_dir, drafter_dir = tiny_models
    log = tmp_path_factory.mktemp("hang") / "serve.log"
    with start_tiny_server(target_dir, drafter_dir, log, "--ping-timeout-s", "1.5", "--draft-timeout-s", "1.5",
                           "--health-interval-s", "0.5", "--budget", "8", "--candidates", "8", "--width", "4",
                           "--health-generate-timeout-s", str(PROBE_TIMEOUT_S)) as srv:
        yield srv


def _stream_until_error(server, body: dict, freeze, timeout: float = 30.0) -> tuple[list[str], float]:
    """Start a stream, call ``freeze()`` after the first event, return the rest and the time to the end."""
    with httpx.Client(base_url=server.base, timeout=timeout) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    break
            freeze()
            t0 = time.monotonic()
            rest = [line for line in lines if line.startswith("data: ")]
            return rest, time.monotonic() - t0


def _drafter_up(server) -> float:
    return metric_total(httpx.get(f"http://127.0.0.1:{server.metrics_ports[0]}/metrics").text,
                        "dartree_verifier_drafter_up")


def _ready_detail(server) -> str:
    """``/health/ready``'s detail; the status must be 200 (a drafter's state never makes it 503)."""
    r = httpx.get(server.base + "/health/ready", timeout=5)
    assert r.status_code == 200, r.text
    return r.json()["detail"]


def _wait_for(cond, timeout: float, what: str) -> float:
    """Poll ``cond()`` every 0.1 s until true; seconds waited (AssertionError naming ``what`` at ``timeout``)."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"{what} not within {timeout:g} s"
        time.sleep(0.1)
    return time.monotonic() - t0


def _stream_text(server, body: dict, during=None) -> tuple[str, str | None, float, list[dict]]:
    """Stream ``body``; ``during()`` runs after the first event. Returns the text, the last finish
    reason, the longest gap between two events (s) and every event."""
    events, gaps, last = [], [0.0], None
    with httpx.Client(base_url=server.base, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.monotonic()
                if last is not None:
                    gaps.append(now - last)
                last = now
                events.append(json.loads(line[6:]))
                if len(events) == 1 and during is not None:
                    during()
    choices = [e["choices"][0] for e in events if e.get("choices")]
    return "".join(ch["text"] for ch in choices), choices[-1]["finish_reason"], max(gaps), events


def test_a_hung_drafter_costs_speed_never_a_request(hang_server):
    """SIGSTOP of the drafter mid-stream: the stream goes on without speculation after one heartbeat
    verdict (no error event, the same text as plain decoding), readiness stays 200 and says why,
    the gauge drops to 0; after SIGCONT the same drafter is used again."""
    proc = hang_server.child("dartree-drafter")
    pid = proc.pid
    body = {"prompt": "x", "max_tokens": 240, "temperature": 0, "stream": True,
            "speculative": {"method": "dflash", "budget": 8}}  # explicit budget: drafts every round
    ref = httpx.post(hang_server.base + "/v1/completions", timeout=60,
                     json={**body, "stream": False, "speculative": {"method": "ar"}}).json()["choices"][0]
    try:
        text, finish, gap, events = _stream_text(hang_server, body, lambda: proc.send_signal(signal.SIGSTOP))
        assert not any("error" in e for e in events), [e for e in events if "error" in e]
        assert (text, finish) == (ref["text"], ref["finish_reason"])
        assert gap < 6.0  # the heartbeat's verdict or the 1.5 s draft deadline, not forever
        _wait_for(lambda: _drafter_up(hang_server) == 0, 10, "the gauge at 0")  # the heartbeat's verdict
        _wait_for(lambda: "without speculation" in _ready_detail(hang_server), 5, "the reason in /health/ready")
        plain = httpx.post(hang_server.base + "/v1/completions", timeout=30, json={**body, "stream": False})
        assert plain.status_code == 200 and plain.json()["choices"][0]["text"] == ref["text"]
    finally:
        proc.send_signal(signal.SIGCONT)
    _wait_for(lambda: _drafter_up(hang_server) == 1, 30, "the drafter back up")
    assert hang_server.child("dartree-drafter").pid == pid  # recovered, not restarted
    _wait_for(lambda: _ready_detail(hang_server) == "ready", 5, "/health/ready without a notice")
    state = _wait_idle(hang_server)
    assert state["running"] == state["waiting"] == state["drafter_contexts"] == state["gateway_in_flight"] == 0, state


@pytest.mark.parametrize("victim,code", [("dartree-verifie", "engine_unavailable")], ids=["verifier"])
def test_hung_worker_is_detected_by_a_deadline_and_recovers(hang_server, victim, code):
    proc = hang_server.child(victim)
    pid = proc.pid
    body = {"prompt": "x", "max_tokens": 240, "stream": True,
            "speculative": {"method": "dflash", "budget": 8}}  # explicit budget: drafts every round
    try:
        rest, waited = _stream_until_error(hang_server, body, lambda: proc.send_signal(signal.SIGSTOP))
        assert rest[-1] == "data: [DONE]", rest[-3:]
        err = json.loads(rest[-2][6:])["error"]
        assert err["code"] == code and set(err) == {"message", "type", "param", "code"}, err
        assert waited < 6.0  # the 1.5 s deadline, not forever
        hang_server.wait_ready(timeout=10, want=False)
    finally:
        proc.send_signal(signal.SIGCONT)
    hang_server.wait_ready(timeout=30)
    assert hang_server.child(victim).pid == pid  # recovered, not restarted
    r = httpx.post(hang_server.base + "/v1/completions", json={"prompt": "x", "max_tokens": 8}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    state = _wait_idle(hang_server)
    assert state["running"] == state["waiting"] == state["drafter_contexts"] == state["gateway_in_flight"] == 0, state


def test_abandoned_requests_are_aborted_in_a_resumed_verifier(hang_server):
    """The gateway fails in-flight requests when the verifier stops answering; when the verifier comes
    back it must not keep decoding them to max_tokens for nobody: the gateway's abort reaches it."""
    proc = hang_server.child("dartree-verifie")
    vport = hang_server.metrics_ports[0]
    aborts = lambda: metric_total(httpx.get(f"http://127.0.0.1:{vport}/metrics").text,  # noqa: E731
                                  "dartree_aborts_total")
    before = aborts()
    body = {"prompt": "x", "max_tokens": 240, "stream": True, "speculative": {"method": "ar"}}
    try:
        rest, _ = _stream_until_error(hang_server, body, lambda: proc.send_signal(signal.SIGSTOP))
        assert json.loads(rest[-2][6:])["error"]["code"] == "engine_unavailable"
    finally:
        proc.send_signal(signal.SIGCONT)
    hang_server.wait_ready(timeout=30)
    deadline = time.monotonic() + 10
    while aborts() == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert aborts() == before + 1


def test_kill_9_of_the_drafter_during_a_non_streaming_request_loses_nothing(hang_server):
    """The request finishes without speculation (the text of plain decoding); the supervisor starts a
    new drafter, and speculation comes back: a later request drafts again (the draft-token counter moves)."""
    body = {"prompt": "x", "max_tokens": 240, "temperature": 0, "speculative": {"method": "dflash", "budget": 8}}
    ref = httpx.post(hang_server.base + "/v1/completions", timeout=60,
                     json={**body, "speculative": {"method": "ar"}}).json()["choices"][0]
    old = hang_server.child("dartree-drafter")
    r = _kill_mid_request(hang_server, old, body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == ref["text"]
    hang_server.wait_replaced("dartree-drafter", old.pid)
    vport = hang_server.metrics_ports[0]
    drafts = lambda: metric_total(httpx.get(f"http://127.0.0.1:{vport}/metrics").text,  # noqa: E731
                                  "dartree_spec_draft_tokens_total")

    def drafts_again() -> bool:
        before = drafts()
        again = httpx.post(hang_server.base + "/v1/completions", json={**body, "max_tokens": 16}, timeout=60)
        assert again.status_code == 200 and ref["text"].startswith(again.json()["choices"][0]["text"]), again.text
        return drafts() > before

    _wait_for(drafts_again, 60, "speculation with the new drafter")


def _kill_mid_request(server, proc, body: dict):
    """POST ``body`` (non-streaming) on a thread, SIGKILL ``proc`` once the verifier runs the request;
    the response."""
    import threading

    box: dict = {}
    t = threading.Thread(target=lambda: box.update(r=httpx.post(server.base + "/v1/completions", timeout=60,
                                                                 json=body)))
    t.start()
    vport = server.metrics_ports[0]
    for _ in range(200):  # wait until the verifier runs it
        if metric_total(httpx.get(f"http://127.0.0.1:{vport}/metrics").text, "dartree_num_requests_running") > 0:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    t.join(60)
    return box["r"]


@pytest.mark.parametrize("victim", ["dartree-verifie"], ids=["verifier"])
def test_kill_9_during_a_non_streaming_request_is_a_503(hang_server, victim):
    """The streaming case is in tests/service/test_e2e_tiny.py; this is the non-streaming one."""
    old = hang_server.child(victim)
    r = _kill_mid_request(hang_server, old, {"prompt": "x", "max_tokens": 240,  # explicit budget: drafts every round
                                             "speculative": {"method": "dflash", "budget": 8}})
    assert r.status_code == 503, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    hang_server.wait_replaced(victim, old.pid)
    hang_server.wait_ready(timeout=120)
    ok = httpx.post(hang_server.base + "/v1/completions", json={"prompt": "x", "max_tokens": 8}, timeout=60)
    assert ok.status_code == 200


# ------------------------------------------------------------------------------- generation probe
def test_generation_probe_runs_through_both_workers_and_is_not_a_user_request(rel_server):
    before = scrape(rel_server)
    r = httpx.get(rel_server.base + "/health/generate", timeout=30)  # no API key: open like /health/ready
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "ok" and r.json()["latency_ms"] > 0
    after = scrape(rel_server)
    assert metric_total(after["drafter"], "dartree_drafter_calls_total", type="draft_batch") > \
        metric_total(before["drafter"], "dartree_drafter_calls_total", type="draft_batch")
    assert metric_total(after["verifier"], "dartree_spec_rounds_total") > \
        metric_total(before["verifier"], "dartree_spec_rounds_total")
    for name in ("dartree_requests_total", "dartree_time_to_first_token_seconds_count"):
        assert metric_total(after["gateway"], name) == metric_total(before["gateway"], name), name


@pytest.mark.parametrize("victim", ["dartree-drafter", "dartree-verifie"], ids=["drafter", "verifier"])
def test_generation_probe_is_a_503_while_a_worker_hangs(hang_server, victim):
    assert httpx.get(hang_server.base + "/health/generate", timeout=30).status_code == 200
    proc = hang_server.child(victim)
    proc.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        r = httpx.get(hang_server.base + "/health/generate", timeout=30)
        waited = time.monotonic() - t0
    finally:
        proc.send_signal(signal.SIGCONT)
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "health_check_failed", err
    assert waited < PROBE_TIMEOUT_S + 1.5, waited  # the probe's own deadline, not the client's
    hang_server.wait_ready(timeout=30)
    assert httpx.get(hang_server.base + "/health/generate", timeout=30).status_code == 200


def test_a_drafter_past_its_restart_budget_leaves_the_server_serving_plainly(tiny_models, tmp_path):
    """``--max-restarts 1``: the second death of the drafter within the window is not restarted, and
    instead of stopping the server the supervisor logs it and the verifier serves on without
    speculation (200, the text of plain decoding, readiness 200 with the reason)."""
    target_dir, drafter_dir = tiny_models
    body = {"prompt": "x", "max_tokens": 32, "temperature": 0, "speculative": {"method": "dflash", "budget": 8}}
    with start_tiny_server(target_dir, drafter_dir, tmp_path / "serve.log", "--max-restarts", "1",
                           "--health-interval-s", "0.5") as srv:
        ref = httpx.post(srv.base + "/v1/completions", timeout=60,
                         json={**body, "speculative": {"method": "ar"}}).json()["choices"][0]["text"]
        first = srv.child("dartree-drafter")
        first.send_signal(signal.SIGKILL)
        second = srv.wait_replaced("dartree-drafter", first.pid)
        second.send_signal(signal.SIGKILL)
        _wait_for(lambda: "serving without speculation from now on" in srv.log.read_text(), 30, "the supervisor's verdict")
        _wait_for(lambda: "without speculation" in _ready_detail(srv), 10, "the reason in /health/ready")
        r = httpx.post(srv.base + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref, r.text
        assert srv.proc.poll() is None  # the supervisor still runs
        with pytest.raises(LookupError):
            srv.child("dartree-drafter")  # and did not start a third drafter

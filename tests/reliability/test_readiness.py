"""Readiness follows a hung worker while generations are in flight (issue 17, class 2).

A worker stopped with SIGSTOP while a stream runs: ``/health/ready`` must go 503 within the
documented bound (README "Health": about 4 s with the defaults) and not wait for the draft deadline
(30 s here) or the request timeout; after SIGCONT it is 200 again and the server serves. The
in-flight stream ends cleanly with ``[DONE]`` (finished after SIGCONT, or an error event).
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from .conftest import start_tiny_server

pytestmark = pytest.mark.e2e
BOUND_S = 10.0  # generous: the documented bound is ~4 s; the old behaviour was 200 until the 30 s draft deadline


@pytest.fixture(scope="module")
def ready_server(tiny_models, tmp_path_factory):
    target_dir, drafter_dir = tiny_models
    log = tmp_path_factory.mktemp("ready") / "serve.log"
    with start_tiny_server(target_dir, drafter_dir, log, "--request-timeout-s", "25", "--draft-timeout-s", "30",
                           "--budget", "8", "--candidates", "8", "--width", "4") as srv:
        yield srv


def _ready(server) -> int:
    try:
        return httpx.get(server.base + "/health/ready", timeout=2).status_code
    except httpx.HTTPError:
        return 0


@pytest.mark.parametrize("victim", ["dartree-drafter", "dartree-verifie"], ids=["drafter", "verifier"])
def test_readiness_is_503_soon_after_a_worker_hangs_with_a_stream_in_flight(ready_server, victim):
    proc = ready_server.child(victim)
    box: dict = {}
    started = threading.Event()

    def stream() -> None:  # an explicit budget drafts every round (the goodput policy may decode plainly)
        with httpx.Client(base_url=ready_server.base, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 240, "stream": True,
                                                           "speculative": {"method": "dflash", "budget": 8}}) as r:
                lines = []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line)
                        started.set()
                box["lines"] = lines

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(30)
    proc.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        while _ready(ready_server) == 200 and time.monotonic() - t0 < 30:
            time.sleep(0.2)
        went_unready = time.monotonic() - t0
        in_flight = t.is_alive() if victim == "dartree-drafter" else True
        for _ in range(5):  # stays unready while the worker hangs
            assert _ready(ready_server) != 200
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGCONT)
    assert went_unready < BOUND_S, went_unready
    assert in_flight  # the drafter case: readiness went false while the generation was still running
    ready_server.wait_ready(timeout=BOUND_S)
    t.join(60)
    assert box["lines"][-1] == "data: [DONE]"  # the stream ended cleanly: finished, or an OpenAI-shaped error
    last = json.loads(box["lines"][-2][6:])
    assert set(last["error"]) == {"message", "type", "param", "code"} if "error" in last \
        else last["choices"][0]["finish_reason"] in ("length", "stop"), last
    r = httpx.post(ready_server.base + "/v1/completions", json={"prompt": "x", "max_tokens": 8}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8

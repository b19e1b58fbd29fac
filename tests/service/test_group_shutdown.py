"""A SIGTERM that reaches every process of ``dartree serve`` drains once (issue 17, class 3).

systemd's ``KillMode=control-group`` and container runtimes that signal the whole group send SIGTERM
to the supervisor, the gateway, the verifier, the drafter and the forkserver they were forked from at
once. That must be one drain: the
requests in flight finish with their full text, new requests get 503 meanwhile, and every process
exits 0. A SIGTERM to one worker alone drains that worker: its in-flight requests finish, then it
exits 0 and the supervisor starts a new one.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx
import psutil
import pytest

from services.testing import Server, start_server

from .tiny import TINY_FLAGS, make_tiny_models

pytestmark = pytest.mark.e2e
ENV = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "OMP_WAIT_POLICY": "PASSIVE"}
PROMPT = "Count from 1 to 500: 1,"
MAX_TOKENS = 120
WORKERS = ("dartree-gateway", "dartree-verifie", "dartree-drafter")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_models(tmp_path_factory.mktemp("tiny-group"))


def _serve(tiny, log):
    target_dir, drafter_dir = tiny
    return start_server(*TINY_FLAGS, "--drain-timeout-s", "120", "--budget", "8", "--candidates", "8", "--width", "4",
                        log=log, target=target_dir, drafter=drafter_dir, env=ENV, stop_timeout=150)


class _Requests:
    """4 streaming and 2 non-streaming greedy requests on threads; ``results[i]`` = (text, finish, error)."""

    def __init__(self, base: str, n_stream: int = 4, n_plain: int = 2):
        self.base = base
        self.results: dict[int, tuple[str, str | None, dict | None]] = {}
        self.events = [threading.Event() for _ in range(n_stream)]  # set once a stream got 2 events
        self.threads = [threading.Thread(target=self._stream, args=(i,)) for i in range(n_stream)]
        self.threads += [threading.Thread(target=self._plain, args=(n_stream + i,)) for i in range(n_plain)]
        for t in self.threads:
            t.start()

    def _body(self, stream: bool) -> dict:
        return {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}

    def _stream(self, i: int) -> None:
        text, finish, err, n = "", None, None, 0
        with httpx.Client(base_url=self.base, timeout=180) as c:
            with c.stream("POST", "/v1/completions", json=self._body(True)) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        err = event["error"]
                        continue
                    text += event["choices"][0]["text"]
                    finish = event["choices"][0]["finish_reason"] or finish
                    n += 1
                    if n >= 2:
                        self.events[i].set()
        self.events[i].set()
        self.results[i] = (text, finish, err)

    def _plain(self, i: int) -> None:
        r = httpx.post(self.base + "/v1/completions", json=self._body(False), timeout=180)
        body = r.json()
        self.results[i] = ((body["choices"][0]["text"], body["choices"][0]["finish_reason"], None)
                           if r.status_code == 200 else ("", None, body.get("error")))

    def wait_started(self, server: Server, n: int) -> None:
        for e in self.events:
            assert e.wait(60)
        vport = server.metrics_ports[0]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the non-streaming ones are running too
            text = httpx.get(f"http://127.0.0.1:{vport}/metrics", timeout=5).text
            m = re.search(r"^dartree_num_requests_running (\S+)", text, re.M)
            if m and float(m.group(1)) >= n:
                return
            time.sleep(0.05)
        raise TimeoutError(server.log_tail())

    def join(self) -> None:
        for t in self.threads:
            t.join(180)


def _reference(base: str) -> str:
    r = httpx.post(base + "/v1/completions", timeout=120, json={
        "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert r.status_code == 200
    return r.json()["choices"][0]["text"]


def _first_refusal(base: str, within_s: float = 10.0) -> httpx.Response:
    """The first answer other than 200 to a one-token request, polled every 10 ms right after the
    signal: the drain's 503 window lasts only as long as the in-flight requests, well under a second
    on a fast machine, and a request that got in before the gateway saw the signal is a 200."""
    deadline = time.monotonic() + within_s
    while True:
        r = httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=30)
        if r.status_code != 200 or time.monotonic() > deadline:
            return r
        time.sleep(0.01)


def test_sigterm_to_every_process_drains_once_and_everything_exits_0(tiny, tmp_path):
    log = tmp_path / "serve.log"
    with _serve(tiny, log) as srv:
        ref = _reference(srv.base)
        reqs = _Requests(srv.base)
        reqs.wait_started(srv, 6)
        supervisor = psutil.Process(srv.proc.pid)
        procs = [supervisor] + supervisor.children(recursive=True)  # the workers, their forkserver, ...
        assert {srv.child(name).pid for name in WORKERS} <= {p.pid for p in procs}
        for p in procs:  # what KillMode=control-group does
            p.send_signal(signal.SIGTERM)
        refused = _first_refusal(srv.base)
        reqs.join()
        code = srv.proc.wait(150)
    assert refused.status_code == 503, refused.text
    assert set(refused.json()["error"]) == {"message", "type", "param", "code"}
    for i, (text, finish, err) in sorted(reqs.results.items()):
        assert err is None and finish in ("length", "stop") and text == ref, (i, err, finish, text[:80])
    assert code == 0, log.read_text()[-3000:]
    out = log.read_text()
    for name in ("gateway", "verifier", "drafter"):
        assert f"{name} exited with code 0" in out, out[-3000:]
    assert "second stop signal" not in out and "drain timeout" not in out and "Traceback" not in out, out[-3000:]


@pytest.fixture(scope="module")
def alone_server(tiny, tmp_path_factory):
    with _serve(tiny, tmp_path_factory.mktemp("alone") / "serve.log") as srv:
        yield srv


@pytest.mark.slow  # a second server and a worker restart each: ~45 s on 2 shared cores
@pytest.mark.parametrize("victim", ["dartree-drafter", "dartree-verifie"], ids=["drafter", "verifier"])
def test_sigterm_to_one_worker_lets_its_in_flight_requests_finish(alone_server, victim):
    srv = alone_server
    ref = _reference(srv.base)
    old = srv.child(victim)
    reqs = _Requests(srv.base, n_stream=2, n_plain=1)
    reqs.wait_started(srv, 3)
    old.send_signal(signal.SIGTERM)
    reqs.join()
    for i, (text, finish, err) in sorted(reqs.results.items()):
        assert err is None and finish in ("length", "stop") and text == ref, (i, err, finish, text[:80])
    srv.wait_replaced(victim, old.pid, timeout=60)
    name = "drafter" if victim == "dartree-drafter" else "verifier"
    assert f"{name} died (exited with code 0); restarting it" in srv.log.read_text(), srv.log_tail()  # drained
    srv.wait_ready(timeout=120)
    assert _reference(srv.base) == ref

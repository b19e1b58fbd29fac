"""``dartree serve`` end to end: three real processes on ipc://, a tiny random model, the openai client.

Covers: completions and chat, streaming and not (stream == non-stream), greedy served == plain AR
decoding, logprobs through the openai client (the target's, equal across methods, stream ==
non-stream), metrics from every process, concurrent identical requests, kill -9 of a worker mid-stream
(clean error, restart, readiness false then true), and the SIGTERM drain. Tests run in file order
on one server; the drain test stops it.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from services.runtime import free_loopback_ports
from services.testing import Server, served_ar_reference, start_server

from .tiny import TINY_FLAGS, make_tiny_models

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_models(tmp_path_factory.mktemp("tiny"))


# The tests bound CPU-bound work by the pytest timeout (pyproject.toml), not by wall-clock budgets of
# their own: on the shared 2-core machines a 240-token answer of the tiny model takes 2 s idle and over
# a minute under load. WORK_TIMEOUT_S bounds one non-streamed answer; DRAIN_S is the server's drain
# budget, which the SIGTERM test's in-flight requests must finish within to end normally.
WORK_TIMEOUT_S = 600.0
DRAIN_S = 600.0


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    target_dir, drafter_dir = tiny
    log = tmp_path_factory.mktemp("log") / "serve.log"
    with start_server(*TINY_FLAGS, "--budget", "8", "--candidates", "8", "--width", "4", "--ping-timeout-s", "3",
                      "--draft-timeout-s", "10", "--drain-timeout-s", str(DRAIN_S), log=log, target=target_dir,
                      drafter=drafter_dir, ready_timeout=WORK_TIMEOUT_S, stop_timeout=DRAIN_S + 60) as srv:
        yield srv


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0, timeout=60)


def _ar_reference(target_dir: Path, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Plain greedy decoding of the tiny target in this process (the served answer must equal it)."""
    return served_ar_reference(target_dir, prompt_ids, max_tokens)


def _sse(r: httpx.Response) -> list:
    events = [line[6:] for line in r.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_completions_and_chat_stream_equal_non_stream_and_equal_plain_decoding(server):
    from gateway.text import TextModel

    client = _client(server)
    reference = _ar_reference(server.target_dir, TextModel(server.target_dir).encode("Hello world"), 24)
    for method in ("dartree-pruned", "ddtree", "dflash", "ar"):
        extra = {"speculative": {"method": method}, "return_token_ids": True}
        plain = client.completions.create(model="tiny", prompt="Hello world", max_tokens=24, extra_body=extra)
        chunks = list(client.completions.create(model="tiny", prompt="Hello world", max_tokens=24, stream=True,
                                                extra_body=extra))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == plain.choices[0].text, method
        ids = plain.choices[0].model_extra["token_ids"]
        assert len(ids) == plain.usage.completion_tokens
        assert ids == reference[:len(ids)], method  # lossless: the drafter changes speed, never output
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi 😀"}],
                                          max_completion_tokens=16)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi 😀"}], max_completion_tokens=16, stream=True)
        if c.choices)
    assert streamed == chat.choices[0].message.content


def test_stop_token_id_is_the_stop_reason_and_the_log_says_listening(server):
    """A request ended on an entry of ``stop_token_ids`` reports it as ``stop_reason`` through the
    real workers (the verifier's round chunk carries it), streamed and not; and the gateway's
    start-up line says it is listening, not that the server is running."""
    from gateway.text import TextModel

    client = _client(server)
    prompt_ids = TextModel(server.target_dir).encode("Hello world")
    ref = _ar_reference(server.target_dir, prompt_ids, 16)
    unseen = next(t for t in range(3, 300) if t not in ref)
    # the tiny target repeats one token after this prompt: a stop on it ends the request at its first
    # token (the prefill's), a stop id it never generates leaves the request to max_tokens
    for method in ("dartree-pruned", "ar"):
        for stop, want_ids, finish, reason in ((ref[0], [], "stop", ref[0]), (unseen, ref, "length", None)):
            body = {"speculative": {"method": method}, "return_token_ids": True, "stop_token_ids": [stop],
                    "ignore_eos": True}
            choice = client.completions.create(model="tiny", prompt="Hello world", max_tokens=16,
                                               extra_body=body).choices[0]
            assert (choice.finish_reason, choice.model_extra["stop_reason"]) == (finish, reason), method
            assert choice.model_extra["token_ids"] == want_ids
            last = [c for c in client.completions.create(model="tiny", prompt="Hello world", max_tokens=16,
                                                         stream=True, extra_body=body) if c.choices][-1]
            assert (last.choices[0].finish_reason, last.choices[0].model_extra["stop_reason"]) == (finish, reason)
    log = server.log_tail(1_000_000)
    assert "listening on http://" in log and "Uvicorn running on" not in log


def _reference_logprobs(target_dir: Path, prompt_ids: list[int], ids: list[int]) -> list[float]:
    """The tiny target's raw logprob of each of ``ids`` after ``prompt_ids``, from one causal forward."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt_ids + ids])).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt_ids) - 1:-1], dim=-1)
    return lp.gather(1, torch.tensor(ids)[:, None])[:, 0].tolist()


def test_logprobs_through_the_openai_client_for_both_endpoints(server):
    from gateway.text import TextModel

    client, text = _client(server), TextModel(server.target_dir)
    prompt_ids = text.encode("Hello world")
    seen = {}
    for method in ("dartree-pruned", "ar"):
        extra = {"speculative": {"method": method}, "return_token_ids": True}
        plain = client.completions.create(model="tiny", prompt="Hello world", max_tokens=20, logprobs=3,
                                          extra_body=extra)
        lp, ids = plain.choices[0].logprobs, plain.choices[0].model_extra["token_ids"]
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(ids)
        assert len(ids) == plain.usage.completion_tokens
        assert lp.tokens == [text.token_text(i) for i in ids]
        assert all(tok in top and 3 <= len(top) <= 4 for tok, top in zip(lp.tokens, lp.top_logprobs))
        assert lp.token_logprobs == pytest.approx(_reference_logprobs(server.target_dir, prompt_ids, ids), abs=1e-4)
        chunks = [c for c in client.completions.create(model="tiny", prompt="Hello world", max_tokens=20, logprobs=3,
                                                         stream=True, extra_body=extra) if c.choices]
        assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == lp.tokens
        assert [x for c in chunks for x in c.choices[0].logprobs.token_logprobs] == pytest.approx(lp.token_logprobs,
                                                                                                 abs=1e-5)
        assert [x for c in chunks for x in c.choices[0].logprobs.text_offset] == lp.text_offset
        seen[method] = lp.token_logprobs
    assert seen["dartree-pruned"] == pytest.approx(seen["ar"], abs=1e-4)

    messages = [{"role": "user", "content": "hi 😀"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=16, logprobs=True,
                                          top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert b"".join(bytes(e.bytes) for e in content).decode(errors="replace") == chat.choices[0].message.content
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.logprob - 1e-6 for e in content)
    streamed = [e for c in client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=16,
                                                          logprobs=True, top_logprobs=2, stream=True)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)

    for call, field in ((lambda: client.completions.create(model="tiny", prompt="x", logprobs=6), "logprobs"),
                        (lambda: client.chat.completions.create(model="tiny", messages=messages, logprobs=True,
                                                                top_logprobs=21), "top_logprobs")):
        with pytest.raises(openai.BadRequestError) as err:
            call()
        assert err.value.status_code == 400 and err.value.body["param"] == field


def test_every_process_exports_metrics_and_tau_is_consistent(server):
    vport, dport = server.metrics_ports
    v = httpx.get(f"http://127.0.0.1:{vport}/metrics").text
    d = httpx.get(f"http://127.0.0.1:{dport}/metrics").text
    g = httpx.get(server.base + "/metrics").text
    assert "dartree_spec_rounds_total" in v and "dartree_drafter_calls_total" in d
    assert "dartree_time_to_first_token_seconds" in g

    rounds, accepted = _total(v, "dartree_spec_rounds_total"), _total(v, "dartree_spec_accepted_tokens_total")
    emitted = _total(v, "dartree_spec_acceptance_length_sum")
    assert rounds > 0 and accepted <= emitted <= accepted + rounds  # emitted = accepted + a bonus per uncut round
    assert _total(v, "dartree_num_requests_running") == 0 and _total(d, "dartree_drafter_contexts") == 0


def test_real_prometheus_scrapes_all_three_and_tau_matches_the_engine(server, tmp_path):
    exe = shutil.which("prometheus")
    if exe is None:
        pytest.skip("no prometheus binary (Debian package 'prometheus'; the CI set-up installs it)")
    vport, dport = server.metrics_ports
    gport = int(server.base.rsplit(":", 1)[1])
    (prom_port,) = free_loopback_ports(1)
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text("global: {scrape_interval: 1s}\nscrape_configs:\n" + "".join(
        f"  - job_name: {job}\n    static_configs: [{{targets: ['127.0.0.1:{port}']}}]\n"
        for job, port in (("gateway", gport), ("verifier", vport), ("drafter", dport))))
    prom = subprocess.Popen([exe, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    api = f"http://127.0.0.1:{prom_port}/api/v1/query"
    try:
        httpx.post(server.base + "/v1/completions", json={"prompt": "tau", "max_tokens": 30}, timeout=60)
        v = httpx.get(f"http://127.0.0.1:{vport}/metrics").text  # the engine's own count, no traffic after this
        own = _total(v, "dartree_spec_acceptance_length_sum") / _total(v, "dartree_spec_acceptance_length_count")
        query = "sum(dartree_spec_acceptance_length_sum) / sum(dartree_spec_acceptance_length_count)"
        tau, up = None, 0
        for _ in range(120):
            try:
                up = len(httpx.get(api, params={"query": "up == 1"}).json()["data"]["result"])
                res = httpx.get(api, params={"query": query}).json()["data"]["result"]
                tau = float(res[0]["value"][1]) if res else None
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            if up == 3 and tau is not None and abs(tau - own) < 1e-9:
                break
            time.sleep(0.5)
        assert up == 3 and tau == pytest.approx(own, abs=1e-9) and tau >= 1.0
    finally:
        prom.terminate()
        prom.wait(20)


def _total(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def test_concurrent_identical_greedy_requests_agree(server):
    async def go():
        async with httpx.AsyncClient(base_url=server.base, timeout=60) as c:
            rs = await asyncio.gather(*(c.post("/v1/completions", json={"prompt": "The quick", "max_tokens": 20,
                                                                        "stream": bool(i % 2)}) for i in range(6)))
        return rs

    texts = set()
    for r in asyncio.run(go()):
        assert r.status_code == 200
        texts.add("".join(e["choices"][0]["text"] for e in _sse(r)) if r.headers["content-type"].startswith(
            "text/event-stream") else r.json()["choices"][0]["text"])
    assert len(texts) == 1


def _metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")
               or line.startswith(name + "{"))


def test_concurrent_different_requests_share_steps_and_equal_plain_decoding(server):
    """Different prompts, lengths and methods in flight together are verified in shared batched
    steps (the verifier's requests-per-step histogram sees steps of more than one request), and
    each greedy answer equals plain decoding of its prompt alone."""
    from gateway.text import TextModel

    tm = TextModel(server.target_dir)
    prompts = ["Hello world", "The quick brown fox", "One two", "A much longer prompt about many things " * 3]
    methods = ["ar", "dartree-pruned", "ddtree", "dflash"]
    vurl = f"http://127.0.0.1:{server.metrics_ports[0]}/metrics"
    before = httpx.get(vurl).text

    async def go():
        async with httpx.AsyncClient(base_url=server.base, timeout=60) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json={
                "prompt": p, "max_tokens": 24, "temperature": 0, "return_token_ids": True,
                "speculative": {"method": m}}) for p, m in zip(prompts * 2, methods + methods[::-1])))

    for r, p in zip(asyncio.run(go()), prompts * 2):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == _ar_reference(server.target_dir, tm.encode(p), 24)[
            :len(r.json()["choices"][0]["token_ids"])]
        assert r.json()["usage"]["completion_tokens"] == len(r.json()["choices"][0]["token_ids"])
    after = httpx.get(vurl).text
    steps = _metric(after, "dartree_step_requests_count") - _metric(before, "dartree_step_requests_count")
    reqs = _metric(after, "dartree_step_requests_sum") - _metric(before, "dartree_step_requests_sum")
    assert steps > 0 and reqs / steps > 1.5  # on average more than one request per forward
    assert _metric(after, 'dartree_kv_slots{state="used"}') == 0


def test_kill_9_of_the_drafter_mid_stream_loses_nothing_and_speculation_comes_back(server):
    """The stream goes on without speculation (no error event, the text of plain decoding); the
    supervisor starts a new drafter and later requests draft with it (the draft-token counter moves).

    No wall-clock budget of its own beyond the HTTP read timeouts: the new drafter's start-up and each
    request take as long as the machine's load makes them (the pytest timeout catches a hang)."""
    server.wait_ready(timeout=WORK_TIMEOUT_S)
    body = {"prompt": "x", "max_tokens": 240, "temperature": 0, "stream": True,
            "speculative": {"budget": 8}}  # explicit budget: drafts every round
    ref = httpx.post(server.base + "/v1/completions", timeout=WORK_TIMEOUT_S,
                     json={**body, "stream": False, "speculative": {"method": "ar"}}).json()["choices"][0]
    old = server.child("dartree-drafter")
    events = []
    with httpx.Client(base_url=server.base, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    if not events:
                        old.send_signal(signal.SIGKILL)
                    events.append(json.loads(line[6:]))
    assert not any("error" in e for e in events), [e for e in events if "error" in e]
    choices = [e["choices"][0] for e in events if e.get("choices")]
    assert "".join(ch["text"] for ch in choices) == ref["text"]
    assert choices[-1]["finish_reason"] == ref["finish_reason"]
    server.wait_replaced("dartree-drafter", old.pid, timeout=WORK_TIMEOUT_S)  # the supervisor starts a new one
    vport = server.metrics_ports[0]
    drafts = lambda: _metric(httpx.get(f"http://127.0.0.1:{vport}/metrics", timeout=60).text,  # noqa: E731
                             "dartree_spec_draft_tokens_total")
    while True:  # until the verifier has re-connected to the new drafter (its start-up under load: minutes)
        before = drafts()
        again = httpx.post(server.base + "/v1/completions", json={**body, "stream": False, "max_tokens": 16},
                           timeout=WORK_TIMEOUT_S)
        assert again.status_code == 200 and ref["text"].startswith(again.json()["choices"][0]["text"]), again.text
        if drafts() > before:
            break
        time.sleep(0.2)


@pytest.mark.parametrize("victim", ["dartree-verifie"], ids=["verifier"])
def test_kill_9_of_a_worker_mid_stream_gives_a_clean_error_and_recovers(server, victim):
    server.wait_ready(timeout=WORK_TIMEOUT_S)  # a previous kill's restart can still flip readiness for a heartbeat or two
    old = server.child(victim)
    body = {"prompt": "x", "max_tokens": 240, "stream": True,
            "speculative": {"budget": 8}}  # explicit budget: drafts every round, so it needs the drafter
    with httpx.Client(base_url=server.base, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    old.send_signal(signal.SIGKILL)
                    break
            tail = [line for line in lines if line.startswith("data: ")]
    assert tail[-1] == "data: [DONE]" and "error" in json.loads(tail[-2][6:]), tail[-3:]
    server.wait_replaced(victim, old.pid, timeout=WORK_TIMEOUT_S)  # the supervisor starts a new one
    server.wait_ready(timeout=WORK_TIMEOUT_S)  # its start-up (target, cost sweep) under load: minutes
    ok = httpx.post(server.base + "/v1/completions", json={"prompt": "x", "max_tokens": 8}, timeout=WORK_TIMEOUT_S)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8


def test_sigterm_drains_in_flight_requests_and_refuses_new_ones(server):
    """SIGTERM to the supervisor: new requests get 503 while the in-flight ones finish normally, then
    the server exits 0.

    The in-flight stream is read on a thread of its own, so the probes never wait behind it; they
    run until the gateway answers 503 or the stream has ended (then the drain is over and the probe
    came too late: six sequences of 240 tokens outlast the supervisor's reaction even on a fast
    machine). Under load the sequences take longer, within the drain budget ``DRAIN_S``."""
    server.wait_ready(timeout=WORK_TIMEOUT_S)
    started, rest = threading.Event(), []

    def read_stream():
        with httpx.Client(base_url=server.base, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 240, "n": 6,
                                                            "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        rest.append(line)
                        started.set()
        started.set()

    reader = threading.Thread(target=read_stream, daemon=True)
    reader.start()
    assert started.wait(WORK_TIMEOUT_S) and rest, "the stream never started"
    server.proc.send_signal(signal.SIGTERM)
    refused = None
    while reader.is_alive():  # the gateway's drain begins a moment after the signal (its supervisor relays it)
        refused = httpx.post(server.base + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
        if refused.status_code == 503:
            break
        time.sleep(0.05)
    assert refused is not None and refused.status_code == 503, "the drain never refused a request"
    reader.join(DRAIN_S + 30)
    assert not reader.is_alive()
    assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert server.proc.wait(DRAIN_S + 60) == 0


def test_start_server_passes_env_and_raises_with_the_log_when_the_server_dies_before_ready(tmp_path):
    """The launcher's error contract (no model is loaded: the server refuses its environment at start)."""
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"exited with code 2(.|\n)*DARTREE_MAX_RUNNING='lots'"):
        with start_server(log=tmp_path / "serve.log", target=tmp_path, drafter="none",
                          env={"DARTREE_MAX_RUNNING": "lots"}, ready_timeout=60):
            pytest.fail("the server must not become ready")
    assert time.monotonic() - t0 < 60

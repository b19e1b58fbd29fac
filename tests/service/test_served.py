"""Gateway (real uvicorn) -> ZMQ ipc:// -> verifier worker (fake engine), driven by the official openai client."""

from __future__ import annotations

import asyncio
import shutil
import socket
import tempfile
import threading
import time
from contextlib import contextmanager

import httpx
import openai
import pytest
import uvicorn

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.engine_client import ZmqEngineClient
from gateway.text import TextModel
from services.protocol import PeerInfo
from tests.doubles import FakeEngine

from .test_workers import running_verifier

TEXT = "Hello world, 你好世界 😀 done."


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def served(model_dir, engine, **gateway_cfg):
    sockdir = tempfile.mkdtemp(prefix="dt-", dir="/tmp")
    try:
        with running_verifier(sockdir, engine) as (worker, io, endpoint):
            text = TextModel(model_dir)
            port = _free_port()
            cfg = GatewayConfig(target=str(model_dir), served_model_name="tiny", port=port, default_temperature=0.0,
                                ping_interval_s=0.05, **gateway_cfg)
            local = PeerInfo(role="gateway", epoch="g", tokenizer_hash="", eos_token_id=-1)
            app = create_app(cfg, ZmqEngineClient(endpoint, local, 0.05, 2.0), text)
            server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
            thread = threading.Thread(target=server.run, daemon=True)
            thread.start()
            base = f"http://127.0.0.1:{port}"
            for _ in range(200):
                try:
                    if httpx.get(base + "/health/ready").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.02)
            try:
                yield base, app.state.gateway, worker
            finally:
                server.should_exit = True
                thread.join(10)
    finally:
        shutil.rmtree(sockdir, ignore_errors=True)


@pytest.fixture
def text_rounds(bytelevel_dir):
    ids = TextModel(bytelevel_dir).encode(TEXT, add_special_tokens=False)
    return [ids[i:i + 3] for i in range(0, len(ids), 3)]


def test_openai_client_completions_and_chat_stream_equals_non_stream(bytelevel_dir, text_rounds):
    engine = FakeEngine(rounds=text_rounds)
    with served(bytelevel_dir, engine) as (base, gw, worker):
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        plain = client.completions.create(model="tiny", prompt="Say:", max_tokens=64)
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="tiny", prompt="Say:", max_tokens=64, stream=True) if c.choices)
        assert plain.choices[0].text == streamed == TEXT
        assert plain.usage.completion_tokens == sum(len(r) for r in text_rounds)
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                     stream=True, stream_options={"include_usage": True}))
        assert chat.choices[0].message.content == TEXT
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == TEXT
        assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
        assert [m.id for m in client.models.list().data] == ["tiny"]
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="tiny", prompt="x", max_tokens=5, extra_body={"best_of": 3})
        assert info.value.body["param"] == "best_of"
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="other", prompt="x")


def test_client_disconnect_mid_stream_frees_everything(bytelevel_dir):
    engine = FakeEngine(rounds=[[100]] * 250, step_delay_s=0.005)
    with served(bytelevel_dir, engine) as (base, gw, worker):
        async def go():
            async with httpx.AsyncClient(base_url=base, timeout=10) as client:
                async with client.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 250,
                                                                            "stream": True}) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            break  # hang up after the first event

        asyncio.run(go())
        for _ in range(300):
            if engine.num_active() == 0 and gw.in_flight == 0:
                break
            time.sleep(0.01)
        assert engine.num_active() == 0 and gw.in_flight == 0, (len(engine.steps), gw.in_flight)
        assert 0 < len(engine.steps) < 250, len(engine.steps)
        assert worker.metrics.registry.get_sample_value("dartree_num_requests_running") == 0
        assert worker.metrics.registry.get_sample_value("dartree_aborts_total", {"reason": "client"}) == 1


def test_inproc_engine_client_runs_the_same_gateway_over_an_in_process_verifier(bytelevel_dir, text_rounds):
    """R15: the gateway's EngineClient over a verifier worker on a thread, no sockets."""
    from gateway.engine_client import InprocEngineClient
    from services.verifier.worker import VerifierWorker, VerifierWorkerConfig

    from .fakes import verifier_info

    engine = FakeEngine(rounds=text_rounds)
    text = TextModel(bytelevel_dir)
    worker = VerifierWorker(engine, verifier_info(text.vocab_size), VerifierWorkerConfig())
    client = InprocEngineClient(post=lambda msg: worker.post(b"inproc", msg), hello=worker.hello,
                                status=worker.status, local=PeerInfo(role="gateway", epoch="g"))
    worker.send = lambda identity, msg, frames=(): client.deliver_threadsafe(msg)
    stop = threading.Event()
    thread = threading.Thread(target=worker.event_loop, args=(stop,), daemon=True)
    thread.start()
    app = create_app(GatewayConfig(target=str(bytelevel_dir), served_model_name="tiny", default_temperature=0.0),
                     client, text)

    async def go():
        await client.start()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return (await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 64})).json()

    try:
        body = asyncio.run(go())
    finally:
        stop.set()
        thread.join(5)
    assert body["choices"][0]["text"] == TEXT and engine.num_active() == 0


"""The gateway's request-body deadline (``--body-timeout``), over raw sockets against a real uvicorn.

A client that sends its headers and then stalls mid-body gets a 408 in the OpenAI error shape once
the deadline passes, the connection is closed, and nothing reaches the engine. A body that is slow
but complete in time is served, and a response that outlasts the deadline is not cut (the deadline
covers reading the body only).
"""

from __future__ import annotations

import argparse
import json
import socket
import time

import httpx

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.text import TextModel
from services.testing import run_uvicorn

from .fakes import FakeEngineClient, Script, verifier_info

TIMEOUT_S = 0.5


def _gateway(model_dir, script=None, **config):
    text = TextModel(model_dir)
    ids = text.encode("Hello world", add_special_tokens=False)
    engine = FakeEngineClient(verifier_info(text.vocab_size), script or (lambda gen: Script(ids)))
    cfg = GatewayConfig(target=str(model_dir), served_model_name="tiny", default_temperature=0.0,
                        body_timeout=TIMEOUT_S, **config)
    return create_app(cfg, engine, text), engine


def _headers(port: int, length: int, extra: str = "") -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n{extra}\r\n").encode()


def _read_until_closed(sock: socket.socket, limit_s: float) -> tuple[bytes, bool]:
    """Everything the server sends; ``True`` when it closed the connection within ``limit_s``."""
    sock.settimeout(limit_s)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        return data, False
    return data, True


def test_a_stalled_body_gets_a_408_and_the_connection_is_closed(bytelevel_dir):
    app, engine = _gateway(bytelevel_dir)
    body = json.dumps({"prompt": "Hello", "max_tokens": 4}).encode()
    with run_uvicorn(app) as base:
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as sock:
            t0 = time.monotonic()
            sock.sendall(_headers(port, len(body)) + body[:5])  # then stall
            data, closed = _read_until_closed(sock, limit_s=5.0)
            elapsed = time.monotonic() - t0
        metrics = httpx.get(base + "/metrics").text
    head, _, payload = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), data[:200]
    assert b"connection: close" in head.lower()
    assert closed, "the server kept the connection open after the 408"
    assert TIMEOUT_S * 0.8 <= elapsed < TIMEOUT_S + 2.0, elapsed
    err = json.loads(payload)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == "body_timeout" and err["type"] == "timeout_error"
    assert engine.generated == []  # nothing was sent downstream
    assert 'dartree_rejected_requests_total{reason="body_timeout"} 1.0' in metrics


def test_a_slow_but_complete_body_and_a_long_response_are_not_cut(bytelevel_dir):
    ids = TextModel(bytelevel_dir).encode("one two three four five six", add_special_tokens=False)
    slow = lambda gen: Script(ids, round_sizes=[1], delay_s=0.1)  # noqa: E731 - ~2.5 s of rounds > the deadline
    app, engine = _gateway(bytelevel_dir, slow)
    body = json.dumps({"prompt": "Hello", "max_tokens": 64}).encode()
    with run_uvicorn(app) as base:
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(_headers(port, len(body), "Connection: close\r\n") + body[:5])
            time.sleep(TIMEOUT_S / 2)
            sock.sendall(body[5:])
            data, closed = _read_until_closed(sock, limit_s=10.0)
        assert closed and data.startswith(b"HTTP/1.1 200 "), data[:300]
        assert json.loads(data.partition(b"\r\n\r\n")[2])["choices"][0]["text"] == "one two three four five six"
        t0 = time.monotonic()
        with httpx.stream("POST", base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 64, "stream": True},
                          timeout=30) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert time.monotonic() - t0 > 2 * TIMEOUT_S  # the stream outlived the body deadline
    assert lines[-1] == "data: [DONE]" and "error" not in lines[-2]
    assert len(engine.generated) == 2


def test_body_timeout_comes_from_the_flag_or_the_environment(monkeypatch):
    from services.serve import add_serve_args, config_from_args

    def parse(*argv: str) -> GatewayConfig:
        parser = argparse.ArgumentParser()
        add_serve_args(parser)
        return config_from_args(GatewayConfig, parser.parse_args(list(argv)))

    assert parse().body_timeout == 10.0
    assert parse("--body-timeout", "2.5").body_timeout == 2.5
    monkeypatch.setenv("DARTREE_BODY_TIMEOUT", "3")
    assert parse().body_timeout == 3.0
    assert parse("--body-timeout", "0").body_timeout == 0.0  # the flag beats the variable; 0 = off

"""Shared fixtures of the reliability suite: one ``dartree serve`` on the tiny models for the whole session.

The server is the one ``tests/service/test_e2e_tiny.py`` starts (same models, same launcher), plus the
limits and the API key the security checks need. Every test that talks to it sends :data:`AUTH`.
Tests that must break a server (SIGSTOP, other models) start their own with :func:`start_tiny_server`.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from services.testing import Server, start_server
from tests.service.tiny import TINY_FLAGS, make_tiny_models

API_KEY = "reliability-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# the session server's limits (the security tests check each of them)
MAX_CONCURRENT = 24
MAX_PROMPT_TOKENS = 200
MAX_TOKENS_LIMIT = 240
MAX_BODY_BYTES = 256 * 1024


def start_tiny_server(target_dir: Path, drafter_dir: Path | str, log: Path, *extra: str,
                      ready_timeout: float = 180.0):
    """:func:`services.testing.start_server` on the tiny models with :data:`TINY_FLAGS`, one OpenMP
    thread (unless set) and a passive OpenMP wait policy; yields a :class:`Server`."""
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "OMP_WAIT_POLICY": "PASSIVE"}
    return start_server(*TINY_FLAGS, *extra, log=log, target=target_dir, drafter=drafter_dir, env=env,
                        ready_timeout=ready_timeout)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    return make_tiny_models(tmp_path_factory.mktemp("tiny-rel"))


@pytest.fixture(scope="session")
def rel_server(tiny_models, tmp_path_factory):
    """The tiny server with an API key (metrics left open) and small limits."""
    target_dir, drafter_dir = tiny_models
    log = tmp_path_factory.mktemp("rel-log") / "serve.log"
    with start_tiny_server(target_dir, drafter_dir, log, "--api-key", API_KEY, "--budget", "8", "--candidates",
                           "8", "--width", "4", "--ping-timeout-s", "3", "--draft-timeout-s", "10",
                           "--drain-timeout-s", "10", "--max-concurrent-requests", str(MAX_CONCURRENT),
                           "--max-prompt-tokens", str(MAX_PROMPT_TOKENS), "--max-tokens-limit", str(MAX_TOKENS_LIMIT),
                           "--max-body-bytes", str(MAX_BODY_BYTES), "--max-running", "8", "--max-waiting", "64") as srv:
        yield srv


def metric_total(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` (optionally only those carrying ``labels``) in a /metrics page."""
    total = 0.0
    for line in text.splitlines():
        if not (line.startswith(name + "{") or line.startswith(name + " ")):
            continue
        if labels and not all(f'{k}="{v}"' in line for k, v in labels.items()):
            continue
        total += float(line.split()[-1])
    return total


def scrape(server: Server) -> dict[str, str]:
    """The three processes' /metrics pages."""
    vport, dport = server.metrics_ports
    return {"gateway": httpx.get(server.base + "/metrics", timeout=10).text,
            "verifier": httpx.get(f"http://127.0.0.1:{vport}/metrics", timeout=10).text,
            "drafter": httpx.get(f"http://127.0.0.1:{dport}/metrics", timeout=10).text}

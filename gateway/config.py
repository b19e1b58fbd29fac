"""The gateway's configuration (one frozen dataclass; CLI flags and DARTREE_* variables mirror the fields)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class GatewayConfig:
    """Gateway settings. Every field is a CLI flag (``--field-name``) and an env var (``DARTREE_FIELD_NAME``).

    Attributes:
        host: the address the HTTP API listens on (loopback by default).
        port: the TCP port the HTTP API listens on.
        target: the target model (default name or a local HF directory); its tokenizer is read here.
        served_model_name: the ``model`` clients send ("" = the target's name).
        verifier_endpoint: ZMQ endpoint of the verifier ("" = the default ipc:// socket).
        api_key: if set, ``Authorization: Bearer <key>`` is required on every path but the health
            checks, the OpenAPI schema and docs, and ``/metrics`` (unless ``--metrics-auth``).
        metrics_auth: also require the key on /metrics.
        max_concurrent_requests: requests in flight before 429 (the gateway's admission limit). A request
            holds its slot from the end of its body on: while it is tokenized, queued and generated.
        tokenizer_threads: worker threads that validate, render and tokenize request bodies off the
            event loop (bodies of 256 KiB or more share one more thread of their own).
        max_body_bytes: largest request body accepted (413 beyond).
        body_timeout: seconds from a request's headers to the end of its body; a client still sending
            then gets 408 and the connection is closed (0 = no limit).
        max_prompt_tokens: largest prompt accepted (0 = up to the context window).
        max_tokens_limit: largest ``max_tokens`` accepted (0 = up to the context window).
        default_max_tokens: completions' ``max_tokens`` when omitted (OpenAI: 16); chat uses the context.
        default_temperature: temperature when omitted (OpenAI: 1.0).
        request_timeout_s: a request still running after this is aborted (504 or error event).
        health_generate_timeout_s: deadline of the ``/health/generate`` probe's generation (503 beyond).
        drain_timeout_s: on SIGTERM, how long in-flight requests may finish (new ones get 503).
        ping_interval_s, ping_timeout_s: verifier liveness probing: a verifier that answered no ping for
            ``ping_timeout_s`` makes readiness false and fails the requests in flight (fail-fast).
        retry_after_s: ``Retry-After`` sent with 429.
        sse_keepalive_s: an SSE stream that sent the client nothing for this long (seconds) gets a
            comment line, whether or not rounds arrive meanwhile. A stream's status line and
            headers go out at its first round or at most 0.5 s after admission (then with a comment
            line), so a queued stream is not silent; a refusal that comes later is an error event.
        json_whitespace: the JSON layout a structured-output or forced-tool-call grammar allows:
            ``flexible`` (at most 20 spaces / newlines between tokens, so pretty-printed JSON, the
            layout the model and its drafter tend to write) or ``compact`` (no whitespace at all).
        log_level: python logging level name.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    target: str = "smollm2-135m-instruct"
    served_model_name: str = ""
    verifier_endpoint: str = ""
    api_key: str = ""
    metrics_auth: bool = False
    max_concurrent_requests: int = 64
    tokenizer_threads: int = 2
    max_body_bytes: int = 4 * 1024 * 1024
    body_timeout: float = 10.0
    max_prompt_tokens: int = 0
    max_tokens_limit: int = 0
    default_max_tokens: int = 16
    default_temperature: float = 1.0
    request_timeout_s: float = 600.0
    health_generate_timeout_s: float = 10.0
    drain_timeout_s: float = 30.0
    ping_interval_s: float = 1.0
    ping_timeout_s: float = 3.0
    retry_after_s: int = 1
    sse_keepalive_s: float = 15.0
    json_whitespace: str = "flexible"
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port {self.port} is not a TCP port")
        for name in ("max_concurrent_requests", "max_body_bytes", "default_max_tokens", "tokenizer_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("body_timeout", "request_timeout_s", "drain_timeout_s", "ping_interval_s", "ping_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.json_whitespace not in ("flexible", "compact"):
            raise ValueError(f"json_whitespace must be 'flexible' or 'compact', not {self.json_whitespace!r}")
        if not (math.isfinite(self.default_temperature) and self.default_temperature >= 0):
            raise ValueError(f"default_temperature must be a finite number >= 0 (got {self.default_temperature})")
        if self.health_generate_timeout_s <= 0:
            raise ValueError("health_generate_timeout_s must be > 0")

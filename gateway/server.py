"""Run the gateway process: resolve the tokenizer, connect to the verifier, serve HTTP, drain on SIGTERM.

On SIGTERM/SIGINT the gateway keeps listening but answers new requests with 503 (readiness goes
false), lets in-flight requests finish for up to ``drain_timeout_s``, then ends the ones still
running (streams: a ``server_shutdown`` error event and ``[DONE]``; others: a 503) and stops uvicorn.
A second SIGTERM/SIGINT ends them at once. The supervisor's drain signal
(:data:`services.runtime.DRAIN_SIGNAL`) starts the same drain but never counts as a second signal
(a SIGTERM sent to the whole process group reaches the gateway too); its stop-now signal
(:data:`services.runtime.STOP_NOW_SIGNAL`) ends the in-flight requests at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from pathlib import Path

import uvicorn

from gateway.app import RequestIdLogFilter, create_app
from gateway.config import GatewayConfig
from gateway.engine_client import ZmqEngineClient
from gateway.handlers import CUT_BY_STOP
from gateway.text import TextModel
from services.protocol import PeerInfo
from services.runtime import DRAIN_SIGNAL, STOP_NOW_SIGNAL, trim_heap
from services.wire import ipc_endpoint, new_epoch

log = logging.getLogger("gateway")
CUT_GRACE_S = 3.0  # after the drain timeout: time for cut responses to send their last bytes
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"


def model_dir(target: str) -> Path:
    """The local directory holding the target's tokenizer: the default target's, a local directory,
    or a hub id's snapshot in the hub cache (never converts or downloads anything)."""
    from services.models.registry import DEFAULT_TARGET, cache_root, cached_snapshot, is_hub_id

    path = cache_root() / DEFAULT_TARGET if target in ("", DEFAULT_TARGET) else Path(target).expanduser()
    if not path.exists() and is_hub_id(target):
        path = cached_snapshot(target) or path
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {path}: start the verifier first (it prepares the "
                                f"default target and downloads a hub id into the hub cache) or pass --target "
                                f"<local HF directory>")
    return path


class ListeningLogFilter(logging.Filter):
    """Rewords uvicorn's start-up line ("Uvicorn running on URL (Press CTRL+C to quit)"), logged when
    the socket is bound, long before the workers are ready: "listening on URL; not ready until the
    workers are (GET /health/ready)". Other records pass unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith("Uvicorn running on "):
            record.msg = "listening on " + record.msg.removeprefix("Uvicorn running on ").split(" (Press")[0] \
                + "; not ready until the workers are (GET /health/ready)"
            record.__dict__.pop("color_message", None)
        return True


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdLogFilter())
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def build_app(config: GatewayConfig):
    """The FastAPI app wired to a ZMQ engine client (connects when the app starts)."""
    text = TextModel(model_dir(config.target))
    # parsing tokenizer.json leaves its freed heap resident: SmolLM2's (3.5 MB, parsed twice) ~27 MB
    trim_heap()
    local = PeerInfo(role="gateway", epoch=new_epoch(), tokenizer_hash=text.tokenizer_hash,
                     eos_token_id=text.eos_token_id, special_token_ids=text.special_token_ids)
    endpoint = config.verifier_endpoint or ipc_endpoint("verifier")
    engine = ZmqEngineClient(endpoint, local, config.ping_interval_s, config.ping_timeout_s)
    return create_app(config, engine, text)


class _DrainingServer(uvicorn.Server):
    """uvicorn that drains (503 for new requests, in-flight finish) before it stops; a second signal
    (or the drain timeout) ends the requests still in flight cleanly (:meth:`Gateway.cut_in_flight`)."""

    def __init__(self, config: uvicorn.Config, app, drain_timeout_s: float):
        super().__init__(config)
        self._app, self._drain_timeout_s = app, drain_timeout_s
        self._drain_task: asyncio.Task | bool | None = None
        self._terms = 0  # SIGTERM/SIGINT received (the supervisor's drain signal is not counted)

    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn's SIGTERM/SIGINT handling plus the supervisor's drain and stop-now signals."""
        if threading.current_thread() is not threading.main_thread():
            with super().capture_signals():
                yield
            return
        extra = {sig: signal.signal(sig, self.handle_exit) for sig in (DRAIN_SIGNAL, STOP_NOW_SIGNAL)}
        try:
            with super().capture_signals():
                yield
        finally:
            for sig, handler in extra.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame) -> None:
        if sig not in (signal.SIGTERM, signal.SIGINT, DRAIN_SIGNAL, STOP_NOW_SIGNAL):
            return super().handle_exit(sig, frame)
        loop = asyncio.get_event_loop()
        self._terms += sig in (signal.SIGTERM, signal.SIGINT)
        second = sig in (signal.SIGTERM, signal.SIGINT) and self._terms > 1
        if sig == STOP_NOW_SIGNAL or second:
            # end the in-flight requests now (error event / 503), the drain then completes
            log.warning("%s: ending the requests still in flight",
                        "second stop signal" if second else "told to stop now")
            loop.call_soon_threadsafe(self._app.state.gateway.cut_in_flight, CUT_BY_STOP)
        if self._drain_task is None:
            self._drain_task = True  # set before the task exists: a second signal must not start another
            loop.call_soon_threadsafe(lambda: setattr(self, "_drain_task", loop.create_task(self._drain())))

    async def _drain(self) -> None:
        gw = self._app.state.gateway
        gw.begin_drain()
        log.info("draining: %d requests in flight, up to %.0f s", gw.in_flight, self._drain_timeout_s)
        if not await gw.wait_idle(self._drain_timeout_s):
            log.warning("drain timeout: ending %d request(s) still in flight with a server_shutdown error",
                        gw.in_flight)
            gw.cut_in_flight()
            if not await gw.wait_idle(CUT_GRACE_S):
                log.warning("%d responses did not finish within %g s of the cut", gw.in_flight, CUT_GRACE_S)
        self.should_exit = True


def run_gateway(config: GatewayConfig) -> None:
    """Serve until drained (blocking)."""
    setup_logging(config.log_level)
    app = build_app(config)
    uv = uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level.lower(),
                        access_log=False, timeout_graceful_shutdown=5, lifespan="on")
    logging.getLogger("uvicorn.error").addFilter(ListeningLogFilter())  # after uvicorn's own logging set-up
    _DrainingServer(uv, app, config.drain_timeout_s).run()

"""FastAPI routes of the OpenAI-compatible API, the edge middleware (request ids, API key, body read
deadline) and error shapes.

Never imports torch (tests/test_layering.py): the gateway is HTTP, text and streaming only.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import re
import time
import uuid

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from gateway.config import GatewayConfig
from gateway.engine_client import EngineClient
from gateway.handlers import Gateway, log_rejection, request_id_var
from gateway.probe import GenerateProbe
from gateway.schemas import ApiError, ChatCompletionRequest, CompletionRequest
from gateway.text import TextModel
from services.metrics import GatewayMetrics

log = logging.getLogger("gateway")
REQUEST_ID_RE = re.compile(r"^[\x21-\x7e]{1,128}$")  # printable ASCII, no spaces, <= 128 chars
# machine-readable ``code`` of the errors Starlette raises itself (unknown route, wrong HTTP method)
HTTP_ERROR_CODES = {404: "not_found", 405: "method_not_allowed"}


def create_app(config: GatewayConfig, engine: EngineClient, text: TextModel,
               metrics: GatewayMetrics | None = None) -> FastAPI:
    """The ASGI app; ``app.state.gateway`` holds the :class:`Gateway` (drain, counters)."""
    gw = Gateway(config, engine, text, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        yield
        await engine.close()
        gw.requests.close()

    app = FastAPI(title="DARTree Serve", version="1", lifespan=lifespan)
    app.state.gateway = gw
    _routes(app, gw, GenerateProbe(engine, text, config.health_generate_timeout_s))
    _error_handlers(app)
    app.add_middleware(BodyTimeoutMiddleware, timeout_s=config.body_timeout)
    app.add_middleware(EdgeMiddleware, api_key=config.api_key, metrics_auth=config.metrics_auth)  # outermost
    _openapi(app)
    return app


def _routes(app: FastAPI, gw: Gateway, probe: GenerateProbe) -> None:
    @app.post("/v1/completions", openapi_extra=_body("CompletionRequest"))
    async def completions(request: Request) -> Response:
        return await gw.handle(request, "completion")

    @app.post("/v1/chat/completions", openapi_extra=_body("ChatCompletionRequest"))
    async def chat_completions(request: Request) -> Response:
        return await gw.handle(request, "chat")

    @app.get("/v1/models")
    async def models() -> dict:
        return gw.models()

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> dict:
        """OpenAI ``models.retrieve``: the model card, or 404 in the OpenAI error shape."""
        return gw.model_card(model)

    @app.get("/health/live")
    async def live() -> dict:
        return {"status": "ok"}

    @app.get("/health")
    @app.get("/health/ready")
    async def ready() -> JSONResponse:
        """200 when the server can serve a request, else 503 with the reason. ``/health`` (the path
        vLLM, TGI and llama.cpp's server answer, which clients and probes call) is the same check."""
        ok, why = gw.readiness()
        return JSONResponse({"status": "ready" if ok else "unavailable", "detail": why}, status_code=200 if ok else 503)

    @app.get("/health/generate")
    async def health_generate() -> JSONResponse:
        """A real greedy generation through verifier and drafter (see gateway/probe.py); for monitoring."""
        ok, why, seconds = (False, "draining", 0.0) if gw.draining else await probe.run()
        if ok:
            return JSONResponse({"status": "ok", "latency_ms": round(1000 * seconds, 1)})
        log.warning("generation probe failed after %.3f s: %s", seconds, why)
        err = ApiError(503, f"the generation probe failed: {why}", None, "health_check_failed")
        return JSONResponse(err.body(), status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # HEAD answers as GET does, without the body (uvicorn drops it): monitors and caches probe with it
    for path, fn in (("/health", ready), ("/health/live", live), ("/health/ready", ready), ("/v1/models", models),
                     ("/v1/models/{model:path}", retrieve_model), ("/metrics", metrics)):
        app.add_api_route(path, fn, methods=["HEAD"], include_in_schema=False)


def _error_handlers(app: FastAPI) -> None:
    def shaped(err: ApiError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> JSONResponse:
        return shaped(err)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        return shaped(ApiError(400, f"invalid request: {err.errors()[0].get('msg', '')}", None, "invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        code = HTTP_ERROR_CODES.get(err.status_code, f"http_{err.status_code}")
        return shaped(ApiError(err.status_code, str(err.detail), None, code, dict(err.headers or {})))

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, err: ClientDisconnect) -> JSONResponse:
        # The client closed the connection mid-body: nothing to answer, and not a server fault.
        log.info("client disconnected before sending the whole request body")
        return shaped(ApiError(400, "the client disconnected before the request body was complete", None,
                               "client_disconnected"))

    @app.exception_handler(Exception)
    async def internal(request: Request, err: Exception) -> JSONResponse:
        log.exception("internal error")
        return shaped(ApiError(500, "internal server error", None, "internal_error"))


class EdgeMiddleware:
    """Pure ASGI (streaming-safe): validates/assigns X-Request-Id, echoes it, checks the API key
    (:meth:`_authorized`: a 401 in the OpenAI error shape before any route runs)."""

    def __init__(self, app, api_key: str = "", metrics_auth: bool = False):
        self.app, self.api_key, self.metrics_auth = app, api_key.encode(), metrics_auth

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        rid = headers.get(b"x-request-id")
        if rid is not None:
            rid = rid.decode("latin-1")
            if not REQUEST_ID_RE.match(rid):
                err = ApiError(400, "X-Request-Id must be 1 to 128 printable ASCII characters without spaces",
                               "x-request-id", "invalid_request_id")
                return await _send_error(err, scope, receive, send, None)
        else:
            rid = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        token = request_id_var.set(rid)
        try:
            if not self._authorized(scope["path"], scope["headers"]):
                err = ApiError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')", None,
                               "invalid_api_key")
                return await _send_error(err, scope, receive, send, rid)

            async def send_with_id(message) -> None:
                if message["type"] == "http.response.start":
                    message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode())]
                await send(message)

            await self.app(scope, receive, send_with_id)
        finally:
            request_id_var.reset(token)

    def _authorized(self, path: str, headers: list[tuple[bytes, bytes]]) -> bool:
        """Whether a request to ``path`` with these raw ASGI headers may pass (see :func:`bearer_matches`).

        With a key set, every path needs it except :data:`OPEN_PATHS` (and ``/metrics`` unless
        ``metrics_auth``): unknown paths, path variants and every method (HEAD, OPTIONS) included.
        """
        if not self.api_key:
            return True
        if path in OPEN_PATHS or (path == "/metrics" and not self.metrics_auth):
            return True
        return bearer_matches([v for k, v in headers if k.lower() == b"authorization"], self.api_key)


# Paths served without the API key: health (for orchestrators) and the API's own description.
OPEN_PATHS = frozenset({"/health", "/health/live", "/health/ready", "/health/generate", "/openapi.json", "/docs",
                        "/docs/oauth2-redirect", "/redoc"})
MAX_AUTHORIZATION_BYTES = 4096


def bearer_matches(values: list[bytes], key: bytes) -> bool:
    """Whether the ``Authorization`` header values carry exactly ``Bearer <key>``.

    Exactly one header is accepted (two or more, whatever their order, are refused); spaces and tabs
    around the whole value are not part of it (RFC 7230 OWS: HTTP parsers drop them too); the scheme
    is case-insensitive and separated from the credentials by one or more spaces (RFC 7235); the
    credentials are compared byte for byte, in constant time, with ``key`` (any other byte, a tab
    included, makes them differ). Never raises, whatever the bytes.
    """
    if len(values) != 1 or not key or len(values[0]) > MAX_AUTHORIZATION_BYTES:
        return False
    scheme, sep, credentials = values[0].strip(b" \t").partition(b" ")
    if not sep or scheme.lower() != b"bearer":
        return False
    return hmac.compare_digest(credentials.lstrip(b" "), key)


class BodyTimeoutMiddleware:
    """Pure ASGI: a request whose body is not complete ``timeout_s`` after its headers gets a 408.

    The app's reads of the body (``receive`` calls until ``more_body`` is false) run against one
    deadline; on expiry the read raises an :class:`ApiError` (408, ``Connection: close``, so the
    server closes the connection after answering) and nothing reaches the engine. Later ``receive``
    calls (the disconnect watch of a long response) pass through untouched. ``timeout_s`` 0: off.
    """

    def __init__(self, app, timeout_s: float):
        self.app, self.timeout_s = app, timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not self.timeout_s:
            return await self.app(scope, receive, send)
        deadline = time.monotonic() + self.timeout_s
        body_done = False

        async def receive_by_deadline():
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), deadline - time.monotonic())
            except TimeoutError:
                log.info("request body still incomplete after %g s: 408", self.timeout_s)
                raise ApiError(408, f"the request body was not complete within {self.timeout_s:g} s", None,
                               "body_timeout", headers={"Connection": "close"}) from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, receive_by_deadline, send)


async def _send_error(err: ApiError, scope, receive, send, rid: str | None) -> None:
    log_rejection(err)
    headers = {**err.headers, **({"x-request-id": rid} if rid else {})}
    await JSONResponse(err.body(), status_code=err.status, headers=headers)(scope, receive, send)


class RequestIdLogFilter(logging.Filter):
    """Adds ``record.request_id`` (the current request's id, or "-") to every log record."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        return True


def _body(name: str) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{name}"}}}}}


def _openapi(app: FastAPI) -> None:
    """Document the request bodies (parsed by hand for exact error control) in the OpenAPI schema."""
    original = app.openapi

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        schema = original()
        _, defs = models_json_schema([(CompletionRequest, "validation"), (ChatCompletionRequest, "validation")],
                                     ref_template="#/components/schemas/{model}")
        schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
        app.openapi_schema = schema
        return schema

    app.openapi = openapi

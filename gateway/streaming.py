"""The streaming side of a response: the delta a round contributes, the SSE response and events,
keep-alive comments and the races of a request against its client's disconnect and the server's
drain (:class:`gateway.handlers.Gateway` drives them).

A stream is never silent for longer than ``--sse-keepalive-s``: :func:`with_keepalive` counts from
the last bytes written to the client, so rounds whose tokens complete no character yet hold no
keep-alive back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import msgspec
from starlette.requests import Request
from starlette.responses import StreamingResponse

from gateway.logprobs import TokenOut
from gateway.schemas import ApiError

log = logging.getLogger("gateway")

_JSON = msgspec.json.Encoder()
SSE_DONE = b"data: [DONE]\n\n"


@dataclass
class Delta:
    """One round's contribution to the response: text and the tokens whose text it carries."""

    text: str
    tokens: list[TokenOut] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string matched, or the stop token id (not EOS)
    index: int = 0  # the choice it belongs to (``n`` > 1)

    @property
    def token_ids(self) -> list[int]:
        return [t.token_id for t in self.tokens]


class Disconnected(Exception):
    """The client went away before the response started."""


class ServerShutdown(Exception):
    """The request was cut while in flight (:meth:`Gateway.cut_in_flight`); the message is the reason."""


def shutdown_error(reason: str) -> ApiError:
    """The 503 ``server_shutdown`` error of a request cut ``reason`` (e.g. at the drain timeout)."""
    return ApiError(503, f"the server is shutting down: the request was cut {reason}", None, "server_shutdown")


KEEPALIVE = Delta("")
# A stream's status line and headers go out when its first round arrives or this long after it was
# admitted, whichever is first (a queued request is not silent). An engine refusal within it keeps
# its HTTP status (429, 400, 503); a later one is an SSE error event in the OpenAI shape, then [DONE].
STREAM_START_GRACE_S = 0.5


async def whole_answers(deltas: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    """Each choice's deltas as one delta, yielded when the choice finishes (text, tokens, finish)."""
    held: dict[int, Delta] = {}
    try:
        async for d in deltas:
            h = held.setdefault(d.index, Delta("", index=d.index))
            h.text += d.text
            h.tokens.extend(d.tokens)
            if d.finish_reason:
                h.finish_reason, h.stop_reason = d.finish_reason, d.stop_reason
                yield held.pop(d.index)
    finally:
        await deltas.aclose()


class SSEResponse(StreamingResponse):
    """A streaming response that always runs its cleanup, even if the body never started."""

    def __init__(self, content, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close_deltas, release = self._on_close
            await close_deltas()
            release()


def sse_event(obj: dict) -> bytes:
    """One SSE ``data:`` event carrying ``obj`` as JSON."""
    return b"data: " + _JSON.encode(obj) + b"\n\n"


async def wait_disconnect(request: Request) -> None:
    """Return when the client of ``request`` disconnects."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def race_disconnect(request: Request, awaitable, cut: Callable[[], asyncio.Future],
                           timeout: float | None = None):
    """Await ``awaitable``; if the client disconnects first, cancel it and raise :class:`Disconnected`;
    if ``cut()`` completes first (drain timeout), cancel it and raise a 503 ``server_shutdown`` :class:`ApiError`.
    With ``timeout`` (seconds): if none of these happened by then, return the still running task."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(wait_disconnect(request))
    cutter = cut()
    try:
        done, _ = await asyncio.wait({task, watcher, cutter}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        cutter.cancel()
    if not done:
        return task
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if cutter.done() and not cutter.cancelled():
            log.info("request cut %s", cutter.result())
            raise shutdown_error(cutter.result())
        log.info("client disconnected before the response started")
        raise Disconnected
    return task.result()


async def with_keepalive(it: AsyncIterator, interval: float, cut: Callable[[], asyncio.Future],
                          quiet_since: Callable[[], float], pending: asyncio.Task | None = None) -> AsyncIterator:
    """Items of ``it``; ``KEEPALIVE`` whenever ``interval`` seconds have passed since the client last
    got bytes (``it`` keeps running).

    ``quiet_since()``: the event loop time (seconds) of the last bytes written to the client. Items
    that write nothing (rounds whose tokens complete no character yet) do not hold keep-alives back,
    nor does a backlog of them, so a stream is never silent for longer than ``interval`` (plus the
    event loop's latency) however its rounds arrive.
    ``pending``: a task already running ``it.__anext__()`` (its result comes first).
    Raises :class:`ServerShutdown` (after cancelling ``it``'s pending step) once ``cut()`` completes.
    """
    loop = asyncio.get_running_loop()
    task = pending or asyncio.ensure_future(it.__anext__())
    cutter = cut()
    try:
        while True:
            left = quiet_since() + interval - loop.time() if interval else None
            if left is not None and left <= 0 and not cutter.done():
                yield KEEPALIVE  # before items already waiting too: they may write nothing
                continue
            done, _ = await asyncio.wait({task, cutter}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            if cutter in done:
                log.info("stream cut %s", cutter.result())
                raise ServerShutdown(cutter.result())
            if not done:
                yield KEEPALIVE
                continue
            try:
                item = task.result()
            except StopAsyncIteration:
                return
            yield item
            task = asyncio.ensure_future(it.__anext__())
    finally:
        cutter.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

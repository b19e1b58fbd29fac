"""Request handling behind the routes: validate, tokenize, admit, run rounds, shape OpenAI responses.

One code path (:meth:`Gateway._deltas`) turns the engine's rounds into response deltas; the
streaming response writes each delta as one SSE event, the non-streaming one concatenates them, so
both carry the same text, token ids, logprobs, usage and finish reason. A delta carries the tokens
(ids, logprobs) whose text it carries (:meth:`gateway.detokenize.CompletionText.take_tokens`). A chat
request whose tools may be called streams each choice's answer as one event at its end: only the
whole answer tells a tool call (``tool_calls``, finish reason ``tool_calls``) from text
(:mod:`gateway.tools`).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections import deque
from collections.abc import AsyncIterator

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from gateway.config import GatewayConfig
from gateway.detokenize import CompletionText
from gateway.engine_client import EngineClient, EngineError
from gateway.logprobs import TokenOut, chat_logprobs, completion_logprobs
from gateway.requests import Prepared, RequestBuilder, choice_requests, model_name, read_body
from gateway.schemas import ApiError
from gateway.streaming import (KEEPALIVE, SSE_DONE, STREAM_START_GRACE_S, Delta, Disconnected, ServerShutdown,
                               SSEResponse, race_disconnect, shutdown_error, sse_event, whole_answers,
                               with_keepalive)
from gateway.text import TextModel
from services.metrics import GatewayMetrics
from services.protocol import RoundChunk

log = logging.getLogger("gateway")

CUT_AT_DRAIN_TIMEOUT = "at the end of the drain timeout"
CUT_BY_STOP = "because the server was told to stop now (a second stop signal)"
request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")
_JSON = msgspec.json.Encoder()


class Gateway:
    """Holds the engine client, tokenizer, limits and counters; the routes call its methods."""

    def __init__(self, config: GatewayConfig, engine: EngineClient, text: TextModel,
                 metrics: GatewayMetrics | None = None):
        self.config, self.engine, self.text = config, engine, text
        self.metrics = metrics or GatewayMetrics()
        self.model_name = config.served_model_name or model_name(config.target)
        self.in_flight = 0
        self.draining = False
        self.cut: str | None = None  # why in-flight requests end now (cut_in_flight); None: not cut
        self._cut_waiters: set[asyncio.Future] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.requests = RequestBuilder(config, engine, text, self.model_name, self.readiness)
        engine.on_discarded = lambda reason, n: self.metrics.discarded_tokens.labels(reason).inc(n)

    # ------------------------------------------------------------------------------ lifecycle

    def begin_drain(self) -> None:
        """Refuse new requests (503); in-flight ones continue."""
        self.draining = True

    def cut_in_flight(self, reason: str = CUT_AT_DRAIN_TIMEOUT) -> None:
        """End every in-flight request now: streams get a ``server_shutdown`` error event and
        ``[DONE]``, requests still waiting for their answer a 503; the engine requests are aborted.
        ``reason`` completes the error's message ("the request was cut " + reason): the drain timeout
        expired (:data:`CUT_AT_DRAIN_TIMEOUT`) or the server was told to stop now (:data:`CUT_BY_STOP`);
        the first cut's reason stays."""
        self.draining, self.cut = True, self.cut or reason
        self.engine.early_close_reason = "shutdown"  # the streams closed from here on were cut, not left
        for fut in list(self._cut_waiters):
            if not fut.done():
                fut.set_result(self.cut)

    def _cut_waiter(self) -> asyncio.Future:
        """A future of the running loop that completes at :meth:`cut_in_flight` (cancel it when done)."""
        fut = asyncio.get_running_loop().create_future()
        if self.cut:
            fut.set_result(self.cut)
        else:
            self._cut_waiters.add(fut)
            fut.add_done_callback(self._cut_waiters.discard)
        return fut

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight (``False`` on timeout)."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    def readiness(self) -> tuple[bool, str]:
        if self.draining:
            return False, "draining"
        if not self.engine.ready:
            return False, self.engine.detail or "starting"
        return True, self.engine.detail or "ready"

    def models(self) -> dict:
        """``GET /v1/models``: the one model this server serves."""
        return {"object": "list", "data": [self._card()]}

    def model_card(self, model: str) -> dict:
        """``GET /v1/models/{model}``; ApiError 404 for any other id."""
        if model != self.model_name:
            raise ApiError(404, f"model '{model}' does not exist; this server serves '{self.model_name}'", "model",
                           "model_not_found")
        return self._card()

    def _card(self) -> dict:
        info = self.engine.info
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "dartree",
                "root": self.config.target, "max_model_len": info.max_context if info else None}

    # -------------------------------------------------------------------------------- requests

    async def handle(self, request: Request, kind: str) -> Response:
        """Serve ``POST /v1/completions`` (kind "completion") or ``/v1/chat/completions`` ("chat")."""
        arrival = time.monotonic()
        lease = None
        try:
            body = await read_body(request, self.config.max_body_bytes)
            if self.in_flight >= self.config.max_concurrent_requests:
                raise ApiError(429, "the server is at its concurrent request limit; retry later", None,
                               "overloaded", headers={"Retry-After": str(self.config.retry_after_s)})
            lease = _Lease(self)  # held while the body is tokenized off the loop: floods stay bounded
            prep = await self.requests.prepare_async(body, kind, request.state.request_id, arrival)
        except BaseException as err:
            if lease is not None:
                lease.release()
            if isinstance(err, ApiError):
                self.metrics.rejected.labels(_reject_reason(err.status)).inc()
                log_rejection(err)
            raise
        log.info("%s: %d prompt tokens, max_tokens %d, stream %s, spec %s", kind, len(prep.gen.prompt_ids),
                 prep.gen.sampling.max_tokens, prep.stream, prep.gen.spec.method or "default")
        choices = choice_requests(prep)
        deltas = self._deltas(prep) if len(choices) == 1 else self._merged(choices)
        if prep.tools is not None and prep.stream:
            deltas = whole_answers(deltas)
        try:
            if prep.stream:
                grace = min(STREAM_START_GRACE_S, self.config.sse_keepalive_s or STREAM_START_GRACE_S)
                first = await race_disconnect(request, deltas.__anext__(), self._cut_waiter, timeout=grace)

                async def close_deltas() -> None:
                    if isinstance(first, asyncio.Task) and not first.done():  # the response never started
                        first.cancel()
                        await asyncio.gather(first, return_exceptions=True)
                    await deltas.aclose()

                headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
                response = SSEResponse(self._sse(prep, first, deltas), on_close=(close_deltas, lease.release),
                                        media_type="text/event-stream", headers=headers)
                lease = None  # handed to the response
                return response
            body, num_tokens = await race_disconnect(request, self._collect(prep, deltas), self._cut_waiter)
            self.metrics.generation_tokens.inc(num_tokens)  # handed to the client
            return Response(body, media_type="application/json")
        except Disconnected:
            return Response(status_code=499)
        except EngineError as err:
            headers = {"Retry-After": str(self.config.retry_after_s)} if err.status == 429 else None
            raise ApiError(err.status, err.message, err.param, err.code, headers) from None
        finally:
            if lease is not None:
                await deltas.aclose()
                lease.release()

    def _admit(self) -> None:
        self.in_flight += 1
        self.metrics.in_flight.set(self.in_flight)
        self._idle.clear()

    def _release(self) -> None:
        self.in_flight -= 1
        self.metrics.in_flight.set(self.in_flight)
        if self.in_flight == 0:
            self._idle.set()

    # --------------------------------------------------------------------------------- running

    async def _deltas(self, prep: Prepared) -> AsyncIterator[Delta]:
        """Rounds -> deltas (stop strings applied); records latency metrics, the finish reason, the
        prompt tokens (when the first round arrives: the verifier ran the prefill) and the tokens past
        a stop string (discarded). The generated tokens are counted where the response hands them to
        the client (:meth:`handle`, :meth:`_sse`)."""
        text = CompletionText(self.text, prep.gen.prompt_ids, prep.stop)
        deadline = prep.arrival + self.config.request_timeout_s if self.config.request_timeout_s else None
        chunks = self.engine.generate(prep.gen, deadline=deadline)
        rows: deque[tuple[float, list[tuple[int, float]]]] = deque()  # logprobs of counted tokens not handed out
        last, finish, received = None, "abort", 0
        try:
            async for chunk in chunks:
                received += len(chunk.token_ids)
                now = time.monotonic()
                if last is None:
                    self.metrics.ttft.observe(now - prep.arrival)
                    self.metrics.prompt_tokens.inc(len(prep.gen.prompt_ids))  # the first round is the prefill's
                else:
                    self.metrics.itl.observe(now - last)
                last = now
                step = text.feed(chunk.token_ids)
                if prep.gen.sampling.logprobs is not None:
                    rows.extend(_logprob_rows(chunk)[:len(step.token_ids)])
                if text.stopped is not None:
                    self.engine.abort(prep.gen.request_id, "stop_string")
                    finish = "stop"
                    yield Delta(step.text, _tokens(text, rows), "stop", text.stopped)
                    return
                tail = text.finish() if chunk.finish_reason else ""
                finish = "stop" if text.stopped is not None else chunk.finish_reason
                reason = text.stopped if text.stopped is not None else chunk.stop_token_id if finish == "stop" else None
                yield Delta(step.text + tail, _tokens(text, rows), finish, reason)
                if finish:
                    return
        except EngineError:
            finish = "error"
            raise
        finally:
            await chunks.aclose()
            if text.stopped is not None and received > text.num_tokens:  # the round's tokens past the stop string
                self.metrics.discarded_tokens.labels("stop_string").inc(received - text.num_tokens)
            self.metrics.requests.labels(finish or "abort").inc()
            self.metrics.e2e.observe(time.monotonic() - prep.arrival)
            log.info("finished: %s, %d completion tokens, %.3f s", finish or "abort", text.num_tokens,
                     time.monotonic() - prep.arrival)

    async def _merged(self, choices: list[Prepared]) -> AsyncIterator[Delta]:
        """The deltas of ``n`` choices run concurrently, each tagged with its choice's ``index``, in
        arrival order; the first error of any choice ends them all (every choice is aborted)."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(choice: Prepared) -> None:
            try:
                async for d in self._deltas(choice):
                    d.index = choice.index
                    await queue.put(d)
                await queue.put(None)
            except Exception as exc:  # handed to the consumer, which raises it
                await queue.put(exc)

        tasks = [asyncio.create_task(pump(c)) for c in choices]
        try:
            done = 0
            while done < len(choices):
                item = await queue.get()
                if item is None:
                    done += 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _collect(self, prep: Prepared, deltas: AsyncIterator[Delta]) -> tuple[bytes, int]:
        """The whole response's JSON body and its number of completion tokens (all choices). The body
        is built and encoded on a worker thread: with logprobs a long answer is megabytes of JSON."""
        parts = [[prep.prompt_text] if prep.echo else [] for _ in range(prep.n)]
        tokens: list[list[TokenOut]] = [[] for _ in range(prep.n)]
        last = [Delta("") for _ in range(prep.n)]
        async for d in deltas:
            parts[d.index].append(d.text)
            tokens[d.index].extend(d.tokens)
            last[d.index] = d
        body = await self.requests.offload(self._body, prep, ["".join(p) for p in parts], tokens, last)
        return body, sum(len(t) for t in tokens)

    def _body(self, prep: Prepared, texts: list[str], tokens: list[list[TokenOut]], last: list[Delta]) -> bytes:
        """The response body: one choice per entry of ``texts`` / ``tokens`` / ``last``; usage counts the
        prompt once and every choice's completion tokens."""
        usage = _usage(len(prep.gen.prompt_ids), sum(len(t) for t in tokens))
        choices = []
        for i, (text, toks, end) in enumerate(zip(texts, tokens, last)):
            logprobs = self._logprobs(prep, toks)
            if prep.kind == "chat":
                message, finish = _message(prep, text, end.finish_reason)
                choice = {"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish,
                          "stop_reason": end.stop_reason}
            else:
                choice = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": end.finish_reason,
                          "stop_reason": end.stop_reason}
            if prep.return_token_ids:
                choice["token_ids"] = [t.token_id for t in toks]
            choices.append(choice)
        obj = "chat.completion" if prep.kind == "chat" else "text_completion"
        return _JSON.encode({"id": prep.response_id, "object": obj, "created": prep.created, "model": prep.model,
                             "choices": choices, "usage": usage})

    async def _sse(self, prep: Prepared, first: Delta | asyncio.Task,
                   deltas: AsyncIterator[Delta]) -> AsyncIterator[bytes]:
        """SSE events: one per round with text (or a finish), an optional usage event, then [DONE];
        a keep-alive comment whenever the client got no bytes for ``sse_keepalive_s``.

        ``first``: the first delta, or the task still waiting for it (the response started before the
        first round, see :data:`STREAM_START_GRACE_S`): a keep-alive comment is sent at once then.
        """
        num_tokens, num_sent, finished = 0, 0, 0
        sent_first: set[int] = set()                  # choices whose first event was sent
        carried: dict[int, list[TokenOut]] = {}      # per choice: tokens of deltas without text
        pending = first if isinstance(first, asyncio.Task) else None
        loop = asyncio.get_running_loop()
        wrote = loop.time()  # when the client last got bytes (the keep-alive clock)
        events = with_keepalive(deltas, self.config.sse_keepalive_s, self._cut_waiter, lambda: wrote, pending)
        try:
            d: Delta | None = KEEPALIVE if pending is not None else first
            while d is not None:
                if d is KEEPALIVE:
                    wrote = loop.time()
                    yield b": keep-alive\n\n"
                else:
                    num_tokens += len(d.tokens)
                    # tokens of a delta without text (they complete no character yet) ride with the next event
                    carried.setdefault(d.index, []).extend(d.tokens)
                    first_event = d.index not in sent_first
                    text = (prep.prompt_text if prep.echo and first_event else "") + d.text
                    if text or d.finish_reason or first_event:
                        toks = carried.pop(d.index)
                        sent, wrote = len(toks), loop.time()
                        yield sse_event(self._chunk(prep, text, d, toks, first_event, num_sent + sent))
                        self.metrics.generation_tokens.inc(sent)  # the event was written to the client
                        sent_first.add(d.index)
                        num_sent += sent
                    if d.finish_reason:
                        finished += 1
                        if finished == prep.n:
                            break
                d = await anext(events, None)
            if prep.include_usage:
                yield sse_event({"id": prep.response_id, "object": _chunk_object(prep), "created": prep.created,
                              "model": prep.model, "choices": [],
                              "usage": _usage(len(prep.gen.prompt_ids), num_tokens)})
        except EngineError as err:
            yield sse_event({"error": {"message": err.message, "type": ApiError.TYPES.get(err.status, "error"),
                                    "param": err.param, "code": err.code or str(err.status)}})
        except ServerShutdown as cut:
            yield sse_event(shutdown_error(str(cut)).body())
        except Exception:  # a bug must still end the stream properly, without a traceback to the client
            log.exception("stream failed")
            yield sse_event(ApiError(500, "internal server error", None, "internal_error").body())
        finally:
            await events.aclose()
            await deltas.aclose()
        yield SSE_DONE

    def _chunk(self, prep: Prepared, text: str, d: Delta, tokens: list[TokenOut], first_event: bool,
               num_sent: int) -> dict:
        """One stream chunk carrying ``text`` and ``tokens``; ``num_sent``: completion tokens sent so far,
        these included (the chunk's cumulative ``usage`` with ``continuous_usage_stats``)."""
        logprobs = self._logprobs(prep, tokens)
        if prep.kind == "chat":
            delta, finish = _message(prep, text, d.finish_reason)
            if delta.get("tool_calls"):
                delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(delta["tool_calls"])]
            if not first_event:
                del delta["role"]
            choice = {"index": d.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": d.index, "text": text, "logprobs": logprobs, "finish_reason": d.finish_reason}
        if d.finish_reason:
            choice["stop_reason"] = d.stop_reason
        if prep.return_token_ids:
            choice["token_ids"] = [t.token_id for t in tokens]
        out = {"id": prep.response_id, "object": _chunk_object(prep), "created": prep.created,
               "model": prep.model, "choices": [choice]}
        if prep.include_usage:
            out["usage"] = _usage(len(prep.gen.prompt_ids), num_sent) if prep.continuous_usage else None
        return out

    def _logprobs(self, prep: Prepared, tokens: list[TokenOut]) -> dict | None:
        """The choice's ``logprobs`` object for ``tokens`` (None when the request did not ask)."""
        if prep.gen.sampling.logprobs is None:
            return None
        return chat_logprobs(tokens, self.text) if prep.kind == "chat" else completion_logprobs(tokens, self.text)


# ------------------------------------------------------------------------------------------ helpers

def _message(prep: Prepared, text: str, finish: str | None) -> tuple[dict, str | None]:
    """A chat answer's ``message`` (or stream ``delta``) and finish reason: a finished answer that
    spells calls to the request's tools is ``tool_calls`` (:meth:`ToolPlan.parse`)."""
    calls = prep.tools.parse(text) if prep.tools is not None and finish == "stop" else None
    if calls is None:
        return {"role": "assistant", "content": text}, finish
    return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"


def _logprob_rows(chunk: RoundChunk) -> list[tuple[float, list[tuple[int, float]]]]:
    """``(logprob, [(top id, top logprob)])`` per token of a round that was asked for logprobs."""
    lp = chunk.logprobs
    if lp is None:
        raise EngineError(500, "the verifier sent a round without the logprobs this request asked for", None,
                          "internal_error")
    tops = lp.top_ids or [[] for _ in lp.logprobs]
    top_values = lp.top_logprobs or [[] for _ in lp.logprobs]
    return [(v, list(zip(i, tv))) for v, i, tv in zip(lp.logprobs, tops, top_values)]


def _tokens(text: CompletionText, rows: deque) -> list[TokenOut]:
    """The tokens ``text`` handed out, each with its logprob row (``rows`` is empty without logprobs)."""
    out = []
    for span in text.take_tokens():
        lp, top = rows.popleft() if rows else (None, [])
        out.append(TokenOut(span.token_id, span.offset, lp, top))
    return out


class _Lease:
    """One admitted request's slot; released exactly once."""

    def __init__(self, gateway: Gateway):
        self._gateway: Gateway | None = gateway
        gateway._admit()

    def release(self) -> None:
        if self._gateway is not None:
            self._gateway._release()
            self._gateway = None


def _chunk_object(prep: Prepared) -> str:
    return "chat.completion.chunk" if prep.kind == "chat" else "text_completion"


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def log_rejection(err: ApiError) -> None:
    """One log line for a refused request (the request id comes with the log record)."""
    param = f" [{err.param}]" if err.param else ""
    log.info("rejected: %d %s%s: %s", err.status, err.code or ApiError.TYPES.get(err.status, "error"), param,
             err.message[:300])


def _reject_reason(status: int) -> str:
    return {400: "invalid", 404: "unknown_model", 408: "body_timeout", 413: "too_large", 415: "content_type",
            429: "overloaded", 503: "unavailable"}.get(status, str(status))

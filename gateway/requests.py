"""Turn an HTTP body into a validated, tokenized engine request (or an OpenAI-shaped error).

The work (JSON validation, chat-template rendering, tokenization: seconds for a multi-megabyte
prompt) runs on worker threads, never on the event loop, so health checks and running streams do
not wait for it (:meth:`RequestBuilder.prepare_async`). Tokenization releases the GIL
(:data:`gateway.text.GIL_FREE_MIN`). Bodies over :data:`LARGE_BODY_BYTES` have a lane of their own
(one thread): a flood of huge prompts queues there while ordinary requests keep their threads.

Checks, in order: JSON schema and types (400), unsupported output-changing fields (400), logprobs
combinations (400), model (404), readiness (503), prompt (empty, out-of-vocabulary ids, too long),
max_tokens against the limits and the context window, speculative settings against what the
verifier serves.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import msgspec
from pydantic import ValidationError
from starlette.requests import Request

from gateway.config import GatewayConfig
from gateway.engine_client import EngineClient
from gateway.schemas import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    check_stop,
    requested_logprobs,
    unsupported_field,
    validation_error,
)
from gateway.text import PromptTooLong, TemplateError, TextModel
from gateway.tools import ToolPlan, call_text, checked_grammar, plan_tools, with_tool_prompt
from services.params import MAX_LOGIT_BIAS, ParamError, SamplingParams, SpecParams
from services.protocol import METHODS, Generate

LARGE_BODY_BYTES = 256 * 1024  # bodies at least this big are prepared on the one-thread large lane


@dataclass
class Prepared:
    """A validated request, ready for the engine."""

    kind: str                       # "completion" | "chat"
    response_id: str
    model: str
    gen: Generate
    prompt_text: str                # for echo
    stop: list[str]
    echo: bool
    stream: bool
    include_usage: bool
    return_token_ids: bool
    arrival: float
    continuous_usage: bool = False  # cumulative usage in every stream chunk (stream_options.continuous_usage_stats)
    n: int = 1                      # choices; each runs as its own engine request (:func:`choice_requests`)
    index: int = 0                  # this choice's ``index`` in the response
    tools: ToolPlan | None = None   # chat ``tools`` that may be called: the answer is parsed for a call
    created: int = field(default_factory=lambda: int(time.time()))


class RequestBuilder:
    """Validation and tokenization for one server (config, engine limits, tokenizer)."""

    def __init__(self, config: GatewayConfig, engine: EngineClient, text: TextModel, model_name: str,
                 readiness: Callable[[], tuple[bool, str]]):
        self.config, self.engine, self.text = config, engine, text
        self.model_name, self.readiness = model_name, readiness
        self._pool = ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="gateway-prepare")
        self._large = ThreadPoolExecutor(1, thread_name_prefix="gateway-prepare-large")

    async def prepare_async(self, body: bytes, kind: str, log_id: str, arrival: float) -> Prepared:
        """:meth:`prepare` on a worker thread (bodies of :data:`LARGE_BODY_BYTES` or more: the large
        lane); readiness is read here, on the event loop. Raises :class:`ApiError`."""
        ready = self.readiness()
        pool = self._large if len(body) >= LARGE_BODY_BYTES else self._pool
        return await asyncio.get_running_loop().run_in_executor(pool, self.prepare, body, kind, log_id, arrival,
                                                                ready)

    async def offload(self, fn: Callable, *args):
        """``fn(*args)`` on a worker thread (other CPU-heavy work: building a big response body)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        """Stop the worker threads (work already queued still runs)."""
        self._pool.shutdown(wait=False)
        self._large.shutdown(wait=False)

    def prepare(self, body: bytes, kind: str, log_id: str, arrival: float,
                ready: tuple[bool, str] | None = None) -> Prepared:
        """Parse and validate a body into a :class:`Prepared` request (raises :class:`ApiError`).

        ``ready``: the readiness ``(ok, why)`` to apply (None: ask ``readiness`` now). CPU-heavy for
        big prompts: call it through :meth:`prepare_async` from the event loop.
        """
        cls = ChatCompletionRequest if kind == "chat" else CompletionRequest
        try:
            req = cls.model_validate_json(body)
        except ValidationError as exc:
            raise validation_error(exc) from None
        bad = unsupported_field(req)
        if bad:
            raise ApiError(400, bad[1], bad[0], "unsupported_parameter")
        if req.model is not None and req.model != self.model_name:
            raise ApiError(404, f"model '{req.model}' does not exist; this server serves '{self.model_name}'",
                           "model", "model_not_found")
        stop = req.stop_list()
        check_stop(stop)
        logprobs = requested_logprobs(req)
        opts = self._stream_options(req)
        self._check_choices(req.n)
        plan, grammar = self._structured(req)
        ready, why = self.readiness() if ready is None else ready
        if not ready:
            raise ApiError(503, f"the server is not ready: {why}", None, "service_unavailable")
        prompt_ids, prompt_text = self._prompt(req, plan)
        max_tokens = self._max_tokens(req, len(prompt_ids), "messages" if kind == "chat" else "prompt")
        sampling, spec = self._params(req, max_tokens, logprobs, grammar)
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        return Prepared(kind=kind, response_id=f"{prefix}-{log_id}", model=self.model_name,
                        gen=Generate(f"{log_id}-{uuid.uuid4().hex[:8]}", prompt_ids, sampling, spec),
                        prompt_text=prompt_text, stop=stop, echo=bool(getattr(req, "echo", False)),
                        stream=req.stream, include_usage=bool(opts and opts.include_usage),
                        return_token_ids=req.return_token_ids, arrival=arrival,
                        continuous_usage=bool(opts and opts.continuous_usage_stats), n=req.n, tools=plan)

    @staticmethod
    def _stream_options(req):
        """``stream_options``, only with ``stream`` and ``continuous_usage_stats`` only with
        ``include_usage`` (a 400 naming the field otherwise)."""
        opts = req.stream_options
        if opts is not None and not req.stream:
            raise ApiError(400, "'stream_options' is only allowed with 'stream': true", "stream_options",
                           "invalid_value")
        if opts is not None and opts.continuous_usage_stats and not opts.include_usage:
            raise ApiError(400, "'stream_options.continuous_usage_stats' requires 'include_usage': true",
                           "stream_options.continuous_usage_stats", "invalid_value")
        return opts

    def _params(self, req, max_tokens: int, logprobs: int | None, grammar: str | None
                ) -> tuple[SamplingParams, SpecParams]:
        """The request's :class:`SamplingParams` and :class:`SpecParams`, range-checked by their
        ``check()`` (a :class:`ParamError` is a 400 naming its field)."""
        sampling = self._sampling(
            req, max_tokens=max_tokens,
            temperature=self.config.default_temperature if req.temperature is None else req.temperature,
            top_k=max(req.top_k, 0), stop_token_ids=tuple(self._check_ids(req.stop_token_ids or [], "stop_token_ids")),
            logprobs=logprobs, logit_bias=self._logit_bias(req.logit_bias or {}),
            min_tokens=self._min_tokens(req, max_tokens), grammar=grammar)
        spec = self._spec(req)
        try:
            sampling.check()
            spec.check()
        except ParamError as exc:
            raise ApiError(400, str(exc), exc.param, "invalid_value") from None
        return sampling, spec

    @staticmethod
    def _sampling(req, **given) -> SamplingParams:
        """The request's :class:`SamplingParams`: every params field the body has under the same
        name and set (None: the params' default), then ``given`` (the fields this builder
        converts or checks against the server). Ranges are checked by ``check()``."""
        fields = type(req).model_fields
        same = {f: v for f in SamplingParams.__struct_fields__ if f in fields and (v := getattr(req, f)) is not None}
        return SamplingParams(**{**same, **given})

    def _structured(self, req) -> tuple[ToolPlan | None, str | None]:
        """The request's tool plan and grammar (``response_format``, or a forced tool call), JSON in
        the configured layout (``json_whitespace``); objects closed to their declared properties
        (tool arguments always, a ``json_schema`` unless its ``strict`` is false).

        Raises:
            ApiError: an invalid schema or tool definition, or both a JSON ``response_format`` and a
                forced tool call (400 naming the field).
        """
        ws = self.config.json_whitespace
        plan, grammar = (plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, ws)
                         if isinstance(req, ChatCompletionRequest) else (None, None))
        rf = req.response_format
        if rf is None or rf.type == "text":
            return plan, grammar
        if grammar is not None:
            raise ApiError(400, "a JSON 'response_format' cannot be combined with a forced tool call ('tool_choice')",
                           "response_format", "invalid_value")
        if rf.type == "json_object":
            return plan, checked_grammar(None, "response_format", whitespace=ws)
        if rf.json_schema.json_schema is None:
            raise ApiError(400, "'response_format.json_schema.schema' is required", "response_format.json_schema.schema",
                           "missing_required_parameter")
        return plan, checked_grammar(rf.json_schema.json_schema, "response_format.json_schema.schema",
                                     whitespace=ws, strict=rf.json_schema.strict is not False)

    def _prompt(self, req, plan: ToolPlan | None = None) -> tuple[list[int], str]:
        if isinstance(req, ChatCompletionRequest):
            try:
                ids, text = self._chat_prompt(req, plan)
            except TemplateError as exc:
                raise ApiError(400, str(exc), "messages", "invalid_messages") from None
            except PromptTooLong as exc:
                raise ApiError(400, str(exc), "messages", "context_length_exceeded") from None
            param = "messages"
        else:
            prompt = req.prompt
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
                if len(prompt) != 1:
                    raise ApiError(400, "only one prompt per request is supported", "prompt", "batch_not_supported")
                prompt = prompt[0]
            if isinstance(prompt, str):
                try:
                    self.text.check_length(prompt, self._prompt_limit())  # a huge prompt: refused untokenized
                except PromptTooLong as exc:
                    raise ApiError(400, str(exc), "prompt", "context_length_exceeded") from None
                ids, text = self.text.encode(prompt), prompt
            else:
                ids = self._check_ids(prompt, "prompt")
                text = self.text.decode(ids) if req.echo else ""
            param = "prompt"
        if not ids:
            raise ApiError(400, "the prompt is empty (it must contain at least one token)", param, "empty_prompt")
        limit = self._limit("max_prompt_tokens", self.config.max_prompt_tokens)
        if limit and len(ids) > limit:
            raise ApiError(400, f"the prompt has {len(ids)} tokens, over the limit of {limit}", param,
                           "context_length_exceeded")
        return ids, text

    def _chat_prompt(self, req: ChatCompletionRequest, plan: ToolPlan | None = None) -> tuple[list[int], str]:
        """The conversation's ids and text; every field the client set must reach the template. The
        tools of ``plan`` are listed in the system message; an assistant turn's ``tool_calls`` are
        written as the JSON-in-text calls (:mod:`gateway.tools`).

        Raises:
            ApiError: a message field the template never receives (``tool_calls``...), ``name``s the
                template ignores, a ``chat_template_kwargs`` key it does not read or that collides
                with the request's own fields.
            TemplateError: the template failed.
        """
        for i, m in enumerate(req.messages):
            for key, value in (m.model_extra or {}).items():
                if value not in (None, "", [], {}):
                    raise ApiError(400, f"'messages[{i}].{key}' is not supported by this server (the chat "
                                   f"template does not receive it)", f"messages[{i}].{key}", "unsupported_parameter")
        messages = [{"role": m.role, "content": self._content(i, m), **({"name": m.name} if m.name else {})}
                    for i, m in enumerate(req.messages)]
        messages = with_tool_prompt(messages, plan)
        kwargs = dict(req.chat_template_kwargs or {})
        reserved = sorted(kwargs.keys() & {"messages", "add_generation_prompt", "token_limit"})
        if reserved:  # these are the request's own fields; as template kwargs they would collide
            raise ApiError(400, f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs",
                           "invalid_value")
        unread = sorted(kwargs.keys() - self.text.template_variables())
        if unread:
            raise ApiError(400, f"'chat_template_kwargs.{unread[0]}' is not used by this model's chat template",
                           f"chat_template_kwargs.{unread[0]}", "unsupported_parameter")
        ids, text = self.text.chat_prompt(messages, req.add_generation_prompt, self._prompt_limit(), **kwargs)
        named = next((i for i, m in enumerate(messages) if "name" in m), None)
        if named is not None:
            plain = [{"role": m["role"], "content": m["content"]} for m in messages]
            if self.text.render_chat(plain, req.add_generation_prompt, **kwargs) == text:
                raise ApiError(400, f"'messages[{named}].name' is not used by this model's chat template",
                               f"messages[{named}].name", "unsupported_parameter")
        return ids, text

    @staticmethod
    def _content(i: int, m) -> str:
        """A message's text; an assistant's ``tool_calls`` follow it as JSON-in-text calls, a tool
        result with a ``tool_call_id`` is ``{"tool_call_id": ..., "content": ...}``."""
        if m.tool_call_id is not None:
            if m.role != "tool":
                raise ApiError(400, f"'messages[{i}].tool_call_id' is only allowed on tool messages",
                               f"messages[{i}].tool_call_id", "invalid_value")
            return json.dumps({"tool_call_id": m.tool_call_id, "content": m.text()}, ensure_ascii=False)
        if not m.tool_calls:
            return m.text()
        if m.role != "assistant":
            raise ApiError(400, f"'messages[{i}].tool_calls' is only allowed on assistant messages",
                           f"messages[{i}].tool_calls", "invalid_value")
        try:
            calls = call_text(m.tool_calls)
        except ValueError as exc:
            raise ApiError(400, f"invalid 'messages[{i}].tool_calls': {exc}", f"messages[{i}].tool_calls",
                           "invalid_value") from None
        return f"{m.text()}\n{calls}" if m.text() else calls

    def _prompt_limit(self) -> int:
        """Most prompt tokens a request may have (0: unknown): the prompt limit, and the context
        window less the one token to generate."""
        ctx = self.engine.info.max_context if self.engine.info else 0
        values = [v for v in (self._limit("max_prompt_tokens", self.config.max_prompt_tokens), ctx - 1) if v > 0]
        return min(values) if values else 0

    def _check_ids(self, ids: list[int], param: str) -> list[int]:
        vocab = (self.engine.info.vocab_size if self.engine.info else 0) or self.text.vocab_size
        for i, t in enumerate(ids):
            if not 0 <= t < vocab:
                raise ApiError(400, f"token id {t} is outside the vocabulary [0, {vocab})", f"{param}[{i}]",
                               "invalid_token_id")
        return list(ids)

    def _logit_bias(self, bias: dict) -> dict[int, float]:
        """``logit_bias`` with token-id keys (OpenAI sends them as strings), checked entry by entry.

        Raises:
            ApiError: more than :data:`MAX_LOGIT_BIAS` entries, a key that is not a token id of the
                vocabulary, or a value that is not a number in [-100, 100] (``param`` names the key).
        """
        if len(bias) > MAX_LOGIT_BIAS:
            raise ApiError(400, f"'logit_bias' has {len(bias)} entries; at most {MAX_LOGIT_BIAS} are allowed",
                           "logit_bias", "invalid_value")
        vocab = (self.engine.info.vocab_size if self.engine.info else 0) or self.text.vocab_size
        out = {}
        for key, value in bias.items():
            param = f"logit_bias.{key[:32]}"
            if not (key.isascii() and key.isdigit() and len(key) <= 10 and int(key) < vocab):
                raise ApiError(400, f"'logit_bias' key {key[:32]!r} is not a token id in [0, {vocab})", param,
                               "invalid_token_id")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
                raise ApiError(400, f"'logit_bias' value of {key[:32]!r} must be a number in [-100, 100]", param,
                               "invalid_value")
            out[int(key)] = float(value)
        return out

    @staticmethod
    def _min_tokens(req, max_tokens: int) -> int:
        """``min_tokens``, at most ``max_tokens`` (a 400 naming it otherwise)."""
        if req.min_tokens > max_tokens:
            raise ApiError(400, f"'min_tokens' = {req.min_tokens} is over 'max_tokens' = {max_tokens}", "min_tokens",
                           "invalid_value")
        return req.min_tokens

    def _check_choices(self, n: int) -> None:
        """``n`` choices are ``n`` engine requests admitted together: more than the verifier's running
        and waiting slots can never all be admitted (a 429 would only repeat), so a 400 naming ``n``."""
        limits = self.engine.info.limits if self.engine.info else None
        slots = limits.max_running + limits.max_waiting if limits and limits.max_running else 0
        if slots and n > slots:
            raise ApiError(400, f"'n' = {n} choices need {n} request slots at once; this server has {slots} "
                           f"({limits.max_running} running + {limits.max_waiting} waiting)", "n", "invalid_value")

    def _limit(self, name: str, local: int) -> int:
        limits = self.engine.info.limits if self.engine.info else None
        values = [v for v in (local, getattr(limits, name, 0) if limits else 0) if v]
        return min(values) if values else 0

    def _max_tokens(self, req, num_prompt: int, prompt_param: str) -> int:
        ctx = self.engine.info.max_context if self.engine.info else 0
        explicit = getattr(req, "max_completion_tokens", None) or req.max_tokens
        param = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
        limit = self._limit("max_tokens", self.config.max_tokens_limit)
        if ctx and num_prompt >= ctx:
            raise ApiError(400, f"the prompt has {num_prompt} tokens; this model's context window is {ctx}",
                           prompt_param, "context_length_exceeded")
        room = ctx - num_prompt if ctx else 0
        if explicit is None:
            default = self.config.default_max_tokens if isinstance(req, CompletionRequest) else room
            return max(1, min(v for v in (default, room, limit) if v)) if (default or room or limit) else 16
        if limit and explicit > limit:
            raise ApiError(400, f"'{param}' = {explicit} is over this server's limit of {limit}", param, "invalid_value")
        if ctx and explicit > room:
            raise ApiError(400, f"this model's context window is {ctx} tokens, but {num_prompt + explicit} were "
                           f"requested ({num_prompt} in the prompt, {explicit} to generate)", param,
                           "context_length_exceeded")
        return explicit

    def _spec(self, req) -> SpecParams:
        """The request's :class:`SpecParams`: ``speculative`` against the methods this server serves
        and its request limits (400 naming the field)."""
        opts = req.speculative
        if opts is None:
            return SpecParams()
        info = self.engine.info
        if opts.method is not None and info and info.methods and opts.method not in info.methods:
            what = ("is not served by this server's drafter" if opts.method in METHODS
                    else "is not a speculative method")
            raise ApiError(400, f"method '{opts.method}' {what}; this server serves: {', '.join(info.methods)}",
                           "speculative.method", "invalid_value")
        limits = info.limits if info else None
        for name, value in (("budget", opts.budget), ("width", opts.width), ("candidates", opts.candidates)):
            top = getattr(limits, f"max_{name}", 0) if limits else 0
            if value is not None and top and value > top:
                raise ApiError(400, f"speculative {name} {value} is over the server's maximum {top} "
                               f"(`dartree serve --max-request-budget`)", f"speculative.{name}", "invalid_value")
        return SpecParams(method=opts.method, budget=opts.budget, width=opts.width, depth_bonus=opts.depth_bonus,
                          candidates=opts.candidates)


def choice_requests(prep: Prepared) -> list[Prepared]:
    """The ``n`` choices of a request, each its own engine request: choice ``i`` has ``index = i``
    and, when a seed was given, seed ``seed + i`` (wrapped to the signed 64-bit range)."""
    if prep.n == 1:
        return [prep]
    out = []
    for i in range(prep.n):
        s = prep.gen.sampling
        seed = None if s.seed is None else (s.seed + i + 2**63) % 2**64 - 2**63
        gen = msgspec.structs.replace(prep.gen, request_id=f"{prep.gen.request_id}-{i}",
                                      sampling=msgspec.structs.replace(s, seed=seed))
        out.append(dataclasses.replace(prep, gen=gen, index=i))
    return out


def model_name(target: str) -> str:
    """The ``model`` a target reference is served as (:func:`services.models.registry.served_name`)."""
    from services.models.registry import served_name

    return served_name(target)


# Content-Encoding of a request body -> zlib's wbits (RFC 9110 §8.4.1; "deflate" is the zlib format,
# a raw deflate stream is accepted too, as browsers and some clients send it)
_BODY_ENCODINGS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def decode_body(body: bytes, encoding: str | None, limit: int) -> bytes:
    """``body`` with its ``Content-Encoding`` removed (the codings listed, undone last first).

    Args:
        body: the bytes received; encoding: the header's value (None or ``identity``: unchanged).
        limit: the most bytes the decoded body may have.
    Raises:
        ApiError: 415 ``unsupported_content_encoding`` for a coding other than gzip / deflate /
            identity; 400 ``invalid_content_encoding`` for data that is not valid in its coding or is
            cut short; 413 ``body_too_large`` when the decoded body would exceed ``limit`` (decoding
            stops there: a small compressed body cannot expand without bound).
    """
    codings = [c.strip().lower() for c in (encoding or "").split(",") if c.strip()]
    for coding in reversed(codings):
        if coding == "identity":
            continue
        if coding not in _BODY_ENCODINGS:
            raise ApiError(415, f"content encoding '{coding}' is not supported; send the body uncompressed, "
                                "gzip or deflate", None, "unsupported_content_encoding")
        body = _inflate(body, coding, limit)
    return body


def _inflate(data: bytes, coding: str, limit: int) -> bytes:
    wbits = _BODY_ENCODINGS[coding]
    for bits in (wbits, -zlib.MAX_WBITS) if coding == "deflate" else (wbits,):
        d = zlib.decompressobj(bits)
        try:
            out = d.decompress(data, limit + 1)
        except zlib.error:
            continue
        if len(out) > limit or d.unconsumed_tail:
            raise ApiError(413, f"the decoded request body is over the {limit}-byte limit", None, "body_too_large")
        if d.eof:
            return out
    raise ApiError(400, f"the request body is not valid {coding} data (Content-Encoding: {coding})", None,
                   "invalid_content_encoding")


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing oversize bodies (413, before and after decoding), non-JSON content
    types (415) and content encodings other than gzip / deflate (415, :func:`decode_body`)."""
    ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if ctype != "application/json" and not ctype.endswith("+json"):
        raise ApiError(415, f"content type '{ctype}' is not supported; send application/json", None,
                       "unsupported_media_type")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is over the {limit}-byte limit", None, "body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the request body is over the {limit}-byte limit", None, "body_too_large")
        chunks.append(chunk)
    return decode_body(b"".join(chunks), request.headers.get("content-encoding"), limit)

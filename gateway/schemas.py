"""OpenAI-compatible request models (pydantic) and the gateway's validation rules.

Types are strict (``"5"`` is not an int) and ranges are checked here, so the verifier only ever
sees well-formed requests. Fields that would change the output but are not implemented exactly
under tree speculation are rejected by :func:`unsupported_field` with a 400 naming the field,
never silently ignored (docs/design.md "Refuse, never ignore"). Unknown fields that do not change the output are ignored.
Message fields the chat template would never see are refused where the prompt is built
(:mod:`gateway.requests`).
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

MAX_STOP_STRINGS = 4
MAX_CHOICES = 128             # OpenAI's limit for ``n``
MAX_STOP_CHARS = 256
MAX_COMPLETION_LOGPROBS = 5   # OpenAI's limit for /v1/completions ``logprobs``
MAX_CHAT_TOP_LOGPROBS = 20    # OpenAI's limit for /v1/chat/completions ``top_logprobs`` (== MAX_TOP_LOGPROBS)
Finite = Annotated[float, Field(allow_inf_nan=False)]
# Lists stop at their first bad item (``fail_fast``): a 4 MB body of a million bad items is one error,
# not millions (each union member would report every item: seconds of CPU to build and shape them).
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(fail_fast=True)]
Strings = Annotated[list[str], Field(fail_fast=True)]
WIRE_INT_MAX = 2**31 - 1  # integers that travel to the verifier must fit msgpack (2**64 - 1 would; keep margin)


class ApiError(Exception):
    """An HTTP error in the OpenAI shape ``{"error": {"message", "type", "param", "code"}}``."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
             415: "invalid_request_error", 429: "rate_limit_error", 500: "internal_error",
             503: "service_unavailable", 504: "timeout_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON body clients see."""
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class SpeculativeOptions(_Strict):
    """The ``speculative`` extension: per-request tree settings (``None`` = server default)."""

    method: str | None = None
    budget: int | None = Field(None, ge=1, le=WIRE_INT_MAX)   # the verifier checks the real ranges
    width: int | None = Field(None, ge=1, le=WIRE_INT_MAX)
    depth_bonus: Finite | None = Field(None, le=0)  # beta <= 0: a bonus would favour depth without bound
    candidates: int | None = Field(None, ge=1, le=WIRE_INT_MAX)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for function and schema names


class JsonSchemaFormat(_Strict):
    """``response_format.json_schema``: the schema the output must match (always enforced); ``strict``
    true or omitted also closes its objects to their declared properties, false keeps JSON Schema's
    default of allowing undeclared ones (gateway/tools.py ``closed_schema``)."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """``response_format``: ``text`` (no constraint), ``json_object`` (any JSON object) or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("'json_schema' is required with type 'json_schema' and allowed only there")
        return self


class FunctionDefinition(_Strict):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None   # a JSON schema of the arguments (an object)
    strict: bool | None = None


class Tool(_Strict):
    """One entry of ``tools`` (only functions exist)."""

    type: Literal["function"]
    function: FunctionDefinition


class _FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    """``tool_choice`` forcing one declared function."""

    type: Literal["function"]
    function: _FunctionName


class _Sampling(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: Finite | None = Field(None, ge=0.0, le=2.0)
    top_p: Finite = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=WIRE_INT_MAX)     # extension (vLLM): 0 or -1 = disabled
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: str | Strings | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    user: str | None = None
    speculative: SpeculativeOptions | None = None
    stop_token_ids: TokenIds | None = None   # extension (vLLM)
    ignore_eos: bool = False                                          # extension (vLLM)
    return_token_ids: bool = False                                    # extension: token ids in choices
    presence_penalty: Finite | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Finite | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, Any] | None = None  # checked entry by entry (gateway.requests: the first bad one fails)
    repetition_penalty: Finite | None = Field(None, gt=0.0)           # extension (vLLM): prompt + output
    min_tokens: int = Field(0, ge=0, le=WIRE_INT_MAX)                 # extension (vLLM)
    min_p: Finite = Field(0.0, ge=0.0, le=1.0)                        # extension (vLLM)
    response_format: ResponseFormat | None = None                     # gateway.tools: a grammar

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is a string or a list of token ids (one prompt)."""

    prompt: str | TokenIds | Strings | Annotated[list[TokenIds], Field(fail_fast=True)]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)  # raw target logprobs + top-k
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(fail_fast=True)] | None = None
    name: str | None = None
    tool_calls: Annotated[list[dict[str, Any]], Field(max_length=128)] | None = None  # assistant: gateway.tools
    tool_call_id: str | None = None  # tool: the call answered (rendered with the result: gateway.tools)

    @model_validator(mode="after")
    def _content_required(self) -> "ChatMessage":
        """OpenAI's rule: only an assistant message may omit ``content`` (or send null)."""
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role!r} message needs a content (only assistant messages may omit it)")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``; ``max_completion_tokens`` is an alias of ``max_tokens``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, fail_fast=True)]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None                                           # raw target logprobs
    top_logprobs: int | None = Field(None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)  # alternatives per token
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[Tool], Field(max_length=128, fail_fast=True)] | None = None  # gateway.tools
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # None = true: one or more calls per answer (gateway.tools)


# Output-changing fields we do not implement exactly: value that means "off" for each.
_UNSUPPORTED_EXTRA = {
    "length_penalty": (1, 1.0, None), "use_beam_search": (False, None), "prompt_logprobs": (None, 0),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "structured_outputs": (None,), "functions": (None, []), "function_call": (None, "none"),
    "bad_words": (None, []), "allowed_token_ids": (None, []), "logits_processors": (None, []),
    "truncate_prompt_tokens": (None,), "include_stop_str_in_output": (False, None),
    "skip_special_tokens": (True, None), "spaces_between_special_tokens": (True, None),
    "top_a": (None, 0), "typical_p": (None, 1, 1.0), "audio": (None,), "modalities": (None, ["text"]),
    "prediction": (None,), "reasoning_effort": (None,), "continue_final_message": (False, None),
    "chat_template": (None, ""), "documents": (None, []), "detokenize": (True, None),
    "return_tokens_as_token_ids": (False, None), "prompt_embeds": (None,), "vllm_xargs": (None, {}),
    "web_search_options": (None,), "verbosity": (None,),
    # llama.cpp / Ollama samplers (their companions, e.g. mirostat_tau or dry_base, change nothing while
    # these are off, so only these are checked)
    "mirostat": (None, 0), "dry_multiplier": (None, 0), "xtc_probability": (None, 0), "tfs_z": (None, 1),
    "dynatemp_range": (None, 0), "top_n_sigma": (None, -1), "smoothing_factor": (None, 0),
    "epsilon_cutoff": (None, 0), "eta_cutoff": (None, 0),
}
# The same, per endpoint: fields of the other endpoint (or vLLM extensions) that would be ignored here.
_UNSUPPORTED_EXTRA_COMPLETION = {"max_completion_tokens": (None,), "add_special_tokens": (True, None),
                                 "top_logprobs": (None,), "messages": (None,), "tools": (None, []),
                                 "tool_choice": (None, "none")}
_UNSUPPORTED_EXTRA_CHAT = {"echo": (False, None), "add_special_tokens": (False, None), "prompt": (None,),
                           "suffix": (None, ""), "best_of": (None, 1)}

# What to send instead, named in the refusal of these fields.
_INSTEAD = {"functions": "use 'tools'", "function_call": "use 'tool_choice'",
            "guided_json": "send a JSON schema as 'response_format'",
            "structured_outputs": "send a JSON schema as 'response_format'"}
_INSTEAD_COMPLETION = {"tools": "tools are served on /v1/chat/completions",
                       "tool_choice": "tools are served on /v1/chat/completions",
                       "messages": "send messages to /v1/chat/completions", "max_completion_tokens": "use 'max_tokens'",
                       "top_logprobs": "use 'logprobs': N"}
_INSTEAD_CHAT = {"prompt": "send a prompt to /v1/completions", "best_of": "use 'n'"}


def unsupported_field(req: _Sampling) -> tuple[str, str] | None:
    """``(param, message)`` for the first output-changing field that is set but not implemented."""
    checks: list[tuple[str, Any, tuple]] = []
    if isinstance(req, CompletionRequest):  # best_of == n returns every candidate: no ranking needed
        checks += [("best_of", req.best_of, (None, 1, req.n)), ("suffix", req.suffix, (None, ""))]
    for name, value, off in checks:
        if not any(value == o and type(value) is type(o) for o in off):
            return name, f"'{name}' = {value!r} is not supported by this server (it would change the output)"
    completion = isinstance(req, CompletionRequest)
    endpoint = _UNSUPPORTED_EXTRA_COMPLETION if completion else _UNSUPPORTED_EXTRA_CHAT
    extra = {**_UNSUPPORTED_EXTRA, **endpoint}
    instead = {**_INSTEAD, **(_INSTEAD_COMPLETION if completion else _INSTEAD_CHAT)}
    for name, value in (req.model_extra or {}).items():
        if name in extra and value not in extra[name]:
            where = "on this endpoint" if name in endpoint else "by this server"
            hint = f"; {instead[name]}" if name in instead else ""
            return name, f"'{name}' is not supported {where} (it would change the output){hint}"
    return None


def requested_logprobs(req: _Sampling) -> int | None:
    """Top-k alternatives the request asks for with its logprobs (0: the tokens' own only), None: no logprobs.

    Raises:
        ApiError: chat ``top_logprobs`` > 0 without ``logprobs: true``; completions ``logprobs`` with
            ``echo`` (that would need the prompt's logprobs, which are not computed).
    """
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs and not req.logprobs:
            raise ApiError(400, "'top_logprobs' requires 'logprobs': true", "top_logprobs", "invalid_value")
        return (req.top_logprobs or 0) if req.logprobs else None
    if isinstance(req, CompletionRequest) and req.logprobs is not None and req.echo:
        raise ApiError(400, "'logprobs' with 'echo' is not supported (prompt logprobs are not computed)", "echo",
                       "unsupported_parameter")
    return getattr(req, "logprobs", None)


def validation_error(exc: ValidationError) -> ApiError:
    """A pydantic error as a 400 naming the offending field (``param``).

    For a union (``prompt``, ``stop``) pydantic reports one error per member; the deepest one is
    the most specific (``prompt[1]`` rather than "not a string").
    """
    errors = exc.errors(include_url=False, include_input=exc.error_count() <= 16)  # inputs may be megabytes
    err = max(errors, key=lambda e: len(_clean_loc(e["loc"])))
    if err["type"] == "json_invalid":
        return ApiError(400, _json_problem(err.get("input", b""), (err.get("ctx") or {}).get("error", "")), None,
                        "invalid_json")
    param = _param(_clean_loc(err["loc"]))
    msg = err["msg"]
    if err["type"] == "missing":
        return ApiError(400, f"'{param}' is required", param, "missing_required_parameter")
    if err["type"] == "extra_forbidden":
        return ApiError(400, f"unknown field '{param}'", param, "unknown_parameter")
    if not param:
        return ApiError(400, f"the request body must be a JSON object: {msg}", None, "invalid_type")
    return ApiError(400, f"invalid '{param}': {msg}", param, "invalid_value")


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _json_problem(body, detail: str) -> str:
    """What is wrong with a body the JSON parser refused: bad UTF-8, a lone surrogate escape, or syntax."""
    if isinstance(body, (bytes, bytearray)):
        try:
            text = bytes(body).decode("utf-8")
        except UnicodeDecodeError as e:
            return f"the request body is not valid UTF-8 (byte {e.start})"
        if _SURROGATE_ESCAPE.search(text):
            try:  # Python's parser accepts lone surrogate escapes; pydantic's (rightly) does not
                json.loads(text)
                return "invalid Unicode escape (lone surrogate, e.g. \\ud800 without its pair) in the request body"
            except (ValueError, RecursionError):  # another problem (syntax, nesting deeper than Python's stack)
                pass
    return f"the request body is not valid JSON: {detail}" if detail else "the request body is not valid JSON"


def _clean_loc(loc) -> list:
    """``loc`` without pydantic's union-member tags (``'str'``, ``'list[int]'``, ``'TextPart'``...)."""
    tags = {"str", "int", "float", "bool", "dict", "none", "constrained-int", "constrained-float"}
    return [x for x in loc if not (isinstance(x, str) and (x in tags or "[" in x or x[:1].isupper()))]


def _param(loc: list) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def check_stop(stop: list[str]) -> None:
    """At most 4 non-empty stop strings of bounded length."""
    if len(stop) > MAX_STOP_STRINGS:
        raise ApiError(400, f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stop)}", "stop", "invalid_value")
    for s in stop:
        if not s or len(s) > MAX_STOP_CHARS:
            raise ApiError(400, f"stop strings must have 1 to {MAX_STOP_CHARS} characters", "stop", "invalid_value")

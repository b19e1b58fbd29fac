"""Structured output and tool calls at the gateway: ``response_format`` and ``tools`` become an
llguidance grammar the verifier enforces, tool definitions a system message, and generated text
OpenAI ``tool_calls``.

The chat template of the served model has no tool format, so tool calls follow a JSON-in-text
convention (docs/serving.md, "Structured output and tool calls"): the tools are listed in a
system message, and the whole answer is the calls, each written as ``{"name": ..., "arguments":
{...}}``, one per line (``parallel_tool_calls``, OpenAI's default) or exactly one
(``parallel_tool_calls: false``; always one for a named ``tool_choice``). With ``tool_choice``
``required`` or a named function the grammar forces such calls to declared functions with arguments matching their parameters; with ``auto``
nothing is forced and an answer that parses as such calls is returned as them.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

import llguidance

from gateway.schemas import ApiError
from services.protocol import MAX_GRAMMAR_CHARS

# The JSON layouts a grammar may allow (llguidance JSON options, GatewayConfig.json_whitespace).
# "flexible": up to 20 spaces / newlines between tokens, so pretty-printed JSON (the layout models and
# their drafters write) is allowed while a model still cannot pad forever; "compact": no whitespace.
JSON_WHITESPACE = {"flexible": {"whitespace_pattern": r"[\n ]{0,20}"}, "compact": {"whitespace_flexible": False}}

TOOL_PROMPT = ("You can call the functions listed below. To call one, answer with only a JSON object of the "
               'form {"name": <function name>, "arguments": <JSON object of its arguments>} and nothing else.'
               "\nFunctions:\n")
PARALLEL_TOOL_PROMPT = ("You can call the functions listed below. To call them, answer with only JSON objects of "
                        'the form {"name": <function name>, "arguments": <JSON object of its arguments>}, one '
                        "call per line, and nothing else.\nFunctions:\n")


# Keywords whose value is one subschema / a list of subschemas / a map of name -> subschema.
_SUBSCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
              "additionalProperties", "unevaluatedItems")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_schema(schema, _in_all_of: bool = False):
    """``schema`` in strict mode (vLLM's default grammar mode, OpenAI's ``strict: true``): every
    object schema that does not say otherwise gets ``additionalProperties: false``, so only its
    declared ``properties`` (and ``patternProperties``) may appear. A schema that sets
    ``additionalProperties`` (or ``unevaluatedProperties``) keeps its own rule, and the members of an
    ``allOf`` (and the object holding it) keep JSON Schema's default, since closing each member would
    refuse the properties the others declare. Subschemas are closed at any depth (``properties``,
    ``items``, ``anyOf``, ``$defs``...). A new schema is returned; ``schema`` is not changed.
    """
    if isinstance(schema, list):
        return [closed_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = closed_schema(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_schema(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_schema(s) for name, s in out[key].items()}
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [closed_schema(s, _in_all_of=True) for s in out["allOf"]]
    types = out.get("type")
    is_object = types == "object" or (isinstance(types, list) and "object" in types) or "properties" in out
    if (is_object and not _in_all_of and "allOf" not in out
            and "additionalProperties" not in out and "unevaluatedProperties" not in out):
        out["additionalProperties"] = False
    return out


STRICT_HINT = (" (objects admit only the properties they declare unless they set 'additionalProperties'; "
               "docs/serving.md, strict objects)")


def json_schema_grammar(schema: dict | None, whitespace: str = "flexible") -> str:
    """The llguidance grammar (a JSON string) of a JSON ``schema``; ``None``: any JSON object.
    Properties follow ``schema`` as given (callers pass :func:`closed_schema` for strict mode).

    ``whitespace``: a :data:`JSON_WHITESPACE` layout, ``flexible`` (at most 20 spaces / newlines
    between tokens, as pretty-printed JSON has) or ``compact`` (none).

    Raises:
        KeyError: an unknown ``whitespace``.
        ValueError: the schema cannot be compiled (llguidance's message).
    """
    return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"} if schema is None else schema,
                                                         defaults=JSON_WHITESPACE[whitespace])


def grammar_error(grammar: str) -> str | None:
    """Why ``grammar`` cannot be compiled (one line), or None when it can."""
    try:
        err = llguidance.LLMatcher.validate_grammar(grammar)
    except Exception as exc:  # llguidance raises plain Exceptions on malformed input
        err = str(exc) or "invalid grammar"
    return (err.splitlines() or ["invalid grammar"])[0] if err else None


def calls_grammar(schema: dict, whitespace: str = "flexible") -> str:
    """The llguidance grammar of one or more JSON values matching ``schema``, one per line (a Lark
    grammar embedding the schema, ``whitespace`` inside each value as :func:`json_schema_grammar`'s)."""
    embedded = {**schema, "x-guidance": JSON_WHITESPACE[whitespace]}
    lark = 'start: call ("\\n" call)*\ncall: %json ' + json.dumps(embedded, ensure_ascii=False)
    return json.dumps({"grammars": [{"name": "tool_calls", "lark_grammar": lark}]}, ensure_ascii=False)


def checked_grammar(schema: dict | None, param: str, repeated: bool = False, whitespace: str = "flexible",
                    strict: bool = True) -> str:
    """:func:`json_schema_grammar` of ``schema`` (``repeated``: :func:`calls_grammar`) with the
    ``whitespace`` layout, validated; ``strict``: objects admit only their declared properties
    unless they set ``additionalProperties`` (:func:`closed_schema`). ``None`` (any JSON object) is
    never closed.

    Raises:
        ApiError: 400 naming ``param`` when the schema cannot be compiled or is too large.
    """
    if strict and schema is not None:
        schema = closed_schema(schema)
    try:
        grammar = calls_grammar(schema, whitespace) if repeated else json_schema_grammar(schema, whitespace)
    except (ValueError, TypeError) as exc:
        raise ApiError(400, f"invalid JSON schema in '{param}': {exc}", param, "invalid_value") from None
    err = grammar_error(grammar)
    if err:
        hint = STRICT_HINT if strict and schema is not None and "nsatisfiable" in err else ""
        raise ApiError(400, f"invalid JSON schema in '{param}': {err}{hint}", param, "invalid_value")
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise ApiError(400, f"the JSON schema in '{param}' is too large", param, "invalid_value")
    return grammar


@dataclass(frozen=True)
class ToolPlan:
    """How a request's ``tools`` shape its prompt, grammar and answer.

    Attributes:
        names: the declared function names (the answer may call only these).
        forced: ``required`` or a named function: the grammar forces a call.
        prompt: the system text listing the functions.
        parallel: an answer may hold several calls (``parallel_tool_calls``, default true); else exactly one.
    """

    names: tuple[str, ...]
    forced: bool
    prompt: str
    parallel: bool = True

    def parse(self, text: str) -> list[dict] | None:
        """The OpenAI ``tool_calls`` entries ``text`` spells (each with its own id, in order), or None
        when it is not only calls to declared functions, or holds several without ``parallel`` (then
        it is the answer's ``content``). Calls are JSON objects separated by whitespace (one per line)."""
        objs, decoder, i = [], json.JSONDecoder(), 0
        while True:
            while i < len(text) and text[i] in " \t\r\n":
                i += 1
            if i == len(text):
                break
            try:
                obj, i = decoder.raw_decode(text, i)
            except ValueError:
                return None
            objs.append(obj)
        if not objs or (len(objs) > 1 and not self.parallel):
            return None
        for obj in objs:
            if not (isinstance(obj, dict) and set(obj) == {"name", "arguments"} and obj["name"] in self.names
                    and isinstance(obj["arguments"], dict)):
                return None
        return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": o["name"], "arguments": json.dumps(o["arguments"], ensure_ascii=False)}}
                for o in objs]


def _call_schema(fn) -> dict:
    """The schema of one call to ``fn``: its name as a constant, its parameters as the arguments."""
    params = fn.parameters if fn.parameters else {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": fn.name}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def plan_tools(tools, tool_choice, parallel_tool_calls: bool | None = None,
               whitespace: str = "flexible") -> tuple[ToolPlan | None, str | None]:
    """``(plan, grammar)`` of a chat request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls``
    (None = true, OpenAI's default); ``(None, None)`` when no tool may be called (no tools, or
    ``tool_choice: "none"``). A ``required`` call's grammar allows one or more calls, one per line,
    when parallel, exactly one otherwise; a named function is called exactly once (vLLM's named
    function choice: the grammar is that function's call); ``whitespace`` is the JSON layout inside a call
    (:data:`JSON_WHITESPACE`).

    Raises:
        ApiError: ``tool_choice`` without tools, a named function that is not declared, duplicate
            names, or parameters that are not a valid JSON schema (400 naming the field).
    """
    if not tools:
        if tool_choice not in (None, "none"):
            raise ApiError(400, "'tool_choice' requires 'tools'", "tool_choice", "invalid_value")
        return None, None
    fns = [t.function for t in tools]
    names = [f.name for f in fns]
    if len(set(names)) != len(names):
        raise ApiError(400, "'tools' declares a function name twice", "tools", "invalid_value")
    for i, fn in enumerate(fns):
        if fn.parameters is not None:
            checked_grammar(fn.parameters, f"tools[{i}].function.parameters")
    if tool_choice == "none":
        return None, None
    chosen = fns
    if tool_choice is not None and not isinstance(tool_choice, str):
        chosen = [f for f in fns if f.name == tool_choice.function.name]
        if not chosen:
            raise ApiError(400, f"'tool_choice' names function {tool_choice.function.name!r}, which 'tools' does "
                           "not declare", "tool_choice.function.name", "invalid_value")
    forced = tool_choice is not None and tool_choice != "auto"
    listing = [{"name": f.name, **({"description": f.description} if f.description else {}),
                "parameters": f.parameters or {"type": "object", "properties": {}}} for f in fns]
    parallel = parallel_tool_calls is not False
    plan = ToolPlan(tuple(names), forced, (PARALLEL_TOOL_PROMPT if parallel else TOOL_PROMPT)
                    + json.dumps(listing, ensure_ascii=False), parallel)
    if not forced:
        return plan, None
    schema = _call_schema(chosen[0]) if len(chosen) == 1 else {"anyOf": [_call_schema(f) for f in chosen]}
    named = not isinstance(tool_choice, str)
    return plan, checked_grammar(schema, "tools", repeated=parallel and not named, whitespace=whitespace)


def with_tool_prompt(messages: list[dict], plan: ToolPlan | None) -> list[dict]:
    """``messages`` with the tool listing appended to the first system message (or as a new first
    system message)."""
    if plan is None:
        return messages
    if messages and messages[0]["role"] in ("system", "developer"):
        first = dict(messages[0])
        first["content"] = f"{first['content']}\n\n{plan.prompt}" if first["content"] else plan.prompt
        return [first, *messages[1:]]
    return [{"role": "system", "content": plan.prompt}, *messages]


def call_text(tool_calls: list) -> str:
    """An assistant turn's ``tool_calls`` in the convention's text (one JSON object per line)."""
    out = []
    for call in tool_calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(fn.get("arguments"), str)):
            raise ValueError("each tool call needs function.name and function.arguments (a JSON string)")
        try:
            args = json.loads(fn["arguments"])
        except ValueError:
            raise ValueError("function.arguments must be a JSON string") from None
        out.append(json.dumps({"name": fn["name"], "arguments": args}, ensure_ascii=False))
    return "\n".join(out)

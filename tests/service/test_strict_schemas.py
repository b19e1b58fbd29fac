"""Strict JSON grammars: a forced tool call's arguments and a ``json_schema`` answer admit only the
properties their schema declares (unless it sets ``additionalProperties``), with bounded whitespace,
so a model cannot wander inside an object until ``max_tokens`` (vLLM's strict grammar mode,
OpenAI's ``strict: true``).

The grammar checks run a real llguidance matcher over candidate texts; the last test sends the
request that used to run to ``length`` to SmolLM2-135M-Instruct (float32 weights, slow on CPU).
"""

from __future__ import annotations

import asyncio
import json

import jsonschema
import llguidance
import pytest

from gateway.schemas import ChatCompletionRequest
from gateway.tools import checked_grammar, plan_tools

from .fakes import bytelevel_model_dir

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather",
                                                 "parameters": CITY}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    model_dir = bytelevel_model_dir(tmp_path_factory.mktemp("strict"))
    return llguidance.LLTokenizer((model_dir / "tokenizer.json").read_text(), eos_token=2)


def accepts(tok, grammar: str, text: str) -> bool:
    """Whether ``text`` is a complete answer of ``grammar``."""
    m = llguidance.LLMatcher(tok, grammar, log_level=0)
    return bool(m.consume_tokens(tok.tokenize_str(text)) and not m.is_error() and m.is_accepting())


def _call(args: dict, indent=None) -> str:
    return json.dumps({"name": "get_weather", "arguments": args}, indent=indent)


@pytest.mark.parametrize("choice", ["required", "named"])
@pytest.mark.parametrize("parallel", [True, False])
def test_forced_call_arguments_admit_only_declared_properties(tok, choice, parallel):
    """The issue's runaway: the model wrote ``"type": "object", "properties": {...}`` into the
    arguments; the grammar must refuse any key ``parameters`` does not declare."""
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                "tools": [WEATHER_TOOL],
                                                "tool_choice": "required" if choice == "required" else NAMED})
    _, grammar = plan_tools(req.tools, req.tool_choice, parallel)
    assert accepts(tok, grammar, _call({"city": "Paris"}))
    assert accepts(tok, grammar, _call({"city": "Paris"}, indent=2))  # pretty-printed: still allowed
    assert not accepts(tok, grammar, _call({"city": "Paris", "type": "object"}))
    assert not accepts(tok, grammar, _call({"city": "Paris", "properties": {"type": "string"}}, indent=2))
    wide = '{"name": "get_weather", "arguments": {' + " " * 21 + '"city": "Paris"}}'
    assert not accepts(tok, grammar, wide)  # whitespace is bounded inside a call
    assert accepts(tok, grammar, wide.replace(" " * 21, " " * 20))


def test_a_named_function_is_called_exactly_once(tok):
    """A named ``tool_choice`` forces one call of that function, parallel or not (a small model
    otherwise repeats the same call until ``max_tokens``); ``required`` keeps parallel calls."""
    two = _call({"city": "Paris"}) + "\n" + _call({"city": "Rome"})
    for choice, parallel, many in [(NAMED, None, False), (NAMED, True, False), ("required", None, True)]:
        req = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                    "tools": [WEATHER_TOOL], "tool_choice": choice})
        _, grammar = plan_tools(req.tools, req.tool_choice, parallel)
        assert accepts(tok, grammar, _call({"city": "Paris"}))
        assert accepts(tok, grammar, two) is many, (choice, parallel)


def test_additional_properties_opt_in_and_nesting(tok):
    """A schema that allows more keeps its rule; closing reaches nested objects, array items,
    ``anyOf`` branches and ``$defs``; ``allOf`` members stay open (closing each would refuse the
    others' properties); the input schema is not modified."""
    nested = {"type": "object", "properties": {
        "place": {"type": "object", "properties": {"city": {"type": "string"}}},
        "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
        "any": {"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"type": "null"}]},
        "ref": {"$ref": "#/$defs/R"},
        "free": {"type": "object", "additionalProperties": True},
        "typed": {"type": "object", "additionalProperties": {"type": "integer"}},
        "both": {"allOf": [{"type": "object", "properties": {"x": {"type": "integer"}}},
                           {"type": "object", "properties": {"y": {"type": "integer"}}}]}},
        "$defs": {"R": {"type": "object", "properties": {"r": {"type": "boolean"}}}}}
    before = json.dumps(nested, sort_keys=True)
    g = checked_grammar(nested, "s", whitespace="compact")
    assert json.dumps(nested, sort_keys=True) == before
    ok = {"place": {"city": "Oslo"}, "tags": [{"k": "v"}], "any": {"a": 1}, "ref": {"r": True},
          "free": {"anything": [1, 2]}, "typed": {"n": 3}, "both": {"x": 1, "y": 2}}
    assert accepts(tok, g, json.dumps(ok, separators=(",", ":")))
    for path, extra in [("place", {"city": "Oslo", "zip": "1"}), ("tags", [{"k": "v", "z": 1}]),
                        ("any", {"a": 1, "b": 2}), ("ref", {"r": True, "s": 1}), ("typed", {"n": "three"})]:
        bad = {**ok, path: extra}
        assert not accepts(tok, g, json.dumps(bad, separators=(",", ":"))), path
    assert not accepts(tok, g, json.dumps({**ok, "top": 1}, separators=(",", ":")))
    from gateway.tools import closed_schema

    closed = closed_schema(nested)
    assert closed["properties"]["both"]["allOf"][0].get("additionalProperties") is None
    assert closed["properties"]["free"]["additionalProperties"] is True


@pytest.mark.parametrize("strict", [True, None, False])
def test_response_format_strict_closes_objects_unless_false(bytelevel_dir, tok, strict):
    """``json_schema`` with ``strict`` true (or omitted, the served default) admits only declared
    properties; ``strict: false`` keeps JSON Schema's default (undeclared properties allowed)."""
    from .conftest import GatewayHarness

    h = GatewayHarness(bytelevel_dir)
    fmt = {"name": "a", "schema": CITY, **({} if strict is None else {"strict": strict})}
    r = asyncio.run(h.chat(messages=[{"role": "user", "content": "x"}], max_tokens=8,
                           response_format={"type": "json_schema", "json_schema": fmt}))
    assert r.status_code == 200, r.text
    grammar = h.engine.generated[0].sampling.grammar
    assert accepts(tok, grammar, '{"city": "Paris"}')
    assert accepts(tok, grammar, '{"city": "Paris", "type": "object"}') == (strict is False)


def test_a_required_property_never_declared_is_a_400_that_says_why():
    """Strict objects make ``required`` names outside ``properties`` unsatisfiable: refused up front
    (400 naming the field, with the rule), never a request that cannot finish."""
    from gateway.schemas import ApiError

    bad = {"type": "object", "required": ["city"]}
    with pytest.raises(ApiError) as e:
        checked_grammar(bad, "tools[0].function.parameters")
    assert e.value.status == 400 and e.value.body()["error"]["param"] == "tools[0].function.parameters"
    assert "additionalProperties" in e.value.body()["error"]["message"]
    assert checked_grammar(bad, "p", strict=False)  # JSON Schema's default: an undeclared key may be written
    assert checked_grammar({**bad, "additionalProperties": True}, "p")


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("tool_choice,parallel", [("required", None), (NAMED, False)])
def test_smollm2_float32_forced_call_closes_within_64_tokens(smol_stack, tool_choice, parallel):
    """The reported request: SmolLM2 with float32 weights at T = 0 used to write undeclared keys into
    the arguments until ``max_tokens`` 64 (``finish_reason: "length"``, no calls); now every call it
    returns validates, before the budget ends (exactly one when not parallel)."""
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    r = smol_stack.chat(messages=[{"role": "user", "content": "What's the weather like in Paris today?"}],
                        tools=[WEATHER_TOOL], tool_choice=tool_choice, temperature=0, max_tokens=64,
                        speculative={"method": "ar"}, **extra)
    c = r["choices"][0]
    assert c["finish_reason"] == "tool_calls", c
    calls = c["message"]["tool_calls"]
    assert calls and (parallel is not False or len(calls) == 1), calls
    for call in calls:
        assert call["function"]["name"] == "get_weather"
        jsonschema.validate(json.loads(call["function"]["arguments"]), CITY)
    assert r["usage"]["completion_tokens"] < (32 if parallel is False else 64), r["usage"]


@pytest.fixture(scope="module")
def smol_stack():
    """The gateway over an in-process verifier running SmolLM2-135M-Instruct (float32, plain decoding)."""
    import httpx

    from gateway.text import TextModel
    from services.models.registry import resolve_target
    from services.verifier.engine import SpecEngine
    from services.verifier.target import TargetModel

    from .fakes import InprocWorkerStack, verifier_info

    d = resolve_target(None)
    target = TargetModel.from_pretrained(d, weights="float32")
    vocab, eos = target.model.config.vocab_size, target.model.config.eos_token_id
    tok = llguidance.LLTokenizer((d / "tokenizer.json").read_text(), n_vocab=vocab, eos_token=eos)
    stack = InprocWorkerStack(d, TextModel(d), SpecEngine(target, None, grammar_tokenizer=tok),
                              verifier_info(vocab, max_context=2048, eos_token_id=eos, methods=["ar"]))

    def chat(**body):
        async def go():
            await stack.client.start()
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=stack.app), base_url="http://t",
                                         timeout=600) as http:
                return await http.post("/v1/chat/completions", json={"model": "tiny", **body})
        r = asyncio.run(go())
        assert r.status_code == 200, r.text
        return r.json()

    stack.chat = chat
    yield stack
    stack.close()

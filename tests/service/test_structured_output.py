"""``response_format`` and ``tools`` through the gateway, the official ``openai`` client, and a real
engine (tiny random-weight float32 target, tiny DARTree drafter, byte-level tokenizer).

A random model writes garbage; the grammar makes it write JSON that parses and validates against
the schema (``jsonschema``), streamed and not, for every speculative method and ``ar``, and makes a
forced tool call's arguments match the declared parameters.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import jsonschema
import llguidance
import openai
import pytest

from gateway.config import GatewayConfig
from gateway.schemas import Tool
from gateway.text import TextModel
from gateway.tools import ToolPlan, checked_grammar, plan_tools
from services.testing import tiny_drafter, tiny_service, tiny_target
from services.verifier.drafter_client import InprocDrafterClient
from services.verifier.engine import SpecEngine

from .conftest import GatewayHarness
from .fakes import InprocWorkerStack, bytelevel_model_dir, verifier_info

CONTEXT = 1024
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
          "required": ["color", "ok"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "ping", "parameters": {
             "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
             "required": ["n"], "additionalProperties": False}}}]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MSG = [{"role": "user", "content": "Hello there"}]
METHODS = ["ar", "dartree-pruned", "ddtree"]


class Stack(InprocWorkerStack):
    """The gateway app over an in-process verifier worker running a real ``SpecEngine``; compact JSON
    unless ``json_whitespace`` says otherwise (a random-weight model pads every gap it may)."""

    def __init__(self, model_dir: Path, json_whitespace: str = "compact"):
        text = TextModel(model_dir)
        vocab = text.vocab_size
        target = tiny_target("llama", vocab_size=vocab, hidden_size=32, num_layers=2,
                             max_position_embeddings=CONTEXT, eos_token_id=2, seed=3)
        service = tiny_service(target, tiny_drafter(target, seed=3, block_size=6))
        tok = llguidance.LLTokenizer((model_dir / "tokenizer.json").read_text(), n_vocab=vocab, eos_token=2)
        engine = SpecEngine(target, InprocDrafterClient(service), max_draft_depth=6, grammar_tokenizer=tok)
        super().__init__(model_dir, text, engine, verifier_info(vocab, max_context=CONTEXT),
                         json_whitespace=json_whitespace)

    def run(self, fn):
        """``await fn(openai_client, httpx_client)`` on a fresh event loop."""
        async def go():
            await self.client.start()
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://t",
                                         timeout=120) as http:
                oai = openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=http, max_retries=0)
                return await fn(oai, http)
        return asyncio.run(go())


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(bytelevel_model_dir(tmp_path_factory.mktemp("bytelevel")))
    yield s
    s.close()


def _response_format(schema=SCHEMA):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


async def _stream_text(oai, **kw) -> tuple[dict[int, str], dict[int, str], dict[int, list]]:
    """Streamed content, finish reason and tool-call deltas per choice index."""
    texts, finishes, calls = {}, {}, {}
    stream = await oai.chat.completions.create(model="tiny", stream=True, **kw)
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            calls.setdefault(c.index, []).extend(c.delta.tool_calls or [])
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    return texts, finishes, calls


@pytest.mark.parametrize("method", METHODS)
def test_json_schema_output_validates_streamed_and_not(stack, method):
    kw = dict(messages=MSG, max_tokens=64, response_format=_response_format(),
              extra_body={"speculative": {"method": method}})

    async def go(oai, http):
        r = await oai.chat.completions.create(model="tiny", **kw)
        return r, await _stream_text(oai, **kw)

    r, (texts, finishes, _) = stack.run(go)
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert texts == {0: choice.message.content} and finishes == {0: "stop"}


def test_flexible_whitespace_default_allows_pretty_printed_json(tmp_path_factory):
    """The served default (``--json-whitespace flexible``) accepts indented JSON and bounds each gap;
    compact forbids it; a request under the default still ends in JSON that validates."""
    assert GatewayConfig().json_whitespace == "flexible"
    with pytest.raises(ValueError, match="json_whitespace"):
        GatewayConfig(json_whitespace="pretty")
    model_dir = bytelevel_model_dir(tmp_path_factory.mktemp("bytelevel_ws"))
    tok = llguidance.LLTokenizer((model_dir / "tokenizer.json").read_text(), eos_token=2)

    def accepts(grammar: str, text: str) -> bool:
        m = llguidance.LLMatcher(tok, grammar, log_level=0)
        return bool(m.consume_tokens(tok.tokenize_str(text)) and not m.is_error() and m.is_accepting())

    obj = {"color": "red", "ok": True}
    pretty, wide = json.dumps(obj, indent=2), "{" + " " * 21 + '"color":"red","ok":true}'
    flexible, compact = checked_grammar(SCHEMA, "s"), checked_grammar(SCHEMA, "s", whitespace="compact")
    assert "\n  " in pretty and accepts(flexible, pretty) and accepts(flexible, wide.replace(" " * 21, " " * 20))
    assert not accepts(flexible, wide) and not accepts(compact, pretty) and accepts(compact, json.dumps(obj, separators=(",", ":")))
    s = Stack(model_dir, json_whitespace=GatewayConfig().json_whitespace)
    try:
        async def go(oai, http):
            return [await oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=480,
                                                      response_format=_response_format(),
                                                      extra_body={"speculative": {"method": m}}) for m in METHODS[:2]]
        ar, spec = [r.choices[0] for r in s.run(go)]
    finally:
        s.close()
    assert ar.finish_reason == "stop" and ar.message.content == spec.message.content
    assert any(c in ar.message.content for c in " \n")  # the random model pads the gaps it is allowed
    jsonschema.validate(json.loads(ar.message.content), SCHEMA)


def test_grammar_metrics(stack):
    """Forbidden draft nodes are counted; the sampling phase (processors + masks) is timed."""
    r = stack.worker.metrics.registry
    masked = lambda: r.get_sample_value("dartree_spec_grammar_masked_tokens_total",  # noqa: E731
                                        {"method": "dartree-pruned"}) or 0.0
    timed = lambda: r.get_sample_value("dartree_round_seconds_count", {"phase": "sampling"}) or 0.0  # noqa: E731
    before = masked(), timed()

    async def go(oai, http):
        return await oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=64,
                                                 response_format=_response_format(),
                                                 extra_body={"speculative": {"method": "dartree-pruned"}})

    jsonschema.validate(json.loads(stack.run(go).choices[0].message.content), SCHEMA)
    assert masked() > before[0] and timed() > before[1]


def test_unconstrained_output_is_not_json(stack):
    async def go(oai, http):
        return await oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=24)

    with pytest.raises(ValueError):
        json.loads(stack.run(go).choices[0].message.content)


def test_json_object_and_n_choices_and_completions(stack):
    async def go(oai, http):
        chat = await oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=96, n=2, seed=5,
                                                 temperature=0.8, response_format={"type": "json_object"})
        schema = await oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=64, n=2,
                                                   response_format=_response_format())
        comp = await http.post("/v1/completions", json={"model": "tiny", "prompt": "Answer:", "max_tokens": 64,
                                                         "response_format": _response_format()})
        return chat, schema, comp

    chat, schema, comp = stack.run(go)
    assert [c.index for c in chat.choices] == [0, 1]
    for c in chat.choices:
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)
        else:  # a random model may fill a free-form object until max_tokens: still a JSON object's prefix
            assert c.finish_reason == "length" and c.message.content.startswith("{")
    assert len(schema.choices) == 2
    for c in schema.choices:
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    assert comp.status_code == 200, comp.text
    jsonschema.validate(json.loads(comp.json()["choices"][0]["text"]), SCHEMA)


@pytest.mark.parametrize("choice", ["required", "named"])
@pytest.mark.parametrize("method", ["ar", "dartree-pruned"])
def test_forced_tool_calls_match_the_declared_parameters(stack, choice, method):
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "get_weather"}}
    # EOS biased up: the grammar allows more calls after each one, which a random model keeps adding
    kw = dict(messages=MSG, max_tokens=96, tools=TOOLS, tool_choice=tool_choice, logit_bias={"2": 100},
              extra_body={"speculative": {"method": method}})

    async def go(oai, http):
        r = await oai.chat.completions.create(model="tiny", **kw)
        return r, await _stream_text(oai, **kw)

    r, (texts, finishes, deltas) = stack.run(go)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None, c
    assert c.message.tool_calls and len({call.id for call in c.message.tool_calls}) == len(c.message.tool_calls)
    for call in c.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        if choice == "named":
            assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
    assert finishes == {0: "tool_calls"} and texts == {0: ""}
    assert [(d.index, d.type, d.function.name, d.function.arguments) for d in deltas[0]] == [
        (k, "function", call.function.name, call.function.arguments) for k, call in enumerate(c.message.tool_calls)]


@pytest.mark.parametrize("method", ["ar", "dartree-pruned"])
def test_parallel_tool_calls_and_min_tokens(stack, method):
    """``parallel_tool_calls: false``: exactly one call, which completes the grammar and ends the
    answer even before ``min_tokens`` (grammar completion wins). Parallel (the default): the grammar
    lets ``min_tokens`` push past the first call into a second one, after which EOS (biased up)
    ends the answer: two calls with distinct ids and indexes 0 and 1, streamed and not."""
    base = dict(messages=MSG, max_tokens=160, tools=TOOLS, tool_choice="required")
    spec = {"speculative": {"method": method}}

    async def go(oai, http):
        one = await oai.chat.completions.create(model="tiny", parallel_tool_calls=False, extra_body=spec, **base)
        n1 = one.usage.completion_tokens
        held = await oai.chat.completions.create(model="tiny", parallel_tool_calls=False,
                                                 extra_body={**spec, "min_tokens": n1 + 8}, **base)
        kw = dict(base, logit_bias={"2": 100}, extra_body={**spec, "min_tokens": n1 + 1})
        two = await oai.chat.completions.create(model="tiny", **kw)
        return one, held, two, await _stream_text(oai, **kw)

    one, held, two, (texts, finishes, deltas) = stack.run(go)
    (call,) = one.choices[0].message.tool_calls
    assert one.choices[0].finish_reason == held.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in held.choices[0].message.tool_calls] == [
        (call.function.name, call.function.arguments)]
    assert held.usage.completion_tokens == one.usage.completion_tokens
    c = two.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None, c
    first, second = c.message.tool_calls
    assert (first.function.name, first.function.arguments) == (call.function.name, call.function.arguments)
    assert first.id != second.id
    for tc in (first, second):
        jsonschema.validate(json.loads(tc.function.arguments), PARAMS[tc.function.name])
    assert finishes == {0: "tool_calls"} and texts == {0: ""}
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas[0]] == [
        (0, first.function.name, first.function.arguments), (1, second.function.name, second.function.arguments)]
    assert len({d.id for d in deltas[0]}) == 2


def test_multi_turn_with_a_tool_result_and_auto(stack):
    msgs = MSG + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "ping", "arguments": '{"n": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "pong"}]

    async def go(oai, http):
        return await oai.chat.completions.create(model="tiny", messages=msgs, max_tokens=16, tools=TOOLS,
                                                 tool_choice="auto")

    c = stack.run(go).choices[0]
    assert c.finish_reason in ("stop", "length") and c.message.tool_calls is None  # a random model calls nothing


# ---------------------------------------------------------------------------------------------
# the gateway alone (scripted engine): prompt, grammar, parsing, errors
# ---------------------------------------------------------------------------------------------
def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def bl_harness(bytelevel_dir):
    """The scripted-engine gateway with a context window that fits the tool listing."""
    h = GatewayHarness(bytelevel_dir)
    h.engine.info = verifier_info(h.text.vocab_size, max_context=CONTEXT)
    return h


def test_tools_are_listed_in_the_system_prompt_and_forced_by_a_grammar(bl_harness):
    h: GatewayHarness = bl_harness
    r = run(h.chat(messages=[{"role": "system", "content": "Be brief."}] + MSG, tools=TOOLS, tool_choice="required",
                   max_tokens=8))
    assert r.status_code == 200, r.text
    gen = h.engine.generated[0]
    prompt = h.text.decode(gen.prompt_ids)
    assert "Be brief.\n\nYou can call the functions" in prompt and '"name": "get_weather"' in prompt
    assert prompt.startswith("system\nBe brief.") and prompt.count("system\n") == 1  # one system turn
    assert gen.sampling.grammar and "get_weather" in gen.sampling.grammar and "ping" in gen.sampling.grammar
    msgs = MSG + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_7", "type": "function", "function": {"name": "ping", "arguments": '{"n": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_7", "content": "pong"}]
    r = run(h.chat(messages=msgs, tools=TOOLS, tool_choice="none", max_tokens=8))
    assert r.status_code == 200 and h.engine.generated[1].sampling.grammar is None
    prompt = h.text.decode(h.engine.generated[1].prompt_ids)
    assert "You can call" not in prompt
    assert '{"name": "ping", "arguments": {"n": 3}}' in prompt  # the earlier call and its result reach the model
    assert '{"tool_call_id": "call_7", "content": "pong"}' in prompt
    r = run(h.chat(messages=MSG, tools=TOOLS, tool_choice="auto", max_tokens=8))
    assert r.status_code == 200 and h.engine.generated[2].sampling.grammar is None
    assert "You can call" in h.text.decode(h.engine.generated[2].prompt_ids)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_answer_that_spells_a_declared_call_is_a_tool_call(bl_harness, stream):
    h = bl_harness
    h.script_text = '{"name": "ping", "arguments": {"n": 4}}'
    r = run(h.chat(messages=MSG, tools=TOOLS, max_tokens=64, stream=stream))
    assert r.status_code == 200, r.text
    if stream:
        events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
        (call,) = [tc for e in events for c in e["choices"] for tc in c["delta"].get("tool_calls") or []]
        assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    else:
        (call,) = r.json()["choices"][0]["message"]["tool_calls"]
        assert r.json()["choices"][0]["finish_reason"] == "tool_calls"
    assert call["function"] == {"name": "ping", "arguments": '{"n": 4}'} and call["type"] == "function"


TWO_CALLS = '{"name": "ping", "arguments": {"n": 4}}\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}'


@pytest.mark.parametrize("stream", [False, True])
def test_auto_answer_with_two_calls_is_two_tool_calls_unless_parallel_is_off(bl_harness, stream):
    h = bl_harness
    h.script_text = TWO_CALLS
    r = run(h.chat(messages=MSG, tools=TOOLS, max_tokens=128, stream=stream))
    assert r.status_code == 200, r.text
    if stream:
        events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
        calls = [tc for e in events for c in e["choices"] for tc in c["delta"].get("tool_calls") or []]
        assert [tc["index"] for tc in calls] == [0, 1]
        assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
        assert not any(c["delta"].get("content") for e in events for c in e["choices"])
    else:
        calls = r.json()["choices"][0]["message"]["tool_calls"]
        assert r.json()["choices"][0]["finish_reason"] == "tool_calls"
    assert [c["function"] for c in calls] == [{"name": "ping", "arguments": '{"n": 4}'},
                                              {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}]
    assert calls[0]["id"] != calls[1]["id"] and all(c["id"].startswith("call_") for c in calls)
    r = run(h.chat(messages=MSG, tools=TOOLS, max_tokens=128, stream=stream, parallel_tool_calls=False))
    assert r.status_code == 200, r.text
    if not stream:  # two calls where one is allowed: the answer is text
        c = r.json()["choices"][0]
        assert c["message"]["content"] == TWO_CALLS and c["finish_reason"] == "stop"
        assert "tool_calls" not in c["message"]


def test_tool_plan_parses_only_declared_calls():
    plan = ToolPlan(("ping",), False, "")
    (call,) = plan.parse('{"name": "ping", "arguments": {}}')
    assert call["function"]["name"] == "ping"
    for text in ('{"name": "pong", "arguments": {}}', '{"name": "ping"}', '{"name": "ping", "arguments": 3}',
                 'call ping', '{"name": "ping", "arguments": {}, "x": 1}', '', '{"name": "ping", "arguments": {}} x',
                 '{"name": "ping", "arguments": {}}\n{"name": "pong", "arguments": {}}'):
        assert plan.parse(text) is None, text
    two = '{"name":"ping","arguments":{"n":1}}\n{\n "name": "ping",\n "arguments": {}\n}\n'
    assert [c["function"]["arguments"] for c in plan.parse(two)] == ['{"n": 1}', "{}"]
    assert ToolPlan(("ping",), False, "", parallel=False).parse(two) is None
    assert plan_tools(None, None) == (None, None)


def test_parallel_tool_calls_picks_the_prompt_and_the_grammar():
    tools = [Tool.model_validate(t) for t in TOOLS]
    plan, grammar = plan_tools(tools, "required")
    assert plan.parallel and "one call per line" in plan.prompt and '"lark_grammar":' in grammar
    plan, grammar = plan_tools(tools, "required", parallel_tool_calls=False)
    assert not plan.parallel and "one call per line" not in plan.prompt and '"lark_grammar":null' in grammar
    plan, grammar = plan_tools(tools, "auto", parallel_tool_calls=True)
    assert plan.parallel and grammar is None


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "objectx"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}}},
     "response_format.json_schema.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}]},
     "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    # strict objects: a required property the schema never declares can never be written
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": ["x"]}}}]},
     "tools[0].function.parameters"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "properties": {"a": {"type": "object", "required": ["b"]}}, "required": ["a"]}}}},
     "response_format.json_schema.schema"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}]},
     "messages[0].tool_calls"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]},
     "messages[0].tool_calls"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages[0].tool_call_id"),
]


@pytest.mark.parametrize("fields,param", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_bad_structured_requests_are_400_naming_the_field(bl_harness, fields, param):
    h = bl_harness
    r = run(h.chat(**{"messages": MSG, **fields}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    assert not h.engine.generated


def test_tools_on_completions_are_refused(bl_harness):
    r = run(bl_harness.complete(prompt="x", tools=TOOLS))
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"

"""Penalties, logit_bias, min_tokens, min_p and ``n`` choices through the gateway (scripted engine)."""

from __future__ import annotations

import asyncio
import json

import pytest

from .fakes import Script
from .test_gateway import sse_events


def run(coro):
    return asyncio.run(coro)


WORDS = ["alpha beta gamma", "one two three four", "red green"]


def _by_seed(h):
    """Choice ``i`` (seed 100 + i) plays ``WORDS[i]``."""
    h.script = lambda gen: Script(h.text.encode(WORDS[gen.sampling.seed - 100], add_special_tokens=False))


def test_options_reach_the_engine(bl_harness):
    h = bl_harness
    r = run(h.complete(prompt="x", max_tokens=4, presence_penalty=0.5, frequency_penalty=-1.5, repetition_penalty=1.2,
                       logit_bias={"5": 10, "7": -100}, min_tokens=2, min_p=0.05))
    assert r.status_code == 200, r.text
    s = h.engine.generated[0].sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_tokens, s.min_p) == \
        (0.5, -1.5, 1.2, 2, 0.05)
    assert s.logit_bias == {5: 10.0, 7: -100.0}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("chat", [False, True])
def test_n_choices_each_with_its_seed_index_and_summed_usage(bl_harness, stream, chat):
    h = bl_harness
    _by_seed(h)
    body = dict(max_tokens=50, n=3, seed=100, stream=stream)
    if stream:
        body["stream_options"] = {"include_usage": True}
    r = run(h.chat(messages=[{"role": "user", "content": "hi"}], **body) if chat else h.complete(prompt="Say:", **body))
    assert r.status_code == 200, r.text
    gens = h.engine.generated
    assert sorted(g.sampling.seed for g in gens) == [100, 101, 102]
    assert len({g.request_id for g in gens}) == 3
    prompt_tokens = len(gens[0].prompt_ids)
    ntok = [len(h.text.encode(w, add_special_tokens=False)) for w in WORDS]
    if stream:
        events = sse_events(r.text)
        texts = {0: "", 1: "", 2: ""}
        for e in events:
            for c in e["choices"]:
                texts[c["index"]] += c["delta"].get("content") or "" if chat else c["text"]
        usage = events[-1]["usage"]
        finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
        assert len(finishes) == 3
    else:
        obj = r.json()
        assert [c["index"] for c in obj["choices"]] == [0, 1, 2]
        texts = {c["index"]: c["message"]["content"] if chat else c["text"] for c in obj["choices"]}
        usage = obj["usage"]
    assert texts == dict(enumerate(WORDS))
    assert usage == {"prompt_tokens": prompt_tokens, "completion_tokens": sum(ntok),
                     "total_tokens": prompt_tokens + sum(ntok)}


def test_n_choices_unseeded_and_best_of_equal_to_n(bl_harness):
    h = bl_harness
    r = run(h.complete(prompt="x", max_tokens=3, n=2, best_of=2))
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2 and [g.sampling.seed for g in h.engine.generated] == [None, None]


def test_a_failing_choice_fails_the_request_and_aborts_the_others(bl_harness):
    h = bl_harness
    h.script = lambda gen: Script(h.text.encode("a b c d e f", add_special_tokens=False), delay_s=0.01,
                                  error_after_rounds=1 if gen.request_id.endswith("-1") else None)
    r = run(h.complete(prompt="x", max_tokens=30, n=3))
    assert r.status_code == 500 and set(r.json()["error"]) == {"message", "type", "param", "code"}


BAD = [
    ({"n": 0}, "n"), ({"n": 129}, "n"), ({"n": 2, "best_of": 3}, "best_of"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"), ({"min_p": -0.1}, "min_p"), ({"min_tokens": -1}, "min_tokens"),
    ({"max_tokens": 3, "min_tokens": 4}, "min_tokens"),
    ({"logit_bias": {"abc": 1}}, "logit_bias.abc"), ({"logit_bias": {"-3": 1}}, "logit_bias.-3"),
    ({"logit_bias": {"100000000": 1}}, "logit_bias.100000000"), ({"logit_bias": {"5": 101}}, "logit_bias.5"),
    ({"logit_bias": {"5": "1"}}, "logit_bias.5"), ({"logit_bias": {"5": True}}, "logit_bias.5"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("fields,param", BAD, ids=[json.dumps(b[0])[:40] for b in BAD])
def test_out_of_range_options_are_400_naming_the_field(bl_harness, fields, param, chat):
    h = bl_harness
    if chat and "best_of" in fields:
        pytest.skip("best_of is a /v1/completions field")
    r = run(h.chat(messages=[{"role": "user", "content": "hi"}], **fields) if chat else h.complete(prompt="x", **fields))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert not h.engine.generated

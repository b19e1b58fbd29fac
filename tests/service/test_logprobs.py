"""Logprobs through the gateway on a scripted engine: shapes, alignment with text/ids/usage, streaming.

The scripted engine gives the token at output position p the logprob ``-(p + 1) / 1000``
(:func:`tests.service.fakes.fake_logprobs`), so every entry tells which token it belongs to. Checked:

- one entry per counted token (== ``token_ids`` == ``usage.completion_tokens``), in order, with the
  token's own string/bytes; cut at the same token as the text by stop strings and ``max_tokens``;
- streamed logprobs concatenated == the non-streamed ones, for both endpoints, with multibyte text
  and random round splits;
- each stream chunk carries exactly the tokens whose text has been released by then (a token whose
  text is held back, by incomplete UTF-8 or a possible stop string, rides with the chunk that
  releases the end of its text), against a brute-force reference that decodes every prefix;
- ``text_offset`` is where each token's text starts.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from gateway.text import PROMPT_CONTEXT_TOKENS, TextModel

from .fakes import Script

TEXTS = ["Hello world, this is a test.", "你好，世界！这是一个测试。", "Emoji 😀🎉 party 🧪 time", "mixed 日本語 🎉!"]


def run(coro):
    return asyncio.run(coro)


def sse_events(body: str) -> list:
    assert body.endswith("data: [DONE]\n\n"), body[-200:]
    return [json.loads(line[6:]) for line in body.split("\n\n") if line.startswith("data: {")]


# ---------------------------------------------------------------------------------------- reference
def _decoded(text: TextModel, prompt: list[int], ids: list[int]) -> list[str]:
    """Complete text after each prefix of ``ids`` (trailing incomplete characters dropped)."""
    tail = list(prompt[-PROMPT_CONTEXT_TOKENS:])
    tail = [] if text.decode(tail).endswith("\ufffd") else tail
    base = text.decode(tail)
    return [text.decode(tail + ids[:k])[len(base):].rstrip("\ufffd") for k in range(len(ids) + 1)]


def prefix_stable(texts: list[str]) -> bool:
    """Decoding more tokens never rewrites text (always for byte-level BPE; see test_commit_semantics)."""
    return all(b.startswith(a) for a, b in zip(texts, texts[1:]))


def token_spans(texts: list[str]) -> list[tuple[int, int | None]]:
    """``(start, end)`` of each token's text: a token that only starts a character ends where the
    token completing it ends; ``end`` None: its text is never completed (released at the very end)."""
    lens = [len(t) for t in texts]
    spans = []
    for j in range(len(lens) - 1):
        m = next((m for m in range(j + 1, len(lens)) if lens[m] > lens[j]), None)
        spans.append((lens[j], lens[m] if m is not None else None))
    return spans


# --------------------------------------------------------------------------------------- extraction
def completion_entries(logprobs: dict) -> list[tuple]:
    return list(zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], logprobs["text_offset"],
                    strict=True))


def chat_entries(logprobs: dict) -> list[tuple]:
    assert set(logprobs) == {"content"}
    return [(e["token"], e["logprob"], e["bytes"], [tuple(t.values()) for t in e["top_logprobs"]])
            for e in logprobs["content"]]


def choice_text(choice: dict, chat: bool) -> str:
    if chat:
        return (choice.get("message") or choice.get("delta") or {}).get("content") or ""
    return choice["text"]


def request(h, chat: bool, k: int, **body):
    if chat:
        return h.chat(messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=k, **body)
    return h.complete(prompt="Say:", logprobs=k, **body)


# -------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("sizes", [[1], [3, 1, 4], [7]])
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("stop", [None, "first", "mid"])
def test_stream_equals_non_stream_and_each_chunk_carries_its_tokens(harness, text, sizes, chat, stop):
    h = harness
    ids = h.text.encode(text, add_special_tokens=False)
    h.script = lambda gen: Script(ids, round_sizes=sizes)
    stops = {None: None, "first": [text[1:3]], "mid": [text[len(text) // 2:len(text) // 2 + 2]]}[stop]
    k = 3 if chat else 2

    async def go():
        body = dict(max_tokens=100, stop=stops, return_token_ids=True)
        plain = await request(h, chat, k, **body)
        streamed = await request(h, chat, k, stream=True, stream_options={"include_usage": True}, **body)
        return plain.json(), streamed

    plain, streamed = run(go())
    choice = plain["choices"][0]
    kept, final = choice["token_ids"], choice_text(choice, chat)
    entries = (chat_entries if chat else completion_entries)(choice["logprobs"])
    # one entry per counted token, in order, each the token's own
    assert len(entries) == len(kept) == plain["usage"]["completion_tokens"]
    assert kept == ids[:len(kept)] and (stop is not None or kept == ids)
    assert [e[0] for e in entries] == [h.text.token_text(t) for t in kept]
    assert [e[1] for e in entries] == [-(p + 1) / 1000 for p in range(len(kept))]
    if chat:
        assert [e[2] for e in entries] == [list(h.text.token_bytes(t)) for t in kept]
        assert all(len(e[3]) == k and e[3][0][1] == -1.0 for e in entries)
    else:
        assert all(e[0] in e[2] and len(e[2]) <= k + 1 for e in entries)

    events = sse_events(streamed.text)
    chunks, usage = events[:-1], events[-1]
    assert usage["usage"] == plain["usage"]
    per_chunk = [(chat_entries if chat else completion_entries)(e["choices"][0]["logprobs"]) for e in chunks]
    assert [x for c in per_chunk for x in c] == entries  # stream == non-stream
    assert all(len(c) == len(e["choices"][0]["token_ids"]) for c, e in zip(per_chunk, chunks))
    assert "".join(choice_text(e["choices"][0], chat) for e in chunks) == final

    texts = _decoded(h.text, h.engine.generated[-1].prompt_ids, ids)
    if not prefix_stable(texts):
        return  # the byte-fallback decoder quirk: no brute-force reference (see test_commit_semantics)
    spans = token_spans(texts)[:len(kept)]
    if not chat:
        assert [e[3] for e in entries] == [min(start, len(final)) for start, _ in spans]
    released, carried = 0, 0
    for c, e in zip(per_chunk[:-1], chunks[:-1]):  # the last chunk hands out everything left
        released += len(choice_text(e["choices"][0], chat))
        carried += len(c)
        assert carried == sum(end is not None and end <= released for _, end in spans), (released, spans)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("max_tokens", [1, 5, 9])
def test_max_tokens_cuts_logprobs_with_the_text(bl_harness, stream, max_tokens):
    h = bl_harness
    ids = h.text.encode("mixed 日本語 🧪 and 😀 emoji", add_special_tokens=False)
    assert len(ids) > max_tokens
    h.script = lambda gen: Script(ids, round_sizes=[4])
    r = run(h.complete(prompt="x", max_tokens=max_tokens, logprobs=0, stream=stream))
    if stream:
        lps = [lp for e in sse_events(r.text) for lp in e["choices"][0]["logprobs"]["token_logprobs"]]
        finish = sse_events(r.text)[-1]["choices"][0]["finish_reason"]
    else:
        lps, finish = r.json()["choices"][0]["logprobs"]["token_logprobs"], r.json()["choices"][0]["finish_reason"]
    assert lps == [-(p + 1) / 1000 for p in range(max_tokens)] and finish == "length"


def test_stop_string_completed_mid_round_keeps_the_completing_token_only(bl_harness):
    h = bl_harness
    ids = h.text.encode("one two STOP three four", add_special_tokens=False)
    h.script = lambda gen: Script(ids, round_sizes=[len(ids)])
    body = run(h.complete(prompt="x", max_tokens=50, stop=["STOP"], logprobs=1, return_token_ids=True)).json()
    choice, lp = body["choices"][0], body["choices"][0]["logprobs"]
    assert choice["text"] == "one two " and body["usage"]["completion_tokens"] == len(choice["token_ids"])
    assert len(lp["tokens"]) == len(choice["token_ids"]) < len(ids)
    assert "STOP" in "".join(lp["tokens"]) and "STOP" not in "".join(lp["tokens"][:-1])
    assert all(0 <= o <= len(choice["text"]) for o in lp["text_offset"])


def test_no_logprobs_unless_asked(bl_harness):
    h = bl_harness
    r = run(h.complete(prompt="x", max_tokens=3)).json()
    assert r["choices"][0]["logprobs"] is None and h.engine.generated[-1].sampling.logprobs is None
    r = run(h.chat(messages=[{"role": "user", "content": "hi"}], max_tokens=3, logprobs=False)).json()
    assert r["choices"][0]["logprobs"] is None and h.engine.generated[-1].sampling.logprobs is None
    run(h.chat(messages=[{"role": "user", "content": "hi"}], max_tokens=3, logprobs=True))
    assert h.engine.generated[-1].sampling.logprobs == 0
    run(h.complete(prompt="x", max_tokens=3, logprobs=4))
    assert h.engine.generated[-1].sampling.logprobs == 4


def test_token_bytes_of_both_tokenizer_kinds(bytelevel_dir, bytefallback_dir):
    for d in (bytelevel_dir, bytefallback_dir):
        text = TextModel(d)
        ids = text.encode("Emoji 😀 你好 x", add_special_tokens=False)
        joined = b"".join(text.token_bytes(t) for t in ids).decode()
        assert joined.strip() == "Emoji 😀 你好 x"
        assert any("\\x" in text.token_text(t) for t in ids)  # partial characters show as escapes
    bf = TextModel(bytefallback_dir)
    assert bf.token_bytes(bf.tokenizer.token_to_id("<0xE4>")) == b"\xe4"
    assert bf.token_text(2) == "<|im_end|>"

"""Multi-token commit semantics under random acceptance patterns (bug-classes B01-B07, serving.md §2.9).

A scripted drafter decides how many drafts each round accepts; hypothesis picks that pattern plus
where EOS / stop token ids / ``max_tokens`` / stop strings fall. Checked, against plain greedy
decoding cut at the first terminator:

- engine (``SpecEngine``): emitted ids, ``finish_reason``, per-round ``accept_length``, the
  verifier's Prometheus counters (B06: only emitted tokens are counted) and, when asked, one logprob
  row per emitted token equal to the target's own (B19, B04);
- the whole text path (gateway ASGI app -> in-process verifier worker -> ``SpecEngine``): text,
  ``token_ids``, ``usage``, ``finish_reason``/``stop_reason``, logprobs (one per counted token, the
  target's), streamed == non-streamed byte for byte, and the verifier's acceptance histogram sums to
  the completion tokens.

``tests/engine/test_greedy_equivalence.py`` already places a terminator at every depth of a fully
accepted path; these tests add arbitrary acceptance patterns, rejections, and all four cut
mechanisms competing ("whichever comes first").
"""

from __future__ import annotations

import asyncio
import json
import random
import threading

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.text import PROMPT_CONTEXT_TOKENS, TextModel
from services.metrics import VerifierMetrics
from services.testing import greedy_reference, tiny_target
from services.params import SamplingParams, SpecParams
from services.verifier.engine import SpecEngine

from tests.service.fakes import InprocWorkerStack
from tests.service.fakes import verifier_info as fake_info

from .scripted import ScriptedDrafter

D = 5           # draft depth: a full round emits D + 1 tokens
N = 36          # reference length
SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


# ---------------------------------------------------------------------------------------------------
# expected outcome, computed from the reference alone
# ---------------------------------------------------------------------------------------------------
def expected_engine(ref: list[int], max_tokens: int, eos: int | None, stop_ids: set[int], ignore_eos: bool
                    ) -> tuple[list[int], str]:
    """Plain greedy cut at the first EOS / stop id (excluded) or at max_tokens."""
    out: list[int] = []
    for tok in ref:
        if (tok == eos and not ignore_eos) or tok in stop_ids:
            return out, "stop"
        out.append(tok)
        if len(out) == max_tokens:
            return out, "length"
    raise AssertionError("reference too short for this case")


def expected_stop_id(ref: list[int], ids: list[int], finish: str, eos: int | None, ignore_eos: bool) -> int | None:
    """The ``stop_reason`` a request cut by the engine reports: its terminator when that is a stop id
    and not an EOS the request stops on; None for EOS or ``length``."""
    if finish != "stop":
        return None
    tok = ref[len(ids)]
    return None if tok == eos and not ignore_eos else tok


def expected_rounds(n_emitted: int, accepts: list[int], finish: str) -> list[tuple[int, int]]:
    """``(tokens emitted, accept_length)`` of each speculative round after the prefill token.

    Round k covers ``accepts[k] + 1`` reference positions (accepted drafts + bonus); rounds run until
    one covers the cut: the terminator's position ("stop"; that round may emit nothing) or the last
    emitted token ("length").
    """
    if n_emitted == 0:
        return []  # the prefill token itself was a terminator
    rounds, pos, k = [], 1, 0
    end = n_emitted + 1 if finish == "stop" else n_emitted
    while pos < end:
        a = min(accepts[k] if k < len(accepts) else D, D)
        emit = min(a + 1, n_emitted - pos)
        rounds.append((emit, min(a, emit)))
        pos, k = pos + a + 1, k + 1
    return rounds


# ---------------------------------------------------------------------------------------------------
# engine level
# ---------------------------------------------------------------------------------------------------
V = 128


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", vocab_size=V, hidden_size=32, num_layers=2, max_position_embeddings=256,
                       eos_token_id=None)


def reference_logprobs(model, prompt: list[int], ref: list[int], k: int = 3) -> tuple[list[float], list[list[int]]]:
    """The target's logprob of each ``ref`` token and its top-k ids, from one causal forward."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + ref]), use_cache=False).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    return lp.gather(1, torch.tensor(ref)[:, None])[:, 0].tolist(), lp.topk(k, dim=-1).indices.tolist()


@pytest.fixture(scope="module")
def cases(target):
    """Three prompts and their greedy references (EOS ignored)."""
    out = []
    for seed in range(3):
        rng = random.Random(seed)
        prompt = [rng.randrange(3, V) for _ in range(5 + seed)]
        out.append((prompt, greedy_reference(target.model, prompt, N)))
    return out


@pytest.fixture(scope="module")
def case_logprobs(target, cases):
    return [reference_logprobs(target.model, prompt, ref) for prompt, ref in cases]


terminators = st.fixed_dictionaries({
    "case": st.integers(0, 2),
    "accepts": st.lists(st.integers(0, D), max_size=12),
    "max_tokens": st.integers(1, N - 2),
    "eos_at": st.none() | st.integers(0, N - 2),
    "stop_at": st.lists(st.integers(0, N - 2), max_size=2),
    "ignore_eos": st.booleans(),
    "method": st.sampled_from(["dartree-pruned", "ddtree", "dflash"]),
    "logprobs": st.sampled_from([None, 0, 3]),
})


@settings(max_examples=200, **SETTINGS)
@given(t=terminators)
def test_engine_commits_token_by_token_for_any_acceptance_pattern(target, cases, case_logprobs, t):
    prompt, ref = cases[t["case"]]
    eos = ref[t["eos_at"]] if t["eos_at"] is not None else None
    stop_ids = {ref[i] for i in t["stop_at"]}
    want, want_finish = expected_engine(ref, t["max_tokens"], eos, stop_ids, t["ignore_eos"])

    drafter = ScriptedDrafter({"r": prompt + ref}, t["accepts"], depth=D, vocab_size=V, seed=len(t["accepts"]),
                              bait=next(iter(stop_ids), None))
    engine = SpecEngine(target, drafter, max_draft_depth=D)
    engine.eos_token_ids = (eos,) if eos is not None else ()  # as if the target's config named this EOS
    sampling = SamplingParams(max_tokens=t["max_tokens"], stop_token_ids=tuple(stop_ids), ignore_eos=t["ignore_eos"],
                              logprobs=t["logprobs"])
    outs = list(engine.generate("r", prompt, sampling, SpecParams(t["method"])))

    got = [tok for o in outs for tok in o.token_ids]
    assert got == want
    if t["logprobs"] is None:
        assert all(o.logprobs is None for o in outs)
    else:  # one row per emitted token in every round, the target's own (cut with the tokens, B03/B04/B19)
        assert all(len(o.logprobs.logprobs) == len(o.logprobs.top_ids) == len(o.token_ids) for o in outs)
        ref_lp, ref_top = case_logprobs[t["case"]]
        got_lp = [x for o in outs for x in o.logprobs.logprobs]
        assert got_lp == pytest.approx(ref_lp[:len(got)], abs=1e-4)
        assert [r for o in outs for r in o.logprobs.top_ids] == [r[:t["logprobs"]] for r in ref_top[:len(got)]]
    assert outs[-1].finish_reason == want_finish and all(o.finish_reason is None for o in outs[:-1])
    assert outs[0].is_prefill and not any(o.is_prefill for o in outs[1:])
    # every round: the scripted number of accepted drafts, cut by the terminator / length
    per_round = [(len(o.token_ids), o.accept_length) for o in outs[1:]]
    assert per_round == expected_rounds(len(want), t["accepts"], want_finish)
    assert all(o.accepted_per_depth == [1] * o.accept_length for o in outs[1:])
    # the verifier's metrics count exactly the emitted tokens (B04/B06)
    metrics = VerifierMetrics()
    for o in outs[1:]:
        metrics.observe_round(t["method"], o.num_draft_tokens, o.accept_length, list(o.accepted_per_depth),
                              len(o.token_ids), dict(o.timings))
    r = metrics.registry
    label = {"method": t["method"]}
    value = lambda name, **kw: r.get_sample_value(name, {**label, **kw}) or 0.0  # noqa: E731
    assert value("dartree_spec_acceptance_length_sum") == len(got) - len(outs[0].token_ids)
    assert value("dartree_spec_rounds_total") == len(outs) - 1
    assert value("dartree_spec_accepted_tokens_total") == sum(o.accept_length for o in outs[1:])
    for depth in range(1, D + 1):
        hits = sum(o.accept_length >= depth for o in outs[1:])
        assert value("dartree_spec_accepted_tokens_per_depth_total", depth=str(depth)) == hits
    assert engine.num_active() == 0 and drafter.num_contexts() == 0


# ---------------------------------------------------------------------------------------------------
# through the gateway text layer: HTTP (ASGI) -> in-process verifier worker -> SpecEngine
# ---------------------------------------------------------------------------------------------------
class TextStack(InprocWorkerStack):
    """The gateway app over an :class:`InprocEngineClient` and a verifier worker thread running a real
    ``SpecEngine`` (tiny float32 target sized to the tokenizer) with a :class:`ScriptedDrafter`."""

    def __init__(self, model_dir):
        text = TextModel(model_dir)
        vocab = text.vocab_size
        self.target = tiny_target("llama", vocab_size=vocab, hidden_size=32, num_layers=2,
                                  max_position_embeddings=256, eos_token_id=None, seed=3)
        self.drafter = ScriptedDrafter({}, [], depth=D, vocab_size=vocab, seed=1)
        super().__init__(model_dir, text, SpecEngine(self.target, self.drafter, max_draft_depth=D), fake_info(vocab))
        rng = random.Random(7)
        self.cases, self.logprobs = [], []
        for n in (3, 8):
            prompt = [rng.randrange(3, vocab) for _ in range(n)]
            self.cases.append((prompt, greedy_reference(self.target.model, prompt, N)))
            self.logprobs.append(reference_logprobs(self.target.model, prompt, self.cases[-1][1])[0])

    def metric(self, name: str) -> float:
        return sum(s.value for m in self.worker.metrics.registry.collect() for s in m.samples if s.name == name)


@pytest.fixture(scope="module", params=["bytelevel", "bytefallback"])
def stack(request, tmp_path_factory):
    from tests.service.fakes import bytefallback_model_dir, bytelevel_model_dir

    make = bytelevel_model_dir if request.param == "bytelevel" else bytefallback_model_dir
    s = TextStack(make(tmp_path_factory.mktemp(request.param)))
    yield s
    s.close()


def _sse(body: str) -> list[dict]:
    assert body.endswith("data: [DONE]\n\n"), body[-300:]
    events = [line[6:] for line in body.split("\n\n") if line.startswith("data: ")]
    return [json.loads(e) for e in events[:-1]]


def _tail(text: TextModel, prompt: list[int]) -> list[int]:
    tail = list(prompt[-PROMPT_CONTEXT_TOKENS:])
    return [] if text.decode(tail).endswith("\ufffd") else tail


def prefix_stable(text: TextModel, prompt: list[int], ids: list[int]) -> bool:
    """Whether decoding more tokens never rewrites complete characters already decoded.

    Byte-level BPE always is; HF's ByteFallback decoder is not: ``<0x4A><0x4A>`` decodes to "JJ" but
    ``<0x4A><0x4A><0xD1>`` to three U+FFFD (an invalid byte group is replaced byte by byte), so an
    incremental detokenizer (ours, vLLM's) legitimately emits "JJ" and the brute-force reference
    below is not defined for such outputs.
    """
    tail = _tail(text, prompt)
    texts = [text.decode(tail + ids[:k]) for k in range(len(ids) + 1)]
    return all(b.startswith(a.rstrip("\ufffd")) for a, b in zip(texts, texts[1:]))


def text_reference(text: TextModel, prompt: list[int], ids: list[int], stops: list[str]) -> tuple[str, int, str | None]:
    """(text, tokens kept, matched stop) by brute force: decode every prefix, cut at the first stop string."""
    tail = _tail(text, prompt)
    base = text.decode(tail)

    def text_of(k: int) -> str:
        return text.decode(tail + ids[:k])[len(base):]

    for k in range(1, len(ids) + 1):
        t = text_of(k)
        hits = sorted((t.find(s), i) for i, s in enumerate(stops) if s in t)
        if hits:
            idx, i = hits[0]
            return t[:idx], k, stops[i]
    return text_of(len(ids)), len(ids), None


@settings(max_examples=80, **SETTINGS)
@given(data=st.data())
def test_gateway_text_usage_and_finish_agree_with_plain_decoding(stack, data):
    t = data.draw(terminators)
    prompt, ref = stack.cases[t["case"] % len(stack.cases)]
    eos = ref[t["eos_at"]] if t["eos_at"] is not None else None
    stop_ids = sorted({ref[i] for i in t["stop_at"]})
    ids, engine_finish = expected_engine(ref, t["max_tokens"], eos, set(stop_ids), t["ignore_eos"])
    stop_id = expected_stop_id(ref, ids, engine_finish, eos, t["ignore_eos"])
    full, _, _ = text_reference(stack.text, prompt, ids, [])
    pieces = [c for c in full.split("\ufffd") if c]
    stops = []
    for _ in range(data.draw(st.integers(0, 2))):  # stop strings cut from the text itself (multibyte included)
        if not pieces:
            break
        piece = data.draw(st.sampled_from(pieces))
        a = data.draw(st.integers(0, len(piece) - 1))
        stops.append(piece[a:a + data.draw(st.integers(1, 3))])
    stops = list(dict.fromkeys(stops))
    want_text, kept, matched = text_reference(stack.text, prompt, ids, stops)
    want_ids = ids[:kept]
    want_finish = "stop" if matched is not None else engine_finish

    stack.engine.eos_token_ids = (eos,) if eos is not None else ()
    stack.drafter.set_script(t["accepts"], prompt + ref, bait=stop_ids[0] if stop_ids else None)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": t["max_tokens"], "stop": stops or None,
            "stop_token_ids": stop_ids, "ignore_eos": t["ignore_eos"], "return_token_ids": True,
            "speculative": {"method": t["method"]}, "logprobs": t["logprobs"]}
    before = stack.metric("dartree_spec_acceptance_length_sum")

    async def go():
        await stack.client.start()
        transport = httpx.ASGITransport(app=stack.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=30) as c:
            plain = await c.post("/v1/completions", json=body)
            after_plain = stack.metric("dartree_spec_acceptance_length_sum")
            streamed = await c.post("/v1/completions", json={**body, "stream": True,
                                                             "stream_options": {"include_usage": True}})
        return plain, after_plain, streamed

    plain, after_plain, streamed = asyncio.run(go())
    assert plain.status_code == 200, plain.text
    choice = plain.json()["choices"][0]
    if prefix_stable(stack.text, prompt, ids):
        assert choice["text"] == want_text
        assert choice["token_ids"] == want_ids
    else:  # only the decoder quirk differs: same tokens unless a stop string is involved
        want_text, want_ids = choice["text"], choice["token_ids"]
        matched = choice["stop_reason"] if isinstance(choice["stop_reason"], str) else None
        assert matched is not None or want_ids == ids
        want_finish = "stop" if matched is not None else engine_finish
    assert plain.json()["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": len(want_ids),
                                     "total_tokens": len(prompt) + len(want_ids)}
    lp = choice["logprobs"]
    if t["logprobs"] is None:
        assert lp is None
    else:  # one entry per counted token: the target's logprob of that very token
        assert len(lp["tokens"]) == len(lp["text_offset"]) == len(lp["top_logprobs"]) == len(want_ids)
        assert lp["tokens"] == [stack.text.token_text(i) for i in want_ids]
        assert lp["token_logprobs"] == pytest.approx(stack.logprobs[t["case"] % len(stack.cases)][:len(want_ids)],
                                                     abs=1e-4)
        assert all(len(top) <= t["logprobs"] + 1 for top in lp["top_logprobs"])
    want_reason = matched if matched is not None else stop_id  # a stop string, else the stop id, else null
    assert choice["finish_reason"] == want_finish and choice["stop_reason"] == want_reason
    if matched is None:  # nothing cut by the gateway: the verifier's tau histogram counts exactly these tokens
        assert after_plain - before == max(len(want_ids) - 1, 0)

    events = _sse(streamed.text)
    chunks, usage = events[:-1], events[-1]
    assert usage["choices"] == [] and usage["usage"] == plain.json()["usage"]
    assert "".join(e["choices"][0]["text"] for e in chunks) == want_text
    assert [i for e in chunks for i in e["choices"][0]["token_ids"]] == want_ids
    if t["logprobs"] is not None:
        # streamed logprobs == non-streamed, each with its chunk's tokens; values up to float noise, because the
        # scripted drafter draws other wrong siblings in the second run, so the verify trees differ
        streamed_lp = {key: [x for e in chunks for x in e["choices"][0]["logprobs"][key]] for key in lp}
        assert streamed_lp["tokens"] == lp["tokens"] and streamed_lp["text_offset"] == lp["text_offset"]
        assert streamed_lp["token_logprobs"] == pytest.approx(lp["token_logprobs"], abs=1e-4)
        assert [list(d) for d in streamed_lp["top_logprobs"]] == [list(d) for d in lp["top_logprobs"]]
        assert all(len(e["choices"][0]["logprobs"]["tokens"]) == len(e["choices"][0]["token_ids"]) for e in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == want_finish
    assert chunks[-1]["choices"][0]["stop_reason"] == want_reason
    assert all(e["choices"][0]["finish_reason"] is None for e in chunks[:-1])
    for _ in range(200):  # the verifier frees the request at the next round boundary after a stop-string abort
        if stack.engine.num_active() == 0 and stack.drafter.num_contexts() == 0:
            break
        threading.Event().wait(0.01)
    assert stack.engine.num_active() == 0 and stack.drafter.num_contexts() == 0


# ---------------------------------------------------------------------------------------------------
# real multibyte text (CJK, 4-byte emoji, byte-fallback pieces) in random round splits, over HTTP
# ---------------------------------------------------------------------------------------------------
MULTIBYTE = ["你好，世界！这是一个测试。", "Emoji 😀🎉 party 🧪 time", "mixed 日本語 and ascii 🎉!",
             "Hello world, 你好世界 😀 done.", "STOP here. END of text"]


@pytest.fixture(scope="module", params=["bytelevel", "bytefallback"])
def harness(request, tmp_path_factory):
    from tests.service.conftest import GatewayHarness
    from tests.service.fakes import bytefallback_model_dir, bytelevel_model_dir

    make = bytelevel_model_dir if request.param == "bytelevel" else bytefallback_model_dir
    return GatewayHarness(make(tmp_path_factory.mktemp("mb-" + request.param)))


@settings(max_examples=40, **SETTINGS)
@given(data=st.data(), text=st.sampled_from(MULTIBYTE), sizes=st.lists(st.integers(1, 7), min_size=1, max_size=4),
       max_tokens=st.integers(1, 40))
def test_multibyte_stream_equals_non_stream_with_stops_and_length(harness, data, text, sizes, max_tokens):
    from tests.service.fakes import Script

    h = harness
    ids = h.text.encode(text, add_special_tokens=False)
    prompt = h.text.encode("Say:", add_special_tokens=False)
    engine_ids = ids[:max_tokens]
    engine_finish = "length" if len(ids) >= max_tokens else "stop"
    stops = list(dict.fromkeys(data.draw(st.lists(st.sampled_from(
        [text[i:i + n] for n in (1, 2, 3) for i in range(len(text) - n + 1) if text[i:i + n].strip()]),
        max_size=2))))
    want_text, kept, matched = text_reference(h.text, prompt, engine_ids, stops)
    h.script = lambda gen: Script(ids, round_sizes=sizes)

    async def go():
        body = {"prompt": prompt, "max_tokens": max_tokens, "stop": stops or None, "return_token_ids": True}
        plain = await h.complete(**body)
        streamed = await h.complete(**body, stream=True, stream_options={"include_usage": True})
        return plain.json(), streamed

    plain, streamed = asyncio.run(go())
    choice = plain["choices"][0]
    assert choice["text"] == want_text and choice["token_ids"] == engine_ids[:kept]
    assert plain["usage"]["completion_tokens"] == kept
    assert choice["finish_reason"] == ("stop" if matched else engine_finish) and choice["stop_reason"] == matched
    events = _sse(streamed.text)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]).encode() == want_text.encode()
    assert [i for e in events[:-1] for i in e["choices"][0]["token_ids"]] == choice["token_ids"]
    assert events[-1]["usage"] == plain["usage"]
    assert events[-2]["choices"][0]["finish_reason"] == choice["finish_reason"]
    assert all("\ufffd" not in e["choices"][0]["text"] for e in events[:-2])  # only a cut at the end leaves one
    assert h.gateway.in_flight == 0

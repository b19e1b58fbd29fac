"""Incremental detokenization and stop strings over multi-token rounds (property-based)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.text import PROMPT_CONTEXT_TOKENS, CompletionText, IncrementalDetokenizer, TemplateError, TextModel

TEXTS = ["Hello world, this is a test.", "你好，世界！这是一个测试。", "Emoji 😀🎉 party 🧪 time",
         "mixed 日本語 and ascii 🎉!", "a", "STOP here. END of text"]


@pytest.fixture(scope="module", params=["bytelevel", "bytefallback"])
def text_model(request, bytelevel_dir, bytefallback_dir):
    return TextModel(bytelevel_dir if request.param == "bytelevel" else bytefallback_dir)


def _reference(model: TextModel, prompt_ids, ids, stops):
    """(text, number of tokens) by brute force: decode every prefix, cut at the first stop string."""
    tail = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
    base = model.decode(tail)

    def text_of(k):
        return model.decode(tail + list(ids[:k]))[len(base):]

    for k in range(1, len(ids) + 1):
        t = text_of(k)
        hits = [t.find(s) for s in stops if s in t]
        if hits:
            return t[:min(hits)], k
    return text_of(len(ids)), len(ids)


def _split(ids, sizes):
    out, i, k = [], 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)]
        out.append(ids[i:i + n])
        i, k = i + n, k + 1
    return out


def _run(model, prompt_ids, rounds, stops):
    ct = CompletionText(model, prompt_ids, stops)
    parts, kept = [], []
    for r in rounds:
        d = ct.feed(r)
        parts.append(d.text)
        kept += d.token_ids
        if ct.stopped:
            break
    parts.append(ct.finish())
    return "".join(parts), kept, ct


@pytest.mark.parametrize("text", TEXTS)
def test_detokenizer_never_emits_partial_characters(text_model, text):
    ids = text_model.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(text_model)
    deltas = [detok.push(i) for i in ids] + [detok.flush()]
    assert "".join(deltas) == text_model.decode(ids)
    assert all("\ufffd" not in d for d in deltas)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.sampled_from(TEXTS), sizes=st.lists(st.integers(1, 6), min_size=1, max_size=5),
       stops=st.lists(st.sampled_from(["STOP", "界", "😀", " t", "is a", "zz", "。", "n"]), max_size=3))
def test_stop_strings_cut_text_ids_and_usage_at_the_same_place(text_model, text, sizes, stops):
    prompt = text_model.encode("Say: ", add_special_tokens=False)
    ids = text_model.encode(text, add_special_tokens=False)
    got_text, kept, ct = _run(text_model, prompt, _split(ids, sizes), stops)
    ref_text, ref_n = _reference(text_model, prompt, ids, stops)
    assert got_text == ref_text
    assert kept == ids[:ref_n] and ct.num_tokens == ref_n


def test_partial_stop_prefix_is_held_then_released(bytelevel_dir):
    model = TextModel(bytelevel_dir)
    ct = CompletionText(model, [], ["END!"])
    out = [ct.feed(model.encode("text EN", add_special_tokens=False)).text]
    assert not out[0].endswith("EN")  # "EN" could start "END!": held back
    out.append(ct.feed(model.encode("D.", add_special_tokens=False)).text)
    out.append(ct.finish())
    assert "".join(out) == "text END." and ct.stopped is None


def test_round_after_a_stop_is_ignored(bytelevel_dir):
    model = TextModel(bytelevel_dir)
    ct = CompletionText(model, [], ["world"])
    d = ct.feed(model.encode("Hello world and more", add_special_tokens=False))
    assert d.text == "Hello " and ct.stopped == "world"
    assert ct.feed([5, 6]).token_ids == [] and ct.finish() == ""


def test_chat_template_renders_and_encodes(bytelevel_dir):
    model = TextModel(bytelevel_dir)
    text = model.render_chat([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = model.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == 1 and 2 in ids  # special tokens map to their ids


def test_template_errors_are_template_errors(tmp_path, bytelevel_dir):
    model = TextModel(bytelevel_dir)
    model.chat_template = "{{ raise_exception('no system role') }}"
    model._compiled = None
    with pytest.raises(TemplateError, match="no system role"):
        model.render_chat([{"role": "system", "content": "x"}])
    model.chat_template = None
    with pytest.raises(TemplateError, match="no chat template"):
        model.render_chat([{"role": "user", "content": "x"}])


def test_smollm2_tokenizer_if_present():
    from pathlib import Path

    from services.models.registry import DEFAULT_TARGET, cache_root

    path = cache_root() / DEFAULT_TARGET
    if not (path / "tokenizer.json").is_file():
        pytest.skip("SmolLM2 not converted on this machine")
    model = TextModel(Path(path))
    assert model.eos_token_id == 2 and model.tokenizer_hash
    ids = model.encode_chat([{"role": "user", "content": "你好 😀"}])
    gen = model.encode("你好 😀 world", add_special_tokens=False)
    got, _, _ = _run(model, ids, _split(gen, [2, 1, 3]), [])
    assert got == _reference(model, ids, gen, [])[0] == "你好 😀 world"

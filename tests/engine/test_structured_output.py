"""Grammar-constrained output (JSON schemas) under tree speculation == plain decoding.

(a) the per-row masks of a tree equal a fresh matcher fed each row's root-to-node path; (b) for
every method and drafter, speculative output equals plain (``ar``) decoding with the same grammar,
token for token, solo and in a mixed batch, and parses and validates against its schema; (c) a
draft node the grammar forbids is never accepted, even when the unconstrained target would.
"""

from __future__ import annotations

import json

import jsonschema
import llguidance as llg
import pytest
import torch

from services.testing import greedy_reference, tiny_drafter, tiny_service
from services.tree import derive_buffers
from services.tree.draft_tree import tree_from_parents
from gateway.tools import grammar_error, json_schema_grammar
from services.tree.grammar import GrammarState, unpack_bitmask
from services.verifier.drafter_client import InprocDrafterClient
from services.params import SamplingParams, SpecParams
from services.verifier.engine import EngineConfig, SpecEngine

from tests.doubles import FullTreeDrafter, OracleDrafter, ScriptedDrafterClient
from tests.engine.conftest import TARGET_KW, V  # noqa: F401  (fixtures: target, llama)
from tests.engine.test_batched import _run_batched
from tests.engine.test_logit_processors import _prompt

EOS = 2
N = 48
# A 128-token vocabulary: 3 specials, the 95 printable ASCII characters, 30 multi-byte pieces.
PIECES = [b"<|endoftext|>", b"<|im_start|>", b"<|im_end|>"] + [bytes([c]) for c in range(32, 127)] + [
    s.encode() for s in ['{"', '":', '",', '"}', "true", "false", "null", "red", "green", "blue", "color",
                         "name", "ok", '{"color":"', '","ok":', "ab", "cd", "ef", "10", "42", "ra", "en", "ue",
                         "ls", "al", "or", "co", "am", "na", "e}"]]
assert len(PIECES) == V and len(set(PIECES)) == V


class _Pieces:
    """The vocabulary as an llguidance ``TokenizerWrapper`` source: greedy longest-match encoding."""

    def __init__(self):
        self.tokens, self.eos_token_id, self.bos_token_id, self.special_token_ids = PIECES, EOS, None, [0, 1, 2]
        self.ids = {p: i for i, p in enumerate(PIECES) if i > 2}

    def __call__(self, text):
        data, out, i = text if isinstance(text, bytes) else text.encode(), [], 0
        while i < len(data):
            n = next(n for n in range(min(11, len(data) - i), 0, -1) if data[i:i + n] in self.ids)
            out.append(self.ids[data[i:i + n]])
            i += n
        return out


TOK = llg.LLTokenizer(llg.TokenizerWrapper(_Pieces()), n_vocab=V, eos_token=EOS, slices=[])

SCHEMAS = {
    "enum+bool": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                                   "ok": {"type": "boolean"}},
                  "required": ["color", "ok"], "additionalProperties": False},
    "string+int": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4},
                                                    "n": {"type": "integer", "minimum": 0, "maximum": 99}},
                   "required": ["name", "n"], "additionalProperties": False},
}


def _text(ids: list[int]) -> str:
    return b"".join(PIECES[t] for t in ids).decode()


def _sampling(schema, **kw):
    return SamplingParams(max_tokens=N, grammar=json_schema_grammar(schema, "compact"), **kw)


def _ar(target, prompt, sampling):
    engine = SpecEngine(target, None, grammar_tokenizer=TOK)
    outs = list(engine.generate("r", prompt, sampling, SpecParams("ar")))
    return [t for o in outs for t in o.token_ids], outs[-1].finish_reason


def _spec(engine, prompt, sampling, method):
    outs = list(engine.generate("r", prompt, sampling, SpecParams(method)))
    return [t for o in outs for t in o.token_ids], outs


@pytest.fixture(scope="module")
def service(llama):
    return tiny_service(llama, tiny_drafter(llama, seed=3, block_size=6))


def _engines(llama, service, prompt, ref):
    """(name, engine, method) for every drafter under test (test_logit_processors.py's set)."""
    yield "oracle", SpecEngine(llama, OracleDrafter({"r": prompt + ref}, depth=4, distractors=2, vocab_size=V,
                                                    seed=3, truth_prob=0.8), max_draft_depth=4,
                               grammar_tokenizer=TOK), "dartree-pruned"
    for method in ("dartree-pruned", "ddtree", "domino"):
        yield method, SpecEngine(llama, InprocDrafterClient(service), max_draft_depth=6, grammar_tokenizer=TOK), method
    yield "full tree", SpecEngine(llama, FullTreeDrafter(V, depth=1), max_draft_depth=1,
                                  grammar_tokenizer=TOK), "dartree-pruned"


def _check_json(ids, schema):
    obj = json.loads(_text(ids))
    jsonschema.validate(obj, schema)
    return obj


# ---------------------------------------------------------------------------------------------
# masks along tree paths
# ---------------------------------------------------------------------------------------------
def _fresh_mask(grammar: str, path: list[int]) -> torch.Tensor:
    m = llg.LLMatcher(TOK, grammar, log_level=0)
    assert m.consume_tokens(path)
    bits = torch.zeros((1, (TOK.vocab_size + 31) // 32), dtype=torch.int32)
    m.unsafe_compute_mask_ptr(bits[0].data_ptr(), bits.shape[1] * 4)
    return unpack_bitmask(bits, V)[0]


def test_tree_masks_equal_a_fresh_matcher_per_path():
    grammar = json_schema_grammar(SCHEMAS["enum+bool"], "compact")
    emitted = TOK.tokenize_str('{"color":"')  # the root is the last of these
    state = GrammarState(llg.LLMatcher(TOK, grammar, log_level=0), V, TOK.vocab_size)
    for t in emitted:
        state.advance(t)
    ids = {s: PIECES.index(s.encode()) for s in ("red", "green", '",', '","ok":', "true", "x", "ra")}
    # rows: 1 red, 2 green, 3 x (forbidden), 4 '","ok":' under red, 5 true under 4, 6 ra under x,
    # 7 '",' under green (forbidden: the grammar's mask offers only '","ok":' for the forced bytes)
    tokens = [ids["red"], ids["green"], ids["x"], ids['","ok":'], ids["true"], ids["ra"], ids['",']]
    parents = [-1, -1, -1, 0, 3, 2, 1]
    buffers = derive_buffers(tree_from_parents(tokens, parents), emitted[-1])
    allowed, masked = state.tree_masks(buffers.input_ids, buffers.parent_rows)
    reachable, num_forbidden = [], 0
    for i in range(buffers.input_ids.numel()):
        path = buffers.input_ids[buffers.tree_mask[i]].tolist()[1:]
        prefix_ok = all(_fresh_mask(grammar, emitted + path[:k])[path[k]] for k in range(len(path) - 1))
        ok = prefix_ok and (not path or bool(_fresh_mask(grammar, emitted + path[:-1])[path[-1]]))
        num_forbidden += prefix_ok and not ok
        reachable.append(ok)
        if ok:
            assert torch.equal(allowed[i], _fresh_mask(grammar, emitted + path)), i
        else:
            assert allowed[i].all(), i  # unreachable rows are left unmasked
    assert masked == num_forbidden == 2 and sum(reachable) == 5  # "ra" below "x" is not counted
    assert not allowed[0, ids["x"]] and allowed[0, ids["red"]]
    assert state.matcher.consume_tokens(TOK.tokenize_str('red","ok":true}'))  # the walk left the state as it was


def test_invalid_grammar_is_refused_without_holding_a_slot(llama):
    bad = json_schema_grammar({"type": "objectx"})
    assert grammar_error(bad)
    engine = SpecEngine(llama, None, grammar_tokenizer=TOK)
    free = engine.num_free_slots()
    with pytest.raises(ValueError, match="grammar"):
        engine.add_request("r", [3, 4], SamplingParams(grammar=bad), SpecParams("ar"))
    assert engine.num_free_slots() == free and engine.num_active() == 0


# ---------------------------------------------------------------------------------------------
# speculative == plain with a grammar
# ---------------------------------------------------------------------------------------------
CASES = {"greedy enum": ("enum+bool", {}), "greedy string": ("string+int", {}),
         "seeded": ("string+int", dict(temperature=0.9, seed=11)),
         "with penalties": ("enum+bool", dict(presence_penalty=1.5, frequency_penalty=0.5))}


@pytest.mark.parametrize("name", list(CASES))
def test_speculative_equals_plain_with_a_grammar(llama, service, name):
    schema_name, kw = CASES[name]
    schema, prompt = SCHEMAS[schema_name], _prompt(5)
    sampling = _sampling(schema, **kw)
    ref, finish = _ar(llama, prompt, sampling)
    assert finish == "stop" and len(ref) < N
    _check_json(ref, schema)
    unconstrained, _ = _ar(llama, prompt, SamplingParams(max_tokens=N, ignore_eos=True, **kw))
    with pytest.raises(ValueError):
        json.loads(_text(unconstrained))  # the random model alone does not write JSON
    for label, engine, method in _engines(llama, service, prompt, ref):
        tokens, outs = _spec(engine, prompt, sampling, method)
        assert tokens == ref, label
        assert outs[-1].finish_reason == "stop", label
        if label in ("oracle", "full tree"):
            assert sum(o.accept_length for o in outs) > 0, label


class GreedyChainDrafter(ScriptedDrafterClient):
    """Drafts the target's own *unconstrained* greedy chain after the current context (what plain
    decoding without a grammar would emit next): every node is accepted without a grammar."""

    def __init__(self, model, depth: int):
        super().__init__()
        self.model, self.depth, self.context = model, depth, {}

    def draft_job(self, job):
        self.check(job)
        ctx = self.context.setdefault(job.request_id, [])
        ctx += job.committed_ids
        chain = greedy_reference(self.model, ctx + [job.root_token], self.depth_cap(job, self.depth))
        return self.record(job, tree_from_parents(chain, list(range(-1, len(chain) - 1))))


def test_a_grammar_forbidden_draft_is_never_accepted(llama):
    """Drafts the target would accept without the grammar; with it, every node the grammar forbids
    is masked and rejected, and the output is still plain decoding's."""
    prompt, schema = _prompt(8), SCHEMAS["enum+bool"]
    free, _ = _ar(llama, prompt, SamplingParams(max_tokens=N, ignore_eos=True))
    plain = SpecEngine(llama, GreedyChainDrafter(llama.model, 4), max_draft_depth=4)
    tokens, outs = _spec(plain, prompt, SamplingParams(max_tokens=N, ignore_eos=True), "dartree-pruned")
    assert tokens == free and all(o.accept_length == o.num_draft_tokens for o in outs[1:-1])  # all accepted
    ref, _ = _ar(llama, prompt, _sampling(schema))
    engine = SpecEngine(llama, GreedyChainDrafter(llama.model, 4), max_draft_depth=4, grammar_tokenizer=TOK)
    tokens, outs = _spec(engine, prompt, _sampling(schema), "dartree-pruned")
    assert tokens == ref
    _check_json(tokens, schema)
    assert sum(o.grammar_masked for o in outs) >= len(outs) // 2  # a forbidden node in most rounds
    for o in outs:
        assert o.accept_length <= o.num_draft_tokens - o.grammar_masked


def test_logit_bias_cannot_lift_the_grammar_mask(llama):
    prompt, schema = _prompt(9), SCHEMAS["enum+bool"]
    x = PIECES.index(b"x")
    ref, finish = _ar(llama, prompt, _sampling(schema, logit_bias={x: 100.0}))
    assert finish == "stop" and x not in ref
    _check_json(ref, schema)


def test_mixed_batch_with_grammars_equals_solo_plain(llama, service):
    cases = [("g0", _prompt(20), _sampling(SCHEMAS["enum+bool"]), "dartree-pruned"),
             ("g1", _prompt(21), _sampling(SCHEMAS["string+int"], temperature=0.8, seed=3), "ddtree"),
             ("g2", _prompt(22), _sampling(SCHEMAS["string+int"], repetition_penalty=1.3), "ar"),
             ("plain", _prompt(23), SamplingParams(max_tokens=N, ignore_eos=True), "domino"),
             ("bias", _prompt(24), SamplingParams(max_tokens=N, ignore_eos=True, logit_bias={11: 100.0}),
              "dartree-pruned")]
    refs = {rid: _ar(llama, prompt, s)[0] for rid, prompt, s, _ in cases}
    engine = SpecEngine(llama, InprocDrafterClient(service), EngineConfig(max_running=8), max_draft_depth=6,
                        grammar_tokenizer=TOK)
    tokens, _ = _run_batched(engine, {0: [(rid, prompt, s, SpecParams(method)) for rid, prompt, s, method in cases]})
    assert tokens == refs
    _check_json(tokens["g0"], SCHEMAS["enum+bool"])
    _check_json(tokens["g1"], SCHEMAS["string+int"])
    _check_json(tokens["g2"], SCHEMAS["string+int"])


def test_the_grammar_ends_the_request_even_with_ignore_eos(llama):
    """The grammar's last token ends the request (EOS is the only token left), ``ignore_eos`` or not,
    and a fully accepting tree emits no token past it."""
    prompt, schema = _prompt(10), SCHEMAS["enum+bool"]
    ref, finish = _ar(llama, prompt, _sampling(schema))
    assert finish == "stop"
    assert _ar(llama, prompt, _sampling(schema, ignore_eos=True)) == (ref, "stop")
    engine = SpecEngine(llama, FullTreeDrafter(V, depth=1), max_draft_depth=1, grammar_tokenizer=TOK)
    tokens, outs = _spec(engine, prompt, _sampling(schema, ignore_eos=True), "dartree-pruned")
    assert tokens == ref and outs[-1].finish_reason == "stop"
    _check_json(tokens, schema)


def test_a_grammar_that_completes_before_min_tokens_ends_the_request(llama, service):
    """Grammar completion wins over ``min_tokens``: the JSON ends the request with "stop" before
    ``min_tokens``, for every method; a stop token id that the grammar needs as its last token is
    still sampled there (nothing else is allowed) and ends the request."""
    prompt, schema = _prompt(11), SCHEMAS["enum+bool"]
    ref, finish = _ar(llama, prompt, _sampling(schema))
    assert finish == "stop" and len(ref) < N - 1
    sampling = _sampling(schema, min_tokens=N - 1)
    assert _ar(llama, prompt, sampling) == (ref, "stop")
    for label, engine, method in _engines(llama, service, prompt, ref):
        tokens, outs = _spec(engine, prompt, sampling, method)
        assert (tokens, outs[-1].finish_reason) == (ref, "stop"), label
    closing = PIECES.index(b"}")
    assert _text(ref).endswith("}")
    tokens, finish = _ar(llama, prompt, _sampling(schema, min_tokens=N - 1, stop_token_ids=(closing,)))
    assert finish == "stop" and _text(tokens + [closing]) == _text(ref)

"""Batched steps (engine v2): a request's tokens never depend on who else is in the step.

Oracles: the same request run alone (its own engine, one request per step), a fresh prefill of the
committed tokens for every KV slot, and the HF reference verify for the runner.
"""

from __future__ import annotations

import random

import pytest
import torch

from services.drafter.service import DFLASH_METHODS as METHODS  # the Domino drafter's methods
from services.drafter.service import DrafterService
from services.testing import random_tree, tiny_drafter, tiny_service, tiny_target
from services.tree import derive_buffers
from services.tree.batch import Segment, causal_segment, pack_segments, split_rows
from services.verifier.drafter_client import InprocDrafterClient, _BatchHandle
from services.params import SamplingParams, SpecParams
from services.verifier.engine import EngineConfig, SpecEngine
from services.verifier.runner import ModelRunner
from services.weights import int4_kernel_available
from tests.engine.conftest import TARGET_KW, V
from tests.engine.test_kv_compaction import assert_slot_equals_fresh_prefill


@pytest.fixture(scope="module")
def service(target):
    return tiny_service(target, tiny_drafter(target, seed=3, block_size=6))


def _engine(target, service, **cfg):
    return SpecEngine(target, InprocDrafterClient(service), EngineConfig(**cfg), max_draft_depth=5)


def _solo(target, service, prompt, sampling, spec):
    engine = _engine(target, service, max_running=1)
    return [t for out in engine.generate("solo", prompt, sampling, spec) for t in out.token_ids]


def _run_batched(engine, arrivals, max_steps=500):
    """Step every active request together; ``arrivals[k]`` = requests added before step ``k``.

    Returns ``{rid: tokens}`` and the number of requests in each step."""
    tokens: dict[str, list[int]] = {}
    active: list[str] = []
    sizes = []
    for k in range(max_steps):
        for rid, prompt, sampling, spec in arrivals.get(k, []):
            engine.add_request(rid, prompt, sampling, spec)
            tokens[rid] = []
            active.append(rid)
        if not active and k > max(arrivals):
            return tokens, sizes
        if not active:
            continue
        res = engine.step_batch(list(active))
        sizes.append(len(res))
        for rid, out in res.items():
            assert not isinstance(out, BaseException), out
            if out is None:
                continue
            tokens[rid] += out.token_ids
            if out.finish_reason is not None:
                active.remove(rid)
    raise AssertionError("requests did not finish")


def _mixed_requests(seed: int, n: int, methods=METHODS):
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(3, V - 1) for _ in range(rng.randrange(2, 30))]
        method = methods[i % len(methods)]
        spec = SpecParams(method, budget=rng.choice([None, 3, 9]), width=rng.choice([None, 2, 4]))
        sampling = SamplingParams(max_tokens=rng.randrange(4, 24), ignore_eos=bool(i % 2))
        reqs.append((f"r{i}", prompt, sampling, spec))
    return reqs


@pytest.mark.parametrize("seed,n", [(0, 1), (1, 3), (2, 8)])
def test_batched_equals_solo_greedy(target, service, seed, n):
    """1-8 requests of different lengths, methods and knobs share steps (arriving at different
    steps, finishing at different steps, prompts prefilled in 4-token chunks): every request's
    tokens equal running it alone, at T = 0 in float32."""
    reqs = _mixed_requests(seed, n)
    arrivals: dict[int, list] = {}
    for i, r in enumerate(reqs):
        arrivals.setdefault(2 * (i % 3), []).append(r)
    engine = _engine(target, service, max_running=8, prefill_chunk=4, max_step_tokens=64)
    got, sizes = _run_batched(engine, arrivals)
    for rid, prompt, sampling, spec in reqs:
        assert got[rid] == _solo(target, service, prompt, sampling, spec), (rid, spec.method)
    assert n == 1 or max(sizes) >= 2  # requests really shared steps
    assert engine.num_active() == 0 and engine.num_free_slots() == 8 and service.num_contexts() == 0


@pytest.mark.skipif(not int4_kernel_available(), reason="torch has no int4 CPU kernel")
def test_batched_equals_solo_with_the_dense_catch_up(target):
    """An int4 drafter whose catch-up appends (prompts, plain rounds) go through its dense context
    copies (``catch_up_rows=4``): batched requests equal their solo runs, and the copies were used."""
    svc = DrafterService(tiny_drafter(target, seed=3, block_size=6), target.embed_tokens(), target.lm_head(),
                         packed_gemm=False, q4_linears=True, catch_up_rows=4)
    rows = []
    svc.drafter._ctx_dense[0].register_forward_hook(lambda m, args, out: rows.append(args[0].shape[:-1].numel()))
    reqs = _mixed_requests(5, 4, methods=("dartree-pruned", "domino"))
    engine = _engine(target, svc, max_running=4, max_step_tokens=64)
    got, sizes = _run_batched(engine, {0: reqs})
    assert rows and max(sizes) >= 2
    for rid, prompt, sampling, spec in reqs:
        assert got[rid] == _solo(target, svc, prompt, sampling, spec), (rid, spec.method)


def test_stop_token_ids_end_batched_requests_as_solo(target, service):
    """Requests sharing steps, each with a stop id taken from the middle of its own greedy answer:
    each ends exactly where it ends alone, and reports that id as its ``stop_token_id`` (EOS-ended
    or length-ended ones report None)."""
    reqs, want = [], {}
    for i, (rid, prompt, _, spec) in enumerate(_mixed_requests(4, 4)):
        ref = _solo(target, service, prompt, SamplingParams(max_tokens=16, ignore_eos=True), spec)
        cut = next((k for k in range(2, len(ref)) if ref[k] not in ref[:k]), None)
        stop = (ref[cut],) if cut is not None and i % 2 == 0 else (V - 1,) if V - 1 not in ref else ()
        sampling = SamplingParams(max_tokens=16, ignore_eos=True, stop_token_ids=stop)
        want[rid] = (ref[:cut] if cut is not None and i % 2 == 0 else ref,
                     ref[cut] if cut is not None and i % 2 == 0 else None)
        reqs.append((rid, prompt, sampling, spec))
    assert any(w[1] is not None for w in want.values())  # some request really stops on its id
    engine = _engine(target, service, max_running=4, prefill_chunk=4, max_step_tokens=64)
    for rid, prompt, sampling, spec in reqs:
        engine.add_request(rid, prompt, sampling, spec)
    got = {rid: [] for rid in want}
    last = {}
    while engine.num_active():
        for rid, out in engine.step_batch([r for r in want if r not in last]).items():
            assert not isinstance(out, BaseException), out
            if out is None:
                continue
            got[rid] += out.token_ids
            if out.finish_reason is not None:
                last[rid] = out
    for rid, (tokens, stop_id) in want.items():
        assert got[rid] == tokens, rid
        assert last[rid].stop_token_id == stop_id, rid
        assert last[rid].finish_reason == ("stop" if stop_id is not None else "length"), rid


def test_chunked_prefill_rides_along_with_decoding(target, service):
    """A long prompt arriving while another request decodes is prefilled in chunks inside the same
    steps: the decoding request emits in every one of those steps, and both equal their solo runs."""
    a = ("a", [5, 6, 7], SamplingParams(max_tokens=30, ignore_eos=True), SpecParams("ar"))
    long_prompt = [(11 * i + 3) % (V - 2) + 1 for i in range(60)]
    b = ("b", long_prompt, SamplingParams(max_tokens=5, ignore_eos=True), SpecParams("dartree-pruned"))
    engine = _engine(target, service, max_running=2, prefill_chunk=8, max_step_tokens=9)
    engine.add_request(*a)
    first = engine.step_batch(["a"])["a"]
    toks = {"a": list(first.token_ids), "b": []}
    engine.add_request(*b)
    chunk_steps = 0
    while engine.num_active():
        res = engine.step_batch([r for r in ("a", "b") if r in engine._reqs])
        if "b" in res and res["b"] is None:
            chunk_steps += 1
            assert res.get("a") is not None and len(res["a"].token_ids) == 1  # a kept emitting
        for rid, out in res.items():
            if out is not None:
                toks[rid] += out.token_ids
    assert chunk_steps == 60 // 8  # 8 rows per step: 1 for a, 8 for b's chunk (the last chunk emits)
    assert toks["a"] == _solo(target, service, *a[1:])
    assert toks["b"] == _solo(target, service, *b[1:])


def test_seeded_sampling_is_independent_of_the_batch(target, service):
    """A seeded T > 0 request gives the same tokens alone and among unseeded requests."""
    seeded = ("s", [9, 8, 7, 6], SamplingParams(max_tokens=20, temperature=1.0, seed=1234, ignore_eos=True),
              SpecParams("dartree-pruned", budget=6))
    alone = _solo(target, service, *seeded[1:])
    others = [(f"u{i}", [3 + i, 4, 5], SamplingParams(max_tokens=15, temperature=0.8, ignore_eos=True),
               SpecParams(m)) for i, m in enumerate(["ar", "ddtree", "dartree-pruned", "domino"])]
    engine = _engine(target, service, max_running=5, prefill_chunk=3)
    got, _ = _run_batched(engine, {0: others[:2], 1: [seeded], 3: others[2:]})
    assert got["s"] == alone


def test_slots_equal_fresh_prefill_and_reuse_carries_nothing(target, service):
    """After many branching rounds in a shared batch every slot equals a fresh prefill of its
    committed tokens; a freed slot reused by a new request gives that request its solo tokens."""
    engine = _engine(target, service, max_running=3, prefill_chunk=5)
    reqs = [(f"k{i}", [7 + i] * (3 + 4 * i), SamplingParams(max_tokens=60, ignore_eos=True),
             SpecParams(m, budget=8)) for i, m in enumerate(["dartree-pruned", "ddtree", "ar"])]
    for r in reqs:
        engine.add_request(*r)
    emitted = {r[0]: [] for r in reqs}
    for _ in range(12):
        for rid, out in engine.step_batch([r[0] for r in reqs]).items():
            if out is not None:
                emitted[rid] += out.token_ids
    for rid, prompt, _, _ in reqs:
        st = engine._reqs[rid]
        assert_slot_equals_fresh_prefill(target, engine.runner.cache, st.slot, prompt + emitted[rid][:-1])
    slot = engine._reqs["k1"].slot
    engine.abort("k1")
    new = ("n", [40, 41], SamplingParams(max_tokens=12, ignore_eos=True), SpecParams("dartree-pruned"))
    engine.add_request(*new)
    assert engine._reqs["n"].slot == slot
    toks = []
    while "n" in engine._reqs:
        res = engine.step_batch(["n", "k0", "k2"] if "k0" in engine._reqs else ["n"])
        if res.get("n") is not None:
            toks += res["n"].token_ids
    assert toks == _solo(target, service, *new[1:])


def test_abort_and_errors_affect_only_their_request(target, service):
    """Aborting one request between steps, and a drafter error for another inside a step, leave the
    remaining requests' tokens equal to their solo runs."""

    class Flaky(InprocDrafterClient):
        """The drafter fails request "bad" inside the batch (the others' drafts are fine)."""

        def submit(self, jobs):
            good = iter(super().submit([j for j in jobs if j.request_id != "bad"]))
            return [_BatchHandle([RuntimeError("drafter exploded")], 0) if j.request_id == "bad"
                    else next(good) for j in jobs]

    engine = SpecEngine(target, Flaky(service), EngineConfig(max_running=4, prefill_chunk=4), max_draft_depth=5)
    good = ("good", [4, 5, 6, 7, 8], SamplingParams(max_tokens=16, ignore_eos=True), SpecParams("dartree-pruned"))
    for rid in ("good", "bad", "gone"):
        engine.add_request(rid, good[1], good[2], good[3])
    toks, errors = [], {}
    for k in range(100):
        if k == 2:
            engine.abort("gone")
        active = [r for r in ("good", "bad", "gone") if r in engine._reqs]
        if not active:
            break
        for rid, out in engine.step_batch(active).items():
            if isinstance(out, BaseException):
                errors[rid] = out
            elif out is not None and rid == "good":
                toks += out.token_ids
    assert set(errors) == {"bad"} and "exploded" in str(errors["bad"])
    assert toks == _solo(target, service, *good[1:])
    assert engine.num_active() == 0 and engine.num_free_slots() == 4


def test_step_token_budget_keeps_every_request_progressing(target, service):
    """With ``max_step_tokens`` smaller than the running requests' rows a step takes what fits in
    the given order (the worker rotates it), and at least one request always runs."""
    engine = _engine(target, service, max_running=3, max_step_tokens=1)
    for i in range(3):
        engine.add_request(f"q{i}", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True), SpecParams("ar"))
    res = engine.step_batch(["q2", "q0", "q1"])
    assert list(res) == ["q2"]  # 3 prompt tokens > 1-token budget: one chunk of 1 token
    assert engine._reqs["q2"].prefilled == 1


def test_runner_equals_reference_verify_per_request(target):
    """One batched forward over several slots (prompt chunks, then random trees) equals the HF
    reference prefill / tree verify of each request alone (logits and tapped features)."""
    runner = ModelRunner(target, num_slots=4, capacity=300, kv_bucket=16)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, V) for _ in range(n)] for n in (5, 17, 9)]
    refs = []
    for p in prompts:
        cache = target.new_cache()
        refs.append((*target.prefill(p, cache), cache))
    slots = [runner.cache.alloc() for _ in prompts]
    out = runner.execute([causal_segment(p, 0, s) for p, s in zip(prompts, slots)])
    for p, s, (lg, feats, _), f, lgs in zip(prompts, slots, refs, split_rows(out.features, out.packed.cu_rows),
                                           split_rows(out.logits, out.packed.cu_rows)):
        torch.testing.assert_close(lgs[-1], lg, atol=1e-5, rtol=0)
        torch.testing.assert_close(f, feats, atol=1e-5, rtol=0)
        runner.cache.extend(s, len(p))
    bufs = [derive_buffers(random_tree(rng, V, 6, 4), 7) for _ in prompts]
    out = runner.execute([Segment(b.input_ids, b.position_offsets, b.tree_mask, len(p), s)
                          for b, p, s in zip(bufs, prompts, slots)])
    for b, p, (_, _, cache), lgs, f in zip(bufs, prompts, refs, split_rows(out.logits, out.packed.cu_rows),
                                         split_rows(out.features, out.packed.cu_rows)):
        want_lg, want_f = target.verify(b, cache, len(p))
        torch.testing.assert_close(lgs, want_lg, atol=1e-5, rtol=0)
        torch.testing.assert_close(f, want_f, atol=1e-5, rtol=0)


def test_pack_segments_worked_example():
    """The module docstring's example, literally."""
    r, a, b, p, q = 50, 51, 52, 60, 61
    seg0 = Segment(torch.tensor([r, a, b]), torch.tensor([0, 1, 1]),
                   torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool), start=3, slot=2)
    seg1 = causal_segment([p, q], start=0, slot=0)
    pk = pack_segments([seg0, seg1])
    assert pk.input_ids.tolist() == [r, a, b, p, q]
    assert pk.positions.tolist() == [3, 4, 4, 0, 1]
    assert pk.cu_rows.tolist() == [0, 3, 5]
    assert pk.row_index.tolist() == [[0, 1, 2], [3, 4, -1]]
    assert pk.padded_pos.tolist() == [0, 1, 2, 3, 4]  # row_index flattened: [0, 1, 2, 3, 4, -1]
    assert pack_segments([seg1, seg0]).padded_pos.tolist() == [0, 1, 3, 4, 5]  # [[p, q, -], [r, a, b]]
    assert pk.kv_length == 6
    assert pk.write_slot.tolist() == [2, 2, 2, 0, 0] and pk.write_pos.tolist() == [3, 4, 5, 0, 1]
    assert pk.attn_mask[0, 0].int().tolist() == [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 1]]
    assert pk.attn_mask[1, 0].int().tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]]
    assert pack_segments([seg0, seg1], kv_bucket=4).kv_length == 8
    assert pack_segments([seg0, seg1], kv_bucket=4, kv_capacity=7).kv_length == 7


@pytest.mark.parametrize("bad", ["empty", "dup", "capacity", "mask"])
def test_pack_segments_rejects_bad_input(bad):
    seg = causal_segment([1, 2, 3], start=2, slot=0)
    with pytest.raises(ValueError):
        if bad == "empty":
            pack_segments([])
        elif bad == "dup":
            pack_segments([seg, causal_segment([4], 0, 0)])
        elif bad == "capacity":
            pack_segments([seg], kv_capacity=4)
        else:
            pack_segments([Segment(seg.input_ids, seg.position_offsets, torch.ones(2, 2, dtype=torch.bool), 0, 1)])


def test_kv_cache_memory_is_reported_and_checked():
    """The cache reports its size; a cache far larger than the machine's memory is a one-line error."""
    from services.verifier.kv_cache import SlotKVCache

    c = SlotKVCache(2, 2, 8, num_slots=3, capacity=10)
    assert c.nbytes() == SlotKVCache.estimate_bytes(2, 2, 8, 3, 10) == 2 * 2 * 3 * 2 * 10 * 8 * 4
    s = c.alloc()
    assert (s, c.num_free()) == (0, 2)
    c.free(s)
    c.free(s)
    assert c.num_free() == 3
    with pytest.raises(MemoryError, match="KV cache"):
        SlotKVCache(1000, 64, 128, num_slots=1000, capacity=1 << 20)


def test_engine_is_reusable_for_hf_reference(target):
    """The runner switches the model to the slot attention; outside a step it is plain SDPA, so the
    reference paths (prefill / verify / generate of HF) still agree with a fresh model."""
    fresh = tiny_target("llama", **TARGET_KW)
    _engine(fresh, tiny_service(fresh))
    ref = tiny_target("llama", **TARGET_KW)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    torch.testing.assert_close(fresh.model(ids).logits, ref.model(ids).logits, atol=1e-6, rtol=0)


@pytest.mark.parametrize("seed", [0, 1])
def test_overlap_gives_the_same_tokens(target, service, seed):
    """With overlap (next draft submitted right after the commit, collected by the next round) and
    the requests split into two groups that take turns, every request still equals its solo run;
    the drafter really ran ahead (drafts were collected, not drafted inside the step)."""
    reqs = _mixed_requests(10 + seed, 6)
    engine = _engine(target, service, max_running=6, prefill_chunk=4, overlap=True)
    calls = []
    submit = engine.drafter.submit
    engine.drafter.submit = lambda jobs: calls.append(len(jobs)) or submit(jobs)
    for r in reqs:
        engine.add_request(*r)
    tokens = {r[0]: [] for r in reqs}
    turn = 0
    while engine.num_active():
        active = [r[0] for r in reqs if r[0] in engine._reqs]
        group = [r for i, r in enumerate(active) if i % 2 == turn] or active
        turn ^= 1
        for rid, out in engine.step_batch(group).items():
            assert not isinstance(out, BaseException), out
            if out is not None:
                tokens[rid] += out.token_ids
    for rid, prompt, sampling, spec in reqs:
        assert tokens[rid] == _solo(target, service, prompt, sampling, spec), (rid, spec.method)
    assert sum(calls) > 6 and max(calls) >= 2 and engine.num_free_slots() == 6  # batched, ahead of time


def test_drafter_batch_equals_one_request_at_a_time(target):
    """``DrafterService.draft_batch``: one block forward over requests with contexts of different
    lengths (padded + masked) gives every request the tree it gets alone, for every method, over
    several rounds (contexts grow); a bad job fails alone."""
    from services.drafter.service import DFLASH_METHODS as DRAFT_METHODS
    from services.testing import draft_job

    a, b = (tiny_service(target, tiny_drafter(target, seed=5, block_size=6)) for _ in range(2))
    rng = random.Random(1)
    methods = [m for m in DRAFT_METHODS if m != "ar"]
    starts = {m: 0 for m in methods}
    for rnd in range(3):
        jobs = []
        for i, m in enumerate(methods):
            n = rng.randrange(1, 9) + (6 * i if rnd == 0 else 0)
            ids = [rng.randrange(3, V - 1) for _ in range(n)]
            starts[m] += n
            jobs.append(draft_job(m, ids, torch.randn(n, target.feature_dim), rng.randrange(3, V - 1), starts[m],
                                 SpecParams(m, budget=7, width=3), 5))
        bad = draft_job("bad", [1], torch.randn(2, target.feature_dim), 1, 1, SpecParams("ddtree"), 5)
        got = a.draft_batch(jobs[:2] + [bad] + jobs[2:])
        assert isinstance(got.pop(2), ValueError)
        for j, res in zip(jobs, got):
            want, _ = b.draft_batch([j])[0]
            tree, timings = res
            assert torch.equal(tree.draft_tokens, want.draft_tokens) and torch.equal(tree.parents, want.parents), j.spec
            torch.testing.assert_close(tree.scores, want.scores, atol=1e-4, rtol=0)
            assert timings["draft"] > 0

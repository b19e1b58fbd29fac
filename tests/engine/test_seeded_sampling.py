"""A seeded request's tokens are a function of (prompt, sampling params, seed) alone.

Each output position draws its uniform from (seed, absolute position), and every tree row is sampled
by inverse CDF with the uniform of the position it predicts; a draft node is accepted iff it equals
its parent row's sample. The emitted tokens are then exactly what plain decoding with the same seed
emits, whatever was drafted: the policy's budgets (fixed 0 / 4 / 16, goodput), the method, the
batch mates and the number of verify rows per round change the speed, never the tokens.
"""

from __future__ import annotations

import pytest
import torch

from services.testing import tiny_drafter, tiny_service, tiny_target
from services.tree import derive_buffers, sample_target_tokens, walk
from services.tree.accept import position_uniforms
from services.tree.draft_tree import tree_from_parents
from services.verifier.calibration import AcceptanceCalibrator
from services.verifier.cost_model import StepCostModel
from services.verifier.drafter_client import InprocDrafterClient
from services.params import SamplingParams, SpecParams
from services.verifier.engine import SpecEngine
from services.verifier.policy import GoodputPolicy
try:
    from tests.doubles.drafters import FullTreeDrafter, RandomDrafter
except ImportError:  # the drafter doubles' older home
    from services.testing import FullTreeDrafter, RandomDrafter
from tests.tree.test_accept import S_PARENTS, S_PATHS, S_PROBS, S_TOKENS, assert_differs, assert_follows

V8 = 8
PROMPT = [1, 5, 3]
N = 32


def _run(engine: SpecEngine, requests: dict[str, tuple]) -> dict[str, list[int]]:
    """Run ``{rid: (prompt, sampling, spec)}`` together in batched steps; the tokens per request."""
    for rid, (prompt, sp, spec) in requests.items():
        engine.add_request(rid, prompt, sp, spec)
    out: dict[str, list[int]] = {rid: [] for rid in requests}
    live = list(requests)
    while live:
        for rid, res in engine.step_batch(live).items():
            assert not isinstance(res, BaseException), res
            if res is not None:
                out[rid] += res.token_ids
                if res.finish_reason is not None:
                    live.remove(rid)
    assert engine.num_active() == 0
    return out


def _one(engine: SpecEngine, method: str = "dartree-pruned", seed: int | None = 7, budget: int | None = None,
         prompt=PROMPT, **sampling) -> list[int]:
    sp = SamplingParams(max_tokens=N, temperature=sampling.pop("temperature", 1.0), seed=seed, ignore_eos=True,
                        **sampling)
    return _run(engine, {"r": (prompt, sp, SpecParams(method, budget=budget))})["r"]


def _goodput(draft_s: float = 0.0, learn: bool = False) -> GoodputPolicy:
    cost = StepCostModel()
    cost.seed([(1, 0.022), (33, 0.086)])
    cost.observe_draft(draft_s)
    policy = GoodputPolicy(cost, AcceptanceCalibrator(forget=0.98), explore_every=2)
    if not learn:
        policy.observe_step = lambda stats: None
    return policy


@pytest.fixture(scope="module")
def target8():
    return tiny_target("llama", vocab_size=V8, hidden_size=32, num_layers=2, init_std=0.3, eos_token_id=None,
                       target_layer_ids=[1])


@pytest.fixture(scope="module")
def llama():
    return tiny_target("llama", vocab_size=128, hidden_size=32, num_layers=3, max_position_embeddings=256)


@pytest.fixture(scope="module")
def service(llama):
    return tiny_service(llama, tiny_drafter(llama, seed=3, block_size=6))


# ------------------------------------------------------------------------------------ position uniforms

def test_position_uniforms_are_a_function_of_seed_and_position():
    pos = torch.tensor([5, 9, 5, 6, 9])
    u = position_uniforms(7, pos)
    assert u.shape == (5,) and u.dtype == torch.float32
    assert u[0] == u[2] and u[1] == u[4] and len(set(u.tolist())) == 3
    assert torch.equal(u, position_uniforms(7, pos))
    assert not torch.equal(u, position_uniforms(8, pos))
    assert torch.equal(position_uniforms(7, torch.tensor([6])), u[3:4])  # no dependence on the batch
    for seed in (0, -1, 2**63 - 1, -(2**63)):  # the API's whole seed range
        assert 0 <= float(position_uniforms(seed, torch.tensor([0])).item()) < 1


def test_position_uniforms_look_uniform_and_independent():
    u = position_uniforms(123, torch.arange(20000)).double()
    hist = torch.histc(u, bins=20, min=0, max=1)
    assert float(((hist - 1000) ** 2 / 1000).sum()) < 45.3  # chi-square, 19 df, p = 0.001
    assert abs(float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])) < 0.03  # neighbours
    seeds = torch.stack([position_uniforms(s, torch.tensor([10]))[0] for s in range(4000)]).double()
    assert abs(float(seeds.mean()) - 0.5) < 0.02  # across seeds at one position


def test_tree_walk_with_position_uniforms_equals_plain_inverse_cdf_sampling():
    """Sampling every row with its position's uniform and accepting exact matches emits what plain
    one-token-at-a-time sampling emits with the same uniforms (here: whatever the tree shape)."""
    logits = S_PROBS.log()
    buffers = derive_buffers(tree_from_parents(S_TOKENS, S_PARENTS), root_token=4)
    start = 20
    for seed in range(300):
        u = position_uniforms(seed, start + 1 + buffers.position_offsets)
        res = walk(buffers, sample_target_tokens(logits, 1.0, uniforms=u))
        emitted = buffers.input_ids[res.accepted_rows[1:]].tolist() + [res.bonus_token]
        row, plain = 0, []  # plain: sample row `row`, then move to the child carrying the sample
        while True:
            tok = int(sample_target_tokens(logits[row:row + 1], 1.0,
                                           uniforms=position_uniforms(seed, torch.tensor([start + 1 + len(plain)]))))
            plain.append(tok)
            path = tuple(plain)
            row = next((r for r, p in S_PATHS.items() if p == path), None)
            if row is None:
                break
        assert emitted == plain, seed


def test_tree_walk_with_position_uniforms_emits_the_target_distribution():
    buffers = derive_buffers(tree_from_parents(S_TOKENS, S_PARENTS), root_token=4)
    logits = S_PROBS.log() + 0.3
    emissions = []
    for seed in range(12000):
        u = position_uniforms(seed, 50 + buffers.position_offsets)
        res = walk(buffers, sample_target_tokens(logits, 1.0, uniforms=u))
        emissions.append(buffers.input_ids[res.accepted_rows[1:]].tolist() + [res.bonus_token])
    for row, path in S_PATHS.items():
        nxt = [e[len(path)] for e in emissions if len(e) > len(path) and tuple(e[:len(path)]) == path]
        assert len(nxt) > 600
        assert_follows(nxt, S_PROBS[row])
        assert_differs(nxt, S_PROBS[(row + 1) % len(S_PROBS)])


def test_uniform_sampling_never_emits_a_zero_probability_token():
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.0, 0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    edge = torch.tensor([1.0 - 2**-24, 1.0 - 2**-24, 1.0 - 2**-24])
    from services.tree.accept import sample_rows

    assert sample_rows(probs, uniforms=edge).tolist() == [2, 2, 0]
    assert sample_rows(probs, uniforms=torch.zeros(3)).tolist() == [1, 2, 0]


# ------------------------------------------------------------------------------------------- engine

def test_seed_gives_the_same_tokens_whatever_the_policy_drafts(target8):
    """The reported case: goodput drafting in one run and not in another changed the tokens."""
    runs = {
        "ar": _one(SpecEngine(target8, None), method="ar"),
        "budget 4": _one(SpecEngine(target8, RandomDrafter(V8, budget=4, depth=3, seed=1), max_draft_depth=3)),
        "budget 16": _one(SpecEngine(target8, RandomDrafter(V8, budget=16, depth=4, seed=2), max_draft_depth=4)),
        "full tree": _one(SpecEngine(target8, FullTreeDrafter(V8, depth=2), max_draft_depth=2)),
        "goodput": _one(SpecEngine(target8, RandomDrafter(V8, budget=12, depth=3, seed=3), max_draft_depth=3,
                                   policy=_goodput(0.0))),
        "goodput, slow drafter": _one(SpecEngine(target8, RandomDrafter(V8, budget=12, depth=3, seed=3),
                                                 max_draft_depth=3, policy=_goodput(0.05))),
    }
    assert len(runs["ar"]) == N
    assert {k: v for k, v in runs.items() if v != runs["ar"]} == {}
    assert _one(SpecEngine(target8, None), method="ar", seed=8) != runs["ar"]


@pytest.mark.parametrize("method", ["dartree-pruned", "ddtree", "domino"])
def test_seed_is_the_same_across_budgets_and_methods_on_a_real_drafter(llama, service, method):
    ar = _one(SpecEngine(llama, None), method="ar", seed=11)
    for budget in (None, 4, 16):
        engine = SpecEngine(llama, InprocDrafterClient(service), max_draft_depth=5)
        assert _one(engine, method=method, seed=11, budget=budget) == ar, (method, budget)
    goodput = SpecEngine(llama, InprocDrafterClient(service), max_draft_depth=5, policy=_goodput(0.0, learn=True))
    assert _one(goodput, method=method, seed=11) == ar
    assert service.num_contexts() == 0


@pytest.mark.parametrize("filt", [dict(top_k=3), dict(top_p=0.7), dict(temperature=0.6)])
def test_seed_reproduces_with_filters_and_temperatures(target8, filt):
    ar = _one(SpecEngine(target8, None), method="ar", **dict(filt))
    spec = _one(SpecEngine(target8, FullTreeDrafter(V8, depth=2), max_draft_depth=2), **dict(filt))
    assert spec == ar


def test_same_request_five_times_on_one_goodput_server(llama, service):
    """The policy's shared state (learned costs and acceptance, exploration counters) moves between
    the runs; the tokens do not."""
    engine = SpecEngine(llama, InprocDrafterClient(service), max_draft_depth=5, policy=_goodput(0.0, learn=True))
    runs = [_one(engine, seed=7) for _ in range(5)]
    assert all(r == runs[0] for r in runs)


def test_seeded_request_is_independent_of_its_batch_mates(llama, service):
    seeded = ([9, 8, 7, 6], SamplingParams(max_tokens=N, temperature=1.0, seed=1234, ignore_eos=True))
    alone = _run(SpecEngine(llama, None), {"s": (*seeded, SpecParams("ar"))})["s"]
    mates = {f"u{i}": ([3 + i, 4, 5], SamplingParams(max_tokens=10 + 7 * i, temperature=0.8, ignore_eos=True),
                       SpecParams(m)) for i, m in enumerate(["ddtree", "ar", "dartree-pruned"])}
    mates["g"] = ([7, 7], SamplingParams(max_tokens=12), SpecParams("domino"))
    for policy in (None, _goodput(0.0, learn=True)):  # fixed: every round drafts; goodput: some do
        engine = SpecEngine(llama, InprocDrafterClient(service), max_draft_depth=5, policy=policy)
        got = _run(engine, {**mates, "s": (*seeded, SpecParams("dartree-pruned"))})
        assert got["s"] == alone
    assert all(len(got[k]) == mates[k][1].max_tokens for k in mates)


def test_unseeded_requests_differ_between_runs_and_follow_the_global_seed(target8):
    engine = SpecEngine(target8, RandomDrafter(V8, budget=8, depth=3, seed=1), max_draft_depth=3)
    runs = [_one(engine, seed=None) for _ in range(3)]
    assert runs[0] != runs[1] and runs[1] != runs[2]
    torch.manual_seed(5)
    a = _one(engine, seed=None)
    torch.manual_seed(5)
    assert _one(engine, seed=None) == a

"""The goodput policy changes only which draft nodes are verified, never what is emitted (issue 13).

T = 0: every method equals plain greedy with the policy on, whether it speculates (cheap drafter)
or mostly decodes plainly (expensive drafter: B = 0 rounds make no drafter call, and the drafter
context then catches up with every token committed meanwhile). T > 0: the first three tokens are
still distributed as plain sampling from the target (chi-square, as tests/engine/test_sampling.py).
"""

from __future__ import annotations

import random

import pytest

from services.drafter.service import DFLASH_METHODS as METHODS  # the Domino drafter's methods
from services.testing import draft_one, greedy_reference, tiny_drafter, tiny_service
from services.verifier.calibration import AcceptanceCalibrator
from services.verifier.cost_model import StepCostModel
from services.verifier.drafter_client import InprocDrafterClient
from services.params import SamplingParams, SpecParams
from services.verifier.engine import EngineConfig, SpecEngine
from services.verifier.policy import GoodputPolicy
from tests.doubles import OracleDrafter, RandomDrafter
from tests.engine.conftest import V
from tests.engine.test_sampling import V as V8
from tests.engine.test_sampling import chi2_critical, chi2_stat, exact_joint, sample_counts

N = 40


class FrozenCostPolicy(GoodputPolicy):
    """Goodput policy whose step cost model does not learn from the (tiny, noisy) real steps."""

    def __init__(self, draft_s: float, a: float = 0.02, b: float = 0.002, **kw):
        cost = StepCostModel()
        cost.seed([(1, a + b), (33, a + 33 * b)])
        cost.observe_draft(draft_s)
        super().__init__(cost, AcceptanceCalibrator(forget=0.98), **kw)

    def observe_step(self, stats) -> None:
        pass


def _prompt(seed, n=7):
    rng = random.Random(seed)
    return [rng.randrange(3, V - 1) for _ in range(n)]


@pytest.fixture(scope="module")
def service(target):
    return tiny_service(target, tiny_drafter(target, seed=3, block_size=6))


@pytest.mark.parametrize("draft_s", [0.0, 0.05, 10.0])
@pytest.mark.parametrize("method", METHODS)
def test_goodput_greedy_equals_plain_greedy(target, service, method, draft_s):
    prompt = _prompt(11)
    ref = greedy_reference(target.model, prompt, N)
    policy = FrozenCostPolicy(draft_s, explore_every=4)
    engine = SpecEngine(target, InprocDrafterClient(service), max_draft_depth=5, policy=policy)
    outs = list(engine.generate("r", prompt, SamplingParams(max_tokens=N, ignore_eos=True), SpecParams(method)))
    assert [t for o in outs for t in o.token_ids] == ref
    assert engine.num_active() == 0 and service.num_contexts() == 0
    rounds = outs[1:]
    if method != "ar" and draft_s == 10.0:  # an expensive drafter: mostly plain rounds without a drafter call
        assert sum(o.drafted for o in rounds) <= len(rounds) // 4 + 1
        assert all(o.num_draft_tokens == 0 for o in rounds if not o.drafted)


def test_plain_rounds_make_no_drafter_call_and_the_context_catches_up(llama):
    prompt = _prompt(3)
    ref = greedy_reference(llama.model, prompt, N)
    oracle = OracleDrafter({"r": prompt + ref}, depth=4, distractors=2, vocab_size=V, seed=3, truth_prob=0.0)
    policy = FrozenCostPolicy(1.0, explore_every=5)   # a useless, expensive drafter
    engine = SpecEngine(llama, oracle, max_draft_depth=4, policy=policy)
    outs = list(engine.generate("r", prompt, SamplingParams(max_tokens=N, ignore_eos=True),
                                SpecParams("dartree-pruned")))
    assert [t for o in outs for t in o.token_ids] == ref
    rounds = outs[1:]
    assert len(oracle.calls) == sum(o.drafted for o in rounds) <= len(rounds) // 5 + 1
    # the oracle checks the context contract: each call got every token committed since the last one
    assert sum(len(c.committed_ids) for c in oracle.calls[1:]) == oracle.calls[-1].start - oracle.calls[0].start
    assert oracle.released == ["r"]


def test_good_drafter_keeps_speculating(llama):
    prompt = _prompt(4)
    ref = greedy_reference(llama.model, prompt, N)
    oracle = OracleDrafter({"r": prompt + ref}, depth=4, distractors=2, vocab_size=V, seed=3)
    policy = FrozenCostPolicy(0.005)
    engine = SpecEngine(llama, oracle, max_draft_depth=4, policy=policy)
    outs = list(engine.generate("r", prompt, SamplingParams(max_tokens=N, ignore_eos=True),
                                SpecParams("dartree-pruned")))
    assert [t for o in outs for t in o.token_ids] == ref
    assert all(o.drafted and o.accept_length >= 1 for o in outs[1:-1])
    late = [o for o in outs[1:-1]][4:]
    assert all(abs(o.predicted_tau - (o.accept_length + 1)) < 1.0 for o in late)  # calibrated to ~ D + 1


def test_batched_mixed_methods_equal_greedy(target, service):
    policy = FrozenCostPolicy(0.02, explore_every=3)
    engine = SpecEngine(target, InprocDrafterClient(service), EngineConfig(max_running=8), max_draft_depth=5,
                        policy=policy)
    rng = random.Random(5)
    want, got = {}, {}
    for i, method in enumerate(METHODS):
        prompt = [rng.randrange(3, V - 1) for _ in range(rng.randrange(2, 20))]
        n = rng.randrange(8, 30)
        want[f"r{i}"] = greedy_reference(target.model, prompt, n)
        got[f"r{i}"] = []
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=n, ignore_eos=True),
                           SpecParams(method, budget=6 if i == 2 else None))
    live = list(got)
    for _ in range(500):
        if not live:
            break
        for rid, out in engine.step_batch(live).items():
            assert not isinstance(out, BaseException), out
            if out is not None:
                got[rid] += out.token_ids
                if out.finish_reason:
                    live.remove(rid)
    assert got == want
    assert engine.num_active() == 0 and service.num_contexts() == 0


@pytest.fixture(scope="module")
def target8():
    from services.testing import tiny_target

    return tiny_target("llama", vocab_size=V8, hidden_size=32, num_layers=2, init_std=0.3, eos_token_id=None,
                       target_layer_ids=[1])


def test_goodput_sampling_keeps_the_target_distribution(target8, draft_s=0.0):
    """Random trees cut by the policy (it learns as it goes, so budgets vary between rounds)."""
    client = RandomDrafter(V8, budget=12, depth=3, seed=1)
    policy = FrozenCostPolicy(draft_s, explore_every=3)
    engine = SpecEngine(target8, client, max_draft_depth=3, policy=policy)
    counts = sample_counts(engine, 1500, 3, temperature=1.0)
    stat, df = chi2_stat(counts, exact_joint(target8.model))
    assert stat < chi2_critical(df), f"chi2 {stat:.1f} > critical {chi2_critical(df):.1f} (df {df})"
    stat_w, df_w = chi2_stat(counts, exact_joint(target8.model, parent_row_bug=True))
    assert stat_w > 2 * chi2_critical(df_w)
    assert engine.num_active() == 0 and client.num_contexts() == 0


@pytest.mark.parametrize("method", ["dflash", "domino"])
def test_chains_carry_path_scores_for_the_calibrator(target, service, method):
    """Chain drafts score each node with its path log-probability (non-increasing, <= 0), so the
    calibrator can tell a confident chain from a doubtful one."""
    import torch

    from services.params import SpecParams as SP

    feats = torch.zeros(3, target.feature_dim)
    tree, _ = draft_one(service, "chain", [5, 6, 7], feats, 9, 3, SP(method), max_depth=5)
    service.release("chain")
    assert tree.num_nodes == 5
    assert bool((tree.scores <= 1e-6).all()) and bool((tree.scores[1:] <= tree.scores[:-1] + 1e-6).all())
    assert float(tree.scores[-1]) < 0


def test_goodput_with_overlap_equals_greedy(target, service):
    """With overlap the next draft is submitted right after the commit, also asking the policy."""
    policy = FrozenCostPolicy(0.02, explore_every=3)
    engine = SpecEngine(target, InprocDrafterClient(service), EngineConfig(max_running=4, overlap=True),
                        max_draft_depth=5, policy=policy)
    prompts = {f"o{i}": _prompt(20 + i, n=5 + i) for i in range(3)}
    want = {rid: greedy_reference(target.model, p, 20) for rid, p in prompts.items()}
    got = {rid: [] for rid in prompts}
    for rid, p in prompts.items():
        engine.add_request(rid, p, SamplingParams(max_tokens=20, ignore_eos=True), SpecParams("dartree-pruned"))
    live = list(prompts)
    for k in range(300):
        if not live:
            break
        group = live[k % 2::2] or live  # alternate groups, as the worker does
        for rid, out in engine.step_batch(group).items():
            assert not isinstance(out, BaseException), out
            if out is not None:
                got[rid] += out.token_ids
                if out.finish_reason:
                    live.remove(rid)
    assert got == want
    assert engine.num_active() == 0 and service.num_contexts() == 0

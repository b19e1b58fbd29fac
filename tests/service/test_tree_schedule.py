"""The verifier's load-dependent tree budget/width schedule (``--tree-schedule``): parser, the
policy's per-round pick by running count, explicit request values winning, the gauges, and
losslessness under it."""

from __future__ import annotations

import pytest

from services import protocol as p
from services.spec import DEFAULT_KNOBS, TreeSchedule, parse_tree_schedule
from services.verifier.policy import FixedPolicy, GoodputPolicy, RoundInfo
from services.verifier.config import EngineConfig, VerifierWorkerConfig
from services.verifier.worker import VerifierWorker

from tests.doubles import FakeEngine, ScriptedDrafterClient, next_output

from .fakes import verifier_info

SCHEDULE = "1:16x12,2:12x8,4:8x6,8:4x4"
EXPECTED = {1: (16, 12), 2: (12, 8), 3: (12, 8), 4: (8, 6), 5: (8, 6), 6: (8, 6), 7: (8, 6), 8: (4, 4)}


# ------------------------------------------------------------------------------------------- parser

def test_parse_good_strings():
    assert parse_tree_schedule(SCHEDULE) == TreeSchedule(((1, 16, 12), (2, 12, 8), (4, 8, 6), (8, 4, 4)))
    assert parse_tree_schedule(" 2 : 12 X 8 , 5:3x1 ") == TreeSchedule(((2, 12, 8), (5, 3, 1)))
    assert parse_tree_schedule("1:1024x256").steps == ((1, 1024, 256),)
    assert parse_tree_schedule("") is None and parse_tree_schedule("none") is None
    assert str(parse_tree_schedule(" 1:16x12, 4:8x6")) == "1:16x12,4:8x6"


@pytest.mark.parametrize("text, why", [
    ("1:16", "not MIN_RUNNING:BUDGETxWIDTH"), ("1:16x", "not MIN_RUNNING"), ("a:1x1", "not MIN_RUNNING"),
    ("1:16x12,", "not MIN_RUNNING"), ("1:-4x2", "not MIN_RUNNING"), ("1:2x2;2:1x1", "not MIN_RUNNING"),
    ("0:8x4", "strictly increasing"), ("2:8x4,2:4x4", "strictly increasing"), ("4:8x4,2:4x4", "strictly increasing"),
    ("1:0x4", "budget 0"), ("1:1025x4", "budget 1025"), ("1:8x0", "width 0"), ("1:8x257", "width 257")])
def test_parse_bad_strings_give_one_line(text, why):
    with pytest.raises(ValueError, match=why) as err:
        parse_tree_schedule(text)
    assert "\n" not in str(err.value)


def test_startup_validation_uses_the_server_limits():
    with pytest.raises(ValueError, match="budget 65 .* must be in \\[1, 64\\]"):
        parse_tree_schedule("1:65x4", max_budget=64)
    with pytest.raises(ValueError, match="threshold 16 exceeds max_running 8"):
        VerifierWorkerConfig(tree_schedule="1:8x4,16:4x2", engine=EngineConfig(max_running=8))
    with pytest.raises(ValueError, match="budget 2000"):
        VerifierWorkerConfig(tree_schedule="1:2000x4")
    assert VerifierWorkerConfig(tree_schedule=SCHEDULE).tree_schedule == SCHEDULE


def test_pick_by_running_count():
    s = parse_tree_schedule(SCHEDULE)
    assert {n: s.pick(n) for n in range(1, 9)} == EXPECTED
    assert s.pick(100) == (4, 4)
    assert parse_tree_schedule("3:8x4").pick(2) is None  # below the first threshold: the defaults


@pytest.mark.parametrize("argv_env", [(["--tree-schedule", "1:8x4,1:4x2"], {}),
                                      ([], {"DARTREE_TREE_SCHEDULE": "1:8"})])
def test_cli_reports_a_bad_schedule_in_one_line(argv_env, monkeypatch, capsys):
    from services.cli import main

    argv, env = argv_env
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(["verifier", "--drafter-endpoint", "none", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dartree: error: --tree-schedule:") and err.count("\n") == 1


# ------------------------------------------------------------------------------- worker, fake engine

def _worker(engine, schedule: str, max_running: int = 8) -> tuple[VerifierWorker, list]:
    sent: list = []
    config = VerifierWorkerConfig(tree_schedule=schedule, engine=EngineConfig(max_running=max_running))
    worker = VerifierWorker(engine, verifier_info(400), config, send=lambda ident, msg: sent.append(msg))
    return worker, sent


def _gen(rid: str) -> p.Generate:
    return p.Generate(rid, [5, 6], p.SamplingParams(max_tokens=64), p.SpecParams())


class _Unset:
    budget = width = depth_bonus = candidates = None


@pytest.mark.parametrize("policy", [FixedPolicy, GoodputPolicy])
def test_the_policy_picks_budget_width_from_the_running_count(policy):
    """The knobs of a request that leaves them unset follow the running count the step reports;
    the other knobs come from the defaults."""
    pol = policy(schedule=parse_tree_schedule(SCHEDULE))
    for n in list(range(1, 9)) + [100]:
        pol.begin_step([RoundInfo("r", "dartree-pruned", 0.0, True)], num_running=n)
        knobs = pol.draft_knobs("r", _Unset())
        if knobs is not None:  # goodput may choose a plain round; when it drafts, the pick applies
            assert (knobs.budget, knobs.width) == EXPECTED[min(n, 8)]
            assert (knobs.depth_bonus, knobs.candidates) == (DEFAULT_KNOBS.depth_bonus, DEFAULT_KNOBS.candidates)
    below = FixedPolicy(schedule=parse_tree_schedule("3:8x4"))
    below.begin_step([], num_running=2)
    assert below.draft_knobs("r", _Unset()) == DEFAULT_KNOBS  # below the first threshold: the defaults


def test_worker_gauges_follow_the_running_count():
    """Requests arrive one by one (1 -> 8 running) and finish: the gauges show the schedule's step
    at the running count, and 0 once idle."""
    engine = FakeEngine(rounds=[[1]] * 20)  # every step runs every request: none finishes before the 8th arrives
    worker, sent = _worker(engine, SCHEDULE)
    for i in range(8):
        worker.post(b"gw", _gen(f"r{i}"))
        for _ in range(2):
            worker.run_once(idle_timeout=0)
        assert worker.metrics.registry.get_sample_value("dartree_spec_scheduled_budget") == EXPECTED[i + 1][0]
        assert worker.metrics.registry.get_sample_value("dartree_spec_scheduled_width") == EXPECTED[i + 1][1]
    while engine.num_active():
        worker.run_once(idle_timeout=0)
    assert worker.metrics.registry.get_sample_value("dartree_spec_scheduled_budget") == 0  # idle: no pick
    assert sum(isinstance(m, p.RoundChunk) and m.finish_reason == "stop" for m in sent) == 8


def test_no_schedule_shows_no_pick():
    engine = FakeEngine()
    worker, _ = _worker(engine, "")
    for rid in "ab":
        worker.post(b"gw", _gen(rid))
    while engine.num_active() or not engine.steps:
        worker.run_once(idle_timeout=0)
    assert worker.metrics.registry.get_sample_value("dartree_spec_scheduled_budget") == 0


# ------------------------------------------------------------------------------- real engine, tiny

class SpyDrafter(ScriptedDrafterClient):
    """Delegates each batch to a service's ``draft_batch`` (a real :class:`DrafterService` or a
    scripted drafter); records the knobs each round was drafted with."""

    def __init__(self, service):
        super().__init__()
        self.service = service
        self.seen: list[tuple[str, int | None, int | None, int]] = []  # (request, budget, width, nodes)

    def draft_batch(self, jobs):
        out = []
        for job, res in zip(jobs, self.service.draft_batch(jobs)):
            if not isinstance(res, BaseException):
                res = self.trim(job, *res)
                self.seen.append((job.request_id, job.spec.budget, job.spec.width, res[0].num_nodes))
            out.append(res)
        return out

    def trim(self, job, tree, timings):
        return tree, timings

    def release(self, request_id):
        self.service.release(request_id)


class TrimmedOracle(SpyDrafter):
    """An :class:`OracleDrafter` (true path + wrong siblings, shuffled per depth) cut to the first
    ``spec.budget`` nodes: the budget decides how much of the true path survives, so rounds accept."""

    def trim(self, job, tree, timings):
        from services.tree.draft_tree import tree_from_parents

        n = job.spec.budget
        return tree_from_parents(tree.draft_tokens[:n].tolist(), tree.parents[:n].tolist()), timings


@pytest.fixture(scope="module")
def tiny():
    from services.testing import tiny_drafter, tiny_service, tiny_target

    target = tiny_target("llama", vocab_size=128, hidden_size=32, num_layers=3, max_position_embeddings=256)
    return target, tiny_service(target, tiny_drafter(target, block_size=8))


def test_explicit_request_values_override_the_schedule(tiny):
    from services.params import SamplingParams, SpecParams
    from services.verifier.engine import SpecEngine

    target, service = tiny
    spy = SpyDrafter(service)
    engine = SpecEngine(target, spy, max_draft_depth=8, policy=FixedPolicy(schedule=parse_tree_schedule("1:5x4")))
    cases = {"none": SpecParams("dartree-pruned"), "b": SpecParams("dartree-pruned", budget=9),
             "w": SpecParams("dartree-pruned", width=2), "bw": SpecParams("dartree-pruned", budget=3, width=1)}
    for rid, spec in cases.items():
        engine.add_request(rid, [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True), spec)
        next_output(engine, rid)  # prefill: no draft
        next_output(engine, rid)
        engine.abort(rid)
    assert [s[:3] for s in spy.seen] == [("none", 5, 4), ("b", 9, 4), ("w", 5, 2), ("bw", 3, 1)]
    assert all(nodes <= budget for _, budget, _, nodes in spy.seen)
    assert cases["none"].budget is None  # the request's own parameters are not modified


@pytest.mark.parametrize("drafter", ["dartree", "oracle"])
def test_greedy_output_is_unchanged_under_the_schedule(tiny, drafter):
    """Three requests through the worker and a real engine: B/W change with the running count round
    by round, the output stays token-for-token plain greedy. ``dartree``: the real DARTree drafter
    (random weights: B and W shape every tree, nothing is accepted); ``oracle``: B cuts a true path
    (rounds accept, so KV compaction runs under every budget)."""
    from services.testing import greedy_reference
    from tests.doubles import OracleDrafter
    from services.verifier.engine import SpecEngine

    target, service = tiny
    prompts = {"a": [5, 9, 17, 33], "b": [40, 3, 77, 8, 91, 12], "c": [100, 101]}
    lengths = {"a": 40, "b": 24, "c": 12}
    refs = {rid: greedy_reference(target.model, prompt, lengths[rid]) for rid, prompt in prompts.items()}
    if drafter == "oracle":
        spy = TrimmedOracle(OracleDrafter({rid: prompts[rid] + refs[rid] for rid in prompts}, depth=4, seed=5))
    else:
        spy = SpyDrafter(service)
    config = VerifierWorkerConfig(tree_schedule="1:12x4,2:6x2,3:2x1", engine=EngineConfig(max_running=3))
    engine = SpecEngine(target, spy, max_draft_depth=8, policy=FixedPolicy(schedule=parse_tree_schedule(config.tree_schedule)))
    sent: list = []
    worker = VerifierWorker(engine, verifier_info(128), config, send=lambda ident, msg: sent.append(msg))
    for rid, prompt in prompts.items():
        worker.post(b"gw", p.Generate(rid, prompt, p.SamplingParams(max_tokens=lengths[rid], ignore_eos=True),
                                      p.SpecParams(method="dartree-pruned")))
    for _ in range(500):
        worker.run_once(idle_timeout=0)
        if {m.request_id for m in sent if isinstance(m, p.RoundChunk) and m.finish_reason} == set(prompts):
            break
    assert not [m for m in sent if isinstance(m, p.RequestError)]
    for rid, prompt in prompts.items():
        got = [t for m in sent if m.request_id == rid for t in m.token_ids]
        assert got == refs[rid], rid
    knobs = {(b, w) for _, b, w, _ in spy.seen}
    assert knobs == {(12, 4), (6, 2), (2, 1)}  # all three steps were used
    assert all(nodes <= b for _, b, _, nodes in spy.seen)
    if drafter == "oracle":
        assert sum(m.accept_length for m in sent if isinstance(m, p.RoundChunk)) > 10
    assert engine.num_active() == 0 and spy.service.num_contexts() == 0


def test_the_bench_reads_the_schedule_the_verifier_exports():
    import httpx
    from prometheus_client import generate_latest

    from benchmarks.bench_serving import read_server_schedule
    from services.metrics import VerifierMetrics

    for schedule in ("1:16x12,4:8x6", ""):
        text = generate_latest(VerifierMetrics(model="m", tree_schedule=schedule).registry).decode()
        transport = httpx.MockTransport(lambda r, text=text: httpx.Response(200, text=text))
        assert read_server_schedule("http://127.0.0.1:8001/metrics", transport) == schedule

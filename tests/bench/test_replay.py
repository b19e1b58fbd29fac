"""``dartree bench --tau-replay``: replayed acceptance equals the engine's, round for round.

The replay (benchmarks/bench_run.replay_turn) feeds the drafter from one teacher-forced target
forward instead of per-round tree verifies. On float32 tiny models the two must agree exactly:
the same number of rounds, the same accept length in every round, the same tau, for every drafting
method, including a terminator that ends the output inside a round and ``max_tokens`` cutting one.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from benchmarks.bench_run import CellStats, engine_turn, install_recorder, replay_turn
from services.drafter.service import DFLASH_METHODS as METHODS  # the Domino drafter's methods
from services.testing import tiny_service, tiny_target
from services.verifier.drafter_client import InprocDrafterClient
from services.verifier.engine import SpecEngine

V = 24  # a small vocabulary so random trees hit the greedy continuation often


class _Tok:
    def decode(self, ids, **kw):
        return " ".join(map(str, ids))


@pytest.fixture(scope="module")
def engine():
    target = tiny_target("llama", vocab_size=V, hidden_size=32, num_layers=3, max_position_embeddings=256)
    return SpecEngine(target, InprocDrafterClient(tiny_service(target, seed=3, block_size=6)), max_draft_depth=5)


def _prompt(seed: int, n: int = 9) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, V - 2) for _ in range(n)]


@pytest.mark.parametrize("method", [m for m in METHODS if m != "ar"])
def test_replay_equals_engine_round_for_round(engine, method):
    tok = _Tok()
    accepted_any = 0
    for seed in range(4):
        ids = _prompt(seed)
        ref = engine_turn(engine, None, tok, ids, "ar", {}, 0.0, 30, 0, CellStats(), 0, f"ar-{seed}")
        live, replayed = CellStats(), CellStats()
        got = engine_turn(engine, install_recorder(engine), tok, ids, method, {}, 0.0, 30, 0, live, 0,
                          f"e-{method}-{seed}")
        rep = replay_turn(engine, tok, ids, ref["tokens"], ref["finish"], method, {}, replayed, 2,
                          f"r-{method}-{seed}")
        assert got["tokens"] == ref["tokens"]  # lossless, so the replay's premise holds
        assert rep["rounds"] == got["rounds"] and rep["taus_sum"] == got["taus_sum"]
        assert rep["tau"] == pytest.approx(got["tau"])
        assert replayed.accept_hist == live.accept_hist
        assert replayed.depth_hist == live.depth_hist and replayed.num_trees == live.num_trees
        accepted_any += sum(c for k, c in live.accept_hist.items() if k > 0)
        assert rep["decode_s"] == 0.0 and rep["replay"]
    if method not in ("dflash", "domino"):  # random chains rarely hit; trees over a 24-token vocabulary do
        assert accepted_any > 0, "the fixture must produce accepting rounds for the comparison to mean anything"


def test_replay_counts_terminator_and_max_tokens_like_the_engine(engine):
    """EOS inside the output (finish=stop) and a max_tokens cut: same tau accounting as engine_turn."""
    tok = _Tok()
    ids = _prompt(11)
    ref = engine_turn(engine, None, tok, ids, "ar", {}, 0.0, 40, 0, CellStats(), 0, "ar-eos")
    stop_at = ref["tokens"][7]  # make an early greedy token the terminator
    saved = engine.eos_token_ids
    engine.eos_token_ids = (stop_at,)
    try:
        ar = engine_turn(engine, None, tok, ids, "ar", {}, 0.0, 40, 0, CellStats(), 0, "ar-eos2")
        assert ar["finish"] == "stop"
        for method in ("dflash", "dartree-pruned"):
            live, replayed = CellStats(), CellStats()
            got = engine_turn(engine, None, tok, ids, method, {}, 0.0, 40, 0, live, 0, f"e-eos-{method}")
            rep = replay_turn(engine, tok, ids, ar["tokens"], ar["finish"], method, {}, replayed, 0, f"r-eos-{method}")
            assert (rep["rounds"], rep["taus_sum"]) == (got["rounds"], got["taus_sum"])
            assert replayed.accept_hist == live.accept_hist
    finally:
        engine.eos_token_ids = saved
    for n in (1, 2, 5):  # max_tokens ending anywhere
        ar = engine_turn(engine, None, tok, ids, "ar", {}, 0.0, n, 0, CellStats(), 0, f"ar-n{n}")
        live, replayed = CellStats(), CellStats()
        got = engine_turn(engine, None, tok, ids, "ddtree", {}, 0.0, n, 0, live, 0, f"e-n{n}")
        rep = replay_turn(engine, tok, ids, ar["tokens"], ar["finish"], "ddtree", {}, replayed, 0, f"r-n{n}")
        assert (rep["rounds"], rep["taus_sum"]) == (got["rounds"], got["taus_sum"])
        assert Counter(replayed.accept_hist) == Counter(live.accept_hist)

"""The training's held-out estimate is the engine's replayed tau (equal to the live engine's)."""

from __future__ import annotations

import argparse
import json
import random

import pytest
import torch

from services.testing import tiny_drafter, tiny_service, tiny_target
from services.training.heldout import HeldoutTurn, greedy_turns, replayed_tau
from services.training.train import build_args, run
from services.verifier.drafter_client import InprocDrafterClient
from services.params import SamplingParams, SpecParams
from services.verifier.engine import SpecEngine

V = 24


@pytest.mark.parametrize("budget", [4, 12])
def test_replayed_tau_equals_live_engine_tau(budget, tmp_path):
    target = tiny_target("llama", vocab_size=V, hidden_size=32, num_layers=3, max_position_embeddings=256)
    drafter = tiny_drafter(target, seed=3, block_size=6).train()
    rng = random.Random(0)
    prompts = [(f"p{i}", [rng.randrange(3, V - 2) for _ in range(9)]) for i in range(3)]
    turns = greedy_turns(target, prompts, 30, tmp_path / "turns.pt")
    assert greedy_turns(target, prompts, 30, tmp_path / "turns.pt") == turns  # cached
    got = replayed_tau(drafter, target, turns, "dartree-pruned", budget=budget, width=4, max_draft_depth=5)
    assert drafter.training  # mode restored
    engine = SpecEngine(target, InprocDrafterClient(tiny_service(target, drafter)), max_draft_depth=5)
    rounds = emitted = 0
    for uid, ids in prompts:
        outs = list(engine.generate(uid, ids, SamplingParams(max_tokens=30),
                                    SpecParams("dartree-pruned", budget=budget, width=4)))
        assert [t for o in outs for t in o.token_ids] == next(t.ref for t in turns if t.uid == uid)
        rounds += len(outs) - 1  # the prefill emits the first token, outside any round
        emitted += sum(len(o.token_ids) for o in outs[1:]) + (1 if outs[-1].finish_reason == "stop" else 0)
    assert got == pytest.approx(emitted / rounds)
    assert got > 1.0


def test_training_eval_logs_replayed_tau(tiny_training, tmp_path):
    tdir, feats = tiny_training
    pf = tmp_path / "prompts.json"
    pf.write_text(json.dumps([[5, 9, 11, 30, 7], [40, 41, 3, 3, 9, 12]]))
    ap = argparse.ArgumentParser()
    build_args(ap)
    a = ap.parse_args(["--target", str(tdir), "--feat-dir", str(feats), "--work-dir", str(tmp_path / "w"),
                       "--out", str(tmp_path / "out"), "--layers", "1", "--gru-hidden-dim", "8", "--emb-dim", "8",
                       "--anchors", "4", "--threads", "1", "--heldout", "2", "--max-steps", "2", "--eval-every", "1",
                       "--replay-prompt-file", str(pf), "--replay-max-tokens", "12", "--replay-budgets", "4", "8"])
    run(a)
    lines = [json.loads(x) for x in (tmp_path / "w" / "eval.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2, 2]
    assert all(x["replay_tau_B4"] >= 1.0 and x["replay_tau_B8"] >= 1.0 for x in lines)
    turns = torch.load(tmp_path / "w" / "heldout_turns.pt", weights_only=False)["turns"]
    assert len(turns) == 2 and all(len(HeldoutTurn(**t).ref) <= 12 for t in turns)

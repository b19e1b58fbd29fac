"""Reduced draft vocabulary (issue 14): a d2t map, drafts over N target ids, lossless; full layout unchanged."""

from __future__ import annotations

import json
import random

import pytest
import torch

from services.drafter.model import DFlashDrafter, load_drafter, reduce_draft_vocab, save_drafter
from services.drafter.service import DFLASH_METHODS as METHODS  # the Domino drafter's methods
from services.testing import draft_one, greedy_reference, tiny_drafter, tiny_service, tiny_target
from services.verifier.drafter_client import InprocDrafterClient
from services.params import SamplingParams, SpecParams
from services.verifier.engine import SpecEngine

V = 96
DRAFT_METHODS = [m for m in METHODS if m != "ar"]


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", vocab_size=V, hidden_size=32, num_layers=3, max_position_embeddings=256)


def _drafts(service, method, seed=0, rounds=4):
    """Trees of a few rounds over random contexts: list of (tokens, parents)."""
    rng = random.Random(seed)
    f = service.cfg.feature_dim
    out = []
    for r in range(rounds):
        ids = [rng.randrange(3, V - 1) for _ in range(6)]
        feats = torch.randn(len(ids), f, generator=torch.Generator().manual_seed(seed * 100 + r))
        tree, _ = draft_one(service, f"q{r}", ids, feats, ids[-1], len(ids), SpecParams(method, budget=12, width=4))
        service.release(f"q{r}")
        out.append((tree.draft_tokens.tolist(), tree.parents.tolist()))
    return out


@pytest.mark.parametrize("method", DRAFT_METHODS)
def test_full_size_map_drafts_identical_trees(target, method):
    """N = V under a permuted map: same logits per target id, so the same trees (as target ids)."""
    full = tiny_drafter(target, seed=2)
    perm = torch.randperm(V, generator=torch.Generator().manual_seed(0))
    mapped = reduce_draft_vocab(full, perm)
    assert mapped.config.draft_vocab_size == V and torch.equal(mapped.draft_to_target(), perm)
    a = _drafts(tiny_service(target, full), method)
    b = _drafts(tiny_service(target, mapped), method)
    assert a == b
    assert any(toks for toks, _ in a)


@pytest.mark.parametrize("method", DRAFT_METHODS)
def test_reduced_map_drafts_only_mapped_ids(target, method):
    full = tiny_drafter(target, seed=2)
    keep = torch.randperm(V, generator=torch.Generator().manual_seed(1))[:24]
    svc = tiny_service(target, reduce_draft_vocab(full, keep))
    allowed = set(keep.tolist())
    drafted = [t for toks, _ in _drafts(svc, method) for t in toks]
    assert drafted and set(drafted) <= allowed


@pytest.mark.parametrize("method", ["dflash", "ddtree", "domino", "dartree-pruned", "seqheap"])
def test_reduced_vocab_generation_is_lossless(target, method):
    prompt = [5, 17, 33, 8, 61, 22, 40]
    ref = greedy_reference(target.model, prompt, 32)
    # keep the greedy continuation's tokens in the map so that some drafts can be accepted
    keep = sorted(set(ref) | set(random.Random(0).sample(range(V), 20)))
    svc = tiny_service(target, reduce_draft_vocab(tiny_drafter(target, seed=4), torch.tensor(keep)))
    engine = SpecEngine(target, InprocDrafterClient(svc), max_draft_depth=6)
    outs = list(engine.generate("r", prompt, SamplingParams(max_tokens=32, ignore_eos=True), SpecParams(method)))
    assert [t for o in outs for t in o.token_ids] == ref


def test_reduced_layout_round_trips_strictly_and_full_layout_is_unchanged(target, tmp_path):
    full = tiny_drafter(target, seed=2)
    save_drafter(full, tmp_path / "full")
    cfg = json.loads((tmp_path / "full" / "config.json").read_text())
    assert "draft_vocab_size" not in cfg
    from safetensors.torch import load_file
    assert not {"d2t", "t2d"} & set(load_file(str(tmp_path / "full" / "model.safetensors")))
    keep = torch.tensor([9, 3, 50, 77, 12])
    red = reduce_draft_vocab(full, keep)
    save_drafter(red, tmp_path / "red")
    cfg = json.loads((tmp_path / "red" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 5
    sd = load_file(str(tmp_path / "red" / "model.safetensors"))
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool
    assert sd["embed_proj.2.weight"].shape == (5, full.config.emb_dim)
    back = load_drafter(tmp_path / "red")
    assert torch.equal(back.draft_to_target(), keep)
    assert back.t2d.sum() == 5 and bool(back.t2d[keep].all())
    with pytest.raises(ValueError):
        DFlashDrafter(back.config).set_draft_vocab(torch.tensor([1, 1, 2, 3, 4]))


def test_reduced_vocab_batched_drafts_equal_single_drafts_in_target_ids(target):
    """``draft_batch`` maps draft ids to target ids for several requests at once exactly as for one."""
    from services.testing import draft_job

    keep = torch.randperm(V, generator=torch.Generator().manual_seed(3))[:30]
    a, b = (tiny_service(target, reduce_draft_vocab(tiny_drafter(target, seed=2), keep)) for _ in range(2))
    rng = random.Random(2)
    jobs = []
    for i, m in enumerate(DRAFT_METHODS):
        ids = [rng.randrange(3, V - 1) for _ in range(3 + i)]
        jobs.append(draft_job(m, ids, torch.randn(len(ids), a.cfg.feature_dim), ids[-1], len(ids),
                             SpecParams(m, budget=10, width=4), None))
    for j, (tree, _) in zip(jobs, a.draft_batch(jobs)):
        want, _ = b.draft_batch([j])[0]
        assert tree.draft_tokens.tolist() == want.draft_tokens.tolist() and set(tree.draft_tokens.tolist()) <= set(
            keep.tolist())

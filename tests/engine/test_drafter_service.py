"""DrafterService and the Domino head against the definitions of algorithms.md §1.3 and §2.1-§2.2:
block row selection (shift_label), the incremental drafter context, the GRU cell, DominoScorer and the
chain rollout, and the trees every method returns."""

from __future__ import annotations

import pytest
import torch

from services.drafter.service import DFLASH_METHODS, HEAD_METHODS, METHODS  # noqa: F401
from services.drafter.tree_builders import DominoScorer
from services.testing import block_logits_one, draft_one, tiny_drafter, tiny_service, tiny_target
from services.params import SpecParams

V = 96


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", vocab_size=V, hidden_size=32, num_layers=3, target_layer_ids=[0, 2])


def _feats(target, n, seed=0):
    return torch.randn(n, target.feature_dim, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("projector_type", ["domino", None])
def test_block_rows_follow_shift_label(target, projector_type):
    """Block = [root, MASK x (B-1)] at positions start..start+B-1; Domino (shift_label) keeps all B rows,
    DFlash drops row 0; logits come from the target's lm_head."""
    svc = tiny_service(target, tiny_drafter(target, projector_type=projector_type, block_size=6))
    d, c = svc.drafter, svc.cfg
    feats = _feats(target, 7)
    hd, base = block_logits_one(svc, "r", feats, 11, 7)
    with torch.inference_mode():
        kv = d.context_kv(feats[None], torch.arange(7))
        block = target.embed_tokens()(torch.tensor([11] + [c.mask_token_id] * 5))[None]
        h = d.block_forward(block, torch.arange(7, 13), kv)[0]
        rows = h if projector_type else h[1:]
        ref_logits = target.lm_head()(rows).float()
    assert hd.shape == (c.num_draft_slots, c.hidden_size) and c.num_draft_slots == (6 if projector_type else 5)
    torch.testing.assert_close(hd, rows, atol=1e-6, rtol=0)
    torch.testing.assert_close(base, ref_logits, atol=1e-6, rtol=0)


def test_incremental_context_equals_one_shot(target):
    """Appending committed features round by round (block rows dropped each time) == all at once."""
    svc_a, svc_b = tiny_service(target, block_size=6), tiny_service(target, block_size=6)
    svc_b.drafter.load_state_dict(svc_a.drafter.state_dict())
    feats = _feats(target, 12)
    block_logits_one(svc_a, "r", feats[:5], 40, 5)
    block_logits_one(svc_a, "r", feats[5:6], 41, 6)
    block_logits_one(svc_a, "r", feats[6:6], 41, 6)  # nothing committed (an empty round): context unchanged
    hd_a, base_a = block_logits_one(svc_a, "r", feats[6:12], 42, 12)
    hd_b, base_b = block_logits_one(svc_b, "r", feats, 42, 12)
    torch.testing.assert_close(hd_a, hd_b, atol=1e-5, rtol=0)
    torch.testing.assert_close(base_a, base_b, atol=1e-5, rtol=0)
    assert svc_a.num_contexts() == 1
    svc_a.release("r")
    svc_a.release("r")
    assert svc_a.num_contexts() == 0


def test_context_gaps_are_rejected(target):
    svc = tiny_service(target)
    block_logits_one(svc, "r", _feats(target, 5), 1, 5)
    with pytest.raises(ValueError, match="holds 5 positions"):
        block_logits_one(svc, "r", _feats(target, 2), 1, 9)
    with pytest.raises(ValueError, match="one row per committed token"):
        draft_one(svc, "q", [1, 2, 3], _feats(target, 2), 4, 3, SpecParams("dflash"))


def test_gru_cell_is_pytorch_gru(target):
    d = tiny_drafter(target)
    x = torch.randn(1, 5, target.hidden_size)
    with torch.inference_mode():
        ref, _ = d.prefix_gru(x)
        h = torch.zeros(1, d.config.gru_hidden_dim)
        for t in range(5):
            h = d.gru_cell(x[:, t], h)
            torch.testing.assert_close(h, ref[:, t], atol=1e-6, rtol=0)


def test_domino_scorer_is_the_additive_correction(target):
    d = tiny_drafter(target, block_size=6)
    emb = target.embed_tokens()
    hd = torch.randn(6, target.hidden_size)
    sc = DominoScorer(d, emb, hd)
    with torch.inference_mode():
        h0 = sc.root_state(7)
        gru_ref, _ = d.prefix_gru(emb(torch.tensor([[7, 9]])))
        torch.testing.assert_close(h0, gru_ref[:, 0], atol=1e-6, rtol=0)
        h1 = sc.advance(h0, torch.tensor([9]))
        torch.testing.assert_close(h1, gru_ref[:, 1], atol=1e-6, rtol=0)
        states = torch.cat([h0, h1])
        base = torch.randn(V)
        full = sc.score(3, states, None, base)
        ref = base[None] + d.correction(hd[3].expand(2, -1), states)
        torch.testing.assert_close(full, ref, atol=1e-5, rtol=0)
        cand = torch.tensor([5, 0, 17])
        torch.testing.assert_close(sc.score(3, states, cand, base[cand]), ref[:, cand], atol=1e-5, rtol=0)


def test_domino_chain_matches_the_sequential_definition(target):
    """§2.2: d1 = argmax base[0]; d_{i+1} = argmax(base[i] + embed_proj([H_d[i]; h_i])), h_i = GRU over
    [root, d_1 .. d_i] from a zero state (pure_draft_prefix_len = 1)."""
    svc = tiny_service(target, block_size=6)
    d, emb = svc.drafter, target.embed_tokens()
    feats, root = _feats(target, 6, seed=3), 13
    tree, _ = draft_one(svc, "r", list(range(6)), feats, root, 6, SpecParams("domino"))
    svc.release("r")
    hd, base = block_logits_one(svc, "s", feats, root, 6)
    toks = [int(base[0].argmax())]
    with torch.inference_mode():
        for i in range(1, base.shape[0]):
            _, h = d.prefix_gru(emb(torch.tensor([[root] + toks])))
            toks.append(int((base[i] + d.correction(hd[i], h[0, 0])).argmax()))
    assert tree.draft_tokens.tolist() == toks
    assert tree.parents.tolist() == list(range(-1, len(toks) - 1))


@pytest.mark.parametrize("method", [m for m in DFLASH_METHODS if m != "ar"])
@pytest.mark.parametrize("max_depth", [None, 3, 1, 0])
def test_every_method_returns_a_valid_tree(target, method, max_depth):
    svc = tiny_service(target, block_size=8)
    spec = SpecParams(method, budget=10, width=3, candidates=6)
    tree, timings = draft_one(svc, "r", list(range(9)), _feats(target, 9), 5, 9, spec, max_depth=max_depth)
    assert set(timings) == {"draft", "tree_build"}
    cap = 8 if max_depth is None else max_depth
    if cap == 0:
        assert tree.num_nodes == 0
        return
    tree.validate(budget=10 if method not in ("dflash", "domino") else cap, vocab_size=V)
    assert 1 <= tree.max_depth <= cap
    if method in ("dflash", "domino"):
        assert tree.num_nodes == cap  # a chain over every slot
    else:
        assert cap <= tree.num_nodes <= 10


def test_method_checks(target):
    plain = tiny_service(target, tiny_drafter(target, projector_type=None))
    assert set(plain.info()["methods"]) == {"ar", "dflash", "ddtree"}
    assert set(tiny_service(target).info()["methods"]) == set(DFLASH_METHODS)
    for m in HEAD_METHODS:
        with pytest.raises(ValueError, match="correction head"):
            draft_one(plain, "r", [1], _feats(target, 1), 2, 1, SpecParams(m))
    with pytest.raises(ValueError, match="does not draft"):
        draft_one(plain, "r", [1], _feats(target, 1), 2, 1, SpecParams("ar"))


def test_the_one_drafter_assembly_borrows_in_the_drafters_dtype_and_passes_options(target):
    """``build_drafter``: the target's modules as they are without a dtype, frozen float32 copies for
    a float32 drafter next to a bfloat16 target, the drafter family's service with the options given
    (here the block's rows), and a service that drafts the same tree as one made by hand."""
    from services.drafter.build import build_drafter
    from services.drafter.service import DrafterService

    d = tiny_drafter(target, block_size=6)
    svc = build_drafter(d, target.embed_tokens(), target.lm_head(), packed_gemm=False, block_rows=4)
    assert isinstance(svc, DrafterService) and svc.embed is target.embed_tokens() and svc.block_rows == 4
    by_hand = DrafterService(d, target.embed_tokens(), target.lm_head(), packed_gemm=False, block_rows=4)
    spec = SpecParams("dartree-pruned", budget=6, width=3)
    feats = _feats(target, 5)
    a, _ = draft_one(svc, "r", [1, 2, 3, 4, 5], feats, 7, 5, spec)
    b, _ = draft_one(by_hand, "r", [1, 2, 3, 4, 5], feats, 7, 5, spec)
    assert torch.equal(a.draft_tokens, b.draft_tokens) and torch.equal(a.parents, b.parents)
    emb16 = torch.nn.Embedding(V, 32).to(torch.bfloat16)
    head16 = torch.nn.Linear(32, V, bias=False).to(torch.bfloat16)
    svc32 = build_drafter(d, emb16, head16, torch.float32, packed_gemm=False)
    assert svc32.embed.weight.dtype is torch.float32 and torch.equal(svc32.embed.weight, emb16.weight.float())
    with pytest.raises(TypeError):
        build_drafter(d, target.embed_tokens(), target.lm_head(), no_such_option=1)

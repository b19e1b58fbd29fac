"""Tree-verify attention with a device-built mask (services/tree/tree_mask.py,
services/verifier/tree_attention.py) against today's dense reference: the host-built mask of
``derive_buffers`` / ``pack_segments`` and SDPA over it, then the runner and the engine with it."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from services.testing import random_tree, tiny_drafter, tiny_service
from services.tree import derive_buffers
from services.tree.draft_tree import tree_from_parents
from services.tree.batch import Segment, causal_segment, pack_segments
from services.tree.tree_mask import depths_from_parents, path_all, tree_mask_from_parents
from services.verifier.drafter_client import InprocDrafterClient
from services.verifier.engine import EngineConfig, SpecEngine
from services.verifier.runner import ModelRunner
from services.verifier.tree_attention import prefix_attention, tree_verify_attention
from tests.doubles.segments import LockstepSlots
from tests.engine.conftest import V
from tests.engine.test_batched import _mixed_requests, _run_batched, _solo


def test_device_mask_of_the_worked_example():
    mask = tree_mask_from_parents(torch.tensor([-1, 0, 0, 1]))
    assert mask.int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    assert tree_mask_from_parents(torch.tensor([-1, 0, 1])).int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert tree_mask_from_parents(torch.tensor([-1])).tolist() == [[True]]
    # a forest (two segments side by side): blocks on the diagonal, nothing across
    forest = tree_mask_from_parents(torch.tensor([-1, 0, -1, 2, 2]))
    assert forest.int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0],
                                     [0, 0, 1, 0, 1]]


@pytest.mark.parametrize("seed", range(6))
def test_device_mask_equals_host_mask_on_random_trees(seed):
    rng = random.Random(seed)
    for nodes in (1, 2, 5, 17, 31, 32, 33, 64, 128):
        b = derive_buffers(random_tree(rng, V, nodes, rng.randrange(1, 12)), 7)
        assert torch.equal(tree_mask_from_parents(b.parent_rows), b.tree_mask), nodes
        assert torch.equal(depths_from_parents(b.parent_rows), b.position_offsets), nodes
    chain = derive_buffers(tree_from_parents(list(range(40)), [-1] + list(range(39))), 1)  # depth 40
    assert torch.equal(tree_mask_from_parents(chain.parent_rows), chain.tree_mask)


def test_batched_masks_equal_one_tree_at_a_time():
    rng = random.Random(9)
    parents = torch.full((5, 20), -1, dtype=torch.long)
    for i in range(5):  # trees of different sizes, padded with roots
        b = derive_buffers(random_tree(rng, V, rng.randrange(0, 19), 6), 1)
        parents[i, :b.parent_rows.numel()] = b.parent_rows
    batched = tree_mask_from_parents(parents)
    assert batched.shape == (5, 20, 20)
    for i in range(5):
        assert torch.equal(batched[i], tree_mask_from_parents(parents[i]))


def test_segment_parents_from_its_mask_and_a_chunk():
    b = derive_buffers(random_tree(random.Random(3), V, 20, 5), 1)
    seg = Segment(b.input_ids, b.position_offsets, b.tree_mask, 0, 0)  # no parent rows given
    assert torch.equal(seg.parents(), b.parent_rows)
    assert causal_segment([5, 6, 7], 4, 0).parents().tolist() == [-1, 0, 1]


def test_path_all_flags_every_ancestor():
    parents = torch.tensor([-1, 0, 0, 1, 3, 2])
    flags = torch.tensor([True, True, False, True, False, True])
    assert path_all(parents, flags).tolist() == [True, True, False, True, False, False]


def _dense_reference(q, k, v, start, tree_mask, scale):
    """Today's call: SDPA over the slot with a host-style dense mask [1, 1, R, L]."""
    r, length = tree_mask.shape[0], k.shape[1]
    dense = torch.zeros(r, length, dtype=torch.bool)
    dense[:, :start] = True
    dense[:, start:start + r] = tree_mask
    return F.scaled_dot_product_attention(q, k[None], v[None], attn_mask=dense[None, None], scale=scale,
                                          enable_gqa=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_attention_equals_dense_reference_for_1_to_129_rows(dtype):
    """float32: within 1e-6 (the log-sum-exp merge sums in another order: not bitwise); bfloat16:
    within bfloat16 rounding of the float32 reference. Slot views of a larger cache, no copies."""
    gen = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    hq, hkv, dh, scale = 9, 3, 64, 0.125
    for rows in list(range(1, 18)) + [31, 33, 64, 65, 128, 129]:
        start = rng.choice([0, 1, 37, 250])
        cache = torch.randn(2, 3, hkv, start + rows + 20, dh, generator=gen)  # [K/V, slots, Hkv, C, Dh]
        q = torch.randn(1, hq, rows, dh, generator=gen)
        parents = torch.tensor([-1] + [rng.randrange(i) for i in range(1, rows)])
        mask = tree_mask_from_parents(parents)
        k, v = cache[0, 1, :, :start + rows + 5], cache[1, 1, :, :start + rows + 5]  # views, 5 columns past
        ref = _dense_reference(q, k, v, start, mask, scale)
        got = tree_verify_attention(q.to(dtype), k.to(dtype), v.to(dtype), start, mask, scale)
        assert got.dtype == dtype and got.shape == ref.shape
        if dtype == torch.float32:
            torch.testing.assert_close(got, ref, atol=1e-6, rtol=0, msg=f"{rows} rows at {start}")
        else:
            torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2, msg=f"{rows} rows at {start}")


def test_prefix_attention_returns_the_log_sum_exp():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 3, n, 16, generator=gen) for n in (7, 40, 40))
    out, lse = prefix_attention(q, k, v, 0.25)
    s = q @ k.transpose(-1, -2) * 0.25
    torch.testing.assert_close(lse, s.logsumexp(-1), atol=1e-6, rtol=0)
    torch.testing.assert_close(out, s.softmax(-1) @ v, atol=1e-6, rtol=0)


def test_tree_attention_refuses_shapes_that_do_not_fit():
    q, k = torch.zeros(1, 4, 3, 8), torch.zeros(2, 10, 8)
    with pytest.raises(ValueError, match="do not fit"):
        tree_verify_attention(q, k, k, 8, torch.ones(3, 3, dtype=torch.bool), 1.0)  # 8 + 3 > 10 columns


def test_pack_without_mask_keeps_the_layout():
    segs = [causal_segment([1, 2], 3, 0), causal_segment([4], 0, 1)]
    full, bare = pack_segments(segs, 4), pack_segments(segs, 4, with_mask=False)
    assert bare.attn_mask.shape == (2, 1, 2, 0)
    for f in ("input_ids", "positions", "cu_rows", "row_index", "padded_pos", "write_slot", "write_pos"):
        assert torch.equal(getattr(full, f), getattr(bare, f)), f


def test_tree_attention_runner_equals_dense_runner(target):
    """Random trees, prompt chunks and lone rows across commits: logits, features and slot KV of the
    tree-attention runner equal the dense runner's (float32, to rounding)."""
    dense = ModelRunner(target, num_slots=4, capacity=200, kv_bucket=8)
    tree = ModelRunner(target, num_slots=4, capacity=200, kv_bucket=8, tree_attention=True)
    assert tree.tree_attention and not dense.tree_attention  # CPU keeps the dense calls by default
    rng = random.Random(0)
    walk = LockstepSlots((dense, tree))
    for step in range(6):
        segs = walk.segments(rng, step, V)
        a, b = dense.execute(segs), tree.execute(segs)
        torch.testing.assert_close(b.logits, a.logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(b.features, a.features, atol=1e-5, rtol=0)
        walk.commit(segs)


def test_tree_attention_refused_with_padded_steps(target):
    with pytest.raises(ValueError, match="excludes compile and cuda_graphs"):
        ModelRunner(target, num_slots=2, capacity=64, cuda_graphs=True, tree_attention=True)


@pytest.mark.parametrize("seed,n", [(1, 4)])
def test_tree_attention_engine_equals_plain_solo(target, seed, n):
    """Requests of every method on the tree-attention runner emit exactly what each emits alone on
    the dense runner (T = 0, float32): speculative output unchanged."""
    service = tiny_service(target, tiny_drafter(target, seed=3, block_size=6))
    reqs = _mixed_requests(seed, n)
    arrivals = {2 * (i % 3): [] for i in range(n)}
    for i, r in enumerate(reqs):
        arrivals[2 * (i % 3)].append(r)
    config = EngineConfig(max_running=8, prefill_chunk=4, max_step_tokens=64)
    runner = ModelRunner(target, 8, SpecEngine.kv_positions(target, config), config.kv_bucket, tree_attention=True)
    engine = SpecEngine(target, InprocDrafterClient(service), config, max_draft_depth=5, runner=runner)
    got, _ = _run_batched(engine, arrivals)
    for rid, prompt, sampling, spec in reqs:
        assert got[rid] == _solo(target, service, prompt, sampling, spec), (rid, spec.method)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tree_attention_on_cuda_equals_dense_reference(dtype):
    """On a GPU the prefix call is the flash kernel (bfloat16) or the matmul fallback (float32);
    either way the merged result equals SDPA over the dense mask to the dtype's rounding."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    hq, hkv, dh = 32, 8, 128  # Qwen3-4B's attention shape
    for rows, start in ((1, 300), (17, 0), (65, 1000), (129, 37)):
        cache = torch.randn(2, hkv, start + rows + 8, dh, generator=gen, device="cuda", dtype=dtype)
        q = torch.randn(1, hq, rows, dh, generator=gen, device="cuda", dtype=dtype)
        parents = torch.tensor([-1] + [random.Random(rows).randrange(i) for i in range(1, rows)], device="cuda")
        mask = tree_mask_from_parents(parents)
        k, v = cache[0, :, :start + rows], cache[1, :, :start + rows]
        ref = _dense_reference(q.float().cpu(), k.float().cpu(), v.float().cpu(), start, mask.cpu(), dh ** -0.5)
        got = tree_verify_attention(q, k, v, start, mask, dh ** -0.5)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(got.float().cpu(), ref, atol=tol, rtol=tol, msg=f"{rows} rows at {start}")


@pytest.mark.gpu
def test_tree_attention_runner_on_cuda_equals_dense_runner():
    """The eager CUDA runner (``cuda_graphs=False``: tree attention by default) against the dense
    per-request calls."""
    from services.testing import tiny_target
    from tests.engine.conftest import TARGET_KW

    target = tiny_target("qwen3", **TARGET_KW)
    target.model.to("cuda")
    target.device = torch.device("cuda")
    tree = ModelRunner(target, num_slots=4, capacity=200, kv_bucket=8, cuda_graphs=False)
    dense = ModelRunner(target, num_slots=4, capacity=200, kv_bucket=8, cuda_graphs=False, tree_attention=False)
    assert tree.tree_attention and not dense.tree_attention
    rng = random.Random(0)
    walk = LockstepSlots((dense, tree))
    for step in range(6):
        segs = walk.segments(rng, step, V)
        a, b = dense.execute(segs), tree.execute(segs)
        torch.testing.assert_close(b.logits, a.logits, atol=1e-4, rtol=1e-4)
        walk.commit(segs)

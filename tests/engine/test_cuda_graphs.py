"""services/cuda_graphs.py: replaying a captured step equals running it eagerly (R8 oracle 3, fast ==
reference). The eager fallback and the argument checks run everywhere; capture itself needs a GPU
(``gpu`` marker, skipped without CUDA).
"""

from __future__ import annotations

import pytest
import torch

from services.cuda_graphs import GraphBuckets, GraphedStep, graphs_enabled, pick_bucket


def _mlp(seed: int = 0, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(16, 32, generator=g).to(device)
    w2 = torch.randn(32, 8, generator=g).to(device)

    def fn(x):  # [R, 16] -> ([R, 8], [R])
        y = torch.relu(x @ w1) @ w2
        return y, y.sum(-1)
    return fn


def test_eager_fallback_on_cpu_is_the_function_itself():
    fn = _mlp()
    x = torch.randn(4, 16)
    step = GraphedStep(fn, [x])
    assert not step.captured
    for _ in range(2):
        x = torch.randn(4, 16)
        got, ref = step(x), fn(x)
        assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_shape_or_dtype_outside_the_bucket_is_one_clear_error():
    step = GraphedStep(_mlp(), [torch.randn(4, 16)])
    with pytest.raises(ValueError, match=r"input 0: \(5, 16\).*pad to the bucket"):
        step(torch.randn(5, 16))
    with pytest.raises(ValueError, match="float64"):
        step(torch.randn(4, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="takes 1 inputs"):
        step(torch.randn(4, 16), torch.randn(4, 16))
    with pytest.raises(ValueError, match="at least one"):
        GraphedStep(_mlp(), [])


def test_pick_bucket():
    assert pick_bucket(1, [17, 9, 33]) == 9
    assert pick_bucket(9, [9, 17, 33]) == 9
    assert pick_bucket(10, [9, 17, 33]) == 17
    with pytest.raises(ValueError, match="exceeds the largest bucket 33"):
        pick_bucket(34, [9, 17, 33])
    with pytest.raises(ValueError):
        pick_bucket(0, [9])


def test_buckets_make_one_step_per_key_and_switch_off(monkeypatch):
    made = []

    def make(key):
        made.append(key)
        return _mlp(seed=key)

    b = GraphBuckets(make, max_graphs=2)
    for key in (1, 2, 1, 2):
        x = torch.randn(3, 16)
        assert torch.equal(b.run(key, x)[0], _mlp(seed=key)(x)[0])
    assert made == [1, 2] and b.num_captured() == 0
    with pytest.raises(ValueError, match="more than 2 graph buckets"):
        b.run(3, torch.randn(3, 16))
    monkeypatch.setenv("DARTREE_CUDA_GRAPHS", "0")
    assert not graphs_enabled()


def test_buckets_overflow_can_run_eagerly():
    """``overflow="eager"``: a key past ``max_graphs`` runs its callable uncaptured (same result, counted)."""
    b = GraphBuckets(lambda key: _mlp(seed=key), max_graphs=1, overflow="eager")
    x = torch.randn(3, 16)
    assert torch.equal(b.run(1, x)[0], _mlp(seed=1)(x)[0])
    assert torch.equal(b.run(2, x)[0], _mlp(seed=2)(x)[0])
    assert list(b.steps) == [1] and b.num_eager_overflow == 1
    with pytest.raises(ValueError, match="overflow"):
        GraphBuckets(lambda key: _mlp(), overflow="drop")


# ---------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_replay_equals_eager_for_new_inputs():
    fn = _mlp(device="cuda")
    step = GraphedStep(fn, [torch.randn(4, 16, device="cuda")])
    assert step.captured
    outs = []
    for seed in range(3):
        x = torch.randn(4, 16, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))
        got, ref = step(x), fn(x)
        assert all(torch.equal(a, b) for a, b in zip(got, ref))
        outs.append(got[0])
    assert outs[0] is outs[1]  # static outputs: the next replay overwrites them


@pytest.mark.gpu
def test_in_place_writes_into_a_static_buffer_replay_like_a_kv_cache():
    cache = torch.zeros(32, 8, device="cuda")  # [T, H], pre-allocated like SlotKVCache
    ref = cache.clone()

    def write(pos, x):  # pos [R] long, x [R, H]: the step's K/V rows land at their positions
        cache.index_copy_(0, pos, x * 2)
        return cache[:16].sum(0)

    step = GraphedStep(write, [torch.arange(24, 28, device="cuda"), torch.zeros(4, 8, device="cuda")])
    cache.zero_()  # warm-up ran the write for real: start the comparison from a clean cache
    for start in (0, 4, 9):
        pos, x = torch.arange(start, start + 4, device="cuda"), torch.randn(4, 8, device="cuda")
        got = step(pos, x).clone()
        ref.index_copy_(0, pos, x * 2)
        assert torch.equal(cache, ref) and torch.equal(got, ref[:16].sum(0))


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_graphed_hf_forward_equals_eager(arch):
    """A whole HF decoder forward (rotary, norms, SDPA, lm_head) captured per row bucket."""
    from services.testing import tiny_causal_lm

    model = tiny_causal_lm(arch, vocab_size=256, hidden_size=64, num_layers=2).to("cuda")

    def forward(ids, pos):  # [1, R] each -> logits [1, R, V]
        return model(input_ids=ids, position_ids=pos, use_cache=False).logits

    with torch.inference_mode():
        buckets = GraphBuckets(lambda rows: forward)
        for rows in (9, 17, 9):
            ids = torch.randint(0, 256, (1, rows), device="cuda")
            pos = torch.arange(5, 5 + rows, device="cuda")[None]
            got = buckets.run(rows, ids, pos).clone()
            torch.testing.assert_close(got, forward(ids, pos), rtol=1e-5, atol=1e-5)
        assert buckets.num_captured() == 2

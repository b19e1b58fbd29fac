"""The device compaction of a step's accepted paths (SlotKVCache.commit_paths) against today's
per-slot commit, fed by the device walk (services/tree/device_walk.py) and by the host walk."""

from __future__ import annotations

import random

import pytest
import torch

from services.testing import random_tree
from services.tree import derive_buffers, walk
from services.tree.device_walk import unpack_walk, walk_segments
from services.verifier.kv_cache import SlotKVCache
from tests.tree.test_device_walk import _pack, _targets

V = 50


def _two_caches(seed: int):
    a = SlotKVCache(num_layers=3, num_kv_heads=2, head_dim=4, num_slots=5, capacity=120)
    b = SlotKVCache(num_layers=3, num_kv_heads=2, head_dim=4, num_slots=5, capacity=120)
    gen = torch.Generator().manual_seed(seed)
    for la, lb in zip(a.keys + a.values, b.keys + b.values):
        la.copy_(torch.randn(la.shape, generator=gen))
        lb.copy_(la)
    return a, b


@pytest.mark.parametrize("seed", range(4))
def test_commit_paths_equals_per_slot_commit(seed):
    rng = random.Random(seed)
    host, dev = _two_caches(seed)
    slots = [host.alloc() for _ in range(4)]
    assert slots == [dev.alloc() for _ in range(4)]
    for _ in range(5):  # rounds: every slot verifies a random tree at its length, then commits
        step = rng.sample(slots, rng.randrange(1, 5))
        starts = [host.length(s) for s in step]
        items = []
        for s in step:
            b = derive_buffers(random_tree(rng, V, rng.randrange(0, 16), rng.randrange(1, 6)), rng.randrange(V))
            items.append((b, _targets(rng, b, rng.choice([0.3, 0.8, 1.0]))))
        for s, start, (b, t) in zip(step, starts, items):
            host.commit(s, start, walk(b, t).accepted_rows)
        out = walk_segments(*_pack(items))
        lengths = [len(rows) for rows, _ in unpack_walk(out.packed())]  # the round's one host read
        dev.commit_paths(step, starts, out.accepted_rows, lengths)
        for s in slots:
            assert dev.length(s) == host.length(s)
        for layer, (ka, kb) in enumerate(zip(host.keys + host.values, dev.keys + dev.values)):
            assert torch.equal(ka, kb), layer  # every column, committed or not


def test_commit_paths_refuses_a_wrong_start():
    cache, _ = _two_caches(0)
    slot = cache.alloc()
    cache.extend(slot, 3)
    with pytest.raises(ValueError, match="commit expects 2"):
        cache.commit_paths([slot], [2], torch.tensor([[0, 1]]), [2])
    with pytest.raises(ValueError, match="commit expects"):
        cache.commit_paths([slot], [3], torch.tensor([[0]]), [118])  # past the capacity


@pytest.mark.gpu
def test_device_walk_and_commit_on_cuda_equal_the_host_ones():
    rng = random.Random(5)
    host, _ = _two_caches(5)
    dev = SlotKVCache(num_layers=3, num_kv_heads=2, head_dim=4, num_slots=5, capacity=120, device="cuda")
    for a, b in zip(host.keys + host.values, dev.keys + dev.values):
        b.copy_(a)
    slots = [host.alloc() for _ in range(3)]
    assert slots == [dev.alloc() for _ in range(3)]
    starts = [0, 0, 0]
    items = []
    for _ in slots:
        b = derive_buffers(random_tree(rng, V, 12, 4), 1)
        items.append((b, _targets(rng, b, 0.9)))
    for s, (b, t) in zip(slots, items):
        host.commit(s, 0, walk(b, t).accepted_rows)
    ids, parents, cu, targets, width = _pack(items)
    out = walk_segments(ids.cuda(), parents.cuda(), cu.cuda(), targets.cuda(), width)
    lengths = [len(rows) for rows, _ in unpack_walk(out.packed())]
    dev.commit_paths(slots, starts, out.accepted_rows, lengths)
    for ka, kb in zip(host.keys + host.values, dev.keys + dev.values):
        assert torch.equal(ka, kb.cpu())

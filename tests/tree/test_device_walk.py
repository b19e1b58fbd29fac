"""The device accept walk of a packed step (services/tree/device_walk.py) against the host walk."""

from __future__ import annotations

import random

import torch

from services.testing import random_tree
from services.tree import derive_buffers, walk
from services.tree.device_walk import unpack_walk, walk_segments
from services.tree.draft_tree import DraftTree, tree_from_parents

V = 50


def _targets(rng: random.Random, buffers, follow: float) -> torch.Tensor:
    """``[N+1]`` target tokens from logits whose argmax is, with probability ``follow``, the token of
    one of the row's children (so paths get accepted), else a random token."""
    ids, parents = buffers.input_ids.tolist(), buffers.parent_rows.tolist()
    children: dict[int, list[int]] = {}
    for row, p in enumerate(parents):
        children.setdefault(p, []).append(row)
    logits = torch.randn(len(ids), V, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
    for row in range(len(ids)):
        if children.get(row) and rng.random() < follow:
            logits[row, ids[rng.choice(children[row])]] = 100.0
    return logits.argmax(-1)


def _pack(items):
    """Concatenate per-segment (buffers, targets) into the flattened inputs of walk_segments."""
    bounds = [0]
    for b, _ in items:
        bounds.append(bounds[-1] + b.input_ids.numel())
    cat = lambda f: torch.cat([f(b, t) for b, t in items])  # noqa: E731
    return (cat(lambda b, t: b.input_ids), cat(lambda b, t: b.parent_rows), torch.tensor(bounds),
            cat(lambda b, t: t), max(b.input_ids.numel() for b, _ in items))


def test_literal_walks_mismatch_at_root_mid_path_and_full_accept():
    # rows [r, a, b, c]: a, b below r; c below a (derive_buffers' worked example), tokens a=5, b=6, c=7
    b = derive_buffers(tree_from_parents([5, 6, 7], [-1, -1, 0]), 1)
    cases = {(9, 0, 0, 0): ([0], 9), (5, 8, 0, 0): ([0, 1], 8), (5, 7, 0, 4): ([0, 1, 3], 4),
             (6, 0, 3, 0): ([0, 2], 3)}
    items = [(b, torch.tensor(t)) for t in cases]
    out = walk_segments(*_pack(items))
    assert out.accepted_rows.shape == (4, 4)
    assert unpack_walk(out.packed()) == list(cases.values())
    assert out.accept_lengths.tolist() == [0, 1, 2, 1]


def test_device_walk_equals_host_walk_on_random_trees():
    rng = random.Random(0)
    for _ in range(40):
        items = []
        for _ in range(rng.randrange(1, 6)):
            tree = random_tree(rng, V, rng.choice([0, 1, 3, 8, 20, 40, 64]), rng.randrange(1, 9))
            b = derive_buffers(tree if tree.num_nodes else DraftTree.empty(), rng.randrange(V))
            items.append((b, _targets(rng, b, rng.choice([0.0, 0.5, 0.9, 1.0]))))
        ids, parents, cu, targets, width = _pack(items)
        out = walk_segments(ids, parents, cu, targets, width + rng.randrange(3))  # a wider static bound
        got = unpack_walk(out.packed())
        for (b, t), (rows, bonus) in zip(items, got):
            want = walk(b, t)
            assert rows == want.accepted_rows.tolist() and bonus == want.bonus_token
        assert out.packed().shape[0] == len(items)


def test_device_walk_reads_no_host_value():
    """Static shapes and no device read: the walk runs under a guard that fails on any host sync."""
    from tests.engine.test_padded_steps import _fail_on_host_sync

    rng = random.Random(1)
    b = derive_buffers(random_tree(rng, V, 30, 6), 3)
    args = _pack([(b, _targets(rng, b, 0.9))] * 3)
    with _fail_on_host_sync():
        walk_segments(*args)

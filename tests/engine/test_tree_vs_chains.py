"""Tree verify == chains (style.md R8.1): one tree forward gives every node the logits and tapped
features of running its root-to-node path as a plain causal sequence after the prefix."""

from __future__ import annotations

import random

import pytest
import torch

from services.testing import ARCHS, random_tree, tiny_target
from services.tree import derive_buffers

ATOL = 1e-5


def _plain(target, ids):
    """Logits [T, V] and features [T, F] of one causal forward without a cache."""
    with torch.inference_mode():
        out = target.model(input_ids=torch.tensor([ids]), use_cache=False)
    return out.logits[0].float(), target._features()


def _paths(buffers):
    """Root-to-node verify rows of every row (root first)."""
    parents = buffers.parent_rows.tolist()
    paths = []
    for r in range(len(parents)):
        path = [r]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        paths.append(path[::-1])
    return paths


@pytest.fixture(scope="module", params=ARCHS)
def target(request):
    return tiny_target(request.param, vocab_size=128, hidden_size=32, num_layers=3, target_layer_ids=[0, 2])


@pytest.mark.parametrize("prefix_len,num_nodes,max_depth,seed", [(9, 30, 6, 0), (1, 12, 12, 1), (23, 40, 3, 2)])
def test_tree_verify_equals_per_path_causal_runs(target, prefix_len, num_nodes, max_depth, seed):
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 128) for _ in range(prefix_len)]
    root = rng.randrange(3, 128)
    tree = random_tree(rng, 128, num_nodes, max_depth)
    assert tree.num_nodes == num_nodes and tree.max_depth > 2  # a real, branching tree
    assert len(set(tree.parents.tolist())) < num_nodes  # some node has several children
    buffers = derive_buffers(tree, root)
    cache = target.new_cache()
    target.prefill(prefix, cache)
    logits, feats = target.verify(buffers, cache, len(prefix))
    assert logits.shape == (num_nodes + 1, target.vocab_size)
    assert feats.shape == (num_nodes + 1, target.feature_dim)
    ids = buffers.input_ids.tolist()
    for row, path in enumerate(_paths(buffers)):
        ref_logits, ref_feats = _plain(target, prefix + [ids[r] for r in path])
        torch.testing.assert_close(logits[row], ref_logits[-1], atol=ATOL, rtol=0,
                                   msg=lambda m: f"row {row} (path {path}) logits: {m}")
        torch.testing.assert_close(feats[row].float(), ref_feats[-1].float(), atol=ATOL, rtol=0,
                                   msg=lambda m: f"row {row} (path {path}) features: {m}")


def test_tree_verify_on_an_empty_cache(target):
    """start = 0: the root is the first token of the sequence (no cached prefix)."""
    rng = random.Random(5)
    tree = random_tree(rng, 128, 10, 4)
    buffers = derive_buffers(tree, 7)
    logits, _ = target.verify(buffers, target.new_cache(), 0)
    ids = buffers.input_ids.tolist()
    for row, path in enumerate(_paths(buffers)):
        ref, _ = _plain(target, [ids[r] for r in path])
        torch.testing.assert_close(logits[row], ref[-1], atol=ATOL, rtol=0)


def test_tree_verify_depends_on_the_mask(target):
    """Sanity of the oracle itself: the same tokens run as one flat causal sequence give different
    logits for a node whose path skips an earlier sibling (so the comparison above has teeth)."""
    prefix = [5, 9, 3]
    tree = random_tree(random.Random(0), 128, 2, 1)  # two siblings below the root
    buffers = derive_buffers(tree, 11)
    cache = target.new_cache()
    target.prefill(prefix, cache)
    logits, _ = target.verify(buffers, cache, len(prefix))
    flat, _ = _plain(target, prefix + buffers.input_ids.tolist())
    assert (logits[2] - flat[-1]).abs().max() > 1e-3

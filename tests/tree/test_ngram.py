"""n-gram chains: the suffix matcher, the trie merge into a drafted tree, and the emitted-path count."""

from __future__ import annotations

import math
import random

import pytest
import torch

from services.drafter.ngram_drafts import NgramDrafts
from services.testing import random_tree
from services.tree import DraftTree, derive_buffers
from services.tree.draft_tree import tree_from_parents
from services.tree.ngram import NgramIndex, chain_hits, merge_chain


def _index(tokens, max_n=3, min_n=2):
    idx = NgramIndex(max_n, min_n)
    idx.extend(tokens)
    return idx


def _brute_propose(history, root, max_len, max_n=3, min_n=2):
    """The specification, by brute force: longest suffix first, latest earlier occurrence."""
    seq = history + [root]
    for n in range(min(max_n, len(seq)), min_n - 1, -1):
        suffix = seq[-n:]
        for start in range(len(seq) - n - 1, -1, -1):  # occurrences ending before the last token
            if seq[start:start + n] == suffix:
                return seq[start + n:start + n + max_len]
    return []


def test_propose_docstring_example():
    assert _index([5, 6, 7, 8, 5, 6]).propose(7, 8) == [8, 5, 6, 7]
    assert _index([5, 6, 7, 8, 5, 6]).propose(7, 2) == [8, 5]


def test_longest_suffix_wins_over_a_later_shorter_one():
    # (1, 2, 3) occurred first, followed by 40; (2, 3) occurred later, followed by 50
    hist = [1, 2, 3, 40, 9, 2, 3, 50, 9, 1, 2]
    assert _index(hist).propose(3, 1) == [40]
    assert _index(hist, max_n=2).propose(3, 1) == [50]


def test_latest_occurrence_wins_and_no_match_is_empty():
    assert _index([7, 8, 1, 7, 8, 2, 9]).propose(8, 1) == []  # (9, 8) never seen, (2, 9, 8) neither
    assert _index([4, 4, 4]).propose(4, 3) == [4]  # the latest (4, 4, 4) ends on the last token
    assert _index([7, 8, 1, 7, 8, 2, 7]).propose(8, 1) == [2]  # latest (7, 8) was followed by 2
    assert _index([1, 2, 3, 4]).propose(9, 4) == []
    assert _index([1, 2, 3, 4], min_n=1).propose(2, 2) == [3, 4]
    assert _index([]).propose(5, 3) == [] and _index([1, 2]).propose(1, 0) == []


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="min_n"):
        NgramIndex(2, 3)
    with pytest.raises(ValueError, match="min_n"):
        NgramIndex(3, 0)


@pytest.mark.parametrize("seed", range(40))
def test_matcher_equals_brute_force_on_random_histories(seed):
    rng = random.Random(seed)
    hist = [rng.randrange(4) for _ in range(rng.randrange(0, 60))]
    idx = NgramIndex(3, 2)
    for k in range(0, len(hist), 7):  # incremental extends equal one extend
        idx.extend(hist[k:k + 7])
    root, max_len = rng.randrange(4), rng.randrange(1, 9)
    assert idx.propose(root, max_len) == _brute_propose(hist, root, max_len)


def _tree():
    # root -> a(10) -> b(11); root -> c(12)
    return tree_from_parents([10, 12, 11], [-1, -1, 0], [-0.1, -0.5, -0.3])


def test_merge_shares_the_prefix_and_appends_the_rest():
    merged, added = merge_chain(_tree(), [10, 20, 21], max_new=4, max_depth=8)
    assert added == 2
    assert merged.draft_tokens.tolist() == [10, 12, 11, 20, 21]
    assert merged.parents.tolist() == [-1, -1, 0, 0, 3]
    assert merged.depths.tolist() == [1, 1, 2, 2, 3]
    step = math.log(0.5)
    assert merged.scores.tolist() == pytest.approx([-0.1, -0.5, -0.3, -0.1 + step, -0.1 + 2 * step])
    merged.validate()


def test_merge_of_a_chain_already_in_the_tree_adds_nothing():
    tree = _tree()
    merged, added = merge_chain(tree, [10, 11], max_new=4, max_depth=8)
    assert added == 0 and merged is tree


def test_merge_respects_max_new_and_max_depth():
    merged, added = merge_chain(_tree(), [30, 31, 32, 33], max_new=2, max_depth=8)
    assert added == 2 and merged.draft_tokens.tolist()[3:] == [30, 31]
    merged, added = merge_chain(_tree(), [10, 11, 40, 41], max_new=4, max_depth=3)
    assert added == 1 and merged.draft_tokens.tolist()[3:] == [40] and merged.max_depth == 3
    merged, added = merge_chain(DraftTree.empty(), [5, 6], max_new=4, max_depth=8)
    assert merged.parents.tolist() == [-1, 0] and added == 2


@pytest.mark.parametrize("seed", range(30))
def test_merge_keeps_random_trees_valid_and_within_the_allowance(seed):
    rng = random.Random(seed)
    n = rng.randrange(0, 20)
    tree = random_tree(rng, 6, n, 5) if n else DraftTree.empty()
    chain = [rng.randrange(6) for _ in range(rng.randrange(0, 8))]
    max_new, max_depth = rng.randrange(0, 5), rng.randrange(1, 7)
    merged, added = merge_chain(tree, chain, max_new, max_depth)
    merged.validate(budget=tree.num_nodes + max_new, vocab_size=6)  # unique siblings, topological, depths
    assert merged.num_nodes == tree.num_nodes + added and added <= max_new
    assert merged.max_depth <= max(tree.max_depth, max_depth)
    assert torch.equal(merged.draft_tokens[:tree.num_nodes], tree.draft_tokens)
    assert torch.equal(merged.parents[:tree.num_nodes], tree.parents)
    # the chain's merged prefix is a root path of the merged tree
    bufs = derive_buffers(merged, root_token=0)
    paths = {tuple(bufs.input_ids[r].item() for r in row if r > 0) for row in bufs.retrieve_indices.tolist()}
    kept = min(len(chain), max_depth)
    walked = chain_hits(merged, 0, chain[:kept])
    assert any(p[:walked] == tuple(chain[:walked]) for p in paths)


def test_chain_hits_counts_only_new_nodes_on_the_emitted_path():
    merged, _ = merge_chain(_tree(), [10, 20, 21], max_new=4, max_depth=8)
    assert chain_hits(merged, 3, [10, 20, 21, 99]) == 2
    assert chain_hits(merged, 3, [10, 20, 7]) == 1
    assert chain_hits(merged, 3, [10, 11]) == 0
    assert chain_hits(merged, 3, [12, 20]) == 0


def test_ngram_drafts_add_within_allowance_and_count_hits():
    store = NgramDrafts(max_nodes=3)
    prompt = [1, 2, 3, 4, 5, 6, 1, 2]
    tree = store.join("r", prompt, len(prompt), 3, DraftTree.empty(), max_depth=8)
    assert tree.draft_tokens.tolist() == [4, 5, 6] and store.counts() == (3, 0)
    # the target emitted 4, 5 (accepted) and then 9: two n-gram nodes were right
    tree = store.join("r", [3, 4, 5], len(prompt) + 3, 9, DraftTree.empty(), max_depth=8)
    assert store.counts() == (3, 2)
    store.release("r")
    assert store.join("r", [7, 7], 2, 7, DraftTree.empty(), max_depth=8).num_nodes == 1  # a fresh history
    with pytest.raises(ValueError, match="ngram_nodes"):
        NgramDrafts(max_nodes=0)


def test_the_switch_is_on_or_off_and_refused_with_eagle3():
    from services.drafter.build import ngram_options
    from services.drafter.worker import DrafterWorkerConfig
    from services.testing import tiny_eagle3, tiny_target

    assert DrafterWorkerConfig().ngram_draft == "off"
    with pytest.raises(ValueError, match="ngram_draft must be 'on' or 'off'"):
        DrafterWorkerConfig(ngram_draft="yes")
    target = tiny_target("llama", vocab_size=64, hidden_size=32, num_layers=3, target_layer_ids=[0, 1, 2])
    assert ngram_options(object(), False) == {} and ngram_options(object(), True) == {"ngram_nodes": 4}
    with pytest.raises(ValueError, match="--ngram-draft on needs"):
        ngram_options(tiny_eagle3(target), True)

"""DARTree built without host reads (``dartree(..., sync_free=True)``, the default off the CPU): the
same tree, bit for bit, as the build with the per-depth early stop and the host prune, on random
logits and on the tiny Domino drafter; and one device-to-host copy per build."""

from __future__ import annotations

import random

import pytest
import torch

from services.tree.dartree import dartree
from services.tree.scorer import MarkovScorer, TableScorer
from tests.engine.test_step_commit import _READS


def _same(a, b) -> None:
    for f in ("draft_tokens", "parents", "depths", "scores"):
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype and torch.equal(x, y), f


def _case(seed: int):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    depth, vocab = rng.randrange(1, 9), rng.choice([5, 20, 70])
    base = rng.choice([1.0, 3.0]) * torch.randn(depth, vocab, generator=gen)
    if rng.random() < 0.3:  # ties: a coarse grid of logits
        base = base.round()
    if rng.random() < 0.5:
        scorer = TableScorer(torch.randn(depth, vocab, vocab, generator=gen).round() if seed % 3 == 0
                             else torch.randn(depth, vocab, vocab, generator=gen))
    else:
        scorer = MarkovScorer(torch.randn(vocab, 4, generator=gen), torch.randn(vocab, 4, generator=gen))
    variant = rng.choice(["pruned", "fixed"])
    kw = dict(K=rng.choice([1, 3, 8, 64]), W=rng.choice([1, 2, 4, 12]), B=rng.choice([0, 1, 3, 9, 30, 64]),
              beta=rng.choice([0.0, -0.2, -1.0]) if variant == "pruned" else 0.0, variant=variant,
              pure_draft_prefix_len=rng.choice([0, 1, 2]), max_depth=rng.choice([None, 3]))
    return base, scorer, rng.randrange(vocab), kw


@pytest.mark.parametrize("block", range(4))
def test_sync_free_tree_equals_the_early_stop_tree(block):
    for seed in range(block * 50, block * 50 + 50):
        base, scorer, root, kw = _case(seed)
        _same(dartree(base, scorer, root, sync_free=True, **kw), dartree(base, scorer, root, sync_free=False, **kw))


class _Counting:
    """Counts Python-level reads of tensor values (each is a device-to-host copy on CUDA)."""

    def __enter__(self):
        self.count, self.saved = 0, {n: getattr(torch.Tensor, n) for n in _READS}

        def counting(name):
            def f(t, *a, **k):
                self.count += 1
                return self.saved[name](t, *a, **k)
            return f

        for n in _READS:
            setattr(torch.Tensor, n, counting(n))
        return self

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(torch.Tensor, n, f)


def test_sync_free_build_reads_once_and_the_early_stop_build_per_depth():
    gen = torch.Generator().manual_seed(0)
    base, scorer = torch.randn(8, 40, generator=gen), TableScorer(torch.randn(8, 40, 40, generator=gen))
    with _Counting() as c:
        tree = dartree(base, scorer, 3, K=10, W=4, B=12, beta=-0.2, sync_free=True)
    assert c.count == 1 and tree.num_nodes == 12
    with _Counting() as c:
        dartree(base, scorer, 3, K=10, W=4, B=12, beta=-0.2, sync_free=False)
    assert c.count > 1  # the counter sees the early stop's reads and the host prune


@pytest.mark.parametrize("method", ["dartree-pruned", "dartree-fixed"])
def test_sync_free_tree_equals_on_the_tiny_drafter(monkeypatch, method):
    """Every tree the tiny Domino drafter builds for greedy requests, built both ways, is the same."""
    import services.drafter.tree_builders as builders_mod
    from services.params import SamplingParams, SpecParams
    from services.testing import tiny_drafter, tiny_service, tiny_target
    from tests.engine.conftest import TARGET_KW
    from services.verifier.drafter_client import InprocDrafterClient
    from services.verifier.engine import SpecEngine

    built = []
    real = builders_mod.dartree

    def both(*a, **k):
        tree = real(*a, **k, sync_free=True)
        _same(tree, real(*a, **k, sync_free=False))
        built.append(tree.num_nodes)
        return tree

    monkeypatch.setattr(builders_mod, "dartree", both)
    llama = tiny_target("llama", **TARGET_KW)
    svc = tiny_service(llama, tiny_drafter(llama, seed=3, block_size=6))
    engine = SpecEngine(llama, InprocDrafterClient(svc), max_draft_depth=5)
    rng = random.Random(4)
    for i in range(3):
        prompt = [rng.randrange(3, 120) for _ in range(rng.randrange(3, 12))]
        spec = SpecParams(method, budget=rng.choice([None, 5, 20]), width=rng.choice([None, 2, 6]))
        for _ in engine.generate(f"g{i}", prompt, SamplingParams(max_tokens=12, ignore_eos=True), spec):
            pass
    assert len(built) >= 6 and max(built) > 1

"""Target features the verifier keeps for the drafter and the prefix cache: one copy of each row.

A request's features live in ``hist_feats`` (the prefix cache's rows when it finishes); its draft
context ``ctx_feats`` is the tail of the same rows. After plain rounds the first draft concatenates
the context once, and that concatenation replaces its parts in the history (no second copy of the
prompt's rows); a prompt chunk keeps only its own rows, not its whole step's features.

Oracle for the values: the target's features of the committed ids from one causal forward
(:meth:`TargetModel.teacher_forced`), to float32 rounding (the batched step's GEMMs run on other
row counts); the drafter receives bitwise the rows the prefix cache keeps.
"""

from __future__ import annotations

import random

import pytest
import torch

from services.testing import tiny_drafter, tiny_service
from services.verifier.drafter_client import InprocDrafterClient
from services.params import SamplingParams, SpecParams
from services.verifier.engine import EngineConfig, SpecEngine
from services.verifier.policy import FixedPolicy
from tests.doubles import next_output
from tests.engine.conftest import V


class PlainFirst(FixedPolicy):
    """:class:`FixedPolicy` that gives each request ``plain`` plain rounds before it drafts."""

    def __init__(self, plain: int):
        super().__init__()
        self.plain, self.calls = plain, {}

    def draft_knobs(self, rid, spec):
        self.calls[rid] = self.calls.get(rid, 0) + 1
        return None if self.calls[rid] <= self.plain else super().draft_knobs(rid, spec)


class Recording(InprocDrafterClient):
    """Records the features of every draft job it submits and, with ``engine`` set, the bytes and
    rows the submitting request holds then (``hist_feats`` and ``ctx_feats``)."""

    def __init__(self, service):
        super().__init__(service)
        self.sent: list[tuple[str, torch.Tensor]] = []
        self.held: list[tuple[int, int]] = []
        self.engine = None

    def submit(self, jobs):
        self.sent += [(j.request_id, j.features) for j in jobs]
        for j in jobs:
            if self.engine is not None:
                req = self.engine._reqs[j.request_id]
                rows = sum(f.shape[0] for f in req.drafts.hist_feats)
                self.held.append((_storage_bytes(req.drafts.hist_feats + [req.drafts.ctx_feats]), rows * _row_bytes(j.features)))
        return super().submit(jobs)


@pytest.fixture(scope="module")
def service(target):
    return tiny_service(target, tiny_drafter(target, seed=3, block_size=6))


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, V - 1) for _ in range(n)]


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _row_bytes(t: torch.Tensor) -> int:
    return t.shape[1] * t.element_size()


def test_first_draft_after_plain_rounds_keeps_one_copy_of_the_context(target, service):
    client = Recording(service)
    engine = SpecEngine(target, client, EngineConfig(max_running=1, prefill_chunk=8), max_draft_depth=5,
                        policy=PlainFirst(plain=3))
    client.engine = engine
    prompt = _prompt(1, 21)
    engine.add_request("r", prompt, SamplingParams(max_tokens=30, ignore_eos=True), SpecParams("dartree-pruned"))
    req = engine._reqs["r"]
    while not client.sent:
        next_output(engine, "r")
    sent = client.sent[0][1]
    assert sent.shape[0] == len(prompt) + 3  # the prompt and the rows of the 3 plain rounds, in one tensor
    held, rows = client.held[0]
    assert held == rows  # at the draft: every committed row held once
    assert torch.equal(torch.cat(req.drafts.hist_feats)[:sent.shape[0]], sent)  # a first draft: positions 0 on
    engine.abort("r")  # the module's drafter service forgets its context


def test_drafter_and_prefix_cache_get_the_targets_features(target, service):
    client = Recording(service)
    engine = SpecEngine(target, client, EngineConfig(max_running=1, prefill_chunk=8), max_draft_depth=5,
                        policy=PlainFirst(plain=2))
    prompt = _prompt(2, 19)
    outs = list(engine.generate("q", prompt, SamplingParams(max_tokens=16, ignore_eos=True),
                                SpecParams("dartree-pruned")))
    entry = engine.runner.cache.prefix.entry(0)
    assert entry is not None and entry.tokens[:len(prompt)] == prompt
    assert len(entry.tokens) >= len(prompt) + sum(len(o.token_ids) for o in outs) - 1
    _, ref = target.teacher_forced(entry.tokens)
    torch.testing.assert_close(entry.features, ref, rtol=1e-4, atol=1e-5)
    first = client.sent[0][1]
    assert torch.equal(first, entry.features[:first.shape[0]])  # the drafter's rows are the cached rows


def test_a_prompt_chunk_keeps_only_its_own_rows(target, service):
    engine = SpecEngine(target, InprocDrafterClient(service),
                        EngineConfig(max_running=2, prefill_chunk=8, max_step_tokens=16), max_draft_depth=5)
    sampling, spec = SamplingParams(max_tokens=4, ignore_eos=True), SpecParams("dartree-pruned")
    engine.add_request("a", _prompt(3, 21), sampling, spec)
    engine.add_request("b", _prompt(4, 21), sampling, spec)
    engine.step_batch(["a", "b"])  # one step: a chunk of each prompt
    for rid in ("a", "b"):
        (chunk,) = engine._reqs[rid].drafts.chunk_feats
        assert chunk.shape[0] == 8
        assert chunk.untyped_storage().nbytes() == 8 * _row_bytes(chunk)  # not the step's 16 rows

"""A scripted engine for the verifier worker and a scripted service for the drafter worker.

Neither loads a model (style.md R10: mock the model, not the machinery): :class:`FakeEngine` runs
batched steps of scripted rounds with ``SpecEngine``'s interface, :class:`FakeDrafterService`
drafts chain trees with ``DrafterService``'s batched interface.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from services.verifier.requests import StepStats


@dataclass
class FakeRound:
    """Duck-typed ``RoundOutput``."""

    token_ids: list[int]
    finish_reason: str | None
    num_draft_tokens: int = 4
    accept_length: int = 0
    accepted_per_depth: list[int] = field(default_factory=list)
    timings: dict = field(default_factory=lambda: {"draft": 0.001, "verify": 0.002, "total": 0.004})
    prefill_seconds: float = 0.0
    is_prefill: bool = False
    logprobs: object = None
    drafted: bool = False
    predicted_tau: float | None = None
    stop_token_id: int | None = None


class FakeEngine:
    """``SpecEngine``'s worker-facing methods over scripted rounds; records each step and every free.

    Each request emits ``rounds[k]`` in its k-th round (round 0 is its prefill) and finishes with
    the last one. A step sleeps ``step_delay_s`` once, then runs one round of every request of its
    plan, in order. It has ``slots`` KV slots; each active request holds one. Its candidates are
    decode rounds that never draft (the worker plans them with a real :class:`FixedPolicy` and no
    row limit), so a plan holds every request it was given, in order.

    Attributes:
        batches: the request ids of each step; steps: the same, flattened (one entry per round);
        aborted: freed request ids, in order.
    """

    vocab_size, max_context, eos_token_ids = 400, 256, (2,)

    def __init__(self, rounds: list[list[int]] | None = None, step_delay_s: float = 0.0,
                 fail_on_step: int | None = None, fail_with: Exception | None = None, slots: int = 8):
        self.slots = slots
        self.rounds = rounds or [[5], [6, 7, 8], [9, 10], [11]]
        self.step_delay_s, self.fail_on_step, self.fail_with = step_delay_s, fail_on_step, fail_with
        self.active: dict[str, int] = {}
        self.batches: list[list[str]] = []
        self.steps: list[str] = []
        self.aborted: list[str] = []
        self.last_step = StepStats()
        self.lock = threading.Lock()
        self.drafter_up: list[bool] = []  # every set_drafter_up call, in order
        from types import SimpleNamespace

        from services.verifier.policy import FixedPolicy

        self.policy = FixedPolicy()
        self.config = SimpleNamespace(max_step_tokens=1 << 20, prefill_chunk=1 << 20)

    def set_drafter_up(self, up: bool) -> None:
        self.drafter_up.append(bool(up))

    def add_request(self, request_id, prompt_ids, sampling, spec) -> None:
        if 399 in prompt_ids:
            raise ValueError("prompt (1 tokens) + max_tokens (9999) exceeds the context window of 256 tokens")
        self.active[request_id] = 0

    def candidates(self, request_ids: list[str]) -> list:
        """Every request of ``request_ids`` as a decode round without a draft (``SpecEngine.candidates``)."""
        from services.verifier.scheduler import Candidate

        return [Candidate(rid, slot=i, prompt_len=0, prefilled=0) for i, rid in enumerate(dict.fromkeys(request_ids))]

    def step(self, plan) -> dict:
        """:meth:`step_batch` of the plan's requests, in the plan's order."""
        return self.step_batch([e.rid for e in plan.entries])

    def step_batch(self, request_ids: list[str]) -> dict:
        """One round of each request: ``{rid: FakeRound | exception}`` (a failed request is freed)."""
        time.sleep(self.step_delay_s)
        self.batches.append(list(request_ids))
        results: dict = {}
        for rid in request_ids:
            try:
                results[rid] = self._round(rid)
            except Exception as exc:
                results[rid] = exc
        self.last_step = StepStats(requests=len(request_ids), rows=len(request_ids))
        return results

    def _round(self, request_id: str) -> FakeRound:
        k = self.active[request_id]
        self.steps.append(request_id)
        if self.fail_on_step is not None and k == self.fail_on_step:
            self.abort(request_id)
            raise self.fail_with or RuntimeError("boom")
        self.active[request_id] = k + 1
        last = k == len(self.rounds) - 1
        ids = self.rounds[k]
        out = FakeRound(list(ids), "stop" if last else None, accept_length=len(ids) - 1,
                        accepted_per_depth=[1] * (len(ids) - 1), is_prefill=k == 0)
        if last:
            self.abort(request_id)
        return out

    def abort(self, request_id: str) -> None:
        if self.active.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def num_active(self) -> int:
        return len(self.active)

    def num_free_slots(self) -> int:
        return max(0, self.slots - len(self.active))


def next_output(engine, request_id: str):
    """Run one request of a real ``SpecEngine`` alone until it emits: its prefill (in chunks) and
    first token, or one round. A request waiting for another's prefill starts from what is
    committed (``alone``).

    Raises:
        KeyError: unknown request id; whatever its round raised (the engine then freed it).
    """
    return engine.next_output(request_id)


class FakeDrafterService:
    """``DrafterService`` stand-in: a chain tree ``root+1, root+2, ...`` of ``budget`` nodes per job."""

    def __init__(self, hang_s: float = 0.0, fail: bool = False, fail_ids: tuple[str, ...] = ()):
        self.hang_s, self.fail, self.fail_ids = hang_s, fail, set(fail_ids)
        self.contexts: dict[str, int] = {}
        self.calls: list[tuple] = []
        self.batches: list[list[str]] = []  # request ids of each draft_batch call

    def info(self) -> dict:
        from tests.service.fakes import METHODS

        return {"vocab_size": 400, "block_size": 4, "mask_token_id": 3, "feature_dim": 8, "max_position": 256,
                "methods": list(METHODS), "target_layer_ids": [1, 2], "description": "fake"}

    def num_contexts(self) -> int:
        return len(self.contexts)

    def _draft(self, job):
        from services.tree.draft_tree import tree_from_parents

        if job.request_id in self.fail_ids or self.fail:
            raise ValueError(f"scripted failure of {job.request_id}" if not self.fail else "scripted drafter failure")
        assert job.features.shape == (len(job.committed_ids), 8)
        self.calls.append((job.request_id, list(job.committed_ids), job.features.clone(), job.root_token, job.start,
                           job.method, job.max_depth))
        self.contexts[job.request_id] = job.start
        n = min(job.spec.budget, job.max_depth or 99)
        tree = tree_from_parents([job.root_token + 1 + i for i in range(n)], list(range(-1, n - 1)))
        return tree, {"draft": 0.0005, "tree_build": 0.0001}

    def draft_batch(self, jobs) -> list:
        """One chain tree per job after ``hang_s``; a job's error is returned in its place."""
        time.sleep(self.hang_s)
        self.batches.append([j.request_id for j in jobs])
        out = []
        for j in jobs:
            try:
                out.append(self._draft(j))
            except Exception as exc:
                out.append(exc)
        return out

    def release(self, request_id: str) -> None:
        self.contexts.pop(request_id, None)

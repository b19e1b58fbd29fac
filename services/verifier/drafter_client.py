"""How the engine reaches the drafter: one protocol, an in-process and a ZMQ implementation.

A step's drafts travel as one batch: ``submit(jobs)`` starts them (one :class:`DraftJob` per
request) and returns a handle per job; each request's round then ``collect``s its tree, or
``discard``s it when the request went away. The in-process client calls
:class:`services.drafter.service.DrafterService` directly (tests, ``dartree generate``);
``services.verifier.remote_drafter`` implements the same protocol over ZMQ, where the drafter
computes between ``submit`` and ``collect`` (the engine's overlap, ``EngineConfig.overlap``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from services.spec import TreeKnobs
from services.tree import DraftTree


@dataclass(frozen=True)
class DraftJob:
    """One request's draft in a batched drafter call.

    Attributes:
        request_id; committed_ids: tokens committed since the request's last draft (first draft:
        the prompt); features: ``[len(committed_ids), F]`` target features at those positions;
        root_token: the last committed token, at position ``start`` (not in the context); method:
        the speculative method (one that drafts); spec: the tree knobs, every one resolved by the
        verifier's policy; max_depth: cap on the tree's depth (None = the drafter's slots).
    """

    request_id: str
    committed_ids: list[int]
    features: Tensor
    root_token: int
    start: int
    method: str
    spec: TreeKnobs
    max_depth: int | None = None


class DrafterClient(Protocol):
    """What the engine calls on a drafter (and nothing else)."""

    def submit(self, jobs: list[DraftJob]) -> list:
        """Start ``jobs`` as one batch; one handle per job, in order."""
        ...

    def collect(self, handle) -> tuple[DraftTree, dict[str, float]]:
        """A submitted job's ``(tree, timings in seconds)``; raises what its draft raised."""
        ...

    def discard(self, handle) -> None:
        """Forget a submitted job (its result is dropped)."""
        ...

    def release(self, request_id: str) -> None:
        """Forget a request's drafter context (idempotent)."""
        ...

    def info(self) -> dict:
        """The drafter's handshake fields (``max_position`` among them; ``{}`` when unknown)."""
        ...


class _BatchHandle:
    """Job ``index`` of a drafted batch: its result, or the exception its draft raised."""

    def __init__(self, results: list, index: int):
        self.results, self.index = results, index

    def result(self) -> tuple[DraftTree, dict[str, float]]:
        """The job's ``(tree, timings)``; raises its error (out of memory: as a drafter process's
        error reply, a :class:`~services.verifier.remote_drafter.DrafterError` naming it)."""
        out = self.results[self.index]
        if isinstance(out, BaseException):
            from services.devices import is_out_of_memory

            if is_out_of_memory(out):
                from services.verifier.remote_drafter import DrafterError

                raise DrafterError(f"drafter: {type(out).__name__}: {out}") from out
            raise out
        return out


class InprocDrafterClient:
    """Calls a :class:`DrafterService` (or ``Eagle3Service``) in the same process: ``submit`` drafts
    the whole batch at once with ``draft_batch`` (one drafter forward), on the caller's thread.

    This is the engine's drafter in ``dartree generate``, the benchmarks and the tests, and in a
    server whose drafter runs inside the verifier process (``--drafter-placement verifier``,
    docs/design.md "Drafter placement").

    Args:
        service: the drafter service.
        metrics: a :class:`services.metrics.DrafterMetrics` to record calls, batch sizes, errors,
            live contexts and the per-phase compute seconds (None: nothing recorded).
        threads: intra-op CPU threads while drafting (``torch.set_num_threads`` around each
            ``draft_batch``, the previous count restored after; None: the process's own count).
    """

    def __init__(self, service, metrics=None, threads: int | None = None):
        self.service, self.metrics, self.threads = service, metrics, threads

    def submit(self, jobs: list[DraftJob]) -> list[_BatchHandle]:
        """Draft ``jobs`` now, as ONE batched forward; one handle per job for :meth:`collect`."""
        results = self._draft(list(jobs))
        if self.metrics is not None:
            self._record(len(jobs), results)
        return [_BatchHandle(results, i) for i in range(len(jobs))]

    def _draft(self, jobs: list[DraftJob]) -> list:
        if self.threads is None:
            return self.service.draft_batch(jobs)
        import torch

        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            return self.service.draft_batch(jobs)
        finally:
            torch.set_num_threads(before)

    def _record(self, num_jobs: int, results: list) -> None:
        from services.devices import is_out_of_memory

        m = self.metrics
        m.calls.labels("draft_batch").inc()
        m.batch_jobs.observe(num_jobs)
        for res in results:
            if isinstance(res, BaseException):
                m.errors.inc()
                if is_out_of_memory(res):
                    m.out_of_memory.inc()
            else:
                for phase, seconds in res[1].items():
                    m.seconds.labels(phase).observe(seconds)
        m.contexts.set(self.service.num_contexts())

    def collect(self, handle: _BatchHandle) -> tuple[DraftTree, dict[str, float]]:
        """The tree of a submitted job (re-raises its error)."""
        return handle.result()

    def discard(self, handle: _BatchHandle) -> None:
        """Forget a submitted job (already drafted: nothing to cancel)."""

    def release(self, request_id: str) -> None:
        self.service.release(request_id)
        if self.metrics is not None:
            self.metrics.calls.labels("release").inc()
            self.metrics.contexts.set(self.service.num_contexts())

    def info(self) -> dict:
        return self.service.info()

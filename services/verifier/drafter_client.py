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
        out = self.results[self.index]
        if isinstance(out, BaseException):
            raise out
        return out


class InprocDrafterClient:
    """Calls a :class:`DrafterService` (or ``Eagle3Service``) in the same process: ``submit`` drafts
    the whole batch at once with ``draft_batch`` (one drafter forward)."""

    def __init__(self, service):
        self.service = service

    def submit(self, jobs: list[DraftJob]) -> list[_BatchHandle]:
        """Draft ``jobs`` now, as ONE batched forward; one handle per job for :meth:`collect`."""
        results = self.service.draft_batch(list(jobs))
        return [_BatchHandle(results, i) for i in range(len(jobs))]

    def collect(self, handle: _BatchHandle) -> tuple[DraftTree, dict[str, float]]:
        """The tree of a submitted job (re-raises its error)."""
        return handle.result()

    def discard(self, handle: _BatchHandle) -> None:
        """Forget a submitted job (already drafted: nothing to cancel)."""

    def release(self, request_id: str) -> None:
        self.service.release(request_id)

    def info(self) -> dict:
        return self.service.info()

"""How the engine reaches the drafter: one protocol, an in-process and a ZMQ implementation.

The in-process client calls :class:`services.drafter.service.DrafterService` directly (tests,
``dartree generate``); ``services.verifier.remote_drafter`` implements the same protocol over ZMQ.

Besides the blocking ``draft``, a client may offer ``submit`` / ``collect`` / ``discard``: the
draft is started at ``submit`` and its tree picked up at ``collect``, so the drafter works while the
verifier runs another group's forward (the engine's overlap, ``EngineConfig.overlap``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from services.tree import DraftTree


@dataclass(frozen=True)
class DraftJob:
    """One request's draft in a batched drafter call (the in-process twin of ``DraftRequest``).

    Attributes:
        request_id; committed_ids: tokens committed since the request's last draft; features:
        ``[len(committed_ids), F]`` target features at those positions; root_token: the last
        committed token at position ``start``; spec: resolved method and knobs; max_depth: depth cap.
    """

    request_id: str
    committed_ids: list[int]
    features: Tensor
    root_token: int
    start: int
    spec: object
    max_depth: int | None = None


class _BatchHandle:
    """Job ``index`` of a submitted draft batch (a future of the whole batch's results)."""

    def __init__(self, future, index: int):
        self.future, self.index = future, index

    def result(self):
        out = self.future.result()[self.index]
        if isinstance(out, BaseException):
            raise out
        return out

    def cancel(self) -> None:  # the batch runs for the other jobs; this one's result is ignored
        pass


class _Done:
    """An already computed result, with a future's ``result``."""

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


class DrafterClient(Protocol):
    """What the engine calls each round (see ``DrafterService.draft`` for the arguments)."""

    def draft(self, request_id: str, committed_ids: list[int], features: Tensor, root_token: int, start: int,
              spec, max_depth: int | None = None) -> tuple[DraftTree, dict[str, float]]: ...

    def release(self, request_id: str) -> None: ...


class InprocDrafterClient:
    """Calls a :class:`DrafterService` in the same process; ``submit`` runs the draft on one
    background thread (torch releases the GIL inside its ops), in submission order."""

    def __init__(self, service):
        self.service = service
        self._pool = None

    def draft(self, request_id: str, committed_ids: list[int], features: Tensor, root_token: int, start: int,
              spec, max_depth: int | None = None) -> tuple[DraftTree, dict[str, float]]:
        if self._pool is not None:  # keep the service single-threaded once submit is in use
            return self.collect(self.submit(request_id, committed_ids, features, root_token, start, spec, max_depth))
        return self.service.draft(request_id, committed_ids, features, root_token, start, spec, max_depth=max_depth)

    def submit(self, request_id: str, committed_ids: list[int], features: Tensor, root_token: int, start: int,
               spec, max_depth: int | None = None):
        """Start a draft (same arguments as :meth:`draft`); returns a handle for :meth:`collect`."""
        from concurrent.futures import ThreadPoolExecutor

        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="drafter")
        return self._pool.submit(self.service.draft, request_id, list(committed_ids), features, root_token, start,
                                 spec, max_depth=max_depth)

    def collect(self, handle) -> tuple[DraftTree, dict[str, float]]:
        """The tree of a submitted draft (waits for it; re-raises its error)."""
        return handle.result()

    def discard(self, handle) -> None:
        """Forget a submitted draft (its result is dropped)."""
        handle.cancel()

    def submit_many(self, jobs: list[DraftJob]) -> list:
        """Start several requests' drafts as ONE batched drafter forward
        (``DrafterService.draft_batch``); one handle per job for :meth:`collect`. Without overlap
        in use the batch runs here, now."""
        if self._pool is None:
            fut = _Done(self.service.draft_batch(list(jobs)))
        else:
            fut = self._pool.submit(self.service.draft_batch, list(jobs))
        return [_BatchHandle(fut, i) for i in range(len(jobs))]

    def release(self, request_id: str) -> None:
        if self._pool is not None:  # after any draft of this request still queued
            self._pool.submit(self.service.release, request_id)
        else:
            self.service.release(request_id)

    def info(self) -> dict:
        return self.service.info()

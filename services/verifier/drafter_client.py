"""How the engine reaches the drafter: one protocol, an in-process and a ZMQ implementation.

The in-process client calls :class:`services.drafter.service.DrafterService` directly (tests,
``dartree generate``); ``services.verifier.remote_drafter`` implements the same protocol over ZMQ.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from services.tree import DraftTree


class DrafterClient(Protocol):
    """What the engine calls each round (see ``DrafterService.draft`` for the arguments)."""

    def draft(self, request_id: str, committed_ids: list[int], features: Tensor, root_token: int, start: int,
              spec, max_depth: int | None = None) -> tuple[DraftTree, dict[str, float]]: ...

    def release(self, request_id: str) -> None: ...


class InprocDrafterClient:
    """Calls a :class:`DrafterService` in the same process."""

    def __init__(self, service):
        self.service = service

    def draft(self, request_id: str, committed_ids: list[int], features: Tensor, root_token: int, start: int,
              spec, max_depth: int | None = None) -> tuple[DraftTree, dict[str, float]]:
        return self.service.draft(request_id, committed_ids, features, root_token, start, spec, max_depth=max_depth)

    def release(self, request_id: str) -> None:
        self.service.release(request_id)

    def info(self) -> dict:
        return self.service.info()

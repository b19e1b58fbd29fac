"""Test doubles with the production interfaces: scripted drafter clients and a scripted engine.

- :mod:`tests.doubles.drafters`: :class:`OracleDrafter`, :class:`RandomDrafter`,
  :class:`FullTreeDrafter`: drafter clients (``submit`` / ``collect`` / ``discard`` / ``release`` /
  ``info``) whose trees are scripted per job, so the engine runs its production path on them.
- :mod:`tests.doubles.engine`: :class:`FakeEngine` (batched steps of scripted rounds) and
  :class:`FakeDrafterService` (the drafter worker's service over chain trees); :func:`next_output`
  (a real engine's next output of one request run alone).
- :mod:`tests.doubles.segments`: :func:`random_segments` (random trees, prompt chunks and lone rows
  as verify segments) and :class:`LockstepSlots` (KV slots several runners commit in lockstep).
"""

from tests.doubles.drafters import (
    DraftCall,
    FullTreeDrafter,
    OracleDrafter,
    RandomDrafter,
    ScriptedDrafterClient,
)
from tests.doubles.engine import FakeDrafterService, FakeEngine, FakeRound, next_output

__all__ = ["DraftCall", "FakeDrafterService", "FakeEngine", "FakeRound", "FullTreeDrafter", "OracleDrafter",
           "RandomDrafter", "ScriptedDrafterClient", "next_output"]

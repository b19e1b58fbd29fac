"""Scripted drafter clients: the engine's drafter interface over trees a test decides.

:class:`ScriptedDrafterClient` gives every double the production client interface (``submit`` a
batch of :class:`DraftJob`, ``collect`` / ``discard`` each handle, ``release``, ``info``); a
subclass only says which tree one job gets (:meth:`ScriptedDrafterClient.draft_job`). Every job is
checked against the client contract (one feature row per committed token, a context that grows
exactly by the committed tokens) and recorded, so a test can compare the features the engine handed
over with a fresh teacher-forced forward.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from torch import Tensor

from services.testing import _shuffle_topological, random_tree, tree_from_nodes
from services.tree.draft_tree import DraftTree
from services.verifier.drafter_client import DraftJob


@dataclass
class DraftCall:
    """One recorded draft job."""

    request_id: str
    committed_ids: list[int]
    features: Tensor
    root_token: int
    start: int
    max_depth: int | None
    tree: DraftTree


class _Ready:
    """A scripted draft computed at submission: its ``(tree, timings)`` or the error it raised."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


class ScriptedDrafterClient:
    """A drafter client whose trees come from :meth:`draft_job`, one job at a time.

    Tracks each request's drafter context length exactly as ``DrafterService`` does and records
    every job in ``calls`` and every release in ``released``.
    """

    def __init__(self) -> None:
        self.ctx_len: dict[str, int] = {}
        self.calls: list[DraftCall] = []
        self.released: list[str] = []

    def draft_job(self, job: DraftJob) -> tuple[DraftTree, dict[str, float]]:
        """The tree of one job and its timings in seconds (subclasses script it)."""
        raise NotImplementedError

    def draft_batch(self, jobs: list[DraftJob]) -> list:
        """:meth:`draft_job` per job; a job's error takes its place (as ``DrafterService.draft_batch``)."""
        out = []
        for job in jobs:
            try:
                out.append(self.draft_job(job))
            except Exception as exc:
                out.append(exc)
        return out

    def submit(self, jobs: list[DraftJob]) -> list[_Ready]:
        """Draft ``jobs`` now; one handle per job for :meth:`collect`."""
        return [_Ready(r) for r in self.draft_batch(list(jobs))]

    def collect(self, handle: _Ready) -> tuple[DraftTree, dict[str, float]]:
        """The ``(tree, timings)`` of a submitted job.

        Raises:
            whatever the job's :meth:`draft_job` raised (e.g. ``AssertionError`` on a broken contract).
        """
        if isinstance(handle.value, BaseException):
            raise handle.value
        return handle.value

    def discard(self, handle: _Ready) -> None:
        """Forget a submitted job (nothing to cancel: it was drafted at submission)."""

    def release(self, request_id: str) -> None:
        """Forget a request's context."""
        self.released.append(request_id)
        self.ctx_len.pop(request_id, None)

    def info(self) -> dict:
        """No limits of its own (no ``max_position``)."""
        return {}

    def num_contexts(self) -> int:
        """Requests with a drafter context."""
        return len(self.ctx_len)

    def check(self, job: DraftJob) -> None:
        """The client contract; raises ``AssertionError`` when the engine broke it."""
        features, committed = job.features, job.committed_ids
        if features.ndim != 2 or features.shape[0] != len(committed):
            raise AssertionError(f"features {tuple(features.shape)} for {len(committed)} committed ids")
        have = self.ctx_len.get(job.request_id, 0)
        if have != job.start - len(committed):
            raise AssertionError(f"context of {job.request_id!r} holds {have}, expected {job.start - len(committed)}")
        self.ctx_len[job.request_id] = job.start

    def record(self, job: DraftJob, tree: DraftTree) -> tuple[DraftTree, dict[str, float]]:
        """Record ``job`` with its ``tree``; returns what :meth:`draft_job` returns (zero timings)."""
        self.calls.append(DraftCall(job.request_id, list(job.committed_ids), job.features.detach().clone(),
                                    job.root_token, job.start, job.max_depth, tree))
        return tree, {"draft": 0.0, "tree_build": 0.0}

    def depth_cap(self, job: DraftJob, depth: int) -> int:
        """``depth`` capped by the job's ``max_depth``."""
        return depth if job.max_depth is None else min(depth, job.max_depth)


class OracleDrafter(ScriptedDrafterClient):
    """Knows each request's reference sequence (prompt + greedy continuation) and drafts it.

    Each round the tree holds the true continuation down to ``depth`` (capped by ``max_depth`` and
    the end of the reference) plus ``distractors`` wrong siblings at every depth, each wrong sibling
    carrying a wrong child of its own; nodes are shuffled within a depth, so the true path is not
    rows ``0..L-1`` of the verify and commit must gather. With ``truth_prob < 1`` the true path is
    cut at a random depth (a wrong token continues it), which exercises mid-path rejection.

    Args:
        references: ``{request_id: prompt + continuation}``; more via :meth:`set_reference`.
        depth: maximum draft depth D; distractors: wrong siblings per depth; seed: RNG seed.
        vocab_size: token range for wrong tokens; exclude: ids never drafted.
        bait: a token used as the first wrong sibling at every depth where it is wrong (e.g. a stop
            id that must not take effect from a rejected branch).
    """

    def __init__(self, references: dict[str, list[int]] | None = None, depth: int = 4, distractors: int = 2,
                 vocab_size: int = 128, seed: int = 0, truth_prob: float = 1.0, exclude: tuple[int, ...] = (),
                 bait: int | None = None):
        super().__init__()
        self.bait = bait
        self.references = dict(references or {})
        self.depth, self.distractors, self.vocab_size = depth, distractors, vocab_size
        self.truth_prob = truth_prob
        self.exclude = set(exclude)
        self.rng = random.Random(seed)

    def set_reference(self, request_id: str, sequence: list[int]) -> None:
        self.references[request_id] = list(sequence)

    def _wrong(self, avoid: set[int]) -> int:
        while True:
            t = self.rng.randrange(self.vocab_size)
            if t not in avoid and t not in self.exclude:
                return t

    def draft_job(self, job: DraftJob) -> tuple[DraftTree, dict[str, float]]:
        self.check(job)
        ref, start = self.references[job.request_id], job.start
        if ref[start] != job.root_token:
            raise AssertionError(f"root {job.root_token} at position {start} but the reference has {ref[start]}")
        depth = self.depth_cap(job, self.depth)
        truth = ref[start + 1: start + 1 + max(depth, 0)]
        if self.truth_prob < 1.0 and truth and self.rng.random() > self.truth_prob:
            cut = self.rng.randrange(len(truth))  # keep truth[:cut], then a wrong token
            truth = truth[:cut] + [self._wrong({truth[cut]})]
        tokens: list[int] = []
        parents: list[int] = []
        depths: list[int] = []
        parent = -1
        for d, tok in enumerate(truth, start=1):
            siblings = {tok}
            for j in range(self.distractors):
                w = self.bait if j == 0 and self.bait is not None and self.bait != tok else self._wrong(siblings)
                siblings.add(w)
                tokens.append(w)
                parents.append(parent)
                depths.append(d)
                if d < depth:  # a wrong child below the wrong sibling
                    tokens.append(self._wrong(set()))
                    parents.append(len(tokens) - 2)
                    depths.append(d + 1)
            tokens.append(tok)
            parents.append(parent)
            depths.append(d)
            parent = len(tokens) - 1
        tok_s, par_s = _shuffle_topological(tokens, parents, depths, self.rng)
        tree = tree_from_nodes(tok_s, par_s)
        tree.validate(vocab_size=self.vocab_size)
        return self.record(job, tree)


class RandomDrafter(ScriptedDrafterClient):
    """Proposes random trees of up to ``budget`` nodes (depth <= min(depth, max_depth))."""

    def __init__(self, vocab_size: int, budget: int = 12, depth: int = 5, seed: int = 0,
                 exclude: tuple[int, ...] = ()):
        super().__init__()
        self.vocab_size, self.budget, self.depth = vocab_size, budget, depth
        self.exclude = tuple(exclude)
        self.rng = random.Random(seed)

    def draft_job(self, job: DraftJob) -> tuple[DraftTree, dict[str, float]]:
        self.check(job)
        depth = self.depth_cap(job, self.depth)
        return self.record(job, random_tree(self.rng, self.vocab_size, self.rng.randint(0, self.budget), depth,
                                            self.exclude))


class FullTreeDrafter(ScriptedDrafterClient):
    """Every token at every depth up to ``depth`` (``V + V^2 + ...`` nodes): for tiny vocabularies only.

    Every target sample lands on a drafted node, so all ``depth + 1`` tokens of a round come from the
    tree walk (used by the T > 0 distribution test).
    """

    def __init__(self, vocab_size: int, depth: int = 2):
        super().__init__()
        self.vocab_size, self.depth = vocab_size, depth

    def draft_job(self, job: DraftJob) -> tuple[DraftTree, dict[str, float]]:
        self.check(job)
        tokens: list[int] = []
        parents: list[int] = []
        frontier = [-1]
        for _ in range(self.depth_cap(job, self.depth)):
            nxt = []
            for p in frontier:
                for t in range(self.vocab_size):
                    tokens.append(t)
                    parents.append(p)
                    nxt.append(len(tokens) - 1)
            frontier = nxt
        return self.record(job, tree_from_nodes(tokens, parents))

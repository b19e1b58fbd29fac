"""The drafter's side of the engine: each request's outbox (what its drafter has not seen yet) and
the link that submits and collects drafts.

A request's drafter context is its committed tokens and their target features. The drafter sees
them only through draft jobs: :class:`DraftOutbox` holds what the next job carries (the ids and
features committed since the last draft, the rows of plain rounds owed meanwhile), the history
kept to rebuild a lost context, and the draft in flight. :class:`DrafterLink` turns outboxes into
:class:`~services.verifier.drafter_client.DraftJob` s with the knobs the step plan resolved,
submits a step's jobs as ONE batched drafter call, collects each round's tree, and turns a lost
drafter into plain rounds (docs/design.md, "A drafter failure never fails a request").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from services.spec import TreeKnobs
from services.tree import DraftTree
from services.verifier.drafter_client import DraftJob, DrafterClient
from services.verifier.remote_drafter import DrafterUnavailable

log = logging.getLogger("services.verifier.engine")


@dataclass
class DraftOutbox:
    """One request's drafter-bound state.

    Attributes:
        ctx_ids: committed since the last draft (the next job's ``committed_ids``); ctx_feats:
            ``[len(ctx_ids) - owed rows, F]`` their features; owed_feats: rows of plain rounds,
            concatenated at the next draft; chunk_feats: prompt-chunk features until the prefill ends;
        hist_feats: the features of every committed position (kept only with a drafter: a lost
            context is rebuilt from them); pending: a submitted draft (overlap: for the next round),
            its handle or the exception its submission raised; pending_knobs: the knobs it was
            submitted with; skip_round: the plan gave this round no draft (the policy's plain
            round); resync: the drafter lost this context: the next draft sends the whole history.
    """

    ctx_ids: list[int] = field(default_factory=list)
    ctx_feats: torch.Tensor | None = None
    owed_feats: list[torch.Tensor] = field(default_factory=list)
    chunk_feats: list[torch.Tensor] = field(default_factory=list)
    hist_feats: list[torch.Tensor] = field(default_factory=list)
    pending: object = None
    pending_knobs: TreeKnobs | None = None
    skip_round: bool = False
    resync: bool = False

    def context_features(self) -> torch.Tensor | None:
        """The context features for a draft, with the rows of plain rounds since the last draft
        appended (once, here: a per-round ``torch.cat`` would copy the whole context every round).

        The context's parts are also the last entries of ``hist_feats`` (the same tensors), which
        then take the concatenation in their place: the history keeps the same rows without a
        second copy of them (after a prompt, ``F`` x 2 bytes a prompt position in bfloat16).
        """
        if self.owed_feats:
            parts = [self.ctx_feats, *self.owed_feats]
            self.ctx_feats = torch.cat(parts)
            self.owed_feats = []
            tail = self.hist_feats[-len(parts):]
            if len(tail) == len(parts) and all(a is b for a, b in zip(tail, parts)):
                self.hist_feats[-len(parts):] = [self.ctx_feats]
        return self.ctx_feats

    def resync_from(self, hist_ids: list[int]) -> None:
        """Make the next draft carry the whole committed history ``hist_ids`` (a drafter that lost
        the context rebuilds it from these ids and features, as after a prefill)."""
        self.ctx_feats = torch.cat(self.hist_feats) if len(self.hist_feats) > 1 else self.hist_feats[0]
        self.hist_feats = [self.ctx_feats]
        self.ctx_ids, self.owed_feats, self.resync = list(hist_ids), [], False

    def after_prefill(self, prompt_ids: list[int], keep: bool) -> None:
        """The prompt is in: the first draft carries it whole (``keep``: a drafter exists)."""
        self.ctx_ids = list(prompt_ids)
        cf = self.chunk_feats
        self.ctx_feats = None if not cf else torch.cat(cf) if len(cf) > 1 else cf[0]
        self.chunk_feats = []
        self.hist_feats = [self.ctx_feats] if keep else []

    def after_round(self, new_ids: list[int], new_feats: torch.Tensor, skipped: bool, resend: bool,
                    keep: bool) -> None:
        """A round committed ``new_ids`` (root + accepted) with features ``new_feats [n, F]``.

        Args:
            skipped: the plan gave it no draft: the drafter's context still owes these rows.
            resend: a plain round the drafter never heard of (it was down): resend the history next.
            keep: a drafter exists (the history's features are kept).
        """
        if skipped and self.ctx_feats is not None:
            self.ctx_ids.extend(new_ids)
            self.owed_feats.append(new_feats)
        else:
            self.ctx_ids, self.ctx_feats, self.owed_feats = new_ids, new_feats, []
            self.resync |= resend
        if keep:
            self.hist_feats.append(new_feats)

    def committed_feats(self, decoding: bool) -> list[torch.Tensor]:
        """The features of the committed positions, in order (prompt chunks while prefilling)."""
        return self.hist_feats if decoding else self.chunk_feats


class DrafterLink:
    """The engine's drafter client with its up / down state.

    Args:
        drafter: the client (None: no drafter, every round is plain).
        draft_depth: ``draft_depth(start)`` -> the deepest draft for a root at ``start`` (<= 0: none).
    """

    def __init__(self, drafter: DrafterClient | None, draft_depth: Callable[[int], int]):
        self.drafter, self.draft_depth = drafter, draft_depth
        self.up = drafter is not None  # drafts may be requested (see set_up)
        self.forget_contexts = False   # the drafter went down: release every request's context

    def set_up(self, up: bool) -> None:
        """Say whether the drafter is reachable (:meth:`SpecEngine.set_drafter_up`)."""
        up = bool(up) and self.drafter is not None
        if self.up and not up:
            self.forget_contexts = True  # on the compute thread, at the next step (the client is its own)
        elif up and not self.up:
            log.info("drafter is back: speculative decoding resumes")
        self.up = up

    def can_draft(self, req) -> bool:
        """Whether a decoding request's round may call the drafter: a drafting method, the drafter
        up, room for a draft token."""
        return req.decoding and req.method.drafts and self.up and self.draft_depth(req.start) > 0

    def job(self, rid: str, req, knobs: TreeKnobs) -> DraftJob:
        """The request's next draft with the resolved ``knobs`` (its history first when it must resync)."""
        if req.drafts.resync:
            self.drafter.release(rid)  # the client forgets the old drafter process's context
            req.drafts.resync_from(req.hist_ids)
        box = req.drafts
        return DraftJob(rid, list(box.ctx_ids), box.context_features(), req.root, req.start, req.method, knobs,
                        self.draft_depth(req.start))

    def submit(self, jobs: list[tuple[object, DraftJob]]) -> None:
        """Start the drafts of ``(request, job)`` pairs as ONE batched drafter call; each request's
        round collects its own. A failed submission fails those requests' next round."""
        if not jobs:
            return
        try:
            handles = self.drafter.submit([job for _, job in jobs])
        except Exception as exc:
            handles = [exc] * len(jobs)
        for (req, job), h in zip(jobs, handles):
            req.drafts.pending, req.drafts.pending_knobs = h, job.spec

    def collect(self, req, reqs: dict) -> tuple[DraftTree, dict, bool, bool]:
        """``(tree, timings, drafted, skipped)`` of a decode round: its submitted draft (none: an
        empty tree: ``ar``, no room, or the plan's plain round, ``skipped``). A draft lost with the
        drafter (:class:`DrafterUnavailable`) is a plain round; another error propagates."""
        t0 = time.perf_counter()
        timings: dict[str, float] = {}
        tree, drafted, skipped = DraftTree.empty(), False, False
        box = req.drafts
        if box.pending is not None:
            handle, box.pending, box.pending_knobs = box.pending, None, None
            try:
                if isinstance(handle, BaseException):
                    raise handle
                tree, dt = self.drafter.collect(handle)
                timings.update(dt)
                drafted = True
            except DrafterUnavailable as exc:
                self.lost(exc, reqs)  # this round (and each other pending one) runs plainly
        elif box.skip_round:
            box.skip_round, skipped = False, True
        timings["draft_wait"] = time.perf_counter() - t0
        timings["_t0"] = t0
        return tree, timings, drafted, skipped

    def lost(self, exc: Exception, reqs: dict) -> None:
        """A draft failed with :class:`DrafterUnavailable`: stop drafting until the drafter is up
        again and release every request's drafter context, which turns every other submitted draft
        into a plain round (their replies cannot come either: the client dropped the connection)."""
        if self.up:
            log.warning("drafter unavailable, decoding plainly until it is back: %s", exc)
        self.up, self.forget_contexts = False, False
        self.release_all(reqs)

    def release_all(self, reqs: dict) -> None:
        """Release every running request's drafter context and discard its submitted draft (their
        next drafts resend the history)."""
        for rid, r in reqs.items():
            if r.decoding and r.method.drafts:
                self.discard(r)
                r.drafts.resync = True
                self.drafter.release(rid)

    def discard(self, req) -> None:
        """Drop the request's submitted draft, if any."""
        box = req.drafts
        if box.pending is not None and not isinstance(box.pending, BaseException):
            self.drafter.discard(box.pending)
        box.pending = box.pending_knobs = None

    def release(self, rid: str, req) -> None:
        """A request left: discard its draft in flight and release its drafter context."""
        if self.drafter is None:
            return
        self.discard(req)
        if req.method.drafts and req.decoding:
            self.drafter.release(rid)


def owned(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when it spans its whole storage, else a copy: a prompt chunk's ``[n, F]``
    features are a slice of its step's ``[R, F]`` features, which the slice would keep alive
    (every request of the step until each has finished its prefill)."""
    whole = t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t if whole and t.is_contiguous() else t.clone()

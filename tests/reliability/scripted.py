"""A scripted drafter: the test decides how many draft tokens each round accepts.

:class:`ScriptedDrafter` knows each request's reference (prompt + plain greedy continuation, as
:class:`tests.doubles.OracleDrafter` does and with the same contract checks) and, in round ``k``,
proposes the true continuation down to depth ``accepts[k]`` followed by one wrong token (a real
rejection, not a short tree), plus wrong siblings at every depth. With a greedy target the round
therefore accepts exactly ``min(accepts[k], max_depth, tokens left in the reference)`` drafts.
"""

from __future__ import annotations

import random

from services.testing import _shuffle_topological, tree_from_nodes
from tests.doubles import OracleDrafter


class ScriptedDrafter(OracleDrafter):
    """``accepts``: accepted drafts per round, in order (rounds past the script accept ``depth``)."""

    def __init__(self, references: dict[str, list[int]], accepts: list[int], depth: int, vocab_size: int,
                 seed: int = 0, bait: int | None = None, exclude: tuple[int, ...] = (),
                 any_request: list[int] | None = None):
        super().__init__(references, depth=depth, distractors=1, vocab_size=vocab_size, seed=seed, bait=bait,
                         exclude=exclude)
        self.accepts = list(accepts)
        self.rounds: dict[str, int] = {}
        self.rng = random.Random(seed)
        self.any_request = any_request  # the reference of every request id not in ``references``

    def set_script(self, accepts: list[int], any_request: list[int] | None = None, bait: int | None = None) -> None:
        """A new acceptance pattern (and reference) for the requests that start from now on."""
        self.accepts, self.any_request, self.bait = list(accepts), any_request, bait

    def draft_job(self, job):
        self.check(job)
        request_id, start = job.request_id, job.start
        ref = self.references.get(request_id, self.any_request)
        if ref[start] != job.root_token:
            raise AssertionError(f"root {job.root_token} at position {start} but the reference has {ref[start]}")
        cap = self.depth_cap(job, self.depth)
        k = self.rounds.get(request_id, 0)
        self.rounds[request_id] = k + 1
        want = self.accepts[k] if k < len(self.accepts) else self.depth
        truth = ref[start + 1: start + 1 + min(want, cap)]
        path = list(truth)
        if len(path) < cap and start + 1 + len(path) < len(ref):  # one wrong token ends the accepted path
            path.append(self._wrong({ref[start + 1 + len(path)]}))
        tokens: list[int] = []
        parents: list[int] = []
        depths: list[int] = []
        parent = -1
        for d, tok in enumerate(path, start=1):
            avoid = {tok, ref[start + d]}  # never the token the target will pick at this depth
            wrong = self.bait if self.bait is not None and self.bait not in avoid else self._wrong(avoid)
            tokens += [wrong, tok]
            parents += [parent, parent]
            depths += [d, d]
            parent = len(tokens) - 1
        tok_s, par_s = _shuffle_topological(tokens, parents, depths, self.rng)
        tree = tree_from_nodes(tok_s, par_s)
        tree.validate(vocab_size=self.vocab_size)
        return tree, {"draft": 0.0, "tree_build": 0.0}

"""Random verify segments for the runner tests, and KV slots several runners commit in lockstep.

:func:`random_segments` gives, per KV slot, a random draft tree at the slot's committed length, a
prompt chunk or a lone ``ar`` row (slot ``i`` takes kind ``i % 3``), so one step mixes every kind of
row a batched verify step holds. :class:`LockstepSlots` allocates the same slots in several
:class:`~services.verifier.runner.ModelRunner` s and commits each step's segments in all of them,
so a test can compare their outputs (and their KV) step after step.
"""

from __future__ import annotations

import random

from services.testing import random_tree
from services.tree import derive_buffers
from services.tree.batch import Segment, causal_segment


def random_segments(rng: random.Random, slots: list[int], lengths: list[int], vocab: int) -> list[Segment]:
    """One segment per slot at its committed length: a random tree (2-9 nodes, depth <= 4, root
    token 6), a prompt chunk of 2-11 tokens, or one row; token ids in ``[3, vocab)`` outside the trees."""
    segs = []
    for i, (slot, start) in enumerate(zip(slots, lengths)):
        kind = i % 3
        if kind == 0:
            b = derive_buffers(random_tree(rng, vocab, rng.randrange(2, 10), 4), 6)
            segs.append(Segment(b.input_ids, b.position_offsets, b.tree_mask, start, slot))
        elif kind == 1:
            segs.append(causal_segment([rng.randrange(3, vocab) for _ in range(rng.randrange(2, 12))], start, slot))
        else:
            segs.append(causal_segment([rng.randrange(3, vocab)], start, slot))
    return segs


class LockstepSlots:
    """``num_slots`` KV slots allocated in each of ``runners`` (the same slot ids in all of them) and
    their committed lengths.

    Raises:
        AssertionError: the runners handed out different slot ids.
    """

    def __init__(self, runners, num_slots: int = 3):
        self.runners = tuple(runners)
        per_runner = [[r.cache.alloc() for _ in range(num_slots)] for r in self.runners]
        assert all(s == per_runner[0] for s in per_runner), per_runner
        self.slots: list[int] = per_runner[0]
        self.lengths = [0] * num_slots

    def segments(self, rng: random.Random, step: int, vocab: int) -> list[Segment]:
        """Step ``step``'s segments: the first ``1 + step % num_slots`` slots, each at its length."""
        return random_segments(rng, self.slots[:1 + step % len(self.slots)], self.lengths, vocab)

    def commit(self, segs: list[Segment]) -> None:
        """Commit every row of ``segs`` (a tree: all its nodes) in every runner."""
        for s in segs:
            for r in self.runners:
                r.cache.extend(s.slot, s.num_rows)
            self.lengths[self.slots.index(s.slot)] += s.num_rows

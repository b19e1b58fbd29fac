"""Prefix caching over the slot KV cache: a finished request's slot keeps its conversation.

llama.cpp server's ``cache_prompt`` shape. When a request finishes, its slot's committed positions
(prompt + the tokens whose KV was written, including rows past a terminator the emit cut) stay in
the slot, with their token ids and target features, as a *cached prefix*. A new request is given
the free slot whose cached tokens share the longest prefix with its prompt (least recently used
among ties); only the rest of the prompt is prefilled, from the match length on. A match that would
reuse less than half of its slot's cached tokens (``PrefixCache.min_share``, llama.cpp's
``--slot-prompt-similarity``) is passed over for a free slot caching nothing, so a new conversation
that shares only a chat template's preamble with a cached one does not overwrite it. A slot without
a match is taken from the free slots that cache nothing first, then the least recently used (an
*eviction*).

Sharing across slots. A prefix is reused *in place* only by the request that takes its slot, so
a prefix also serves others by **copy**: :meth:`PrefixCache.plan` looks at every slot's committed
columns -- the free slots' cached prefixes and the running requests' committed positions (their
prompt so far while prefilling, prompt plus accepted tokens while decoding) -- and when one shares
at least ``min_copy`` positions more with the prompt than the in-place choice, the request takes a
slot caching nothing (else the least recently used) and
:meth:`~services.verifier.kv_cache.SlotKVCache.copy_prefix` copies those leading columns (every
layer's K and V) and their target feature rows into it; only the rest is prefilled. Copying is
read-only on the source: columns below a slot's committed length never change while its owner runs
(verify rows land past it), and nothing past it is ever copied. A copy of 2,000 positions of
SmolLM2-135M is a 46 MB memcpy, a few ms against seconds of prefill. This covers the n-th user of
a long system prompt while the slots caching it are running, and a new conversation that shares
only part of a cached one (a weak match: it copies that part into another slot and both stay
cached).

**Waiting for a prefill.** Requests that arrive together with the same prompt (the ``n`` choices of
one request, which the gateway runs as ``n`` engine requests, or identical prompts of different
clients) would otherwise all prefill it. A new request whose prompt shares at least ``min_copy``
positions more with a request still prefilling (the *leader*) than anything committed now waits
(:func:`place`): it holds its slot but sits steps out until the leader has committed the
shared positions, then copies them and prefills only the rest (one token for an identical prompt)
with its own sampling seed. If the leader is aborted or fails first, the waiting requests take
whatever is committed elsewhere, wait for another request prefilling the prompt, or prefill it
themselves; nothing an aborted request wrote is read.

Why per slot, not vLLM's hashed blocks or SGLang's radix tree: the KV layout is one contiguous
``[S, H_kv, C, Dh]`` row per slot (:class:`~services.verifier.kv_cache.SlotKVCache`), verify rows
are written and compacted in place past the committed length, and a slot is owned by one running
request at a time. Reusing a slot's own leading columns needs no block table and no reference
counts, and no request ever writes columns another request reads (the speculative rows of a tree
verify land past the committed length of the slot's only owner). The cost of sharing is the copy:
two requests sharing a system prompt each hold its KV in their own slot.

Speculation stays intact because the cache keeps, next to each committed position's KV, the target
features the drafter's context is built from: a request that reuses ``m`` positions hands the
drafter the features of the whole prompt (``m`` cached rows + the freshly prefilled ones), exactly
the rows a cold prefill would hand it, and the drafter rebuilds its context from them (its context
for a position depends only on that position's features and, for EAGLE-3, the next token, which the
prompt carries). Only positions a request committed are kept; an aborted or failed request leaves
nothing reusable.

Memory: a cached prefix's KV lives in its slot's columns, which are reserved for the slot whether
it caches anything or not, so keeping it costs nothing extra. What the cache holds *beyond* the slots
is, per cached position, its target feature row (``F`` values in the target's activation dtype:
SmolLM2-135M with the 5-layer DARTree drafter taps ``F = 5 x 576``, 11.25 KiB a position in float32)
and its token id (counted as :data:`ID_BYTES`). That is :meth:`PrefixCache.nbytes`; ``max_bytes``
(``--prefix-cache-mib``) bounds it: storing a prefix that takes the total past the bound evicts the
least recently used prefixes (the new one last) until it fits. Only free slots cache prefixes, so a
running request's KV is never evicted (a copy only writes into the slot its own request took).

**Host RAM.** A prefix evicted from its slot (the slot given to another request) may be saved first
to :attr:`PrefixCache.ram`, a :class:`~services.verifier.prefix_store.PrefixStore` bounded by
``--prefix-cache-ram-mib`` (llama-server's ``--cache-ram``): its KV columns, feature rows and token
ids in host memory. :meth:`PrefixCache.plan` copies an entry back into a slot when it shares at
least ``min_copy`` positions more with the prompt than any slot does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from services.verifier.prefix_store import ID_BYTES, PrefixStore, common_prefix


@dataclass
class PrefixEntry:
    """What a free slot caches.

    Attributes:
        tokens: token ids of the slot's committed positions ``[0, len(tokens))``.
        features: ``[len(tokens), F]`` target features at those positions, or None (kept only when
            a drafter may need them).
        last_used: tick of the last store or reuse (LRU order).
    """

    tokens: list[int]
    features: Tensor | None
    last_used: int


@dataclass
class PrefixStats:
    """Counters since start: ``queried_tokens`` prompt tokens looked up, ``hit_tokens`` of them
    served from a cached prefix or another slot's committed columns (not prefilled), ``hits``
    requests with a non-empty hit, ``copied_tokens`` / ``copies`` the part of those served by a
    copy from another slot (:meth:`~services.verifier.kv_cache.SlotKVCache.copy_prefix`; the rest
    were reused in place), ``waits`` requests held until another request's prefill committed the
    prefix they share, ``evictions`` cached prefixes dropped to give their slot to another request
    (or to scratch work) or to keep the cache within its memory bound (``bound_evictions`` of them)."""

    queried_tokens: int = 0
    hit_tokens: int = 0
    hits: int = 0
    copied_tokens: int = 0
    copies: int = 0
    waits: int = 0
    evictions: int = 0
    bound_evictions: int = 0


@dataclass(frozen=True)
class Placement:
    """Where a new request goes (:meth:`PrefixCache.plan`).

    Attributes:
        slot: the free slot it takes.
        reused: positions ``[0, reused)`` of ``slot``'s cached prefix it reuses in place.
        source: the slot whose leading columns it copies into ``slot`` (-1: no copy; ``reused`` is
            0 whenever a copy is planned).
        copied: positions ``[0, copied)`` to copy from ``source``, or from ``stored``.
        stored: the key of the host-RAM entry (:class:`~services.verifier.prefix_store.PrefixStore`)
            whose leading columns it restores into ``slot`` (-1: none; ``source`` is then -1).
    """

    slot: int
    reused: int = 0
    source: int = -1
    copied: int = 0
    stored: int = -1


class PrefixCache:
    """The cached prefixes of free slots and the slot choice for a new request.

    Args:
        enabled: False: nothing is stored and every lookup misses (cold prefill every request).
        max_bytes: bound on :meth:`nbytes` (feature rows + token ids of every cached prefix; the
            KV sits in reserved slot columns and is not counted); None: no bound. A prefix larger
            than the bound on its own is not kept.
    Raises:
        ValueError: ``max_bytes`` < 0.
    """

    min_share = 0.5  # a match is taken over a slot caching nothing when it reuses >= this of the slot (match)
    min_copy = 16    # a copy from another slot is planned when it serves >= this many positions more (plan)

    def __init__(self, enabled: bool = True, max_bytes: int | None = None):
        self.enabled = bool(enabled)
        self._entries: dict[int, PrefixEntry] = {}
        self._tick = 0
        self._bytes = 0
        self.max_bytes = max_bytes
        self.stats = PrefixStats()
        self.ram = PrefixStore()  # evicted prefixes in host memory (off until its bound is set)

    @property
    def max_bytes(self) -> int | None:
        """The bound on :meth:`nbytes` (None: none). Setting a lower one evicts LRU prefixes to fit.

        Raises:
            ValueError: set below 0.
        """
        return self._max_bytes

    @max_bytes.setter
    def max_bytes(self, value: int | None) -> None:
        if value is not None and value < 0:
            raise ValueError(f"the prefix cache's memory bound must be >= 0 bytes (got {value})")
        self._max_bytes = None if value is None else int(value)
        self._fit()

    @staticmethod
    def entry_bytes(tokens: list[int], features: Tensor | None) -> int:
        """Bytes a prefix of ``tokens`` with ``features [len(tokens), F]`` (or None) holds beyond its
        slot: the feature rows plus :data:`ID_BYTES` per token."""
        return ID_BYTES * len(tokens) + (features.numel() * features.element_size() if features is not None else 0)

    def nbytes(self) -> int:
        """Bytes held by every cached prefix beyond the reserved KV slots (:meth:`entry_bytes`)."""
        return self._bytes

    def _fit(self) -> None:
        """Evict least recently used prefixes until :meth:`nbytes` is within the bound."""
        while self._max_bytes is not None and self._bytes > self._max_bytes and self._entries:
            lru = min(self._entries, key=lambda s: self._entries[s].last_used)
            self.drop(lru, eviction=True)
            self.stats.bound_evictions += 1

    def __len__(self) -> int:
        return len(self._entries)

    def entry(self, slot: int) -> PrefixEntry | None:
        """The cached prefix of ``slot`` (None: nothing cached)."""
        return self._entries.get(slot)

    def cached_tokens(self) -> int:
        """Positions cached in all free slots."""
        return sum(len(e.tokens) for e in self._entries.values())

    def store(self, slot: int, tokens: list[int], features: Tensor | None) -> None:
        """Cache ``tokens`` (the slot's committed positions) and their ``features [len(tokens), F]``
        (or None) in ``slot``, most recently used; then evict least recently used prefixes (this one
        last) while :meth:`nbytes` exceeds ``max_bytes``. Caches nothing when disabled or ``tokens``
        is empty.

        Raises:
            ValueError: ``features`` has not one row per token.
        """
        if features is not None and features.shape[0] != len(tokens):
            raise ValueError(f"{features.shape[0]} feature rows for {len(tokens)} cached tokens")
        self.drop(slot)
        if not self.enabled or not tokens:
            return
        self._tick += 1
        self._entries[slot] = PrefixEntry(list(tokens), features, self._tick)
        self._bytes += self.entry_bytes(tokens, features)
        self._fit()

    def drop(self, slot: int, eviction: bool = False) -> None:
        """Forget ``slot``'s cached prefix (idempotent); ``eviction`` counts it as an eviction."""
        e = self._entries.pop(slot, None)
        if e is not None:
            self._bytes -= self.entry_bytes(e.tokens, e.features)
            if eviction:
                self.stats.evictions += 1

    def clear(self) -> None:
        """Forget every cached prefix (not counted as evictions): their KV no longer matches what
        the steps compute (the runner's step was swapped)."""
        for slot in list(self._entries):
            self.drop(slot)
        self.ram.clear()

    def victim(self, free_slots: list[int]) -> int:
        """The free slot to give to a request without a match: the lowest one caching nothing, else
        the least recently used.

        Raises:
            ValueError: ``free_slots`` is empty.
        """
        if not free_slots:
            raise ValueError("no free slot")
        empty = [s for s in free_slots if s not in self._entries]
        if empty:
            return min(empty)
        return min(free_slots, key=lambda s: self._entries[s].last_used)

    def match(self, free_slots: list[int], prompt: list[int], need_features: bool) -> tuple[int, int]:
        """``(slot, reused)``: the free slot to give a request for ``prompt``, and how many leading
        positions it may reuse there: the common prefix with the slot's cached tokens, capped at
        ``len(prompt) - 1`` (the last prompt token is always prefilled, so the first token's logits
        are computed) and, when ``need_features``, 0 for a prefix cached without features.

        Taking a slot overwrites its cached prefix past the reused part, so, as llama.cpp's
        ``--slot-prompt-similarity``, a match is taken outright only when it reuses at least
        ``min_share`` of the slot's cached tokens (the longest such, least recently used among
        ties). Otherwise a free slot caching nothing is taken (``reused == 0``): a new conversation
        that shares only a short preamble with a cached one leaves that one intact. With no such
        slot some prefix is lost anyway, so the longest match of any share is taken, else
        :meth:`victim`'s slot. Counts the lookup.

        Raises:
            ValueError: ``free_slots`` is empty.
        """
        slot, reused = self._match(free_slots, prompt, need_features)
        self.stats.queried_tokens += len(prompt)
        self.count_hit(reused)
        return slot, reused

    def count_hit(self, reused: int, copied: bool = False) -> None:
        """Count a request served ``reused`` positions (nothing when 0); ``copied``: by a copy."""
        if reused > 0:
            self.stats.hits += 1
            self.stats.hit_tokens += reused
            if copied:
                self.stats.copies += 1
                self.stats.copied_tokens += reused

    def _match(self, free_slots: list[int], prompt: list[int], need_features: bool) -> tuple[int, int]:
        """:meth:`match` without counting."""
        if not free_slots:
            raise ValueError("no free slot")
        best, best_len, best_tick = -1, 0, 0      # the longest match of any share
        good, good_len, good_tick = -1, 0, 0      # the longest match reusing >= min_share of its slot
        cap = len(prompt) - 1
        if self.enabled and cap > 0:
            for slot in free_slots:
                e = self._entries.get(slot)
                if e is None or (need_features and e.features is None):
                    continue
                n = min(common_prefix(e.tokens, prompt), cap)
                if n > best_len or (n == best_len and n > 0 and e.last_used < best_tick):
                    best, best_len, best_tick = slot, n, e.last_used
                if n > 0 and n >= self.min_share * len(e.tokens) and \
                        (n > good_len or (n == good_len and e.last_used < good_tick)):
                    good, good_len, good_tick = slot, n, e.last_used
        if good_len > 0:
            best, best_len = good, good_len
        elif best_len > 0 and any(s not in self._entries for s in free_slots):
            best_len = 0  # a weak match: keep its prefix, take a slot caching nothing
        if best_len == 0:
            return self.victim(free_slots), 0
        return best, best_len

    def longest(self, prompt: list[int], sources: dict[int, list[int]]) -> tuple[int, int]:
        """``(slot, n)``: the source sharing the longest prefix with ``prompt`` (``sources``: slot ->
        the token ids of its committed positions), ``n`` capped at ``len(prompt) - 1``; ``(-1, 0)``
        when none shares a token (lowest slot among ties)."""
        best, best_len = -1, 0
        cap = len(prompt) - 1
        for slot in sorted(sources):
            n = min(common_prefix(sources[slot], prompt), cap)
            if n > best_len:
                best, best_len = slot, n
        return best, best_len

    def copy_sources(self, free_slots: list[int], need_features: bool) -> dict[int, list[int]]:
        """``{slot: tokens}`` of the free slots' cached prefixes a request may copy from (with
        ``need_features``, only those cached with features)."""
        return {s: e.tokens for s in free_slots if (e := self._entries.get(s)) is not None
                and not (need_features and e.features is None)}

    def plan(self, free_slots: list[int], prompt: list[int], need_features: bool,
             running: dict[int, list[int]] | None = None) -> Placement:
        """Where a request for ``prompt`` goes: :meth:`match`'s in-place choice, unless copying the
        leading columns of another slot serves at least ``min_copy`` positions more.

        Copy sources are the free slots' cached prefixes (:meth:`copy_sources`) and ``running``
        (slot -> the ids of a running request's *committed* positions: the only columns of a slot
        that never change while its owner runs). A copy goes into the in-place choice when that
        reuses nothing and is not the source, else into :meth:`victim` of the other free slots;
        when the source is the only free slot, it is taken in place. An entry of the host-RAM store
        (:attr:`ram`) sharing at least ``min_copy`` positions more than any slot is restored instead,
        into the in-place choice when that reuses nothing, else into :meth:`victim` of the others.
        Counts the lookup (the hit is counted when the placement is carried out: :meth:`count_hit`);
        disabled: always a :meth:`victim` slot reusing nothing.

        Raises:
            ValueError: ``free_slots`` is empty.
        """
        slot, reused = self._match(free_slots, prompt, need_features)
        self.stats.queried_tokens += len(prompt)
        if not self.enabled:
            return Placement(slot)
        src, n = self.longest(prompt, {**self.copy_sources(free_slots, need_features), **(running or {})})
        key, stored = self.ram.longest(prompt, need_features)
        if stored >= max(reused, n) + self.min_copy:
            rest = [s for s in free_slots if s != slot]
            return Placement(slot if reused == 0 or not rest else self.victim(rest), 0, -1, stored, key)
        others = [s for s in free_slots if s != src]
        if n < reused + self.min_copy or not others:
            return Placement(slot, reused)
        return Placement(slot if reused == 0 and slot != src else self.victim(others), 0, src, n)

    def touch(self, slot: int) -> None:
        """Mark ``slot``'s cached prefix most recently used (a copy read it; no-op without one)."""
        e = self._entries.get(slot)
        if e is not None:
            self._tick += 1
            e.last_used = self._tick


# ------------------------------------------------------------------------------ placement of requests
# The engine's side of prefix sharing. ``reqs`` is the engine's request table (request id ->
# :class:`~services.verifier.requests.RequestState`); ``need``: a drafter exists (the reused
# positions' target features must come along).

def place(cache, reqs: dict, rid: str, req, need: bool) -> None:
    """Give a new request its slot and the prompt positions it need not prefill: a cached prefix
    reused in place, or the leading columns another slot has committed copied into its own slot
    (:meth:`PrefixCache.plan`); or, when a request still prefilling shares at least ``min_copy``
    positions more, wait for that prefill (:func:`resolve_waits`). With a drafter the reused
    positions' target features come along, so the drafter's context is rebuilt from exactly the
    rows a cold prefill would produce."""
    pc = cache.prefix
    plan = pc.plan(cache.free_slots(), req.prompt_ids, need, committed(reqs, rid) if pc.enabled else None)
    lead, lead_len = leader(reqs, rid, req.prompt_ids) if pc.enabled else (None, 0)
    if lead is not None and lead_len >= max(plan.reused, plan.copied) + pc.min_copy:
        plan = Placement(pc.victim(cache.free_slots()))
        req.wait_for, req.wait_len = lead, lead_len
        pc.stats.waits += 1
    req.slot = plan.slot
    req.prefilled, feats = cache.take(plan)
    req.cached = req.prefilled
    if need and plan.copied and plan.source >= 0 and feats is None:
        feats = committed_feats(reqs, plan.source, plan.copied)
    if req.prefilled and feats is not None:
        req.drafts.chunk_feats.append(feats)


def committed(reqs: dict, exclude: str) -> dict[int, list[int]]:
    """``{slot: ids}`` of every other running request's committed positions (copy sources)."""
    out = {}
    for rid, r in reqs.items():
        ids = r.hist_ids if r.decoding else r.prompt_ids[:r.prefilled]
        if rid != exclude and r.wait_for is None and ids:
            out[r.slot] = ids
    return out


def committed_feats(reqs: dict, slot: int, n: int) -> Tensor:
    """``[n, F]`` target features of the first ``n`` committed positions of the running request
    in ``slot`` (a copy, never a view of its step's features)."""
    req = next(r for r in reqs.values() if r.slot == slot and r.wait_for is None)
    parts, have = [], 0
    for f in req.drafts.committed_feats(req.decoding):
        if have >= n:
            break
        parts.append(f[:n - have])
        have += parts[-1].shape[0]
    return torch.cat(parts)


def leader(reqs: dict, rid: str, prompt: list[int]) -> tuple[str | None, int]:
    """``(request id, n)``: the other request still prefilling (and not waiting itself) whose
    prompt shares the most leading positions with ``prompt``, ``n`` capped at ``len(prompt) - 1``."""
    best, best_len = None, 0
    for other, r in reqs.items():
        if other != rid and not r.decoding and r.wait_for is None:
            n = min(common_prefix(r.prompt_ids, prompt), len(prompt) - 1)
            if n > best_len:
                best, best_len = other, n
    return best, best_len


def resolve_waits(cache, reqs: dict, need: bool, force: frozenset[str] = frozenset()) -> None:
    """Start every waiting request whose leader has committed the shared positions, finished, or
    left (abort, error: the waiting request then takes whatever another slot has committed, waits
    for another request prefilling the prompt, or prefills it itself; nothing an aborted request
    wrote is read). A request in ``force`` starts now, from what is committed."""
    pc = cache.prefix
    for rid, req in list(reqs.items()):
        if req.wait_for is None:
            continue
        lead = reqs.get(req.wait_for)
        if rid not in force and lead is not None and not lead.decoding and lead.prefilled < req.wait_len:
            continue
        req.wait_for = None
        sources = {**pc.copy_sources(cache.free_slots(), need), **committed(reqs, rid)}
        src, n = pc.longest(req.prompt_ids, sources)
        lead, lead_len = leader(reqs, rid, req.prompt_ids) if rid not in force else (None, 0)
        if lead is not None and lead_len >= n + pc.min_copy:
            req.wait_for, req.wait_len = lead, lead_len
        elif n >= pc.min_copy:
            feats = cache.copy_prefix(src, req.slot, n)
            req.prefilled = req.cached = n
            if need:
                req.drafts.chunk_feats = [feats if feats is not None else committed_feats(reqs, src, n)]

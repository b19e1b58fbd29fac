"""A preallocated slot KV cache: one slot per running request, per-slot committed lengths.

gpt-fast's ``setup_caches`` / nanochat's ``cache_seqlens`` shape: every layer holds
``keys, values [S, H_kv, C, Dh]`` (``S`` slots, ``C`` columns per slot), allocated once at start
(``torch.empty``: the operating system commits pages only when they are first touched, so the
resident memory follows the contexts actually used; :meth:`SlotKVCache.prepare` zero-fills each
slot's columns up to the length a step reads before they are read the first time, so attention
never sees uninitialised memory — a NaN there would survive a zero attention weight). A step writes its rows from
each slot's committed length on (:mod:`services.tree.batch`), :meth:`SlotKVCache.commit` then
compacts the accepted rows in place (DART/DDT ``compact_dynamic_cache``, docs/algorithms.md §5) and
sets the slot's length. Freeing a slot only resets its length: nothing is read past a length.

Prefix caching (:mod:`services.verifier.prefix_cache`): a slot freed with its committed token ids
keeps its KV as a cached prefix; :meth:`SlotKVCache.alloc_prefix` hands a new request the free slot
with the longest common prefix and starts its length there, :meth:`SlotKVCache.alloc` (no prompt)
takes a slot caching nothing before evicting the least recently used prefix. A request may also
start from another slot's committed columns: :meth:`SlotKVCache.copy_prefix` copies them into its
own slot (:meth:`SlotKVCache.take` carries out a :meth:`PrefixCache.plan`). A prefix evicted from
its slot may be saved to host RAM first (:meth:`SlotKVCache.evict`,
:mod:`services.verifier.prefix_store`) and copied back later (:meth:`SlotKVCache.restore_prefix`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from services.verifier.prefix_cache import Placement, PrefixCache
from services.verifier.prefix_store import StoredPrefix


class KVCacheTooLarge(MemoryError, ValueError):
    """The KV cache does not fit: a configuration error (one line naming the flags to change), so the
    command lines print it without a traceback (a ``ValueError``) and callers may catch ``MemoryError``."""


class SlotKVCache:
    """Per-layer ``[S, H_kv, C, Dh]`` keys and values with per-slot lengths.

    Args:
        num_layers, num_kv_heads, head_dim: the target's attention shape.
        num_slots: concurrent requests (``--max-running``); capacity: columns per slot (the context
            window plus the widest step segment, since verify rows sit past the committed length).
    Raises:
        KVCacheTooLarge: (a ``MemoryError``) with a one-line reason when the cache cannot be allocated.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_slots: int, capacity: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        if num_slots < 1 or capacity < 1:
            raise ValueError("a slot cache needs at least one slot and one column")
        self.num_slots, self.capacity = num_slots, capacity
        self.shape = (num_slots, num_kv_heads, capacity, head_dim)
        self.dtype, self.device = dtype, torch.device(device)
        need = self.estimate_bytes(num_layers, num_kv_heads, head_dim, num_slots, capacity, dtype)
        if self.device.type == "cpu":
            import psutil

            avail = psutil.virtual_memory().available
            if need > avail:
                raise KVCacheTooLarge(f"the KV cache needs {need / 2**30:.2f} GiB ({num_slots} slots x {capacity} positions)"
                                  f" but {avail / 2**30:.2f} GiB of RAM are available: lower --max-running or"
                                  " --max-context")
        try:
            self.keys = [torch.empty(self.shape, dtype=dtype, device=device) for _ in range(num_layers)]
            self.values = [torch.empty(self.shape, dtype=dtype, device=device) for _ in range(num_layers)]
        except (RuntimeError, MemoryError) as exc:  # torch raises RuntimeError (CPU) / OutOfMemoryError (CUDA)
            raise KVCacheTooLarge(f"the KV cache ({need / 2**30:.2f} GiB for {num_slots} slots x {capacity} positions)"
                              f" does not fit: {exc}; lower --max-running or --max-context") from None
        self._lengths = [0] * num_slots
        self._clean = [0] * num_slots  # columns [0, _clean) of a slot hold finite values
        self._free = list(range(num_slots))
        self.prefix = PrefixCache()  # cached prefixes of free slots (filled only by free(..., tokens))

    @staticmethod
    def estimate_bytes(num_layers: int, num_kv_heads: int, head_dim: int, num_slots: int, capacity: int,
                       dtype: torch.dtype = torch.float32) -> int:
        """Bytes the keys and values of such a cache take."""
        return 2 * num_layers * num_slots * num_kv_heads * capacity * head_dim * torch.tensor([], dtype=dtype).element_size()

    @classmethod
    def for_model(cls, config, num_slots: int, capacity: int, dtype: torch.dtype, device) -> "SlotKVCache":
        """A cache shaped for a HF causal-LM ``config`` (llama / qwen2 / qwen3)."""
        heads = int(config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        return cls(int(config.num_hidden_layers), kv_heads, head_dim, num_slots, capacity, dtype, device)

    def nbytes(self) -> int:
        """Bytes held by keys and values."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        """Take a free slot with length 0: the lowest caching no prefix, else the least recently
        used one (its cached prefix is evicted).

        Raises:
            RuntimeError: every slot is in use.
        """
        if not self._free:
            raise RuntimeError(f"all {self.num_slots} KV slots are in use")
        slot = self.prefix.victim(self._free)
        self.evict(slot)
        self._free.remove(slot)
        self._lengths[slot] = 0
        return slot

    def evict(self, slot: int) -> None:
        """Drop ``slot``'s cached prefix as an eviction (no-op without one), first saving it to the
        host-RAM store when the store wants it (:meth:`PrefixStore.save
        <services.verifier.prefix_store.PrefixStore.save>`: every layer's K and V of its columns, its
        feature rows, its token ids)."""
        entry = self.prefix.entry(slot)
        if entry is not None and self.prefix.ram.wants(len(entry.tokens)):
            self.prefix.ram.save(entry.tokens, [(k[slot], v[slot]) for k, v in zip(self.keys, self.values)],
                                 entry.features)
        self.prefix.drop(slot, eviction=True)

    def alloc_prefix(self, prompt: list[int], need_features: bool = False) -> tuple[int, int, Tensor | None]:
        """Take the free slot :meth:`PrefixCache.plan` picks for ``prompt`` with the free slots'
        cached prefixes as the only sources: the one sharing the most leading tokens reused in place
        (at most ``len(prompt) - 1``; LRU among ties; a match reusing under ``min_share`` of its
        slot only when no free slot caches nothing), or a longer one copied into another slot;
        without a match, :meth:`alloc`'s slot.

        Returns:
            ``(slot, reused, features)``: ``reused`` positions ``[0, reused)`` already hold the
            prompt's KV; ``features [reused, F]`` their cached target features (None when
            ``reused == 0`` or none were cached; with ``need_features`` a slot without cached
            features is never matched).
        Raises:
            RuntimeError: every slot is in use.
        """
        if not self._free:
            raise RuntimeError(f"all {self.num_slots} KV slots are in use")
        plan = self.prefix.plan(self._free, prompt, need_features)
        reused, feats = self.take(plan)
        return plan.slot, reused, feats

    def free_slots(self) -> list[int]:
        """The free slots (a copy of the list)."""
        return list(self._free)

    def take(self, placement: Placement) -> tuple[int, Tensor | None]:
        """Carry out a :meth:`PrefixCache.plan`: take ``placement.slot`` out of the free list (its
        cached prefix dropped; an eviction, saved to host RAM when long enough (:meth:`evict`), unless
        reused in place) with its length at the reused positions, then copy ``placement.copied``
        leading columns from ``placement.source`` (:meth:`copy_prefix`) or from the host-RAM entry
        ``placement.stored`` (:meth:`restore_prefix`) into it. Counts the hit.

        Returns:
            ``(prefilled, features)``: positions ``[0, prefilled)`` of the slot now hold the
            prompt's KV; ``features [prefilled, F]`` their cached target features when the reused,
            copied or restored prefix was a cached one with features (None otherwise: a copy from a running
            slot leaves the features to its owner's caller).
        Raises:
            ValueError: the slot is not free, the stored entry is gone, or the copy is not allowed
                (:meth:`copy_prefix`).
        """
        slot, reused = placement.slot, placement.reused
        if slot not in self._free:
            raise ValueError(f"slot {slot} is not free")
        entry = self.prefix.entry(slot) if reused else None
        feats = entry.features[:reused] if entry is not None and entry.features is not None else None
        stored = self.prefix.ram.entry(placement.stored) if placement.stored >= 0 else None  # before a save drops it
        if placement.stored >= 0 and stored is None:
            raise ValueError(f"no stored prefix {placement.stored}")
        if reused == 0:
            self.evict(slot)
        self.prefix.drop(slot)
        self._free.remove(slot)
        self._lengths[slot] = reused
        self.prefix.count_hit(reused)
        if stored is not None:
            feats = self.restore_prefix(stored, slot, placement.copied)
            self.prefix.ram.count_hit(placement.stored, placement.copied)
        elif placement.copied:
            feats = self.copy_prefix(placement.source, slot, placement.copied)
        return self._lengths[slot], feats

    @torch.inference_mode()
    def restore_prefix(self, stored: StoredPrefix, dst: int, n: int) -> Tensor | None:
        """Copy a host-RAM entry's columns ``[0, n)`` (every layer's K and V) into the taken, empty
        slot ``dst`` and set its length to ``n``: the layout :meth:`copy_prefix` writes. Counts a
        copied hit.

        Returns:
            ``features [n, F]`` of the entry on the device it was saved from (None: saved without).
        Raises:
            ValueError: ``dst`` is free or holds positions, or ``n`` is not in ``[1, len(stored.tokens)]``.
        """
        if dst in self._free or self._lengths[dst] != 0:
            raise ValueError(f"cannot restore into slot {dst}: it must be taken and empty")
        if not 0 < n <= len(stored.tokens):
            raise ValueError(f"the stored prefix holds {len(stored.tokens)} positions; cannot restore {n}")
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            k[dst, :, :n].copy_(stored.keys[i, :, :n])
            v[dst, :, :n].copy_(stored.values[i, :, :n])
        self._lengths[dst] = n
        self._clean[dst] = max(self._clean[dst], n)
        self.prefix.count_hit(n, copied=True)
        if stored.features is None:
            return None
        return stored.features[:n].to(stored.feature_device)

    @torch.inference_mode()
    def copy_prefix(self, src: int, dst: int, n: int) -> Tensor | None:
        """Copy columns ``[0, n)`` of every layer's keys and values from slot ``src`` into the
        taken slot ``dst`` and set ``dst``'s length to ``n`` (2 x layers copies of ``[H_kv, n, Dh]``:
        2,000 positions of SmolLM2-135M are 46 MB in float32). Read-only on ``src``: only its
        committed columns (a running slot's length, a free slot's cached prefix) are copied, and
        its owner writes only past its committed length. Counts a copied hit.

        Returns:
            ``features [n, F]`` of a cached source prefix (None: a running source, or cached
            without features).
        Raises:
            ValueError: ``dst`` is free or holds positions, ``src == dst``, or ``n`` is beyond the
                source's committed positions.
        """
        if dst in self._free or self._lengths[dst] != 0 or src == dst:
            raise ValueError(f"cannot copy into slot {dst}: it must be taken, empty and not the source {src}")
        entry = self.prefix.entry(src) if src in self._free else None
        have = len(entry.tokens) if entry is not None else (0 if src in self._free else self._lengths[src])
        if not 0 < n <= have:
            raise ValueError(f"slot {src} holds {have} committed positions; cannot copy {n}")
        for k, v in zip(self.keys, self.values):
            k[dst, :, :n] = k[src, :, :n]
            v[dst, :, :n] = v[src, :, :n]
        self._lengths[dst] = n
        self._clean[dst] = max(self._clean[dst], n)
        self.prefix.touch(src)
        self.prefix.count_hit(n, copied=True)
        return entry.features[:n] if entry is not None and entry.features is not None else None

    def reserve(self, slot: int) -> None:
        """Take ``slot`` out of the free list for good (a runner's scratch slot for padding rows).

        Raises:
            ValueError: ``slot`` is not free.
        """
        if slot not in self._free:
            raise ValueError(f"slot {slot} is not free")
        self.evict(slot)
        self._free.remove(slot)

    def free(self, slot: int, tokens: list[int] | None = None, features: Tensor | None = None) -> None:
        """Return a slot (idempotent). With ``tokens`` (the ids of its committed positions, exactly
        :meth:`length` of them) and optionally their ``features [len(tokens), F]``, the slot keeps
        its KV as a cached prefix; otherwise it caches nothing (a mismatched length caches nothing)."""
        if slot in self._free:
            return
        if tokens is not None and len(tokens) == self._lengths[slot] and \
                (features is None or features.shape[0] == len(tokens)):
            self.prefix.store(slot, tokens, features)
        else:
            self.prefix.drop(slot)
        self._lengths[slot] = 0
        self._free.append(slot)

    def length(self, slot: int) -> int:
        """Committed positions of ``slot``."""
        return self._lengths[slot]

    def extend(self, slot: int, n: int) -> None:
        """Mark the ``n`` rows written past the committed length as committed (a prompt chunk)."""
        if self._lengths[slot] + n > self.capacity:
            raise ValueError(f"slot {slot} would exceed its {self.capacity} positions")
        self._lengths[slot] += n

    def prepare(self, slots: list[int], length: int) -> None:
        """Zero-fill columns ``[0, length)`` of ``slots`` that were never written (once per column)."""
        for slot in slots:
            lo = self._clean[slot]
            if lo < length:
                for k, v in zip(self.keys, self.values):
                    k[slot, :, lo:length].zero_()
                    v[slot, :, lo:length].zero_()
                self._clean[slot] = length

    def write(self, layer: int, slot_idx: Tensor, pos_idx: Tensor, keys: Tensor, values: Tensor) -> None:
        """Write rows ``keys/values [R, H_kv, Dh]`` at ``(slot_idx[r], pos_idx[r])`` of ``layer``."""
        self.keys[layer][slot_idx, :, pos_idx] = keys
        self.values[layer][slot_idx, :, pos_idx] = values

    def write_read(self, layer: int, slot: int, start: int, keys: Tensor, values: Tensor,
                   length: int) -> tuple[Tensor, Tensor]:
        """Write ``keys/values [H_kv, R, Dh]`` to columns ``start .. start + R - 1`` of ``slot`` in
        ``layer`` (the values :meth:`write` stores for one segment's consecutive columns, as two slice
        copies), then return ``keys, values [H_kv, length, Dh]``: views of the slot's first ``length``
        columns (the runner's per-request attention: one call a layer)."""
        k, v = self.keys[layer][slot], self.values[layer][slot]
        n = keys.shape[1]
        k[:, start:start + n] = keys
        v[:, start:start + n] = values
        return k[:, :length], v[:, :length]

    def read(self, layer: int, slots: Tensor, length: int) -> tuple[Tensor, Tensor]:
        """``keys, values [n, H_kv, length, Dh]`` of ``slots``, gathered (no look at the slot values,
        hence no host sync on CUDA: the padded steps' read; :meth:`write_read` views one slot)."""
        return self.keys[layer][slots, :, :length], self.values[layer][slots, :, :length]

    @torch.inference_mode()
    def commit(self, slot: int, start: int, accepted_rows: Tensor) -> None:
        """After a verify written from column ``start``: move row ``accepted_rows[i]`` to column
        ``start + i`` in every layer and set the slot's length to ``start + len(accepted_rows)``.
        A contiguous prefix path moves nothing."""
        rows = accepted_rows.tolist()
        n = len(rows)
        if start != self._lengths[slot]:
            raise ValueError(f"slot {slot} holds {self._lengths[slot]} positions, commit expects {start}")
        if rows != list(range(n)):
            src = torch.tensor(rows, device=self.device) + start
            for k, v in zip(self.keys, self.values):
                k[slot, :, start:start + n] = k[slot, :, src]
                v[slot, :, start:start + n] = v[slot, :, src]
        self._lengths[slot] = start + n

    @torch.inference_mode()
    def commit_paths(self, slots: list[int], starts: list[int], accepted_rows: Tensor, lengths: list[int]) -> None:
        """:meth:`commit` of many slots at once, with the accepted paths left on the device.

        One gather and one indexed write per layer's keys and values for all ``n`` slots (instead of
        one ``.tolist()`` and two copies per slot and layer), with static shapes: entry ``(i, j)``
        moves column ``starts[i] + accepted_rows[i, j]`` to ``starts[i] + j``; a ``-1`` entry (past a
        path) rewrites column ``starts[i]`` with its own value, as entry ``(i, 0)`` does (row 0, the
        root, is every path's first row). Sources are gathered before any write, as in :meth:`commit`.

        Args:
            slots, starts: host ints, each slot's committed length before the round (its verify
                rows were written from there).
            accepted_rows: ``[n, Rm]`` long on the cache's device, segment-local rows of each path
                by depth, ``-1`` padded (:class:`~services.tree.device_walk.SegmentWalk`).
            lengths: host ints, each path's rows (``accept_length + 1``; read from the round's one
                device-to-host transfer).
        Raises:
            ValueError: a start that is not the slot's committed length, or a path past the capacity.
        """
        for slot, start, n in zip(slots, starts, lengths):
            if start != self._lengths[slot] or start + n > self.capacity:
                raise ValueError(f"slot {slot} holds {self._lengths[slot]} positions, commit expects {start} (+{n})")
        rows = accepted_rows.to(self.device).long()  # [n, Rm]
        base = torch.tensor(starts, dtype=torch.long, device=self.device)[:, None]  # [n, 1]
        dst = base + torch.arange(rows.shape[1], device=self.device)  # [n, Rm]
        src = torch.where(rows >= 0, base + rows, base)
        dst = torch.where(rows >= 0, dst, base)
        slot_idx = torch.tensor(slots, dtype=torch.long, device=self.device)[:, None]  # [n, 1]
        for k, v in zip(self.keys, self.values):
            k[slot_idx, :, dst] = k[slot_idx, :, src]  # [n, Rm, Hkv, Dh] gathered, then written
            v[slot_idx, :, dst] = v[slot_idx, :, src]
        for slot, start, n in zip(slots, starts, lengths):
            self._lengths[slot] = start + n

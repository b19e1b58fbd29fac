"""A bounded host-RAM store of cached prefixes evicted from their KV slot.

llama.cpp ``llama-server``'s ``--cache-ram`` shape (vLLM's and SGLang's CPU offload of prefix KV).
A free slot's cached prefix (:mod:`services.verifier.prefix_cache`) is lost when its slot is given
to another request (an *eviction*): with every slot in use, the slot caching a long system prompt
is taken and the next request that shares it would prefill it again. Before the slot is
overwritten, :meth:`~services.verifier.kv_cache.SlotKVCache.take` saves the prefix here: its token
ids, every layer's K and V of its committed columns (``[L, H_kv, n, Dh]`` each, in the cache's
dtype) and its target feature rows when cached (``[n, F]``). Only prefixes of at least
:data:`MIN_STORED_TOKENS` positions are saved (a shorter one prefills in less time than it takes
room); a prefix whose tokens another stored entry starts with is not saved twice, and a stored
entry that is a prefix of the one saved is replaced by it.

:meth:`~services.verifier.prefix_cache.PrefixCache.plan` considers the entries as copy sources, as
another slot's columns: a prompt sharing at least ``min_copy`` positions more with an entry than
with anything in the slots copies those leading columns back into its slot
(:meth:`~services.verifier.kv_cache.SlotKVCache.restore_prefix`, the layout
:meth:`~services.verifier.kv_cache.SlotKVCache.copy_prefix` writes) and prefills only the rest;
the restored feature rows are handed to the drafter as a cold prefill's.

Memory: the entries live in host memory (``.to("cpu")`` copies of the device's columns; on a CPU
target, clones); :meth:`PrefixStore.nbytes` counts their KV, feature rows and :data:`ID_BYTES` per
token id, and ``max_bytes`` (``--prefix-cache-ram-mib``; 0 = off) bounds it: a save that takes the
total past the bound drops the least recently used entries (the new one last). Entries are not
pinned: each is copied once each way, and a pinned allocation per entry costs more than the copy
it would speed up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

ID_BYTES = 8  # bytes counted per cached token id (one list slot; small ids are shared int objects)
MIN_STORED_TOKENS = 256  # shortest prefix worth keeping in RAM (a 256-token prefill is ~0.4 s on a 2-core CPU)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]: bisect on slice equality (C speed)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass
class StoredPrefix:
    """A prefix saved in host memory.

    Attributes:
        tokens: token ids of its positions ``[0, n)``.
        keys, values: ``[L, H_kv, n, Dh]`` every layer's K and V at those positions (CPU).
        features: ``[n, F]`` target features at those positions (CPU), or None.
        feature_device: where the features are handed back (the device they were saved from).
        last_used: tick of the last save or restore (LRU order).
    """

    tokens: list[int]
    keys: Tensor
    values: Tensor
    features: Tensor | None
    feature_device: torch.device | None
    last_used: int

    def nbytes(self) -> int:
        """Host bytes it holds: K, V, feature rows and :data:`ID_BYTES` per token."""
        feats = self.features.numel() * self.features.element_size() if self.features is not None else 0
        return 2 * self.keys.numel() * self.keys.element_size() + feats + ID_BYTES * len(self.tokens)


@dataclass
class StoreStats:
    """Counters since start: ``saved`` prefixes saved on eviction, ``hits`` requests whose leading
    positions were restored from RAM (``hit_tokens`` positions), ``evictions`` entries dropped to
    stay within the bound."""

    saved: int = 0
    hits: int = 0
    hit_tokens: int = 0
    evictions: int = 0


class PrefixStore:
    """Evicted prefixes in host memory, least recently used dropped first past ``max_bytes``.

    Args:
        max_bytes: bound on :meth:`nbytes`; 0 stores nothing.
    Raises:
        ValueError: ``max_bytes`` < 0.
    """

    min_tokens = MIN_STORED_TOKENS

    def __init__(self, max_bytes: int = 0):
        self._entries: dict[int, StoredPrefix] = {}
        self._next = 0
        self._tick = 0
        self._bytes = 0
        self.max_bytes = max_bytes
        self.stats = StoreStats()

    @property
    def max_bytes(self) -> int:
        """The bound on :meth:`nbytes` (0: off). Setting a lower one drops LRU entries to fit.

        Raises:
            ValueError: set below 0.
        """
        return self._max_bytes

    @max_bytes.setter
    def max_bytes(self, value: int) -> None:
        if value < 0:
            raise ValueError(f"the prefix cache's RAM bound must be >= 0 bytes (got {value})")
        self._max_bytes = int(value)
        self._fit()

    def nbytes(self) -> int:
        """Host bytes held by every entry (:meth:`StoredPrefix.nbytes`)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def entry(self, key: int) -> StoredPrefix | None:
        """The entry under ``key`` (None: dropped)."""
        return self._entries.get(key)

    def wants(self, num_tokens: int) -> bool:
        """Whether a prefix of ``num_tokens`` positions would be saved (on, and long enough)."""
        return self._max_bytes > 0 and num_tokens >= self.min_tokens

    @torch.inference_mode()
    def save(self, tokens: list[int], layers: list[tuple[Tensor, Tensor]], features: Tensor | None) -> int:
        """Save a prefix evicted from its slot, most recently used; drop LRU entries past the bound.

        Args:
            tokens: its token ids (``n``).
            layers: per layer ``(keys, values)``, each ``[H_kv, >= n, Dh]`` (the slot's columns; only
                the first ``n`` are copied).
            features: ``[n, F]`` its target features, or None.
        Returns:
            The entry's key, or -1 when nothing was saved (off, shorter than ``min_tokens``, larger
            than the bound on its own, or already covered by an entry, which is marked used).
        """
        n = len(tokens)
        if not self.wants(n) or not layers:
            return -1
        for key, e in self._entries.items():
            if len(e.tokens) >= n and common_prefix(e.tokens, tokens) == n:
                self.touch(key)
                return -1
        k0 = layers[0][0]
        shape = (len(layers), k0.shape[0], n, k0.shape[2])
        per_pos = 2 * len(layers) * k0.shape[0] * k0.shape[2] * k0.element_size() + ID_BYTES
        feat_bytes = features.numel() * features.element_size() if features is not None else 0
        if per_pos * n + feat_bytes > self._max_bytes:
            return -1
        for key in [k for k, e in self._entries.items() if common_prefix(e.tokens, tokens) == len(e.tokens)]:
            self._drop(key)  # superseded: the new entry starts with it
        keys = torch.empty(shape, dtype=k0.dtype, device="cpu")
        values = torch.empty(shape, dtype=k0.dtype, device="cpu")
        for i, (k, v) in enumerate(layers):
            keys[i].copy_(k[:, :n])
            values[i].copy_(v[:, :n])
        feats = features.to("cpu", copy=True) if features is not None else None
        self._tick += 1
        key, self._next = self._next, self._next + 1
        self._entries[key] = StoredPrefix(list(tokens), keys, values, feats,
                                          features.device if features is not None else None, self._tick)
        self._bytes += self._entries[key].nbytes()
        self.stats.saved += 1
        self._fit()
        return key

    def longest(self, prompt: list[int], need_features: bool) -> tuple[int, int]:
        """``(key, n)``: the entry sharing the longest prefix with ``prompt``, ``n`` capped at
        ``len(prompt) - 1``; with ``need_features`` only entries saved with features; ``(-1, 0)``
        when none shares a token (the most recently used among ties)."""
        best, best_len, best_tick = -1, 0, -1
        cap = len(prompt) - 1
        for key, e in self._entries.items():
            if need_features and e.features is None:
                continue
            n = min(common_prefix(e.tokens, prompt), cap)
            if n > best_len or (n == best_len and n > 0 and e.last_used > best_tick):
                best, best_len, best_tick = key, n, e.last_used
        return best, best_len

    def count_hit(self, key: int, n: int) -> None:
        """Count a restore of ``n`` positions from ``key``'s entry and mark it most recently used."""
        self.stats.hits += 1
        self.stats.hit_tokens += n
        self.touch(key)

    def touch(self, key: int) -> None:
        """Mark ``key``'s entry most recently used (no-op when dropped)."""
        e = self._entries.get(key)
        if e is not None:
            self._tick += 1
            e.last_used = self._tick

    def clear(self) -> None:
        """Drop every entry (not counted as evictions): their KV no longer matches what the steps
        compute (the runner's step was swapped)."""
        for key in list(self._entries):
            self._drop(key)

    def _drop(self, key: int) -> None:
        e = self._entries.pop(key)
        self._bytes -= e.nbytes()

    def _fit(self) -> None:
        """Drop least recently used entries until :meth:`nbytes` is within the bound."""
        while self._bytes > self._max_bytes and self._entries:
            self._drop(min(self._entries, key=lambda k: self._entries[k].last_used))
            self.stats.evictions += 1

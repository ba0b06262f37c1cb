"""A growable open-addressing hash map from non-negative int64 keys to int64 ids.

Why not a ``dict``: BFS over the DTMC looks up millions of packed states;
a Python dict costs ~100 ns per key plus list conversions, while these
vectorised probes cost a cache miss or so per key.  Keys and ids sit side by
side in one (capacity, 2) array so a probe touches one cache line; linear
probing with a multiplicative (Fibonacci) hash and load factor <= 0.5 keeps
the number of probe rounds small.
"""

from __future__ import annotations

import numpy as np

_EMPTY = np.int64(-1)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


class Int64Map:
    """Maps packed state keys to dense ids 0, 1, 2, ... in insertion order."""

    def __init__(self, capacity_hint: int = 1 << 12) -> None:
        bits = max(10, int(np.ceil(np.log2(max(capacity_hint, 1) * 2))))
        self._alloc(bits)
        self.size = 0

    def _alloc(self, bits: int) -> None:
        self._bits = bits
        self._mask = np.int64((1 << bits) - 1)
        self._tab = np.full((1 << bits, 2), _EMPTY, dtype=np.int64)  # [key, id]

    def _slots(self, keys: np.ndarray) -> np.ndarray:
        # Multiplicative hashing: take the top `bits` bits of key * golden.
        # Views, not astype: keys are non-negative, and each copy is a full pass.
        h = keys.view(np.uint64) * _GOLDEN
        h >>= np.uint64(64 - self._bits)
        return h.view(np.int64)

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """Ids of `keys`, -1 where absent."""
        slot = self._slots(keys)
        row = self._tab[slot]
        hit = row[:, 0] == keys
        out = np.where(hit, row[:, 1], -1)
        # Keep probing only where the slot holds some other key.
        pending = np.flatnonzero(~hit & (row[:, 0] != _EMPTY))
        k = keys[pending]
        slot = (slot[pending] + 1) & self._mask
        while pending.size:
            row = self._tab[slot]
            hit = row[:, 0] == k
            out[pending[hit]] = row[hit, 1]
            go_on = ~hit & (row[:, 0] != _EMPTY)
            pending, k = pending[go_on], k[go_on]
            slot = (slot[go_on] + 1) & self._mask
        return out

    def insert_new(self, keys: np.ndarray) -> np.ndarray:
        """Insert distinct keys known to be absent; return their new ids."""
        n = keys.shape[0]
        ids = np.arange(self.size, self.size + n, dtype=np.int64)
        if 2 * (self.size + n) > self._tab.shape[0]:
            self._grow(self.size + n)
        self._place(keys, ids)
        self.size += n
        return ids

    def _place(self, keys: np.ndarray, ids: np.ndarray) -> None:
        slot = self._slots(keys)
        tab = self._tab
        while keys.size:
            free = tab[slot, 0] == _EMPTY
            # Several keys may race for one free slot: write all, read back,
            # and let the losers probe on.
            fs = slot[free]
            tab[fs, 0] = keys[free]
            won = np.zeros(keys.shape[0], dtype=bool)
            won[free] = tab[fs, 0] == keys[free]
            tab[slot[won], 1] = ids[won]
            lose = ~won
            keys, ids = keys[lose], ids[lose]
            slot = (slot[lose] + 1) & self._mask

    def _grow(self, needed: int) -> None:
        old = self._tab
        used = old[:, 0] != _EMPTY
        bits = self._bits
        while (1 << bits) < 2 * needed:
            bits += 1
        self._alloc(bits + 1)
        self._place(old[used, 0].copy(), old[used, 1].copy())

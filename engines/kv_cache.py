"""Paged KV pool and page allocator.

The pool is one tensor per K and V, `[num_layers, num_pages * page_size, num_kv_heads, head_dim]`:
a *slot* is `page * page_size + offset`, so a request's `block_table` (its list of page ids)
turns token positions into slots without copying anything when the request grows.
"""
from __future__ import annotations

import torch

from engines.config import ModelConfig


class KVPool:
    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device):
        self.num_pages, self.page_size = num_pages, page_size
        # One extra, zeroed slot at the end (`null_slot`): padded attention positions read it, so
        # they never read never-written memory (NaN garbage there would poison 0-weight terms).
        shape = (cfg.num_hidden_layers, num_pages * page_size + 1, cfg.num_key_value_heads, cfg.head_dim)
        # torch.empty: untouched pages cost no resident memory on CPU.
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.k[:, -1].zero_()
        self.v[:, -1].zero_()

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def null_slot(self) -> int:
        return self.num_slots

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


class PageAllocator:
    """Free-list allocator with reference counts (a page may be shared through the prefix cache)."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.ref_count = [0] * num_pages
        # pop() from the end: low page ids first, which keeps tests readable.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise MemoryError("KV pool exhausted")
        page = self._free.pop()
        self.ref_count[page] = 1
        return page

    def incref(self, page: int) -> None:
        self.ref_count[page] += 1

    def decref(self, page: int) -> int:
        """Drop one reference; returns the remaining count (the caller decides what 0 means)."""
        rc = self.ref_count[page] - 1
        if rc < 0:
            raise RuntimeError(f"page {page} released more often than it was taken")
        self.ref_count[page] = rc
        return rc

    def release(self, page: int) -> None:
        """Put an unreferenced page back on the free list."""
        assert self.ref_count[page] == 0, f"page {page} still referenced"
        self._free.append(page)

"""Prefix cache over full KV pages, hash-chained as in vLLM v1.

A full page is keyed by a digest of (digest of the previous page, its tokens), so equal keys
mean equal prefixes. The digest is cryptographic (blake2b-128): a plain `hash()` of token
tuples can be collided on purpose, which would let one user read another's KV. Pages whose
reference count drops to zero stay cached and become evictable in LRU order.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

PageKey = bytes


class PrefixCache:
    def __init__(self) -> None:
        self._page_of: dict[PageKey, int] = {}
        self._key_of: dict[int, PageKey] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced cached pages, LRU first

    def __len__(self) -> int:
        return len(self._key_of)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @staticmethod
    def page_keys(token_ids: list[int], page_size: int, num_pages: int, parent: PageKey | None = None) -> list[PageKey]:
        """Keys of the first `num_pages` full pages of `token_ids`, chained after `parent`."""
        if num_pages <= 0:
            return []
        pages = np.asarray(token_ids[:num_pages * page_size], dtype=np.int64).reshape(num_pages, page_size)
        keys, prev = [], parent or b""
        for row in pages:
            prev = hashlib.blake2b(prev + row.tobytes(), digest_size=16).digest()
            keys.append(prev)
        return keys

    def lookup(self, key: PageKey) -> int | None:
        return self._page_of.get(key)

    def contains_page(self, page: int) -> bool:
        return page in self._key_of

    def key_of(self, page: int) -> PageKey | None:
        return self._key_of.get(page)

    def insert(self, key: PageKey, page: int) -> bool:
        """Cache `page` under `key`. False when the key is already cached by another page."""
        if key in self._page_of or page in self._key_of:
            return False
        self._page_of[key] = page
        self._key_of[page] = key
        return True

    def touch(self, page: int) -> None:
        """A request took a reference: the page is no longer evictable."""
        self._evictable.pop(page, None)

    def park(self, page: int) -> None:
        """The last reference was dropped: keep the page cached, evictable, most recent last."""
        self._evictable[page] = None
        self._evictable.move_to_end(page)

    def evict(self) -> int | None:
        """Forget the least recently used unreferenced page and return it, or None."""
        if not self._evictable:
            return None
        page, _ = self._evictable.popitem(last=False)
        del self._page_of[self._key_of.pop(page)]
        return page

    def discard(self, page: int) -> None:
        """Forget `page` whatever its references (its content is not to be shared): its holders keep
        it, and the last one's release returns it to the free pool."""
        key = self._key_of.pop(page, None)
        if key is not None:
            del self._page_of[key]
            self._evictable.pop(page, None)

    def clear(self) -> list[int]:
        """Drop every evictable page (returns them); referenced pages stay cached."""
        pages = []
        while (p := self.evict()) is not None:
            pages.append(p)
        return pages

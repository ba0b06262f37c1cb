"""Gives sequences KV pages: prefix matching at admission, growth per step, release at the end."""
from __future__ import annotations

from engines.kv_cache import PageAllocator
from engines.prefix_cache import PageKey, PrefixCache
from engines.sequence import Sequence


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)
        self.prefix_cache = PrefixCache() if enable_prefix_caching else None
        self.num_prefix_matches = 0  # admissions that ran prefix matching (handoff-resume must not)
        self.num_hit_tokens = 0  # tokens those admissions found in the cache

    # -- accounting --------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def num_free_pages(self) -> int:
        """Pages that can be handed out now: free, or cached but evictable."""
        evictable = self.prefix_cache.num_evictable if self.prefix_cache else 0
        return self.allocator.num_free + evictable

    @property
    def num_cached_pages(self) -> int:
        return len(self.prefix_cache) if self.prefix_cache else 0

    @property
    def num_used_pages(self) -> int:
        """Pages referenced by live sequences."""
        return self.num_pages - self.num_free_pages

    def pages_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.page_size)
        return max(0, total - len(seq.block_table))

    # -- admission -----------------------------------------------------------------------------
    def admit(self, seq: Sequence) -> None:
        """Attach cached prefix pages to a new sequence (no allocation beyond them)."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        if self.prefix_cache is None:
            return
        self.num_prefix_matches += 1
        # At least one token must be computed: its logits give the next token.
        n_full = (len(seq.token_ids) - 1) // self.page_size
        keys = PrefixCache.page_keys(seq.token_ids, self.page_size, n_full)
        for key in keys:
            page = self.prefix_cache.lookup(key)
            if page is None:
                break
            if self.allocator.ref_count[page] == 0:
                self.prefix_cache.touch(page)
            self.allocator.incref(page)
            seq.block_table.append(page)
            seq.last_page_key = key
        seq.num_registered_pages = len(seq.block_table)
        seq.num_cached_tokens = seq.num_computed_tokens = len(seq.block_table) * self.page_size
        self.num_hit_tokens += seq.num_cached_tokens

    def _take_page(self) -> int:
        if self.allocator.num_free == 0 and self.prefix_cache is not None:
            page = self.prefix_cache.evict()
            if page is not None:
                self.allocator.release(page)
        return self.allocator.alloc()

    def reserve(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more KV entries. False (and no change) if out of pages."""
        need = self.pages_needed(seq, num_new_tokens)
        if need == 0:  # most decode steps: the last page has room
            return True
        if need > self.num_free_pages:
            return False
        for _ in range(need):
            seq.block_table.append(self._take_page())
        return True

    def slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        ps, bt = self.page_size, seq.block_table
        return [bt[t // ps] * ps + t % ps for t in range(start, end)]

    def commit_computed(self, seq: Sequence, num_tokens: int) -> None:
        """`num_tokens` more KV entries were written; offer newly full pages to the prefix cache."""
        seq.num_computed_tokens += num_tokens
        if self.prefix_cache is None:
            return
        n_full = seq.num_computed_tokens // self.page_size
        if n_full <= seq.num_registered_pages:
            return
        keys = PrefixCache.page_keys(seq.token_ids[seq.num_registered_pages * self.page_size:], self.page_size,
                                     n_full - seq.num_registered_pages, seq.last_page_key)
        for i, key in enumerate(keys, start=seq.num_registered_pages):
            self.prefix_cache.insert(key, seq.block_table[i])  # a duplicate simply stays private
        seq.num_registered_pages, seq.last_page_key = n_full, keys[-1]

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep the sequence's first `num_tokens` tokens (>= 1) and what of their K/V may be kept; the
        pages past them go back (a cached one stays in the prefix cache: its content still matches
        its key). At least the last kept token is left to compute, so the next step has logits to
        sample from, as at admission. The next write must not land in a page the prefix cache holds:
        such pages are full and may be shared (another sequence matched it, or will), so when the
        first position to compute falls inside one, that page is dropped too and its kept part is
        computed again (at most page_size - 1 tokens) rather than copied."""
        if not 1 <= num_tokens <= len(seq.token_ids):
            raise ValueError(f"truncate to {num_tokens} tokens: a sequence of {len(seq.token_ids)} keeps 1 to all of them")
        ps = self.page_size
        computed = min(seq.num_computed_tokens, num_tokens - 1)
        page = computed // ps
        if computed % ps and page < len(seq.block_table) and self._shared(seq.block_table[page]):
            computed = page * ps  # the write would land in a cached (full, maybe shared) page
        keep = -(-computed // ps)
        dropped, seq.block_table = seq.block_table[keep:], seq.block_table[:keep]
        self._drop(dropped)
        del seq.token_ids[num_tokens:]
        seq.num_computed_tokens = computed
        seq.num_cached_tokens = min(seq.num_cached_tokens, computed)
        seq.num_registered_pages = min(seq.num_registered_pages, computed // ps)
        seq.last_page_key = self._key_of_page(seq, seq.num_registered_pages - 1)

    def _key_of_page(self, seq: Sequence, i: int) -> PageKey | None:
        """The chain key of the sequence's page `i` (None for i < 0): the cache's, or, for a page
        that stayed private (its key was cached by another page first), hashed again from the tokens."""
        if i < 0 or self.prefix_cache is None:
            return None
        return self.prefix_cache.key_of(seq.block_table[i]) or PrefixCache.page_keys(seq.token_ids, self.page_size, i + 1)[-1]

    def uncache(self, seq: Sequence) -> None:
        """The sequence's K/V may be broken (its logits were NaN/inf): no later request may match the
        pages it computed, so they leave the prefix cache (the ones it matched at admission stay)."""
        if self.prefix_cache is None:
            return
        for page in seq.block_table[seq.num_cached_tokens // self.page_size:]:
            self.prefix_cache.discard(page)

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's pages: cached ones stay in the prefix cache, the rest go back."""
        self._drop(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_pages = 0
        seq.last_page_key = None

    def _shared(self, page: int) -> bool:
        return (self.prefix_cache is not None and self.prefix_cache.contains_page(page)) or \
            self.allocator.ref_count[page] > 1

    def _drop(self, pages: list[int]) -> None:
        """A sequence lets go of `pages`: the last reference to a cached one parks it in the prefix
        cache (evictable), to any other returns it to the pool."""
        for page in pages:
            if self.allocator.decref(page) == 0:
                if self.prefix_cache is not None and self.prefix_cache.contains_page(page):
                    self.prefix_cache.park(page)
                else:
                    self.allocator.release(page)

    def reset_prefix_cache(self) -> int:
        if self.prefix_cache is None:
            return 0
        pages = self.prefix_cache.clear()
        for p in pages:
            self.allocator.release(p)
        return len(pages)

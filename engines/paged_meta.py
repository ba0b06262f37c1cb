"""Paged-KV metadata in the CSR form GPU kernels take (flashinfer, Triton): built from the same
block tables the torch backend reads, in plain Python, so it is tested on CPU."""
from __future__ import annotations

from typing import NamedTuple


class PagedMeta(NamedTuple):
    qo_indptr: list[int]  # [B+1] query-token offsets per sequence
    kv_indptr: list[int]  # [B+1] offsets into kv_indices per sequence
    kv_indices: list[int]  # page ids, sequence after sequence
    kv_last_page_len: list[int]  # [B] tokens used in each sequence's last page (1..page_size)


def build_paged_meta(q_lens: list[int], kv_lens: list[int], block_tables: list[list[int]], page_size: int) -> PagedMeta:
    qo, kv_ptr, idx, last = [0], [0], [], []
    for q, n, bt in zip(q_lens, kv_lens, block_tables):
        if n < 1 or q < 1 or q > n:
            raise ValueError(f"bad lengths: q_len={q}, kv_len={n}")
        pages = -(-n // page_size)
        if pages > len(bt):
            raise ValueError(f"kv_len {n} needs {pages} pages, block table has {len(bt)}")
        qo.append(qo[-1] + q)
        idx.extend(bt[:pages])
        kv_ptr.append(len(idx))
        last.append(n - (pages - 1) * page_size)
    return PagedMeta(qo, kv_ptr, idx, last)


def slots_from_meta(meta: PagedMeta, page_size: int) -> list[list[int]]:
    """Inverse view, for tests: the pool slots of every sequence's context, in order."""
    out = []
    for b in range(len(meta.kv_last_page_len)):
        pages = meta.kv_indices[meta.kv_indptr[b]:meta.kv_indptr[b + 1]]
        slots = [p * page_size + o for p in pages[:-1] for o in range(page_size)]
        slots += [pages[-1] * page_size + o for o in range(meta.kv_last_page_len[b])]
        out.append(slots)
    return out

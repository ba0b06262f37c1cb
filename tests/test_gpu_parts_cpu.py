"""The GPU path's pure-Python pieces, checked on CPU: backend choice, paged metadata, joint KV."""
from __future__ import annotations

import random

import pytest
import torch

import engines.attention as attention
from engines.attention import BatchLayout, TorchBackend, select_backend
from engines.memory import ModelFootprint, joint_kv_tokens
from engines.paged_meta import build_paged_meta, slots_from_meta


def test_cpu_picks_torch_even_when_flashinfer_is_installed(monkeypatch):
    monkeypatch.setattr(attention, "_has", lambda name: True)  # as if flashinfer and triton were installed
    assert isinstance(select_backend(torch.device("cpu")), TorchBackend)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        select_backend(torch.device("cpu"), "flashinfer")
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_backend(torch.device("cpu"), "magic")


@pytest.mark.parametrize("seed", range(5))
def test_paged_meta_matches_torch_reference(seed):
    """The CSR metadata names exactly the pool slots the torch backend gathers."""
    rng = random.Random(seed)
    ps, B = 4, 6
    free = list(range(200))
    rng.shuffle(free)
    q_lens, kv_lens, tables = [], [], []
    for i in range(B):
        n = rng.randrange(1, 40)
        q = 1 if i < 3 else rng.randrange(1, n + 1)  # three decodes first, then extends
        pages = -(-n // ps) + rng.randrange(2)  # a table may hold an extra, not yet used page
        q_lens.append(q), kv_lens.append(n), tables.append([free.pop() for _ in range(pages)])
    meta = build_paged_meta(q_lens, kv_lens, tables, ps)
    assert meta.qo_indptr[-1] == sum(q_lens) and len(meta.kv_indptr) == B + 1
    assert all(1 <= x <= ps for x in meta.kv_last_page_len)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    layout = BatchLayout(3, q_lens, kv_lens, torch.zeros(sum(q_lens), dtype=torch.int64), bt, ps)
    tmeta = TorchBackend().plan(layout)
    ref, off = [], 0
    for g in tmeta.decode_groups:  # decode slots are stored group after group, each [n, max_kv]
        rows = tmeta.decode_slots[off:off + (g.end - g.start) * g.max_kv].view(-1, g.max_kv)
        ref += [rows[i - g.start, :kv_lens[i]].tolist() for i in range(g.start, g.end)]
        assert all(x == -1 for i in range(g.start, g.end) for x in rows[i - g.start, kv_lens[i]:].tolist())
        off += (g.end - g.start) * g.max_kv
    for i, e in enumerate(tmeta.extends, start=3):
        ref.append(e.kv_slots.tolist() if e.kv_slots is not None else
                   [tables[i][t // ps] * ps + t % ps for t in range(kv_lens[i])])
    assert slots_from_meta(meta, ps) == ref


def test_paged_meta_rejects_bad_lengths():
    with pytest.raises(ValueError, match="needs 2 pages"):
        build_paged_meta([1], [5], [[3]], 4)
    with pytest.raises(ValueError, match="bad lengths"):
        build_paged_meta([3], [2], [[3]], 4)


def test_joint_kv_tokens():
    gib = 2**30
    a = ModelFootprint("small", 1 * gib, 100_000)
    b = ModelFootprint("large", 16 * gib, 400_000)
    t = joint_kv_tokens([a, b], 80 * gib, memory_fraction=0.9, page_size=16)
    budget = 0.9 * 80 * gib - 17 * gib
    assert t % 16 == 0 and t * 500_000 <= budget < (t + 16) * 500_000
    # sharing a device halves what each would get alone only through the summed per-token cost
    alone = joint_kv_tokens([b], 80 * gib, memory_fraction=0.9)
    assert alone > t
    with pytest.raises(ValueError, match="no room"):
        joint_kv_tokens([b], 16 * gib)
    with pytest.raises(ValueError, match="memory_fraction"):
        joint_kv_tokens([a], 80 * gib, memory_fraction=1.5)

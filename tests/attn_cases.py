"""Random attention steps over a paged pool, shared by the attention-backend tests."""
from __future__ import annotations

import random

import torch

from engines.attention import BatchLayout


def random_step(rng: random.Random, num_decodes: int, num_extends: int, ps: int, hkv: int, d: int,
                dtype: torch.dtype, max_ctx: int = 90):
    """A pool full of earlier K/V and one step's batch: decodes first, then extends (some with a
    cached prefix, some without). -> (layout, k cache, v cache, a seeded generator for q/k/v)"""
    num_pages = (num_decodes + num_extends) * -(-max_ctx // ps) + 3
    free = list(range(num_pages))
    rng.shuffle(free)
    q_lens, kv_lens, tables, slots = [], [], [], []
    for i in range(num_decodes + num_extends):
        kv = rng.randrange(1, max_ctx)
        q = 1 if i < num_decodes else rng.choice([kv, rng.randrange(1, kv + 1)])
        if i < num_decodes and kv == 1:
            kv = 2  # a decode has context before its token
        pages = [free.pop() for _ in range(-(-kv // ps))]
        tables.append(pages)
        q_lens.append(q), kv_lens.append(kv)
        slots += [pages[t // ps] * ps + t % ps for t in range(kv - q, kv)]
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
    layout = BatchLayout(num_decodes, q_lens, kv_lens, torch.tensor(slots, dtype=torch.int64), bt, ps)
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    n_slots = num_pages * ps + 1
    kc = torch.randn(n_slots, hkv, d, generator=g).to(dtype)
    vc = torch.randn(n_slots, hkv, d, generator=g).to(dtype)
    kc[-1] = 0  # KVPool's null slot
    vc[-1] = 0
    return layout, kc, vc, g

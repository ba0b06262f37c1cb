"""Page allocator, prefix cache and block manager on CPU, plus prefix reuse in the engine."""
from __future__ import annotations

import random

from hypothesis import given, settings, strategies as st

from engines import Engine, SamplingParams
from engines.block_manager import BlockManager
from engines.kv_cache import PageAllocator
from engines.prefix_cache import PrefixCache
from engines.sequence import Sequence

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def test_allocator_refcounts():
    a = PageAllocator(4)
    p = [a.alloc() for _ in range(4)]
    assert sorted(p) == [0, 1, 2, 3] and a.num_free == 0
    try:
        a.alloc()
        raise AssertionError("alloc on an empty pool must fail")
    except MemoryError:
        pass
    a.incref(p[0])
    assert a.decref(p[0]) == 1 and a.decref(p[0]) == 0
    a.release(p[0])
    assert a.num_free == 1


def test_prefix_keys_chain_and_lru():
    k1 = PrefixCache.page_keys(list(range(8)), 4, 2)
    k2 = PrefixCache.page_keys([0, 1, 2, 3, 9, 9, 9, 9], 4, 2)
    assert k1[0] == k2[0] and k1[1] != k2[1]  # same first page, different second
    # the same tokens after a different prefix get a different key
    assert PrefixCache.page_keys([4, 5, 6, 7], 4, 1)[0] != k1[1]
    pc = PrefixCache()
    assert pc.insert(k1[0], 10) and not pc.insert(k1[0], 11)
    pc.insert(k1[1], 11)
    pc.park(10), pc.park(11)
    pc.touch(10)  # back in use: not evictable
    assert pc.evict() == 11 and pc.evict() is None and pc.lookup(k1[0]) == 10


def test_block_manager_prefix_match_and_free():
    bm = BlockManager(num_pages=8, page_size=4)
    a = Sequence(list(range(10)), GREEDY)
    bm.admit(a)
    assert a.num_cached_tokens == 0
    assert bm.reserve(a, 10) and len(a.block_table) == 3
    bm.commit_computed(a, 10)  # two full pages become cached
    b = Sequence(list(range(9)) + [99], GREEDY)
    bm.admit(b)
    assert b.num_cached_tokens == 8 and b.block_table == a.block_table[:2]
    bm.free(a), bm.free(b)
    assert bm.num_free_pages == 8 and bm.num_cached_pages == 2
    # a prompt fully covered by cached pages still computes its last token
    c = Sequence(list(range(8)), GREEDY)
    bm.admit(c)
    assert c.num_cached_tokens == 4


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 3), st.booleans()), min_size=1, max_size=12),
       st.integers(0, 10_000))
def test_pages_conserved(reqs, seed):
    """Any mix of admit/grow/finish: free + cached == total once nothing is running, and the
    pages in use are never more than the pool."""
    rng = random.Random(seed)
    bm = BlockManager(num_pages=24, page_size=4)
    live = []
    prefixes = [[rng.randrange(50) for _ in range(40)] for _ in range(3)]
    for n, pfx, finish_early in reqs:
        s = Sequence(prefixes[pfx % 3][:n] if pfx < 3 else [rng.randrange(50) for _ in range(n)], GREEDY)
        bm.admit(s)
        if not bm.reserve(s, s.num_uncomputed):
            bm.free(s)
            continue
        bm.commit_computed(s, s.num_uncomputed)
        for _ in range(rng.randrange(6)):
            s.token_ids.append(rng.randrange(50))
            if not bm.reserve(s, 1):
                break
            bm.commit_computed(s, 1)
        (bm.free(s) if finish_early else live.append(s))
        assert 0 <= bm.num_used_pages <= bm.num_pages
    for s in live:
        bm.free(s)
    assert bm.num_free_pages == bm.num_pages
    assert bm.allocator.num_free + bm.num_cached_pages == bm.num_pages


def test_engine_prefix_reuse_computes_only_suffix(tiny_qwen3):
    eng = Engine.from_pretrained(tiny_qwen3, num_kv_tokens=4096, page_size=16)
    shared = [random.Random(0).randrange(2, 512) for _ in range(200)]
    eng.generate(shared + [7, 8, 9], max_tokens=4, temperature=0.0, ignore_eos=True)
    before = eng.stats.num_prefill_tokens
    out = eng.generate(shared + [11, 12, 13, 14, 15], max_tokens=4, temperature=0.0, ignore_eos=True)[0]
    computed = eng.stats.num_prefill_tokens - before
    assert out.num_cached_tokens == 192  # 12 full pages of the 200 shared tokens
    assert computed == 205 - 192
    # and the answer is the same as without the cache
    cold = Engine.from_pretrained(tiny_qwen3, num_kv_tokens=4096, enable_prefix_caching=False)
    assert cold.generate(shared + [11, 12, 13, 14, 15], max_tokens=4, temperature=0.0,
                         ignore_eos=True)[0].token_ids == out.token_ids
    kv = eng.kv_usage()
    assert kv.pages_free == kv.pages_total and kv.pages_used == 0 and kv.pages_cached > 0


def test_preemption_when_kv_runs_out(tiny_qwen3):
    """A pool far too small for the batch: requests are preempted and recomputed, never
    crash, and greedy output equals a run with plenty of KV."""
    prompts = [[random.Random(i).randrange(2, 512) for _ in range(30)] for i in range(6)]
    big = Engine.from_pretrained(tiny_qwen3, num_kv_tokens=4096).generate(
        prompts, max_tokens=40, temperature=0.0, ignore_eos=True)
    small = Engine.from_pretrained(tiny_qwen3, num_kv_tokens=160, page_size=16)
    outs = small.generate(prompts, max_tokens=40, temperature=0.0, ignore_eos=True)
    assert small.kv_usage().preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in big]
    assert small.kv_usage().pages_free == small.kv_usage().pages_total

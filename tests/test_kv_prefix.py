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


def all_back(bm: BlockManager, live: list[Sequence]) -> None:
    """Free what is still live: then every page is free or cached, none lost."""
    for s in live:
        bm.free(s)
    assert bm.num_free_pages == bm.num_pages
    assert bm.allocator.num_free + bm.num_cached_pages == bm.num_pages


def compute_all(bm: BlockManager, s: Sequence) -> bool:
    """Reserve and write the K/V of every token `s` has not computed; False (and `s` freed) when
    the pool is out of pages."""
    if not bm.reserve(s, s.num_uncomputed):
        bm.free(s)
        return False
    bm.commit_computed(s, s.num_uncomputed)
    return True


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
        if not compute_all(bm, s):
            continue
        for _ in range(rng.randrange(6)):
            s.token_ids.append(rng.randrange(50))
            if not bm.reserve(s, 1):
                break
            bm.commit_computed(s, 1)
        (bm.free(s) if finish_early else live.append(s))
        assert 0 <= bm.num_used_pages <= bm.num_pages
    all_back(bm, live)


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


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 30), st.integers(0, 3), st.integers(0, 8), st.integers(0, 40),
                          st.booleans()), min_size=1, max_size=10),
       st.integers(0, 10_000))
def test_truncate_keeps_pages_conserved_and_the_cache_consistent(reqs, seed):
    """Any mix of admit/grow/truncate/grow again/finish: every registered page still holds the
    tokens its key says, the next write never lands in a cached or shared page, and once nothing is
    live every page is free or cached."""
    rng = random.Random(seed)
    ps = 4
    bm = BlockManager(num_pages=64, page_size=ps)
    live = []
    prefixes = [[rng.randrange(50) for _ in range(40)] for _ in range(3)]

    def grow(s, n):  # n more tokens, each computed; False (s freed) when out of pages
        for _ in range(n):
            s.token_ids.append(rng.randrange(50))
            if not compute_all(bm, s):
                return False
        return True

    def consistent(s):
        # a registered page is cached under the key of its tokens, or stayed private (another page
        # cached that key first); the chain goes on from the last one's key either way
        keys = PrefixCache.page_keys(s.token_ids, ps, s.num_registered_pages)
        for page, key in zip(s.block_table, keys):
            assert bm.prefix_cache.key_of(page) in (key, None)
        assert s.last_page_key == (keys[-1] if keys else None)
        assert s.num_computed_tokens < len(s.token_ids) or s.num_computed_tokens == 0
        nxt = s.num_computed_tokens // ps  # the page the next computed token is written to
        if nxt < len(s.block_table):
            page = s.block_table[nxt]
            assert not bm.prefix_cache.contains_page(page) and bm.allocator.ref_count[page] == 1
        assert len(s.block_table) == -(-s.num_computed_tokens // ps)

    for n, pfx, more, cut, finish_early in reqs:
        s = Sequence(prefixes[pfx % 3][:n] if pfx < 3 else [rng.randrange(50) for _ in range(n)], GREEDY)
        bm.admit(s)
        if not (compute_all(bm, s) and grow(s, more)):
            continue
        keep = 1 + cut % len(s.token_ids)
        bm.truncate(s, keep)
        assert len(s.token_ids) == keep
        consistent(s)
        # compute the rest of the kept tokens, then grow again
        if not (compute_all(bm, s) and grow(s, rng.randrange(6))):
            continue
        s.token_ids.append(rng.randrange(50))  # the next token, not yet computed
        consistent(s)
        (bm.free(s) if finish_early else live.append(s))
        assert 0 <= bm.num_used_pages <= bm.num_pages
    all_back(bm, live)


def test_truncate_refuses_what_it_cannot_keep():
    bm = BlockManager(num_pages=8, page_size=4)
    s = Sequence(list(range(6)), GREEDY)
    bm.admit(s)
    for bad in (0, 7):
        try:
            bm.truncate(s, bad)
            raise AssertionError(f"truncate to {bad} of 6 tokens must fail")
        except ValueError as e:
            assert "keeps 1 to all of them" in str(e)


def test_engine_truncate_then_resume_computes_what_a_fresh_engine_does(tiny_qwen3):
    """Two sequences share cached prefix pages; one is rolled back into a shared page and into a
    private one, and goes on with other tokens: each next token and its logits are a fresh
    engine's over the same tokens, the other sequence is untouched, and every page comes back."""
    import torch
    eng = Engine.from_pretrained(tiny_qwen3, num_kv_tokens=512, page_size=4)
    rng = random.Random(3)
    prompt = [rng.randrange(2, 512) for _ in range(10)]

    def step():  # one forward; each sequence that got a next token takes it -> {id(seq): logits}
        out = eng.forward()
        got = {}
        for s, tok, row in zip(out.seqs, out.next_tokens, out.logits):
            s.token_ids.append(tok)
            got[id(s)] = row
        return got

    def fresh(tokens):  # a new engine without a prefix cache: the logits after `tokens`
        ref = Engine.from_pretrained(tiny_qwen3, num_kv_tokens=512, page_size=4, enable_prefix_caching=False)
        ref.add(list(tokens), GREEDY)
        return ref.forward().logits[0]

    a = eng.add(list(prompt), GREEDY)
    for _ in range(6):  # 16 tokens, 15 computed: pages 0-2 full and cached
        step()
    b = eng.add(a.token_ids[:13] + [7], GREEDY)  # matches those three pages, the third holding output tokens
    step()
    assert b.num_cached_tokens == 12 and b.block_table[:3] == a.block_table[:3]
    b_pages = list(b.block_table)
    # (a forward steps every live sequence: b goes on beside a throughout)
    for back in (None, 2):  # inside the shared third page, then 2 tokens back, inside a private page
        keep = 11 if back is None else len(a.token_ids) - back
        eng.truncate(a, keep)
        a.token_ids.extend([11, 12])
        want = fresh(a.token_ids)
        got = step()[id(a)]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert a.token_ids[-1] == int(want.argmax())
    assert b.block_table[:len(b_pages)] == b_pages
    want_b = fresh(b.token_ids)
    got = step()[id(b)]
    torch.testing.assert_close(got, want_b, rtol=1e-5, atol=1e-5)
    try:
        eng.truncate(a, len(prompt) - 1)
        raise AssertionError("truncating into the prompt must fail")
    except ValueError as e:
        assert "would cut into the prompt" in str(e)
    eng.release(a, "stop"), eng.release(b, "stop")
    kv = eng.kv_usage()
    assert kv.pages_free == kv.pages_total and kv.pages_used == 0

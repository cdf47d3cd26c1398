"""BlockManager: allocation, chained-hash prefix cache, LRU eviction, copy-on-write, invariants."""

from __future__ import annotations

import random
from collections import Counter

import pytest

import warpforge.llm.block_manager as bm_mod
from warpforge.llm.block_manager import BlockManager
from warpforge.llm.sequence import Sequence


def check_invariants(bm: BlockManager, live: list[Sequence]) -> None:
    """Ref counts equal block-table uses; free <=> ref 0; the cache map and page hashes agree."""
    uses = Counter(p for s in live for p in s.block_table)
    free, evictable = set(bm._free), set(bm._evictable)
    assert len(free) == len(bm._free) and not (free & evictable)
    for page in bm.pages:
        assert page.ref_count >= 0
        assert page.ref_count == uses[page.id], f"page {page.id}"
        assert (page.id in free or page.id in evictable) == (page.ref_count == 0)
        assert (page.hash is not None) == (bm._cached.get(page.hash) == page.id)
        assert (page.id in evictable) <= (page.hash is not None)
    assert bm.num_free_pages + len(uses) == bm.num_pages
    for s in live:
        assert len(s.block_table) == len(set(s.block_table)), "a sequence uses a page twice"


def computed(bm: BlockManager, seq: Sequence, n: int | None = None) -> Sequence:
    """Pretend the runner computed the first n (default: all but the last) tokens."""
    seq.num_computed_tokens = seq.num_tokens - 1 if n is None else n
    bm.cache_computed_pages(seq)
    return seq


def test_allocate_and_free_counts():
    bm = BlockManager(10, 4)
    s = Sequence(list(range(10)))
    assert bm.can_allocate(s)
    bm.allocate(s)
    assert len(s.block_table) == 3 and bm.num_free_pages == 7 and s.num_cached_tokens == 0
    check_invariants(bm, [s])
    bm.free(s)
    assert s.block_table == [] and bm.num_free_pages == 10
    check_invariants(bm, [])


def test_cannot_allocate_beyond_pool():
    bm = BlockManager(3, 4)
    a = Sequence(list(range(8)))
    bm.allocate(a)
    b = Sequence(list(range(100, 109)))  # 3 pages, 1 free
    assert not bm.can_allocate(b)
    with pytest.raises(RuntimeError, match="out of KV pages"):
        bm.allocate(b)


def test_prefix_hit_on_full_pages_only():
    bm = BlockManager(16, 4)
    a = Sequence(list(range(10)))  # pages [0-3] [4-7] full, [8, 9] partial
    bm.allocate(a)
    computed(bm, a, 10)
    b = Sequence(list(range(10)) + [50, 51])
    bm.allocate(b)
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]  # the partial page is never shared
    assert bm.pages[a.block_table[0]].ref_count == 2
    assert bm.prefix_hit_tokens == 8 and bm.prefix_queried_tokens == 10 + 12
    check_invariants(bm, [a, b])
    bm.free(a)
    assert bm.pages[b.block_table[0]].ref_count == 1
    check_invariants(bm, [b])


def test_hits_only_on_exact_prefixes():
    bm = BlockManager(32, 4)
    a = Sequence(list(range(12)))
    bm.allocate(a)
    computed(bm, a, 12)
    cases = {
        (99, 1, 2, 3, 4, 5, 6, 7, 8): 0,  # first page differs
        (0, 1, 2, 3, 4, 5, 99, 7, 8): 4,  # second page differs
        (0, 1, 2, 3, 4, 5, 6, 7, 8): 8,
    }
    for tokens, hit in cases.items():
        s = Sequence(list(tokens))
        bm.allocate(s)
        assert s.num_cached_tokens == hit, tokens
        bm.free(s)
    # Same tokens as a's second page but after a different first page: the chain does not match.
    s = Sequence([9, 9, 9, 9, 4, 5, 6, 7, 1])
    bm.allocate(s)
    assert s.num_cached_tokens == 0
    check_invariants(bm, [a, s])


def test_hash_collision_cannot_serve_wrong_tokens(monkeypatch):
    monkeypatch.setattr(bm_mod, "page_hash", lambda prev, tokens: 7)  # every page collides
    bm = BlockManager(8, 2)
    a = Sequence([1, 2, 3])
    bm.allocate(a)
    computed(bm, a, 2)
    b = Sequence([5, 6, 7])
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and b.block_table[0] != a.block_table[0]
    check_invariants(bm, [a, b])


def test_pages_registered_only_once_computed():
    bm = BlockManager(16, 4)
    a = Sequence(list(range(12)))
    bm.allocate(a)  # a chunked prefill that has computed nothing yet
    b = Sequence(list(range(13)))
    assert not bm._lookup(b)[0]
    computed(bm, a, 5)  # first chunk: one full page computed
    bm.allocate(b)
    assert b.num_cached_tokens == 4
    check_invariants(bm, [a, b])


def test_fully_cached_prompt_recomputes_last_token_with_copy_on_write():
    bm = BlockManager(8, 4)
    a = Sequence(list(range(8)))
    bm.allocate(a)
    computed(bm, a, 8)
    b = Sequence(list(range(8)))
    assert bm.can_allocate(b)
    free_before = bm.num_free_pages
    bm.allocate(b)
    assert b.num_cached_tokens == 7  # the last token is computed again so it has logits
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    assert bm.take_copies() == [(a.block_table[1], b.block_table[1])]
    assert bm.take_copies() == []
    assert b.block_table_version == 1 and a.block_table_version == 0  # the runner's cached table rebuilds
    assert bm.num_free_pages == free_before - 1
    assert bm.pages[a.block_table[1]].ref_count == 1 and bm.pages[b.block_table[1]].ref_count == 1
    check_invariants(bm, [a, b])


def test_fully_cached_prompt_of_a_freed_sequence_reuses_pages_in_place():
    bm = BlockManager(8, 4)
    a = Sequence(list(range(8)))
    bm.allocate(a)
    computed(bm, a, 8)
    pages = list(a.block_table)
    bm.free(a)
    assert bm.num_free_pages == 8 and bm.num_cached_pages == 2
    b = Sequence(list(range(8)))
    bm.allocate(b)
    assert b.block_table == pages and b.num_cached_tokens == 7 and bm.take_copies() == []
    assert bm.num_free_pages == 6  # revived pages leave the free pool
    check_invariants(bm, [b])


def test_eviction_prefers_plain_pages_then_lru_tail_first():
    bm = BlockManager(6, 2)
    a = Sequence([1, 2, 3, 4, 5, 6, 7])  # 4 pages; 3 full ones get cached
    bm.allocate(a)
    computed(bm, a)
    p0, p1, p2, p3 = a.block_table
    bm.free(a)  # evictable, freed tail first: p2 (oldest), p1, p0; p3 plain
    assert bm.num_free_pages == 6 and bm.num_cached_pages == 3
    c = Sequence([40, 41, 42, 43])  # takes the plain pages first
    bm.allocate(c)
    assert set(c.block_table).isdisjoint({p0, p1, p2}) and bm.num_cached_pages == 3
    d = Sequence([50, 51, 52, 53, 54])  # 3 pages: 1 plain left, then evicts p2, p1 (least recent first)
    bm.allocate(d)
    assert p2 in d.block_table and p1 in d.block_table and p0 not in d.block_table
    assert bm.num_cached_pages == 1
    check_invariants(bm, [c, d])
    bm.free(d)
    e = Sequence([1, 2, 3, 4, 5, 6])  # only a's first page survived
    bm.allocate(e)
    assert e.num_cached_tokens == 2 and e.block_table[0] == p0
    check_invariants(bm, [c, e])


def test_can_allocate_counts_revived_pages():
    bm = BlockManager(3, 2)
    a = Sequence([1, 2, 3, 4, 5])
    bm.allocate(a)
    computed(bm, a, 4)
    bm.free(a)
    b = Sequence([1, 2, 3, 4, 9])  # 2 hits (evictable) + 1 fresh: 3 of 3 free
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.num_cached_tokens == 4 and bm.num_free_pages == 0
    c = Sequence([1, 2])  # a hit on b's first page (ref > 0) that needs a CoW copy: no page left
    assert not bm.can_allocate(c)
    check_invariants(bm, [b])


def test_append_slot_grows_one_page_when_full():
    bm = BlockManager(4, 4)
    s = Sequence([1, 2, 3])
    bm.allocate(s)
    for tok in range(10, 15):
        computed(bm, s)
        s.append_token(tok)
        assert bm.can_append(s)
        bm.append_slot(s)
        assert len(s.block_table) == bm.pages_for(s.num_tokens)
    assert s.num_tokens == 8 and len(s.block_table) == 2
    check_invariants(bm, [s])
    other = Sequence(list(range(100, 108)))
    bm.allocate(other)
    s.append_token(15)  # needs a third page; none free
    assert not bm.can_append(s)


def test_prefix_caching_disabled():
    bm = BlockManager(8, 2, enable_prefix_caching=False)
    a = Sequence([1, 2, 3, 4, 5])
    bm.allocate(a)
    computed(bm, a, 5)
    b = Sequence([1, 2, 3, 4, 5])
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and bm.num_cached_pages == 0
    bm.free(a)
    bm.free(b)
    assert bm.num_free_pages == 8
    check_invariants(bm, [])


def test_bad_construction():
    with pytest.raises(ValueError, match="num_pages"):
        BlockManager(0, 16)
    with pytest.raises(ValueError, match="page_size"):
        BlockManager(4, 0)


def test_random_operations_keep_invariants():
    rng = random.Random(0)
    bm = BlockManager(24, 3)
    live: list[Sequence] = []
    copies = 0
    prefixes = [[rng.randrange(5) for _ in range(rng.randrange(1, 10))] for _ in range(4)]
    for _ in range(400):
        op = rng.random()
        if op < 0.35:
            s = Sequence(rng.choice(prefixes) + [rng.randrange(5) for _ in range(rng.randrange(0, 6))])
            if bm.can_allocate(s):
                bm.allocate(s)
                assert s.num_cached_tokens < s.num_tokens
                for i, pid in enumerate(s.block_table[:s.num_cached_tokens // 3]):
                    if bm.pages[pid].token_ids is not None:  # a hit (not a private CoW copy)
                        assert bm.pages[pid].token_ids == tuple(s.token_ids[3 * i:3 * i + 3])
                computed(bm, s, rng.randint(s.num_cached_tokens, s.num_tokens))
                live.append(s)
        elif op < 0.7 and live:
            s = rng.choice(live)
            computed(bm, s)
            s.append_token(rng.randrange(5))
            if bm.can_append(s):
                bm.append_slot(s)
            else:
                bm.free(s)
                live.remove(s)
        elif live:
            s = live.pop(rng.randrange(len(live)))
            bm.free(s)
        copies += len(bm.take_copies())
        check_invariants(bm, live)
    for s in live:
        bm.free(s)
    check_invariants(bm, [])
    assert bm.num_free_pages == 24
    assert copies > 0 and bm.prefix_hit_tokens > 0  # the walk exercised CoW and prefix hits

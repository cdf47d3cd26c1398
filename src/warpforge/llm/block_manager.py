"""BlockManager: KV pages with reference counts, a prefix cache of full pages, copy-on-write.

Prefix caching. A full page is named by a chained hash, blake2b(hash of the previous page,
its tokens), so equal hashes mean equal token prefixes (the page's tokens are also compared on a
hit, so a hash collision cannot serve wrong KV). A page is registered in the cache only once its
KV is *computed* (``cache_computed_pages`` after each step), never at allocation: with chunked
prefill another request could otherwise hit a page whose KV has not been written yet.
When its last user frees it, a registered page stays in the cache as *evictable*: it counts as
free, a later hit revives it, and fresh allocations take plain free pages first, then evict
cached ones least recently freed first (a sequence frees its tail first, so shared heads outlive
their tails).

Copy-on-write. A sequence never writes into a page another sequence uses (ref > 1). That happens
when a prompt's every page is a hit: the last token is still recomputed (sampling needs its
logits), so its page is copied to a private one. Copies are queued as (src, dst) page ids in
``pending_copies``; the scheduler drains them into each ``ScheduledBatch.copies`` and the runner
must copy K and V pages src -> dst in every layer before the step's forward pass.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

from warpforge.llm.sequence import Sequence


def page_hash(prev: int | None, tokens: tuple[int, ...]) -> int:
    """64-bit chained hash of one full page: blake2b(prev hash, token ids as int64)."""
    h = hashlib.blake2b(digest_size=8)
    if prev is not None:
        h.update(prev.to_bytes(8, "little"))
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


class Page:
    __slots__ = ("id", "ref_count", "hash", "token_ids")

    def __init__(self, page_id: int):
        self.id = page_id
        self.ref_count = 0
        self.hash: int | None = None  # set only while registered in the prefix cache
        self.token_ids: tuple[int, ...] | None = None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        for name, val in (("num_pages", num_pages), ("page_size", page_size)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {val!r}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pages = [Page(i) for i in range(num_pages)]
        self._free: deque[int] = deque(range(num_pages))  # ref 0, not cached
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0, cached; oldest first
        self._cached: dict[int, int] = {}  # page hash -> page id
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) page copies for the runner
        self.prefix_queried_tokens = 0  # prompt tokens looked up by allocate()
        self.prefix_hit_tokens = 0  # of which served from the prefix cache

    @property
    def num_free_pages(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_pages(self) -> int:
        return len(self._cached)

    def pages_for(self, num_tokens: int) -> int:
        return _cdiv(num_tokens, self.page_size)

    # -- page pool ---------------------------------------------------------------------------
    def _take_free(self) -> int:
        if self._free:
            pid = self._free.popleft()
        elif self._evictable:
            pid, _ = self._evictable.popitem(last=False)
            page = self.pages[pid]
            assert page.hash is not None  # an evictable page is one the prefix cache holds
            del self._cached[page.hash]
            page.hash = page.token_ids = None
        else:
            raise RuntimeError("out of KV pages: check can_allocate/can_append first")
        self.pages[pid].ref_count = 1
        return pid

    def _ref(self, pid: int) -> None:
        page = self.pages[pid]
        if page.ref_count == 0:
            del self._evictable[pid]  # a hit revives a cached free page
        page.ref_count += 1

    def _deref(self, pid: int) -> None:
        page = self.pages[pid]
        if page.ref_count <= 0:
            raise RuntimeError(f"page {pid}: freed more often than referenced")
        page.ref_count -= 1
        if page.ref_count == 0:
            if page.hash is not None:
                self._evictable[pid] = None
            else:
                self._free.append(pid)

    # -- prefix cache ------------------------------------------------------------------------
    def _lookup(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """Cached pages (and their hashes) holding the longest full-page prefix of ``seq``."""
        hits: list[int] = []
        hashes: list[int] = []
        if not self.enable_prefix_caching:
            return hits, hashes
        ps, h = self.page_size, None
        for i in range(seq.num_tokens // ps):
            tokens = tuple(seq.token_ids[i * ps:(i + 1) * ps])
            h = page_hash(h, tokens)
            pid = self._cached.get(h)
            if pid is None or self.pages[pid].token_ids != tokens:
                break
            hits.append(pid)
            hashes.append(h)
        return hits, hashes

    def cache_computed_pages(self, seq: Sequence) -> None:
        """Register the full pages of ``seq`` whose KV is computed (below num_computed_tokens)."""
        if not self.enable_prefix_caching:
            return
        ps = self.page_size
        h = seq.block_hashes[-1] if seq.block_hashes else None
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // ps):
            tokens = tuple(seq.token_ids[i * ps:(i + 1) * ps])
            h = page_hash(h, tokens)
            seq.block_hashes.append(h)
            page = self.pages[seq.block_table[i]]
            # Another sequence may have computed the same prefix in the same step: first one wins.
            if h not in self._cached and page.hash is None:
                page.hash, page.token_ids = h, tokens
                self._cached[h] = page.id

    # -- sequences ---------------------------------------------------------------------------
    def _cow_needed(self, seq: Sequence, pos: int) -> bool:
        idx = pos // self.page_size
        return idx < len(seq.block_table) and self.pages[seq.block_table[idx]].ref_count > 1

    def _make_writable(self, seq: Sequence, pos: int) -> None:
        """Copy-on-write: give ``seq`` a private copy of the page holding position ``pos`` if shared."""
        if self._cow_needed(seq, pos):
            idx = pos // self.page_size
            src = seq.block_table[idx]
            dst = self._take_free()
            self.pending_copies.append((src, dst))
            self._deref(src)
            seq.block_table[idx] = dst
            seq.block_table_version += 1

    def can_allocate(self, seq: Sequence) -> bool:
        hits, _ = self._lookup(seq)
        # Reviving an evictable hit takes it out of the free pool just like a fresh page does.
        need = self.pages_for(seq.num_tokens) - len(hits) + sum(self.pages[p].ref_count == 0 for p in hits)
        if hits and len(hits) * self.page_size == seq.num_tokens and self.pages[hits[-1]].ref_count > 0:
            need += 1  # the shared last page is copied (see allocate)
        return self.num_free_pages >= need

    def allocate(self, seq: Sequence) -> None:
        """Pages for all of ``seq``'s tokens, reusing cached full pages of its prefix.

        Sets ``seq.num_cached_tokens`` (a multiple of page_size, except that a fully cached
        sequence recomputes its last token, copy-on-write if that page is shared).
        """
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id}: already holds pages")
        hits, hashes = self._lookup(seq)
        for pid in hits:  # reference hits first so fresh allocations cannot evict them
            self._ref(pid)
        fresh = [self._take_free() for _ in range(self.pages_for(seq.num_tokens) - len(hits))]
        seq.block_table = hits + fresh
        seq.block_hashes = hashes
        seq.num_cached_tokens = min(len(hits) * self.page_size, seq.num_tokens - 1)
        self._make_writable(seq, seq.num_cached_tokens)
        self.prefix_queried_tokens += seq.num_tokens
        self.prefix_hit_tokens += seq.num_cached_tokens

    def can_append_free(self, seq: Sequence) -> bool:
        """The slot of ``seq``'s last token needs no page: it lies in a page ``seq`` holds alone."""
        idx, bt = (len(seq.token_ids) - 1) // self.page_size, seq.block_table
        return idx < len(bt) and self.pages[bt[idx]].ref_count == 1

    def can_append(self, seq: Sequence) -> bool:
        """Whether the slot of ``seq``'s last (uncomputed) token can be made ready."""
        if self.can_append_free(seq):  # the usual decode: a private page
            return True
        pos = len(seq.token_ids) - 1
        need = max(0, self.pages_for(seq.num_tokens) - len(seq.block_table)) + self._cow_needed(seq, pos)
        return self.num_free_pages >= need

    def append_slot(self, seq: Sequence) -> None:
        """Make the slot of ``seq``'s last token writable: a new page when the last one is full."""
        if self.can_append_free(seq):  # already a private page: nothing to do
            return
        while len(seq.block_table) < self.pages_for(seq.num_tokens):
            seq.block_table.append(self._take_free())
        self._make_writable(seq, seq.num_tokens - 1)

    def reserve(self, seq: Sequence, num_tokens: int) -> int:
        """Pages for positions up to ``num_tokens - 1`` (speculative drafts after the last token), as
        many as the free pool gives; -> the positions ``seq``'s pages now hold. The last token's slot
        must be ready first (``append_slot``): the pages added here are fresh, so private."""
        while len(seq.block_table) < self.pages_for(num_tokens) and self.num_free_pages > 0:
            seq.block_table.append(self._take_free())
        return min(num_tokens, len(seq.block_table) * self.page_size)

    def trim(self, seq: Sequence) -> None:
        """Release the pages past the ones ``seq``'s tokens need (those of rejected drafts)."""
        keep = self.pages_for(seq.num_tokens)
        if len(seq.block_table) > keep:
            for pid in reversed(seq.block_table[keep:]):
                self._deref(pid)
            del seq.block_table[keep:]
            seq.block_table_version += 1  # a later append may reach this length with another page

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s pages, tail first (cached ones become evictable, tails evicted first)."""
        for pid in reversed(seq.block_table):
            self._deref(pid)
        seq.block_table = []
        seq.block_hashes = []

    def take_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) page copies queued since the last call."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

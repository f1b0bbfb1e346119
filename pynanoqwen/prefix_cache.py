"""The prefix cache: which KV pages of earlier requests a new prompt can reuse, on any backend.

A backend keeps its KV cache in pages of `page_size` positions drawn from a pool of `num_pages`
(the GPU engine's page pool, docs/DECODE.md; the CPU reference's page copies, cpu_pages.py).
After a request, every full page whose KV is reusable stays in the pool, keyed by a hash chain of
the tokens it encodes: key(page i) = H(key(page i - 1), tokens of page i), so a key names the whole
prefix up to the end of its page, and the KV of a position depends only on that prefix (attention
is causal). A new prompt walks its own chain from page 0 and reuses the longest run of cached pages.

This module owns no KV data: it hands out page ids and takes back what the backend reports.

    lease = cache.lease(prompt_ids, total_tokens)   # before the request
        lease.reused       page ids holding the KV of prompt[:lease.cached_tokens], in order
        lease.allocatable  page ids the request may write, in the order it must take them: free
                           pages first, then cached pages, least recently used first
    ... the backend runs with page table = reused + allocatable[:k], filling in lease.written
        (positions it wrote) and lease.reusable (leading positions a cold prefill of any longer
        prompt would compute bit for bit the same) ...
    cache.commit(lease, sequence)                    # after it, even if it was cancelled
        overwritten cached pages are dropped, the new full reusable pages are registered, the
        rest goes back to the free list.

At least `min_prefill` prompt tokens are always left to prefill: one, because the logits of the last
prompt token are what the first sampled token comes from, or more for a backend whose prefill
computes a few rows in other arithmetic than many (the GPU engine did, up to 2026-12-05:
engine/backend.py). A prompt reuses at most (len - min_prefill) // page_size pages.

Pages in use by a lease are pinned (a reference count): they are neither handed out as allocatable
nor reused by another lease until it is committed. Eviction is least recently used; a request's
pages are touched from its last page to its first, so a chain is evicted from its tail, and the
pages that remain still form a reusable prefix.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
from array import array
from collections.abc import Iterator, Sequence
from typing import Protocol

import numpy as np

from .prompt_lookup import LookupParams
from .sampling import SamplingParams


@dataclasses.dataclass
class PageLease:
    """The pages one request may use; the backend fills in `written` and `reusable` as it runs."""

    reused: list[int]        # cached page ids holding the KV of the prompt's first cached_tokens
    allocatable: list[int]   # page ids the request takes, in this order, for positions after those
    page_size: int
    keys: list[bytes]        # hash-chain keys of the prompt's full pages (as far as lease() hashed)
    written: int = 0         # positions 0..written-1 hold KV in reused + allocatable[:k]
    reusable: int = 0        # of those, the leading positions whose KV is fit to be reused

    @property
    def cached_tokens(self) -> int:
        return len(self.reused) * self.page_size

    def page_table(self) -> list[int]:
        """Logical page -> page id for every page the lease may use."""
        return self.reused + self.allocatable


class PagedBackend(Protocol):
    """What a generate.Backend adds to serve with the prefix cache (server/scheduler.py).

    generate_paged is generate.Backend.generate with the KV cache in the lease's pages (made by
    PrefixCache(num_pages, page_size, min_prefill)):
    - positions 0 .. lease.cached_tokens - 1 are already in the pages lease.reused, in order;
      the backend must not recompute them and must not write those pages;
    - logical page j >= len(lease.reused) is lease.allocatable[j - len(lease.reused)];
    - as it runs, and at the latest when the generator finishes or is closed, lease.written is the
      number of leading positions of prompt + generated tokens whose KV is in the pages, and
      lease.reusable how many of those a later request may reuse: only positions whose KV is bit
      for bit what a cold run of any prompt that starts with them would compute (a backend whose
      prefill and decode paths round differently counts only prompt pages computed whole).
    The caller guarantees len(lease.page_table()) * page_size >= len(prompt_ids) + max_new_tokens.
    """

    page_size: int   # positions per KV page
    num_pages: int   # pages in the pool the lease's page ids index
    min_prefill: int  # the fewest prompt tokens a lease must leave it to run (PrefixCache)

    def generate_paged(self, prompt_ids: list[int], params: SamplingParams, max_new_tokens: int,
                       stop_ids: frozenset[int], lease: PageLease,
                       lookup: LookupParams = LookupParams()) -> Iterator[int]: ...


@dataclasses.dataclass
class CacheStats:
    """Counters since the cache was made (server/metrics.py exports them)."""

    leases: int = 0
    prompt_tokens: int = 0   # tokens of every leased prompt
    hit_tokens: int = 0      # of those, tokens whose KV came from cached pages
    evicted_pages: int = 0   # cached pages overwritten by a later request

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def page_keys(tokens: Sequence[int], pages: int, page_size: int, known: Sequence[bytes] = ()) -> list[bytes]:
    """The hash-chain keys of the first `pages` full pages of `tokens`, continuing the chain from
    `known` (the keys of its first pages, already computed)."""
    return extend_keys(list(known[:pages]), tokens, pages, page_size)


def extend_keys(keys: list[bytes], tokens: Sequence[int], pages: int, page_size: int) -> list[bytes]:
    """`keys` (the chain's first keys) extended in place to the first `pages` pages of `tokens`. The
    ids are packed to int64 bytes once and hashed a page's slice at a time (a 4000-token prompt:
    0.32 ms on the 2-core VM, 0.40 with an array built a page)."""
    data = array("q", tokens[len(keys) * page_size:pages * page_size]).tobytes()
    stride = 8 * page_size
    for i in range(pages - len(keys)):
        keys.append(hashlib.blake2b((keys[-1] if keys else b"") + data[i * stride:(i + 1) * stride],
                                    digest_size=16).digest())
    return keys


class PrefixCache:
    """Full KV pages of earlier requests, by hash-chain key, in a pool of `num_pages` page ids."""

    def __init__(self, num_pages: int, page_size: int, min_prefill: int = 1):
        if num_pages < 1 or page_size < 1 or min_prefill < 1:
            raise ValueError(f"num_pages {num_pages}, page_size {page_size} and min_prefill {min_prefill} "
                             f"must be positive")
        self.num_pages = num_pages
        self.page_size = page_size
        self.min_prefill = min_prefill
        self._free: dict[int, None] = dict.fromkeys(range(num_pages))  # in order; O(1) removal
        # key -> page id of every cached page, least recently used first.
        self._cached: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._key_of: dict[int, bytes] = {}
        self._pins: collections.Counter[int] = collections.Counter()
        self.stats = CacheStats()
        self._last_prompt: tuple[np.ndarray, list[bytes]] = (np.zeros(0, np.int64), [])  # ids, page keys

    @classmethod
    def for_backend(cls, backend: PagedBackend) -> PrefixCache:
        """A cache of the backend's whole page pool, leaving it its min_prefill tokens to run."""
        return cls(backend.num_pages, backend.page_size, backend.min_prefill)

    @property
    def cached_pages(self) -> int:
        return len(self._cached)

    def lease(self, prompt_ids: Sequence[int], total_tokens: int, *, reuse: bool = True) -> PageLease:
        """Pages for a request whose prompt is `prompt_ids` and which may hold `total_tokens`
        positions (prompt plus generated). reuse=False takes no cached page (llama.cpp's
        cache_prompt: false) but still registers the request's pages afterwards."""
        size = self.page_size
        needed = -(-total_tokens // size)
        if not len(prompt_ids) <= total_tokens or needed > self.num_pages:
            raise ValueError(f"a request of {total_tokens} positions ({len(prompt_ids)} in the prompt) "
                             f"does not fit {self.num_pages} pages of {size}")
        keys, reused = self._cached_prefix(prompt_ids, max(0, len(prompt_ids) - self.min_prefill) // size
                                           if reuse else 0)
        for page in reused:
            self._pins[page] += 1
        # Free pages first; then cached ones from the least recently used end. Only as many as
        # needed are looked at: listing the whole pool first cost a 4000-token prompt's lease
        # 0.83 ms at 2048 pages on the 2-core VM, against 0.48 now.
        candidates = (p for p in itertools.chain(self._free, self._cached.values()) if not self._pins[p])
        allocatable = list(itertools.islice(candidates, needed - len(reused)))
        if len(allocatable) < needed - len(reused):
            for page in reused:
                self._pins[page] -= 1
            raise ValueError(f"the page pool is exhausted: {needed} pages wanted, "
                             f"{len(reused) + len(allocatable)} not in use by other requests")
        for page in allocatable:
            self._pins[page] += 1
        self.stats.leases += 1
        self.stats.prompt_tokens += len(prompt_ids)
        self.stats.hit_tokens += len(reused) * size
        return PageLease(reused, allocatable, size, keys)

    def _cached_prefix(self, prompt_ids: Sequence[int], limit: int) -> tuple[list[bytes], list[int]]:
        """(keys, pages): the cached, unpinned pages holding the prompt's first pages, at most
        `limit` of them, and the hash-chain keys of the prompt's pages as far as the walk looked
        (one past the last page found, unless it stopped at the limit). Keys the prompt shares with
        the last leased prompt come from that lease: an editor's requests differ in their last
        pages only. The walk hashes no further than it looks, and commit() hashes the rest after
        the request: a cold 4000-token prompt's 250 pages cost its lease 0.19 of 0.27 ms on the
        2-core VM when lease() hashed them all, on the way to its first token."""
        size = self.page_size
        ids = np.frombuffer(array("q", prompt_ids), np.int64)
        last_ids, last_keys = self._last_prompt
        n = min(len(ids), len(last_keys) * size)
        differ = np.flatnonzero(ids[:n] != last_ids[:n])
        keys = last_keys[:int(differ[0] if differ.size else n) // size]
        pages: list[int] = []
        while len(pages) < limit:
            if len(keys) == len(pages):
                extend_keys(keys, prompt_ids, len(keys) + 1, size)
            page = self._cached.get(keys[len(pages)])
            if page is None or self._pins[page]:
                break
            pages.append(page)
        self._last_prompt = (ids, keys)
        return keys, pages

    def commit(self, lease: PageLease, sequence: Sequence[int]) -> None:
        """Take back the lease's pages after its request ended; `sequence` is prompt + generated
        ids, whose first lease.written positions the pages hold."""
        size = self.page_size
        table = lease.page_table()
        used = max(len(lease.reused), -(-lease.written // size))
        reusable_pages = min(lease.reusable, lease.written) // size
        keys = page_keys(sequence, reusable_pages, size, lease.keys)
        last_ids, last_keys = self._last_prompt
        if last_keys is lease.keys and len(keys) > len(last_keys):  # for the next lease's prompt to share
            self._last_prompt = (last_ids, keys[:len(last_ids) // size])
        for page in table:
            self._pins[page] -= 1
            if not self._pins[page]:
                del self._pins[page]
        for page in table[len(lease.reused):used]:  # written by this request: old contents are gone
            self._drop(page)
        for index in range(used - 1, -1, -1):  # tail first, so that page 0 ends most recently used
            page = table[index]
            if index < reusable_pages:
                self._register(keys[index], page)
            elif index >= len(lease.reused):
                self._free[page] = None

    def _drop(self, page: int) -> None:
        key = self._key_of.pop(page, None)
        if key is not None:
            del self._cached[key]
            self.stats.evicted_pages += 1
        else:
            self._free.pop(page, None)

    def _register(self, key: bytes, page: int) -> None:
        old = self._cached.get(key)
        if old is not None and old != page:  # the same prefix computed again: keep one page of it
            if self._pins[old]:  # another request reads the old one
                self._free[page] = None
                return
            del self._key_of[old]
            del self._cached[key]
            self._free[old] = None
        self._cached[key] = page
        self._cached.move_to_end(key)
        self._key_of[page] = key

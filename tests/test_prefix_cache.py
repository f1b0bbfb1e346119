"""The prefix cache's bookkeeping (prefix_cache.PrefixCache) and the CPU backend that uses it
(cpu_pages.PagedCpuBackend): a warm request writes exactly the tokens and the KV bits of a cold one."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pynanoqwen.cpu_pages import PagedCpuBackend
from pynanoqwen.data import EMBEDDED_MODEL
from pynanoqwen.fileformat import NanoQwenFile
from pynanoqwen.prefix_cache import PrefixCache, page_keys
from pynanoqwen.reference import ReferenceModel
from pynanoqwen.sampling import SamplingParams

P = 4  # a small page size keeps the bookkeeping tests readable


def run(cache, prompt, generated, *, reusable=None, written=None):
    """Lease pages for prompt + generated, pretend a backend wrote them all, commit."""
    lease = cache.lease(prompt, len(prompt) + len(generated))
    lease.written = len(prompt) + len(generated) if written is None else written
    lease.reusable = lease.written if reusable is None else reusable
    cache.commit(lease, prompt + generated)
    return lease


def test_a_shared_prefix_reuses_its_full_pages_and_leaves_a_token_to_prefill():
    cache = PrefixCache(num_pages=16, page_size=P)
    first = run(cache, list(range(10)), [50, 51])
    assert first.reused == [] and cache.cached_pages == 3  # 12 positions: 3 full pages
    again = cache.lease(list(range(10)), 12)
    assert again.reused == first.page_table()[:2] and again.cached_tokens == 8  # page 3 holds token 9
    cache.commit(again, list(range(10)))
    exact = cache.lease(list(range(8)), 9)
    assert exact.cached_tokens == 4  # 8 prompt tokens: reusing both pages would leave none to run
    cache.commit(exact, list(range(8)))
    other = cache.lease([0, 1, 2, 3, 99, 5, 6, 7, 8], 10)
    assert other.cached_tokens == 4  # the chain breaks at the first differing page
    assert cache.stats.hit_tokens == 8 + 4 + 4 and cache.stats.leases == 4


def test_min_prefill_leaves_that_many_prompt_tokens_to_run():
    """A backend that must run at least 5 prompt tokens (the GPU engine's is 17) is never leased
    more cached pages than leave it those."""
    cache = PrefixCache(num_pages=16, page_size=P, min_prefill=5)
    run(cache, list(range(24)), [])
    for length, cached in ((24, 16), (21, 16), (20, 12), (9, 4), (8, 0)):
        lease = cache.lease(list(range(length)), length + 1)
        assert lease.cached_tokens == cached and length - lease.cached_tokens >= 5, (length, lease.cached_tokens)
        cache.commit(lease, list(range(length)))
    with pytest.raises(ValueError, match="min_prefill"):
        PrefixCache(num_pages=16, page_size=P, min_prefill=0)


def test_free_pages_come_first_then_the_least_recently_used_from_the_tail_of_a_chain():
    cache = PrefixCache(num_pages=6, page_size=P)
    a = run(cache, list(range(12)), [])            # pages of a: a0 a1 a2, 3 pages left free
    assert cache.cached_pages == 3
    lease = cache.lease([7] * 17, 20)               # 5 pages: the 3 free ones, then a's tail first
    assert lease.allocatable[:3] == [p for p in range(6) if p not in a.page_table()]
    assert lease.allocatable[3:] == [a.page_table()[2], a.page_table()[1]]
    lease.written, lease.reusable = 20, 16
    cache.commit(lease, [7] * 20)
    assert cache.stats.evicted_pages == 2
    assert cache.lease(list(range(12)) + [0], 13).reused == a.page_table()[:1]  # a0 survived: still a prefix


def test_pages_in_use_are_pinned():
    cache = PrefixCache(num_pages=6, page_size=P)
    run(cache, list(range(8)), [1])                  # 2 pages cached, 4 free
    held = cache.lease(list(range(8)) + [5], 12)     # reuses both and takes 1 more
    assert len(held.reused) == 2 and len(held.allocatable) == 1
    blocked = cache.lease(list(range(8)) + [6], 9)  # those are leased: no reuse, and not allocatable
    assert blocked.reused == [] and len(blocked.allocatable) == 3
    assert not set(blocked.allocatable) & set(held.page_table())
    with pytest.raises(ValueError, match="exhausted"):
        cache.lease(list(range(20)), 20)
    cache.commit(blocked, list(range(8)) + [6])
    cache.commit(held, list(range(8)) + [5])


def test_only_reusable_pages_are_kept_and_overwritten_ones_are_forgotten():
    cache = PrefixCache(num_pages=8, page_size=P)
    lease = run(cache, list(range(9)), [1, 2, 3], reusable=8)  # the decoded page is not reusable
    assert cache.cached_pages == 2
    assert sorted(cache._free) == sorted(set(range(8)) - set(lease.page_table()[:2]))
    short = run(cache, list(range(9)), [], written=5)  # cancelled after 5 positions
    assert short.written == 5 and cache.cached_pages == 2
    assert page_keys(list(range(8)), 2, P) == short.keys[:2]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=23), min_size=1, max_size=6))
def test_a_lease_keys_every_prompt_as_if_it_came_alone(prompts):
    """lease() takes the keys of the pages a prompt shares with the last leased one from that lease
    (or its commit) and hashes only as far as it looks; whatever came before, its keys are the first
    of the prompt's own chain, and they cover every page it reuses (ids 0..3 make prompts that share
    prefixes of every length)."""
    cache = PrefixCache(num_pages=64, page_size=P)
    for prompt in prompts:
        lease = cache.lease(prompt, len(prompt) + 1)
        assert len(lease.reused) <= len(lease.keys) <= len(prompt) // P
        assert lease.keys == page_keys(prompt, len(lease.keys), P)
        lease.written = lease.reusable = len(prompt)
        cache.commit(lease, prompt)


def test_a_cold_lease_hashes_one_page_and_its_commit_the_rest():
    """The hashing of a prompt nothing matches waits for commit(), after the request: the lease
    hashes the page it looked up; the commit gives the next lease of a longer prompt every key."""
    cache = PrefixCache(num_pages=64, page_size=P)
    prompt = list(range(5 * P + 1))
    lease = cache.lease(prompt, len(prompt) + 1)
    assert lease.reused == [] and lease.keys == page_keys(prompt, 1, P)
    lease.written = lease.reusable = len(prompt)
    cache.commit(lease, prompt)
    longer = prompt + [7] * P
    again = cache.lease(longer, len(longer))
    assert len(again.reused) == 5 and again.keys[:5] == page_keys(prompt, 5, P)
    assert again.keys == page_keys(longer, 6, P)  # the memo's five keys, then the page it looked at


def test_the_same_prefix_computed_twice_keeps_one_page():
    cache = PrefixCache(num_pages=8, page_size=P)
    run(cache, list(range(8)), [9])
    run(cache, list(range(8)), [9], reusable=9)  # page 1 was recomputed (the last prompt page)
    assert cache.cached_pages == 2 and len(cache._free) == 6


@pytest.fixture(scope="module")
def weights():
    return NanoQwenFile(EMBEDDED_MODEL)


def paged_backend(weights):
    return PagedCpuBackend(ReferenceModel(weights, max_context=256))


def generate(backend, cache, prompt, params, max_new_tokens):
    lease = cache.lease(prompt, len(prompt) + max_new_tokens)
    tokens = list(backend.generate_paged(prompt, params, max_new_tokens, frozenset(), lease))
    model = backend.model
    kv = model.k_cache[:, :model.position].copy(), model.v_cache[:, :model.position].copy()
    cache.commit(lease, prompt + tokens)
    return tokens, kv, lease.cached_tokens


def test_warm_requests_write_the_tokens_and_kv_of_cold_ones(weights):
    """Prompts that share prefixes of many lengths, greedy and sampled, in an order that hits,
    misses and evicts (the pool is one context: 16 pages); each is rerun cold on a fresh backend."""
    rng = np.random.default_rng(7)
    base = [int(t) for t in rng.integers(10, 4096, 200)]
    backend = paged_backend(weights)
    cache = PrefixCache.for_backend(backend)
    hits = 0
    other = [int(t) for t in rng.integers(10, 4096, 200)]
    for start, cut, tail, params in [
            (base, 150, 3, SamplingParams()), (base, 150, 9, SamplingParams(0.8, 20, 0.9, 11)),
            (base, 47, 1, SamplingParams()), (other, 180, 0, SamplingParams()), (base, 160, 0, SamplingParams()),
            (base, 33, 20, SamplingParams()), (base, 150, 5, SamplingParams(1.0, 0, 1.0, 5)),
            (other, 64, 16, SamplingParams())]:
        prompt = start[:cut] + [int(t) for t in rng.integers(10, 4096, tail)]
        warm_tokens, warm_kv, cached = generate(backend, cache, prompt, params, 40)
        cold_tokens, cold_kv, _ = generate(paged_backend(weights), PrefixCache(16, 16), prompt, params, 40)
        hits += cached > 0
        assert warm_tokens == cold_tokens
        assert all(np.array_equal(w, c) for w, c in zip(warm_kv, cold_kv))
    assert hits >= 4 and cache.stats.evicted_pages > 0

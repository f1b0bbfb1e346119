"""The CPU reference backend with its KV cache kept in pages, so the prefix cache can reuse them.

`PagedCpuBackend` is generate.CpuBackend plus prefix_cache.PagedBackend. The reference model
holds one contiguous KV cache; this backend keeps a copy of every page a request wrote, by page
id, and loads the reused pages into the model before a request instead of recomputing them.

Bit for bit: numpy's float32 matmuls round differently for different numbers of rows (a 200-token
prompt run at once and in 16-token chunks differ by up to 8e-6 in their keys, measured on
the embedded model), so a page reused from an earlier request would not be the page a cold request
computes. So every prompt runs in chunks of one page, aligned to pages: position p is always
computed in the chunk [p - p % P, p - p % P + P) cut at the end of the prompt, whether the pages
before it were computed or loaded. A full prompt page therefore has the same KV in every request
whose prompt covers it, and only those pages are reported reusable; pages holding generated
tokens (one-row decode steps) or the prompt's partial last page are not.

Pages are copied out when the request ends and allocated as they are first written, so memory
grows with the pages used, not with num_pages.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from .backends import CpuBackend
from .kernels.page_alloc import PAGE_SIZE
from .prefix_cache import PageLease
from .prompt_lookup import LookupParams
from .sampling import SamplingParams


class PagedCpuBackend(CpuBackend):
    """The numpy reference with a paged copy of its KV cache (prefix_cache.PagedBackend)."""

    page_size = PAGE_SIZE
    min_prefill = 1  # every prompt runs in page-aligned chunks: any number of rows rounds alike

    def __init__(self, model):
        super().__init__(model)
        self.num_pages = -(-self.max_context // PAGE_SIZE)
        cfg = model.config
        self._page_shape = (cfg.num_layers, PAGE_SIZE, cfg.num_kv_heads, cfg.head_dim)
        self._pages: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # page id -> (k, v)

    def generate_paged(self, prompt_ids: list[int], params: SamplingParams, max_new_tokens: int,
                       stop_ids: frozenset[int], lease: PageLease,
                       lookup: LookupParams = LookupParams()) -> Iterator[int]:
        model, size = self.model, PAGE_SIZE
        cached = lease.cached_tokens
        if cached >= len(prompt_ids):
            raise ValueError(f"{cached} cached positions leave none of the {len(prompt_ids)} prompt tokens to run")
        if lease.reused:
            k, v = zip(*(self._pages[page] for page in lease.reused))
            model.load_kv(np.concatenate(k, axis=1), np.concatenate(v, axis=1))
        else:
            model.reset()
        lease.written = lease.reusable = cached
        try:
            for start in range(cached, len(prompt_ids), size):
                logits = model.forward(prompt_ids[start:start + size], last_only=True)[-1]
            lease.reusable = len(prompt_ids) // size * size
            yield from self.decode(logits, params, max_new_tokens, stop_ids, prompt_ids, lookup)
        finally:  # also when the caller closes the generator early
            self._save_pages(lease, cached, model.position)
            lease.written = model.position

    def _save_pages(self, lease: PageLease, start: int, end: int) -> None:
        """Copy positions start..end-1 of the model's KV cache into the lease's pages."""
        table = lease.page_table()
        for first in range(start, end, PAGE_SIZE):
            page, last = table[first // PAGE_SIZE], min(first + PAGE_SIZE, end)
            if page not in self._pages:
                self._pages[page] = (np.zeros(self._page_shape, np.float32), np.zeros(self._page_shape, np.float32))
            k, v = self._pages[page]
            k[:, :last - first] = self.model.k_cache[:, first:last]
            v[:, :last - first] = self.model.v_cache[:, first:last]

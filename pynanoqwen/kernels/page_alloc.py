"""KV page allocation: on a step that starts a new 16-token page, map it to the next free page.

The KV cache is paged (docs/DECODE.md): position p lives in physical page page_table[p // 16],
slot p % 16. A decode step at a position with p % 16 == 0 is the first to write its logical
page, so the engine's graph for those steps starts with this kernel, which takes the next page
from a bump allocator over a list of free pages in device memory:

    page_table[pos // PAGE_SIZE] = free_pages[next_free_page];  next_free_page += 1

free_pages is 0, 1, 2, ... for a plain generation, and the pages a prefix-cache lease hands out
(prefix_cache.py) for a served request, whose first logical pages the host maps to reused pages
before it starts. Everything is device memory, so the step needs no host round trip; the engine
resets `next_free_page` to 0 when a generation starts. One thread does it; it exists as its own kernel
so that the 15 steps out of 16 that stay in a page do not pay even one launch for it.
"""

from __future__ import annotations

from numba import cuda
from numba.core import types

from ..launch import launch
from ..ptx.griddep import grid_dependency_wait, launch_dependents
from . import PAGE_SIZE, CompileTarget


@cuda.jit
def page_alloc(pos, page_table, free_pages, next_free_page):
    launch_dependents()
    grid_dependency_wait()  # inputs come from the previous kernel (launch.py)
    taken = next_free_page[0]
    page_table[pos[0] // PAGE_SIZE] = free_pages[taken]
    next_free_page[0] = taken + 1


class PageAlloc:
    def launch(self, stream, pos, page_table, free_pages, next_free_page) -> None:
        """pos int32 [1], page_table int32 [max_pages], free_pages int32 [max_pages],
        next_free_page int32 [1] (page_table and next_free_page updated)."""
        launch(page_alloc, 1, 1, stream, (pos, page_table, free_pages, next_free_page))


def make_page_alloc() -> PageAlloc:
    return PageAlloc()


def compile_targets() -> list[CompileTarget]:
    return [CompileTarget("page_alloc", page_alloc, types.void(*[types.int32[::1]] * 4))]

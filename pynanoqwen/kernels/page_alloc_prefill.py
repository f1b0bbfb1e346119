"""KV page allocation for a prefill chunk: map every page the chunk starts to the next free pages.

A prefill chunk writes positions start .. start + m - 1 at once (docs/DECODE.md's paged cache:
position p lives in page_table[p // 16], slot p % 16). The pages it must allocate are the ones
whose first position lies in the chunk, logical pages ceil(start / 16) .. (start + m - 1) // 16;
the page holding `start` itself is already mapped when start % 16 != 0 (an earlier chunk started
it). They take the next entries of the same free list the decode step's page_alloc takes from,
in the same order, so the table comes out exactly as m decode steps would have left it and decode
continues from it:

    page_table[first + j] = free_pages[next_free_page + j]   for each page j the chunk starts
    next_free_page += pages started

`start` and `m` are device arrays (int32 [1]) so one captured graph serves every chunk.
Launch: one block of THREADS threads, each mapping pages THREADS apart (a 2048-token chunk starts
at most 129 pages). Every thread reads next_free_page before the barrier; thread 0 advances it
after, so no thread can see the advanced value.
"""

from __future__ import annotations

from numba import cuda
from numba.core import types

from ..launch import launch
from . import PAGE_SIZE, CompileTarget

THREADS = 128


@cuda.jit
def page_alloc_range(start, m, page_table, free_pages, next_free_page):
    first = (start[0] + PAGE_SIZE - 1) // PAGE_SIZE  # the first page that starts inside the chunk
    end = (start[0] + m[0] - 1) // PAGE_SIZE + 1  # one past the last page the chunk touches
    base = next_free_page[0]
    for page in range(first + cuda.threadIdx.x, end, THREADS):
        page_table[page] = free_pages[base + page - first]
    cuda.syncthreads()
    if cuda.threadIdx.x == 0 and end > first:
        next_free_page[0] = base + end - first


class PageAllocRange:
    def launch(self, stream, start, m, page_table, free_pages, next_free_page) -> None:
        """start, m int32 [1] (positions start .. start + m - 1), page_table int32 [max_pages],
        free_pages int32 [max_pages], next_free_page int32 [1] (page_table and next_free_page
        updated)."""
        launch(page_alloc_range, 1, THREADS, stream, (start, m, page_table, free_pages, next_free_page),
               dependent=False)


def make_page_alloc_range() -> PageAllocRange:
    return PageAllocRange()


def compile_targets() -> list[CompileTarget]:
    i32 = types.int32[::1]
    return [CompileTarget("page_alloc_range", page_alloc_range, types.void(i32, i32, i32, i32, i32))]

"""KV page allocation: on a step that starts a new 16-token page, map it to the next free page.

The KV cache is paged (docs/DECODE.md): position p lives in physical page page_table[p // 16],
slot p % 16. A decode step at a position with p % 16 == 0 is the first to write its logical
page, so the engine's graph for those steps starts with this kernel, which takes the next page
from a bump allocator in device memory:

    page_table[pos // PAGE_SIZE] = next_free_page;  next_free_page += 1

Everything is device memory, so the step needs no host round trip; the engine resets
`next_free_page` to 0 when a generation starts. One thread does it; it exists as its own kernel
so that the 15 steps out of 16 that stay in a page do not pay even one launch for it.
"""

from __future__ import annotations

from numba import cuda
from numba.core import types

from ..launch import launch
from ..ptx.griddep import grid_dependency_wait, launch_dependents
from . import CompileTarget

PAGE_SIZE = 16  # positions per KV page: one (page, kv head) tile is 16 x head_dim FP16 values


@cuda.jit
def page_alloc(pos, page_table, next_free_page):
    launch_dependents()
    grid_dependency_wait()  # inputs come from the previous kernel (launch.py)
    page = next_free_page[0]
    page_table[pos[0] // PAGE_SIZE] = page
    next_free_page[0] = page + 1


class PageAlloc:
    def launch(self, stream, pos, page_table, next_free_page) -> None:
        """pos int32 [1], page_table int32 [max_pages], next_free_page int32 [1] (both updated)."""
        launch(page_alloc, 1, 1, stream, (pos, page_table, next_free_page))


def make_page_alloc() -> PageAlloc:
    return PageAlloc()


def compile_targets() -> list[CompileTarget]:
    return [CompileTarget("page_alloc", page_alloc, types.void(types.int32[::1], types.int32[::1], types.int32[::1]))]

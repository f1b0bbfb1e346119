"""The INT4 GEMV kernel that kernels/gemv_int4.py builds and launches: its work split and load
pipeline and the fused epilogues. The arithmetic paths (prmt, fixed16, dp4a), their activation
staging and the fused RMSNorm are kernels/gemv_int4_paths.py's.

Work split (`GemvPlan`). A "tile" is R consecutive rows (of each matrix: gate/up read R rows of
both); lane L of a warp takes 16-byte chunks c = L, L + 32, ... of its tile's rows (chunk c = inputs
32c .. 32c+31 = words 4c .. 4c+3 of a row), so one "item" (tile, step) of a warp reads 512
contiguous bytes of each of the R rows, and a tile is `steps` = ceil(K/1024) items. The grid is
persistent (at most blocks_per_sm blocks of `warps` warps on every SM), in one of two ways:
- whole tiles (the default): warp w of the grid computes tiles w, w + W_total, w + 2 W_total, ...
  (W_total warps in all), so at any moment the GPU reads one window of neighbouring rows;
- split_tiles: block b takes the b-th of `grid` equal runs of whole tiles, and warp w of the block
  the w-th of `warps` equal runs of that block's items, so every warp has the same work within one
  item whatever N is (whole tiles left down_proj's 3584 rows with 2 tiles on some warps and 1 on
  the rest). A run may begin or end inside a tile: the warp that holds a tile's last step finishes
  it; if the tile began before that warp's run, the warps before it leave their sums of it in
  shared memory (`partials`), and after one syncthreads at the end the finishing warp adds them in
  warp order. Measured, it helps down_proj and slows gate_up, o_proj and the lm_head, whose whole
  tiles were already balanced (docs/PERFORMANCE.md).
Either way the order of every addition is fixed by the plan and the shape, so repeated runs (graph
and eager) give the same bits; no atomics.
A lane keeps the next `depth` items' loads in flight: item i + depth is requested right after item
i is computed, across tile boundaries, so the weight stream does not pause between tiles. Each
item's loads are R (x matrices) 16-byte words and the R group scales of its chunk; the scales ride
in the same pipeline, because a scale read at compute time would stall the lane for a DRAM round
trip at the start of every tile. At a tile's last step the lane partial sums meet in a warp_sum;
lane r stores row r (epilogue). Slots are separate local arrays named at compile time (depth <= 4),
so they stay in registers.

Programmatic dependent launch (ptx/griddep.py, launch.py): the weights do not depend on the kernel
before this one, so every lane issues its first `depth` items' loads before it waits
(grid_dependency_wait) for the activations: the loads are in flight while the previous kernel's
tail drains. A thread signals launch_dependents once it has issued its last load, so the next
kernel starts requesting its own weights while this one finishes.

Epilogue inputs read before the wait (residual, rope): h[row] that a residual epilogue adds to,
and the rope epilogue's bias, position, page and RoPE angles, are not written by the kernel before
this one, so each lane reads them with its first weight loads instead of after its tile's last
item, where every read was one more L2 or DRAM round trip in the kernel's tail. Lane
`owner * lanes_per_tile + r` of a warp stores row r of the warp's tile number `owner` (its tiles
counted from its first, which split plans may share with the warps before), so each lane reads
only its own rows; a warp with more tiles than that covers takes them in rounds of 32 lanes. Why
it is safe (docs/DECODE.md, "Execution model"): a kernel starts only once the kernel before it
has signalled launch_dependents, and the embedding, the INT4 GEMVs and decode attention signal
only after their own wait, which returns once every kernel before them has completed. So when
this kernel starts, every kernel before the nearest of those has completed, and in the step the
writers of h (embedding, o_proj, down_proj), of pos (the sampler, a graph earlier) and of the page
table (the page allocator, before the embedding) always lie before it. The condition this puts on
a caller: a residual GEMV must not follow the kernel that writes its h with nothing between but
kernels that signal before their wait (two residual GEMVs back to back on one h would add to a
stale value).

Fused RoPE and KV write (the decode step's QKV, `rope_heads=`, `launch_rope`): tile t is the row
pair (d, d + head_dim/2) of one head instead of two consecutive rows, so the warp that finishes it
holds both elements RoPE rotates together; one lane (the tile's owner, above) adds the bias,
rotates a q pair into q, a k pair into the position's KV-page slot (float16), and copies a v pair
there (kernels/rope_kv_write.py does the same for prefill rows). One launch and one kernel
boundary per layer fewer.
"""

from __future__ import annotations

import functools
import math

from numba import cuda, float32, uint32
from numba.core import types

from ..config import GROUP_SIZE
from ..ptx import SIMULATOR
from ..ptx.griddep import grid_dependency_wait, launch_dependents
from ..ptx.loads import ld_global_nc_v4_u32
from ..ptx.mma import SHARED_ALIGNMENT
from ..ptx.warp import warp_sum
from . import PAGE_SIZE
from .gemv_int4_paths import CHUNKS_PER_GROUP, U, gemv_path
from .kv_layout import stored_dim

MAX_DEPTH = 4  # pipeline slots a kernel can have (each one a named local array)

# out = Wx; out = Wx + b; out += Wx; out = silu(Wg x) Wu x; and "rope": the QKV projection's
# bias, RoPE and KV-cache write (module docstring), out = (q, k_pages, v_pages, page_table, pos,
# rope_cos, rope_sin).
EPILOGUES = ("store", "bias", "residual", "silu", "rope")


@functools.cache
def gemv_kernel(path: str, n: int, k: int, matrices: int, plan, grid: int, epilogue: str,
                norm_eps: float | None = None, heads: tuple[int, int, int] | None = None):
    """gemv_int4(q0, s0, q1, s1, activations, bias, out) for one shape, path, plan (a
    gemv_int4.GemvPlan), grid and epilogue.

    q/s are flat qweight uint32 [N*K/8] and scales float16 [N*K/128] of matrix 0 (and 1 for
    gate/up; pass matrix 0 again otherwise); `bias` (float16 [N]) is read by the bias and rope
    epilogues (pass any float16 array otherwise); out is float32 or float16 [N], or for "rope"
    (heads = (num_heads, num_kv_heads, head_dim), rows = 2) the tuple of RopeOutputs.
    """
    rows, depth, warps = plan.rows, plan.depth, plan.warps
    threads = 32 * warps
    shared_words, x_words, stage, load_x, multiply = gemv_path(path, k, rows, threads, norm_eps)
    chunks = U(k // 32)
    steps = U(-(-(k // 32) // 32))  # a lane's steps over one tile (the last may leave lanes idle)
    words_per_row = U(k // 8)
    groups = U(k // GROUP_SIZE)
    tiles = U(n // rows)
    blocks = U(grid)
    total_warps = U(grid * warps)
    split = plan.split_tiles
    slot_words = 4 * rows * matrices
    slot_scales = rows * matrices
    partial_words = warps * slot_scales if split else 1  # a warp's sums of a tile it leaves unfinished
    silu, bias, residual, rope = (epilogue == e for e in ("silu", "bias", "residual", "rope"))
    num_heads, num_kv_heads, head_dim = heads if rope else (1, 1, 2)
    half = U(head_dim // 2)
    k_start, v_start = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    # Epilogue inputs read before the wait (module docstring): a rope tile's four values (bias of
    # both rows, cos, sin) sit in one lane, a residual tile's rows in `rows` lanes.
    early = rope or residual
    lanes_per_tile = 1 if rope else rows
    early_per_tile = 4 if rope else 1
    tiles_per_round = 32 // lanes_per_tile
    if split:  # a run of at most this many items touches at most ceil(items / steps) + 1 tiles
        run_items = -(-(-(-(n // rows) // grid) * int(steps)) // warps)
        most_tiles = -(-run_items // int(steps)) + 1
    else:
        most_tiles = -(-(n // rows) // (grid * warps))
    rounds = -(-most_tiles // tiles_per_round)
    early_words = early_per_tile * rounds if early else 1

    @cuda.jit(device=True, inline="always")
    def row_of(tile, r):
        """Row r of a tile: consecutive rows, or for rope the pair (d, d + head_dim/2) of one head,
        so that one warp holds both elements RoPE rotates together."""
        if rope:
            return U(U(U(tile // half) * U(head_dim)) + U(tile % half) + U(U(r) * half))
        return U(U(tile * U(rows)) + U(r))

    # Index arithmetic. Numba widens every integer operation to 64 bits; each intermediate is
    # wrapped in U() so that LLVM narrows it back to 32 (down_proj's loop was two thirds 64-bit
    # adds, multiplies and a division by its 19 steps, and ran at half the speed of gate_up's).
    # A slot's item is tracked as (tile, step in the tile), advanced without dividing.

    @cuda.jit(device=True, inline="always")
    def advance(tile, step, by):
        """(tile, step) `by` items later."""
        step = U(step + U(by))
        while step >= steps:
            step = U(step - steps)
            tile = U(tile + U(1))
        return tile, step

    @cuda.jit(device=True, inline="always")
    def tile_of(warp_id, cursor):
        """The tile a warp's cursor points at: split plans walk their run of tiles directly; the
        others own tiles warp_id, warp_id + total_warps, ... (module docstring: work split)."""
        if split:
            return cursor
        return U(warp_id + U(cursor * total_warps))

    @cuda.jit(device=True, inline="always")
    def load(q0, s0, q1, s1, warp_id, lane, tile, step, valid, words, scl):
        """The item (tile, step) of this lane (its tile's rows at chunk lane + 32 step) into a slot."""
        if valid:
            c = U(lane + U(U(32) * step))
            if c < chunks:
                for r in range(rows):
                    row = row_of(tile_of(warp_id, tile), r)
                    at = U(U(row * words_per_row) + U(U(4) * c))
                    scale_at = U(U(row * groups) + U(c // U(CHUNKS_PER_GROUP)))
                    words[4 * r], words[4 * r + 1], words[4 * r + 2], words[4 * r + 3] = ld_global_nc_v4_u32(q0, at)
                    scl[r] = s0[scale_at]
                    if matrices == 2:
                        b = 4 * (rows + r)
                        words[b], words[b + 1], words[b + 2], words[b + 3] = ld_global_nc_v4_u32(q1, at)
                        scl[rows + r] = s1[scale_at]

    @cuda.jit(device=True, inline="always")
    def read_early(warp_id, lane, first_cursor, touched, bias_values, out, early_values):
        """This lane's epilogue inputs (module docstring), read before the wait; returns the rope
        epilogue's (position, physical page)."""
        p, page = U(0), U(0)
        if rope:
            page_table, pos = out[3], out[4]
            p = U(pos[0])
            page = U(page_table[p // U(PAGE_SIZE)])
        for j in range(rounds):
            owner = U(U(lane // U(lanes_per_tile)) + U(j * tiles_per_round))
            if owner < touched:
                tile = tile_of(warp_id, U(first_cursor + owner))
                if rope:
                    rope_cos, rope_sin = out[5], out[6]
                    first = row_of(tile, 0)
                    d = first % U(head_dim)
                    early_values[4 * j] = float32(bias_values[first])
                    early_values[4 * j + 1] = float32(bias_values[first + half])
                    early_values[4 * j + 2] = rope_cos[p, d]
                    early_values[4 * j + 3] = rope_sin[p, d]
                else:
                    early_values[j] = out[row_of(tile, lane % U(lanes_per_tile))]
        return p, page

    @cuda.jit(device=True, inline="always")
    def early_value(early_values, round_, e):
        """early_values[early_per_tile * round_ + e] for a round known only at run time, as selects
        over the compile-time rounds, so the array stays in registers."""
        value = early_values[e]
        for j in range(1, rounds):
            if round_ == U(j):
                value = early_values[early_per_tile * j + e]
        return value

    @cuda.jit(device=True, inline="always")
    def warp_totals(acc, totals):
        """totals = the warp's sums of acc (in every lane); acc restarts at zero."""
        for i in range(slot_scales):
            totals[i] = warp_sum(acc[i])
            acc[i] = float32(0)

    @cuda.jit(device=True, inline="always")
    def finish_rope(tile, owner, lane, totals, early_values, p, page, out):
        """The QKV tile (d, d + half) of one head: + bias, then a q head is rotated into q, a k head
        rotated into its KV page slot, a v head copied there (kernels/rope_kv_write.py's math; the
        slot's order is kernels/kv_layout.py's)."""
        if lane == U(owner % U(tiles_per_round)):
            q_out, k_pages, v_pages = out[0], out[1], out[2]
            round_ = U(owner // U(tiles_per_round))
            first = row_of(tile, 0)
            x1 = totals[0] + early_value(early_values, round_, 0)
            x2 = totals[1] + early_value(early_values, round_, 1)
            head = first // U(head_dim)
            d = first % U(head_dim)
            slot = p % U(PAGE_SIZE)
            if first < U(v_start):
                c, sn = early_value(early_values, round_, 2), early_value(early_values, round_, 3)
                y1, y2 = x1 * c - x2 * sn, x2 * c + x1 * sn
                if first < U(k_start):
                    q_out[first] = y1
                    q_out[first + half] = y2
                else:
                    kv = head - U(num_heads)
                    k_pages[page, kv, slot, stored_dim(slot, d)] = y1
                    k_pages[page, kv, slot, stored_dim(slot, d + half)] = y2
            else:
                kv = head - U(num_heads + num_kv_heads)
                v_pages[page, kv, slot, stored_dim(slot, d)] = x1
                v_pages[page, kv, slot, stored_dim(slot, d + half)] = x2

    @cuda.jit(device=True, inline="always")
    def finish(tile, owner, lane, totals, bias_values, early_values, p, page, out):
        """A tile's sums are complete (totals, in every lane): lane r stores row r's epilogue, or
        for the early-read epilogues the lanes that read its inputs (module docstring); `owner` is
        the tile's number among this warp's."""
        if rope:
            finish_rope(tile, owner, lane, totals, early_values, p, page, out)
            return
        for r in range(rows):
            if residual:
                if lane == U(U(U(lanes_per_tile) * U(owner % U(tiles_per_round))) + U(r)):
                    out[U(U(tile * U(rows)) + U(r))] = early_value(early_values, U(owner // U(tiles_per_round)), 0) \
                        + totals[r]
            elif lane == U(r):
                row = U(U(tile * U(rows)) + U(r))
                total = totals[r]
                if silu:
                    out[row] = total / (float32(1) + math.exp(-total)) * totals[rows + r]
                elif bias:
                    out[row] = total + float32(bias_values[row])
                else:
                    out[row] = total

    @cuda.jit(device=True, inline="always")
    def compute(warp_id, lane, tile, step, valid, deferred_tile, words, scl, activations, xs, xv, acc, totals,
                deferred, bias_values, out, first_cursor, early_values, p, page):
        """Add the item (tile, step), already in this slot, into acc. At a tile's last step the tile
        is finished, unless it began before this warp's range (deferred_tile): its sums wait in
        `deferred` for the partials of the warps before this one (gemv_int4, after the loop)."""
        if valid:
            c = U(lane + U(U(32) * step))
            if c < chunks:
                load_x(xs, c, xv)
                multiply(words, 0, scl, 0, c, activations, xv, acc, 0)
                if matrices == 2:
                    multiply(words, 4 * rows, scl, rows, c, activations, xv, acc, rows)
            if step == U(steps - U(1)):
                if tile == deferred_tile:
                    warp_totals(acc, deferred)
                else:
                    warp_totals(acc, totals)
                    finish(tile_of(warp_id, tile), U(tile - first_cursor), lane, totals, bias_values, early_values, p,
                           page, out)

    # The launch bound caps registers so that blocks_per_sm blocks fit (the simulator has no such option).
    @cuda.jit(**({} if SIMULATOR else {"launch_bounds": (threads, plan.blocks_per_sm)}))
    def gemv_int4(q0, s0, q1, s1, activations, bias_values, out):
        xs = cuda.shared.array(shared_words, uint32, alignment=SHARED_ALIGNMENT)
        partials = cuda.shared.array(partial_words, float32)
        words0 = cuda.local.array(slot_words, uint32)
        words1 = cuda.local.array(slot_words, uint32)
        words2 = cuda.local.array(slot_words, uint32)
        words3 = cuda.local.array(slot_words, uint32)
        scl0 = cuda.local.array(slot_scales, types.float16)
        scl1 = cuda.local.array(slot_scales, types.float16)
        scl2 = cuda.local.array(slot_scales, types.float16)
        scl3 = cuda.local.array(slot_scales, types.float16)
        xv = cuda.local.array(x_words, uint32)
        acc = cuda.local.array(slot_scales, float32)
        totals = cuda.local.array(slot_scales, float32)
        deferred = cuda.local.array(slot_scales, float32)
        early_values = cuda.local.array(early_words, float32)
        lane = U(cuda.laneid)
        warp = U(U(cuda.threadIdx.x) // U(32))
        block = U(cuda.blockIdx.x)
        warp_id = U(U(block * U(warps)) + warp)
        if split:
            # This block's run of tiles, then this warp's run of their items (module docstring).
            first_tile = U(U(block * tiles) // blocks)
            block_items = U(U(U(U(U(block + U(1)) * tiles) // blocks) - first_tile) * steps)
            begin = U(U(warp * block_items) // U(warps))
            end = U(U(U(warp + U(1)) * block_items) // U(warps))
            tile0, step0 = U(first_tile + U(begin // steps)), U(begin % steps)
            touched = U(U(U(first_tile + U(U(end - U(1)) // steps)) - tile0) + U(1)) if end > begin else U(0)
        else:
            # Whole tiles warp_id, warp_id + total_warps, ...: the cursor counts this warp's tiles.
            count = U(U(U(tiles - U(1) - warp_id) // total_warps) + U(1)) if warp_id < tiles else U(0)
            begin, end = U(0), U(count * steps)
            tile0, step0 = U(0), U(0)
            touched = count
        items = U(end - begin)
        # A tile this warp finishes but did not begin: the warps before it hold its first items.
        deferred_tile = tile0 if step0 != U(0) else U(0xFFFFFFFF)
        # Slot s starts at item begin + s; its (tile, step) cursor then moves `depth` items a round.
        tile1, step1 = advance(tile0, step0, 1)
        tile2, step2 = advance(tile1, step1, 1)
        tile3, step3 = advance(tile2, step2, 1)
        # The weights do not depend on the kernel before this one: request them first, then wait
        # for the activations (ptx/griddep.py).
        load(q0, s0, q1, s1, warp_id, lane, tile0, step0, U(0) < items, words0, scl0)
        if depth >= 2:
            load(q0, s0, q1, s1, warp_id, lane, tile1, step1, U(1) < items, words1, scl1)
        if depth >= 3:
            load(q0, s0, q1, s1, warp_id, lane, tile2, step2, U(2) < items, words2, scl2)
        if depth >= 4:
            load(q0, s0, q1, s1, warp_id, lane, tile3, step3, U(3) < items, words3, scl3)
        first_cursor = tile0
        p, page = U(0), U(0)
        if early:
            p, page = read_early(warp_id, lane, first_cursor, touched, bias_values, out, early_values)
        grid_dependency_wait()
        stage(activations, xs)
        for i in range(slot_scales):
            acc[i] = float32(0)
            deferred[i] = float32(0)
        item = U(0)
        triggered = False
        while item < items:
            compute(warp_id, lane, tile0, step0, item < items, deferred_tile, words0, scl0, activations, xs, xv, acc,
                    totals, deferred, bias_values, out, first_cursor, early_values, p, page)
            tile0, step0 = advance(tile0, step0, depth)
            load(q0, s0, q1, s1, warp_id, lane, tile0, step0, U(item + U(depth)) < items, words0, scl0)
            if depth >= 2:
                compute(warp_id, lane, tile1, step1, U(item + U(1)) < items, deferred_tile, words1, scl1, activations, xs,
                        xv, acc, totals, deferred, bias_values, out, first_cursor, early_values, p, page)
                tile1, step1 = advance(tile1, step1, depth)
                load(q0, s0, q1, s1, warp_id, lane, tile1, step1, U(item + U(depth + 1)) < items, words1, scl1)
            if depth >= 3:
                compute(warp_id, lane, tile2, step2, U(item + U(2)) < items, deferred_tile, words2, scl2, activations, xs,
                        xv, acc, totals, deferred, bias_values, out, first_cursor, early_values, p, page)
                tile2, step2 = advance(tile2, step2, depth)
                load(q0, s0, q1, s1, warp_id, lane, tile2, step2, U(item + U(depth + 2)) < items, words2, scl2)
            if depth >= 4:
                compute(warp_id, lane, tile3, step3, U(item + U(3)) < items, deferred_tile, words3, scl3, activations, xs,
                        xv, acc, totals, deferred, bias_values, out, first_cursor, early_values, p, page)
                tile3, step3 = advance(tile3, step3, depth)
                load(q0, s0, q1, s1, warp_id, lane, tile3, step3, U(item + U(depth + 3)) < items, words3, scl3)
            item = U(item + U(depth))
            if not triggered and U(item + U(depth)) >= items:
                # This thread has issued its last load: the next kernel may start and request its
                # weights while this block finishes (a trigger at the start put the next kernel's
                # blocks beside this one's for its whole run, which measured slower).
                launch_dependents()
                triggered = True
        if not triggered:
            launch_dependents()
        if split:
            # A run that ends inside a tile (or is empty) leaves its sums for the warp that finishes
            # that tile; they are added in warp order, so every run sums in the same order.
            if items == U(0) or U(end % steps) != U(0):
                warp_totals(acc, totals)
                if lane == U(0):
                    for i in range(slot_scales):
                        partials[U(U(warp * U(slot_scales)) + U(i))] = totals[i]
            cuda.syncthreads()
            if deferred_tile != U(0xFFFFFFFF) and items != U(0):
                tile_begin = U(U(deferred_tile - first_tile) * steps)
                if U(tile_begin + steps) <= end:  # this warp holds the tile's last step
                    before = warp
                    while True:
                        before = U(before - U(1))
                        for i in range(slot_scales):
                            deferred[i] += partials[U(U(before * U(slot_scales)) + U(i))]
                        if U(U(before * block_items) // U(warps)) <= tile_begin:
                            break
                    finish(deferred_tile, U(0), lane, deferred, bias_values, early_values, p, page, out)

    return gemv_int4

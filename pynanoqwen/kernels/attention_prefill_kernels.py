"""The kernels of kernels/attention_prefill.py (which owns what they compute, the launch and the
cost model): whole, split and merge, built per attention shape from shared device functions, so that
the three forms do the same arithmetic per row and give the same bits.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, types

from ..ptx import SIMULATOR
from ..ptx.fma import fma
from ..ptx.half2 import float2_to_half2
from ..ptx.mma import cp_async_16, cp_async_commit_group, cp_async_wait_group
from ..ptx.warp import shfl_xor
from ..ptx.wgmma import ROW_BYTES, SWIZZLE_ATOM_BYTES, WARPGROUP, fence_proxy_async_shared, shared_byte_address, \
    wgmma_commit_group, wgmma_f16, wgmma_f16_mn, wgmma_fence, wgmma_wait_group
from . import PAGE_SIZE
from .call_free import divide
from .kv_layout import SWIZZLE_ROWS

KEY_TILE = 64  # keys per pipeline stage: four pages, one m64n64 wgmma a 16-dim k step
STAGES = 2  # (K, V) tiles in shared memory: 64 KiB at head_dim 128
QUERY_TILE = 16  # default query positions per block: one 16-row mma tile per query head
# Keys per segment: each row's softmax state restarts at every multiple of this and is folded into
# the running state in segment order (kernels/attention_prefill.py's docstring). Chosen on the
# mma.sync kernel before this one: a fold added ~360 PTX instructions once a segment to a tile loop
# of ~510 at 32 keys a tile (dev/ptx_loop_mix.py), and a 22-row chunk over 4006 cached keys has 8
# segments, so 64 blocks instead of 8.
SEGMENT_KEYS = 512
SPLIT_ROWS = 128  # chunks of at most this many rows (M_cap) run each segment in a block of its own
MERGE_PARTS = 4  # blocks of the merge per (row block, kv head): each folds a quarter of the O accumulators
# Registers per thread: one 8-warp block a SM, nothing spilled (205 / 207 at 7B). At 128, two
# blocks a SM, the 64-key tile spilled 376 bytes and was the slowest setting measured; at 255 it
# took 31-57% less time than the mma.sync kernel at two blocks a SM (docs/PERFORMANCE.md,
# "Prefill attention on wgmma, measured").
REGISTER_CAP = 255
JIT_OPTIONS = {} if SIMULATOR else {"max_registers": REGISTER_CAP}  # the simulator takes no such option
U = np.uint32  # unsigned index arithmetic: no negative-index checks
WARPS_PER_GROUP = WARPGROUP // 32


def state_values(head_dim: int) -> int:
    """Floats of one lane's softmax state: the O accumulators, then the two row sums and maxima."""
    return 4 * (head_dim // 8) + 4


@functools.cache  # one compile per shape a process: every engine it loads (validate loads six) shares it
def build_kernels(num_heads, num_kv_heads, head_dim, query_tile, segment_keys, max_segments):
    """(whole, split, merge): the kernel that walks all of a block's segments, and the pair that
    computes each segment in a block of its own, then folds them (module docstring)."""
    GROUP = num_heads // num_kv_heads  # query heads per KV head
    ROW_TILES = query_tile // 16  # 16-row mma tiles of positions per block
    REAL_WARPS = GROUP * ROW_TILES
    WARPS = -(-REAL_WARPS // WARPS_PER_GROUP) * WARPS_PER_GROUP  # whole warpgroups: padding warps
    THREADS = 32 * WARPS
    QUERY_ROWS = query_tile
    ROW_WORDS = head_dim // 2  # one K/V row in global memory, as half2 words
    # K and V tiles alike: 64-wide slabs of KEY_TILE 128-byte rows, 128-byte swizzled (ptx/wgmma.py)
    TILE_WORDS = KEY_TILE * ROW_WORDS
    SLAB_WORDS = KEY_TILE * ROW_BYTES // 4
    SLAB_BYTES = KEY_TILE * ROW_BYTES  # from one 64-dim slab of a tile to the next
    RINGS_WORDS = STAGES * 2 * TILE_WORDS
    ROW_CHUNKS = head_dim // 8  # 16-byte copies per row
    TILE_CHUNKS = KEY_TILE * ROW_CHUNKS
    SLOT_WORDS = ROW_WORDS
    KV_HEAD_WORDS = PAGE_SIZE * ROW_WORDS  # one (page, kv head) tile
    PAGE_WORDS = num_kv_heads * KV_HEAD_WORDS
    OUT_ROW_WORDS = num_heads * head_dim // 2
    DIM_STEPS = head_dim // 16  # k steps of Q K^T
    KEY_NTILES = KEY_TILE // 8  # n tiles of S
    KEY_STEPS = KEY_TILE // 16  # k steps of P V
    KEY_STEP_WORDS = 16 * ROW_BYTES // 4  # from one k step of P V to the next in a V slab
    DIM_NTILES = head_dim // 8  # n tiles of O
    Q_REGISTERS, S_REGISTERS, O_REGISTERS = 4 * DIM_STEPS, 4 * KEY_NTILES, 4 * DIM_NTILES  # per lane
    P_REGISTERS = S_REGISTERS // 2  # the weights as half2 words: P V's A fragments
    STATE = state_values(head_dim)
    SUM_LO, SUM_HI, MAX_LO, MAX_HI = O_REGISTERS, O_REGISTERS + 1, O_REGISTERS + 2, O_REGISTERS + 3
    SEGMENT_TILES = segment_keys // KEY_TILE
    MAX_SEGMENTS = max_segments
    PART_NTILES = DIM_NTILES // MERGE_PARTS
    PART_VALUES = 4 * PART_NTILES  # a merge thread's O accumulators
    Q_SCALE = np.float32(math.log2(math.e) / math.sqrt(head_dim))
    NEG_INF = np.float32(-np.inf)
    ZERO = np.float32(0.0)
    ONE = np.float32(1.0)

    @cuda.jit(device=True, inline="always")
    def block_rows(row_count, start_position):
        """(m, start, first row of this block, the block's last needed key, its key tiles)."""
        m = U(row_count[0])
        start = U(start_position[0])
        first_row = U(cuda.gridDim.x - 1 - cuda.blockIdx.x) * U(QUERY_ROWS)  # longest blocks first
        last_key = start + min(first_row + U(QUERY_ROWS), m) - U(1)
        return m, start, first_row, last_key, last_key // U(KEY_TILE) + U(1)

    @cuda.jit(device=True, inline="always")
    def load_tile(k_words, v_words, page_table, smem, k_ring, v_ring, stage, first_key, last_key, kv_head):
        """Issue this thread's cp.async share of keys first_key..+KEY_TILE-1 into `stage`: K and V
        chunk c of row r at chunk position c ^ (r % 8) of its slab's 128-byte row. Keys past
        last_key are zero-filled and not read."""
        for i in range(-(-TILE_CHUNKS // THREADS)):
            c = U(cuda.threadIdx.x) + U(i * THREADS)
            if TILE_CHUNKS % THREADS == 0 or c < TILE_CHUNKS:
                row, chunk = c // U(ROW_CHUNKS), c % U(ROW_CHUNKS)
                key = first_key + row
                in_tile = (stage * U(TILE_WORDS) + (chunk // U(8)) * U(SLAB_WORDS) + row * U(32)
                           + U(4) * ((chunk % U(8)) ^ (row % U(8))))
                src, size = U(0), U(0)
                if key <= last_key:
                    page = U(page_table[key // U(PAGE_SIZE)])
                    # The page stores chunk c of slot s at c ^ (s % 8) (kernels/kv_layout.py).
                    src = page * U(PAGE_WORDS) + kv_head * U(KV_HEAD_WORDS) + (key % U(PAGE_SIZE)) * U(SLOT_WORDS) \
                        + (chunk ^ (key % U(SWIZZLE_ROWS))) * U(4)
                    size = U(16)
                cp_async_16(smem, k_ring + in_tile, k_words, src, size)
                cp_async_16(smem, v_ring + in_tile, v_words, src, size)

    @cuda.jit(device=True, inline="always")
    def load_q(q, m, warp_row, head, gid, tid, q_frag):
        """A fragments of Q (pre-scaled, FP16): register 4 kk + half + 2 side holds row gid + 8 half,
        dims 16 kk + 8 side + 2 tid, +1. Rows >= m are zeros (their q may be anything)."""
        for kk in range(DIM_STEPS):
            for half in range(2):
                row = warp_row + gid + U(8 * half)
                for side in range(2):
                    dim = U(16 * kk + 8 * side) + U(2) * tid
                    x0, x1 = ZERO, ZERO
                    if row < m:
                        x0 = q[row, head, dim] * Q_SCALE
                        x1 = q[row, head, dim + U(1)] * Q_SCALE
                    q_frag[4 * kk + half + 2 * side] = float2_to_half2(x0, x1)

    @cuda.jit(device=True, inline="always")
    def reset(state):
        """An empty softmax state: no keys seen."""
        for i in range(O_REGISTERS):
            state[i] = ZERO
        state[SUM_LO], state[SUM_HI] = ZERO, ZERO
        state[MAX_LO], state[MAX_HI] = NEG_INF, NEG_INF

    @cuda.jit(device=True, inline="always")
    def softmax_tile(first_key, warp_position, gid, tid, s, state):
        """The tile's scores s (log2 domain) become this lane's weights P = exp2(s - max), the
        state's maxima, sums and O accumulators rescaled to the new maxima."""
        if first_key + U(KEY_TILE - 1) > warp_position:  # the tile reaches past some row's position
            for j in range(KEY_NTILES):
                for e in range(4):
                    key = first_key + U(8 * j + e % 2) + U(2) * tid
                    if key > warp_position + gid + U(8 * (e // 2)):
                        s[4 * j + e] = NEG_INF

        tile_lo, tile_hi = NEG_INF, NEG_INF
        for j in range(KEY_NTILES):
            tile_lo = max(tile_lo, max(s[4 * j], s[4 * j + 1]))
            tile_hi = max(tile_hi, max(s[4 * j + 2], s[4 * j + 3]))
        for mask in (1, 2):  # the 4 lanes of a quad hold one row's columns
            tile_lo = max(tile_lo, shfl_xor(tile_lo, mask))
            tile_hi = max(tile_hi, shfl_xor(tile_hi, mask))
        # A row may have seen no key of its segment yet (its position is below the segment's first
        # key while other rows of the warp are past it): its maximum stays -inf, and exp2 is taken
        # relative to 0 instead, so that every weight and rescaling is exp2(-inf) = 0, not NaN.
        new_lo, new_hi = max(state[MAX_LO], tile_lo), max(state[MAX_HI], tile_hi)
        ref_lo = new_lo if new_lo != NEG_INF else ZERO
        ref_hi = new_hi if new_hi != NEG_INF else ZERO
        scale_lo, scale_hi = math.exp2(state[MAX_LO] - ref_lo), math.exp2(state[MAX_HI] - ref_hi)
        state[MAX_LO], state[MAX_HI] = new_lo, new_hi
        sum_lo, sum_hi = state[SUM_LO] * scale_lo, state[SUM_HI] * scale_hi
        for j in range(DIM_NTILES):
            state[4 * j] *= scale_lo
            state[4 * j + 1] *= scale_lo
            state[4 * j + 2] *= scale_hi
            state[4 * j + 3] *= scale_hi
        for j in range(KEY_NTILES):
            s[4 * j] = math.exp2(s[4 * j] - ref_lo)
            s[4 * j + 1] = math.exp2(s[4 * j + 1] - ref_lo)
            s[4 * j + 2] = math.exp2(s[4 * j + 2] - ref_hi)
            s[4 * j + 3] = math.exp2(s[4 * j + 3] - ref_hi)
            sum_lo += s[4 * j] + s[4 * j + 1]
            sum_hi += s[4 * j + 2] + s[4 * j + 3]
        state[SUM_LO], state[SUM_HI] = sum_lo, sum_hi

    @cuda.jit(device=True, inline="always")
    def attend_tile(smem, k_stage, v_stage, first_key, warp_position, gid, tid, q_frag, s, p_frag, state):
        """Add the key tile (keys first_key..+KEY_TILE-1; K at k_stage, V at v_stage of `smem`) into
        this lane's state (s and p_frag: the tile's scores and weights, registers). Every warp of
        the block calls it (the wgmmas are its warpgroup's)."""
        # S = Q K^T: the warpgroup's 64 rows (its warps' Q fragments) against the tile's keys,
        # one wgmma a 16-dim k step, the result in mma.sync's D layout (ptx/wgmma.py).
        for i in range(S_REGISTERS):
            s[i] = ZERO
        wgmma_fence()
        for kk in range(DIM_STEPS):
            wgmma_f16(s, KEY_TILE, q_frag[4 * kk], q_frag[4 * kk + 1], q_frag[4 * kk + 2], q_frag[4 * kk + 3],
                      smem, k_stage + U((kk // 4) * SLAB_WORDS + 8 * (kk % 4)))
        wgmma_commit_group()
        wgmma_wait_group(0)
        # A padding warp too (on warp 0's rows, into a state it never stores): a branch around it
        # would leave the accumulators written on a divergent path, and ptxas then serializes
        # every wgmma of the kernel (its warning C7520).
        softmax_tile(first_key, warp_position, gid, tid, s, state)
        # O += P V on wgmma: the S accumulators of key n tiles 2 ks, 2 ks + 1 are the A fragment of
        # key step ks (flash-attention 2's register reuse; wgmma takes A as mma.sync does), the O
        # accumulators (state[0 : O_REGISTERS]) its D, and V's 16 key rows of step ks, MN-major,
        # its B: the V tile is stored as the K tile is, so its rows are B's k rows (ptx/wgmma.py).
        # Every A register is packed before the fence: one written between two wgmmas makes ptxas
        # insert a warpgroup arrive there (its note C7519).
        for i in range(P_REGISTERS):
            p_frag[i] = float2_to_half2(s[2 * i], s[2 * i + 1])
        wgmma_fence()  # the softmax rewrote the accumulators
        for ks in range(KEY_STEPS):
            wgmma_f16_mn(state, head_dim, p_frag[4 * ks], p_frag[4 * ks + 1], p_frag[4 * ks + 2], p_frag[4 * ks + 3],
                         smem, v_stage + U(ks * KEY_STEP_WORDS), SLAB_BYTES)
        wgmma_commit_group()
        wgmma_wait_group(0)

    @cuda.jit(device=True, inline="always")
    def fold_scales(running_max, segment_max):
        """(maximum, a, b) that fold a segment into the running state: x = folded(x_running, x_segment, a, b)."""
        both = max(running_max, segment_max)
        ref = both if both != NEG_INF else ZERO
        return both, math.exp2(running_max - ref), math.exp2(segment_max - ref)

    @cuda.jit(device=True, inline="always")
    def folded(running_value, segment_value, a, b):
        """One accumulator or row sum folded (a, b from fold_scales). Every form computes exactly this
        expression, written once, which is what keeps their bits the same."""
        return fma(running_value, a, segment_value * b)

    @cuda.jit(device=True, inline="always")
    def fold_into_shared(running, run_at, state):
        """running = running folded with state (this lane's values in shared memory, 32 apart)."""
        both_lo, a_lo, b_lo = fold_scales(running[run_at + U(32 * MAX_LO)], state[MAX_LO])
        both_hi, a_hi, b_hi = fold_scales(running[run_at + U(32 * MAX_HI)], state[MAX_HI])
        for i in range(O_REGISTERS):
            at = run_at + U(32 * i)
            if i % 4 < 2:
                running[at] = folded(running[at], state[i], a_lo, b_lo)
            else:
                running[at] = folded(running[at], state[i], a_hi, b_hi)
        running[run_at + U(32 * SUM_LO)] = folded(running[run_at + U(32 * SUM_LO)], state[SUM_LO], a_lo, b_lo)
        running[run_at + U(32 * SUM_HI)] = folded(running[run_at + U(32 * SUM_HI)], state[SUM_HI], a_hi, b_hi)
        running[run_at + U(32 * MAX_LO)] = both_lo
        running[run_at + U(32 * MAX_HI)] = both_hi

    @cuda.jit(device=True, inline="always")
    def walk_tiles(k_words, v_words, page_table, smem, k_ring, v_ring, first_tile, end_tile, last_key, kv_head,
                   warp_position, gid, tid, q_frag, s, p_frag, state, running, run_at, real):
        """Tiles first_tile..end_tile - 1 into `state` through the two-stage ring (tile first_tile
        already issued). Each segment that ends before end_tile is folded into `running` (shared
        memory; this lane's value v at run_at + 32 v) and `state` restarts; a range within one
        segment (the split kernel's) never folds."""
        for kt in range(first_tile, end_tile):
            stage = kt % U(STAGES)
            cp_async_wait_group(0)
            fence_proxy_async_shared()  # this thread's copies of tile kt, visible to the tensor cores
            # Tile kt is visible to every thread, and every warp is done with tile kt - 1, whose
            # stage is refilled next.
            cuda.syncthreads()
            if kt + U(1) < end_tile:
                load_tile(k_words, v_words, page_table, smem, k_ring, v_ring, (kt + U(1)) % U(STAGES),
                          (kt + U(1)) * U(KEY_TILE), last_key, kv_head)
            cp_async_commit_group()
            # Every tile up to the block's last key: for a warp whose rows all precede it, every
            # weight is exp2(-inf) = 0 and every scale 1 (0 on an empty state), so its state keeps
            # its bits; skipping it per warp would split a warpgroup's wgmma.
            attend_tile(smem, k_ring + stage * U(TILE_WORDS), v_ring + stage * U(TILE_WORDS), kt * U(KEY_TILE),
                        warp_position, gid, tid, q_frag, s, p_frag, state)
            if (kt + U(1)) % U(SEGMENT_TILES) == U(0) and kt + U(1) < end_tile:
                if real:
                    fold_into_shared(running, run_at, state)
                reset(state)
        cp_async_wait_group(0)  # the last (empty) group: nothing of this block is left in flight

    @cuda.jit(device=True, inline="always")
    def store_rows(out_words, m, warp_row, head, gid, tid, acc, sum_lo, sum_hi, part, parts):
        """attn of this lane's two rows below m at O n tiles part * parts ..+parts - 1, whose
        accumulators acc holds from index 0: acc / row sum, the row sum reduced over the quad."""
        for mask in (1, 2):
            sum_lo += shfl_xor(sum_lo, mask)
            sum_hi += shfl_xor(sum_hi, mask)
        for half in range(2):
            row = warp_row + gid + U(8 * half)
            if row < m:
                inverse = divide(ONE, sum_lo if half == 0 else sum_hi)  # no call: kernels/call_free.py
                at = row * U(OUT_ROW_WORDS) + head * U(ROW_WORDS) + tid
                for jj in range(parts):
                    j = part * U(parts) + U(jj)
                    out_words[at + U(4) * j] = float2_to_half2(acc[4 * jj + 2 * half] * inverse,
                                                               acc[4 * jj + 2 * half + 1] * inverse)

    @cuda.jit(device=True, inline="always")
    def rings(smem):
        """(K ring, V ring) word offsets in the dynamic shared memory: the K ring at its first
        1024-byte boundary (the swizzle's atom), the V ring after it."""
        k_ring = (U(SWIZZLE_ATOM_BYTES) - shared_byte_address(smem, U(0)) % U(SWIZZLE_ATOM_BYTES)) \
            % U(SWIZZLE_ATOM_BYTES) // U(4)
        return k_ring, k_ring + U(STAGES * TILE_WORDS)

    @cuda.jit(device=True, inline="always")
    def lane_rows(first_row, start):
        """(warp, lane, gid, tid, head, warp_row, warp_position, real) of this thread in block (., kv
        head); a padding warp (not real) takes the rows of warp 0."""
        warp, lane = U(cuda.threadIdx.x) // U(32), U(cuda.threadIdx.x) % U(32)
        real = warp < U(REAL_WARPS)
        source = warp if real else U(0)
        head = U(cuda.blockIdx.y) * U(GROUP) + source % U(GROUP)
        warp_row = first_row + U(16) * (source // U(GROUP))  # this warp's 16 rows start here
        return warp, lane, lane // U(4), lane % U(4), head, warp_row, start + warp_row, real

    @cuda.jit(device=True, inline="always")
    def record_at(segment, warp, lane):
        """This lane's value 0 in the split kernel's record of (row block, kv head, segment, warp);
        padding warps have none."""
        block = U(cuda.blockIdx.x) * U(num_kv_heads) + U(cuda.blockIdx.y)
        return (U(block * U(MAX_SEGMENTS) + segment) * U(REAL_WARPS) + warp) * U(STATE * 32) + lane

    @cuda.jit(**JIT_OPTIONS)
    def prefill_attention(q, k_words, v_words, page_table, start_position, row_count, out_words):
        """Every segment of the block's keys in turn, folded into a running state in shared memory."""
        smem = cuda.shared.array(0, types.uint32)  # dynamic: the rings, then WARPS x STATE x 32 floats
        running = cuda.shared.array(0, types.float32)  # the same memory
        k_ring, v_ring = rings(smem)
        m, start, first_row, last_key, key_tiles = block_rows(row_count, start_position)
        if first_row >= m:
            return
        kv_head = U(cuda.blockIdx.y)
        warp, lane, gid, tid, head, warp_row, warp_position, real = lane_rows(first_row, start)
        load_tile(k_words, v_words, page_table, smem, k_ring, v_ring, U(0), U(0), last_key, kv_head)
        cp_async_commit_group()
        q_frag = cuda.local.array(Q_REGISTERS, types.uint32)
        load_q(q, m, warp_row, head, gid, tid, q_frag)
        state = cuda.local.array(STATE, types.float32)  # the segment's: O (c0, c1 row gid; c2, c3 row gid + 8), ...
        reset(state)
        s = cuda.local.array(S_REGISTERS, types.float32)
        p_frag = cuda.local.array(P_REGISTERS, types.uint32)
        run_at = k_ring + U(RINGS_WORDS) + warp * U(STATE * 32) + lane
        # A block of one segment folds it into the empty state only: fold(empty, S) = S + 0 (a = exp2(-inf)
        # = 0, b = exp2(0) = 1), so it skips the running state (5 of 51 us a layer at 512 tokens, measured
        # on the mma.sync kernel before this one).
        single = key_tiles <= U(SEGMENT_TILES)
        if not single and real:
            for v in range(STATE):
                running[run_at + U(32 * v)] = NEG_INF if v >= MAX_LO else ZERO
        walk_tiles(k_words, v_words, page_table, smem, k_ring, v_ring, U(0), key_tiles, last_key, kv_head,
                   warp_position, gid, tid, q_frag, s, p_frag, state, running, run_at, real)
        if not real:
            return
        if single:
            for i in range(O_REGISTERS):
                state[i] = state[i] + ZERO
            sum_lo, sum_hi = state[SUM_LO] + ZERO, state[SUM_HI] + ZERO
        else:  # the last segment: the same fold, into registers
            _, a_lo, b_lo = fold_scales(running[run_at + U(32 * MAX_LO)], state[MAX_LO])
            _, a_hi, b_hi = fold_scales(running[run_at + U(32 * MAX_HI)], state[MAX_HI])
            for i in range(O_REGISTERS):
                if i % 4 < 2:
                    state[i] = folded(running[run_at + U(32 * i)], state[i], a_lo, b_lo)
                else:
                    state[i] = folded(running[run_at + U(32 * i)], state[i], a_hi, b_hi)
            sum_lo = folded(running[run_at + U(32 * SUM_LO)], state[SUM_LO], a_lo, b_lo)
            sum_hi = folded(running[run_at + U(32 * SUM_HI)], state[SUM_HI], a_hi, b_hi)
        store_rows(out_words, m, warp_row, head, gid, tid, state, sum_lo, sum_hi, U(0), DIM_NTILES)

    @cuda.jit(**JIT_OPTIONS)
    def prefill_attention_split(q, k_words, v_words, page_table, start_position, row_count, records):
        """Block (x, kv head, segment): that segment's keys only; its state goes to `records`."""
        smem = cuda.shared.array(0, types.uint32)  # dynamic: the rings
        unused = cuda.shared.array(1, types.float32)  # walk_tiles' running state: one segment never folds
        k_ring, v_ring = rings(smem)
        m, start, first_row, last_key, key_tiles = block_rows(row_count, start_position)
        segment = U(cuda.blockIdx.z)
        first_tile = segment * U(SEGMENT_TILES)
        if first_row >= m or first_tile >= key_tiles:
            return
        end_tile = min(first_tile + U(SEGMENT_TILES), key_tiles)
        kv_head = U(cuda.blockIdx.y)
        warp, lane, gid, tid, head, warp_row, warp_position, real = lane_rows(first_row, start)
        load_tile(k_words, v_words, page_table, smem, k_ring, v_ring, first_tile % U(STAGES), first_tile * U(KEY_TILE),
                  last_key, kv_head)
        cp_async_commit_group()
        q_frag = cuda.local.array(Q_REGISTERS, types.uint32)
        load_q(q, m, warp_row, head, gid, tid, q_frag)
        state = cuda.local.array(STATE, types.float32)
        reset(state)
        s = cuda.local.array(S_REGISTERS, types.float32)
        p_frag = cuda.local.array(P_REGISTERS, types.uint32)
        walk_tiles(k_words, v_words, page_table, smem, k_ring, v_ring, first_tile, end_tile, last_key, kv_head,
                   warp_position, gid, tid, q_frag, s, p_frag, state, unused, U(0), real)
        if not real:
            return
        at = record_at(segment, warp, lane)
        for v in range(STATE):
            records[at + U(32 * v)] = state[v]

    @cuda.jit
    def prefill_attention_merge(start_position, row_count, records, out_words):
        """Block (x, kv head, part): the segments' records folded in segment order, as the whole
        kernel folds them, for a quarter of the O accumulators; then attn of those dims."""
        m, start, first_row, last_key, key_tiles = block_rows(row_count, start_position)
        if first_row >= m:
            return
        warp, lane, gid, tid, head, warp_row, warp_position, real = lane_rows(first_row, start)
        if not real:
            return
        part = U(cuda.blockIdx.z)
        first_value = part * U(PART_VALUES)
        acc = cuda.local.array(PART_VALUES, types.float32)
        for i in range(PART_VALUES):
            acc[i] = ZERO
        sum_lo, sum_hi, max_lo, max_hi = ZERO, ZERO, NEG_INF, NEG_INF
        segments = (key_tiles + U(SEGMENT_TILES - 1)) // U(SEGMENT_TILES)
        for segment in range(segments):
            at = record_at(U(segment), warp, lane)
            max_lo, a_lo, b_lo = fold_scales(max_lo, records[at + U(32 * MAX_LO)])
            max_hi, a_hi, b_hi = fold_scales(max_hi, records[at + U(32 * MAX_HI)])
            for i in range(PART_VALUES):
                value = records[at + U(32) * (first_value + U(i))]
                if i % 4 < 2:
                    acc[i] = folded(acc[i], value, a_lo, b_lo)
                else:
                    acc[i] = folded(acc[i], value, a_hi, b_hi)
            sum_lo = folded(sum_lo, records[at + U(32 * SUM_LO)], a_lo, b_lo)
            sum_hi = folded(sum_hi, records[at + U(32 * SUM_HI)], a_hi, b_hi)
        store_rows(out_words, m, warp_row, head, gid, tid, acc, sum_lo, sum_hi, part, PART_NTILES)

    return prefill_attention, prefill_attention_split, prefill_attention_merge

"""Prefill attention on wgmma: a variant of the product's whole kernel (kernels/attention_prefill.py
owns what it computes; attention_prefill_kernels.py the kernel), in two forms.

Q K^T on wgmma (`pv_wgmma=False`). Each warp of the product computes its 16 x 32 score tile of a
key tile with 32 `mma.sync` m16n8k16 fed by 16 `ldmatrix.x4` of K. Here the block's warps form
warpgroups (the GQA group padded to whole warpgroups: 7 query heads -> 8 warps, the eighth
computing head 6's scores again and dropping them), and each warpgroup issues head_dim / 16
`wgmma` m64n32k16 (m64n64k16 at 64 keys a tile) whose B is the K tile in shared memory. A
warpgroup's 64 A rows are its 4 warps' own Q fragments (4 heads x 16 positions), registers exactly
as mma.sync takes them (ptx/wgmma.py). The cp.async copies write each key's 16-byte chunks straight
into the 128-byte-swizzled K-major layout the tensor cores read (no padding; the K ring needs
1024-byte alignment, so the shared memory is dynamic). The S accumulators come back in mma.sync's
D layout, so the causal mask, the online softmax and P V (mma.sync on the padded V tile through
ldmatrix.trans) are the product's, copied (the product's are closures of its kernel builder).

P V on wgmma too (`pv_wgmma=True`): O^T (head_dim x the warpgroup's 64 query rows) += V^T P^T, one
m64n64k16 per 16 keys and 64 dims. A = V^T comes from the same padded V tile through the same
ldmatrix.trans the product uses for its B fragments (a warp's 16 dims: the product's b0, b1, b2,
b3 are this A's a0, a2, a1, a3). B = P^T: each warp writes its 16 rows of P (FP16) into the
warpgroup's swizzled P tile (8 KiB), and its rows' rescaling factors into shared memory, since
a lane of O^T holds 16 query rows' columns; one more block barrier a tile. At the end the row sums
travel the same way, and O / sum is stored 16 bits at a time.

No segments in either: one online softmax over all of a row's keys (the product folds its state
every 512 keys so that its split form gives the same bits; the folds cost ~1% at 32000 tokens).
And 32 keys a ring stage, the product's, or 64 (67.0 KiB of shared memory, 83.5 with the P tiles:
past the 48 KiB a static array may have): half the barriers, rescalings and row maxima a key.

Counted, per warp (head_dim 128, PTX, dev/ptx_loop_mix.py's way): the product's tile loop is 874
instructions with the segment fold, which runs once in 16 tiles, ~510 without; Q K^T on wgmma 486
at 32 keys and 745 at 64 (a 32-key tile: 32 mma.sync and 16 ldmatrix.x4 become 8 wgmma, a fence,
a commit, a wait and 8 descriptors of 4 instructions); with P V on wgmma too 563 and 867 (P's
stores, the factors' loads and two more descriptors outweigh the 32 mma.sync and 12 ldmatrix.x4
it saves). Registers (ptxas, sm_90a), bytes spilled at a cap of 128 (two 8-warp blocks a SM) /
168 / 255 (one block a SM): Q K^T 140 / 0 / 0 at 32 keys, 376 / 32 / 0 at 64; with P V 112 / 0 / 0
and 312 / 56 / 0. `SETTINGS` times them all. The row sums' reciprocal comes from
kernels/call_free.py: `1 / x` would be a subroutine call, and a call serializes every wgmma of the
kernel (docs/HARDWARE.md).

Predicted: Q K^T on wgmma 5-15% less time at 8k-32k tokens, where the product is issue- and
latency-bound at 16 warps a SM (docs/PERFORMANCE.md, "Prefill attention profiled"); P V on wgmma
more only if the tensor pipe, not the issue rate, limits the product (its mma.sync run at a third
of their peak by its docstring's model). Measured on an H100 (docs/PERFORMANCE.md, "Prefill
attention on wgmma, measured"): Q K^T on wgmma at 64 keys and 255 registers takes 31-57% less
time than the product at every chunk (4503 -> 3122 us at rows 29952..31999); P V on wgmma is slower
than Q K^T alone, and its 64-key form FAILS the float64 check from 512 rows (passes at 1 and 64;
the bug is not found: the simulator test, at head_dim 64, passes).

`check` compares every setting against pynanoqwen.oracles.attention_oracle (float64, its
fp16-operand bound) at 7B shapes; `timings` times the product's whole kernel and every setting,
one layer's chunk in a CUDA graph, as tests/test_attention_prefill_gpu.py does.
"""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np
from numba import cuda, types, uint16

from pynanoqwen.kernels import PAGE_SIZE, CompileTarget
from pynanoqwen.kernels.attention_prefill import attention_flops, make_prefill_attention
from pynanoqwen.kernels.call_free import divide
from pynanoqwen.kernels.attention_prefill_kernels import KEY_TILE, REGISTER_CAP, STAGES
from pynanoqwen.launch import launch
from pynanoqwen.oracles import bound_report
from pynanoqwen.ptx import SIMULATOR
from pynanoqwen.ptx.half2 import float2_to_half2
from pynanoqwen.ptx.mma import cp_async_16, cp_async_commit_group, cp_async_wait_group, ldmatrix_x4_trans, \
    mma_m16n8k16
from pynanoqwen.ptx.warp import shfl_xor
from pynanoqwen.ptx.wgmma import ROW_BYTES, SWIZZLE_ATOM_BYTES, WARPGROUP, fence_proxy_async_shared, \
    shared_byte_address, wgmma_commit_group, wgmma_f16, wgmma_fence, wgmma_wait_group

QUERY_ROWS = 16  # positions a block: one 16-row tile a head, as the product's default query tile
KEY_TILES = (KEY_TILE, 2 * KEY_TILE)  # the product's 32 keys a stage (n32 wgmma), and 64 (n64)
# (keys a tile, registers a thread, P V on wgmma) timed: 128 registers let two 8-warp blocks share a SM;
# at 255 none of the forms spills (ptxas, sm_90a; the module docstring has the counts).
SETTINGS = tuple((keys, registers, pv) for pv in (False, True) for keys in KEY_TILES
                 for registers in (REGISTER_CAP, 168, 255))
U = np.uint32


@functools.cache
def build(num_heads: int, num_kv_heads: int, head_dim: int, key_tile: int, max_registers: int = REGISTER_CAP,
          pv_wgmma: bool = False):
    """The kernel for one attention shape, key tile (keys a ring stage), register cap and form
    (pv_wgmma: P V on wgmma too): grid (row blocks, kv heads), block_threads(...) threads,
    shared_bytes(...) of dynamic shared memory."""
    KEYS = key_tile
    GROUP = num_heads // num_kv_heads
    WARPS = block_threads(num_heads, num_kv_heads) // 32
    THREADS = 32 * WARPS
    ROW_WORDS = head_dim // 2  # one K/V row in global memory, as half2 words
    ROW_CHUNKS = head_dim // 8  # 16-byte copies a row
    TILE_CHUNKS = KEYS * ROW_CHUNKS
    SLAB_WORDS = KEYS * ROW_BYTES // 4  # one 64-wide slab of a K tile: KEYS rows of 128 bytes
    K_TILE_WORDS = KEYS * ROW_WORDS
    V_ROW_WORDS = ROW_WORDS + 4  # the product's padded V rows, for ldmatrix.trans without conflicts
    V_TILE_WORDS = KEYS * V_ROW_WORDS
    P_TILE_WORDS = 64 * ROW_BYTES // 4  # a warpgroup's 64 rows of P (its 4 warps' 16 rows), 128 bytes each
    KV_HEAD_WORDS = PAGE_SIZE * ROW_WORDS
    PAGE_WORDS = num_kv_heads * KV_HEAD_WORDS
    OUT_ROW_WORDS = num_heads * head_dim // 2
    DIM_STEPS = head_dim // 16
    KEY_NTILES = KEYS // 8
    KEY_STEPS = KEYS // 16
    DIM_NTILES = head_dim // 8
    DIM_HALVES = head_dim // 64  # P V on wgmma: m64 rows of O^T (dims) a wgmma
    Q_REGISTERS, S_REGISTERS, O_REGISTERS = 4 * DIM_STEPS, 4 * KEY_NTILES, 4 * DIM_NTILES
    Q_SCALE = np.float32(math.log2(math.e) / math.sqrt(head_dim))
    NEG_INF, ZERO, ONE = np.float32(-np.inf), np.float32(0.0), np.float32(1.0)

    @cuda.jit(device=True, inline="always")
    def load_tile(k_words, v_words, page_table, smem, k_ring, v_ring, stage, first_key, last_key, kv_head):
        """This thread's cp.async share of keys first_key..+KEYS-1 into `stage`: K chunk c of
        row r at chunk position c ^ (r % 8) of its slab's 128-byte row, V as the product pads it.
        Keys past last_key are zero-filled and not read."""
        for i in range(-(-TILE_CHUNKS // THREADS)):
            c = U(cuda.threadIdx.x) + U(i * THREADS)
            if TILE_CHUNKS % THREADS == 0 or c < TILE_CHUNKS:
                row, chunk = c // U(ROW_CHUNKS), c % U(ROW_CHUNKS)
                key = first_key + row
                k_dst = (k_ring + stage * U(K_TILE_WORDS) + (chunk // U(8)) * U(SLAB_WORDS) + row * U(32)
                         + U(4) * ((chunk % U(8)) ^ (row % U(8))))
                v_dst = v_ring + stage * U(V_TILE_WORDS) + row * U(V_ROW_WORDS) + chunk * U(4)
                src, size = U(0), U(0)
                if key <= last_key:
                    page = U(page_table[key // U(PAGE_SIZE)])
                    src = page * U(PAGE_WORDS) + kv_head * U(KV_HEAD_WORDS) + (key % U(PAGE_SIZE)) * U(ROW_WORDS) \
                        + chunk * U(4)
                    size = U(16)
                cp_async_16(smem, k_dst, k_words, src, size)
                cp_async_16(smem, v_dst, v_words, src, size)

    @cuda.jit(device=True, inline="always")
    def load_q(q, m, first_row, head, gid, tid, q_frag):
        """A fragments of Q (pre-scaled, FP16), as the product loads them; rows >= m are zeros."""
        for kk in range(DIM_STEPS):
            for half in range(2):
                row = first_row + gid + U(8 * half)
                for side in range(2):
                    dim = U(16 * kk + 8 * side) + U(2) * tid
                    x0, x1 = ZERO, ZERO
                    if row < m:
                        x0 = q[row, head, dim] * Q_SCALE
                        x1 = q[row, head, dim + U(1)] * Q_SCALE
                    q_frag[4 * kk + half + 2 * side] = float2_to_half2(x0, x1)

    @cuda.jit(device=True, inline="always")
    def scores(smem, k_stage, q_frag, s):
        """s = this warpgroup's Q K^T of the K tile at k_stage (every warp of it calls this)."""
        for i in range(S_REGISTERS):
            s[i] = ZERO
        wgmma_fence()
        for kk in range(DIM_STEPS):
            wgmma_f16(s, KEYS, q_frag[4 * kk], q_frag[4 * kk + 1], q_frag[4 * kk + 2], q_frag[4 * kk + 3],
                      smem, k_stage + U((kk // 4) * SLAB_WORDS + 8 * (kk % 4)))
        wgmma_commit_group()
        wgmma_wait_group(0)

    @cuda.jit(device=True, inline="always")
    def weights(s, first_key, position, gid, tid, max_lo, max_hi):
        """The product's online softmax step on this lane's two rows: s becomes exp2(s - new max)
        (causally masked); returns the rescaling of the old state, the new maxima and s's row sums."""
        if first_key + U(KEYS - 1) > position:  # the tile reaches past some row's position
            for j in range(KEY_NTILES):
                for e in range(4):
                    key = first_key + U(8 * j + e % 2) + U(2) * tid
                    if key > position + gid + U(8 * (e // 2)):
                        s[4 * j + e] = NEG_INF
        tile_lo, tile_hi = NEG_INF, NEG_INF
        for j in range(KEY_NTILES):
            tile_lo = max(tile_lo, max(s[4 * j], s[4 * j + 1]))
            tile_hi = max(tile_hi, max(s[4 * j + 2], s[4 * j + 3]))
        for mask in (1, 2):  # the 4 lanes of a quad hold one row's columns
            tile_lo = max(tile_lo, shfl_xor(tile_lo, mask))
            tile_hi = max(tile_hi, shfl_xor(tile_hi, mask))
        # A row below a tile's keys has max -inf: exp2 relative to 0 then, so that its weights and
        # rescaling are 0, not NaN.
        new_lo, new_hi = max(max_lo, tile_lo), max(max_hi, tile_hi)
        ref_lo = new_lo if new_lo != NEG_INF else ZERO
        ref_hi = new_hi if new_hi != NEG_INF else ZERO
        sum_lo, sum_hi = ZERO, ZERO
        for j in range(KEY_NTILES):
            s[4 * j] = math.exp2(s[4 * j] - ref_lo)
            s[4 * j + 1] = math.exp2(s[4 * j + 1] - ref_lo)
            s[4 * j + 2] = math.exp2(s[4 * j + 2] - ref_hi)
            s[4 * j + 3] = math.exp2(s[4 * j + 3] - ref_hi)
            sum_lo += s[4 * j] + s[4 * j + 1]
            sum_hi += s[4 * j + 2] + s[4 * j + 3]
        return math.exp2(max_lo - ref_lo), math.exp2(max_hi - ref_hi), new_lo, new_hi, sum_lo, sum_hi

    @cuda.jit(device=True, inline="always")
    def half_bits(x):
        """The FP16 bits of float32 x (round to nearest), for a 16-bit store."""
        return uint16(float2_to_half2(x, ZERO) & U(0xFFFF))

    @cuda.jit(device=True, inline="always")
    def block_setup(smem, row_count, start_position):
        """(k ring, m, first row, last key, key tiles, kv head, warp, lane, gid, tid, real, head,
        position of the block's row 0): the K ring at the first 1024-byte boundary of the dynamic
        shared memory."""
        k_ring = (U(SWIZZLE_ATOM_BYTES) - shared_byte_address(smem, U(0)) % U(SWIZZLE_ATOM_BYTES)) \
            % U(SWIZZLE_ATOM_BYTES) // U(4)
        m, start = U(row_count[0]), U(start_position[0])
        first_row = U(cuda.gridDim.x - 1 - cuda.blockIdx.x) * U(QUERY_ROWS)  # longest blocks first
        last_key = start + min(first_row + U(QUERY_ROWS), m) - U(1)
        kv_head = U(cuda.blockIdx.y)
        warp, lane = U(cuda.threadIdx.x) // U(32), U(cuda.threadIdx.x) % U(32)
        real = warp < U(GROUP)  # the warps past the group only help their warpgroup's wgmmas
        head = kv_head * U(GROUP) + min(warp, U(GROUP - 1))
        return (k_ring, m, first_row, last_key, last_key // U(KEYS) + U(1), kv_head, warp, lane, lane // U(4),
                lane % U(4), real, head, start + first_row)

    @cuda.jit(device=True, inline="always")
    def next_tile(k_words, v_words, page_table, smem, k_ring, v_ring, kt, key_tiles, last_key, kv_head):
        """Wait for tile kt, publish it (and free tile kt - 1's stage), issue tile kt + 1."""
        cp_async_wait_group(0)
        fence_proxy_async_shared()  # this thread's copies of tile kt, visible to the tensor cores
        cuda.syncthreads()
        if kt + U(1) < key_tiles:
            load_tile(k_words, v_words, page_table, smem, k_ring, v_ring, (kt + U(1)) % U(STAGES),
                      (kt + U(1)) * U(KEYS), last_key, kv_head)
        cp_async_commit_group()

    @cuda.jit(**({} if SIMULATOR else {"max_registers": max_registers}))  # the simulator takes no such option
    def prefill_attention_wgmma_qk(q, k_words, v_words, page_table, start_position, row_count, out_words):
        smem = cuda.shared.array(0, types.uint32)
        (k_ring, m, first_row, last_key, key_tiles, kv_head, warp, lane, gid, tid, real, head,
         position) = block_setup(smem, row_count, start_position)
        if first_row >= m:
            return
        v_ring = k_ring + U(STAGES * K_TILE_WORDS)
        load_tile(k_words, v_words, page_table, smem, k_ring, v_ring, U(0), U(0), last_key, kv_head)
        cp_async_commit_group()
        q_frag = cuda.local.array(Q_REGISTERS, types.uint32)
        load_q(q, m, first_row, head, gid, tid, q_frag)
        o = cuda.local.array(O_REGISTERS, types.float32)  # c0, c1 row gid; c2, c3 row gid + 8
        for i in range(O_REGISTERS):
            o[i] = ZERO
        sum_lo, sum_hi, max_lo, max_hi = ZERO, ZERO, NEG_INF, NEG_INF
        s = cuda.local.array(S_REGISTERS, types.float32)

        for kt in range(key_tiles):
            next_tile(k_words, v_words, page_table, smem, k_ring, v_ring, kt, key_tiles, last_key, kv_head)
            stage = kt % U(STAGES)
            first_key = kt * U(KEYS)
            if first_key > position + U(QUERY_ROWS - 1):  # wholly in every row's future (the same in every warp)
                continue
            scores(smem, k_ring + stage * U(K_TILE_WORDS), q_frag, s)
            if not real:
                continue
            scale_lo, scale_hi, max_lo, max_hi, tile_lo, tile_hi = weights(s, first_key, position, gid, tid,
                                                                           max_lo, max_hi)
            sum_lo, sum_hi = sum_lo * scale_lo + tile_lo, sum_hi * scale_hi + tile_hi
            for j in range(DIM_NTILES):
                o[4 * j] *= scale_lo
                o[4 * j + 1] *= scale_lo
                o[4 * j + 2] *= scale_hi
                o[4 * j + 3] *= scale_hi
            # O += P V, as the product: S n tiles 2 ks, 2 ks + 1 are the A fragment of key step ks.
            base = v_ring + stage * U(V_TILE_WORDS)
            for ks in range(KEY_STEPS):
                p = 8 * ks
                a0 = float2_to_half2(s[p], s[p + 1])
                a1 = float2_to_half2(s[p + 2], s[p + 3])
                a2 = float2_to_half2(s[p + 4], s[p + 5])
                a3 = float2_to_half2(s[p + 6], s[p + 7])
                for jp in range(DIM_NTILES // 2):
                    b0, b1, b2, b3 = ldmatrix_x4_trans(
                        smem, base + (U(16 * ks) + U(8) * ((lane // U(8)) % U(2)) + lane % U(8)) * U(V_ROW_WORDS)
                        + U(8 * jp) + U(4) * (lane // U(16)))
                    at = 8 * jp
                    o[at], o[at + 1], o[at + 2], o[at + 3] = mma_m16n8k16(
                        a0, a1, a2, a3, b0, b1, o[at], o[at + 1], o[at + 2], o[at + 3])
                    o[at + 4], o[at + 5], o[at + 6], o[at + 7] = mma_m16n8k16(
                        a0, a1, a2, a3, b2, b3, o[at + 4], o[at + 5], o[at + 6], o[at + 7])
        cp_async_wait_group(0)  # the last (empty) group: nothing of this block is left in flight

        if real:
            for mask in (1, 2):
                sum_lo += shfl_xor(sum_lo, mask)
                sum_hi += shfl_xor(sum_hi, mask)
            for half in range(2):
                row = first_row + gid + U(8 * half)
                if row < m:
                    inverse = divide(ONE, sum_lo if half == 0 else sum_hi)  # no call: call_free.py
                    at = row * U(OUT_ROW_WORDS) + head * U(ROW_WORDS) + tid
                    for j in range(DIM_NTILES):
                        out_words[at + U(4 * j)] = float2_to_half2(o[4 * j + 2 * half] * inverse,
                                                                   o[4 * j + 2 * half + 1] * inverse)

    @cuda.jit(**({} if SIMULATOR else {"max_registers": max_registers}))
    def prefill_attention_wgmma(q, k_words, v_words, page_table, start_position, row_count, out_halves):
        """P V on wgmma as well: O^T (dims x the warpgroup's 64 query rows) += V^T P^T, A = V^T
        from the V tile through ldmatrix.trans, B = P^T from a swizzled P tile each warp writes."""
        smem = cuda.shared.array(0, types.uint32)
        floats = cuda.shared.array(0, types.float32)  # the same memory: the row scales and sums
        (k_ring, m, first_row, last_key, key_tiles, kv_head, warp, lane, gid, tid, real, head,
         position) = block_setup(smem, row_count, start_position)
        if first_row >= m:
            return
        group, slot = warp // U(4), warp % U(4)  # warpgroup; the warp's 16 rows of P, its 16 dims of each half
        p_tile = k_ring + U(STAGES * K_TILE_WORDS) + group * U(P_TILE_WORDS)  # 1024-byte aligned
        v_ring = k_ring + U(STAGES * K_TILE_WORDS + WARPS // 4 * P_TILE_WORDS)
        exchange = v_ring + U(STAGES * V_TILE_WORDS) + group * U(64)  # 64 floats: one a row of P
        row_lo = slot * U(16) + gid  # this lane's rows of P (and of S): row_lo, row_lo + 8
        load_tile(k_words, v_words, page_table, smem, k_ring, v_ring, U(0), U(0), last_key, kv_head)
        cp_async_commit_group()
        q_frag = cuda.local.array(Q_REGISTERS, types.uint32)
        load_q(q, m, first_row, head, gid, tid, q_frag)
        o0 = cuda.local.array(32, types.float32)  # O^T dims 16 slot + gid (+ 8) of half 0, columns 8i + 2 tid + e
        o1 = cuda.local.array(32, types.float32)  # ... of half 1 (head_dim 128)
        for i in range(32):
            o0[i] = ZERO
            o1[i] = ZERO
        sum_lo, sum_hi, max_lo, max_hi = ZERO, ZERO, NEG_INF, NEG_INF
        s = cuda.local.array(S_REGISTERS, types.float32)

        for kt in range(key_tiles):
            next_tile(k_words, v_words, page_table, smem, k_ring, v_ring, kt, key_tiles, last_key, kv_head)
            stage = kt % U(STAGES)
            first_key = kt * U(KEYS)
            if first_key > position + U(QUERY_ROWS - 1):
                continue
            scores(smem, k_ring + stage * U(K_TILE_WORDS), q_frag, s)
            scale_lo, scale_hi = ONE, ONE
            if real:
                scale_lo, scale_hi, max_lo, max_hi, tile_lo, tile_hi = weights(s, first_key, position, gid, tid,
                                                                               max_lo, max_hi)
                sum_lo, sum_hi = sum_lo * scale_lo + tile_lo, sum_hi * scale_hi + tile_hi
            else:  # a padding warp's rows of P are zeros: its columns of O^T stay 0 and are never stored
                for i in range(S_REGISTERS):
                    s[i] = ZERO
            # P (FP16) into the warpgroup's tile: row r's keys 8j..8j+7 are its chunk j, at j ^ (r % 8).
            for j in range(KEY_NTILES):
                for half in range(2):
                    r = row_lo + U(8 * half)
                    smem[p_tile + r * U(32) + U(4) * (U(j) ^ (r % U(8))) + tid] = float2_to_half2(
                        s[4 * j + 2 * half], s[4 * j + 2 * half + 1])
            if tid == U(0):
                floats[exchange + row_lo] = scale_lo
                floats[exchange + row_lo + U(8)] = scale_hi
            fence_proxy_async_shared()  # this thread's P, visible to the tensor cores
            cuda.syncthreads()
            # Column c = 8i + 2 tid + e of O^T is row c of P: rescaled by that row's factor.
            for i in range(8):
                for e in range(2):
                    factor = floats[exchange + U(8 * i + e) + U(2) * tid]
                    o0[4 * i + e] *= factor
                    o0[4 * i + 2 + e] *= factor
                    if DIM_HALVES == 2:
                        o1[4 * i + e] *= factor
                        o1[4 * i + 2 + e] *= factor
            wgmma_fence()
            base = v_ring + stage * U(V_TILE_WORDS)
            for ks in range(KEY_STEPS):
                for dims in range(DIM_HALVES):
                    # V^T rows 64 dims + 16 slot .. +15, keys 16 ks ..: ldmatrix.trans gives the
                    # product's B fragments b0, b1 (dims +0..7) and b2, b3 (dims +8..15), which are
                    # this A's a0, a2 and a1, a3.
                    b0, b1, b2, b3 = ldmatrix_x4_trans(
                        smem, base + (U(16 * ks) + U(8) * ((lane // U(8)) % U(2)) + lane % U(8)) * U(V_ROW_WORDS)
                        + U(32 * dims) + U(8) * slot + U(4) * (lane // U(16)))
                    if dims == 0:
                        wgmma_f16(o0, 64, b0, b2, b1, b3, smem, p_tile + U(8 * ks))
                    else:
                        wgmma_f16(o1, 64, b0, b2, b1, b3, smem, p_tile + U(8 * ks))
            wgmma_commit_group()
            wgmma_wait_group(0)
        cp_async_wait_group(0)  # the last (empty) group: nothing of this block is left in flight

        # Every row's sum to the lanes that hold its column of O^T, then O / sum stored as FP16.
        for mask in (1, 2):  # a row's sum over its quad's lanes
            sum_lo += shfl_xor(sum_lo, mask)
            sum_hi += shfl_xor(sum_hi, mask)
        cuda.syncthreads()  # every lane has read the last tile's factors
        if tid == U(0):
            floats[exchange + row_lo] = sum_lo if real else ONE
            floats[exchange + row_lo + U(8)] = sum_hi if real else ONE
        cuda.syncthreads()
        for i in range(8):
            for e in range(2):
                column = U(8 * i + e) + U(2) * tid
                owner = group * U(4) + column // U(16)  # the warp whose head this column is
                row = first_row + column % U(16)
                if owner < U(GROUP) and row < m:
                    inverse = divide(ONE, floats[exchange + column])
                    at = row * U(num_heads * head_dim) + (kv_head * U(GROUP) + owner) * U(head_dim) + U(16) * slot + gid
                    out_halves[at] = half_bits(o0[4 * i + e] * inverse)
                    out_halves[at + U(8)] = half_bits(o0[4 * i + 2 + e] * inverse)
                    if DIM_HALVES == 2:
                        out_halves[at + U(64)] = half_bits(o1[4 * i + e] * inverse)
                        out_halves[at + U(72)] = half_bits(o1[4 * i + 2 + e] * inverse)

    return prefill_attention_wgmma if pv_wgmma else prefill_attention_wgmma_qk


def block_threads(num_heads: int, num_kv_heads: int) -> int:
    """Whole warpgroups covering the GQA group's warps (one warp a query head)."""
    group = num_heads // num_kv_heads
    return WARPGROUP * -(-group // 4)


def shared_bytes(num_heads: int, num_kv_heads: int, head_dim: int, key_tile: int, pv_wgmma: bool) -> int:
    """The two rings, the slack that aligns the K ring to 1024 bytes, and with P V on wgmma each
    warpgroup's P tile (8 KiB) and 64 floats of row factors (67.0 KiB at 7B and 64 keys without,
    83.5 KiB with: two blocks still share a SM)."""
    rings = STAGES * key_tile * (head_dim * 2 + (head_dim // 2 + 4) * 4) + SWIZZLE_ATOM_BYTES
    return rings + (block_threads(num_heads, num_kv_heads) // WARPGROUP * (64 * ROW_BYTES + 64 * 4) if pv_wgmma
                    else 0)


class WgmmaAttention:
    """launch(...) as the product's PrefillAttention.launch, always the whole form; pv_wgmma: P V
    on wgmma too (head_dim 64 or 128)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, key_tile: int = KEY_TILE,
                 max_registers: int = REGISTER_CAP, pv_wgmma: bool = False):
        if head_dim % 64 or key_tile not in KEY_TILES or (pv_wgmma and head_dim > 128):
            raise ValueError(f"head_dim must be a multiple of 64 (the K ring's 128-byte rows; at most 128 with P V "
                             f"on wgmma), got {head_dim}, and the key tile one of {KEY_TILES}, got {key_tile}")
        self.num_heads, self.head_dim = num_heads, head_dim
        self.num_kv_heads = num_kv_heads
        self.pv_wgmma = pv_wgmma
        self.kernel = build(num_heads, num_kv_heads, head_dim, key_tile, max_registers, pv_wgmma)
        self.block = block_threads(num_heads, num_kv_heads)
        self.shared = shared_bytes(num_heads, num_kv_heads, head_dim, key_tile, pv_wgmma)

    def launch(self, stream, q, k_pages, v_pages, page_table, start, m, out) -> None:
        words = np.uint32
        k_words, v_words = k_pages.reshape(k_pages.size).view(words), v_pages.reshape(v_pages.size).view(words)
        row_blocks = -(-q.shape[0] // QUERY_ROWS)
        out_view = out.reshape(out.size).view(np.uint16 if self.pv_wgmma else words)  # 16- or 32-bit stores
        launch(self.kernel, (row_blocks, self.num_kv_heads), self.block, stream,
               (q, k_words, v_words, page_table, start, m, out_view), self.shared, dependent=False)


# --- check and timings (7B shapes, on the GPU) -----------------------------------------------------

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 28, 4, 128


def random_chunk(rng, start: int, m: int, m_cap: int, max_pages: int, shape=(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM)):
    """q [m_cap, heads, d] (rows past m NaN) and K/V pools whose used pages are shuffled and whose
    other slots hold NaN (a key the mask excludes, a slot past the chunk or a wrong page poisons
    the output), as tests/test_attention_prefill_gpu.py builds them; host arrays."""
    num_heads, num_kv_heads, head_dim = shape
    used = -(-(start + m) // PAGE_SIZE)
    pool = used + 3
    k_pages = np.full((pool, num_kv_heads, PAGE_SIZE, head_dim), np.nan, np.float16)
    v_pages = np.full_like(k_pages, np.nan)
    page_table = rng.integers(0, pool, max_pages).astype(np.int32)
    page_table[:used] = rng.permutation(pool)[:used]
    positions = np.arange(start + m)
    pages, slots = page_table[positions // PAGE_SIZE], positions % PAGE_SIZE
    k_pages[pages, :, slots] = rng.standard_normal((start + m, num_kv_heads, head_dim))
    v_pages[pages, :, slots] = rng.standard_normal((start + m, num_kv_heads, head_dim))
    q = np.full((m_cap, num_heads, head_dim), np.nan, np.float32)
    q[:m] = 3.0 * rng.standard_normal((m, num_heads, head_dim))  # a peaked softmax
    return q, k_pages, v_pages, page_table


def expected_and_bound(chunk, start: int, m: int):
    """pynanoqwen.oracles.attention_oracle (float64, its fp16-operand bound) of the chunk's rows."""
    from pynanoqwen.oracles import attention_oracle

    q, k_pages, v_pages, page_table = chunk
    positions = np.arange(start + m)
    pages, slots = page_table[positions // PAGE_SIZE], positions % PAGE_SIZE
    return attention_oracle(q[:m], k_pages[pages, :, slots], v_pages[pages, :, slots], start + np.arange(m),
                            fp16_operands=True)


def device_chunk(chunk, start: int, m: int):
    q, k_pages, v_pages, page_table = chunk
    return [cuda.to_device(a) for a in (q, k_pages, v_pages, page_table, np.array([start], np.int32),
                                        np.array([m], np.int32))]


def check(rng):
    """Every (start, m) and setting against float64, the oracle's own bound (computed once a case)."""
    results = []
    for start, m in ((0, 1), (0, 64), (0, 512), (0, 2048), (2048, 2048), (6144, 2048)):
        chunk = random_chunk(rng, start, m, 2048, 8192 // PAGE_SIZE)
        expected, bound = expected_and_bound(chunk, start, m)
        for key_tile, registers, pv_wgmma in SETTINGS:
            attention = WgmmaAttention(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, key_tile, registers, pv_wgmma)
            out = cuda.to_device(np.full((2048, NUM_HEADS * HEAD_DIM), np.nan, np.float16))
            stream = cuda.stream()
            attention.launch(stream, *device_chunk(chunk, start, m), out)
            stream.synchronize()
            results.append(bound_report(f"prefill attention, wgmma Q K^T{' and P V' if pv_wgmma else ''}, {key_tile} "
                                        f"keys a tile, {registers} registers, start {start}, m {m}",
                                        np.abs(out.copy_to_host()[:m].astype(np.float64) - expected), bound))
    return results


def timings() -> list[dict]:
    """us a layer of one chunk (10 launches in a graph) and TFLOP/s: the product's whole kernel
    and this one."""
    from pynanoqwen.gpu_timing import time_graph

    product = make_prefill_attention(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, 32768 // PAGE_SIZE, split_rows=0)
    variants = {f"wgmma Q K^T{' + P V' if pv else ''}, {keys} keys, {registers} registers":
                WgmmaAttention(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, keys, registers, pv) for keys, registers, pv in SETTINGS}
    rows = []
    for start, m in ((0, 512), (0, 2048), (6144, 2048), (29952, 2048)):
        chunk = device_chunk(random_chunk(np.random.default_rng(start + m), start, m, 2048, 32768 // PAGE_SIZE),
                             start, m)
        out = cuda.to_device(np.zeros((2048, NUM_HEADS * HEAD_DIM), np.float16))
        row = {"chunk": f"rows {start}..{start + m - 1}"}
        for name, attention in {"product": product, **variants}.items():
            stream = cuda.stream()
            us = 1e6 * time_graph(stream, lambda: [attention.launch(stream, *chunk, out) for _ in range(10)]) / 10
            row[f"{name} us"] = us
            row[f"{name} TFLOP/s"] = attention_flops(start, m, NUM_HEADS, HEAD_DIM) / us / 1e6
        rows.append(row)
    return rows


def compile_targets() -> list[CompileTarget]:
    """The variant at the 7B shape, both key tiles and both forms (sm_90a: wgmma), for
    tests/test_dev_variants.py."""
    words, ints = types.uint32[::1], types.int32[::1]
    targets = []
    for keys, pv in itertools.product(KEY_TILES, (False, True)):
        out = types.uint16[::1] if pv else words
        signature = types.void(types.float32[:, :, ::1], words, words, ints, ints, ints, out)
        must = ((f"wgmma.mma_async.sync.aligned.m64n{keys}k16.f32.f16.f16", "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16",
                 "fence.proxy.async.shared::cta")
                + (("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16",) if pv
                   else ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",)))
        targets.append(CompileTarget(f"prefill_attention wgmma Q K^T{' + P V' if pv else ''}[28/4x128, {keys} keys]",
                                     build(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, keys, pv_wgmma=pv), signature, must,
                                     cc=(9, 0, "a")))
    return targets


if __name__ == "__main__":
    from harness import run

    run(check, timings, "prefill attention: the product's whole kernel against Q K^T on wgmma (us a layer)")

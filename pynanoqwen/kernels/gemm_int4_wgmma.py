"""INT4 GEMM for prefill on Hopper's warpgroup MMA: out[M, N] = X[M, K] W^T, plus a fused epilogue.

The same function as gemm_int4.py (same operands, epilogues and API, through its factories), on
`wgmma.mma_async` (ptx/wgmma.py) instead of `mma.sync`. mma.sync tops out far below the tensor
cores' rate on Hopper (gemm_int4 reached 270 TFLOP/s at best); wgmma runs asynchronously, so the
warps dequantize the next weights while the tensor cores multiply the current ones.

Roles. wgmma takes A (64 rows) from registers and B from shared memory. The INT4 weights must be
unpacked in registers anyway, so they are A: the product is computed transposed, D = W X^T
[features x tokens], and the epilogue writes out[token, feature]. X (FP16, row-major [M, K]) is B,
"K-major": a token's 64-wide k slab is one 128-byte row, copied in by cp.async 16 bytes at a time
into the 128-byte-swizzled layout the wgmma descriptor reads (chunk c of token row r at chunk
position c ^ (r % 8)), which is also free of bank conflicts for the copies.

Launch shape. grid = (ceil(M / TOKENS), N / COLS), block = 128 x WARPGROUPS threads.
Each warpgroup owns 64 weight rows; the block's X tile (TOKENS tokens) is shared by its
warpgroups. For the fused gate/up projection each warp's 16 rows are 8 gate rows (fragment rows
0-7) and the up rows of the same 8 output columns (rows 8-15), so lane (g, t) holds gate and up of
column g side by side (acc[4i + e] and acc[4i + 2 + e]) and applies silu(g) * u in registers.

Fragments. Lane (g, t) of warp w needs, for k step j (16 wide) of a 64-wide k tile, A[16w+g, 16j +
2t .. +1] and A[16w+g, 16j + 8 + 2t .. +1] (and the same of row 16w+g+8): pair t of packed words 2j
and 2j+1 of its weight row (a word holds 8 consecutive k). So each lane reads its two weight rows'
32 bytes per k tile from shared memory (two ld.shared.v4 per row; the four lanes of a row read the
same address, a broadcast) and unpacks one pair per word: prmt (bytes 0-1 or 2-3 by t), AND (low or
high nibbles by t's parity), fma (offset removal, exact), fma (times the group scale, the one
rounding): 4 instructions per pair, 64 per lane per k tile, against 4 wgmma of 64 x TOKENS x 16.

Pipeline. Shared memory holds STAGES k tiles (X tile TOKENS x 128 bytes, then the weight tile
64 WARPGROUPS x 32 bytes), dynamic shared memory aligned up to 1024 bytes. In k tile kt a thread
waits for its copies of tile kt (cp.async.wait_group), makes them visible to the tensor cores
(fence.proxy.async), passes the barrier, refills the stage of tile kt - 2 (every warpgroup has
waited for that tile's wgmmas: wait_group(1) in tile kt - 1), unpacks tile kt's weights, issues its
4 wgmmas as one group, and waits until only that group is in flight. So tile kt's wgmmas run while
tile kt + 1's weights are unpacked. The k loop is unrolled by two (one 128-wide scale group): even
and odd tiles unpack into different registers, which the in-flight wgmma of the previous tile still
reads.

Epilogues as in gemm_int4.py: `plain`, `bias` (QKV), `residual` (out += XW^T into the float32
residual), `gate_up_silu` (float16 out). Rows of X past M are
zero-filled by the copies; only the epilogue checks tokens.

K chunks. At a few tokens a block is latency-bound: one warpgroup's chain of copy, unpack and 4
dependent wgmmas takes ~0.3 us a k tile whatever the ring's depth (6, 10 or 20 stages: down_proj
89-95 us at 1-64 tokens, docs/PERFORMANCE.md), and o_proj and down_proj have only 56 blocks of 64
weight rows for 132 SMs, qkv 72. More blocks need K split between them, and a split changes the
order of the float32 sums, while the prefix cache needs a row's bits to be the same in whatever
chunk of the prompt computes it. So a linear's K is summed the same way at every M: in `chunks`
fixed chunks of whole scale groups (gemm_int4_tiles.k_chunks), each chunk's wgmmas accumulating
from zero, and the chunk sums added left to right in float32, total = ((c0 + c1) + c2) + c3,
before the epilogue. The product sums a long K (down_proj's 18944) in 4 chunks and a short one
in one (gemm_int4_tiles.k_chunks: measured on the H100 and H200, docs/PERFORMANCE.md, "K chunks
measured"); the simulator checks both forms' bits (tests/sim/test_gemm_sim.py). Two forms give those bits:
- sequential (grid z = 1): a block runs every chunk, adding each chunk's accumulators into its
  total registers after a wait for its wgmmas (ACCUMULATORS more registers: ptxas 213 at WG2_T128
  against 147 in one chunk; a 256-token tile has no room, so those sum K in one chunk);
- split (grid z = chunks, the few-token tiles only, has_split_form): block z runs chunk z and
  publishes its sums to a SplitWorkspace; the tile's last block to arrive (threadfence, atomic
  counter, threadfence, as decode attention's merge) reads the chunk sums through L2 and adds
  them in chunk order, then runs the epilogue and resets the counter. The order of arrival
  changes nothing: the adds are the sequential form's, in its order.
The launcher (gemm_int4.GemmTiling) takes the split form where it is given a SplitWorkspace and
the tiles alone would leave SMs idle.

Cost per 64-wide k tile. A block does 2 x 64 WARPGROUPS x TOKENS x 64 FLOP and copies TOKENS x 128
bytes of X and 64 WARPGROUPS x 32 bytes of W from L2: WG1_T128 (64 x 128) 1.05 MFLOP for 18 KiB,
WG2_T128 2.1 MFLOP for 20 KiB, WG2_T256 4.2 MFLOP for 36 KiB. A warp issues 64 ALU instructions
(the unpack), 4 ld.shared.v4 and 4 wgmma (8 at 256 tokens). Registers (ptxas): 122-158 at 128
tokens, 218 at 256; no spills.

The measured TFLOP/s of every tile at the 7B shapes, against the ~790 the H200 reaches in bf16
through cuBLAS and the mma.sync kernel's best, are bench's GEMM table in docs/PERFORMANCE.md.
Why the best tile stays near 60% (docs/PERFORMANCE.md, "Prefill, 2026-12-03"): Nsight Compute
on WG2_T256 at gate_up, M = 2048, counted ~309 executed instructions per warp and k tile, four
times the count above, issued at 1.23 a cycle by the 8 warps a SM that 236 registers and 148 KiB
of shared memory allow. Issuing them takes about twice the 1024 cycles the tensor cores need for
the tile (tensor pipe 50% busy), while L2 (38%) and DRAM (3%) are far from their limits. About
half of the k loop's PTX was the copies' index arithmetic, which `copy_plan` now does once per
thread (2-19% faster a tile, docs/PERFORMANCE.md, "Prefill, 2026-12-03 evening").
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
from numba import cuda, float32, uint32

from ..config import GROUP_SIZE
from ..ptx.half2 import fma_f16x2
from ..ptx.loads import ld_global_cg_f32
from ..ptx.mma import cp_async_16, cp_async_commit_group, cp_async_wait_group, ld_shared_v4_u32
from ..ptx.wgmma import SHAPES_N, SWIZZLE_ATOM_BYTES, WARPGROUP, fence_proxy_async_shared, shared_byte_address, \
    wgmma_commit_group, wgmma_f16, wgmma_fence, wgmma_wait_group
from .call_free import silu
from .int4_unpack import HIGH_NIBBLES, LOW_NIBBLES, MINUS_72, MINUS_1032, ONE, ONE_SIXTEENTH, SELECT_BYTES_0_1, \
    SELECT_BYTES_2_3, unpack_pair

U = np.uint32  # unsigned index arithmetic: no negative-index checks (see gemv_int4.py)

K_TILE = 64  # k per pipeline stage: one 128-byte swizzle row per token, 4 wgmma k steps
X_ROW_WORDS = K_TILE // 2  # words of one token's k slab in a stage (128 bytes)
W_ROW_WORDS = K_TILE // 8  # packed words of one weight row in a stage (32 bytes)
TILES_PER_GROUP = GROUP_SIZE // K_TILE  # 2: the k loop is unrolled by this
ROWS_PER_WARPGROUP = 64
TOKEN_TILES = SHAPES_N + (256,)  # 256 tokens: two n128 wgmmas per k step
SHARED_LIMIT = 227 * 1024  # a block's dynamic shared memory on sm_90 (after cudaFuncSetAttribute)
NO_TOKEN = U(0xFFFFFFFF)  # an accumulator entry of a padding token: no output word


class GemmTile:
    """What the tiles of both GEMM kernels share (this one's WgmmaTile, gemm_int4_tiles.TileShape):
    `fits`, from the tile's own `check(matrices)` and `block_n`."""

    def fits(self, n: int, k: int, matrices: int) -> bool:
        """Whether this tile can compute an N x K linear (of `matrices` weight matrices)."""
        try:
            self.check(matrices)
        except ValueError:
            return False
        return n % (self.block_n // matrices) == 0 and k % GROUP_SIZE == 0


@dataclasses.dataclass(frozen=True)
class WgmmaTile(GemmTile):
    """A block's tile: 64 WARPGROUPS weight rows (all matrices together) x TOKENS activation rows,
    STAGES 64-wide k tiles in flight."""

    warpgroups: int
    tokens: int
    stages: int = 4
    # Where a K chunk's running total lives (the K chunks paragraph): registers, 128 more a thread,
    # which a 256-token tile does not have; gemm_int4_tma's tiles keep it in a workspace.
    chunk_totals_in_registers = True

    @property
    def block_m(self) -> int:  # activation rows per block (gemm_int4's launcher speaks in these)
        return self.tokens

    @property
    def block_n(self) -> int:  # weight rows per block
        return ROWS_PER_WARPGROUP * self.warpgroups

    @property
    def threads(self) -> int:
        return WARPGROUP * self.warpgroups

    @property
    def stage_bytes(self) -> int:
        return self.tokens * 4 * X_ROW_WORDS + self.block_n * 4 * W_ROW_WORDS

    @property
    def dynamic_shared_bytes(self) -> int:
        return self.stages * self.stage_bytes + SWIZZLE_ATOM_BYTES  # + slack to align the ring

    def check(self, matrices: int) -> None:
        if self.tokens not in TOKEN_TILES or self.warpgroups not in (1, 2) or not 3 <= self.stages \
                or self.dynamic_shared_bytes > SHARED_LIMIT or matrices not in (1, 2):
            raise ValueError(f"{self}: token tiles are {TOKEN_TILES}, 1 or 2 warpgroups, >= 3 stages within "
                             f"{SHARED_LIMIT} bytes of shared memory")


def check_chunks(k: int, tiles: WgmmaTile, epilogue: str, chunks: int) -> None:
    """Raise ValueError unless K splits into `chunks` chunks of whole scale groups that this tile
    and epilogue can sum (the K chunks paragraph: not gate/up, and a 256-token tile only where its
    totals live in memory, as gemm_int4_tma's do)."""
    if not 1 <= chunks <= k // GROUP_SIZE:
        raise ValueError(f"K={k} cannot be summed in {chunks} chunks of whole {GROUP_SIZE}-wide groups")
    if chunks > 1 and (epilogue == "gate_up_silu"
                       or tiles.tokens > SHAPES_N[-1] and tiles.chunk_totals_in_registers):
        raise ValueError(f"{tiles} with the {epilogue} epilogue sums K in one chunk (a chunk total would need "
                         "registers it does not have)")


def has_split_form(tiles, chunks: int) -> bool:
    """Whether the kernel for these tiles and K chunks compiles the split form: the few-token tiles
    only. Its code costs the 128-token tiles ~40 registers (ptxas: 254 instead of 213 at WG2_T128),
    and they serve prompts long enough to fill the SMs without it."""
    return chunks > 1 and isinstance(tiles, WgmmaTile) and tiles.tokens == SHAPES_N[0]


@cuda.jit(device=True, inline="always")
def dequantize_pair(word, selector, mask, multiplier, offset, scale):
    """One lane's pair of a packed word (pair t: weights 2t, 2t+1, int4_unpack.py) times the half2 scale."""
    return fma_f16x2(unpack_pair(word, selector, mask, multiplier, offset), scale, U(0))


@cuda.jit(device=True, inline="always")
def unpack_fragments(tile, word_a, word_b, unpack, scale_a, scale_b, a):
    """This lane's A fragments of one 64-wide k tile into a[0..15]: its pair of each of the 8 words
    of its two weight rows, g (at shared word word_a) and g + 8 (at word_b: 8 rows on here, the up
    row in the TMA kernel's gate/up stage), times their scales (the Fragments paragraph)."""
    selector, mask, multiplier, offset = unpack
    a0, a1, a2, a3 = ld_shared_v4_u32(tile, word_a)  # row g: k 0..31
    a4, a5, a6, a7 = ld_shared_v4_u32(tile, word_a + U(4))  # row g: k 32..63
    b0, b1, b2, b3 = ld_shared_v4_u32(tile, word_b)  # row g + 8
    b4, b5, b6, b7 = ld_shared_v4_u32(tile, word_b + U(4))
    row_a = (a0, a1, a2, a3, a4, a5, a6, a7)
    row_b = (b0, b1, b2, b3, b4, b5, b6, b7)
    for j in range(4):  # k step j: words 2j (k 16j..16j+7) and 2j+1 (k 16j+8..16j+15)
        a[4 * j] = dequantize_pair(row_a[2 * j], selector, mask, multiplier, offset, scale_a)
        a[4 * j + 1] = dequantize_pair(row_b[2 * j], selector, mask, multiplier, offset, scale_b)
        a[4 * j + 2] = dequantize_pair(row_a[2 * j + 1], selector, mask, multiplier, offset, scale_a)
        a[4 * j + 3] = dequantize_pair(row_b[2 * j + 1], selector, mask, multiplier, offset, scale_b)


@functools.cache
def tile_multiply(tokens: int):
    """multiply(tile, stage_word, word_a, word_b, unpack, scale_a, scale_b, a, acc, acc_high): this
    lane's weights of the k tile whose X starts at stage_word (rows at word_a and word_b:
    unpack_fragments) into a, then the tile's wgmmas as one group (two n128 a k step at 256 tokens,
    the second into acc_high), then a wait until only that group is in flight: the previous tile's
    wgmmas are done, so its stage and registers are free. Shared by both wgmma kernels."""
    WIDTH = min(tokens, SHAPES_N[-1])
    HALVES = tokens // WIDTH
    HALF_WORDS = WIDTH // 8 * (SWIZZLE_ATOM_BYTES // 4)  # B words of WIDTH token rows

    @cuda.jit(device=True, inline="always")
    def multiply(tile, stage_word, word_a, word_b, unpack, scale_a, scale_b, a, acc, acc_high):
        unpack_fragments(tile, word_a, word_b, unpack, scale_a, scale_b, a)
        wgmma_fence()
        for j in range(4):
            wgmma_f16(acc, WIDTH, a[4 * j], a[4 * j + 1], a[4 * j + 2], a[4 * j + 3], tile, stage_word + U(8 * j))
            if HALVES == 2:  # tokens 128..255 of the tile
                wgmma_f16(acc_high, WIDTH, a[4 * j], a[4 * j + 1], a[4 * j + 2], a[4 * j + 3], tile,
                          stage_word + U(HALF_WORDS + 8 * j))
        wgmma_commit_group()
        wgmma_wait_group(1)

    return multiply


@functools.cache
def tile_epilogue(n: int, tokens: int, epilogue: str):
    """store(out, bias_values, total, acc_high, m, m0, n0, col_a, col_b, t): a lane's accumulators of
    a TOKENS-token tile through the epilogue into out[M, N], padding tokens skipped. total[4i + 2h +
    e] is D[row + 8h, token 8i + 2t + e] of the first WIDTH tokens, acc_high the same of tokens
    WIDTH.. of a 256-token tile; row h = 0 is output column col_a, h = 1 col_b (for gate/up, h = 0
    is the gate and h = 1 the up projection of column col_a). Shared by both wgmma kernels (this
    one and gemm_int4_tma.py), so that their outputs round alike."""
    WIDTH = min(tokens, SHAPES_N[-1])
    HALVES = tokens // WIDTH
    BIAS, RESIDUAL, GATE_UP = epilogue == "bias", epilogue == "residual", epilogue == "gate_up_silu"

    @cuda.jit(device=True, inline="always")
    def store(out, bias_values, total, acc_high, m, m0, n0, col_a, col_b, t):
        for half in range(HALVES):
            for i in range(WIDTH // 8):
                for e in range(2):
                    token = m0 + U(half * WIDTH + 8 * i + e) + U(2) * t
                    if token < m:
                        first = acc_high[4 * i + e] if half else total[4 * i + e]
                        second = acc_high[4 * i + 2 + e] if half else total[4 * i + 2 + e]
                        at = token * U(n) + n0
                        if GATE_UP:  # first is the gate, second the up projection of column col_a
                            out[at + col_a] = silu(first) * second
                        else:
                            if BIAS:
                                first += float32(bias_values[n0 + col_a])
                                second += float32(bias_values[n0 + col_b])
                            if RESIDUAL:
                                out[at + col_a] += first
                                out[at + col_b] += second
                            else:
                                out[at + col_a] = first
                                out[at + col_b] = second

    return store


@functools.cache
def wgmma_gemm_kernel(n: int, k: int, tiles: WgmmaTile, epilogue: str, chunks: int = 1):
    """gemm_int4_wgmma(x, m, q0, s0, q1, s1, bias, out, partials, counters), gemm_int4.gemm_kernel's
    operands, summing K in `chunks` fixed chunks (the K chunks paragraph)."""
    matrices = 2 if epilogue == "gate_up_silu" else 1
    tiles.check(matrices)
    check_chunks(k, tiles, epilogue, chunks)
    CHUNKS = chunks
    SPLIT_FORM = has_split_form(tiles, chunks)
    TOKENS, ROWS, STAGES, THREADS = tiles.tokens, tiles.block_n, tiles.stages, tiles.threads
    COLS = ROWS // matrices  # output columns per block
    if n % COLS or k % GROUP_SIZE:
        raise ValueError(f"N={n} must be a multiple of {COLS} and K={k} of {GROUP_SIZE}")
    # wgmma n: a 256-token tile issues two n128 wgmmas (tile_multiply) into two accumulator arrays
    # (LLVM keeps a 128-float local array in memory, 64 in registers)
    WIDTH = min(TOKENS, SHAPES_N[-1])
    ACCUMULATORS = WIDTH // 2
    X_STAGE_WORDS = TOKENS * X_ROW_WORDS
    STAGE_WORDS = X_STAGE_WORDS + ROWS * W_ROW_WORDS
    X_CHUNKS, W_CHUNKS = TOKENS * X_ROW_WORDS // 4, ROWS * W_ROW_WORDS // 4  # 16-byte copies per stage
    X_COPIES, W_COPIES = -(-X_CHUNKS // THREADS), -(-W_CHUNKS // THREADS)  # of them a thread's
    X_WORDS, W_WORDS, GROUPS = k // 2, k // 8, k // GROUP_SIZE  # words of one X row / W row; scale groups
    AHEAD = STAGES - 2  # tiles in flight beyond the one computed (the stage of kt - 1 may still be read)
    WAIT = STAGES - 3  # copy groups that may stay pending when tile kt must have landed
    GATE_UP = matrices == 2
    multiply_tile, store = tile_multiply(TOKENS), tile_epilogue(n, TOKENS, epilogue)

    @cuda.jit(device=True, inline="always")
    def weight_row(r):
        """(output column within the block, 1 for the up matrix) of the block's weight row r."""
        if GATE_UP:  # warp (r // 16) holds 8 gate rows, then the up rows of the same columns
            return (r // U(16)) * U(8) + r % U(8), (r // U(8)) % U(2)
        return r, U(0)

    @cuda.jit(device=True, inline="always")
    def copy_plan(m, m0, n0, plan):
        """This thread's share of every stage's cp.async copies, worked out once: the source word
        of k tile 0, the destination word in a stage, and for X the bytes to read (0 past M) or
        for W the matrix. A stage's copies differ only by kt * row words in the source, so
        load_stage is one add a copy (the per-stage arithmetic was ~135 of the k loop's ~250 PTX
        instructions a k tile: docs/PERFORMANCE.md, "Prefill, 2026-12-03")."""
        x_src, x_dst, x_bytes, w_src, w_dst, w_up = plan
        tid = U(cuda.threadIdx.x)
        for i in range(X_COPIES):
            c = tid + U(i * THREADS)
            row, chunk = c // U(X_ROW_WORDS // 4), c % U(X_ROW_WORDS // 4)
            inside = m0 + row < m
            src_row = m0 + row if inside else U(0)  # rows >= M: read nothing, write zeros
            x_src[i] = src_row * U(X_WORDS) + chunk * U(4)
            x_dst[i] = row * U(X_ROW_WORDS) + U(4) * (chunk ^ (row % U(8)))
            x_bytes[i] = U(16) if inside else U(0)
        for i in range(W_COPIES):
            r, half = (tid + U(i * THREADS)) // U(2), (tid + U(i * THREADS)) % U(2)
            col, up = weight_row(r)
            w_src[i] = (n0 + col) * U(W_WORDS) + half * U(4)
            w_dst[i] = U(X_STAGE_WORDS) + r * U(W_ROW_WORDS) + half * U(4)
            w_up[i] = up

    @cuda.jit(device=True, inline="always")
    def load_stage(x, q0, q1, tile, stage_word, kt, plan):
        """Issue this thread's cp.async share (copy_plan) of k tile kt into the stage at stage_word."""
        x_src, x_dst, x_bytes, w_src, w_dst, w_up = plan
        tid = U(cuda.threadIdx.x)
        for i in range(X_COPIES):
            if X_CHUNKS % THREADS == 0 or tid + U(i * THREADS) < U(X_CHUNKS):
                cp_async_16(tile, stage_word + x_dst[i], x, x_src[i] + kt * U(X_ROW_WORDS), x_bytes[i])
        for i in range(W_COPIES):
            if W_CHUNKS % THREADS == 0 or tid + U(i * THREADS) < U(W_CHUNKS):
                if w_up[i]:
                    cp_async_16(tile, stage_word + w_dst[i], q1, w_src[i] + kt * U(W_ROW_WORDS), U(16))
                else:
                    cp_async_16(tile, stage_word + w_dst[i], q0, w_src[i] + kt * U(W_ROW_WORDS), U(16))

    @cuda.jit(device=True, inline="always")
    def half2_scale(s0, s1, feature, up, group):
        bits = U(s1[feature * U(GROUPS) + group]) if up else U(s0[feature * U(GROUPS) + group])
        return bits | (bits << U(16))

    @cuda.jit(device=True, inline="always")
    def step(x, q0, q1, tile, ring, kt, kt_end, plan, w_offset, unpack, scale_a, scale_b, a, acc, acc_high):
        """k tile kt of the block's tiles before kt_end: wait, publish, refill, multiply."""
        cp_async_wait_group(WAIT)  # my copies of tile kt have landed...
        fence_proxy_async_shared()  # ...are visible to the tensor cores...
        cuda.syncthreads()  # ...and everyone's are; every warpgroup is done with tile kt - 2's stage
        ahead = kt + U(AHEAD)
        if ahead < kt_end:
            load_stage(x, q0, q1, tile, ring + (ahead % U(STAGES)) * U(STAGE_WORDS), ahead, plan)
        cp_async_commit_group()  # possibly empty: keeps one group per k tile
        stage_word = ring + (kt % U(STAGES)) * U(STAGE_WORDS)
        w_word = stage_word + w_offset
        multiply_tile(tile, stage_word, w_word, w_word + U(8 * W_ROW_WORDS), unpack, scale_a, scale_b, a, acc, acc_high)

    @cuda.jit(device=True, inline="always")
    def chunk_groups(c):
        """The scale groups [first, end) of K chunk c: fixed by K and CHUNKS, whatever the launch."""
        return c * U(GROUPS) // U(CHUNKS), (c + U(1)) * U(GROUPS) // U(CHUNKS)

    @cuda.jit(device=True, inline="always")
    def output_word(i, h, e, m, m0, n0, column, t):
        """Where accumulator entry 4i + 2h + e (D[row + 8h, token 8i + 2t + e]) lands in out[M, N];
        NO_TOKEN for a padding token."""
        token = m0 + U(8 * i + e) + U(2) * t
        return token * U(n) + n0 + column if token < m else NO_TOKEN

    @cuda.jit(device=True, inline="always")
    def total_of_splits(partials, counters, m, m0, n0, col_a, col_b, t, total):
        """Split form: publish this block's chunk sum, count the block in, and in the tile's last
        block to arrive (the others return False) fold every chunk's sum in chunk order into
        total, the sequential form's order. A chunk's sums are gridDim.x TOKENS rows x n words."""
        rows = U(cuda.gridDim.x) * U(TOKENS) * U(n)
        tile_id = U(cuda.blockIdx.y) * U(cuda.gridDim.x) + U(cuda.blockIdx.x)
        z = U(cuda.blockIdx.z)
        for i in range(WIDTH // 8):
            for h in range(2):
                for e in range(2):
                    at = output_word(i, h, e, m, m0, n0, col_b if h else col_a, t)
                    if at != NO_TOKEN:
                        partials[z * rows + at] = total[4 * i + 2 * h + e]
        cuda.threadfence()
        cuda.syncthreads()  # every warpgroup is done with the ring, and every partial is published
        if cuda.threadIdx.x == 0:  # the ring is idle now: its first word carries the verdict to the block
            last = cuda.atomic.add(counters, tile_id, U(1)) == U(CHUNKS - 1)
            cuda.shared.array(0, uint32)[0] = U(1) if last else U(0)
        cuda.syncthreads()
        if cuda.shared.array(0, uint32)[0] == U(0):
            return False
        cuda.threadfence()
        if cuda.threadIdx.x == 0:
            counters[tile_id] = U(0)  # every block of the tile has counted: ready for the next launch
        for i in range(WIDTH // 8):
            for h in range(2):
                for e in range(2):
                    at = output_word(i, h, e, m, m0, n0, col_b if h else col_a, t)
                    if at != NO_TOKEN:
                        value = float32(ld_global_cg_f32(partials, at))
                        for c in range(1, CHUNKS):  # float32 adds (the simulator's loads give Python floats)
                            value = float32(value + ld_global_cg_f32(partials, U(c) * rows + at))
                        total[4 * i + 2 * h + e] = value
        return True

    @cuda.jit
    def gemm_int4_wgmma(x, m, q0, s0, q1, s1, bias_values, out, partials, counters):
        tile = cuda.shared.array(0, uint32)
        a_even = cuda.local.array(16, uint32)  # A fragments of even / odd k tiles: the previous
        a_odd = cuda.local.array(16, uint32)  # tile's wgmma still reads its registers
        acc = cuda.local.array(ACCUMULATORS, float32)
        acc_high = cuda.local.array(ACCUMULATORS, float32)  # tokens 128..255 of a 256-token tile
        total = cuda.local.array(ACCUMULATORS, float32)  # the chunks' sums so far (CHUNKS > 1)
        m = U(m)
        m0 = U(cuda.blockIdx.x) * U(TOKENS)
        n0 = U(cuda.blockIdx.y) * U(COLS)
        tid = U(cuda.threadIdx.x)
        lane = tid % U(32)
        g, t = lane // U(4), lane % U(4)
        row_a = (tid // U(32)) * U(16) + g  # this lane's weight rows in the block: row_a, row_a + 8
        col_a, up_a = weight_row(row_a)
        col_b, up_b = weight_row(row_a + U(8))
        # PAIR_CONSTANTS[t] of int4_unpack, chosen by selects (a runtime tuple index would live in local memory)
        unpack = (SELECT_BYTES_0_1 if t < U(2) else SELECT_BYTES_2_3,
                  LOW_NIBBLES if t % U(2) == U(0) else HIGH_NIBBLES,
                  ONE if t % U(2) == U(0) else ONE_SIXTEENTH,
                  MINUS_1032 if t % U(2) == U(0) else MINUS_72)
        base = shared_byte_address(tile, U(0))
        ring = ((U(SWIZZLE_ATOM_BYTES) - base % U(SWIZZLE_ATOM_BYTES)) % U(SWIZZLE_ATOM_BYTES)) // U(4)
        w_offset = U(X_STAGE_WORDS) + row_a * U(W_ROW_WORDS)
        for c in range(ACCUMULATORS):
            acc[c] = float32(0)
            acc_high[c] = float32(0)

        plan = (cuda.local.array(X_COPIES, uint32), cuda.local.array(X_COPIES, uint32),
                cuda.local.array(X_COPIES, uint32), cuda.local.array(W_COPIES, uint32),
                cuda.local.array(W_COPIES, uint32), cuda.local.array(W_COPIES, uint32))
        copy_plan(m, m0, n0, plan)
        # The sequential form (grid z = 1) runs every chunk; the split form block z chunk z.
        split = SPLIT_FORM and cuda.gridDim.z > 1
        chunk_first = U(cuda.blockIdx.z) if split else U(0)
        chunk_end = chunk_first + U(1) if split else U(CHUNKS)
        group_first, _ = chunk_groups(chunk_first)
        _, group_end = chunk_groups(chunk_end - U(1))
        kt_first, kt_end = group_first * U(TILES_PER_GROUP), group_end * U(TILES_PER_GROUP)
        for s in range(AHEAD):
            if kt_first + U(s) < kt_end:
                load_stage(x, q0, q1, tile, ring + ((kt_first + U(s)) % U(STAGES)) * U(STAGE_WORDS), kt_first + U(s),
                           plan)
            cp_async_commit_group()  # possibly empty: keeps one group per k tile
        next_a = half2_scale(s0, s1, n0 + col_a, up_a, group_first)
        next_b = half2_scale(s0, s1, n0 + col_b, up_b, group_first)
        for chunk in range(chunk_first, chunk_end):
            first, end = chunk_groups(U(chunk))
            for g_index in range(first, end):
                group = U(g_index)
                scale_a, scale_b = next_a, next_b
                if group + U(1) < group_end:  # fetched a group ahead: the loads' latency hides behind it
                    next_a = half2_scale(s0, s1, n0 + col_a, up_a, group + U(1))
                    next_b = half2_scale(s0, s1, n0 + col_b, up_b, group + U(1))
                kt = group * U(TILES_PER_GROUP)
                step(x, q0, q1, tile, ring, kt, kt_end, plan, w_offset, unpack, scale_a, scale_b, a_even, acc,
                     acc_high)
                step(x, q0, q1, tile, ring, kt + U(1), kt_end, plan, w_offset, unpack, scale_a, scale_b, a_odd, acc,
                     acc_high)
            if CHUNKS > 1:  # the chunk's sum joins the total, left to right; the next chunk starts at 0
                wgmma_wait_group(0)
                for c in range(ACCUMULATORS):
                    total[c] = acc[c] if U(chunk) == chunk_first else total[c] + acc[c]
                    acc[c] = float32(0)
        wgmma_wait_group(0)
        if CHUNKS == 1:
            for c in range(ACCUMULATORS):
                total[c] = acc[c]
        elif split and not total_of_splits(partials, counters, m, m0, n0, col_a, col_b, t, total):
            return

        store(out, bias_values, total, acc_high, m, m0, n0, col_a, col_b, t)

    return gemm_int4_wgmma

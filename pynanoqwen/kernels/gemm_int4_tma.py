"""INT4 GEMM for long prompts on wgmma, fed by the Tensor Memory Accelerator: out[M, N] = X W^T plus
gemm_int4's epilogues, with one thread doing all the copying.

The same function, operands, fragments and order of sums as gemm_int4_wgmma.py (read it first);
only the feed differs. There, every thread issues 16-byte cp.async copies of X and W for each k
tile, and a block barrier a k tile publishes them: after copy_plan ~60% of the tensor cores' rate,
bound by instruction issue with two warps a scheduler (Nsight Compute, docs/PERFORMANCE.md,
"Prefill, 2026-12-03"). Here:

- thread 0 issues, for each k tile, two or three `cp.async.bulk.tensor.2d` boxes (ptx/tensor_copy.py):
  X's 64 k x TOKENS tokens of FP16, which the tensor map's 128-byte swizzle writes in the layout
  the wgmma descriptor reads, and W's 8 packed words x COLS weight rows (for gate/up a box of the
  gate rows and one of the same rows of up). Rows past M arrive as zeros, as the cp.async kernel's
  zero-filling copies give them;
- the stage's `full` mbarrier (one arrival, thread 0's expect_tx, plus the boxes' bytes) tells
  every thread that the tile has landed, in both proxies: the ld.shared of W and the wgmma's reads
  of X need no fence;
- each thread arrives on the stage's `empty` mbarrier once wgmma_wait_group(1) in the next k tile
  has seen the tile's wgmmas done (its W words were in registers before they were issued);
- thread 0 fills between its own k tiles: at tile kt it refills the stage of tile kt - 2 with tile
  kt + STAGES - 2, waiting for every thread's release of that stage. The other warps can trail it
  by a tile before it waits for them. A producer warp of its own instead made the block 9 warps,
  three on one scheduler, and ptxas then has 168 registers a thread: the 256-token tile spilled and
  its launch failed (dev/gemm_wgmma_tma.py keeps that form and the others measured).

No block barrier in the k loop, and no address arithmetic for copies in 255 of the 256 threads.
Each k tile a lane does what the cp.async kernel's does, in the same order: unpack its two rows'
pairs (unpack_fragments, the gate/up rows COLS rows apart in the stage), fence, the tile's wgmmas
as one group, wait for the previous group; the same epilogue (tile_epilogue). So an output has the
cp.async kernel's bits on a tile of the same K chunks: the engine's prefix cache needs a row's
bits to be the same at every M (gemm_int4_tiles.rows_sum_alike).

K chunks. A long K (down_proj's 18944 at 7B) is summed in 4 fixed chunks at every M
(gemm_int4_tiles.k_chunks), and the cp.async kernel keeps the running total in registers, 128
more a thread, which a 256-token tile does not have. Here it lives in a workspace (`totals`, one
float32 word per output of every block's tile, 29 MB for 2048 rows of down_proj): after chunk 0
each thread stores its sums, after each middle chunk adds its sums to what it stored, and after
the last adds the stored total to its sums, ((c0 + c1) + c2) + c3, the cp.async kernel's order
and so its bits. Each word is read back only by the thread that wrote it. A call moves ~170 MB
through the L2 for it at 2048 rows (3 stores and 3 loads a word): predicted ~15-20 us, against the
~146 us the 256-token tile saved over the 128-token one at down_proj (462.7 against 609.7 us on
an H100, one chunk). Measured there: 516.0 against WG2_T128's 614.1 us, so the folds cost ~53 us
(each chunk end also drains the wgmma pipe; docs/PERFORMANCE.md, "2026-12-06, late night"), when
a middle fold still loaded, added and stored one word at a time; it now moves 16-byte quads and
loads four before it stores (`fold`), which took 509.1 us: the word-at-a-time folds were not the
cost (docs/PERFORMANCE.md, "2026-12-06, night"). The launcher gets the workspace from its caller (the engine's
gemm_int4.SplitWorkspace) or makes its own at the first launch of an M that needs more.

Tensor maps (ptx/tensor_copy.py). W's maps are made once per GEMM object; X's per (buffer, M),
because a map holds the address and the row count: `TensorMaps` keeps them. Making one copies 128
bytes to the device synchronously, which a stream being captured forbids, so the first launch of a
(buffer, M) must be eager; the engine runs each prefill bucket's launches once before capturing
them (engine/capture.py), and bench's timings warm up before capture (gpu_timing.time_graph).

Launch shape: grid (ceil(M / TOKENS), N / COLS), 128 x WARPGROUPS threads, STAGES x the stage
(TOKENS x 128 bytes of X, then the W rows' 32 bytes each) + 1 KiB of alignment slack of dynamic
shared memory, and 2 x STAGES mbarriers.

Should reach: at a 128 x 256 tile the tensor pipe's rate less the unpack's issue, ~75% of the
tensor cores' peak (the issue count: 311 PTX instructions for two k tiles of gate_up at 128
tokens against 347 with cp.async). Reached on an H100 (dev/gemm_wgmma_tma.py, bench's GEMM
table): 612 TFLOP/s at gate_up with 2048 tokens (909 us against the cp.async tile's 1096), TTFT
-5% at 512 and -7% at 2048 and 4096 tokens; docs/PERFORMANCE.md has the figures.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
from numba import cuda, float32, types, uint32, uint64

from ..config import GROUP_SIZE
from ..ptx import SIMULATOR
from ..ptx.loads import ld_global_cg_v4_f32, st_global_v4_f32
from ..ptx.mbarrier import fence_barrier_init, mbarrier_arrive, mbarrier_arrive_expect_tx, mbarrier_init, \
    mbarrier_wait
from ..ptx.tensor_copy import acquire_tensor_map, tensor_copy_2d, tensor_map
from ..ptx.wgmma import SHAPES_N, SWIZZLE_ATOM_BYTES, shared_byte_address, wgmma_wait_group
from .gemm_int4_wgmma import K_TILE, TILES_PER_GROUP, W_ROW_WORDS, X_ROW_WORDS, WgmmaTile, check_chunks, \
    tile_epilogue, tile_multiply
from .int4_unpack import HIGH_NIBBLES, LOW_NIBBLES, MINUS_72, MINUS_1032, ONE, ONE_SIXTEENTH, SELECT_BYTES_0_1, \
    SELECT_BYTES_2_3

U = np.uint32  # unsigned index arithmetic: no negative-index checks (see gemv_int4.py)


@dataclasses.dataclass(frozen=True)
class TmaTile(WgmmaTile):
    """A wgmma tile (64 WARPGROUPS weight rows x TOKENS tokens, STAGES k tiles) computed by this
    module's kernel, which keeps K chunks' running totals in a workspace ("K chunks" above)."""

    chunk_totals_in_registers = False


TMA_T256 = TmaTile(2, 256)  # 128 weight rows x 256 tokens: the one the product uses (gemm_int4_tiles)


@functools.cache
def stage_fill(tiles: WgmmaTile, matrices: int):
    """fill(x_map, w_map0, w_map1, tile, ring, full, empty, kt, m0, n0): k tile kt's boxes (X's, then
    W's COLS rows, then for gate/up the same rows of W1) into stage kt % STAGES of the ring at shared
    word `ring`, once every thread has released that stage's previous fill (`empty`), their bytes
    completing on `full`. Shared with dev/gemm_wgmma_tma.py's other producers."""
    TOKENS, ROWS, STAGES = tiles.tokens, tiles.block_n, tiles.stages
    COLS = ROWS // matrices
    X_STAGE_WORDS = TOKENS * X_ROW_WORDS
    STAGE_WORDS = X_STAGE_WORDS + ROWS * W_ROW_WORDS
    STAGE_BYTES = 4 * STAGE_WORDS  # what a stage's boxes bring, zero-filled rows included
    GATE_UP = matrices == 2

    @cuda.jit(device=True, inline="always")
    def fill(x_map, w_map0, w_map1, tile, ring, full, empty, kt, m0, n0):
        stage = kt % U(STAGES)
        # Fill kt // STAGES of this stage needs the release of the fill before; in the first round
        # parity 1 names the phase before phase 0, which counts as complete.
        mbarrier_wait(empty, stage, ((kt // U(STAGES)) & U(1)) ^ U(1))
        mbarrier_arrive_expect_tx(full, stage, U(STAGE_BYTES))
        word = ring + stage * U(STAGE_WORDS)
        tensor_copy_2d(tile, word, x_map, kt * U(K_TILE), m0, full, stage)
        tensor_copy_2d(tile, word + U(X_STAGE_WORDS), w_map0, kt * U(W_ROW_WORDS), n0, full, stage)
        if GATE_UP:  # the up rows after the gate rows
            tensor_copy_2d(tile, word + U(X_STAGE_WORDS + COLS * W_ROW_WORDS), w_map1, kt * U(W_ROW_WORDS), n0, full,
                           stage)

    return fill


@cuda.jit(device=True, inline="always")
def quad_sums(totals, at, acc, c):
    """totals[at .. at + 3] + acc[c .. c + 3] in float32, the four words in one 16-byte load."""
    t0, t1, t2, t3 = ld_global_cg_v4_f32(totals, at)
    return float32(t0 + acc[c]), float32(t1 + acc[c + 1]), float32(t2 + acc[c + 2]), float32(t3 + acc[c + 3])


@functools.cache
def tma_gemm_kernel(n: int, k: int, tiles: TmaTile, epilogue: str, chunks: int = 1):
    """tma_gemm(x_map, m, w_map0, s0, w_map1, s1, bias, out, totals): out[:m] (+)= X W^T with
    gemm_int4's epilogues, X and W (and up's W1) through their tensor maps (TensorMaps), s* the
    scale bits, K summed in `chunks` fixed chunks whose running total lives in `totals` (float32,
    totals_words(grid, tiles) of them; read by nothing in one chunk)."""
    matrices = 2 if epilogue == "gate_up_silu" else 1
    tiles.check(matrices)
    check_chunks(k, tiles, epilogue, chunks)
    CHUNKS = chunks
    TOKENS, ROWS, STAGES, THREADS = tiles.tokens, tiles.block_n, tiles.stages, tiles.threads
    COLS = ROWS // matrices  # output columns per block
    if n % COLS or k % GROUP_SIZE:
        raise ValueError(f"N={n} must be a multiple of {COLS} and K={k} of {GROUP_SIZE}")
    AHEAD = STAGES - 2  # tiles in flight beyond the one computed (the stage of kt - 1 may still be read)
    WIDTH = min(TOKENS, SHAPES_N[-1])  # wgmma n: a 256-token tile issues two n128 wgmmas
    HALVES = TOKENS // WIDTH
    ACCUMULATORS = WIDTH // 2
    X_STAGE_WORDS = TOKENS * X_ROW_WORDS
    STAGE_WORDS = X_STAGE_WORDS + ROWS * W_ROW_WORDS
    GROUPS, K_TILES = k // GROUP_SIZE, k // K_TILE
    GATE_UP = matrices == 2
    multiply, store, fill = tile_multiply(TOKENS), tile_epilogue(n, TOKENS, epilogue), stage_fill(tiles, matrices)
    QUAD = 4 * THREADS  # words between a thread's consecutive quads of accumulators in `totals`

    @cuda.jit(device=True, inline="always")
    def step(maps, tile, ring, full, empty, kt, m0, n0, word_a, word_b, unpack, scale_a, scale_b, a, acc, acc_high):
        """k tile kt: (thread 0: refill the stage two tiles back with tile kt + AHEAD) wait for its
        boxes, unpack, issue its wgmmas, and release the stage of kt - 1, whose wgmmas
        wait_group(1) has just seen done."""
        if cuda.threadIdx.x == 0 and kt + U(AHEAD) < U(K_TILES):
            fill(maps[0], maps[1], maps[2], tile, ring, full, empty, kt + U(AHEAD), m0, n0)
        stage = kt % U(STAGES)
        mbarrier_wait(full, stage, (kt // U(STAGES)) & U(1))
        word = ring + stage * U(STAGE_WORDS)
        multiply(tile, word, word + word_a, word + word_b, unpack, scale_a, scale_b, a, acc, acc_high)
        if kt > U(0):
            mbarrier_arrive(empty, (kt - U(1)) % U(STAGES))

    @cuda.jit(device=True, inline="always")
    def half2_scale(s0, s1, feature, up, group):
        bits = U(s1[feature * U(GROUPS) + group]) if up else U(s0[feature * U(GROUPS) + group])
        return bits | (bits << U(16))

    @cuda.jit(device=True, inline="always")
    def fold(totals, acc, half, first, last):
        """The end of a K chunk, for one half of the tile's tokens: the first chunk's sums are
        stored, each middle one's added to what is stored, and at the last the stored total is
        added to acc instead: ((c0 + c1) + c2) + c3 in float32, the cp.async kernel's order.
        Accumulators c .. c + 3 of a thread are one 16-byte quad at word (block, half, c, thread)
        x 4: a warp's 32 quads of them are 512 contiguous bytes, and each is read back only by the
        thread that wrote it. A middle fold loads four quads before it stores their sums, so four
        L2 round trips overlap; written a word at a time (load, add, store) the folds cost only
        ~5-7 us a call more at 2048 rows (docs/PERFORMANCE.md). The three cases are three loops,
        not one loop that branches a quad: that form compiled to 255 registers and 280 bytes of
        spills (ptxas, sm_90a)."""
        block = U(cuda.blockIdx.y) * U(cuda.gridDim.x) + U(cuda.blockIdx.x)
        base = (block * U(HALVES) + U(half)) * U(ACCUMULATORS * THREADS) + U(4) * U(cuda.threadIdx.x)
        if first:
            for c in range(0, ACCUMULATORS, 4):
                st_global_v4_f32(totals, base + U(c * THREADS), acc[c], acc[c + 1], acc[c + 2], acc[c + 3])
        elif last:
            for c in range(0, ACCUMULATORS, 4):
                acc[c], acc[c + 1], acc[c + 2], acc[c + 3] = quad_sums(totals, base + U(c * THREADS), acc, c)
        else:
            for c in range(0, ACCUMULATORS, 16):
                at = base + U(c * THREADS)
                sums = (quad_sums(totals, at, acc, c), quad_sums(totals, at + U(QUAD), acc, c + 4),
                        quad_sums(totals, at + U(2 * QUAD), acc, c + 8),
                        quad_sums(totals, at + U(3 * QUAD), acc, c + 12))
                for q in range(4):
                    st_global_v4_f32(totals, at + U(q * QUAD), sums[q][0], sums[q][1], sums[q][2], sums[q][3])
        if not last:
            for c in range(ACCUMULATORS):
                acc[c] = float32(0)

    # .maxntid: ptxas may then give each of the 256 threads up to 255 registers (the 256-token tile
    # takes ~200). The simulator takes no launch bounds.
    @cuda.jit(**({} if SIMULATOR else {"launch_bounds": (THREADS, 1)}))
    def tma_gemm(x_map, m, w_map0, s0, w_map1, s1, bias_values, out, totals):
        tile = cuda.shared.array(0, uint32)
        full = cuda.shared.array(STAGES, uint64)
        empty = cuda.shared.array(STAGES, uint64)
        tid = U(cuda.threadIdx.x)
        m = U(m)
        m0 = U(cuda.blockIdx.x) * U(TOKENS)
        n0 = U(cuda.blockIdx.y) * U(COLS)
        base = shared_byte_address(tile, U(0))
        ring = ((U(SWIZZLE_ATOM_BYTES) - base % U(SWIZZLE_ATOM_BYTES)) % U(SWIZZLE_ATOM_BYTES)) // U(4)
        if tid == U(0):
            for s in range(STAGES):
                mbarrier_init(full, s, 1)  # thread 0's arrive.expect_tx; the boxes add their bytes
                mbarrier_init(empty, s, THREADS)  # every thread, after its wgmma wait
            fence_barrier_init()
            acquire_tensor_map(x_map)
            acquire_tensor_map(w_map0)
            if GATE_UP:
                acquire_tensor_map(w_map1)
        cuda.syncthreads()
        if tid == U(0):
            for kt in range(min(AHEAD, K_TILES)):
                fill(x_map, w_map0, w_map1, tile, ring, full, empty, U(kt), m0, n0)
        maps = (x_map, w_map0, w_map1)

        a_even = cuda.local.array(16, uint32)  # A fragments of even / odd k tiles: the previous
        a_odd = cuda.local.array(16, uint32)  # tile's wgmma still reads its registers
        acc = cuda.local.array(ACCUMULATORS, float32)
        acc_high = cuda.local.array(ACCUMULATORS, float32)  # tokens 128..255 of a 256-token tile
        lane, warp = tid % U(32), tid // U(32)
        g, t = lane // U(4), lane % U(4)
        if GATE_UP:  # warp w: gate columns 8w..8w+7 (fragment rows g), their up rows (g + 8)
            col_a = col_b = warp * U(8) + g
            row_b = U(COLS) + col_a
        else:
            col_a = warp * U(16) + g
            col_b = row_b = col_a + U(8)
        word_a = U(X_STAGE_WORDS) + col_a * U(W_ROW_WORDS)
        word_b = U(X_STAGE_WORDS) + row_b * U(W_ROW_WORDS)
        # PAIR_CONSTANTS[t] of int4_unpack, chosen by selects (a runtime tuple index would live in local memory)
        unpack = (SELECT_BYTES_0_1 if t < U(2) else SELECT_BYTES_2_3,
                  LOW_NIBBLES if t % U(2) == U(0) else HIGH_NIBBLES,
                  ONE if t % U(2) == U(0) else ONE_SIXTEENTH,
                  MINUS_1032 if t % U(2) == U(0) else MINUS_72)
        for c in range(ACCUMULATORS):
            acc[c] = float32(0)
            acc_high[c] = float32(0)
        next_a = half2_scale(s0, s1, n0 + col_a, False, U(0))
        next_b = half2_scale(s0, s1, n0 + col_b, GATE_UP, U(0))
        for chunk in range(CHUNKS):
            for g_index in range(chunk * GROUPS // CHUNKS, (chunk + 1) * GROUPS // CHUNKS):
                group = U(g_index)
                scale_a, scale_b = next_a, next_b
                if group + U(1) < U(GROUPS):  # fetched a group ahead: the loads' latency hides behind it
                    next_a = half2_scale(s0, s1, n0 + col_a, False, group + U(1))
                    next_b = half2_scale(s0, s1, n0 + col_b, GATE_UP, group + U(1))
                kt = group * U(TILES_PER_GROUP)
                step(maps, tile, ring, full, empty, kt, m0, n0, word_a, word_b, unpack, scale_a, scale_b, a_even,
                     acc, acc_high)
                step(maps, tile, ring, full, empty, kt + U(1), m0, n0, word_a, word_b, unpack, scale_a, scale_b,
                     a_odd, acc, acc_high)
            if CHUNKS > 1:  # the chunk's wgmmas done, its sums folded into the total
                wgmma_wait_group(0)
                fold(totals, acc, 0, chunk == 0, chunk == CHUNKS - 1)
                if HALVES == 2:
                    fold(totals, acc_high, 1, chunk == 0, chunk == CHUNKS - 1)
        wgmma_wait_group(0)
        store(out, bias_values, acc, acc_high, m, m0, n0, col_a, col_b, t)

    return tma_gemm


class TensorMaps:
    """The tensor maps of one GEMM object's launches on a TmaTile: its weights' (W and, for gate/up,
    W1: boxes of W_ROW_WORDS words x COLS rows), made here, and X's, made at the first launch of
    each (buffer, M) and kept; and the K chunks' totals where the launch brings no workspace. The
    maps hold addresses: the GEMM object keeps its weights alive, and the caller each x it
    launches with (the engine's prefill buffers live as long as the engine)."""

    def __init__(self, n: int, k: int, tiles: TmaTile, weights: list):
        cols = tiles.block_n // len(weights)
        self.weights = [tensor_map(q.reshape(n, k // 8), W_ROW_WORDS, cols, False) for q in weights]
        self.tiles, self.tokens = tiles, tiles.tokens
        self.x_maps: dict = {}
        self.totals = cuda.device_array(1, np.float32)  # read by no kernel of one K chunk

    def x(self, x, m: int):
        """X's map for rows [0, m) of the float16 [rows, K] buffer x: swizzled 64 k x TOKENS boxes."""
        key = (id(x) if SIMULATOR else x.device_ctypes_pointer.value, m)
        if key not in self.x_maps:
            self.x_maps[key] = tensor_map(x, K_TILE, self.tokens, True, rows=m)
        return self.x_maps[key]

    def chunk_totals(self, grid: tuple[int, int], chunks: int, workspace=None):
        """The float32 words a launch of this grid keeps its K chunks' running totals in
        (totals_words): those of `workspace` (gemm_int4.SplitWorkspace) where it has enough, else
        this object's own, made at the first launch that needs more, as X's maps are."""
        words = totals_words(grid, self.tiles) if chunks > 1 else 1
        if workspace is not None and workspace.partials.size >= words:
            return workspace.partials
        if self.totals.size < words:
            self.totals = cuda.device_array(words, np.float32)
        return self.totals


def tma_signature(out=types.float32):
    """The Numba signature of tma_gemm_kernel's kernels, output float32 or float16."""
    maps, bits = types.uint64[::1], types.uint16[::1]
    return types.void(maps, types.uint32, maps, bits, maps, bits, types.float16[::1], out[::1], types.float32[::1])


def totals_words(grid: tuple[int, int], tiles: TmaTile) -> int:
    """float32 words of the K chunks' running totals a launch of this grid needs: one per output
    of every block's tile, padding tokens included."""
    return grid[0] * grid[1] * tiles.tokens * tiles.block_n


def compile_targets() -> list:
    """The 7B linears on the tile prefill gives this kernel (gemm_int4_tiles.TMA_T256), down_proj in
    its 4 K chunks."""
    from . import CompileTarget

    feed = ("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes",
            "fence.proxy.tensormap::generic.acquire.gpu", "mbarrier.try_wait.parity.shared::cta.b64",
            "mbarrier.arrive.shared::cta.b64", "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16", "prmt.b32")
    targets = []
    for name, n, k, epilogue, out, chunks in (("qkv", 4608, 3584, "bias", types.float32, 1),
                                              ("o_proj", 3584, 3584, "residual", types.float32, 1),
                                              ("gate_up", 18944, 3584, "gate_up_silu", types.float16, 1),
                                              ("down_proj", 3584, 18944, "residual", types.float32, 4)):
        targets.append(CompileTarget(f"gemm_int4_tma_{epilogue}_128x256_k{chunks}[{name} {n}x{k}]",
                                     tma_gemm_kernel(n, k, TMA_T256, epilogue, chunks), tma_signature(out), feed,
                                     cc=(9, 0, "a")))
    return targets

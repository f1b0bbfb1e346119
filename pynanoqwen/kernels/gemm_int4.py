"""INT4 GEMM for prefill on the tensor cores: out[M, N] = X[M, K] W^T, plus a fused epilogue.

X is float16 [M, K] (M = prompt tokens, row-major); W is an INT4 linear in the ValueShuffle
layout of pynanoqwen/quant.py (qweight uint32 [N, K/8], scales float16 [N, K/128]). Prefill of a
512-token prompt through the 7B model is ~7.8 TFLOP: tensor-core work, not the GEMV's
bandwidth problem. The weights are dequantized on the fly, in registers, straight into a tensor-core
operand. Three kernels do it, chosen by the tile shape (gemm_int4_tiles.py, `default_tiles_for`):
- WgmmaTile shapes: Hopper's asynchronous warpgroup MMA (gemm_int4_wgmma.py), for every prompt
  bucket: 350-490 TFLOP/s at the 7B shapes from M = 512 (bench's GEMM table); TmaTile shapes, the
  same kernel fed by TMA (gemm_int4_tma.py), for long prompts: gate_up 627 TFLOP/s at M = 2048 on
  the H100.
- TileShape shapes: `mma.sync.m16n8k16` (FP16 x FP16 -> FP32, ptx/mma.py), Marlin-style, this
  module's kernel, described below: SMALL, for shapes no wgmma tile fits.
  mma.sync does not reach the Hopper tensor cores' rate: its large 128 x 128 tile peaked near 270
  TFLOP/s and lost to wgmma at every 7B shape from M = 64 (docs/PERFORMANCE.md), so it left the
  product for dev/gemm_mma_sync_large.py, with its own check and timing.
All share the API, the operands and the epilogues; the factories below build any of them.

Launch shape (mma.sync). grid = (ceil(M / BLOCK_M), N / COLS), block = 32 * WARPS_M * WARPS_N
threads. Block (i, j) computes rows BLOCK_M*i.. of columns COLS*j..; blocks next to each other in x
share a weight tile, so it comes from DRAM once. Each warp owns a WARP_M x WARP_COLS piece of the
block's output: WARP_M / 16 x WARP_COLS / 8 mma tiles, each lane holding 4 FP32 accumulators per
tile. `SMALL` is 16 x 128 with 4 warps of 16 x 32: 16 accumulators and 8 mma per warp per
32-wide k step. The fused gate/up projection is the same kernel with two weight matrices: a block
reads BLOCK_N / 2 rows of Wg and the same rows of Wu, and each warp's tiles come in pairs (gate, up)
covering the same output columns, so the epilogue finds silu(g) * u in one lane's registers.

The k order is ours to choose. mma sums over k, so any permutation of k that A and B share gives
the same product. Lane (g, t) must hold B[k, n = g] for k = 2t, 2t+1 (b0) and 2t+8, 2t+9 (b1) of
each 16-wide k step, and one packed word holds 8 consecutive k of one weight row, which the prmt
unpack (int4_unpack.unpack8) turns into the half2 pairs (k0, k1), (k2, k3), (k4, k5),
(k6, k7). So over a 32-wide k tile, lane (g, t) takes word t of weight row g: pairs 0, 1 serve as
its b0, b1 of the first mma step and pairs 2, 3 of the second. The A fragment must follow the same
map: lane (g, t) needs X[g, 8t..8t+7] (and row g+8), which is one 16-byte shared-memory load
(`ld.shared.v4`) per row, not an `ldmatrix`. Per 32-wide k tile a lane therefore loads one word
per weight tile, 2 x 16 bytes per activation tile, and unpacks one word into four half2 with
2 prmt + 4 AND + 8 fma.rn.f16x2 (offset removal exact, then one rounding to FP16 when multiplying
by the group scale). The scales of the next 128-wide group are fetched into registers one group
ahead.

Pipeline. Shared memory holds STAGES (4) k tiles: the activation tile BLOCK_M x 32 float16 (64
bytes per row) and the packed weight tile BLOCK_N x 4 words (16 bytes per row), 3 KiB per stage
for SMALL, 12 KiB in all (under the 48 KiB of static shared memory). Every thread issues 16-byte
`cp.async.cg` copies for its share of a stage and commits them as one group; in step kt it waits
until tile kt has landed (wait_group STAGES-2), passes one barrier, which also tells it that every
warp is done with the stage about to be refilled, issues tile kt + STAGES - 1 and computes tile kt.
Activation rows >= M are zero-filled by the copy (src-size 0), so every tile is full and only the
epilogue checks rows. Bank conflicts: none, without a swizzle: each quarter-warp's ld.shared.v4
reads two whole 64-byte activation rows (128 contiguous bytes), and a warp's 32 weight words are 8
whole 16-byte rows.

Epilogues (closure constants, one kernel build each): `plain` out = XW^T; `bias` out = XW^T + b
(QKV, FP16 bias); `residual` out += XW^T (o_proj, down_proj into the float32 residual stream);
`gate_up_silu` out (float16) = silu(X Wg^T) * (X Wu^T). Output float32 or float16 [M, N].

Cost per 32-wide k tile and warp of SMALL: 8 mma, 2 ld.shared.v4 + 4 ld.shared.b32, 4 words
unpacked, ~2 cp.async. Per block and k tile it moves 1 KiB of activations and 2 KiB of weights
from L2. At M <= 16 a block's work is mostly its weight tile, and still the 64-token wgmma tile,
three quarters padding there, takes half its time at qkv, o_proj and down_proj (down_proj 89 against
174 us at 1-16 tokens; gate/up 60 against 55: docs/PERFORMANCE.md, "Prefill GEMM at a few rows"),
and rounds a row as every other wgmma tile does. So SMALL serves only shapes no wgmma tile fits.

K is split between blocks only in the wgmma kernel's fixed chunks (gemm_int4_wgmma.py, "K
chunks"), whose sums are added in chunk order whichever block finishes first. Split-K by atomic
adds into the residual, whose order changes the last bits from run to run, is what no default may
do (dev/gemm_wgmma_split_k.py keeps it for the record).

API (the prefill path builds these once per layer):

    gemm = make_gemm_int4(n, k, qweight, scales, bias=None, out_dtype="float32")
    gemm.launch(stream, x, out, m)                  # out[:m] = x[:m] W^T (+ bias)
    gemm.launch(stream, x, h, m, residual=True)     # h[:m] += x[:m] W^T
    mlp = make_gate_up_silu_gemm(n, k, gate_q, gate_s, up_q, up_s)
    mlp.launch(stream, x, out, m)                   # out float16 [:m] = silu(x Wg^T) * (x Wu^T)

x is float16 [>= m, K] and out [>= m, N] on the device, C-contiguous. The tile shape is picked
from m and the shape (`default_tiles_for`) unless the factory was given `tiles=`; nothing is allocated at launch.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, uint32
from numba.core import types

from ..config import GROUP_SIZE
from ..ptx.half2 import fma_f16x2
from ..device import sm_count
from ..launch import launch
from ..ptx.mma import SHARED_ALIGNMENT, cp_async_16, cp_async_commit_group, cp_async_wait_group, \
    ld_shared_v4_u32, mma_m16n8k16
from . import CompileTarget, on_device
from .gemm_int4_tiles import A_ROW_WORDS, B_ROW_WORDS, K_TILE, SMALL, TILE_NAMES, \
    TILES_PER_GROUP, WG1_T64, WG1_T128, WG2_T128, WG2_T256, TileShape, default_tiles_for, k_chunks, matrices_of
from .gemm_int4_tma import TensorMaps, TmaTile, tma_gemm_kernel
from .gemm_int4_wgmma import WgmmaTile, has_split_form, wgmma_gemm_kernel
from .int4_unpack import unpack8

U = np.uint32  # unsigned index arithmetic: no negative-index checks (see gemv_int4.py)

CHUNK_WORDS = 4  # one cp.async or ld.shared.v4: 16 bytes
EPILOGUES = ("plain", "bias", "residual", "gate_up_silu")


@cuda.jit(device=True, inline="always")
def dequantize8(word, scale):
    """The 8 weights of one packed word times the half2 scale (s, s): four half2, input order.

    The unpack (int4_unpack.py) gives the exact u - 8; one fma multiplies by the scale (the only
    rounding: to FP16, |error| <= 2^-11 |w|).
    """
    w01, w23, w45, w67 = unpack8(word)
    return (fma_f16x2(w01, scale, U(0)), fma_f16x2(w23, scale, U(0)), fma_f16x2(w45, scale, U(0)),
            fma_f16x2(w67, scale, U(0)))


def gemm_kernel(n: int, k: int, tiles, epilogue: str, chunks: int = 1):
    """gemm_int4(x, m, q0, s0, q1, s1, bias, out, partials, counters) for one shape, tile and
    epilogue: the mma.sync kernel below for a TileShape, gemm_int4_wgmma's for a WgmmaTile, which
    sums K in `chunks` chunks (gemm_int4_wgmma.py, "K chunks"; the mma.sync kernel in one).

    x uint32 [rows * K/2] (float16 pairs), m uint32, q* uint32 [N*K/8], s* uint16 [N*K/128] (FP16
    bits), bias float16 [N], out float32 or float16 [rows * N], partials float32 and counters uint32
    (the split form's SplitWorkspace); all flat. q1/s1 (the up matrix), bias, partials and counters
    are read only by the epilogues and forms that use them (pass any array of the type otherwise).
    """
    if epilogue not in EPILOGUES:
        raise ValueError(f"unknown epilogue {epilogue!r}; choose one of {EPILOGUES}")
    if isinstance(tiles, TmaTile):  # its operands differ: tensor maps of X and W (GemmTiling.launch)
        return tma_gemm_kernel(n, k, tiles, epilogue, chunks)
    if isinstance(tiles, WgmmaTile):
        return wgmma_gemm_kernel(n, k, tiles, epilogue, chunks)
    if chunks != 1:
        raise ValueError(f"the mma.sync kernel ({tiles}) sums K in one chunk, not {chunks}")
    return mma_sync_gemm_kernel(n, k, tiles, epilogue)


@functools.cache
def mma_sync_gemm_kernel(n: int, k: int, tiles: TileShape, epilogue: str):
    """The mma.sync kernel (gemm_kernel's operands)."""
    matrices = matrices_of(epilogue)
    tiles.check(matrices)
    BLOCK_M, BLOCK_N, STAGES, THREADS = tiles.block_m, tiles.block_n, tiles.stages, tiles.threads
    WARPS_N = tiles.warps_n
    COLS = BLOCK_N // matrices  # output columns per block = weight rows per matrix
    if n % COLS or k % GROUP_SIZE:
        raise ValueError(f"N={n} must be a multiple of {COLS} and K={k} of {GROUP_SIZE}")
    WARP_M, WARP_COLS = BLOCK_M // tiles.warps_m, COLS // WARPS_N
    M_TILES = WARP_M // 16
    COL_TILES = WARP_COLS // 8  # n8 tiles per matrix per warp
    N_TILES = matrices * COL_TILES  # gate tiles first, then the up tiles of the same columns
    ACCUMULATORS = 4 * M_TILES * N_TILES
    A_FRAGMENTS, B_FRAGMENTS = 8 * M_TILES, 4 * N_TILES  # registers of one k tile's operands
    A_STAGE, B_STAGE = BLOCK_M * A_ROW_WORDS, BLOCK_N * B_ROW_WORDS
    A_RING, B_RING = STAGES * A_STAGE, STAGES * B_STAGE  # shared words (a literal size for Numba)
    A_CHUNKS = BLOCK_M * A_ROW_WORDS // CHUNK_WORDS
    X_ROW_WORDS, W_ROW_WORDS, GROUPS, K_TILES = k // 2, k // 8, k // GROUP_SIZE, k // K_TILE
    WAIT = STAGES - 2  # groups that may stay in flight when a tile must have landed
    BIAS, RESIDUAL, GATE_UP = epilogue == "bias", epilogue == "residual", matrices == 2

    @cuda.jit(device=True, inline="always")
    def load_stage(x, m, q0, q1, a_tiles, b_tiles, stage, kt, m0, n0):
        """Issue this thread's cp.async share of k tile kt into `stage`: activations, then weights."""
        tid = U(cuda.threadIdx.x)
        for i in range(-(-A_CHUNKS // THREADS)):
            c = tid + U(i * THREADS)
            if A_CHUNKS % THREADS == 0 or c < A_CHUNKS:
                row, chunk = c // U(A_ROW_WORDS // CHUNK_WORDS), c % U(A_ROW_WORDS // CHUNK_WORDS)
                inside = m0 + row < m
                src_row = m0 + row if inside else U(0)  # rows >= M: read nothing, write zeros
                cp_async_16(a_tiles, stage * U(A_STAGE) + row * U(A_ROW_WORDS) + chunk * U(CHUNK_WORDS),
                            x, src_row * U(X_ROW_WORDS) + kt * U(A_ROW_WORDS) + chunk * U(CHUNK_WORDS),
                            U(16) if inside else U(0))
        for i in range(-(-BLOCK_N // THREADS)):
            c = tid + U(i * THREADS)
            if BLOCK_N % THREADS == 0 or c < BLOCK_N:
                dst = stage * U(B_STAGE) + c * U(B_ROW_WORDS)
                if not GATE_UP or c < COLS:
                    cp_async_16(b_tiles, dst, q0, (n0 + c) * U(W_ROW_WORDS) + kt * U(B_ROW_WORDS), U(16))
                else:
                    cp_async_16(b_tiles, dst, q1, (n0 + c - U(COLS)) * U(W_ROW_WORDS) + kt * U(B_ROW_WORDS), U(16))

    @cuda.jit(device=True, inline="always")
    def load_scales(s0, s1, row, group, scale):
        """Half2 (s, s) of group `group` for each of the lane's weight tiles (row = its first row)."""
        for j in range(N_TILES):
            at = (row + U(8 * (j % COL_TILES))) * U(GROUPS) + group
            bits = U(s0[at]) if j < COL_TILES else U(s1[at])
            scale[j] = bits | (bits << U(16))

    @cuda.jit(device=True, inline="always")
    def multiply_stage(a_tiles, b_tiles, a_at, b_at, scale, a, b, acc):
        """acc += this warp's k tile: fragments from shared memory, weights unpacked, 2 mma steps."""
        for i in range(M_TILES):  # X[g, 8t..8t+7] and X[g+8, 8t..8t+7] of m tile i
            a[8 * i], a[8 * i + 1], a[8 * i + 2], a[8 * i + 3] = ld_shared_v4_u32(
                a_tiles, a_at + U(16 * i * A_ROW_WORDS))
            a[8 * i + 4], a[8 * i + 5], a[8 * i + 6], a[8 * i + 7] = ld_shared_v4_u32(
                a_tiles, a_at + U((16 * i + 8) * A_ROW_WORDS))
        for j in range(N_TILES):  # word t of weight row g of n tile j, as (k0,k1) .. (k6,k7)
            row = (j // COL_TILES) * COLS + 8 * (j % COL_TILES)
            b[4 * j], b[4 * j + 1], b[4 * j + 2], b[4 * j + 3] = dequantize8(
                b_tiles[b_at + U(row * B_ROW_WORDS)], scale[j])
        for step in range(2):
            for i in range(M_TILES):
                for j in range(N_TILES):
                    c = 4 * (i * N_TILES + j)
                    acc[c], acc[c + 1], acc[c + 2], acc[c + 3] = mma_m16n8k16(
                        a[8 * i + 2 * step], a[8 * i + 4 + 2 * step], a[8 * i + 1 + 2 * step], a[8 * i + 5 + 2 * step],
                        b[4 * j + 2 * step], b[4 * j + 1 + 2 * step],
                        acc[c], acc[c + 1], acc[c + 2], acc[c + 3])

    @cuda.jit
    def gemm_int4(x, m, q0, s0, q1, s1, bias_values, out, partials, counters):
        a_tiles = cuda.shared.array(A_RING, uint32, alignment=SHARED_ALIGNMENT)
        b_tiles = cuda.shared.array(B_RING, uint32, alignment=SHARED_ALIGNMENT)
        a = cuda.local.array(A_FRAGMENTS, uint32)
        b = cuda.local.array(B_FRAGMENTS, uint32)
        scale = cuda.local.array(N_TILES, uint32)
        upcoming_scale = cuda.local.array(N_TILES, uint32)
        acc = cuda.local.array(ACCUMULATORS, float32)
        m = U(m)
        m0 = U(cuda.blockIdx.x) * U(BLOCK_M)
        n0 = U(cuda.blockIdx.y) * U(COLS)
        warp, lane = U(cuda.threadIdx.x) // U(32), U(cuda.threadIdx.x) % U(32)
        g, t = lane // U(4), lane % U(4)
        warp_col = (warp % U(WARPS_N)) * U(WARP_COLS)  # the warp's first output column in the block
        first_row = (warp // U(WARPS_N)) * U(WARP_M) + g  # this lane's rows: first_row + 16 i + 8 h
        first_col = warp_col + g  # this lane's weight rows (in each matrix): first_col + 8j
        a_at = first_row * U(A_ROW_WORDS) + U(4) * t
        b_at = first_col * U(B_ROW_WORDS) + t
        for c in range(ACCUMULATORS):
            acc[c] = float32(0)

        for kt in range(STAGES - 1):
            load_stage(x, m, q0, q1, a_tiles, b_tiles, U(kt), U(kt), m0, n0)
            cp_async_commit_group()
        load_scales(s0, s1, n0 + first_col, U(0), upcoming_scale)
        for group in range(GROUPS):
            for j in range(N_TILES):
                scale[j] = upcoming_scale[j]
            if group + 1 < GROUPS:
                load_scales(s0, s1, n0 + first_col, U(group + 1), upcoming_scale)
            for sub in range(TILES_PER_GROUP):
                kt = U(group * TILES_PER_GROUP + sub)
                cp_async_wait_group(WAIT)  # my copies of tile kt have landed...
                cuda.syncthreads()  # ...everyone's have, and nobody still reads tile kt - 1's stage
                ahead = kt + U(STAGES - 1)
                if ahead < K_TILES:
                    load_stage(x, m, q0, q1, a_tiles, b_tiles, ahead % U(STAGES), ahead, m0, n0)
                cp_async_commit_group()  # possibly empty: keeps one group per k tile
                stage = kt % U(STAGES)
                multiply_stage(a_tiles, b_tiles, stage * U(A_STAGE) + a_at, stage * U(B_STAGE) + b_at,
                               scale, a, b, acc)

        # Accumulator 2 half + e of tile (i, j) is D[g + 8 half, 2t + e] of that 16 x 8 tile.
        for j in range(COL_TILES):
            col = n0 + warp_col + U(8 * j) + U(2) * t
            # Loaded once per column pair: the compiler may not reuse them across stores to `out`.
            bias0 = float32(bias_values[col]) if BIAS else float32(0)
            bias1 = float32(bias_values[col + U(1)]) if BIAS else float32(0)
            for i in range(M_TILES):
                for half in range(2):
                    row = m0 + first_row + U(16 * i + 8 * half)
                    if row < m:
                        c = 4 * (i * N_TILES + j) + 2 * half
                        for e in range(2):
                            value = acc[c + e]
                            if BIAS:
                                value += bias0 if e == 0 else bias1
                            if GATE_UP:  # value is the gate; the up tile is COL_TILES tiles on
                                value = value / (float32(1) + math.exp(-value)) * acc[c + e + 4 * COL_TILES]
                            if RESIDUAL:
                                out[row * U(n) + col + U(e)] += value
                            else:
                                out[row * U(n) + col + U(e)] = value

    return gemm_int4


def _weights(n: int, k: int, qweight, scales):
    """(qweight uint32 [N*K/8], scale bits uint16 [N*K/128]) on the device, flat."""
    if k % GROUP_SIZE:
        raise ValueError(f"K={k} is not a multiple of the group size {GROUP_SIZE}")
    if tuple(qweight.shape) != (n, k // 8) or tuple(scales.shape) != (n, k // GROUP_SIZE):
        raise ValueError(f"qweight {tuple(qweight.shape)} / scales {tuple(scales.shape)} do not match "
                         f"N={n}, K={k}")
    q = on_device(qweight, np.uint32).reshape(n * k // 8)
    s = on_device(scales, np.float16).reshape(n * k // GROUP_SIZE).view(np.uint16)
    return q, s


class GemmTiling:
    """An N x K GEMM's tiling, which both GEMM objects share: the tile for each M (the one given, or
    default_tiles_for's), the operand checks, and the grid of a launch."""

    def __init__(self, n: int, k: int, tiles: TileShape | None, matrices: int, out_dtype: str):
        self.n, self.k, self.tiles, self.matrices, self.out_dtype = n, k, tiles, matrices, out_dtype
        for shape in ((tiles,) if tiles else (SMALL,)):  # SMALL serves every M; the wgmma tiles only where they fit
            shape.check(matrices)
            if n % (shape.block_n // matrices):
                raise ValueError(f"N={n} is not a multiple of {shape.block_n // matrices} ({shape})")
        self.tensor_maps: dict = {}  # TmaTile -> its TensorMaps, made at the first launch on it
        # What a launch without the split form passes for its partials and counters (read by no one).
        self._no_workspace = (cuda.device_array(1, np.float32), cuda.device_array(1, np.uint32))

    def tiles_for(self, m: int, epilogue: str) -> TileShape:
        return self.tiles or default_tiles_for(m, self.n, self.k, epilogue)

    def launch(self, stream, kernel, tiles: TileShape, x, out, m: int, q0, s0, q1, s1, bias, chunks: int = 1,
               workspace: "SplitWorkspace | None" = None) -> None:
        if x.dtype != np.float16 or x.ndim != 2 or x.shape[1] != self.k or x.shape[0] < m:
            raise ValueError(f"x must be float16 [>= {m}, {self.k}], got {x.dtype} {tuple(x.shape)}")
        if out.dtype != np.dtype(self.out_dtype) or out.ndim != 2 or out.shape[1] != self.n or out.shape[0] < m:
            raise ValueError(f"out must be {self.out_dtype} [>= {m}, {self.n}], got {out.dtype} {tuple(out.shape)}")
        if m < 1:
            return
        grid = (-(-m // tiles.block_m), self.n // (tiles.block_n // self.matrices))
        if isinstance(tiles, TmaTile):  # X and W through tensor maps, made once each (gemm_int4_tma.TensorMaps)
            if tiles not in self.tensor_maps:
                self.tensor_maps[tiles] = TensorMaps(self.n, self.k, tiles, [q0, q1][:self.matrices])
            maps = self.tensor_maps[tiles]
            launch(kernel, grid, tiles.threads, stream, (maps.x(x, m), U(m), maps.weights[0], s0, maps.weights[-1], s1,
                                                         bias, out.reshape(out.size),
                                                         maps.chunk_totals(grid, chunks, workspace)),
                   tiles.dynamic_shared_bytes, dependent=False)
            return
        # Too few blocks for the SMs: each takes one K chunk (the split form, same bits).
        split = has_split_form(tiles, chunks) and workspace is not None \
            and workspace.fits(grid, tiles.block_m, self.n, chunks) and grid[0] * grid[1] < sm_count()
        partials, counters = (workspace.partials, workspace.counters) if split else self._no_workspace
        # A plain launch: prefill's kernels wait for nothing, graph edges order them.
        launch(kernel, grid + ((chunks,) if split else ()), tiles.threads, stream,
               (x.reshape(x.size).view(np.uint32), U(m), q0, s0, q1, s1, bias, out.reshape(out.size), partials,
                counters), tiles.dynamic_shared_bytes, dependent=False)


class SplitWorkspace:
    """Device scratch for summing K in chunks: the wgmma kernel's split form (gemm_int4_wgmma.py,
    "K chunks"), the chunk sums of up to `rows` token rows x `n` outputs, and one arrival counter a
    block tile, zero between launches (the last block of a tile resets its own); and the TMA
    kernel's running totals (gemm_int4_tma.py, "K chunks") of up to `total_rows` rows, in the same
    words. Its owner passes it to every GEMM launch of a stream (dev/gemm_k_chunks.py; the engine's
    prefill buffers, engine/buffers.py); launches on one stream run one at a time, so they share
    it. Without one a wgmma GEMM runs its sequential form, with the same bits, and a TMA GEMM
    makes its own totals."""

    def __init__(self, rows: int, n: int, chunks: int, stream=0, total_rows: int = 0):
        self.rows, self.n, self.chunks = rows, n, chunks
        self.partials = cuda.device_array(self.words(rows, n, chunks, total_rows), np.float32, stream=stream)
        self.counters = cuda.to_device(np.zeros(self.counter_count(rows, n), np.uint32), stream=stream)

    @staticmethod
    def counter_count(rows: int, n: int) -> int:
        return max(1, rows // 16) * max(1, n // 64)

    @staticmethod
    def words(rows: int, n: int, chunks: int, total_rows: int = 0) -> int:
        return max(chunks * rows, total_rows) * n

    @classmethod
    def nbytes(cls, rows: int, n: int, chunks: int, total_rows: int = 0) -> int:
        """Device bytes of a workspace of this size (engine/memory.py counts it before allocating)."""
        return 4 * cls.words(rows, n, chunks, total_rows) + 4 * cls.counter_count(rows, n)

    def fits(self, grid: tuple[int, int], block_m: int, n: int, chunks: int) -> bool:
        return grid[0] * block_m <= self.rows and n <= self.n and chunks <= self.chunks \
            and grid[0] * grid[1] <= self.counters.size


class Int4Gemm:
    """out = x W^T (+ bias), or out += x W^T, for one INT4 linear at M rows; built by make_gemm_int4."""

    def __init__(self, n, k, qweight, scales, *, bias=None, out_dtype="float32", tiles=None, chunks=None):
        if out_dtype not in ("float32", "float16"):
            raise ValueError(f"out_dtype must be 'float32' or 'float16', got {out_dtype!r}")
        self.n, self.k, self.out_dtype, self.chunks = n, k, out_dtype, chunks
        self.tiling = GemmTiling(n, k, tiles, 1, out_dtype)
        self.qweight, self.scales = _weights(n, k, qweight, scales)
        self.bias = None if bias is None else on_device(bias, np.float16)
        if self.bias is not None and tuple(self.bias.shape) != (n,):
            raise ValueError(f"bias must have shape ({n},), got {tuple(self.bias.shape)}")
        self._unused_bias = cuda.device_array(1, np.float16) if bias is None else None

    def kernel(self, m: int, residual: bool = False):
        """(kernel, tiles, K chunks) this object launches for m rows; compiled on first use."""
        if residual and (self.out_dtype != "float32" or self.bias is not None):
            raise ValueError("a residual GEMM accumulates into float32 and takes no bias")
        epilogue = "residual" if residual else ("bias" if self.bias is not None else "plain")
        tiles = self.tiling.tiles_for(m, epilogue)
        chunks = k_chunks(self.k, tiles, epilogue, self.chunks)
        return gemm_kernel(self.n, self.k, tiles, epilogue, chunks), tiles, chunks

    def launch(self, stream, x, out, m: int, *, residual: bool = False,
               workspace: SplitWorkspace | None = None) -> None:
        """out[:m] = x[:m] W^T (+ bias), or out[:m] += x[:m] W^T when residual; with a workspace,
        in the split form where the tiles alone would leave SMs idle (same bits)."""
        kernel, tiles, chunks = self.kernel(m, residual)
        bias = self._unused_bias if self.bias is None else self.bias
        self.tiling.launch(stream, kernel, tiles, x, out, m, self.qweight, self.scales, self.qweight,
                           self.scales, bias, chunks, workspace)


class GateUpSiluGemm:
    """out float16 = silu(x Wg^T) * (x Wu^T), both projections in one kernel; built by make_gate_up_silu_gemm."""

    def __init__(self, n, k, gate_q, gate_s, up_q, up_s, *, tiles=None):
        self.n, self.k = n, k
        self.tiling = GemmTiling(n, k, tiles, 2, "float16")
        self.gate_q, self.gate_s = _weights(n, k, gate_q, gate_s)
        self.up_q, self.up_s = _weights(n, k, up_q, up_s)
        self._unused_bias = cuda.device_array(1, np.float16)

    def kernel(self, m: int):
        tiles = self.tiling.tiles_for(m, "gate_up_silu")
        return gemm_kernel(self.n, self.k, tiles, "gate_up_silu"), tiles

    def launch(self, stream, x, out, m: int) -> None:
        """out[:m] (float16 [>= m, N]) = silu(x[:m] Wg^T) * (x[:m] Wu^T)."""
        kernel, tiles = self.kernel(m)
        self.tiling.launch(stream, kernel, tiles, x, out, m, self.gate_q, self.gate_s, self.up_q,
                              self.up_s, self._unused_bias)


def make_gemm_int4(n, k, qweight, scales, *, bias=None, out_dtype="float32", tiles=None,
                   chunks=None) -> Int4Gemm:
    """An INT4 GEMM for W [n, k] (qweight uint32 [n, k/8], scales float16 [n, k/128]), summing K
    in `chunks` chunks on the tiles that can (gemm_int4_tiles.k_chunks; None: the product's count
    for this K; dev/gemm_k_chunks.py measures others)."""
    return Int4Gemm(n, k, qweight, scales, bias=bias, out_dtype=out_dtype, tiles=tiles, chunks=chunks)


def make_gate_up_silu_gemm(n, k, gate_q, gate_s, up_q, up_s, *, tiles=None) -> GateUpSiluGemm:
    """The fused MLP input projection at M rows: silu(X Wg^T) * (X Wu^T) for Wg, Wu [n, k] in INT4."""
    return GateUpSiluGemm(n, k, gate_q, gate_s, up_q, up_s, tiles=tiles)


def gemm_flops(m: int, n: int, k: int, matrices: int = 1) -> int:
    """Multiply-adds x 2 of one call."""
    return 2 * m * n * k * matrices


def gemm_signature(out=types.float32):
    """The Numba signature of gemm_kernel's kernels, output float32 or float16."""
    words, bits = types.uint32[::1], types.uint16[::1]
    return types.void(words, types.uint32, words, bits, words, bits, types.float16[::1], out[::1], types.float32[::1],
                      words)


def compile_targets() -> list[CompileTarget]:
    """Every 7B linear with the epilogue and tile prefill uses there, the smaller tiles at one 7B
    shape each, and a tiny shape with float16 output."""
    hidden, intermediate, qkv = 3584, 18944, 4608
    feed = ("cp.async.cg.shared.global", "ld.shared.v4.u32", "prmt.b32", "fma.rn.f16x2")
    targets = []
    for name, n, k, epilogue, tiles, out in (
            ("qkv", qkv, hidden, "bias", SMALL, types.float32),
            ("o_proj", hidden, hidden, "residual", SMALL, types.float32),
            ("gate_up", intermediate, hidden, "gate_up_silu", SMALL, types.float16),
            ("down_proj", hidden, intermediate, "residual", SMALL, types.float32),
            ("tiny, float16 out", 256, 256, "plain", SMALL, types.float16),
            ("qkv", qkv, hidden, "bias", WG1_T128, types.float32),
            ("o_proj", hidden, hidden, "residual", WG2_T128, types.float32),
            ("gate_up", intermediate, hidden, "gate_up_silu", WG1_T128, types.float16),
            ("down_proj", hidden, intermediate, "residual", WG2_T128, types.float32),
            ("down_proj", hidden, intermediate, "residual", WG2_T256, types.float32),
            ("gate_up", intermediate, hidden, "gate_up_silu", WG2_T128, types.float16),
            ("qkv", qkv, hidden, "bias", WG1_T64, types.float32),
            ("down_proj", hidden, intermediate, "residual", WG1_T64, types.float32),
            ("tiny, float16 out", 256, 256, "plain", WG1_T64, types.float16)):
        chunks = k_chunks(k, tiles, epilogue)  # as the product sums this linear's K on this tile
        if isinstance(tiles, WgmmaTile):  # sm_90a; a 256-token tile issues n128 wgmmas
            width = min(tiles.tokens, 128)
            must = (f"wgmma.mma_async.sync.aligned.m64n{width}k16.f32.f16.f16", "wgmma.fence.sync.aligned",
                    "wgmma.commit_group.sync.aligned", "wgmma.wait_group.sync.aligned",
                    "fence.proxy.async.shared::cta") + feed
            if has_split_form(tiles, chunks):  # the chunk sums' publication and fold
                must += ("atom.global.add.u32", "membar.gl", "ld.global.cg.f32")
            cc = (9, 0, "a")
        else:
            must, cc = ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",) + feed, (9, 0)
        targets.append(CompileTarget(f"gemm_int4_{epilogue}_{TILE_NAMES[tiles]}{f'_k{chunks}' if chunks > 1 else ''}"
                                     f"[{name} {n}x{k}]",
                                     gemm_kernel(n, k, tiles, epilogue, chunks), gemm_signature(out), must, cc=cc))
    return targets

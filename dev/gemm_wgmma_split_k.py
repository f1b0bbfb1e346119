"""Split-K for the wgmma INT4 GEMM's residual epilogue: faster at few tokens, and not deterministic.

The product's wgmma kernel (pynanoqwen/kernels/gemm_int4_wgmma.py, same operands, pipeline and
fragments; read its docstring first) computes a block's output over all of K. At 64 or 128
tokens the down projection (3584 x 18944) then runs only 56 blocks of 64 weight rows on 132 SMs.
Split-K gives each block a share of K (grid z = SPLITS) and adds its partial product into the
float32 residual with atomic adds, which only an epilogue that already adds into `out` can do.
The order of those adds is whichever block finishes first, so the result changes in the last bits
from run to run: a prompt's logits did, graph and eager runs of the 7B file stopped agreeing
token for token, and validate's graph tier failed (docs/PERFORMANCE.md). So no default uses it;
this file keeps it, with its check and timing, against the product's default tile:

    python dev/gemm_wgmma_split_k.py    # float64 check (o_proj, down_proj), then us against the default

Error bound on top of the product's (oracles.gemm_oracle): each block's partial obeys the
accumulation bound over its own K / SPLITS (together within the one over K), and the SPLITS atomic
adds each round once, to a running sum of at most |out| + 1.01 mag: SPLITS u32 (|out| + 1.01 mag).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
from numba import cuda, float32, uint32
from numba.core import types

from harness import LINEARS_7B, check_gemm, run, time_calls, time_product_gemm
from pynanoqwen.config import GROUP_SIZE
from pynanoqwen.kernels import CompileTarget
from pynanoqwen.kernels.gemm_int4 import gemm_signature
from pynanoqwen.kernels.gemm_int4_wgmma import TILES_PER_GROUP, W_ROW_WORDS, X_ROW_WORDS, WgmmaTile, unpack_fragments
from pynanoqwen.kernels.int4_unpack import PAIR_CONSTANTS
from pynanoqwen.launch import launch
from pynanoqwen.oracles import U32
from pynanoqwen.ptx.mma import cp_async_16, cp_async_commit_group, cp_async_wait_group
from pynanoqwen.ptx.wgmma import SWIZZLE_ATOM_BYTES, fence_proxy_async_shared, shared_byte_address, \
    wgmma_commit_group, wgmma_f16, wgmma_fence, wgmma_wait_group

U = np.uint32


@dataclasses.dataclass(frozen=True)
class SplitKTile(WgmmaTile):
    """A wgmma tile (one matrix, at most 128 tokens) whose K is split over SPLITS blocks."""

    splits: int = 2

    def fits(self, n: int, k: int, matrices: int) -> bool:
        return matrices == 1 and self.tokens <= 128 and super().fits(n, k, 1) and k % (GROUP_SIZE * self.splits) == 0


WG2_T128_SPLIT_K = SplitKTile(2, 128)  # the variant bench's table used to time: WG2_T128 over two halves of K


@functools.cache
def split_k_kernel(n: int, k: int, tiles: SplitKTile):
    """out[:m] += x[:m] W^T with K split over tiles.splits blocks (gemm_int4.gemm_kernel's operands)."""
    if not tiles.fits(n, k, 1):
        raise ValueError(f"{tiles} does not fit N={n}, K={k}")
    TOKENS, ROWS, STAGES, THREADS, SPLITS = tiles.tokens, tiles.block_n, tiles.stages, tiles.threads, tiles.splits
    ACCUMULATORS = TOKENS // 2
    X_STAGE_WORDS = TOKENS * X_ROW_WORDS
    STAGE_WORDS = X_STAGE_WORDS + ROWS * W_ROW_WORDS
    X_CHUNKS, W_CHUNKS = TOKENS * X_ROW_WORDS // 4, ROWS * W_ROW_WORDS // 4
    X_WORDS, W_WORDS, GROUPS = k // 2, k // 8, k // GROUP_SIZE
    SPLIT_GROUPS = GROUPS // SPLITS
    AHEAD, WAIT = STAGES - 2, STAGES - 3

    @cuda.jit(device=True, inline="always")
    def load_stage(x, m, q, tile, stage_word, kt, m0, n0):
        tid = U(cuda.threadIdx.x)
        for i in range(-(-X_CHUNKS // THREADS)):
            c = tid + U(i * THREADS)
            if X_CHUNKS % THREADS == 0 or c < X_CHUNKS:
                row, chunk = c // U(X_ROW_WORDS // 4), c % U(X_ROW_WORDS // 4)
                inside = m0 + row < m
                src_row = m0 + row if inside else U(0)
                cp_async_16(tile, stage_word + row * U(X_ROW_WORDS) + U(4) * (chunk ^ (row % U(8))),
                            x, src_row * U(X_WORDS) + kt * U(X_ROW_WORDS) + chunk * U(4), U(16) if inside else U(0))
        for i in range(-(-W_CHUNKS // THREADS)):
            c = tid + U(i * THREADS)
            if W_CHUNKS % THREADS == 0 or c < W_CHUNKS:
                r, half = c // U(2), c % U(2)
                cp_async_16(tile, stage_word + U(X_STAGE_WORDS) + r * U(W_ROW_WORDS) + half * U(4),
                            q, (n0 + r) * U(W_WORDS) + kt * U(W_ROW_WORDS) + half * U(4), U(16))

    @cuda.jit(device=True, inline="always")
    def half2_scale(s, feature, group):
        bits = U(s[feature * U(GROUPS) + group])
        return bits | (bits << U(16))

    @cuda.jit(device=True, inline="always")
    def step(x, m, q, tile, ring, kt, first_tile, m0, n0, w_word, unpack, scale_a, scale_b, a, acc):
        cp_async_wait_group(WAIT)
        fence_proxy_async_shared()
        cuda.syncthreads()
        ahead = kt + U(AHEAD)
        if ahead < U(SPLIT_GROUPS * TILES_PER_GROUP):
            load_stage(x, m, q, tile, ring + (ahead % U(STAGES)) * U(STAGE_WORDS), first_tile + ahead, m0, n0)
        cp_async_commit_group()
        stage_word = ring + (kt % U(STAGES)) * U(STAGE_WORDS)
        word_a = stage_word + w_word
        unpack_fragments(tile, word_a, word_a + U(8 * W_ROW_WORDS), unpack, scale_a, scale_b, a)
        wgmma_fence()
        for j in range(4):
            wgmma_f16(acc, TOKENS, a[4 * j], a[4 * j + 1], a[4 * j + 2], a[4 * j + 3], tile, stage_word + U(8 * j))
        wgmma_commit_group()
        wgmma_wait_group(1)

    @cuda.jit
    def gemm_int4_wgmma_split_k(x, m, q0, s0, q1, s1, bias_values, out):
        tile = cuda.shared.array(0, uint32)
        a_even = cuda.local.array(16, uint32)
        a_odd = cuda.local.array(16, uint32)
        acc = cuda.local.array(ACCUMULATORS, float32)
        m = U(m)
        m0, n0 = U(cuda.blockIdx.x) * U(TOKENS), U(cuda.blockIdx.y) * U(ROWS)
        tid = U(cuda.threadIdx.x)
        g, t = (tid % U(32)) // U(4), tid % U(4)
        row_a = (tid // U(32)) * U(16) + g
        unpack = (PAIR_CONSTANTS[0][0] if t < U(2) else PAIR_CONSTANTS[2][0],
                  PAIR_CONSTANTS[0][1] if t % U(2) == U(0) else PAIR_CONSTANTS[1][1],
                  PAIR_CONSTANTS[0][2] if t % U(2) == U(0) else PAIR_CONSTANTS[1][2],
                  PAIR_CONSTANTS[0][3] if t % U(2) == U(0) else PAIR_CONSTANTS[1][3])
        base = shared_byte_address(tile, U(0))
        ring = ((U(SWIZZLE_ATOM_BYTES) - base % U(SWIZZLE_ATOM_BYTES)) % U(SWIZZLE_ATOM_BYTES)) // U(4)
        w_word = U(X_STAGE_WORDS) + row_a * U(W_ROW_WORDS)
        first_group = U(cuda.blockIdx.z) * U(SPLIT_GROUPS)  # this block's share of K
        first_tile = first_group * U(TILES_PER_GROUP)
        for c in range(ACCUMULATORS):
            acc[c] = float32(0)
        for s in range(AHEAD):
            load_stage(x, m, q0, tile, ring + U(s * STAGE_WORDS), first_tile + U(s), m0, n0)
            cp_async_commit_group()
        next_a = half2_scale(s0, n0 + row_a, first_group)
        next_b = half2_scale(s0, n0 + row_a + U(8), first_group)
        for group in range(SPLIT_GROUPS):
            scale_a, scale_b = next_a, next_b
            if group + 1 < SPLIT_GROUPS:  # fetched a group ahead, as the product kernel does
                next_a = half2_scale(s0, n0 + row_a, first_group + U(group + 1))
                next_b = half2_scale(s0, n0 + row_a + U(8), first_group + U(group + 1))
            kt = U(group * TILES_PER_GROUP)
            step(x, m, q0, tile, ring, kt, first_tile, m0, n0, w_word, unpack, scale_a, scale_b, a_even, acc)
            step(x, m, q0, tile, ring, kt + U(1), first_tile, m0, n0, w_word, unpack, scale_a, scale_b, a_odd, acc)
        wgmma_wait_group(0)
        for i in range(TOKENS // 8):
            for e in range(2):
                token = m0 + U(8 * i + e) + U(2) * t
                if token < m:  # the other splits add their shares of K into the same outputs
                    cuda.atomic.add(out, token * U(n) + n0 + row_a, acc[4 * i + e])
                    cuda.atomic.add(out, token * U(n) + n0 + row_a + U(8), acc[4 * i + 2 + e])

    return gemm_int4_wgmma_split_k


class SplitKGemm:
    """out[:m] += x[:m] W^T for one INT4 linear (device qweight, scales), K split over tiles.splits."""

    def __init__(self, n: int, k: int, tiles: SplitKTile, qweight, scales):
        self.n, self.tiles, self.kernel = n, tiles, split_k_kernel(n, k, tiles)
        self.q, self.s = qweight.reshape(qweight.size), scales.reshape(scales.size).view(np.uint16)
        self.unused_bias = cuda.device_array(1, np.float16)

    def launch(self, stream, x, out) -> None:
        m, tiles = x.shape[0], self.tiles
        grid = (-(-m // tiles.tokens), self.n // tiles.block_n, tiles.splits)
        launch(self.kernel, grid, tiles.threads, stream,
               (x.reshape(x.size).view(np.uint32), U(m), self.q, self.s, self.q, self.s, self.unused_bias,
                out.reshape(out.size)), tiles.dynamic_shared_bytes, dependent=False)


def compile_targets() -> list[CompileTarget]:
    n, k = LINEARS_7B["down_proj"]
    must = ("wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16", "atom.global.add.f32", "prmt.b32")
    signature = types.void(*gemm_signature(types.float32).args[:8])  # the product's, without the workspace
    return [CompileTarget(f"gemm_int4_residual_wgmma_128x128_split_k[down_proj {n}x{k}]",
                          split_k_kernel(n, k, WG2_T128_SPLIT_K), signature, must, cc=(9, 0, "a"))]


def atomic_adds_bound(tiles: SplitKTile):
    """The bound the SPLITS atomic adds put on top of the product's (the module docstring)."""
    return lambda magnitude, out: tiles.splits * U32 * (np.abs(out) + 1.01 * magnitude)


def check(rng, tiles: SplitKTile = WG2_T128_SPLIT_K, m: int = 100):
    def launch(stream, weights, bias, x, out):
        SplitKGemm(n, k, tiles, *weights[0]).launch(stream, x, out)

    results = []
    for name in ("o_proj", "down_proj"):
        n, k = LINEARS_7B[name]
        results.append(check_gemm(f"split-K {name} M={m}", launch, n, k, m, "residual", rng, atomic_adds_bound(tiles)))
    return results


def timings(ms=(64, 128, 512)) -> list[dict]:
    rows = []
    for name in ("o_proj", "down_proj"):
        n, k = LINEARS_7B[name]
        for m in ms:
            def build(weights, n=n, k=k):
                return SplitKGemm(n, k, WG2_T128_SPLIT_K, *weights[0]).launch

            rows.append({"linear": name, "M": m, "split-K us": time_calls(build, n, k, m),
                         "default us": time_product_gemm(n, k, m, "residual")})
    return rows


if __name__ == "__main__":
    run(check, timings, "wgmma split-K against the default tiles (us per call)")

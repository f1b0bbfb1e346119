"""The forms of the TMA-fed wgmma INT4 GEMM that the product did not take: a producer warp of its own,
thread 0 producing at 128 tokens or with lag 1, and K in chunks. The product's form (thread 0, 128
x 256, 4 stages, lag 0, one K chunk) is kernels/gemm_int4_tma.py; read it first. Here:

- a producer issues, for each k tile, two or three `cp.async.bulk.tensor.2d` copies (TMA, PTX ISA
  "cp.async.bulk.tensor"): the X tile (64 k x TOKENS tokens of FP16, written in the 128-byte
  swizzle that the wgmma descriptor reads; the tensor map's SWIZZLE_128B is that same pattern,
  chunk c of row r at c ^ (r % 8)) and the W tile (8 packed words x ROWS weight rows; for gate/up
  a box of the gate rows and one of the up rows); rows past M come in as zeros, as the product's
  zero-filling copies give them;
- the stage's `full` mbarrier (one arrival, the producer's expect_tx, plus the boxes' bytes) tells
  the consumers the tile has landed, in both proxies: the consumers' ld.shared of W and their
  wgmmas' reads of X need no fence;
- each consumer thread arrives on the stage's `empty` mbarrier once wgmma_wait_group(1) in the
  next k tile says the tile's wgmmas are done (its W words went to registers before they were
  issued), and the producer waits for it before refilling the stage.

Two producers. A warp of its own (the block's last; its lane 0 walks every k tile), or thread 0
between its own k tiles (`lane_lag`): at tile kt it refills the stage of tile kt - 2 - lag with
tile kt + STAGES - 2 - lag, waiting for every consumer's release of that stage, so the other warps
may trail thread 0 by lag + 1 tiles before it waits for them. The warp costs registers: it makes a
block of two warpgroups 9 warps, 3 of them on one of the SM's 4 schedulers, each scheduler holding
a quarter of the 65536 registers, so a thread may have only 168 (ptxas gives exactly that under
the 288-thread launch bound). The 256-token tiles (196-208 registers unbounded) and the K-chunked
128-token tile (212) spill 68-208 bytes there, and without the bound their launches failed
(CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES). Thread 0 keeps the block at 8 warps and 255 registers.

The consumers do what the product's do, in the same order: unpack the lane's pairs, fence, the 4
(8 at 256 tokens) wgmmas of the tile as one group, wait for the previous group; K in the same fixed
chunks (sequential form), the same epilogues. So every accumulator sums the same products in the
same order, and `check` asks for the product's bits, not only float64's bound.

Tensor maps, the copy and its simulator twin: ptx/tensor_copy.py.

K chunks with their running total in a workspace, down_proj's form at 256 tokens, went into the
product (gemm_int4_tma.py, "K chunks").

Measured on an H100 (docs/PERFORMANCE.md, "2026-12-06, midday"): the product's bits at every
7B linear and tile. The 256-token tile with thread 0 producing (4 stages, lag 0) is the fastest
form at 2048 tokens: gate_up 898.9 against the product's 1118.5 us (619 TFLOP/s), o_proj 119.1
against 129.0, down_proj 462.3 against 612.3 (but in one K chunk, which the product's prefix cache
rules out for down_proj: gemm_int4_tiles.k_chunks), and gate_up's at 512 (246.0 against 270.7).
The producer warp at 128 x 128 is 3-12% faster than the product's default where that tile serves
(qkv 132.5 against 151.2 at 2048, down_proj 146.3 / 589.5 against 154.4 / 612.3 in 4 chunks). A
fifth stage with lag 1 is slower in both forms (not explained). The first prediction, 10-30% from
the copies' bookkeeping alone, held only at 256 tokens: at 128 the k loop of gate_up is 311 PTX
instructions for two k tiles against the product's 347, the unpack (fma 64, and 50, prmt 32)
most of both. Thread 0 at 128 tokens and lag 0 (the evening's run) is slower than the cp.async
kernel everywhere, down_proj in 4 chunks included (166.3 / 652.5 against 154.8 / 606.5 us at 512 /
2048 rows): so no TMA form for down_proj. (tests/test_dev_variants.py compiles the Python function,
without the launch bound, so it sees the unbounded register counts.)

    python dev/gemm_wgmma_tma.py

`check` runs every 7B linear at 7 and 512 tokens against float64 (the product's bound) on the
default tile with both producers, and at 512 tokens against the product's own bits on each timed
form with the same K chunks; `timings` gives us a call of the product's default tile and of this
kernel's forms at 512 and 2048 tokens, weights rotated through twice the L2, as bench's GEMM table
times them.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, types, uint32, uint64

from harness import EPILOGUES_7B, LINEARS_7B, check_gemm, product_gemm, random_int4, run, time_calls, \
    time_product_gemm
from pynanoqwen.config import GROUP_SIZE
from pynanoqwen.kernels import CompileTarget
from pynanoqwen.kernels.gemm_int4 import _weights
from pynanoqwen.kernels.gemm_int4_tiles import TILE_NAMES, WG2_T128, default_tiles_for, k_chunks
from pynanoqwen.kernels.gemm_int4_tma import TensorMaps, stage_fill, tma_signature
from pynanoqwen.kernels.gemm_int4_wgmma import K_TILE, TILES_PER_GROUP, W_ROW_WORDS, X_ROW_WORDS, WgmmaTile, \
    check_chunks, tile_epilogue, tile_multiply
from pynanoqwen.kernels.int4_unpack import HIGH_NIBBLES, LOW_NIBBLES, MINUS_72, MINUS_1032, ONE, ONE_SIXTEENTH, \
    SELECT_BYTES_0_1, SELECT_BYTES_2_3
from pynanoqwen.launch import launch
from pynanoqwen.oracles import passed
from pynanoqwen.ptx import SIMULATOR
from pynanoqwen.ptx.mbarrier import fence_barrier_init, mbarrier_arrive, mbarrier_init, mbarrier_wait
from pynanoqwen.ptx.tensor_copy import acquire_tensor_map
from pynanoqwen.ptx.wgmma import SHAPES_N, SWIZZLE_ATOM_BYTES, shared_byte_address, wgmma_wait_group

U = np.uint32


# --- The kernel ---------------------------------------------------------------------------------

@functools.cache
def tma_gemm_kernel(n: int, k: int, tiles: WgmmaTile, epilogue: str, chunks: int = 1, lane_lag: int | None = None):
    """tma_gemm(x_map, m, w_map0, s0, w_map1, s1, bias, out, totals): out[:m] (+)= X W^T with
    the product's epilogues, X and W through their tensor maps, K summed in `chunks` fixed chunks
    (their running total in registers); the stages filled by a producer warp, or with lane_lag by
    thread 0 between its own k tiles. `totals`, the product's workspace argument, is not read."""
    matrices = 2 if epilogue == "gate_up_silu" else 1
    tiles.check(matrices)
    check_chunks(k, tiles, epilogue, chunks)
    CHUNKS = chunks
    TOKENS, ROWS, STAGES = tiles.tokens, tiles.block_n, tiles.stages
    CONSUMERS = tiles.threads  # the warpgroups' threads; the producer warp follows them
    PRODUCER_WARP = CONSUMERS // 32
    LANE_PRODUCER = lane_lag is not None  # thread 0 fills the stages instead of a warp of its own
    # The lane producer refills, at tile kt, the stage of tile kt - 2 - lag with tile kt + AHEAD: it
    # waits for every consumer to have released tile kt - 2 - lag, so the other warps may lag
    # thread 0's by lag + 1 tiles before it waits for them.
    AHEAD = STAGES - 2 - (lane_lag or 0)
    THREADS = CONSUMERS if LANE_PRODUCER else CONSUMERS + 32
    if LANE_PRODUCER and AHEAD < 1:
        raise ValueError(f"{tiles}: {STAGES} stages leave no tile in flight at lag {lane_lag}")
    COLS = ROWS // matrices
    if n % COLS or k % GROUP_SIZE:
        raise ValueError(f"N={n} must be a multiple of {COLS} and K={k} of {GROUP_SIZE}")
    WIDTH = min(TOKENS, SHAPES_N[-1])
    ACCUMULATORS = WIDTH // 2
    X_STAGE_WORDS = TOKENS * X_ROW_WORDS
    STAGE_WORDS = X_STAGE_WORDS + ROWS * W_ROW_WORDS
    GROUPS, K_TILES = k // GROUP_SIZE, k // K_TILE
    GATE_UP = matrices == 2
    multiply, store, fill = tile_multiply(TOKENS), tile_epilogue(n, TOKENS, epilogue), stage_fill(tiles, matrices)

    @cuda.jit(device=True, inline="always")
    def acquire_maps(x_map, w_map0, w_map1):
        acquire_tensor_map(x_map)
        acquire_tensor_map(w_map0)
        if GATE_UP:
            acquire_tensor_map(w_map1)

    @cuda.jit(device=True, inline="always")
    def consume(maps, tile, ring, full, empty, kt, m0, n0, offset_a, offset_b, constants, scale_a, scale_b, a, acc,
                acc_high):
        """k tile kt: (the lane producer: refill the stage LAG + 2 tiles back with tile kt + AHEAD)
        wait for its boxes, unpack, issue its wgmmas, and release the stage of kt - 1, whose wgmmas
        wait_group(1) has just seen done."""
        if LANE_PRODUCER and cuda.threadIdx.x == 0 and kt + U(AHEAD) < U(K_TILES):
            fill(maps[0], maps[1], maps[2], tile, ring, full, empty, kt + U(AHEAD), m0, n0)
        stage = kt % U(STAGES)
        mbarrier_wait(full, stage, (kt // U(STAGES)) & U(1))
        word = ring + stage * U(STAGE_WORDS)
        multiply(tile, word, word + offset_a, word + offset_b, constants, scale_a, scale_b, a, acc, acc_high)
        if kt > U(0):
            mbarrier_arrive(empty, (kt - U(1)) % U(STAGES))

    @cuda.jit(device=True, inline="always")
    def half2_scale(s0, s1, feature, up, group):
        bits = U(s1[feature * U(GROUPS) + group]) if up else U(s0[feature * U(GROUPS) + group])
        return bits | (bits << U(16))

    # The block must fit the SM's 65536 registers. Without a bound ptxas gave the 256-token and the
    # K-chunked tiles more than 288 threads (the producer warp's 32 included) can have, and their
    # launches failed (CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES); .maxntid tells it the block.
    @cuda.jit(**({} if SIMULATOR else {"launch_bounds": (THREADS, 1)}))  # the simulator takes no bounds
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
                mbarrier_init(full, s, 1)  # the producer's arrive.expect_tx; the boxes add their bytes
                mbarrier_init(empty, s, CONSUMERS)  # every consumer thread, after its wgmma wait
            fence_barrier_init()
        cuda.syncthreads()
        if not LANE_PRODUCER and tid // U(32) == U(PRODUCER_WARP):
            if tid % U(32) == U(0):
                acquire_maps(x_map, w_map0, w_map1)
                for kt in range(K_TILES):
                    fill(x_map, w_map0, w_map1, tile, ring, full, empty, U(kt), m0, n0)
            return
        if LANE_PRODUCER and tid == U(0):
            acquire_maps(x_map, w_map0, w_map1)
            for kt in range(min(AHEAD, K_TILES)):
                fill(x_map, w_map0, w_map1, tile, ring, full, empty, U(kt), m0, n0)
        maps = (x_map, w_map0, w_map1)

        a_even = cuda.local.array(16, uint32)
        a_odd = cuda.local.array(16, uint32)
        acc = cuda.local.array(ACCUMULATORS, float32)
        acc_high = cuda.local.array(ACCUMULATORS, float32)
        total = cuda.local.array(ACCUMULATORS, float32)
        lane = tid % U(32)
        warp = tid // U(32)
        g, t = lane // U(4), lane % U(4)
        if GATE_UP:  # warp w: gate columns 8w..8w+7 (fragment rows g), their up rows (g + 8)
            col_a = col_b = warp * U(8) + g
            row_b = U(COLS) + col_a
        else:
            col_a = warp * U(16) + g
            col_b = col_a + U(8)
            row_b = col_b
        offset_a = U(X_STAGE_WORDS) + col_a * U(W_ROW_WORDS)
        offset_b = U(X_STAGE_WORDS) + row_b * U(W_ROW_WORDS)
        constants = (SELECT_BYTES_0_1 if t < U(2) else SELECT_BYTES_2_3,
                     LOW_NIBBLES if t % U(2) == U(0) else HIGH_NIBBLES,
                     ONE if t % U(2) == U(0) else ONE_SIXTEENTH,
                     MINUS_1032 if t % U(2) == U(0) else MINUS_72)
        for c in range(ACCUMULATORS):
            acc[c] = float32(0)
            acc_high[c] = float32(0)
        up_b = GATE_UP
        next_a = half2_scale(s0, s1, n0 + col_a, False, U(0))
        next_b = half2_scale(s0, s1, n0 + col_b, up_b, U(0))
        for chunk in range(CHUNKS):
            first, end = chunk * GROUPS // CHUNKS, (chunk + 1) * GROUPS // CHUNKS
            for g_index in range(first, end):
                group = U(g_index)
                scale_a, scale_b = next_a, next_b
                if group + U(1) < U(GROUPS):
                    next_a = half2_scale(s0, s1, n0 + col_a, False, group + U(1))
                    next_b = half2_scale(s0, s1, n0 + col_b, up_b, group + U(1))
                kt = group * U(TILES_PER_GROUP)
                consume(maps, tile, ring, full, empty, kt, m0, n0, offset_a, offset_b, constants, scale_a, scale_b,
                        a_even, acc, acc_high)
                consume(maps, tile, ring, full, empty, kt + U(1), m0, n0, offset_a, offset_b, constants, scale_a,
                        scale_b, a_odd, acc, acc_high)
            if CHUNKS > 1:
                wgmma_wait_group(0)
                for c in range(ACCUMULATORS):
                    total[c] = acc[c] if chunk == 0 else total[c] + acc[c]
                    acc[c] = float32(0)
        wgmma_wait_group(0)
        if CHUNKS == 1:
            for c in range(ACCUMULATORS):
                total[c] = acc[c]

        store(out, bias_values, total, acc_high, m, m0, n0, col_a, col_b, t)

    return tma_gemm


def threads(tiles: WgmmaTile, lane_lag: int | None = None) -> int:
    """The block: the warpgroups, then the producer warp unless thread 0 produces."""
    return tiles.threads + (0 if lane_lag is not None else 32)


class TmaGemm:
    """One linear (one weight matrix, or gate and up) on this kernel, as the product's Int4Gemm and
    GateUpSiluGemm take it; its tensor maps as the product keeps them (gemm_int4_tma.TensorMaps)."""

    def __init__(self, n: int, k: int, weights, epilogue: str, tiles: WgmmaTile, chunks: int = 1, bias=None,
                 lane_lag: int | None = None):
        self.n, self.tiles, self.threads = n, tiles, threads(tiles, lane_lag)
        self.kernel = tma_gemm_kernel(n, k, tiles, epilogue, chunks, lane_lag)
        self.unread = cuda.device_array(1, np.float32)  # the product's totals argument
        self.cols = tiles.block_n // len(weights)
        flat = [_weights(n, k, q, s) for q, s in weights]
        self.qweights = [q for q, _ in flat]  # a tensor map holds the address, not the array: keep them alive
        self.maps = TensorMaps(n, k, tiles, self.qweights)
        self.scales = [s for _, s in flat]
        self.bias = cuda.to_device(np.zeros(n, np.float16)) if bias is None else bias

    def launch(self, stream, x, out, m: int) -> None:
        """out[:m] (+)= x[:m] W^T with the kernel's epilogue (x float16 [>= m, K])."""
        grid = (-(-m // self.tiles.tokens), self.n // self.cols)
        launch(self.kernel, grid, self.threads, stream,
               (self.maps.x(x, m), U(m), self.maps.weights[0], self.scales[0], self.maps.weights[-1], self.scales[-1],
                self.bias, out.reshape(out.size), self.unread), self.tiles.dynamic_shared_bytes, dependent=False)


# What is timed, (tiles, lane_lag): a producer warp at the 128-token tile (9 warps: 168 registers a
# thread), and thread 0 producing (8 warps) at 128 and 256 tokens; with lag 1 the other warps may
# run a tile further behind thread 0 before it waits for them, at the price of a stage. Thread 0
# at 256 tokens and lag 0, the fastest, is the product's kernel (gemm_int4_tma.py, the "product"
# column where it is the default tile).
TMA_TILES = {"warp 128x128": (WG2_T128, None), "lane 128x128 s4 lag0": (WG2_T128, 0),
             "lane 128x128 s5 lag1": (WgmmaTile(2, 128, stages=5), 1),
             "lane 128x256 s5 lag1": (WgmmaTile(2, 256, stages=5), 1)}
CHECKED_ROWS = (7, 512)  # against float64: a partial token tile, and bench's short prompt
BITS_ROWS = (512,)  # against the product's bits on the same tile: two or more token blocks at every tile


def tma_launcher(n: int, k: int, epilogue: str, tiles: WgmmaTile, lane_lag: int | None = None):
    """launch(stream, weights, bias, x, out) for harness.check_gemm, K in the product's chunks."""
    def launch_one(stream, weights, bias, x, out):
        TmaGemm(n, k, weights, epilogue, tiles, k_chunks(k, tiles, epilogue), bias, lane_lag).launch(
            stream, x, out, x.shape[0])
    return launch_one


def same_bits(name: str, label: str, form: tuple, m: int, rng):
    """This kernel and the product's on the same tile, K chunks and fresh operands: equal outputs."""
    n, k = LINEARS_7B[name]
    epilogue = EPILOGUES_7B[name]
    tiles, lane_lag = form
    weights = [tuple(cuda.to_device(a) for a in random_int4(rng, n, k))
               for _ in range(2 if epilogue == "gate_up_silu" else 1)]
    bias = cuda.to_device(rng.standard_normal(n).astype(np.float16)) if epilogue == "bias" else None
    x = cuda.to_device(rng.standard_normal((m, k)).astype(np.float16))
    start = rng.standard_normal((m, n)).astype(np.float16 if epilogue == "gate_up_silu" else np.float32)
    outs = []
    for launch_one in (product_gemm(n, k, epilogue, tiles), tma_launcher(n, k, epilogue, tiles, lane_lag)):
        out = cuda.to_device(start)
        launch_one(0, weights, bias, x, out)
        outs.append(out.copy_to_host())
    differ = int(np.count_nonzero(outs[0].view(np.uint16 if epilogue == "gate_up_silu" else np.uint32)
                                  != outs[1].view(np.uint16 if epilogue == "gate_up_silu" else np.uint32)))
    return passed(f"{name} {label} M={m}: the product's bits", differ == 0,
                  f"{differ} of {start.size} outputs differ")


def fits(tiles: WgmmaTile, n: int, k: int, epilogue: str) -> bool:
    return tiles.fits(n, k, 2 if epilogue == "gate_up_silu" else 1)


def check(rng):
    results = []
    for name, (n, k) in LINEARS_7B.items():
        epilogue = EPILOGUES_7B[name]
        for m in CHECKED_ROWS:  # the 128 x 128 tile, both producers
            for lane_lag in (None, 1):  # its 4 stages leave thread 0 one tile ahead at lag 1
                results.append(check_gemm(f"{name} {TILE_NAMES[WG2_T128]} {'lane' if lane_lag else 'warp'} M={m}",
                                          tma_launcher(n, k, epilogue, WG2_T128, lane_lag), n, k, m, epilogue, rng))
        for label, form in TMA_TILES.items():
            if fits(form[0], n, k, epilogue):
                results += [same_bits(name, label, form, m, rng) for m in BITS_ROWS]
    return results


def timings() -> list[dict]:
    """us a call at M = 512 and 2048: the product's default tile, then this kernel's tiles."""
    rows = []
    for name, (n, k) in LINEARS_7B.items():
        epilogue = "plain" if EPILOGUES_7B[name] == "bias" else EPILOGUES_7B[name]  # as bench's GEMM table
        matrices = 2 if epilogue == "gate_up_silu" else 1
        out_dtype = np.float16 if matrices == 2 else np.float32
        for m in (512, 2048):
            flops = 2 * m * n * k * matrices
            product = time_product_gemm(n, k, m, epilogue)
            row = {"linear": name, "M": m, f"product {TILE_NAMES[default_tiles_for(m, n, k, epilogue)]}": product}
            for label, (tiles, lane_lag) in TMA_TILES.items():
                if not fits(tiles, n, k, epilogue):
                    continue

                def build(weights, tiles=tiles, lane_lag=lane_lag):
                    gemm = TmaGemm(n, k, weights, epilogue, tiles, k_chunks(k, tiles, epilogue), lane_lag=lane_lag)
                    return lambda stream, x, out: gemm.launch(stream, x, out, m)

                row[f"tma {label}"] = time_calls(build, n, k, m, out_dtype, matrices)
            best = min(v for key, v in row.items() if key.startswith("tma"))
            row["best TFLOP/s"] = f"{flops / best / 1e6:.0f} ({flops / product / 1e6:.0f})"
            rows.append(row)
    return rows


def compile_targets() -> list[CompileTarget]:
    """The kernel at every 7B linear on its product tile at 512 tokens (producer warp), and at 128 x
    256 with thread 0 producing."""
    targets = []
    feed = ("cp.async.bulk.tensor.2d", "wgmma.mma_async.sync.aligned", "mbarrier", "prmt.b32")
    for name, (n, k) in LINEARS_7B.items():
        epilogue = EPILOGUES_7B[name]
        for tiles, lane_lag in [(WG2_T128, None), TMA_TILES["lane 128x256 s5 lag1"]]:
            producer = "lane" if lane_lag is not None else "warp"
            label = {WG2_T128: "128x128"}.get(tiles, f"128x256_s{tiles.stages}")
            targets.append(CompileTarget(f"gemm_tma_{producer}_{epilogue}_{label}[{name} {n}x{k}]",
                                         tma_gemm_kernel(n, k, tiles, epilogue, k_chunks(k, tiles, epilogue),
                                                         lane_lag),
                                         tma_signature(types.float16 if epilogue == "gate_up_silu" else types.float32),
                                         feed, cc=(9, 0, "a")))
    return targets


if __name__ == "__main__":
    run(check, timings, "INT4 GEMM, us a call: the product's default tile against the TMA-fed kernel (weights rotated "
                        "through 2x the L2)")

"""The decode MLP as one kernel (RMSNorm, gate/up, SiLU product, down_proj and the residual add),
each block owning a slice of the intermediate rows, against the product's two GEMVs.

The product runs the MLP as two launches (kernels/gemv_int4.py): gate_up (70 MB at 7B) writes
mlp = silu(Wg x) * (Wu x) [18944], then down_proj (35 MB) stages all of mlp in every block and adds
Wd mlp into h. At 512 tokens of context they take 22.0 and 17.1 us a layer against 16.3 and 8.2 us of
bytes at the copy rate: down_proj cannot start its loads until gate_up's blocks leave its SMs (PDL's
residency limit, docs/DECODE.md), then waits for mlp and stages 37 KiB of it per block.

Here block b of a persistent grid (one block a SM) owns the intermediate rows [16 u_b, 16 u_b+1)
(u_b = b * units // grid, units = intermediate / 16: 8 or 9 units of 16 rows at 7B on 132 SMs):
1. before its wait it requests its first gate/up weights; then it stages RMSNorm(h) * w (the
   product's fused-norm staging, kernels/gemv_int4_paths.py);
2. its warps compute its 128-144 gate and up rows (a warp a row, the product's lane split and
   prmt arithmetic) and leave mlp for its slice in shared memory, float16 as the product stores it;
3. it multiplies that slice by the matching 128-144 columns of down_proj for all hidden rows: a
   partial Wd[:, slice] mlp[slice] of every output, a thread a row, its first down loads issued
   before the barrier that publishes mlp;
4. the partials [grid, hidden] float32 go to global memory and block b then adds outputs
   [b H / grid, (b+1) H / grid) over all partials, in block order, into h. With `barrier`, one
   kernel: a grid-wide barrier (an arrival counter and a generation, all blocks resident) between
   3 and 4; without, 4 is a second launch (what the simulator runs: it runs blocks one at a time).
Every addition's order is fixed by the grid, so graph and eager runs give the same bits; no atomic
adds of floats (docs/PERFORMANCE.md's split-K war story).

Why it is not the default: measured 42.2 us a layer with the barrier, 41.2 as two launches, against
39.7 for the product's pair (docs/PERFORMANCE.md, with the profile: one block of 16 warps a SM
issues an instruction every 1.9 cycles, latency-bound).

down_proj's slice of a row is 72 bytes (144 int4). `layout="tiled"`: its columns re-laid at load so
that block b's slice is contiguous and a warp's 8-byte loads read 256 contiguous bytes: word
(n, unit u, e) of block b at 2 H u_b + ((n // 32) U_b + u) 64 + (n % 32) 2 + e, and the block's at
most two group scales of row n at (2 b + g) H + n. `layout="rows"`: the product's row-major
matrices as they are (72 bytes at a stride of 9472 per row).

    python dev/mlp_fused.py          # float64 checks, then us a layer against the product's pair
"""

from __future__ import annotations

import functools
import math
import sys
from pathlib import Path

import numpy as np
from llvmlite import ir
from numba import cuda, float32, uint32
from numba.core import types
from numba.cuda.extending import intrinsic

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pynanoqwen.config import GROUP_SIZE  # noqa: E402
from pynanoqwen.kernels.gemv_int4_paths import U, dot8_prmt, gemv_path  # noqa: E402
from pynanoqwen.ptx import SIMULATOR, simulator_twin  # noqa: E402
from pynanoqwen.ptx.griddep import grid_dependency_wait, launch_dependents  # noqa: E402
from pynanoqwen.ptx.half2 import float2_to_half2, half2_to_float2  # noqa: E402
from pynanoqwen.ptx.loads import _is_vector, _load, ld_global_cg_f32, ld_global_nc_v4_u32  # noqa: E402
from pynanoqwen.ptx.mma import SHARED_ALIGNMENT, ld_shared_v4_u32  # noqa: E402
from pynanoqwen.ptx.warp import warp_sum  # noqa: E402

UNIT = 16  # intermediate rows per unit of the split: 16 int4 of a down_proj row = 8 bytes
DEPTH = 4  # gate/up items in flight per lane, as the product's gate_up plan
LAYOUTS = ("tiled", "rows")


def ld_global_nc_v2_u32_simulated(array, index):
    index = int(index)
    if index % 2:
        raise RuntimeError(f"ld_global_nc_v2_u32: index {index} is not 8-byte aligned")
    return (array[index], array[index + 1])


@simulator_twin(ld_global_nc_v2_u32_simulated)
@intrinsic
def ld_global_nc_v2_u32(typingctx, array, index):
    """(array[index], array[index + 1]) of a 1-D uint32 array, one 8-byte read-only load:
    `ld.global.nc.v2.u32` (index even)."""
    if not _is_vector(array, types.uint32, index):
        return None
    return types.UniTuple(types.uint32, 2)(array, index), _load("ld.global.nc.v2.u32", "r", ir.IntType(32), 2, False)


def unit_bounds(units: int, grid: int) -> list[int]:
    """u_b for b = 0 .. grid: block b owns units [u_b, u_b+1)."""
    return [b * units // grid for b in range(grid + 1)]


def most_units(intermediate: int, grid: int) -> int:
    """The most units a block owns (the kernel's loop bound and the oracle's rounding count)."""
    return -(-(intermediate // UNIT) // grid)


def check_shape(hidden: int, intermediate: int, grid: int) -> None:
    """Refuse a shape or grid the kernel cannot split: GROUP_SIZE multiples, and every block a
    non-empty slice within at most two scale groups (the two scales a row of down_proj carries)."""
    if intermediate % GROUP_SIZE or hidden % GROUP_SIZE or hidden % 32:
        raise ValueError(f"hidden {hidden} and intermediate {intermediate} must be multiples of {GROUP_SIZE}")
    bounds = unit_bounds(intermediate // UNIT, grid)
    for b in range(grid):
        first, last = UNIT * bounds[b], UNIT * bounds[b + 1] - 1
        if bounds[b + 1] == bounds[b] or last // GROUP_SIZE > first // GROUP_SIZE + 1:
            raise ValueError(f"block {b}'s slice [{first}, {last}] must be non-empty and span at most two "
                             f"scale groups (grid {grid} too large or too small for {intermediate})")


def tile_down(qweight: np.ndarray, scales: np.ndarray, grid: int) -> tuple[np.ndarray, np.ndarray]:
    """down_proj's (qweight uint32 [H, I/8], scales float16 [H, I/128]) in the tiled layout (module
    docstring): (words uint32 [H I / 8], scales float16 [2 grid H])."""
    hidden, words_per_row = qweight.shape
    bounds = unit_bounds(words_per_row // 2, grid)
    tiled_words, tiled_scales = [], np.zeros((grid, 2, hidden), np.float16)
    for b in range(grid):
        units = bounds[b + 1] - bounds[b]
        block = qweight[:, 2 * bounds[b]:2 * bounds[b + 1]].reshape(hidden // 32, 32, units, 2)
        tiled_words.append(block.transpose(0, 2, 1, 3).reshape(-1))
        group = UNIT * bounds[b] // GROUP_SIZE
        tiled_scales[b, 0] = scales[:, group]
        if group + 1 < scales.shape[1]:
            tiled_scales[b, 1] = scales[:, group + 1]
    return np.concatenate(tiled_words), tiled_scales.reshape(-1)


@functools.cache
def build(hidden: int, intermediate: int, grid: int, warps: int, layout: str, barrier: bool, eps: float,
          blocks_per_sm: int = 1):
    """(mlp kernel, reduce kernel or None) for one shape, grid (blocks, at most blocks_per_sm a SM,
    the launch bound) and variant. The kernel is
    mlp(gate_q, gate_s, up_q, up_s, down_q, down_s, h, norm_pairs, partials, sync) with flat arrays
    (down_q/down_s in `layout`), h float32 [H] (read, then += the MLP), partials float32
    [grid H], sync uint32 [2] (arrivals, generation; zero at first, as the barrier leaves them)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: one of {LAYOUTS}")
    check_shape(hidden, intermediate, grid)
    threads = 32 * warps
    shared_words, _, stage, load_x, multiply = gemv_path("prmt", hidden, 1, threads, eps)
    units = intermediate // UNIT
    units_max = most_units(intermediate, grid)
    chunks = U(hidden // 32)
    steps = U(-(-(hidden // 32) // 32))  # a lane's 512-byte steps along one gate/up row
    words_per_row, groups = U(hidden // 8), U(hidden // GROUP_SIZE)
    down_words_per_row, down_groups = U(intermediate // 8), U(intermediate // GROUP_SIZE)
    rows_per_thread = -(-hidden // threads)
    outputs_max = -(-hidden // grid)
    # array sizes, compile-time literals
    mlp_size, pair_words, sums_size, down_words = UNIT * units_max, UNIT * units_max // 2, warps * outputs_max, 2 * units_max
    H, G, T, W = U(hidden), U(grid), U(threads), U(warps)
    tiled = layout == "tiled"

    @cuda.jit(device=True, inline="always")
    def load_gate_up(gate_q, gate_s, up_q, up_s, first_row, lane, j, s, valid, words, scl):
        """Item (row j of this warp, step s): 16 bytes of its gate row and of its up row, and scales."""
        if valid:
            c = U(lane + U(U(32) * s))
            if c < chunks:
                at = U(U(first_row + U(j * W)) * words_per_row + U(U(4) * c))
                scale_at = U(U(first_row + U(j * W)) * groups + U(c // U(4)))
                words[0], words[1], words[2], words[3] = ld_global_nc_v4_u32(gate_q, at)
                words[4], words[5], words[6], words[7] = ld_global_nc_v4_u32(up_q, at)
                scl[0] = gate_s[scale_at]
                scl[1] = up_s[scale_at]

    @cuda.jit(device=True, inline="always")
    def compute_gate_up(lane, j, s, valid, words, scl, activations, xs, xv, acc, mlp_local, local_row):
        if valid:
            c = U(lane + U(U(32) * s))
            if c < chunks:
                load_x(xs, c, xv)
                multiply(words, 0, scl, 0, c, activations, xv, acc, 0)
                multiply(words, 4, scl, 1, c, activations, xv, acc, 1)
            if s == U(steps - U(1)):
                g = warp_sum(acc[0])
                u = warp_sum(acc[1])
                acc[0] = float32(0)
                acc[1] = float32(0)
                if lane == U(0):  # the product's silu epilogue; float16 rounding below
                    mlp_local[U(local_row + U(j * W))] = g / (float32(1) + math.exp(-g)) * u

    @cuda.jit(device=True, inline="always")
    def advance(j, s):
        s = U(s + U(1))
        if s == steps:
            return U(j + U(1)), U(0)
        return j, s

    @cuda.jit(device=True, inline="always")
    def slot(gate_q, gate_s, up_q, up_s, first_row, lane, j, s, item, index, items, words, scl, activations, xs, xv,
             acc, mlp_local, warp):
        """Pipeline slot `index`: compute its item (item + index), then load the one DEPTH later."""
        compute_gate_up(lane, j, s, U(item + index) < items, words, scl, activations, xs, xv, acc, mlp_local, warp)
        for _ in range(DEPTH):
            j, s = advance(j, s)
        load_gate_up(gate_q, gate_s, up_q, up_s, first_row, lane, j, s, U(U(item + index) + U(DEPTH)) < items, words,
                     scl)
        return j, s

    @cuda.jit(device=True, inline="always")
    def load_down(down_q, down_s, block, first_unit, block_units, m, t, words, scl):
        """Row n = t + T m of down_proj, this block's slice: its words and its two group scales."""
        n = U(t + U(m * T))
        if n < H:
            for u in range(units_max):
                if U(u) < block_units:
                    if tiled:
                        at = U(U(U(2) * H * first_unit) + U(U(U(U(n // U(32)) * block_units) + U(u)) * U(64))
                               + U(U(n % U(32)) * U(2)))
                    else:
                        at = U(U(n * down_words_per_row) + U(U(2) * U(first_unit + U(u))))
                    words[2 * u], words[2 * u + 1] = ld_global_nc_v2_u32(down_q, at)
            group = U(U(first_unit * U(UNIT)) // U(GROUP_SIZE))
            if tiled:
                scl[0] = down_s[U(U(U(U(2) * block) * H) + n)]
                scl[1] = down_s[U(U(U(U(2) * block + U(1)) * H) + n)]
            else:
                scl[0] = down_s[U(U(n * down_groups) + group)]
                scl[1] = down_s[U(U(n * down_groups) + U(group + U(1)))] if U(group + U(1)) < down_groups else scl[0]

    @cuda.jit(device=True, inline="always")
    def compute_down(block, first_unit, block_units, m, t, words, scl, mlp_pairs, partials):
        n = U(t + U(m * T))
        if n < H:
            group = U(first_unit // U(GROUP_SIZE // UNIT))
            acc = float32(0)
            for u in range(units_max):
                if U(u) < block_units:
                    x0, x1, x2, x3 = ld_shared_v4_u32(mlp_pairs, U(8 * u))
                    x4, x5, x6, x7 = ld_shared_v4_u32(mlp_pairs, U(8 * u + 4))
                    half2 = U(0)
                    half2 = dot8_prmt(words[2 * u], x0, x1, x2, x3, half2)
                    half2 = dot8_prmt(words[2 * u + 1], x4, x5, x6, x7, half2)
                    lo, hi = half2_to_float2(half2)
                    second = U(U(first_unit + U(u)) // U(GROUP_SIZE // UNIT)) != group
                    scale = float32(scl[1]) if second else float32(scl[0])
                    acc += scale * (lo + hi)
            partials[U(U(block * H) + n)] = acc

    @cuda.jit(device=True, inline="always")
    def reduce_into_h(h, partials, block, t, sums):
        """h[o] += the sum over blocks (in block order) of partials[., o], o this block's outputs."""
        first = U(U(block * H) // G)
        count = U(U(U(U(block + U(1)) * H) // G) - first)
        lane, warp = U(t % U(32)), U(t // U(32))
        j = lane
        while j < count:
            total = float32(0)
            p = warp
            while p < G:
                total += ld_global_cg_f32(partials, U(U(p * H) + U(first + j)))
                p = U(p + W)
            sums[U(U(warp * U(outputs_max)) + j)] = total
            j = U(j + U(32))
        cuda.syncthreads()
        if t < count:
            total = float32(0)
            for w in range(warps):
                total += sums[U(U(U(w) * U(outputs_max)) + t)]
            h[U(first + t)] = h[U(first + t)] + total

    @cuda.jit(device=True, inline="always")
    def grid_barrier(sync):
        """Every block of the grid has arrived (all are resident: one block a SM, grid <= SMs)."""
        cuda.threadfence()
        cuda.syncthreads()
        if cuda.threadIdx.x == 0:
            generation = cuda.atomic.add(sync, 1, U(0))
            cuda.threadfence()  # the generation is read before this block counts in
            if cuda.atomic.inc(sync, 0, U(grid - 1)) == U(grid - 1):  # the last: the count wraps to 0
                cuda.threadfence()
                cuda.atomic.add(sync, 1, U(1))
            else:
                while cuda.atomic.add(sync, 1, U(0)) == generation:
                    pass
            cuda.threadfence()
        cuda.syncthreads()

    bounds = {} if SIMULATOR else {"launch_bounds": (threads, blocks_per_sm)}

    @cuda.jit(**bounds)
    def mlp(gate_q, gate_s, up_q, up_s, down_q, down_s, h, norm_pairs, partials, sync):
        xs = cuda.shared.array(shared_words, uint32, alignment=SHARED_ALIGNMENT)
        mlp_local = cuda.shared.array(mlp_size, float32)
        mlp_pairs = cuda.shared.array(pair_words, uint32, alignment=SHARED_ALIGNMENT)
        sums = cuda.shared.array(sums_size, float32)
        w0 = cuda.local.array(8, uint32)
        w1 = cuda.local.array(8, uint32)
        w2 = cuda.local.array(8, uint32)
        w3 = cuda.local.array(8, uint32)
        s0 = cuda.local.array(2, types.float16)
        s1 = cuda.local.array(2, types.float16)
        s2 = cuda.local.array(2, types.float16)
        s3 = cuda.local.array(2, types.float16)
        xv = cuda.local.array(16, uint32)
        acc = cuda.local.array(2, float32)
        down_a = cuda.local.array(down_words, uint32)
        down_b = cuda.local.array(down_words, uint32)
        scale_a = cuda.local.array(2, types.float16)
        scale_b = cuda.local.array(2, types.float16)
        t = U(cuda.threadIdx.x)
        lane, warp, block = U(t % U(32)), U(t // U(32)), U(cuda.blockIdx.x)
        first_unit = U(U(block * U(units)) // G)
        block_units = U(U(U(U(block + U(1)) * U(units)) // G) - first_unit)
        block_rows = U(block_units * U(UNIT))
        # This warp's gate/up rows: warp, warp + W, ... of the block's slice; items (row j, step s).
        my_rows = U(U(U(block_rows - U(1) - warp) // W) + U(1)) if warp < block_rows else U(0)
        items = U(my_rows * steps)
        first_row = U(U(first_unit * U(UNIT)) + warp)
        j0, st0 = U(0), U(0)
        j1, st1 = advance(j0, st0)
        j2, st2 = advance(j1, st1)
        j3, st3 = advance(j2, st2)
        # 1. the weights do not depend on the kernel before: request them, then wait for h.
        load_gate_up(gate_q, gate_s, up_q, up_s, first_row, lane, j0, st0, U(0) < items, w0, s0)
        load_gate_up(gate_q, gate_s, up_q, up_s, first_row, lane, j1, st1, U(1) < items, w1, s1)
        load_gate_up(gate_q, gate_s, up_q, up_s, first_row, lane, j2, st2, U(2) < items, w2, s2)
        load_gate_up(gate_q, gate_s, up_q, up_s, first_row, lane, j3, st3, U(3) < items, w3, s3)
        grid_dependency_wait()
        activations = (h, norm_pairs)
        stage(activations, xs)
        acc[0] = float32(0)
        acc[1] = float32(0)
        # 2. gate/up rows, DEPTH items in flight per lane.
        item = U(0)
        while item < items:
            j0, st0 = slot(gate_q, gate_s, up_q, up_s, first_row, lane, j0, st0, item, U(0), items, w0, s0, activations,
                           xs, xv, acc, mlp_local, warp)
            j1, st1 = slot(gate_q, gate_s, up_q, up_s, first_row, lane, j1, st1, item, U(1), items, w1, s1, activations,
                           xs, xv, acc, mlp_local, warp)
            j2, st2 = slot(gate_q, gate_s, up_q, up_s, first_row, lane, j2, st2, item, U(2), items, w2, s2, activations,
                           xs, xv, acc, mlp_local, warp)
            j3, st3 = slot(gate_q, gate_s, up_q, up_s, first_row, lane, j3, st3, item, U(3), items, w3, s3, activations,
                           xs, xv, acc, mlp_local, warp)
            item = U(item + U(DEPTH))
        # 3. down_proj's first two rows of this thread are requested before mlp is published.
        load_down(down_q, down_s, block, first_unit, block_units, 0, t, down_a, scale_a)
        if rows_per_thread > 1:
            load_down(down_q, down_s, block, first_unit, block_units, 1, t, down_b, scale_b)
        cuda.syncthreads()
        if t < U(block_rows // U(2)):
            mlp_pairs[t] = float2_to_half2(mlp_local[U(2) * t], mlp_local[U(U(2) * t + U(1))])
        cuda.syncthreads()
        for m in range(0, rows_per_thread, 2):
            compute_down(block, first_unit, block_units, m, t, down_a, scale_a, mlp_pairs, partials)
            if m + 2 < rows_per_thread:
                load_down(down_q, down_s, block, first_unit, block_units, m + 2, t, down_a, scale_a)
            if m + 1 < rows_per_thread:
                compute_down(block, first_unit, block_units, m + 1, t, down_b, scale_b, mlp_pairs, partials)
                if m + 3 < rows_per_thread:
                    load_down(down_q, down_s, block, first_unit, block_units, m + 3, t, down_b, scale_b)
            if m + 3 >= rows_per_thread:
                launch_dependents()  # (a repeated trigger is harmless) this thread's last load is issued
        if barrier:
            grid_barrier(sync)
            reduce_into_h(h, partials, block, t, sums)

    if barrier:
        return mlp, None

    @cuda.jit(**bounds)
    def reduce(h, partials):
        sums = cuda.shared.array(sums_size, float32)
        grid_dependency_wait()
        launch_dependents()
        reduce_into_h(h, partials, U(cuda.blockIdx.x), U(cuda.threadIdx.x), sums)

    return mlp, reduce


class FusedMlp:
    """One layer's decode MLP: h += Wd (silu(Wg xn) * (Wu xn)), xn = RMSNorm(h) * norm_weight."""

    def __init__(self, gate, up, down, norm_weight, eps, grid, warps=16, layout="tiled", barrier=True, blocks_per_sm=1):
        self.hidden, self.intermediate = down[0].shape[0], gate[0].shape[0]
        self.grid, self.warps = grid, warps
        self.kernel, self.reduce = build(self.hidden, self.intermediate, grid, warps, layout, barrier, float(eps),
                                         blocks_per_sm)
        down_q, down_s = tile_down(*down, grid) if layout == "tiled" else (down[0].reshape(-1), down[1].reshape(-1))
        flat = [gate[0], gate[1], up[0], up[1], down_q, down_s]
        self.weights = [cuda.to_device(np.ascontiguousarray(a).reshape(-1)) for a in flat]
        self.norm_pairs = cuda.to_device(np.ascontiguousarray(norm_weight, np.float16).view(np.uint32))
        self.partials = cuda.device_array(grid * self.hidden, np.float32)
        self.sync = cuda.to_device(np.zeros(2, np.uint32))

    def launch(self, stream, h) -> None:
        from pynanoqwen.launch import launch

        launch(self.kernel, self.grid, 32 * self.warps, stream,
               (*self.weights, h, self.norm_pairs, self.partials, self.sync))
        if self.reduce is not None:
            launch(self.reduce, self.grid, 32 * self.warps, stream, (h, self.partials))


def oracle(gate, up, down, norm_weight, eps, h, grid, exact=False):
    """(h + Wd mlp, bound) of FusedMlp on grid blocks: the product's RMSNorm and gate/up bounds
    (oracles.py), then for down_proj: mlp is read within silu_product_oracle's bound mb of the exact
    product (|Wd| mb); per 16-input unit each FP16 half-accumulator rounds 8 times by at most u16 of
    its partial sum (8 u16 |Wd| |mlp|); in float32 each unit rounds 3 times (halves summed, scale,
    accumulate) over at most units_max units, the reduction adds at most grid + 1 partials per
    output (the warps' strided sums, then the sums of the warps) and the residual once: (3 units_max
    + grid + 2) u32 of (|h| + |Wd| |mlp|).

    exact (random_case's exact inputs): every |h| is the same, so RMSNorm(h) * w is w within a few
    u32 relative, and its float16 rounding gives +-w itself, a multiple of 1/8 of magnitude <= 1.5;
    a gate/up lane's FP16 half-accumulator then sums 16 products of integer weights in [-8, 7] and
    such x, multiples of 1/8 below 192: exact in FP16 (1536 eighths < 2^11). So the gate/up bound
    loses its 16 u16 term, and mlp is known to a few u16 of itself: an error in down_proj's layout
    or scales shows far above the bound (the Gaussian case's bound is of the size of the output)."""
    from pynanoqwen.oracles import U16, U32, gemv_oracle, rmsnorm_oracle, silu_product_oracle
    from pynanoqwen.quant import dequantize_int4

    xn, xn_bound = rmsnorm_oracle(h, norm_weight, eps)
    projections = []
    for q, s in (gate, up):
        expected, bound = gemv_oracle(q, s, xn, "prmt", xn_bound)
        if exact:
            bound = bound - 16 * U16 * (np.abs(dequantize_int4(q, s, np.float64)) @ (np.abs(xn) + xn_bound))
        projections += [expected, bound]
    mlp, mlp_bound = silu_product_oracle(*projections)
    wd = dequantize_int4(*down, np.float64)
    magnitude = np.abs(wd) @ (np.abs(mlp) + mlp_bound)
    units_max = most_units(gate[0].shape[0], grid)
    expected = h.astype(np.float64) + wd @ mlp
    bound = np.abs(wd) @ mlp_bound + 8 * U16 * magnitude + (3 * units_max + grid + 2) * U32 * (np.abs(h) + magnitude)
    return expected, bound


def random_case(rng, hidden, intermediate, exact=False):
    """Fresh random INT4 gate/up/down, norm weight and h (Gaussian, never zeros); exact: h = +-3 with
    random signs and a norm weight of random multiples of 1/8 in [0.5, 1.5] (oracle says why)."""
    from harness import random_int4

    gate, up = random_int4(rng, intermediate, hidden), random_int4(rng, intermediate, hidden)
    down = random_int4(rng, hidden, intermediate)
    if exact:
        norm_weight = (rng.integers(4, 13, hidden) / 8).astype(np.float16)
        h = (3 * rng.choice([-1.0, 1.0], hidden)).astype(np.float32)
    else:
        norm_weight = rng.uniform(0.5, 1.5, hidden).astype(np.float16)
        h = (3 * rng.standard_normal(hidden)).astype(np.float32)
    return gate, up, down, norm_weight, h


VARIANTS = {"tiled, barrier": dict(layout="tiled", barrier=True),
            "tiled, 2 launches": dict(layout="tiled", barrier=False),
            "rows, barrier": dict(layout="rows", barrier=True),
            "tiled, barrier, 2 blocks of 8 warps a SM": dict(layout="tiled", barrier=True, warps=8, blocks_per_sm=2),
            "tiled, 2 launches, 2 blocks of 8 warps a SM": dict(layout="tiled", barrier=False, warps=8, blocks_per_sm=2)}


def check(rng, hidden=None, intermediate=None, grid=None, warps=16, variants=VARIANTS, cases=("exact", "gaussian"),
          launches=2):
    """Each variant against float64 on fresh random inputs of each case (7B shapes on the GPU's SMs
    unless given); each runs `launches` times from the same h, which must give the same bits (a
    barrier count left behind would hang the second run or let it read stale partials)."""
    from harness import SEVEN_B
    from pynanoqwen.device import sm_count
    from pynanoqwen.oracles import bound_report, passed

    hidden = hidden or SEVEN_B.hidden_size
    intermediate = intermediate or SEVEN_B.intermediate_size
    eps = SEVEN_B.rms_norm_eps
    results = []
    for case in cases:
        gate, up, down, norm_weight, h = random_case(rng, hidden, intermediate, exact=case == "exact")
        for name, variant in variants.items():
            variant = {"warps": warps} | variant
            blocks = grid or variant.get("blocks_per_sm", 1) * sm_count()
            expected, bound = oracle(gate, up, down, norm_weight, eps, h, blocks, exact=case == "exact")
            fused = FusedMlp(gate, up, down, norm_weight, eps, blocks, **variant)
            outs = []
            for _ in range(launches):
                h_device = cuda.to_device(h)
                fused.launch(0, h_device)
                outs.append(h_device.copy_to_host())
            error = np.abs(outs[0].astype(np.float64) - expected)
            results.append(bound_report(f"{name}, {case}, grid {blocks}", error, bound))
            if launches > 1:
                results.append(passed(f"{name}, {case}: {launches} runs", all(np.array_equal(o, outs[0]) for o in outs),
                                      "bit-identical"))
    return results


def timings(layers: int = 28, replays: int = 20) -> list[dict]:
    """us a layer: 28 MLPs in one CUDA graph (PDL), weights rotated through twice the L2, for the
    product's gate_up + down_proj pair and each variant."""
    from harness import SEVEN_B
    from pynanoqwen.device import sm_count
    from pynanoqwen.gpu_timing import copy_bandwidth, time_graph, weight_copies
    from pynanoqwen.kernels.gemv_int4 import gemv_bytes, make_gate_up_silu, make_gemv_int4

    hidden, intermediate, eps = SEVEN_B.hidden_size, SEVEN_B.intermediate_size, SEVEN_B.rms_norm_eps
    nbytes = 2 * gemv_bytes(intermediate, hidden) + gemv_bytes(hidden, intermediate)
    copies = weight_copies(nbytes)
    rng = np.random.default_rng(0)
    cases = [random_case(rng, hidden, intermediate) for _ in range(copies)]
    stream = cuda.stream()
    h = cuda.to_device(cases[0][4])
    mlp = cuda.device_array(intermediate, np.float16)
    copy = copy_bandwidth()
    pairs = []
    for gate, up, down, norm_weight, _ in cases:
        pairs.append((make_gate_up_silu(intermediate, hidden, *gate, *up, norm_weight=norm_weight, norm_eps=eps),
                      make_gemv_int4(hidden, intermediate, *down)))

    def product():
        for layer in range(layers):
            gate_up, down = pairs[layer % copies]
            gate_up.launch(stream, h, mlp)
            down.launch(stream, mlp, h, residual=True)

    forms = {"product gate_up + down": product}
    for name, variant in VARIANTS.items():
        blocks = variant.get("blocks_per_sm", 1) * sm_count()
        fused = [FusedMlp(g, u, d, w, eps, blocks, **variant) for g, u, d, w, _ in cases]
        forms[name] = lambda fused=fused: [fused[layer % copies].launch(stream, h) for layer in range(layers)]
    rows = []
    for name, enqueue in forms.items():
        us = 1e6 * time_graph(stream, enqueue, replays) / layers
        rows.append({"form": name, "us a layer": us, "GB/s": nbytes / us / 1e3,
                     "share of copy": f"{100 * nbytes / (us * 1e-6) / copy:.0f}%"})
    return rows


def compile_targets():
    """The 7B kernels on 132 SMs, for tests/test_dev_variants.py."""
    from harness import SEVEN_B
    from pynanoqwen.kernels import CompileTarget

    flat_u32, flat_f16, flat_f32 = types.uint32[::1], types.float16[::1], types.float32[::1]
    signature = types.void(flat_u32, flat_f16, flat_u32, flat_f16, flat_u32, flat_f16, flat_f32, flat_u32, flat_f32,
                           flat_u32)
    targets = []
    for name, variant in VARIANTS.items():
        blocks_per_sm = variant.get("blocks_per_sm", 1)
        kernel, _ = build(SEVEN_B.hidden_size, SEVEN_B.intermediate_size, 132 * blocks_per_sm, variant.get("warps", 16),
                          variant["layout"], variant["barrier"], SEVEN_B.rms_norm_eps, blocks_per_sm)
        must = ("ld.global.nc.v2.u32", "ld.global.nc.v4.u32", "prmt.b32", "griddepcontrol.wait")
        must += ("atom.global.inc.u32",) if variant["barrier"] else ()
        targets.append(CompileTarget(f"mlp_fused[{name}]", kernel, signature, must))
    return targets


if __name__ == "__main__":
    from harness import run

    run(check, timings, "decode MLP, us a layer (28 layers in a graph)")

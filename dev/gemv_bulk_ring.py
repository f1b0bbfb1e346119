"""The residual INT4 GEMV (o_proj, down_proj: h += W x) with its weights streamed by the copy
engine into a shared-memory ring, against the product's register-pipelined GEMV.

The product's GEMV (kernels/gemv_int4_kernel.py) keeps `depth` 16-byte loads a lane in flight:
at 16 warps a SM and depth 4 that is 32 KiB a SM, about what Little's law asks for at the copy
rate, and each lane's pipeline restarts its DRAM round trip at every stall. At 7B, down_proj takes
17.2 us a call for 8.2 us of bytes and o_proj 5.7 for 1.5 (docs/PERFORMANCE.md).

Here block b of a one-block-a-SM grid owns the consecutive rows [b N / grid, (b + 1) N / grid),
whose qweight is one contiguous span of memory. A producer warp's lane 0 copies that span, RS rows
at a time, into a ring of S stages with `cp.async.bulk` (ptx/bulk_copy.py), each stage completing
on its `full` mbarrier; the first S stages are requested before `griddepcontrol.wait`, so up to
S x RS rows (151 KiB a SM for down_proj at RS 2, S 8; all of o_proj's rows) are in flight while the
kernel before this one finishes, with no register holding them. The W consumer warps stage x (the
product's prmt layout) and the block's scales, then walk the stages. They form G row groups of
P = W / G warps: group g takes rows g, g + G, ... of each stage (RS / G of them) and its 32 P lanes
split the K/32 16-byte chunks, a lane a chunk; a lane loads its chunk of x once and multiplies it
by the chunk of each of its rows, with the product's prmt arithmetic
(kernels/gemv_int4_paths.dot8_prmt). Every lane arrives on the stage's `empty` mbarrier once it has
read its chunks, and the producer refills the stage when all have. A warp's sum of its part of a
row goes to shared memory; at the end thread r adds row r's P parts in order into h[row]. Every
addition's order is fixed by the shape, so repeated runs give the same bits; no atomics.

Rounding (within oracles.gemv_oracle's bound, which counts K/32 + 8 float32 roundings a row): a
lane rounds 2 C + 1 times a chunk (the sum of its C FP16 accumulators' 2 C halves, the scale, the
accumulation) over at most ceil(K / (32 * 32 P)) chunks of a row, then 5 warp_sum steps, P - 1
additions of the parts and the residual add; each FP16 half-accumulator rounds at most as in the
product (16 u16; 16 / C times with C chains). check_shape refuses a shape where that count exceeds
the oracle's.

Why it is not the default: measured 16.7 us for down_proj against the product's 17.3-17.5 and
5.0 for o_proj against 5.7-5.9 (docs/PERFORMANCE.md, with Nsight Compute's view): the bytes in
flight were not down_proj's limit; its consumers wait on their shared-memory loads, as the
product's do. o_proj's gain (~25 us a step) has no engine path yet.

    python dev/gemv_bulk_ring.py      # float64 checks, then us a call against the product
"""

from __future__ import annotations

import collections
import functools
import sys
from pathlib import Path

import numpy as np
from numba import cuda, float32, uint32
from numba.core import types

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pynanoqwen.config import GROUP_SIZE  # noqa: E402
from pynanoqwen.kernels.gemm_int4_wgmma import SHARED_LIMIT  # noqa: E402
from pynanoqwen.kernels.gemv_int4_paths import CHUNK_STRIDE, U, dot8_prmt  # noqa: E402
from pynanoqwen.ptx import SIMULATOR  # noqa: E402
from pynanoqwen.ptx.bulk_copy import bulk_copy_to_shared  # noqa: E402
from pynanoqwen.ptx.griddep import grid_dependency_wait, launch_dependents  # noqa: E402
from pynanoqwen.ptx.half2 import half2_to_float2  # noqa: E402
from pynanoqwen.ptx.mbarrier import (fence_barrier_init, mbarrier_arrive, mbarrier_arrive_expect_tx,  # noqa: E402
                                     mbarrier_init, mbarrier_wait)
from pynanoqwen.ptx.mma import cp_async_16, cp_async_commit_group, cp_async_wait_group, ld_shared_v4_u32  # noqa: E402
from pynanoqwen.ptx.warp import warp_sum  # noqa: E402


def most_rows(n: int, grid: int) -> int:
    """The most rows a block owns: block b has rows [b n // grid, (b + 1) n // grid)."""
    return max((b + 1) * n // grid - b * n // grid for b in range(grid))


# chains: independent FP16 accumulators a chunk (1, 2 or 4): the product's one chain is 16
# dependent fma.rn.f16x2 long; 2 chains halve the dependent latency for 2 more float32 roundings.
Setting = collections.namedtuple("Setting", "rows_per_stage stages warps row_groups chains", defaults=(1,))


def layout(n: int, k: int, grid: int, setting: Setting) -> dict[str, int]:
    """Word offsets of the dynamic shared memory's parts (ring, x, scales, parts) and its bytes."""
    rows = most_rows(n, grid)
    parts = setting.warps // setting.row_groups
    ring = setting.stages * setting.rows_per_stage * (k // 8)
    x = CHUNK_STRIDE * (k // 32)
    scales = -(-rows * (k // GROUP_SIZE) // 2 // 4) * 4  # pairs of halves, to a 16-byte boundary
    offsets = {"ring": 0, "x": ring, "scales": ring + x, "parts": ring + x + scales}
    return offsets | {"bytes": 4 * (offsets["parts"] + rows * parts)}


def check_shape(n: int, k: int, grid: int, setting: Setting) -> None:
    """Refuse what the kernel cannot do: row groups that do not divide the warps and the stage's
    rows, odd scale pairs, a ring past shared memory, or more roundings a row than
    oracles.gemv_oracle's bound counts (module docstring)."""
    rows_per_stage, _, warps, groups, _ = setting
    if warps % groups or rows_per_stage % groups or setting.chains not in (1, 2, 4) or k % 256 or grid > n:
        raise ValueError(f"{setting}: row_groups must divide warps and rows_per_stage, K {k} be a multiple of 256 "
                         f"and the grid {grid} at most N {n}")
    parts = warps // groups
    roundings = (2 * setting.chains + 1) * -(-(k // 32) // (32 * parts)) + 5 + parts
    if roundings > k // 32 + 8:
        raise ValueError(f"{roundings} roundings a row exceed the oracle's {k // 32 + 8}")
    nbytes = layout(n, k, grid, setting)["bytes"]
    if nbytes > SHARED_LIMIT:
        raise ValueError(f"{nbytes} bytes of shared memory exceed a block's {SHARED_LIMIT}")


@functools.cache
def build(n: int, k: int, grid: int, setting: Setting):
    """gemv(qweight, scale_pairs, x_pairs, h): h[N] += W x for uint32 qweight [N K/8], the float16
    scales [N K/128] and x [K] as uint32 pairs, on `grid` blocks of `warps` consumer warps + a
    producer; K/128 is even (check_shape), so a block's scales start on a pair."""
    check_shape(n, k, grid, setting)
    rows_per_stage, stages, warps, groups, chains = setting
    offsets = layout(n, k, grid, setting)
    RING, X, SCALES, PARTS = (U(offsets[name]) for name in ("ring", "x", "scales", "parts"))
    RS, S, W, G_ROWS = U(rows_per_stage), U(stages), U(warps), U(groups)
    P = U(warps // groups)  # warps a row group: a row's parts
    ROWS_PER_LANE = rows_per_stage // groups
    GROUP_LANES = U(32 * (warps // groups))
    ROW_WORDS = U(k // 8)
    STAGE_WORDS = U(rows_per_stage * (k // 8))
    CHUNKS = U(k // 32)
    GROUPS = U(k // GROUP_SIZE)
    QUADS = U(k // 8)  # 16-byte pieces of x
    N, G = U(n), U(grid)
    THREADS = U(32 * (warps + 1))
    CONSUMER_THREADS = U(32 * warps)

    @cuda.jit(device=True, inline="always")
    def fill(qweight, words, full, first_row, rows, j):
        """Stage j % S <- rows [j RS, j RS + RS) of the block's (fewer in the last stage)."""
        s = U(j % S)
        count = min(RS, U(rows - U(j * RS)))
        nbytes = U(U(count * ROW_WORDS) * U(4))
        at = U(RING + U(s * STAGE_WORDS))
        src = U(U(first_row + U(j * RS)) * ROW_WORDS)
        mbarrier_arrive_expect_tx(full, s, nbytes)
        bulk_copy_to_shared(words[at:at + U(count * ROW_WORDS)], qweight[src:src + U(count * ROW_WORDS)], nbytes,
                            full, s)

    @cuda.jit(**({} if SIMULATOR else {"launch_bounds": (int(THREADS), 1)}))
    def gemv(qweight, scale_pairs, x_pairs, h):
        full = cuda.shared.array(stages, types.uint64)  # stage holds its rows
        empty = cuda.shared.array(stages, types.uint64)  # every consumer lane is done with it
        words = cuda.shared.array(0, uint32)  # ring, x, scales (dynamic shared memory)
        floats = cuda.shared.array(0, float32)  # the same memory: the parts' sums
        t = U(cuda.threadIdx.x)
        warp, lane = U(t // U(32)), U(t % U(32))
        block = U(cuda.blockIdx.x)
        first_row = U(U(block * N) // G)
        rows = U(U(U(U(block + U(1)) * N) // G) - first_row)
        total_stages = U(U(rows + RS - U(1)) // RS)
        if t == U(0):
            for s in range(stages):
                mbarrier_init(full, s, 1)  # the producer's arrive.expect_tx; the copy adds the bytes
                mbarrier_init(empty, s, int(CONSUMER_THREADS))
            fence_barrier_init()
        cuda.syncthreads()
        # The weights do not depend on the kernel before this one: the first round of the ring is
        # requested before the wait, and so are the block's scales (as pairs of halves).
        if warp == W and lane == U(0):
            j = U(0)
            while j < min(S, total_stages):
                fill(qweight, words, full, first_row, rows, j)
                j = U(j + U(1))
        scale_words = U(U(rows * GROUPS) // U(2))
        scale_first = U(U(first_row * GROUPS) // U(2))
        i = t
        while i < scale_words:
            words[U(SCALES + i)] = scale_pairs[U(scale_first + i)]
            i = U(i + THREADS)
        grid_dependency_wait()  # x and h come from the kernels before (launch.py)
        q = t
        while q < QUADS:  # x into the prmt layout, every copy in flight at once (gemv_int4_paths)
            cp_async_16(words, U(X + U(U(CHUNK_STRIDE) * U(q // U(4))) + U(U(4) * U(q % U(4)))), x_pairs, U(U(4) * q),
                        U(16))
            q = U(q + THREADS)
        cp_async_commit_group()
        cp_async_wait_group(0)
        cuda.syncthreads()

        if warp == W:
            if lane == U(0):
                j = S
                while j < total_stages:
                    # Refill j // S of a stage waits for the consumers' release of fill j // S - 1.
                    mbarrier_wait(empty, U(j % S), U(U(U(j // S) - U(1)) & U(1)))
                    fill(qweight, words, full, first_row, rows, j)
                    j = U(j + U(1))
            launch_dependents()  # the last copy is requested: the next kernel may start
        else:
            group, part = U(warp // P), U(warp % P)
            first_chunk = U(U(part * U(32)) + lane)  # this lane's chunks: first_chunk + 32 P i
            xv = cuda.local.array(16, uint32)
            acc = cuda.local.array(ROWS_PER_LANE, float32)
            for r in range(ROWS_PER_LANE):
                acc[r] = float32(0)
            j = U(0)
            while j < total_stages:
                if j == U(total_stages - U(1)):
                    launch_dependents()
                s = U(j % S)
                mbarrier_wait(full, s, U(U(j // S) & U(1)))
                stage_row = U(j * RS)
                c = first_chunk
                while c < CHUNKS:
                    for e in range(4):
                        xv[4 * e], xv[4 * e + 1], xv[4 * e + 2], xv[4 * e + 3] = \
                            ld_shared_v4_u32(words, U(X + U(U(U(CHUNK_STRIDE) * c) + U(4 * e))))
                    for r in range(ROWS_PER_LANE):
                        row_in_stage = U(group + U(U(r) * G_ROWS))
                        local_row = U(stage_row + row_in_stage)
                        if local_row < rows:
                            at = U(RING + U(U(U(s * STAGE_WORDS) + U(row_in_stage * ROW_WORDS)) + U(U(4) * c)))
                            w0, w1, w2, w3 = ld_shared_v4_u32(words, at)
                            zero = U(0)  # half2 (0, 0)
                            if chains == 1:
                                half = dot8_prmt(w0, xv[0], xv[1], xv[2], xv[3], zero)
                                half = dot8_prmt(w1, xv[4], xv[5], xv[6], xv[7], half)
                                half = dot8_prmt(w2, xv[8], xv[9], xv[10], xv[11], half)
                                half = dot8_prmt(w3, xv[12], xv[13], xv[14], xv[15], half)
                                lo, hi = half2_to_float2(half)
                                chunk = lo + hi
                            elif chains == 2:
                                half_a = dot8_prmt(w1, xv[4], xv[5], xv[6], xv[7],
                                                   dot8_prmt(w0, xv[0], xv[1], xv[2], xv[3], zero))
                                half_b = dot8_prmt(w3, xv[12], xv[13], xv[14], xv[15],
                                                   dot8_prmt(w2, xv[8], xv[9], xv[10], xv[11], zero))
                                lo_a, hi_a = half2_to_float2(half_a)
                                lo_b, hi_b = half2_to_float2(half_b)
                                chunk = (lo_a + hi_a) + (lo_b + hi_b)
                            else:
                                lo_0, hi_0 = half2_to_float2(dot8_prmt(w0, xv[0], xv[1], xv[2], xv[3], zero))
                                lo_1, hi_1 = half2_to_float2(dot8_prmt(w1, xv[4], xv[5], xv[6], xv[7], zero))
                                lo_2, hi_2 = half2_to_float2(dot8_prmt(w2, xv[8], xv[9], xv[10], xv[11], zero))
                                lo_3, hi_3 = half2_to_float2(dot8_prmt(w3, xv[12], xv[13], xv[14], xv[15], zero))
                                chunk = ((lo_0 + hi_0) + (lo_1 + hi_1)) + ((lo_2 + hi_2) + (lo_3 + hi_3))
                            g = U(U(local_row * GROUPS) + U(c // U(4)))
                            s_lo, s_hi = half2_to_float2(words[U(SCALES + U(g // U(2)))])
                            acc[r] += (s_hi if g % U(2) else s_lo) * chunk
                    c = U(c + GROUP_LANES)
                mbarrier_arrive(empty, s)  # this lane has read its chunks of the stage
                for r in range(ROWS_PER_LANE):
                    local_row = U(stage_row + U(group + U(U(r) * G_ROWS)))
                    total = warp_sum(acc[r])
                    acc[r] = float32(0)
                    if lane == U(0) and local_row < rows:
                        floats[U(PARTS + U(U(local_row * P) + part))] = total
                j = U(j + U(1))
        cuda.syncthreads()
        if t < rows:
            total = float32(0)
            for p in range(warps // groups):
                total += floats[U(PARTS + U(U(t * P) + U(p)))]
            h[U(first_row + t)] += total

    return gemv, offsets["bytes"]


class BulkRingGemv:
    """h[N] += W x through the bulk-copy ring, for one INT4 linear (module docstring)."""

    def __init__(self, n, k, qweight, scales, grid, setting):
        from pynanoqwen.kernels import on_device

        self.n, self.k, self.grid, self.warps = n, k, grid, setting.warps
        self.kernel, self.shared_bytes = build(n, k, grid, setting)
        self.qweight = on_device(qweight, np.uint32).reshape(n * k // 8)
        self.scale_pairs = on_device(scales, np.float16).reshape(n * k // GROUP_SIZE).view(np.uint32)

    def launch(self, stream, x, h) -> None:
        """h float32 [N] += W x, x float16 [K] on the device."""
        from pynanoqwen.launch import launch

        launch(self.kernel, self.grid, 32 * (self.warps + 1), stream,
               (self.qweight, self.scale_pairs, x.reshape(self.k).view(np.uint32), h.reshape(self.n)),
               shared_bytes=self.shared_bytes)


def label(setting: Setting) -> str:
    return "RS{} S{} W{} G{} C{}".format(*setting)


# The settings timed at each 7B residual linear (o_proj's whole block fits its ring). With G = RS a
# row group is one row of each stage; with fewer groups a lane reuses its x chunk over RS / G rows.
SETTINGS = {"o_proj": [Setting(4, 8, 16, 4), Setting(8, 4, 8, 2), Setting(8, 4, 8, 2, 2), Setting(8, 4, 8, 2, 4),
                       Setting(8, 4, 16, 4, 2)],
            "down_proj": [Setting(4, 4, 16, 4), Setting(4, 4, 20, 2), Setting(4, 4, 20, 2, 2), Setting(4, 4, 20, 2, 4),
                          Setting(4, 4, 10, 1, 2), Setting(4, 4, 16, 4, 2)]}


def check(rng, shapes=None, grid=None, settings=SETTINGS, launches=2):
    """Each setting against float64 (oracles.gemv_oracle, plus one u32 of |h + W x| for the residual
    add) on fresh Gaussian x and h and random INT4 weights, 7B shapes on the GPU's SMs unless given;
    each runs `launches` times from the same h, which must give the same bits."""
    from harness import LINEARS_7B, random_int4, residual_gemv_checks
    from pynanoqwen.device import sm_count
    from pynanoqwen.oracles import U32, gemv_oracle

    shapes = shapes or {name: LINEARS_7B[name] for name in settings}
    results = []
    for name, (n, k) in shapes.items():
        qweight, scales = random_int4(rng, n, k)
        x = rng.standard_normal(k).astype(np.float16)
        h = (3 * rng.standard_normal(n)).astype(np.float32)
        product, bound = gemv_oracle(qweight, scales, x, "prmt")
        expected = h.astype(np.float64) + product
        bound = bound + U32 * (np.abs(h) + np.abs(product) + bound)
        blocks = grid or sm_count()
        for setting in settings[name]:
            gemv = BulkRingGemv(n, k, qweight, scales, blocks, setting)
            results += residual_gemv_checks(
                f"{name} {label(setting)}, grid {blocks}", gemv, x, h, expected, bound, launches)
    return results


def timings(replays: int = 20) -> list[dict]:
    """us a call of the product's GEMV (its default plan) and of each setting, back-to-back PDL
    launches in a CUDA graph with the weights rotated through twice the L2 (harness.time_calls)."""
    from harness import LINEARS_7B, residual_gemv_timings
    from pynanoqwen.device import sm_count

    def variants(name):
        return {label(setting): lambda n, k, qweight, scales, setting=setting: BulkRingGemv(
            n, k, qweight, scales, sm_count(), setting).launch for setting in SETTINGS[name]}

    return residual_gemv_timings({name: LINEARS_7B[name] for name in SETTINGS}, variants, replays)


def compile_targets():
    """The 7B settings on 132 SMs, for tests/test_dev_variants.py."""
    from harness import LINEARS_7B
    from pynanoqwen.kernels import CompileTarget

    signature = types.void(types.uint32[::1], types.uint32[::1], types.uint32[::1], types.float32[::1])
    must = ("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes", "mbarrier.try_wait.parity.shared::cta.b64",
            "ld.shared.v4.u32", "prmt.b32", "fma.rn.f16x2", "griddepcontrol.wait", "griddepcontrol.launch_dependents")
    targets = []
    for name, settings in SETTINGS.items():
        n, k = LINEARS_7B[name]
        for setting in settings:
            kernel, _ = build(n, k, 132, setting)
            targets.append(CompileTarget(f"gemv_bulk_ring[{name} {label(setting)}]", kernel, signature, must))
    return targets


if __name__ == "__main__":
    from harness import run

    run(check, timings, "residual GEMV at 7B, us a call (PDL, weights rotated through twice the L2)")

"""The INT4 GEMV on the tensor cores: mma.sync m16n8k16 with the weights as A, the token as B.

Why. Profiled, the product's GEMV (kernels/gemv_int4.py) issues about 0.4 instructions a cycle per
scheduler while DRAM runs at 35% of its peak (docs/PERFORMANCE.md): at that instruction count per
weight, the copy rate would need about one instruction every cycle on every scheduler, which no
kernel issues. Per packed word (8 weights) it spends 2 prmt + 4 AND on the unpack, 4 FP16x2 FMAs
that remove the nibble offset, 4 more that multiply by x, and a share of the x loads from shared
memory and the warp sums. This variant keeps the unpack's 2 prmt + 4 AND and hands the rest to the
tensor core:

- A (16 x 16, FP16) is 16 rows of weights *with the offset still in*: after the AND, a low-nibble
  half is 1024 + u = 1032 + w, a high-nibble half 1024 + 16 u = 16 (72 + w) (kernels/int4_unpack.py).
  Lane (g, t) holds rows g and g + 8; the four lanes t = 0..3 of a row hold its chunks 4G .. 4G + 3,
  so one item, 16 rows x 128 inputs, is exactly one scale group G: each lane loads 16 bytes of
  each of its two rows. Per word pair (rows g, g + 8) two mmas: one over the low-nibble pairs
  (w0, w1), (w4, w5), one over the high-nibble pairs (w2, w3), (w6, w7).
- B (16 x 8) is x, the same in all 8 columns: lane (g, t) needs x of its own chunk only, 64 bytes
  from shared memory. (The same instructions would compute 8 different tokens in the 8 columns,
  each column's sums independent of the others: a candidate for prompt lookup's verify pass,
  docs/SPECULATIVE.md; not built.)
- The offsets come off once per group and row: sum_k w_k x_k = D_lo + D_hi / 16 - C_G, where
  C_G = 1032 sum of x over the group's low positions + 72 sum over its high positions, computed
  once per block while x is staged. Then acc += scale (D_lo + D_hi / 16 - C_G) in FP32.
- The mma sums over the four lanes of a row itself, so there is no warp_sum: lane (g, 0) holds
  rows g and g + 8 of every group it computed.

Per word: 6 integer instructions and 1 mma instead of 14, plus a quarter of a 16-byte shared load.
The arithmetic is also more exact than the product's FP16 accumulators (the bound below).

Work split: the items (tile, group), tile-major, are cut into one equal run per warp of the grid.
A warp finishes the tiles its run covers from group 0 to the last group itself; for a tile split
between warps each writes its partial sums to global scratch, fences, and counts in on the tile's
counter; the last to arrive adds the partials in warp order (so the bits never depend on who
arrives last), applies the epilogue and resets the counter for the next launch (the pattern of
kernels/attention_decode.py's split merge). Programmatic dependent launch as in the product: the
first `depth` items' loads go out before griddepcontrol.wait.

Why it is not the default: slower than the product on the short shapes (o_proj, down_proj, qkv),
whose runs are a few items a warp with the split-tile merge in every warp's tail; faster on the
long ones only with the weights repacked in item order (`blocked_layout`), which the file and the
prefill GEMM do not use. It has only the residual epilogue (out += W x): no fused RMSNorm, RoPE or
gate/up, and no engine path. Run `python dev/gemv_mma.py` for its float64 checks and its timing
against the product; figures are in docs/PERFORMANCE.md (2026-12-02 morning), taken before the
product's own x staging got 20-30% faster, which widened the gap on the short shapes.
"""

from __future__ import annotations

import collections
import functools
import sys
from pathlib import Path

import numpy as np
from numba import cuda, float32, uint32
from numba.core import types

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pynanoqwen.config import GROUP_SIZE  # noqa: E402
from pynanoqwen.kernels.gemv_int4_paths import CHUNK_STRIDE  # noqa: E402
from pynanoqwen.kernels.int4_unpack import (HIGH_NIBBLES, LOW_NIBBLES, MAGIC_EXPONENTS, SELECT_BYTES_0_1,  # noqa: E402
                                            SELECT_BYTES_2_3)
from pynanoqwen.ptx import SIMULATOR  # noqa: E402
from pynanoqwen.ptx.griddep import grid_dependency_wait, launch_dependents  # noqa: E402
from pynanoqwen.ptx.half2 import half2_to_float2  # noqa: E402
from pynanoqwen.ptx.loads import ld_global_cg_f32, ld_global_nc_v4_u32  # noqa: E402
from pynanoqwen.ptx.mma import SHARED_ALIGNMENT, ld_shared_v4_u32, mma_m16n8k16  # noqa: E402
from pynanoqwen.ptx.prmt import prmt  # noqa: E402
from pynanoqwen.ptx.warp import shfl_xor, syncwarp  # noqa: E402

U = np.uint32
ROWS = 16  # an mma's M: the rows of one tile
LOW_OFFSET, HIGH_OFFSET = 1032.0, 72.0  # 1024 + u = 1032 + w; (1024 + 16 u) / 16 = 72 + w
GROUP_QUADS = GROUP_SIZE // 8  # 16-byte pieces of x in one group: 16 consecutive staging threads

# blocked: the weights repacked so that one item (16 rows x one group) is 1 KiB of contiguous memory
# and a warp's run of items one contiguous stream (blocked_layout); else the file's row-major words.
Setting = collections.namedtuple("Setting", "warps blocks_per_sm depth blocked", defaults=(False,))


def blocked_layout(qweight: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """qweight uint32 [N, K/8] and scales float16 [N, K/128] (ValueShuffle, row-major) -> the same
    words and scales in item order: for tile T (rows 16T..16T+15) and group G, 256 words, first the
    rows g = 0..7, then g + 8, each row's 16 words of the group in lane order (lane 4g + t takes its
    chunk t), so each of a lane's two 16-byte loads is one 512-byte piece for the whole warp; and the
    16 scales of the item as (row g, row g + 8) pairs for g = 0..7."""
    n, words = qweight.shape
    tiles, groups = n // ROWS, words * 8 // GROUP_SIZE
    blocks = qweight.reshape(tiles, 2, 8, groups, 16).transpose(0, 3, 1, 2, 4)
    pairs = scales.reshape(tiles, 2, 8, groups).transpose(0, 3, 2, 1)
    return np.ascontiguousarray(blocks).reshape(-1), np.ascontiguousarray(pairs).reshape(-1)


def check_shape(n: int, k: int, grid: int, setting: Setting) -> None:
    items, total_warps = (n // ROWS) * (k // GROUP_SIZE), grid * setting.warps
    if n % ROWS or k % GROUP_SIZE or not 1 <= setting.depth <= 4 or items < total_warps:
        raise ValueError(f"{n}x{k} on {grid} blocks of {setting}: N a multiple of {ROWS}, K of {GROUP_SIZE}, "
                         f"depth 1..4, and at least one item ({items}) a warp ({total_warps})")


@functools.cache
def build(n: int, k: int, grid: int, setting: Setting):
    """gemv(qweight, scales, x_pairs, out, partials, counters): out[N] += W x; qweight uint32
    [N*K/8] and scales float16 [N*K/128] flat (ValueShuffle), x float16 [K] as uint32 pairs,
    partials float32 [2 * ROWS * warps of the grid] and counters uint32 [N / 16] (zero at first)."""
    check_shape(n, k, grid, setting)
    warps, depth, blocked = setting.warps, setting.depth, setting.blocked
    threads = 32 * warps
    tiles, groups = U(n // ROWS), U(k // GROUP_SIZE)
    items = U(int(tiles) * int(groups))
    total_warps = U(grid * warps)
    words_per_row = U(k // 8)
    quads = words_per_row  # 16-byte pieces of x: as many as a row has words
    rounds = -(-(k // 8) // threads)
    staged_words = 4 * rounds  # a thread's quads of x, held in registers while staging
    sixteenth = np.float32(1 / 16)
    shared_words, group_count = CHUNK_STRIDE * (k // 32), k // GROUP_SIZE

    @cuda.jit(device=True, inline="always")
    def run_begin(w):
        return U(U(w * items) // total_warps)

    @cuda.jit(device=True, inline="always")
    def warp_of(i):
        """The warp whose run holds item i (run_begin(w) <= i < run_begin(w + 1))."""
        return U(U(U(U(i + U(1)) * total_warps) - U(1)) // items)

    @cuda.jit(device=True, inline="always")
    def load(q, s, g, t, tile, group, valid, words, scl):
        if valid:
            if blocked:
                item = U(U(tile * groups) + group)
                at = U(U(item * U(256)) + U(U(4) * U(U(4) * g + t)))
                words[0], words[1], words[2], words[3] = ld_global_nc_v4_u32(q, at)
                words[4], words[5], words[6], words[7] = ld_global_nc_v4_u32(q, U(at + U(128)))
                scl[0] = s[U(U(item * U(16)) + U(U(2) * g))]
                scl[1] = s[U(U(U(item * U(16)) + U(U(2) * g)) + U(1))]
            else:
                row = U(U(tile * U(ROWS)) + g)
                at = U(U(row * words_per_row) + U(U(U(16) * group) + U(U(4) * t)))
                words[0], words[1], words[2], words[3] = ld_global_nc_v4_u32(q, at)
                words[4], words[5], words[6], words[7] = ld_global_nc_v4_u32(q, U(at + U(U(8) * words_per_row)))
                scl[0] = s[U(U(row * groups) + group)]
                scl[1] = s[U(U(U(row + U(8)) * groups) + group)]

    @cuda.jit(device=True, inline="always")
    def multiply(words, scl, t, group, xs, cs, xv, acc):
        """acc[0], acc[1] (rows g, g + 8) += this item's group, weights already in `words`."""
        at = U(CHUNK_STRIDE) * U(U(U(4) * group) + t)
        for j in range(4):
            xv[4 * j], xv[4 * j + 1], xv[4 * j + 2], xv[4 * j + 3] = ld_shared_v4_u32(xs, U(at + U(4 * j)))
        lo0, lo1, lo2, lo3 = float32(0), float32(0), float32(0), float32(0)
        hi0, hi1, hi2, hi3 = float32(0), float32(0), float32(0), float32(0)
        for j in range(4):
            # kernels/int4_unpack.py's first step, for word j of row g and of row g + 8
            first_g = prmt(words[j], MAGIC_EXPONENTS, SELECT_BYTES_0_1)
            second_g = prmt(words[j], MAGIC_EXPONENTS, SELECT_BYTES_2_3)
            first_8 = prmt(words[4 + j], MAGIC_EXPONENTS, SELECT_BYTES_0_1)
            second_8 = prmt(words[4 + j], MAGIC_EXPONENTS, SELECT_BYTES_2_3)
            lo0, lo1, lo2, lo3 = mma_m16n8k16(first_g & LOW_NIBBLES, first_8 & LOW_NIBBLES, second_g & LOW_NIBBLES,
                                              second_8 & LOW_NIBBLES, xv[4 * j], xv[4 * j + 2], lo0, lo1, lo2, lo3)
            hi0, hi1, hi2, hi3 = mma_m16n8k16(first_g & HIGH_NIBBLES, first_8 & HIGH_NIBBLES, second_g & HIGH_NIBBLES,
                                              second_8 & HIGH_NIBBLES, xv[4 * j + 1], xv[4 * j + 3], hi0, hi1, hi2, hi3)
        offset = cs[group]
        acc[0] += float32(scl[0]) * (hi0 * sixteenth + lo0 - offset)
        acc[1] += float32(scl[1]) * (hi2 * sixteenth + lo2 - offset)

    @cuda.jit(device=True, inline="always")
    def finish(out, g, t, acc0, acc1, row0):
        if t == U(0):
            out[U(row0 + g)] += acc0
            out[U(U(row0 + g) + U(8))] += acc1

    @cuda.jit(device=True, inline="always")
    def end_tile(out, partials, counters, w, g, t, lane, tile, begin, end, acc):
        """This warp's share of `tile` is summed in acc: store it, or merge it with the other warps'."""
        tile_first = U(tile * groups)
        row0 = U(tile * U(ROWS))
        if tile_first >= begin and U(tile_first + groups) <= end:
            finish(out, g, t, acc[0], acc[1], row0)
        else:
            slot = U(0) if tile == U(begin // groups) else U(1)
            at = U(U(U(U(2) * w) + slot) * U(ROWS))
            if t == U(0):
                partials[U(at + g)] = acc[0]
                partials[U(U(at + g) + U(8))] = acc[1]
            cuda.threadfence()
            syncwarp()
            first_warp, last_warp = warp_of(tile_first), warp_of(U(U(tile_first + groups) - U(1)))
            arrived = U(0)  # warps counted in before this one, + 1, in lane 0; then in every lane
            if lane == U(0):
                arrived = U(cuda.atomic.add(counters, tile, U(1)) + U(1))
            for mask in (16, 8, 4, 2, 1):
                arrived = U(arrived + shfl_xor(arrived, U(mask)))
            if arrived == U(U(last_warp - first_warp) + U(1)):
                cuda.threadfence()
                total0, total1 = float32(0), float32(0)
                v = first_warp
                while v <= last_warp:
                    other = U(0) if tile == U(run_begin(v) // groups) else U(1)
                    base = U(U(U(U(2) * v) + other) * U(ROWS))
                    total0 += ld_global_cg_f32(partials, U(base + g))
                    total1 += ld_global_cg_f32(partials, U(U(base + g) + U(8)))
                    v = U(v + U(1))
                finish(out, g, t, total0, total1, row0)
                if lane == U(0):
                    counters[tile] = U(0)
        acc[0] = float32(0)
        acc[1] = float32(0)

    @cuda.jit(device=True, inline="always")
    def stage(x_pairs, xs, cs):
        """x into shared memory (the product's padded chunk layout) and C_G of every group: each
        thread loads all of its quads into registers first (one L2 round trip; cp.async staging
        cost the product's GEMV 20-30%, docs/PERFORMANCE.md), then stores them and sums its
        quads' part of C_G, which the 16 threads of a group add with shuffles."""
        tid = U(cuda.threadIdx.x)
        pairs = cuda.local.array(staged_words, uint32)
        for r in range(rounds):
            q = U(tid + U(r * threads))
            if q < quads:
                for e in range(4):
                    pairs[4 * r + e] = x_pairs[U(U(U(4) * q) + U(e))]
        for r in range(rounds):
            q = U(tid + U(r * threads))
            part = float32(0)
            if q < quads:
                at = U(U(U(CHUNK_STRIDE) * U(q // U(4))) + U(U(4) * U(q % U(4))))
                for e in range(4):
                    xs[U(at + U(e))] = pairs[4 * r + e]
                a0, b0 = half2_to_float2(pairs[4 * r])
                a1, b1 = half2_to_float2(pairs[4 * r + 1])
                a2, b2 = half2_to_float2(pairs[4 * r + 2])
                a3, b3 = half2_to_float2(pairs[4 * r + 3])
                part = float32(LOW_OFFSET) * ((a0 + b0) + (a2 + b2)) + float32(HIGH_OFFSET) * ((a1 + b1) + (a3 + b3))
            part += shfl_xor(part, U(8))
            part += shfl_xor(part, U(4))
            part += shfl_xor(part, U(2))
            part += shfl_xor(part, U(1))
            if q < quads and q % U(GROUP_QUADS) == U(0):
                cs[q // U(GROUP_QUADS)] = part
        cuda.syncthreads()

    @cuda.jit(device=True, inline="always")
    def advance(tile, group):
        group = U(group + U(1))
        if group == groups:
            return U(tile + U(1)), U(0)
        return tile, group

    @cuda.jit(device=True, inline="always")
    def step(q, s, out, partials, counters, w, g, t, lane, begin, end, index, tile, group, words, scl, xs, cs, xv,
             acc):
        """Item `index` of this warp's run (begin + index), whose loads are in this slot: add it,
        end its tile if it is the tile's last group or the run's last item, then request the item
        `depth` later into the same slot."""
        count = U(end - begin)
        if index < count:
            multiply(words, scl, t, group, xs, cs, xv, acc)
            if group == U(groups - U(1)) or U(index + U(1)) == count:
                end_tile(out, partials, counters, w, g, t, lane, tile, begin, end, acc)
        for _ in range(depth):
            tile, group = advance(tile, group)
        load(q, s, g, t, tile, group, U(index + U(depth)) < count, words, scl)
        return tile, group

    @cuda.jit(**({} if SIMULATOR else {"launch_bounds": (threads, setting.blocks_per_sm)}))
    def gemv(q, s, x_pairs, out, partials, counters):
        xs = cuda.shared.array(shared_words, uint32, alignment=SHARED_ALIGNMENT)
        cs = cuda.shared.array(group_count, float32)
        words0 = cuda.local.array(8, uint32)
        words1 = cuda.local.array(8, uint32)
        words2 = cuda.local.array(8, uint32)
        words3 = cuda.local.array(8, uint32)
        scl0 = cuda.local.array(2, types.float16)
        scl1 = cuda.local.array(2, types.float16)
        scl2 = cuda.local.array(2, types.float16)
        scl3 = cuda.local.array(2, types.float16)
        xv = cuda.local.array(16, uint32)
        acc = cuda.local.array(2, float32)
        lane = U(cuda.laneid)
        g, t = U(lane // U(4)), U(lane % U(4))
        w = U(U(U(cuda.blockIdx.x) * U(warps)) + U(U(cuda.threadIdx.x) // U(32)))
        begin, end = run_begin(w), run_begin(U(w + U(1)))
        count = U(end - begin)
        # Slot s holds item begin + s + depth r in round r; (tile, group) advance without dividing.
        tile0, group0 = U(begin // groups), U(begin % groups)
        tile1, group1 = advance(tile0, group0)
        tile2, group2 = advance(tile1, group1)
        tile3, group3 = advance(tile2, group2)
        load(q, s, g, t, tile0, group0, U(0) < count, words0, scl0)
        if depth >= 2:
            load(q, s, g, t, tile1, group1, U(1) < count, words1, scl1)
        if depth >= 3:
            load(q, s, g, t, tile2, group2, U(2) < count, words2, scl2)
        if depth >= 4:
            load(q, s, g, t, tile3, group3, U(3) < count, words3, scl3)
        grid_dependency_wait()
        stage(x_pairs, xs, cs)
        acc[0] = float32(0)
        acc[1] = float32(0)
        item = U(0)
        triggered = False
        while item < count:
            tile0, group0 = step(q, s, out, partials, counters, w, g, t, lane, begin, end, item, tile0, group0,
                                 words0, scl0, xs, cs, xv, acc)
            if depth >= 2:
                tile1, group1 = step(q, s, out, partials, counters, w, g, t, lane, begin, end, U(item + U(1)), tile1,
                                     group1, words1, scl1, xs, cs, xv, acc)
            if depth >= 3:
                tile2, group2 = step(q, s, out, partials, counters, w, g, t, lane, begin, end, U(item + U(2)), tile2,
                                     group2, words2, scl2, xs, cs, xv, acc)
            if depth >= 4:
                tile3, group3 = step(q, s, out, partials, counters, w, g, t, lane, begin, end, U(item + U(3)), tile3,
                                     group3, words3, scl3, xs, cs, xv, acc)
            item = U(item + U(depth))
            if not triggered and U(item + U(depth)) >= count:
                launch_dependents()  # this thread has issued its last load
                triggered = True
        if not triggered:
            launch_dependents()

    return gemv


class MmaGemv:
    """out[N] += W x on the tensor cores, for one INT4 linear (module docstring)."""

    def __init__(self, n, k, qweight, scales, grid, setting):
        from pynanoqwen.kernels import on_device

        self.n, self.k, self.grid, self.warps = n, k, grid, setting.warps
        self.kernel = build(n, k, grid, setting)
        if setting.blocked:
            host = [a.copy_to_host() if hasattr(a, "copy_to_host") else np.asarray(a) for a in (qweight, scales)]
            qweight, scales = blocked_layout(*host)
        self.qweight = on_device(qweight, np.uint32).reshape(n * k // 8)
        self.scales = on_device(scales, np.float16).reshape(n * k // GROUP_SIZE)
        self.partials = cuda.device_array(2 * ROWS * grid * setting.warps, np.float32)
        self.counters = cuda.to_device(np.zeros(n // ROWS, np.uint32))

    def launch(self, stream, x, out) -> None:
        """out float32 [N] += W x, x float16 [K] on the device."""
        from pynanoqwen.launch import launch

        launch(self.kernel, self.grid, 32 * self.warps, stream,
               (self.qweight, self.scales, x.reshape(self.k).view(np.uint32), out.reshape(self.n), self.partials,
                self.counters))


def mma_bound(qweight, scales, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(W x, bound on |MmaGemv - W x|), derived from the kernel's arithmetic before any run.

    Per group G and row, D_lo and D_hi each add 4 mmas of exact FP16 products (|A| <= 1039 and
    1264, so |product| < 2^11 |x| needs 22 bits) into FP32; the tensor core's alignment and
    truncation cost <= 36 u32 (|c| + sum |p|) per mma (oracles.gemm_oracle's model, Fasi et al.
    2021), so over 4 steps at most 37 * 5 u32 M_G with M_G = sum_lo |A x| + sum_hi |A x| / 16 (the
    /16 is exact). C_G adds 128 FP32 terms of the same magnitudes (<= 128 u32 M_G, generous), and
    the two FP32 operations after the mmas 3 u32 M_G. Then acc adds scale * group over K/128 groups
    and at most 2 warp partials: (K/128 + 8) u32 sum_G |s_G| |group_G| <= (K/128 + 8) u32 |W| |x|.
    """
    from pynanoqwen.oracles import U32
    from pynanoqwen.quant import dequantize_int4, unpack_valueshuffle

    n, k = qweight.shape[0], qweight.shape[1] * 8
    x64 = x.astype(np.float64)
    w = dequantize_int4(qweight, scales, np.float64)
    expected = w @ x64
    nibbles = unpack_valueshuffle(qweight).astype(np.float64)
    high = np.tile([False, False, True, True], k // 4)  # pairs (w2, w3), (w6, w7): 1024 + 16 u, then / 16
    a = np.where(high, 64 + nibbles, 1024 + nibbles)
    group_magnitude = (a * np.abs(x64)).reshape(n, k // GROUP_SIZE, GROUP_SIZE).sum(axis=2)  # M_G per row
    s = np.abs(scales.astype(np.float64))
    bound = (37 * 5 + 128 + 3) * U32 * (s * group_magnitude).sum(axis=1) \
        + (k // GROUP_SIZE + 8) * U32 * (np.abs(w) @ np.abs(x64))
    return expected, bound


def check(rng, shapes=None, grid=None, settings=None, launches=2):
    """Each setting against float64 (mma_bound, plus one u32 of |h + W x| for the residual add) on
    fresh Gaussian x and h and random INT4 weights, 7B shapes on the GPU's SMs unless given; each
    runs `launches` times from the same h, which must give the same bits."""
    from harness import random_int4, residual_gemv_checks
    from pynanoqwen.device import sm_count
    from pynanoqwen.oracles import U32

    shapes = shapes or {name: SHAPES[name] for name in ("o_proj", "down_proj", "qkv")}
    settings = settings or SETTINGS
    results = []
    for name, (n, k) in shapes.items():
        qweight, scales = random_int4(rng, n, k)
        x = rng.standard_normal(k).astype(np.float16)
        h = (3 * rng.standard_normal(n)).astype(np.float32)
        product, bound = mma_bound(qweight, scales, x)
        expected = h.astype(np.float64) + product
        bound = bound + U32 * (np.abs(h) + np.abs(product) + bound)
        blocks_per = grid or sm_count()
        for setting in settings:
            blocks = blocks_per * (1 if grid else setting.blocks_per_sm)
            gemv = MmaGemv(n, k, qweight, scales, blocks, setting)
            results += residual_gemv_checks(
                f"{name} mma {label(setting)}, grid {blocks}", gemv, x, h, expected, bound, launches)
    return results


def label(setting: Setting) -> str:
    return "W{} B{} D{}".format(*setting[:3]) + (" blocked" if setting.blocked else "")


SHAPES = {"qkv": (4608, 3584), "o_proj": (3584, 3584), "down_proj": (3584, 18944),
          "gate+up rows": (37888, 3584), "lm_head": (152064, 3584)}
SETTINGS = [Setting(16, 1, 4), Setting(8, 3, 3), Setting(16, 1, 4, True), Setting(8, 3, 3, True), Setting(8, 4, 2, True)]


def timings(replays: int = 20) -> list[dict]:
    """us a call of the product's GEMV (its default plan, residual epilogue) and of each setting,
    back-to-back PDL launches in a CUDA graph with the weights rotated through twice the L2."""
    from harness import residual_gemv_timings
    from pynanoqwen.device import sm_count

    def variants(name):
        return {label(setting): lambda n, k, qweight, scales, setting=setting: MmaGemv(
            n, k, qweight, scales, sm_count() * setting.blocks_per_sm, setting).launch for setting in SETTINGS}

    return residual_gemv_timings(SHAPES, variants, replays)


SIGNATURE = types.void(types.uint32[::1], types.float16[::1], types.uint32[::1], types.float32[::1],
                       types.float32[::1], types.uint32[::1])


def compile_targets():
    """Every 7B shape blocked at W8 B4 D2 (the fastest on the long shapes), o_proj and down_proj on
    the file's row-major words at W16 B1 D4, on 132 SMs, for tests/test_dev_variants.py."""
    from pynanoqwen.kernels import CompileTarget

    must = ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32", "prmt.b32", "ld.global.nc.v4.u32",
            "ld.shared.v4.u32", "griddepcontrol.wait", "griddepcontrol.launch_dependents", "atom.global.add")
    cases = [(name, Setting(8, 4, 2, True)) for name in SHAPES] + [(name, Setting(16, 1, 4)) for name in ("o_proj", "down_proj")]
    return [CompileTarget(f"gemv_mma[{name} {label(setting)}]", build(*SHAPES[name], 132 * setting.blocks_per_sm, setting),
                          SIGNATURE, must) for name, setting in cases]


if __name__ == "__main__":
    from harness import run

    run(check, timings, "INT4 GEMV on mma.sync against the product, us a call (PDL, weights rotated through twice the L2)")

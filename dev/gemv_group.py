"""The INT4 GEMV whose lanes own whole weight groups: x as 16-bit integers with one scale per 128
inputs, a group's dot summed in int32 across its 4 chunks, float arithmetic once a group.

Why. Two reasons, one for decode and one for prompt lookup's verify pass (docs/SPECULATIVE.md).
- Decode. The product's fixed16 path (kernels/gemv_int4_paths.py) gives every chunk of 32 inputs
  its own activation scale, so a lane ends every chunk with float work: the combine of its low and
  high sums, a convert, the product of the weight and activation scales and an FMA. Here one
  activation scale covers a weight group (128 inputs, the weights' own scale group), and a lane
  takes the whole group: 64 contiguous bytes of one row, 16 words, 64 dp4a into two int32 sums,
  then the float work once. That saves ~15 instructions a group, but a lane's x serves one row
  where fixed16's serves two (its tiles are row pairs), so the x loads double. Counted from the
  PTX (`compile_ptx`, the multiply of one unit at o_proj R2): 182 instructions for 128 weights, 33
  of them shared-address arithmetic (add.s64 + cvt per ld.shared.v4, which ptxas can fold into
  the loads' offsets), against 79 for two rows of one chunk in fixed16's loop, 158 for 128
  weights. A unit of two neighbouring rows (`unit_rows` P = 2) reads each x record once for both:
  287 PTX for 256 weights (128 dp4a, 96 for the unpack, 18 loads, ~40 address and float), ~1.12 a
  weight before the weight loads, against fixed16's ~1.23 with its loads: a few per cent, not a
  decode speedup by count; the floor of any dp4a form is 0.875 (4 dp4a and 3 unpack per 8).
- Verify. A lossless verify pass must give each token's row the bits of a decode step
  (docs/SPECULATIVE.md). With the float work once a group, a verify kernel that sums a group's 128
  inputs for up to 16 tokens in one integer mma chain (exact) has one convert and FMA per group,
  row and token left to replay in decode's order, a quarter of what fixed16's per-chunk scales
  leave. dev/gemv_group_verify.py is that kernel; this one defines the order it replays.

The arithmetic. Staging quantizes x per group G of 128 inputs: v = round(x * 32767 / max|x_G|)
by one FMA (fixed16's ROUNDER trick), scale s_G = max|x_G| * float32(1/32767), and each v split into
its unsigned low byte and signed high byte, laid out as fixed16 lays out a chunk (words 4j..4j+3 for
weight word j: low bytes at the inputs of weights 0, 1, 4, 5, their high bytes, the same for 2, 3, 6,
7), four chunks after each other, then -8 sum v and s_G: a record of RECORD words (68: a stride of 4
banks mod 32, so the 8 lanes of a quarter-warp's ld.shared.v4 hit 8 disjoint bank quads).
Per unit (a row's group), exactly: low = -8 sum v + sum u lo, high = sum u hi over 128 inputs
(dp4a .u32.u32 and .u32.s32), dot = 256 high + low = sum (u - 8) v, |dot| <= 128 * 8 * 32767 < 2^25
(int32 exact; the float32 convert rounds once, by at most u32 |dot|). Then
acc = fma(float32(dot), float32(s_w) * s_G, acc), written as an explicit FMA so that a verify
kernel replaying it gets the same instruction whatever the compiler contracts.
Error against x itself: |v s_G - x| <= s_G / 2 + 2^-22 |x| (fixed16's derivation), with s_G over
128 inputs instead of 32 (group_bound).

Work split. A tile is R consecutive rows, cut into units of P rows (1 or 2) and one group: R/P
K/128 units, block-major (with P = 1 and rows contiguous in qweight, a flat run of 64-byte units).
Lane L of a warp takes units L, L + 32, ... of its tile (item = one step of 32 units, 2 KiB a row
for the warp), so a lane's units may lie in different rows: it keeps one float accumulator for
each of the P rows it is in and parks them in shared memory (its own column of the warp's partials
[R][32], no other lane reads it) when its next unit is in later rows. At the tile's end the R rows'
32 partials meet in warp_sum's butterfly (lane r stores row r). Warps own whole tiles, w, w + W,
... (W warps in the grid), as the product's whole-tile plans do. At K = 3584 a row is 28 units: R
= 8 fills 7 steps exactly, R = 1 or 2 leaves 4 of 32 lanes idle in a row's last step (as the
product's 112 chunks leave 16 of its fourth); the product's row counts balance the grid better, so
the settings below try both. The order of every addition is fixed by (R, P, K): repeated runs
give the same bits.

Loads: a slot holds one item's 16 P words and its P scales, `depth` slots in flight per lane, the
first ones requested before griddepcontrol.wait (the weights do not depend on the previous
kernel), launch_dependents once a thread has issued its last load: the product's pipeline.

Not the default: slower than the product's GEMV at every 7B shape on the H200 (qkv 7.1 against 5.2
us, down_proj 19.1 against 13.5; docs/PERFORMANCE.md, 2026-12-05); tests/sim/test_gemv_group_sim.py
checks it against float64 in the simulator. Two epilogues: the residual one (out += W x, the form
of o_proj and down_proj, and of dev/gemv_mma.py) and the gate/up projection's (out float16 =
silu(Wg x) * (Wu x), the product's expression; a unit then holds its rows of both matrices, which
share its x loads), and the decode step's QKV form (a tile is the row pair (d, d + head_dim/2) of
a head, then + bias, RoPE and the KV-page write, `rope_writer`); with or without the product's
fused RMSNorm of h in the staging (qkv's and gate_up's input). `python dev/gemv_group.py` on the
GPU checks it against float64 and times it against the product.
"""

from __future__ import annotations

import collections
import functools
import math
import sys
from pathlib import Path

import numpy as np
from numba import cuda, float32, int32, uint32
from numba.core import types

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pynanoqwen.config import GROUP_SIZE  # noqa: E402
from pynanoqwen.kernels import PAGE_SIZE  # noqa: E402
from pynanoqwen.kernels.kv_layout import stored_dim  # noqa: E402
from pynanoqwen.kernels.gemv_int4_paths import (FIXED_MAX, INVERSE_FIXED_MAX, NIBBLE_BYTES,  # noqa: E402
                                                _normed_activations, fixed16_quad)
from pynanoqwen.ptx import SIMULATOR  # noqa: E402
from pynanoqwen.ptx.bits import bits_float, float_bits  # noqa: E402
from pynanoqwen.ptx.dp4a import dp4a_uu, dp4a_us  # noqa: E402
from pynanoqwen.ptx.fma import fma  # noqa: E402
from pynanoqwen.ptx.griddep import grid_dependency_wait, launch_dependents  # noqa: E402
from pynanoqwen.ptx.half2 import half2_to_float2  # noqa: E402
from pynanoqwen.ptx.loads import ld_global_nc_v4_u32  # noqa: E402
from pynanoqwen.ptx.mma import SHARED_ALIGNMENT, ld_shared_v4_u32  # noqa: E402
from pynanoqwen.ptx.warp import shfl_xor, warp_sum  # noqa: E402

U = np.uint32
UNIT_WORDS = GROUP_SIZE // 8  # a unit: one row's group, 16 words of packed nibbles
GROUP_QUADS = GROUP_SIZE // 8  # 8-input pieces of x in a group: 16 neighbouring staging lanes
RECORD = 68  # shared words of a group's activations: 64 byte words, -8 sum v, s_G, 2 unused
OFFSET_WORD, SCALE_WORD = 64, 65

# rows: R of a tile; warps a block; blocks_per_sm (also the launch bound); depth: items in flight a
# lane; unit_rows: P rows a unit (a lane's group of P neighbouring rows, one x record for all of them).
Setting = collections.namedtuple("Setting", "rows warps blocks_per_sm depth unit_rows", defaults=(1,))


def grid_for(n: int, setting: Setting, sms: int) -> int:
    """Blocks: each warp computes `rounds` tiles (or one fewer), the fewest that blocks_per_sm
    blocks a SM allow, on as few blocks as that leaves (gemv_int4.GemvPlan.grid's rule)."""
    tiles = n // setting.rows
    rounds = -(-tiles // (setting.blocks_per_sm * sms * setting.warps))
    return max(1, -(-(-(-tiles // rounds)) // setting.warps))


def check_shape(n: int, k: int, setting: Setting) -> None:
    if (k % GROUP_SIZE or n % setting.rows or setting.rows not in (1, 2, 4, 8) or not 1 <= setting.depth <= 4
            or setting.unit_rows not in (1, 2) or setting.rows % setting.unit_rows):
        raise ValueError(f"{n}x{k} at {setting}: K a multiple of {GROUP_SIZE}, rows 1, 2, 4 or 8 dividing N, "
                         f"depth 1..4, unit rows 1 or 2 dividing rows")


@functools.cache
def group_stager(k: int, threads: int, norm_eps: float | None = None):
    """stage(activations, xs, xs_base): one token's x into K/128 group records of xs (uint32, from
    word xs_base), by a block of `threads` threads (module docstring: the arithmetic), ending with
    a syncthreads. activations: (x as float16 [K] in uint32 pairs,), or with norm_eps (h float32
    [K], the norm weight's float16 pairs as uint32), whose x = RMSNorm(h) * weight is computed in
    float32 as the product's fused norm computes it (kernels/gemv_int4_paths.py's
    _normed_activations, the same function: its sum of h^2 is in the order of `threads`) and
    quantized without rounding to FP16 first. Thread t holds quads q = t + j threads; a group's
    16 quads sit in 16 neighbouring lanes, which share its largest |x| and sum of v through 4
    shuffles each. Every lane takes part (one past the end holds zeros and stores nothing). Each
    record depends on its group's 128 values alone (a maximum, one rounding each, an integer sum),
    so whoever stages a token with the same `threads`, this kernel or dev/gemv_group_verify.py's,
    gets the same words."""
    quads = U(k // 8)
    quads_per_thread = -(-(k // 8) // threads)
    staged_values = 8 * quads_per_thread
    norm = norm_eps is not None
    normed = _normed_activations(k, threads, norm_eps)

    @cuda.jit(device=True, inline="always")
    def stage(activations, xs, xs_base):
        t = U(cuda.threadIdx.x)
        values = cuda.local.array(staged_values, float32)
        if norm:
            normed(activations, t, values)
        else:
            x_pairs = activations[0]
            for j in range(quads_per_thread):
                q = U(t + U(j * threads))
                for e in range(4):
                    values[8 * j + 2 * e], values[8 * j + 2 * e + 1] = float32(0), float32(0)
                    if q < quads:
                        values[8 * j + 2 * e], values[8 * j + 2 * e + 1] = half2_to_float2(x_pairs[U(U(4) * q + U(e))])
        for j in range(quads_per_thread):
            q = U(t + U(j * threads))
            largest = float32(0)
            for e in range(8):
                largest = max(largest, abs(values[8 * j + e]))
            for mask in (1, 2, 4, 8):
                largest = max(largest, shfl_xor(largest, U(mask)))
            inverse = float32(FIXED_MAX) / largest if largest > float32(0) else float32(0)
            a_low, a_high, b_low, b_high, total = fixed16_quad(values, 8 * j, inverse)
            for mask in (1, 2, 4, 8):
                total = int32(total + shfl_xor(total, U(mask)))
            if q < quads:
                record = U(xs_base + U(U(RECORD) * U(q // U(GROUP_QUADS))))
                at = U(record + U(U(4) * U(q % U(GROUP_QUADS))))
                xs[at] = a_low
                xs[U(at + U(1))] = a_high
                xs[U(at + U(2))] = b_low
                xs[U(at + U(3))] = b_high
                if q % U(GROUP_QUADS) == U(0):
                    xs[U(record + U(OFFSET_WORD))] = uint32(int32(-8) * total)
                    xs[U(record + U(SCALE_WORD))] = float_bits(largest * INVERSE_FIXED_MAX)
        cuda.syncthreads()

    return stage


@functools.cache
def rope_writer(num_heads: int, num_kv_heads: int, head_dim: int):
    """rope_pair(first, x1, x2, bias, q, k_pages, v_pages, page_table, p, rope_cos, rope_sin): the
    QKV rows (first, first + head_dim/2) of one head at position p, summed: + bias, RoPE of a q
    or k head into q or the position's KV-page slot (float16), a v head copied there. The rotation
    as explicit FMAs, so that the decode GEMV and the verify compute it the same way."""
    half = U(head_dim // 2)
    k_start, v_start = U(num_heads * head_dim), U((num_heads + num_kv_heads) * head_dim)

    @cuda.jit(device=True, inline="always")
    def rope_pair(first, x1, x2, bias, q_out, k_pages, v_pages, page_table, p, rope_cos, rope_sin):
        x1 = x1 + float32(bias[first])
        x2 = x2 + float32(bias[U(first + half)])
        head = U(first // U(head_dim))
        d = U(first % U(head_dim))
        page = U(page_table[U(p // U(PAGE_SIZE))])
        slot = U(p % U(PAGE_SIZE))
        if first < v_start:
            c, sn = rope_cos[p, d], rope_sin[p, d]
            y1 = fma(x1, c, -(x2 * sn))
            y2 = fma(x2, c, x1 * sn)
            if first < k_start:
                q_out[first] = y1
                q_out[U(first + half)] = y2
            else:
                kv = U(head - U(num_heads))
                k_pages[page, kv, slot, stored_dim(slot, d)] = y1
                k_pages[page, kv, slot, stored_dim(slot, U(d + half))] = y2
        else:
            kv = U(head - U(num_heads + num_kv_heads))
            v_pages[page, kv, slot, stored_dim(slot, d)] = x1
            v_pages[page, kv, slot, stored_dim(slot, U(d + half))] = x2

    return rope_pair


@functools.cache
def build(n: int, k: int, grid: int, setting: Setting, norm_eps: float | None = None, silu: bool = False,
          heads: tuple[int, int, int] | None = None):
    """gemv(q0, s0, q1, s1, activations, out): out[N] += W x (out float32), or with silu the
    gate/up projection out[N] = silu(Wg x) * (Wu x) (out float16, Wg = q0/s0, Wu = q1/s1; without
    it pass q0/s0 twice); q uint32 [N*K/8] and s float16 [N*K/128] flat (ValueShuffle),
    activations as group_stager takes them (x float16 [K] as uint32 pairs, or with norm_eps h
    float32 [K] and the norm weight). With silu each unit holds its rows of both matrices, which
    share its x loads. With heads = (num_heads, num_kv_heads, head_dim), the decode step's QKV
    projection: a tile is one unit, the row pair (d, d + head_dim/2) of a head, and out is (bias,
    q, k_pages, v_pages, page_table, pos, rope_cos, rope_sin): + bias, then RoPE of q and k at
    position pos[0] into q and the position's KV-page slot, v copied there (the product's rope
    epilogue, kernels/gemv_int4_kernel.py, with the rotation as explicit FMAs: y1 = fma(x1, c,
    -(x2 s)), y2 = fma(x2, c, x1 s), so that a verify kernel computes the same bits)."""
    check_shape(n, k, setting)
    rope = heads is not None
    if rope and (setting.rows != 2 or setting.unit_rows != 2 or silu or n != (heads[0] + 2 * heads[1]) * heads[2]):
        raise ValueError(f"a QKV projection with RoPE takes tiles of one unit of 2 rows (got {setting}), no silu, "
                         f"N = (heads + 2 kv heads) head_dim")
    num_heads, num_kv_heads, head_dim = heads if rope else (1, 1, 2)
    half = U(head_dim // 2)
    rows, warps, depth, unit_rows = setting.rows, setting.warps, setting.depth, setting.unit_rows
    threads = 32 * warps
    groups = U(k // GROUP_SIZE)
    units = U(rows // unit_rows * (k // GROUP_SIZE))  # of a tile
    words_per_row = U(k // 8)
    matrices = 2 if silu else 1
    lines = matrices * unit_rows  # a unit's rows of every matrix: line l = matrix l // P, row l % P
    slot_words = UNIT_WORDS * lines
    steps = U(-(-int(units) // 32))
    tiles = U(n // rows)
    total_warps = U(grid * warps)
    shared_words = RECORD * (k // GROUP_SIZE)
    stage = group_stager(k, threads, norm_eps)
    rope_pair = rope_writer(num_heads, num_kv_heads, head_dim)
    partial_shape = (warps, matrices * rows * 32)  # [matrix][row of the tile][lane]

    @cuda.jit(device=True, inline="always")
    def advance(cursor, step):
        """(cursor, step) one item later: step runs over a tile's steps, cursor over the warp's tiles."""
        step = U(step + U(1))
        if step == steps:
            return U(cursor + U(1)), U(0)
        return cursor, step

    @cuda.jit(device=True, inline="always")
    def row_of(tile, r):
        """Row r of a tile: consecutive rows, or with RoPE the pair (d, d + head_dim/2) of a head."""
        if rope:
            return U(U(U(U(tile // half) * U(head_dim)) + U(tile % half)) + U(U(r) * half))
        return U(U(tile * U(rows)) + U(r))

    @cuda.jit(device=True, inline="always")
    def load(q0, s0, q1, s1, warp_id, lane, cursor, step, valid, words, scl):
        """Unit lane + 32 step of the warp's tile number `cursor` into a slot: its group of each of
        its unit_rows rows of each matrix (rows lie one after the other in qweight, so with one row a
        unit the tile's units are one flat run)."""
        if valid:
            u = U(lane + U(U(32) * step))
            if u < units:
                tile = U(warp_id + U(cursor * total_warps))
                first = U(U(u // groups) * U(unit_rows))  # the unit's first row within the tile
                group = U(u % groups)
                for line in range(lines):
                    q, s = (q0, s0) if line < unit_rows else (q1, s1)
                    row = row_of(tile, U(first + U(line % unit_rows)))
                    at = U(U(row * words_per_row) + U(U(UNIT_WORDS) * group))
                    for j in range(4):
                        w = UNIT_WORDS * line + 4 * j
                        words[w], words[w + 1], words[w + 2], words[w + 3] = ld_global_nc_v4_u32(q, U(at + U(4 * j)))
                    scl[line] = s[U(U(row * groups) + group)]

    @cuda.jit(device=True, inline="always")
    def multiply(words, scl, group, xs, acc):
        """acc[l] + this unit's group of its line l times x_G (module docstring), one FMA a line;
        the x record is read once for all the unit's lines."""
        record = U(U(RECORD) * group)
        offset = int32(xs[U(record + U(OFFSET_WORD))])
        lows = cuda.local.array(lines, int32)
        highs = cuda.local.array(lines, int32)
        for p in range(lines):
            lows[p], highs[p] = offset, int32(0)
        for j in range(16):  # word j of the unit: chunk j // 4, word j % 4 of the chunk
            x0, x1, x2, x3 = ld_shared_v4_u32(xs, U(record + U(4 * j)))
            for p in range(lines):
                word = words[UNIT_WORDS * p + j]
                weights_a = word & NIBBLE_BYTES  # weights 0, 1, 4, 5 of the word's 8
                weights_b = (word >> U(4)) & NIBBLE_BYTES  # weights 2, 3, 6, 7
                lows[p] = dp4a_uu(weights_a, x0, lows[p])
                highs[p] = dp4a_us(weights_a, x1, highs[p])
                lows[p] = dp4a_uu(weights_b, x2, lows[p])
                highs[p] = dp4a_us(weights_b, x3, highs[p])
        x_scale = bits_float(xs[U(record + U(SCALE_WORD))])
        for p in range(lines):
            dot = int32(highs[p] * int32(256) + lows[p])
            acc[p] = fma(float32(dot), float32(scl[p]) * x_scale, acc[p])

    @cuda.jit(device=True, inline="always")
    def compute(warp_id, lane, cursor, step, valid, words, scl, xs, parked, acc, acc_row, out):
        """Add the item (cursor, step), already in this slot; at the tile's last step, sum its rows.
        acc[l] is this lane's sum of line l of the tile's unit row block acc_row[0], parked its
        column of the warp's partials."""
        if valid:
            u = U(lane + U(U(32) * step))
            if u < units:
                block = U(u // groups)
                if block != acc_row[0]:
                    park(parked, acc, acc_row, lane)
                    acc_row[0] = block
                multiply(words, scl, U(u % groups), xs, acc)
            if step == U(steps - U(1)):
                park(parked, acc, acc_row, lane)
                acc_row[0] = U(0)
                tile = U(warp_id + U(cursor * total_warps))
                if rope:
                    x1, x2 = warp_sum(parked[lane]), warp_sum(parked[U(U(32) + lane)])
                    parked[lane], parked[U(U(32) + lane)] = float32(0), float32(0)
                    if lane == U(0):
                        finish_rope(tile, x1, x2, out)
                    return
                for r in range(rows):
                    at = U(U(r * 32) + lane)
                    total = warp_sum(parked[at])
                    parked[at] = float32(0)
                    row = row_of(tile, U(r))
                    if silu:
                        up = warp_sum(parked[U(at + U(rows * 32))])
                        parked[U(at + U(rows * 32))] = float32(0)
                        if lane == U(r):  # the product's silu epilogue (kernels/gemv_int4_kernel.py)
                            out[row] = total / (float32(1) + math.exp(-total)) * up
                    elif lane == U(r):
                        out[row] += total

    @cuda.jit(device=True, inline="always")
    def finish_rope(tile, x1, x2, out):
        """Rows (d, d + head_dim/2) of a head summed: + bias, RoPE at pos[0] of a q or k head into
        q or the KV-page slot, a v head copied there."""
        bias, q_out, k_pages, v_pages, page_table, pos = out[0], out[1], out[2], out[3], out[4], out[5]
        rope_pair(row_of(tile, U(0)), x1, x2, bias, q_out, k_pages, v_pages, page_table, U(pos[0]), out[6], out[7])

    @cuda.jit(device=True, inline="always")
    def park(parked, acc, acc_row, lane):
        """The lane's sums of the unit row block acc_row[0] into its column of the partials; acc restarts."""
        for line in range(lines):
            row = U(U(acc_row[0] * U(unit_rows)) + U(line % unit_rows))
            parked[U(U(U(U(U(line // unit_rows) * U(rows)) + row) * U(32)) + lane)] = acc[line]
            acc[line] = float32(0)

    @cuda.jit(**({} if SIMULATOR else {"launch_bounds": (threads, setting.blocks_per_sm)}))
    def gemv(q0, s0, q1, s1, activations, out):
        xs = cuda.shared.array(shared_words, uint32, alignment=SHARED_ALIGNMENT)
        partials = cuda.shared.array(partial_shape, float32)
        words0 = cuda.local.array(slot_words, uint32)
        words1 = cuda.local.array(slot_words, uint32)
        words2 = cuda.local.array(slot_words, uint32)
        words3 = cuda.local.array(slot_words, uint32)
        scl0 = cuda.local.array(lines, types.float16)
        scl1 = cuda.local.array(lines, types.float16)
        scl2 = cuda.local.array(lines, types.float16)
        scl3 = cuda.local.array(lines, types.float16)
        acc = cuda.local.array(lines, float32)
        acc_row = cuda.local.array(1, uint32)
        lane = U(cuda.laneid)
        warp = U(U(cuda.threadIdx.x) // U(32))
        warp_id = U(U(U(cuda.blockIdx.x) * U(warps)) + warp)
        parked = partials[warp]
        count = U(U(U(tiles - U(1) - warp_id) // total_warps) + U(1)) if warp_id < tiles else U(0)
        items = U(count * steps)
        cursor0, step0 = U(0), U(0)
        cursor1, step1 = advance(cursor0, step0)
        cursor2, step2 = advance(cursor1, step1)
        cursor3, step3 = advance(cursor2, step2)
        load(q0, s0, q1, s1, warp_id, lane, cursor0, step0, U(0) < items, words0, scl0)
        if depth >= 2:
            load(q0, s0, q1, s1, warp_id, lane, cursor1, step1, U(1) < items, words1, scl1)
        if depth >= 3:
            load(q0, s0, q1, s1, warp_id, lane, cursor2, step2, U(2) < items, words2, scl2)
        if depth >= 4:
            load(q0, s0, q1, s1, warp_id, lane, cursor3, step3, U(3) < items, words3, scl3)
        for r in range(matrices * rows):
            parked[U(U(r * 32) + lane)] = float32(0)
        for p in range(lines):
            acc[p] = float32(0)
        acc_row[0] = U(0)
        grid_dependency_wait()
        stage(activations, xs, U(0))
        item = U(0)
        triggered = False
        while item < items:
            compute(warp_id, lane, cursor0, step0, item < items, words0, scl0, xs, parked, acc, acc_row, out)
            for _ in range(depth):
                cursor0, step0 = advance(cursor0, step0)
            load(q0, s0, q1, s1, warp_id, lane, cursor0, step0, U(item + U(depth)) < items, words0, scl0)
            if depth >= 2:
                compute(warp_id, lane, cursor1, step1, U(item + U(1)) < items, words1, scl1, xs, parked, acc,
                        acc_row, out)
                for _ in range(depth):
                    cursor1, step1 = advance(cursor1, step1)
                load(q0, s0, q1, s1, warp_id, lane, cursor1, step1, U(item + U(depth + 1)) < items, words1, scl1)
            if depth >= 3:
                compute(warp_id, lane, cursor2, step2, U(item + U(2)) < items, words2, scl2, xs, parked, acc,
                        acc_row, out)
                for _ in range(depth):
                    cursor2, step2 = advance(cursor2, step2)
                load(q0, s0, q1, s1, warp_id, lane, cursor2, step2, U(item + U(depth + 2)) < items, words2, scl2)
            if depth >= 4:
                compute(warp_id, lane, cursor3, step3, U(item + U(3)) < items, words3, scl3, xs, parked, acc,
                        acc_row, out)
                for _ in range(depth):
                    cursor3, step3 = advance(cursor3, step3)
                load(q0, s0, q1, s1, warp_id, lane, cursor3, step3, U(item + U(depth + 3)) < items, words3, scl3)
            item = U(item + U(depth))
            if not triggered and U(item + U(depth)) >= items:
                launch_dependents()  # this thread has issued its last load
                triggered = True
        if not triggered:
            launch_dependents()

    return gemv


class GroupGemv:
    """out[N] += W x with lanes owning weight groups, for one INT4 linear (module docstring); with
    up_q/up_s, the gate/up projection out float16 [N] = silu(W x) * (W_up x); with heads and bias,
    the decode step's QKV projection with RoPE and the KV write (launch_rope); with norm_weight and
    norm_eps, x = RMSNorm(h) * norm_weight computed while staging."""

    def __init__(self, n, k, qweight, scales, grid, setting, norm_weight=None, norm_eps=None, up_q=None, up_s=None,
                 heads=None, bias=None):
        from pynanoqwen.kernels import on_device

        self.n, self.k, self.grid, self.warps = n, k, grid, setting.warps
        silu = up_q is not None
        self.kernel = build(n, k, grid, setting, None if norm_eps is None else float(norm_eps), silu,
                            None if heads is None else tuple(heads))
        self.bias = None if bias is None else on_device(bias, np.float16)
        self.qweight = on_device(qweight, np.uint32).reshape(n * k // 8)
        self.scales = on_device(scales, np.float16).reshape(n * k // GROUP_SIZE)
        self.up_q = on_device(up_q, np.uint32).reshape(n * k // 8) if silu else self.qweight
        self.up_s = on_device(up_s, np.float16).reshape(n * k // GROUP_SIZE) if silu else self.scales
        self.norm_weight = None if norm_weight is None else on_device(norm_weight, np.float16)

    def activations(self, x):
        """The kernel's activations for x float16 [K], or for h float32 [K] with a norm."""
        if self.norm_weight is None:
            return (x.reshape(self.k).view(np.uint32),)
        return (x.reshape(self.k), self.norm_weight.view(np.uint32))

    def launch(self, stream, x, out) -> None:
        """out float32 [N] += W x (or, gate/up, out float16 [N] = silu(W x) * (W_up x)), x float16
        [K] (or h float32 [K] with a norm) on the device."""
        from pynanoqwen.launch import launch

        launch(self.kernel, self.grid, 32 * self.warps, stream,
               (self.qweight, self.scales, self.up_q, self.up_s, self.activations(x), out.reshape(self.n)))

    def launch_rope(self, stream, x, q, k_pages, v_pages, page_table, pos, rope_cos, rope_sin) -> None:
        """The QKV form (built with heads and bias): qkv = W x + bias of the token at pos[0], q
        float32 [num_heads, head_dim] = RoPE(q part), that position's slot of k_pages (RoPE(k)) and
        v_pages (v), float16 [pages, kv heads, 16, head_dim], through page_table; rope_cos/sin as
        kernels/rope_kv_write.rope_cos_sin."""
        from pynanoqwen.launch import launch

        out = (self.bias, q.reshape(q.size), k_pages, v_pages, page_table, pos, rope_cos, rope_sin)
        launch(self.kernel, self.grid, 32 * self.warps, stream,
               (self.qweight, self.scales, self.up_q, self.up_s, self.activations(x), out))


def scales_of(x: np.ndarray) -> np.ndarray:
    """s_G of every group as the kernel computes it: max|x_G| * float32(1 / 32767), float32."""
    largest = np.abs(np.asarray(x, np.float32)).reshape(-1, GROUP_SIZE).max(axis=1)
    return largest * INVERSE_FIXED_MAX


def staged_activations(x: np.ndarray) -> np.ndarray:
    """x as this kernel stages it, in numpy: per group, v = x * float32(32767 / max|x_G|) rounded
    once to an integer (the float64 product of two float32 is exact), times s_G."""
    groups = np.asarray(x, np.float32).reshape(-1, GROUP_SIZE)
    largest = np.abs(groups).max(axis=1, keepdims=True)
    inverse = np.where(largest > 0, np.float32(FIXED_MAX) / np.where(largest > 0, largest, np.float32(1)),
                       np.float32(0))
    ints = np.rint(groups.astype(np.float64) * inverse.astype(np.float64))
    assert np.all(np.abs(ints) <= FIXED_MAX)
    return (ints * scales_of(x)[:, None].astype(np.float64)).reshape(-1)


def group_bound(qweight, scales, x: np.ndarray, input_error: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(W x, bound on |GroupGemv(x) - W x|), derived before any run (oracles.gemv_oracle's form).

    x's rounding: |v s_G - x| <= s_G / 2 + 2^-22 |x| (kernels/gemv_int4_paths.py's fixed16
    derivation, s_G over 128 inputs). float32: per unit the convert of dot, the scale product and
    the FMA, over a lane's at most ceil(K/4096) + 1 units of a row, then warp_sum's 5 steps: far
    fewer than the K/32 + 8 roundings of u32 sum |w| (|x| + rounding) that oracles.gemv_oracle
    allows, kept here as the same bound. input_error: the kernel reads a copy of x off by up to
    this (a fused norm's float32 xn); its scales follow that copy, and the bound grows by |W| of it."""
    from pynanoqwen.oracles import U32
    from pynanoqwen.quant import dequantize_int4

    x64 = np.asarray(x, np.float64)
    reach = np.abs(x64) if input_error is None else np.abs(x64) + input_error
    group_scales = reach.reshape(-1, GROUP_SIZE).max(axis=1).astype(np.float32) * INVERSE_FIXED_MAX
    rounding = np.repeat(group_scales.astype(np.float64), GROUP_SIZE) / 2 + 2.0**-22 * reach
    if input_error is not None:
        rounding = rounding + input_error
    w = dequantize_int4(qweight, scales, np.float64)
    magnitude = np.abs(w) @ (np.abs(x64) + rounding)
    return w @ x64, (x.shape[0] // 32 + 8) * U32 * magnitude + np.abs(w) @ rounding


def check(rng, shapes=None, grid=None, settings=None, launches=2):
    """Each setting against float64 (group_bound, plus one u32 of
    |h + W x| for the residual add) on fresh Gaussian x and h and random INT4 weights, 7B shapes on
    the GPU's SMs unless given; each runs `launches` times from the same h: the same bits."""
    from harness import random_int4, residual_gemv_checks
    from pynanoqwen.device import sm_count
    from pynanoqwen.oracles import U32

    shapes = shapes or {name: SHAPES[name] for name in ("qkv", "o_proj", "down_proj")}
    results = []
    for name, (n, k) in shapes.items():
        qweight, scales = random_int4(rng, n, k)
        x = rng.standard_normal(k).astype(np.float16)
        h = (3 * rng.standard_normal(n)).astype(np.float32)
        product, bound = group_bound(qweight, scales, x)
        expected = h.astype(np.float64) + product
        bound = bound + U32 * (np.abs(h) + np.abs(product) + bound)
        for setting in settings or SETTINGS:
            if n % setting.rows:
                continue
            blocks = grid or grid_for(n, setting, sm_count())
            gemv = GroupGemv(n, k, qweight, scales, blocks, setting)
            results += residual_gemv_checks(f"{name} group {label(setting)}, grid {blocks}", gemv, x, h, expected,
                                            bound, launches)
    return results


def label(setting: Setting) -> str:
    return "R{} W{} B{} D{}".format(*setting) + (f" P{setting.unit_rows}" if setting.unit_rows > 1 else "")


SHAPES = {"qkv": (4608, 3584), "o_proj": (3584, 3584), "down_proj": (3584, 18944), "gate+up rows": (37888, 3584)}
SETTINGS = [Setting(1, 8, 2, 4), Setting(2, 8, 2, 4), Setting(8, 8, 2, 2), Setting(2, 16, 1, 4),
            Setting(2, 8, 2, 2, unit_rows=2), Setting(2, 16, 1, 2, unit_rows=2)]


def timings(replays: int = 20) -> list[dict]:
    """us a call of the product's GEMV (its default plan, residual epilogue) and of each setting,
    back-to-back PDL launches in a CUDA graph with the weights rotated through twice the L2."""
    from harness import residual_gemv_timings
    from pynanoqwen.device import sm_count

    def variants(name):
        n = SHAPES[name][0]
        return {label(setting): lambda n, k, qweight, scales, setting=setting: GroupGemv(
            n, k, qweight, scales, grid_for(n, setting, sm_count()), setting).launch
            for setting in SETTINGS if n % setting.rows == 0}

    return residual_gemv_timings(SHAPES, variants, replays)


SIGNATURE = types.void(types.uint32[::1], types.float16[::1], types.uint32[::1], types.float16[::1],
                       types.UniTuple(types.uint32[::1], 1), types.float32[::1])


def compile_targets():
    """Every 7B shape at R2 W8 B2 D4, R8 W8 B2 D2 and R2 W8 B2 D2 P2 on 132 SMs, and the gate/up
    projection with the fused RMSNorm at R1 W8 B2 D2, for tests/test_dev_variants.py."""
    from pynanoqwen.kernels import CompileTarget

    must = ("dp4a.u32.u32", "dp4a.u32.s32", "fma.rn.f32", "ld.global.nc.v4.u32", "ld.shared.v4.u32",
            "shfl.sync.bfly.b32", "griddepcontrol.wait", "griddepcontrol.launch_dependents")
    targets = [CompileTarget(f"gemv_group[{name} {label(setting)}]", build(n, k, grid_for(n, setting, 132), setting),
                             SIGNATURE, must)
               for name, (n, k) in SHAPES.items() for setting in SETTINGS[1:3] + SETTINGS[4:5]]
    flat_u32, flat_f16 = types.uint32[::1], types.float16[::1]
    normed = types.Tuple((types.float32[::1], flat_u32))
    setting = Setting(1, 8, 2, 2)
    targets.append(CompileTarget(f"gemv_group[gate_up 18944x3584 {label(setting)}, silu, fused rmsnorm]",
                                 build(18944, 3584, grid_for(18944, setting, 132), setting, 1e-6, True),
                                 types.void(flat_u32, flat_f16, flat_u32, flat_f16, normed, flat_f16),
                                 must + ("ex2.approx",)))
    rope_setting = Setting(2, 8, 2, 2, unit_rows=2)
    pages = types.float16[:, :, :, ::1]
    rope_out = types.Tuple((flat_f16, types.float32[::1], pages, pages, types.int32[::1], types.int32[::1],
                            types.float32[:, ::1], types.float32[:, ::1]))
    targets.append(CompileTarget(f"gemv_group[qkv 4608x3584 {label(rope_setting)}, rope + KV write, fused rmsnorm]",
                                 build(4608, 3584, grid_for(4608, rope_setting, 132), rope_setting, 1e-6,
                                       heads=(28, 4, 128)),
                                 types.void(flat_u32, flat_f16, flat_u32, flat_f16, normed, rope_out),
                                 must + ("cvt.rn.f16.f32",)))
    return targets


if __name__ == "__main__":
    from harness import run

    run(check, timings, "INT4 GEMV with lanes owning weight groups against the product, us a call "
                        "(PDL, weights rotated through twice the L2)")

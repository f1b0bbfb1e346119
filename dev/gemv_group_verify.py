"""Prompt lookup's verify GEMV: W x_m for up to 16 tokens m in one pass over the weights, each
token's output bit for bit what dev/gemv_group.py computes for that token alone.

Why bit for bit. A greedy verify pass is lossless only if every row of its logits is what a decode
step computes (docs/SPECULATIVE.md); a matrix product that sums in another order gives other
bits, and over 28 layers another argmax now and then. The group GEMV makes the decode order cheap
to replay. At one row a tile (R = 1) and K <= 4096 (at most 32 groups a row), lane L of the decode
warp sums group G = L alone: its partial is fma(float32(dot_G), float32(s_w) * s_G, 0), lanes
without a group hold 0, and the row is warp_sum's butterfly over the 32 partials (masks 16, 8, 4,
2, 1). dot_G is an exact integer, so any exact integer arithmetic may compute it; the FMA and the
butterfly are what has to be replayed.

How. The tokens are the 16 rows of an integer mma (`mma.m16n8k32`, ptx/mma.py), 8 weight rows its
8 columns:
- B, the weights: lane (g, t) loads words 4t..4t+3 of row g's group (16 bytes); mma c (c = 0..3)
  takes word 4t + c, its low nibbles (weights 0, 1, 4, 5) as b0 and its high nibbles (2, 3, 6, 7)
  as b1: k = 4t..4t+3 and 16 + 4t..16 + 4t + 3. The nibbles are u = w + 8, unsigned bytes.
- A, the tokens' 16-bit x, staged as gemv_group stages one token (records of 68 words a group: low
  and high bytes of v per weight word, -8 sum v, s_G; the same function, so the same words): for
  mma c, token m's k = 4t.. and 16 + 4t.. are record words 16t + 4c + {0, 2} (low bytes) and
  {1, 3} (high bytes), one ld.shared.v4 a token. The low bytes go through mma .u8.u8, the signed
  high bytes through mma .s8.u8; over a group's 4 mmas each sums exactly in int32, the low one
  starting from -8 sum v, so dot = 256 high + low is gemv_group's integer, bit for bit.
- Then the lane holds dot for tokens g, g + 8 and rows 2t, 2t + 1 of each of the warp's C column
  tiles (8 C rows a warp; the tokens' A fragments are loaded once for all C), and makes the decode
  lanes' partials from them. The groups are taken in the order of the butterfly's leaves: leaf i
  is the partial of lane bitrev5(i) (0, 16, 8, 24, 4, ...), so warp_sum's tree is the balanced
  binary tree over the leaves in that order, and a stack of 5 pending left subtrees a (row, token)
  sums it as the leaves arrive (`push`): nothing is parked in shared memory. Lanes without a group
  (28..31 at K = 3584) enter as leaves of 0 after the item before them (`zeros_after`), as in
  decode. Then out[m, row] += total, the decode epilogue. Items go through `depth` register slots,
  each step called with a constant slot index so that the slots stay in registers (a loop over
  them left them in local memory at C = 2).

Counted by hand per item (one group) and column tile of 8 rows, for up to 16 tokens, in warp
instructions, assuming ptxas folds the shared-address arithmetic into the loads: 8 mma, 12 for the
unpack, 16 for the leaves (combine, convert, scale product, FMA for 4 (token, row) pairs), ~9 to
prefetch the item `depth` on (16 bytes, 2 scales, addresses), ~8 for the stack; and once an item
whatever the column tiles, ~19 (12 shared loads of the tokens' x and offsets, the loop). So ~53 +
19/C per 8 rows, against ~38 for the same rows and group at one token in gemv_group (8 units of
its ~150 a unit, over 32 lanes): ~1.9x at C = 1, ~1.6x at C = 2. The mma and the unpack cost
about what decode's dp4a do on the same weights; the float terms, one set a token, and the
replay's bookkeeping are the rest. PTX is no guide here: the compiled loop body holds both
prefetch branches and every level of the stack, and its movs (the stack's and slots' phis) are
half its length. The GPU run decides (`timings`).

Scope (a dev variant): the residual and the gate/up epilogues (gate and up in column tiles of their
own, so that a lane holds both sums of a (token, row)); replays gemv_group with a tile of one unit (R = P)
and K <= 4096 (then every row's leaves are the same lanes; a longer K makes a lane's partial a
chain of FMAs, which the same stack takes with a chain per leaf, not built); the whole of every
token's x staged in each block's shared memory (K/128 x 68 x 4 bytes a token: 122 KB for 16 tokens
at K = 3584), copied by cp.async from records a first kernel writes (`stage_tokens`, one block a
token, the same staging function as the decode GEMV, with its fused RMSNorm when the decode GEMV
has one, at the decode block's thread count). Not in the engine.
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

from gemv_group import OFFSET_WORD, RECORD, SCALE_WORD, group_stager  # noqa: E402
from gemv_group import Setting as DecodeSetting  # noqa: E402
from pynanoqwen.config import GROUP_SIZE  # noqa: E402
from pynanoqwen.kernels.gemv_int4_paths import NIBBLE_BYTES  # noqa: E402
from pynanoqwen.ptx import SIMULATOR  # noqa: E402
from pynanoqwen.ptx.bits import bits_float  # noqa: E402
from pynanoqwen.ptx.griddep import grid_dependency_wait, launch_dependents  # noqa: E402
from pynanoqwen.ptx.loads import ld_global_nc_v4_u32  # noqa: E402
from pynanoqwen.ptx.mma import (cp_async_16, cp_async_commit_group, cp_async_wait_group,  # noqa: E402
                                ld_shared_v4_u32, mma_m16n8k32_s8u8, mma_m16n8k32_u8u8)

U = np.uint32
MAX_TOKENS = 16  # the mma's M
TILE_ROWS = 8  # the mma's N: weight rows a warp computes at once
# warps a block; depth: groups whose weights a lane has in flight; column_tiles: 8-row mma columns a
# warp computes from one load of the tokens' x (a warp tile of 8 column_tiles rows).
Setting = collections.namedtuple("Setting", "warps depth column_tiles", defaults=(4, 1))
LEVELS = 5  # warp_sum's butterfly: masks 16, 8, 4, 2, 1


@functools.cache
def build_stage(k: int, threads: int, norm_eps: float | None = None):
    """stage_tokens(activations, records): token m's x into records[m K/128 68 ..], one block of
    `threads` a token, by gemv_group's staging function: activations (x float16 [tokens, K] as
    uint32 pairs,), or with norm_eps (h float32 [tokens, K], the norm weight's pairs), whose norm
    sums h^2 in the order of `threads` threads: those of the decode GEMV's block, so that the
    records are the words its blocks stage."""
    stage = group_stager(k, threads, norm_eps)
    norm = norm_eps is not None
    per_token = U(k if norm else k // 2)  # words of one token's activations
    record_words = U(RECORD * (k // GROUP_SIZE))

    @cuda.jit
    def stage_tokens(activations, records):
        m = U(cuda.blockIdx.x)
        grid_dependency_wait()
        first = U(m * per_token)
        if norm:
            stage((activations[0][first:U(first + per_token)], activations[1]), records, U(m * record_words))
        else:
            stage((activations[0][first:U(first + per_token)],), records, U(m * record_words))
        launch_dependents()

    return stage_tokens


def shared_bytes(k: int, tokens: int) -> int:
    """The verify kernel's dynamic shared memory: every token's records."""
    return 4 * tokens * RECORD * (k // GROUP_SIZE)


def leaf_order(groups: int) -> np.ndarray:
    """The groups in the order their leaves enter the butterfly: lane L = bitrev5(i) for i = 0..31,
    the lanes that own a group (L < groups)."""
    return np.array([lane for lane in LEAF_LANES if lane < groups], np.uint32)


LEAF_LANES = [int(f"{i:05b}"[::-1], 2) for i in range(32)]  # leaf i of warp_sum's tree is lane bitrev5(i)


@functools.cache
def build(n: int, k: int, tokens: int, grid: int, setting: Setting, silu: bool = False):
    """verify(q0, s0, q1, s1, records, out): out[m N + row] += W x_m for m < tokens (out float32
    [tokens N]), or with silu the gate/up projection out[m N + row] = silu(Wg x_m) * (Wu x_m) (out
    float16; Wg = q0/s0, Wu = q1/s1, which take column tiles of their own: a lane then holds both
    of a (token, row)); q/s as gemv_group, records from stage_tokens. Replays gemv_group's tile of
    one unit for K <= 4096."""
    groups_count = k // GROUP_SIZE
    columns = setting.column_tiles
    rows_per_warp = TILE_ROWS * columns
    if n % rows_per_warp or k % GROUP_SIZE or not 1 <= groups_count <= 32 or not 1 <= tokens <= MAX_TOKENS \
            or groups_count % setting.depth or not 1 <= setting.depth <= 4:
        raise ValueError(f"{n}x{k}, {tokens} tokens, {setting}: N a multiple of {rows_per_warp}, K a multiple of "
                         f"{GROUP_SIZE} up to 4096 (one group a decode lane), 1..{MAX_TOKENS} tokens, "
                         f"depth 1..4 dividing K/{GROUP_SIZE}")
    warps, depth = setting.warps, setting.depth
    threads = 32 * warps
    groups = U(groups_count)
    words_per_row = U(k // 8)
    tiles = U(n // rows_per_warp)
    total_warps = U(grid * warps)
    record_words = U(RECORD * groups_count)
    quads = U(tokens * RECORD * groups_count // 4)
    t_count = U(tokens)
    order = leaf_order(groups_count)
    leaf_of_item = np.array([LEAF_LANES.index(int(group)) for group in order], np.uint32)
    # zero leaves (lanes without a group) to push after each item, before the next item's leaf
    zeros_after = np.diff(np.append(leaf_of_item, 32)).astype(np.uint32) - np.uint32(1)
    cols = (2 if silu else 1) * columns  # column tile j: matrix j // columns, rows 8 (j % columns) ..
    pairs = 4 * cols  # (token, row) sums a lane holds: tokens g, g + 8 x rows 2t, 2t + 1 of each column tile
    slot_words, slot_scales = 4 * cols * depth, 2 * cols * depth
    stack_words = LEVELS * pairs

    @cuda.jit(device=True, inline="always")
    def load_item(q0, s0, q1, s1, tile, item, g, t, words, scl, d):
        """Item `item` of a warp tile (its group order[item]) into slot d: for each column tile j,
        row 8 (j % columns) + g's words 4t..4t+3 of the group and the scales of rows 8 (j % columns)
        + 2t and + 2t + 1, of matrix j // columns."""
        group = order[item]
        first = U(tile * U(rows_per_warp))
        for j in range(cols):
            q, s = (q0, s0) if j < columns else (q1, s1)
            row = U(U(first + U(TILE_ROWS * (j % columns))) + g)
            at = U(U(row * words_per_row) + U(U(U(16) * group) + U(U(4) * t)))
            w = 4 * (cols * d + j)
            words[w], words[w + 1], words[w + 2], words[w + 3] = ld_global_nc_v4_u32(q, at)
            pair_row = U(U(first + U(TILE_ROWS * (j % columns))) + U(U(2) * t))
            scl[2 * (cols * d + j)] = s[U(U(pair_row * groups) + group)]
            scl[2 * (cols * d + j) + 1] = s[U(U(U(pair_row + U(1)) * groups) + group)]

    @cuda.jit(device=True, inline="always")
    def prefetch(q0, s0, q1, s1, tile, item, g, t, words, scl, d):
        """Slot d gets the item `item`, which may be in the warp's next tile."""
        if item < groups:
            load_item(q0, s0, q1, s1, tile, item, g, t, words, scl, d)
        elif U(tile + total_warps) < tiles:
            load_item(q0, s0, q1, s1, U(tile + total_warps), U(item - groups), g, t, words, scl, d)

    @cuda.jit(device=True, inline="always")
    def leaves(records, group, g, t, words, scl, d, leaf):
        """The decode lane partials of this group (slot d's weights) for tokens g, g + 8 and rows
        2t, 2t + 1 of every column tile: fma(float32(dot), float32(s_w) * s_G, 0), as gemv_group's
        first FMA of a row. The tokens' x is read once for all the column tiles."""
        m0, m1 = g, U(g + U(8))
        base0 = U(U(m0 * record_words) + U(U(RECORD) * group))
        base1 = U(U(m1 * record_words) + U(U(RECORD) * group))
        if m0 >= t_count:  # a padding token: any record will do, its sums are never stored
            base0 = U(U(RECORD) * group)
        if m1 >= t_count:
            base1 = U(U(RECORD) * group)
        off0, off1 = int32(records[U(base0 + U(OFFSET_WORD))]), int32(records[U(base1 + U(OFFSET_WORD))])
        lows = cuda.local.array(pairs, int32)
        highs = cuda.local.array(pairs, int32)
        for c in range(cols):
            lows[4 * c], lows[4 * c + 1], lows[4 * c + 2], lows[4 * c + 3] = off0, off0, off1, off1
            highs[4 * c], highs[4 * c + 1], highs[4 * c + 2], highs[4 * c + 3] = 0, 0, 0, 0
        for chunk in range(4):
            lo_a0, hi_a0, lo_b0, hi_b0 = ld_shared_v4_u32(records, U(base0 + U(U(U(16) * t) + U(4 * chunk))))
            lo_a1, hi_a1, lo_b1, hi_b1 = ld_shared_v4_u32(records, U(base1 + U(U(U(16) * t) + U(4 * chunk))))
            for c in range(cols):
                word = words[4 * (cols * d + c) + chunk]
                b0 = word & NIBBLE_BYTES
                b1 = (word >> U(4)) & NIBBLE_BYTES
                lows[4 * c], lows[4 * c + 1], lows[4 * c + 2], lows[4 * c + 3] = mma_m16n8k32_u8u8(
                    lo_a0, lo_a1, lo_b0, lo_b1, b0, b1, lows[4 * c], lows[4 * c + 1], lows[4 * c + 2], lows[4 * c + 3])
                highs[4 * c], highs[4 * c + 1], highs[4 * c + 2], highs[4 * c + 3] = mma_m16n8k32_s8u8(
                    hi_a0, hi_a1, hi_b0, hi_b1, b0, b1, highs[4 * c], highs[4 * c + 1], highs[4 * c + 2],
                    highs[4 * c + 3])
        x_scale0 = bits_float(records[U(base0 + U(SCALE_WORD))])
        x_scale1 = bits_float(records[U(base1 + U(SCALE_WORD))])
        zero = float32(0)
        for c in range(cols):
            w0, w1 = float32(scl[2 * (cols * d + c)]), float32(scl[2 * (cols * d + c) + 1])
            for e in range(4):  # (token g, row 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1)
                scale = (w0 if e % 2 == 0 else w1) * (x_scale0 if e < 2 else x_scale1)
                dot = int32(highs[4 * c + e] * int32(256) + lows[4 * c + e])
                leaf[4 * c + e] = cuda.fma(float32(dot), scale, zero)

    @cuda.jit(device=True, inline="always")
    def push(stack, leaf, i):
        """Leaf i of the butterfly (lane bitrev5(i)'s partial) into the stack of left subtrees:
        while i's low bits are ones, the pending left sibling is added (left + right, as the
        lower lane adds its partner in warp_sum; the same bits either way). After leaf 31, leaf
        holds the sums."""
        carry = True
        for level in range(LEVELS):
            if carry:
                if (i >> U(level)) & U(1):
                    for p in range(pairs):
                        leaf[p] = stack[LEVELS * p + level] + leaf[p]
                else:
                    for p in range(pairs):
                        stack[LEVELS * p + level] = leaf[p]
                    carry = False

    @cuda.jit(device=True, inline="always")
    def step(q0, s0, q1, s1, records, tile, item, g, t, words, scl, d, leaf, stack):
        """Item `item` (in slot d): its leaves into the stack, then the zero leaves of the lanes
        without a group that follow it; slot d then requests the item `depth` on."""
        group = order[item]
        leaves(records, group, g, t, words, scl, d, leaf)
        prefetch(q0, s0, q1, s1, tile, U(item + U(depth)), g, t, words, scl, d)
        i = leaf_of_item[item]
        push(stack, leaf, i)
        for z in range(zeros_after[item]):
            for p in range(pairs):
                leaf[p] = float32(0)
            push(stack, leaf, U(U(i + U(1)) + U(z)))

    @cuda.jit(**({} if SIMULATOR else {"launch_bounds": (threads, 1)}))
    def verify(q0, s0, q1, s1, records_global, out):
        records = cuda.shared.array(0, uint32)  # dynamic: the tokens' records
        lane = U(cuda.laneid)
        g, t = U(lane // U(4)), U(lane % U(4))
        warp_id = U(U(U(cuda.blockIdx.x) * U(warps)) + U(U(cuda.threadIdx.x) // U(32)))
        words = cuda.local.array(slot_words, uint32)  # slot d: the weights of item d (mod depth)
        scl = cuda.local.array(slot_scales, types.float16)
        leaf = cuda.local.array(pairs, float32)
        stack = cuda.local.array(stack_words, float32)
        if warp_id < tiles:  # the weights do not depend on the kernel before: request them first
            load_item(q0, s0, q1, s1, warp_id, U(0), g, t, words, scl, 0)
            if depth >= 2:
                load_item(q0, s0, q1, s1, warp_id, U(1), g, t, words, scl, 1)
            if depth >= 3:
                load_item(q0, s0, q1, s1, warp_id, U(2), g, t, words, scl, 2)
            if depth >= 4:
                load_item(q0, s0, q1, s1, warp_id, U(3), g, t, words, scl, 3)
        grid_dependency_wait()
        i = U(cuda.threadIdx.x)
        while i < quads:
            cp_async_16(records, U(U(4) * i), records_global, U(U(4) * i), U(16))
            i = U(i + U(threads))
        cp_async_commit_group()
        cp_async_wait_group(0)
        cuda.syncthreads()
        tile = warp_id
        while tile < tiles:
            item = U(0)
            while item < groups:  # one call a slot, so that each slot's index is a constant
                step(q0, s0, q1, s1, records, tile, item, g, t, words, scl, 0, leaf, stack)
                if depth >= 2:
                    step(q0, s0, q1, s1, records, tile, U(item + U(1)), g, t, words, scl, 1, leaf, stack)
                if depth >= 3:
                    step(q0, s0, q1, s1, records, tile, U(item + U(2)), g, t, words, scl, 2, leaf, stack)
                if depth >= 4:
                    step(q0, s0, q1, s1, records, tile, U(item + U(3)), g, t, words, scl, 3, leaf, stack)
                item = U(item + U(depth))
            first = U(tile * U(rows_per_warp))
            for c in range(columns):
                row0 = U(U(first + U(TILE_ROWS * c)) + U(U(2) * t))
                for e in range(4):  # (token g, row 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1)
                    m = U(g + U(8 * (e // 2)))
                    if m < t_count:
                        at = U(U(m * U(n)) + U(row0 + U(e % 2)))
                        total = leaf[4 * c + e]
                        if silu:  # the decode GEMV's silu epilogue, its up row in column tile columns + c
                            out[at] = total / (float32(1) + math.exp(-total)) * leaf[4 * (columns + c) + e]
                        else:
                            out[at] += total
            tile = U(tile + total_warps)
        launch_dependents()

    return verify


class GroupVerify:
    """out[m, :] += W x_m for `tokens` tokens, each as dev/gemv_group.py's GEMV with `decode_warps`
    warps a block computes it alone (with norm_weight and norm_eps, x_m = RMSNorm(h_m) * weight;
    with up_q/up_s, the gate/up projection out float16 [tokens, N] = silu(W x_m) * (W_up x_m))."""

    def __init__(self, n, k, tokens, qweight, scales, grid, setting, decode_warps=8, norm_weight=None,
                 norm_eps=None, up_q=None, up_s=None):
        from pynanoqwen.kernels import on_device

        self.n, self.k, self.tokens, self.grid, self.warps = n, k, tokens, grid, setting.warps
        silu = up_q is not None
        self.stage_threads = 32 * decode_warps
        self.stage = build_stage(k, self.stage_threads, None if norm_eps is None else float(norm_eps))
        self.kernel = build(n, k, tokens, grid, setting, silu)
        self.shared = shared_bytes(k, tokens)
        self.qweight = on_device(qweight, np.uint32).reshape(n * k // 8)
        self.scales = on_device(scales, np.float16).reshape(n * k // GROUP_SIZE)
        self.up_q = on_device(up_q, np.uint32).reshape(n * k // 8) if silu else self.qweight
        self.up_s = on_device(up_s, np.float16).reshape(n * k // GROUP_SIZE) if silu else self.scales
        self.norm_weight = None if norm_weight is None else on_device(norm_weight, np.float16)
        self.records = cuda.device_array(tokens * RECORD * (k // GROUP_SIZE), np.uint32)

    def launch(self, stream, x, out) -> None:
        """out float32 [tokens, N] += (W x_m)_m (gate/up: out float16 [tokens, N] = ...), x float16
        [tokens, K] (or h float32 [tokens, K] with a norm) on the device."""
        from pynanoqwen.launch import launch

        flat = x.reshape(self.tokens * self.k)
        activations = (flat.view(np.uint32),) if self.norm_weight is None else (flat, self.norm_weight.view(np.uint32))
        launch(self.stage, self.tokens, self.stage_threads, stream, (activations, self.records))
        launch(self.kernel, self.grid, 32 * self.warps, stream,
               (self.qweight, self.scales, self.up_q, self.up_s, self.records, out.reshape(self.tokens * self.n)),
               shared_bytes=self.shared)


DECODE = DecodeSetting(rows=1, warps=8, blocks_per_sm=2, depth=4)  # the decode order replayed: one row a tile


def check(rng, shapes=None, token_counts=(1, 5, 9, 16)):
    """On the GPU: every token's row bit for bit what gemv_group's GEMV at DECODE gives that token
    alone, on fresh Gaussian x and h and random INT4 weights (the float64 bound is gemv_group's check)."""
    from gemv_group import GroupGemv, grid_for
    from harness import random_int4
    from pynanoqwen.device import sm_count
    from pynanoqwen.oracles import passed

    results = []
    for name, (n, k) in (shapes or {name: SHAPES[name] for name in ("qkv", "o_proj")}).items():
        qweight, scales = random_int4(rng, n, k)
        decode_gemv = GroupGemv(n, k, qweight, scales, grid_for(n, DECODE, sm_count()), DECODE)
        for tokens in token_counts:
            x = rng.standard_normal((tokens, k)).astype(np.float16)
            h = (3 * rng.standard_normal((tokens, n))).astype(np.float32)
            alone = []
            for m in range(tokens):
                out = cuda.to_device(h[m])
                decode_gemv.launch(0, cuda.to_device(x[m]), out)
                alone.append(out.copy_to_host())
            verify = GroupVerify(n, k, tokens, qweight, scales, verify_grid(n, SETTING), SETTING)
            out = cuda.to_device(h)
            verify.launch(0, cuda.to_device(x), out)
            same = np.array_equal(out.copy_to_host(), np.array(alone))
            results.append(passed(f"{name} verify of {tokens} tokens", same,
                                  "bit for bit the decode GEMV's rows" if same else "rows differ"))
    return results


SHAPES = {"qkv": (4608, 3584), "o_proj": (3584, 3584), "gate+up rows": (37888, 3584)}
SETTING = Setting(warps=8, depth=4, column_tiles=2)  # 122 KB of records at 16 tokens leave one block a SM


def verify_grid(n: int, setting: Setting) -> int:
    """One block a SM (the records leave room for one), fewer when there are fewer tiles than warps."""
    from pynanoqwen.device import sm_count

    return max(1, min(sm_count(), -(-(n // (TILE_ROWS * setting.column_tiles)) // setting.warps)))


def timings(replays: int = 20) -> list[dict]:
    """us a call of gemv_group's decode GEMV at DECODE (one token) and of the verify GEMV at 4, 9
    and 16 tokens with 2 and 1 column tiles a warp, each with its ratio to the decode call; weights
    rotated through twice the L2."""
    from gemv_group import GroupGemv, grid_for
    from harness import time_calls
    from pynanoqwen.device import sm_count

    rows = []
    for name, (n, k) in SHAPES.items():
        one = time_calls(lambda weights: GroupGemv(n, k, *weights[0], grid_for(n, DECODE, sm_count()), DECODE).launch,
                         n, k, 1, replays=replays)
        rows.append({"linear": name, "tokens": 1, "form": "decode (gemv_group R1 W8 B2 D4)", "us a call": one,
                     "ratio": 1.0})
        for tokens in (4, 9, 16):
            for setting in (SETTING, SETTING._replace(column_tiles=1)):
                us = time_calls(lambda weights, tokens=tokens, setting=setting: GroupVerify(
                    n, k, tokens, *weights[0], verify_grid(n, setting), setting).launch, n, k, tokens,
                    replays=replays)
                rows.append({"linear": name, "tokens": tokens, "form": f"verify W{setting.warps} D{setting.depth} "
                             f"C{setting.column_tiles}", "us a call": us, "ratio": us / one})
    return rows


def compile_targets():
    """The verify kernel at the 7B K = 3584 shapes for 9 tokens, and the staging, for tests/test_dev_variants.py."""
    from pynanoqwen.kernels import CompileTarget

    must = ("mma.sync.aligned.m16n8k32.row.col.s32.u8.u8.s32", "mma.sync.aligned.m16n8k32.row.col.s32.s8.u8.s32",
            "fma.rn.f32", "ld.global.nc.v4.u32", "ld.shared.v4.u32", "cp.async.cg.shared.global",
            "griddepcontrol.wait")
    flat_u32, flat_f16 = types.uint32[::1], types.float16[::1]
    signature = types.void(flat_u32, flat_f16, flat_u32, flat_f16, flat_u32, types.float32[::1])
    targets = [CompileTarget(f"gemv_group_verify[{name} 9 tokens, {SETTING}]",
                             build(n, k, 9, min(132, n // (TILE_ROWS * SETTING.column_tiles) // SETTING.warps),
                                   SETTING), signature, must)
               for name, (n, k) in SHAPES.items()]
    gate_up = Setting(SETTING.warps, SETTING.depth, 1)
    targets.append(CompileTarget(f"gemv_group_verify[gate_up 18944x3584 9 tokens, silu, {gate_up}]",
                                 build(18944, 3584, 9, 132, gate_up, silu=True),
                                 types.void(flat_u32, flat_f16, flat_u32, flat_f16, flat_u32, flat_f16),
                                 must + ("ex2.approx",)))
    for name, eps, activations in (("x", None, types.UniTuple(flat_u32, 1)),
                                   ("RMSNorm(h)", 1e-6, types.Tuple((types.float32[::1], flat_u32)))):
        targets.append(CompileTarget(f"gemv_group_verify stage_tokens[K 3584, {name}]",
                                     build_stage(3584, 32 * DECODE.warps, eps),
                                     types.void(activations, flat_u32), ("dp4a.u32.u32", "shfl.sync.bfly.b32",
                                                                          "prmt.b32")))
    return targets


if __name__ == "__main__":
    from harness import run

    run(check, timings, "verify GEMV of several tokens against gemv_group's decode GEMV, us a call "
                        "(weights rotated through twice the L2)")

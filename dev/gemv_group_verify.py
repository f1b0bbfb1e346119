"""Prompt lookup's verify GEMV: W x_m for up to 16 tokens m in one pass over the weights, each
token's output bit for bit what dev/gemv_group.py computes for that token alone.

Why bit for bit. A greedy verify pass is lossless only if every row of its logits is what a decode
step computes (docs/SPECULATIVE.md); a matrix product that sums in another order gives other
bits, and over 28 layers another argmax now and then. The group GEMV makes the decode order cheap
to replay. With a tile of one unit (one row, or two rows that share their x loads: R = P), lane L
of the decode warp sums groups L, L + 32, ... of each row: its partial is a chain of FMAs, acc =
fma(float32(dot_G), float32(s_w) * s_G, acc) from 0 in increasing G (one FMA for K <= 4096, 4 or 5
for down_proj's 148 groups), lanes without a group hold 0, and the row is warp_sum's butterfly over
the 32 partials (masks 16, 8, 4, 2, 1). dot_G is an exact integer, so any exact integer arithmetic
may compute it; the FMA chains and the butterfly are what has to be replayed.

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
  sums it as the leaves arrive (`push`): nothing is parked in shared memory. A leaf's chain is its
  lane's groups in order (`split_items` lists the items); lanes without a group (28..31 at K =
  3584) enter as leaves of 0 after the item before them, as in decode. Then out[m, row] += total,
  the decode epilogue. Items go through `depth` register slots,
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
half its length. Measured on the H200 (docs/PERFORMANCE.md, 2026-12-05): bit for bit, and 2.5x
(down_proj) to 5.4x (qkv) the decode group GEMV at 9 tokens, well over this count.

Split K. down_proj's x for 16 tokens (18944 inputs) does not fit one SM. The butterfly's leaves in
bit-reversed order make any aligned run of 32/S leaves a whole subtree, so S blocks can share a
tile's K, block b taking leaves [32 b / S, 32 (b + 1) / S): the groups of those lanes only, whose
records it stages (37 of down_proj's 148 at S = 4), and its subtree's sums, which it writes to
`partials`; `combine` then adds the S sums as the top log2 S levels of the tree do (adjacent pairs
first). The same bits as one block, by construction.

Scope (a dev variant): the residual, the gate/up (gate and up in column tiles of their own, so that
a lane holds both sums of a (token, row)) and the QKV epilogues (a head's rows d0.. and their RoPE
partners d0 + head_dim/2.. in the two column tiles; each token's pair goes through gemv_group's
rope_writer at its own position, q and K/V slots included); replays gemv_group with a tile of one unit
(R = P); each block stages its split's records of every token in shared memory (K/128 x 68 x 4
bytes a token without a split: 122 KB for 16 tokens at K = 3584), copied by cp.async from records
a first kernel writes (`stage_tokens`, one block a token, the same staging function as the decode
GEMV, with its fused RMSNorm when the decode GEMV has one, at the decode block's thread count). Not
in the engine.
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

from gemv_group import OFFSET_WORD, RECORD, SCALE_WORD, group_stager, rope_writer  # noqa: E402
from gemv_group import Setting as DecodeSetting  # noqa: E402
from pynanoqwen.config import GROUP_SIZE  # noqa: E402
from pynanoqwen.kernels.gemv_int4_paths import NIBBLE_BYTES  # noqa: E402
from pynanoqwen.ptx import SIMULATOR  # noqa: E402
from pynanoqwen.ptx.bits import bits_float  # noqa: E402
from pynanoqwen.ptx.fma import fma  # noqa: E402
from pynanoqwen.ptx.griddep import grid_dependency_wait, launch_dependents  # noqa: E402
from pynanoqwen.ptx.loads import ld_global_nc_v4_u32  # noqa: E402
from pynanoqwen.ptx.mma import (cp_async_16, cp_async_commit_group, cp_async_wait_group,  # noqa: E402
                                ld_shared_v4_u32, mma_m16n8k32_s8u8, mma_m16n8k32_u8u8)

U = np.uint32
MAX_TOKENS = 16  # the mma's M
TILE_ROWS = 8  # the mma's N: weight rows a warp computes at once
# warps a block; depth: groups whose weights a lane has in flight; column_tiles: 8-row mma columns a
# warp computes from one load of the tokens' x (a warp tile of 8 column_tiles rows); splits: blocks
# that share a tile's K, each a subtree of warp_sum's tree (so that each stages a part of x).
Setting = collections.namedtuple("Setting", "warps depth column_tiles splits", defaults=(4, 1, 1))
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


LEAF_LANES = [int(f"{i:05b}"[::-1], 2) for i in range(32)]  # leaf i of warp_sum's tree is lane bitrev5(i)


@functools.cache
def split_items(groups: int, splits: int, depth: int) -> tuple[np.ndarray, ...]:
    """The items (groups) each split of K computes, in order, as tables [splits, length]: group,
    whether it starts its leaf's FMA chain, how many leaves to push after it (0 inside a chain; 1 +
    the lanes without a group that follow), its leaf's index within the split's subtree, and
    whether it is an item at all (each split's list is padded to a multiple of depth). Split b
    owns leaves [32 b / S, 32 (b + 1) / S) of warp_sum's tree, a whole subtree: the lanes
    bitrev5(i) of those leaves and their groups L, L + 32, ... (module docstring)."""
    per_split = 32 // splits
    lists = []
    for b in range(splits):
        items = []
        for local in range(per_split):
            lane = LEAF_LANES[b * per_split + local]
            chain = list(range(lane, groups, 32))
            if not chain:  # a lane without a group: a zero leaf after the item before it
                group_, start, push, leaf, valid = items[-1]
                items[-1] = (group_, start, push + 1, leaf, valid)
                continue
            for j, group in enumerate(chain):
                items.append((group, int(j == 0), int(j == len(chain) - 1), local, 1))
        while len(items) % depth:
            items.append((items[-1][0], 0, 0, 0, 0))
        lists.append(items)
    length = max(len(items) for items in lists)
    tables = np.zeros((5, splits, length), np.uint32)
    counts = np.zeros(splits, np.uint32)
    for b, items in enumerate(lists):
        counts[b] = len(items)
        tables[:, b, :len(items)] = np.array(items, np.uint32).T
    return (*tables, counts)


def shared_bytes(k: int, tokens: int, splits: int = 1, depth: int = 4) -> int:
    """The verify kernel's dynamic shared memory: every token's records of one split's groups."""
    length = split_items(k // GROUP_SIZE, splits, depth)[0].shape[1]
    return 4 * tokens * RECORD * length


@functools.cache
def build(n: int, k: int, tokens: int, grid: int, setting: Setting, silu: bool = False,
          heads: tuple[int, int, int] | None = None):
    """verify(q0, s0, q1, s1, records, out, partials): out[m N + row] += W x_m for m < tokens (out
    float32 [tokens N]), or with silu the gate/up projection out[m N + row] = silu(Wg x_m) * (Wu
    x_m) (out float16; Wg = q0/s0, Wu = q1/s1, which take column tiles of their own: a lane then
    holds both of a (token, row)); q/s as gemv_group, records from stage_tokens. With S splits of
    K (setting.splits > 1) the grid is S x blocks a split, block i computing split i % S of its
    tiles, whose subtree sums go to partials [S, tokens, N] for `combine` instead of to out.
    With heads = (num_heads, num_kv_heads, head_dim), the QKV projection of gemv_group's RoPE form
    for tokens at positions pos[0] + m: a warp tile is rows d0..d0+7 of a head and their partners
    d0 + head_dim/2.. (two column tiles), and out is (bias, q [tokens, num_heads head_dim], k_pages,
    v_pages, page_table, pos, rope_cos, rope_sin), each token's pair written by gemv_group's
    rope_writer at its position. Replays gemv_group's tile of one unit."""
    groups_count = k // GROUP_SIZE
    columns, splits, depth = setting.column_tiles, setting.splits, setting.depth
    rope = heads is not None
    num_heads, num_kv_heads, head_dim = heads if rope else (1, 1, 2 * TILE_ROWS)
    half = head_dim // 2
    if rope and (columns != 1 or silu or splits != 1 or half % TILE_ROWS
                 or n != (num_heads + 2 * num_kv_heads) * head_dim):
        raise ValueError(f"the RoPE form takes one column tile of row pairs, no silu or split, head_dim/2 a "
                         f"multiple of {TILE_ROWS}, N = (heads + 2 kv heads) head_dim; got {setting}, {heads}, N {n}")
    rows_per_warp = TILE_ROWS * columns * (2 if rope else 1)
    if (n % rows_per_warp or k % GROUP_SIZE or not 1 <= tokens <= MAX_TOKENS or not 1 <= depth <= 4
            or splits not in (1, 2, 4, 8) or (splits > 1 and (groups_count < 32 or silu)) or grid % splits):
        raise ValueError(f"{n}x{k}, {tokens} tokens, grid {grid}, {setting}: N a multiple of {rows_per_warp}, K of "
                         f"{GROUP_SIZE}, 1..{MAX_TOKENS} tokens, depth 1..4, splits 1, 2, 4 or 8 dividing the "
                         f"grid, more than one only where every decode lane owns a group and without silu")
    warps = setting.warps
    threads = 32 * warps
    groups = U(groups_count)
    words_per_row = U(k // 8)
    tiles = U(n // rows_per_warp)
    split_warps = U(grid // splits * warps)  # warps that share one split
    item_group, item_start, item_push, item_leaf, item_valid, item_counts = split_items(groups_count, splits, depth)
    length = item_group.shape[1]
    record_words = U(RECORD * groups_count)  # a token's records in global memory
    local_words = U(RECORD * length)  # a token's records of one split in shared memory
    record_copies = U(tokens * length * (RECORD // 4))  # 16-byte copies of one split's records
    t_count = U(tokens)
    cols = (2 if silu or rope else 1) * columns  # column tile j: matrix j // columns, rows 8 (j % columns) ..
    rope_pair = rope_writer(num_heads, num_kv_heads, head_dim)
    tiles_a_head = half // TILE_ROWS
    q_size = U(num_heads * head_dim)
    pairs = 4 * cols  # (token, row) sums a lane holds: tokens g, g + 8 x rows 2t, 2t + 1 of each column tile
    slot_words, slot_scales = 4 * cols * depth, 2 * cols * depth
    stack_words = LEVELS * pairs

    @cuda.jit(device=True, inline="always")
    def tile_row(tile, j):
        """The first row of column tile j of a warp tile: 8 j on; or with RoPE, of the head's rows
        d0.. (j = 0) or their partners d0 + head_dim/2.. (j = 1)."""
        if rope:
            head, d0 = U(tile // U(tiles_a_head)), U(U(tile % U(tiles_a_head)) * U(TILE_ROWS))
            return U(U(U(head * U(head_dim)) + d0) + U(j * half))
        return U(U(tile * U(rows_per_warp)) + U(TILE_ROWS * (j % columns)))

    @cuda.jit(device=True, inline="always")
    def load_item(q0, s0, q1, s1, b, tile, item, g, t, words, scl, d):
        """Item `item` of split b of a warp tile into slot d: for each column tile j, row 8 (j %
        columns) + g's words 4t..4t+3 of the item's group and the scales of rows 8 (j % columns) +
        2t and + 2t + 1, of matrix j // columns."""
        group = item_group[b, item]
        for j in range(cols):
            q, s = (q0, s0) if j < columns or rope else (q1, s1)
            row = U(tile_row(tile, j) + g)
            at = U(U(row * words_per_row) + U(U(U(16) * group) + U(U(4) * t)))
            w = 4 * (cols * d + j)
            words[w], words[w + 1], words[w + 2], words[w + 3] = ld_global_nc_v4_u32(q, at)
            pair_row = U(tile_row(tile, j) + U(U(2) * t))
            scl[2 * (cols * d + j)] = s[U(U(pair_row * groups) + group)]
            scl[2 * (cols * d + j) + 1] = s[U(U(U(pair_row + U(1)) * groups) + group)]

    @cuda.jit(device=True, inline="always")
    def prefetch(q0, s0, q1, s1, b, count, tile, item, g, t, words, scl, d):
        """Slot d gets the item `item`, which may be in the warp's next tile."""
        if item < count:
            load_item(q0, s0, q1, s1, b, tile, item, g, t, words, scl, d)
        elif U(tile + split_warps) < tiles:
            load_item(q0, s0, q1, s1, b, U(tile + split_warps), U(item - count), g, t, words, scl, d)

    @cuda.jit(device=True, inline="always")
    def chain(records, item, start, g, t, words, scl, d, acc):
        """The item's dots for tokens g, g + 8 and rows 2t, 2t + 1 of every column tile (slot d's
        weights), each FMAed onto its decode lane's chain: acc = fma(float32(dot), float32(s_w) *
        s_G, acc), acc from 0 at a chain's first item, as gemv_group's. The tokens' x (the item's
        record) is read once for all the column tiles."""
        m0, m1 = g, U(g + U(8))
        base0 = U(U(m0 * local_words) + U(U(RECORD) * item))
        base1 = U(U(m1 * local_words) + U(U(RECORD) * item))
        if m0 >= t_count:  # a padding token: any record will do, its sums are never stored
            base0 = U(U(RECORD) * item)
        if m1 >= t_count:
            base1 = U(U(RECORD) * item)
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
        for c in range(cols):
            w0, w1 = float32(scl[2 * (cols * d + c)]), float32(scl[2 * (cols * d + c) + 1])
            for e in range(4):  # (token g, row 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1)
                scale = (w0 if e % 2 == 0 else w1) * (x_scale0 if e < 2 else x_scale1)
                dot = int32(highs[4 * c + e] * int32(256) + lows[4 * c + e])
                acc[4 * c + e] = fma(float32(dot), scale, float32(0) if start else acc[4 * c + e])

    @cuda.jit(device=True, inline="always")
    def push(stack, leaf, i):
        """Leaf i of the butterfly (lane bitrev5(i)'s partial, i within the split's subtree) into the
        stack of left subtrees: while i's low bits are ones, the pending left sibling is added
        (left + right, as the lower lane adds its partner in warp_sum; the same bits either way).
        After the subtree's last leaf, leaf holds its sums."""
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
    def step(q0, s0, q1, s1, records, b, count, tile, item, g, t, words, scl, d, acc, leaf, stack):
        """Item `item` (in slot d) onto its chain; where the chain ends, the chain's sums as a leaf
        into the stack, then the zero leaves of the lanes without a group that follow; slot d then
        requests the item `depth` on."""
        if item_valid[b, item]:
            chain(records, item, item_start[b, item], g, t, words, scl, d, acc)
            pushes = item_push[b, item]
            if pushes:
                i = item_leaf[b, item]
                for p in range(pairs):
                    leaf[p] = acc[p]
                push(stack, leaf, i)
                for z in range(U(pushes - U(1))):
                    for p in range(pairs):
                        leaf[p] = float32(0)
                    push(stack, leaf, U(U(i + U(1)) + U(z)))
        prefetch(q0, s0, q1, s1, b, count, tile, U(item + U(depth)), g, t, words, scl, d)

    @cuda.jit(**({} if SIMULATOR else {"launch_bounds": (threads, 1)}))
    def verify(q0, s0, q1, s1, records_global, out, partials):
        records = cuda.shared.array(0, uint32)  # dynamic: the tokens' records of this split's groups
        lane = U(cuda.laneid)
        g, t = U(lane // U(4)), U(lane % U(4))
        b = U(U(cuda.blockIdx.x) % U(splits))
        warp_id = U(U(U(U(cuda.blockIdx.x) // U(splits)) * U(warps)) + U(U(cuda.threadIdx.x) // U(32)))
        count = item_counts[b]
        words = cuda.local.array(slot_words, uint32)  # slot d: the weights of item d (mod depth)
        scl = cuda.local.array(slot_scales, types.float16)
        acc = cuda.local.array(pairs, float32)
        leaf = cuda.local.array(pairs, float32)
        stack = cuda.local.array(stack_words, float32)
        if warp_id < tiles:  # the weights do not depend on the kernel before: request them first
            load_item(q0, s0, q1, s1, b, warp_id, U(0), g, t, words, scl, 0)
            if depth >= 2:
                load_item(q0, s0, q1, s1, b, warp_id, U(1), g, t, words, scl, 1)
            if depth >= 3:
                load_item(q0, s0, q1, s1, b, warp_id, U(2), g, t, words, scl, 2)
            if depth >= 4:
                load_item(q0, s0, q1, s1, b, warp_id, U(3), g, t, words, scl, 3)
        grid_dependency_wait()
        i = U(cuda.threadIdx.x)  # copy (token m, item p, 16 bytes e) of this split's records
        while i < record_copies:
            e = U(i % U(RECORD // 4))
            p = U(U(i // U(RECORD // 4)) % U(length))
            m = U(i // U(U(RECORD // 4) * U(length)))
            source = U(U(U(m * record_words) + U(U(RECORD) * item_group[b, p])) + U(U(4) * e))
            cp_async_16(records, U(U(U(m * local_words) + U(U(RECORD) * p)) + U(U(4) * e)), records_global, source,
                        U(16))
            i = U(i + U(threads))
        cp_async_commit_group()
        cp_async_wait_group(0)
        cuda.syncthreads()
        tile = warp_id
        while tile < tiles:
            item = U(0)
            while item < count:  # one call a slot, so that each slot's index is a constant
                step(q0, s0, q1, s1, records, b, count, tile, item, g, t, words, scl, 0, acc, leaf, stack)
                if depth >= 2:
                    step(q0, s0, q1, s1, records, b, count, tile, U(item + U(1)), g, t, words, scl, 1, acc, leaf,
                         stack)
                if depth >= 3:
                    step(q0, s0, q1, s1, records, b, count, tile, U(item + U(2)), g, t, words, scl, 2, acc, leaf,
                         stack)
                if depth >= 4:
                    step(q0, s0, q1, s1, records, b, count, tile, U(item + U(3)), g, t, words, scl, 3, acc, leaf,
                         stack)
                item = U(item + U(depth))
            for c in range(columns):
                row0 = U(tile_row(tile, c) + U(U(2) * t))
                for e in range(4):  # (token g, row 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1)
                    m = U(g + U(8 * (e // 2)))
                    if m < t_count:
                        at = U(U(m * U(n)) + U(row0 + U(e % 2)))
                        total = leaf[4 * c + e]
                        if rope:  # x1 and its partner x2 (column tile 1) of token m at pos[0] + m
                            bias, q_out, pos = out[0], out[1], out[5]
                            rope_pair(U(row0 + U(e % 2)), total, leaf[4 + e], bias,
                                      q_out[U(m * q_size):U(U(m + U(1)) * q_size)], out[2], out[3], out[4],
                                      U(U(pos[0]) + m), out[6], out[7])
                        elif splits > 1:  # the subtree's sum, for `combine`
                            partials[U(U(b * U(tokens * n)) + at)] = total
                        elif silu:  # the decode GEMV's silu epilogue, its up row in column tile columns + c
                            out[at] = total / (float32(1) + math.exp(-total)) * leaf[4 * (columns + c) + e]
                        else:
                            out[at] += total
            tile = U(tile + split_warps)
        launch_dependents()

    return verify


@functools.cache
def build_combine(n: int, tokens: int, splits: int):
    """combine(partials, out): out[m N + row] += the top levels of warp_sum's tree over the S
    subtree sums partials[0..S-1, m, row] (adjacent pairs first), one thread an output."""
    size = U(tokens * n)

    @cuda.jit
    def combine(partials, out):
        at = U(U(U(cuda.blockIdx.x) * U(cuda.blockDim.x)) + U(cuda.threadIdx.x))
        grid_dependency_wait()
        if at < size:
            sums = cuda.local.array(splits, float32)
            for b in range(splits):
                sums[b] = partials[U(U(U(b) * size) + at)]
            width = splits // 2
            while width >= 1:
                for b in range(width):
                    sums[b] = sums[2 * b] + sums[2 * b + 1]
                width //= 2
            out[at] += sums[0]
        launch_dependents()

    return combine


class GroupVerify:
    """out[m, :] += W x_m for `tokens` tokens, each as dev/gemv_group.py's GEMV with `decode_warps`
    warps a block computes it alone (with norm_weight and norm_eps, x_m = RMSNorm(h_m) * weight;
    with up_q/up_s, the gate/up projection out float16 [tokens, N] = silu(W x_m) * (W_up x_m);
    with heads and bias, the QKV projection with RoPE and the KV write, launch_rope).
    With setting.splits > 1 a third launch adds the splits' subtree sums (`combine`)."""

    def __init__(self, n, k, tokens, qweight, scales, grid, setting, decode_warps=8, norm_weight=None,
                 norm_eps=None, up_q=None, up_s=None, heads=None, bias=None):
        from pynanoqwen.kernels import on_device

        self.n, self.k, self.tokens, self.grid, self.warps = n, k, tokens, grid, setting.warps
        silu = up_q is not None
        self.stage_threads = 32 * decode_warps
        self.stage = build_stage(k, self.stage_threads, None if norm_eps is None else float(norm_eps))
        self.kernel = build(n, k, tokens, grid, setting, silu, None if heads is None else tuple(heads))
        self.bias = None if bias is None else on_device(bias, np.float16)
        self.combine = build_combine(n, tokens, setting.splits) if setting.splits > 1 else None
        self.shared = shared_bytes(k, tokens, setting.splits, setting.depth)
        self.qweight = on_device(qweight, np.uint32).reshape(n * k // 8)
        self.scales = on_device(scales, np.float16).reshape(n * k // GROUP_SIZE)
        self.up_q = on_device(up_q, np.uint32).reshape(n * k // 8) if silu else self.qweight
        self.up_s = on_device(up_s, np.float16).reshape(n * k // GROUP_SIZE) if silu else self.scales
        self.norm_weight = None if norm_weight is None else on_device(norm_weight, np.float16)
        self.records = cuda.device_array(tokens * RECORD * (k // GROUP_SIZE), np.uint32)
        self.partials = cuda.device_array(max(1, setting.splits if self.combine else 0) * tokens * n, np.float32)

    def launch(self, stream, x, out) -> None:
        """out float32 [tokens, N] += (W x_m)_m (gate/up: out float16 [tokens, N] = ...), x float16
        [tokens, K] (or h float32 [tokens, K] with a norm) on the device."""
        from pynanoqwen.launch import launch

        flat = x.reshape(self.tokens * self.k)
        activations = (flat.view(np.uint32),) if self.norm_weight is None else (flat, self.norm_weight.view(np.uint32))
        out = out.reshape(self.tokens * self.n)
        launch(self.stage, self.tokens, self.stage_threads, stream, (activations, self.records))
        launch(self.kernel, self.grid, 32 * self.warps, stream,
               (self.qweight, self.scales, self.up_q, self.up_s, self.records, out, self.partials),
               shared_bytes=self.shared)
        if self.combine is not None:
            launch(self.combine, -(-self.tokens * self.n // 256), 256, stream, (self.partials, out))

    def launch_rope(self, stream, x, q, k_pages, v_pages, page_table, pos, rope_cos, rope_sin) -> None:
        """The QKV form (built with heads and bias) for tokens at positions pos[0] + m: q float32
        [tokens, num_heads, head_dim], each position's slots of k_pages and v_pages, as
        gemv_group's launch_rope writes them for each token alone."""
        from pynanoqwen.launch import launch

        flat = x.reshape(self.tokens * self.k)
        activations = (flat.view(np.uint32),) if self.norm_weight is None else (flat, self.norm_weight.view(np.uint32))
        launch(self.stage, self.tokens, self.stage_threads, stream, (activations, self.records))
        out = (self.bias, q.reshape(q.size), k_pages, v_pages, page_table, pos, rope_cos, rope_sin)
        launch(self.kernel, self.grid, 32 * self.warps, stream,
               (self.qweight, self.scales, self.up_q, self.up_s, self.records, out, self.partials),
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
    for name, (n, k) in (shapes or {name: SHAPES[name] for name in ("qkv", "o_proj", "down_proj")}).items():
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
            setting = setting_for(k)
            verify = GroupVerify(n, k, tokens, qweight, scales, verify_grid(n, setting), setting)
            out = cuda.to_device(h)
            verify.launch(0, cuda.to_device(x), out)
            same = np.array_equal(out.copy_to_host(), np.array(alone))
            results.append(passed(f"{name} verify of {tokens} tokens", same,
                                  "bit for bit the decode GEMV's rows" if same else "rows differ"))
    return results


SHAPES = {"qkv": (4608, 3584), "o_proj": (3584, 3584), "gate+up rows": (37888, 3584), "down_proj": (3584, 18944)}
SETTING = Setting(warps=8, depth=4, column_tiles=2)  # 122 KB of records at 16 tokens leave one block a SM
SPLITS = {18944: 4}  # K split between blocks where x does not fit: 40 records a token at down_proj's K


def setting_for(k: int, setting: Setting = SETTING) -> Setting:
    return setting._replace(splits=SPLITS.get(k, 1))


def verify_grid(n: int, setting: Setting) -> int:
    """One block a SM (the records leave room for one), fewer when there are fewer tiles than warps;
    a multiple of the splits."""
    from pynanoqwen.device import sm_count

    tiles = n // (TILE_ROWS * setting.column_tiles)
    return setting.splits * max(1, min(sm_count() // setting.splits, -(-tiles // setting.warps)))


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
            for setting in (setting_for(k), setting_for(k)._replace(column_tiles=1)):
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
    flat_f32 = types.float32[::1]
    signature = types.void(flat_u32, flat_f16, flat_u32, flat_f16, flat_u32, flat_f32, flat_f32)
    targets = [CompileTarget(f"gemv_group_verify[{name} 9 tokens, {setting_for(k)}]",
                             build(n, k, 9, setting_for(k).splits * 28, setting_for(k)), signature, must)
               for name, (n, k) in SHAPES.items()]
    gate_up = Setting(SETTING.warps, SETTING.depth, 1)
    targets.append(CompileTarget(f"gemv_group_verify[gate_up 18944x3584 9 tokens, silu, {gate_up}]",
                                 build(18944, 3584, 9, 132, gate_up, silu=True),
                                 types.void(flat_u32, flat_f16, flat_u32, flat_f16, flat_u32, flat_f16, flat_f32),
                                 must + ("ex2.approx",)))
    pages = types.float16[:, :, :, ::1]
    rope_out = types.Tuple((flat_f16, flat_f32, pages, pages, types.int32[::1], types.int32[::1],
                            types.float32[:, ::1], types.float32[:, ::1]))
    rope_setting = Setting(SETTING.warps, SETTING.depth, 1)
    targets.append(CompileTarget(f"gemv_group_verify[qkv 4608x3584 9 tokens, rope + KV write, {rope_setting}]",
                                 build(4608, 3584, 9, 132, rope_setting, heads=(28, 4, 128)),
                                 types.void(flat_u32, flat_f16, flat_u32, flat_f16, flat_u32, rope_out, flat_f32),
                                 must + ("cvt.rn.f16.f32",)))
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

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
- Then the lane holds dot for tokens g, g + 8 and rows 2t, 2t + 1, and makes the decode lanes'
  partials from them. The groups are taken in the order of the butterfly's leaves: leaf i is the
  partial of lane bitrev5(i) (0, 16, 8, 24, 4, ...), so warp_sum's tree is the balanced binary tree
  over the leaves in that order, and a stack of 5 pending left subtrees a (row, token) sums it as
  the leaves arrive (`push`): nothing is parked in shared memory. Lanes without a group (28..31 at
  K = 3584) enter as leaves of 0, as in decode. Then out[m, row] += total, the decode epilogue.

Counted per 8 rows, up to 16 tokens and one group (one leaf), in warp instructions. PTX of the
leaf loop at o_proj (`compile_ptx`, 9 tokens): 384 instructions, 164 of them movs (the slot
rotation and the stack's phis, mostly renamed away by ptxas), both prefetch branches included; ~170
of them run a leaf, 40 being the shared-address arithmetic of the 8 ld.shared.v4 (add, shl, cvt,
add.s64, cvt each). By hand, if ptxas folds that into the loads' offsets: 8 mma, 12 shared loads,
12 for the unpack, ~18 for the four leaves (combine, convert, scale product, FMA), ~14 to prefetch
the item 4 on (its group from a constant table, 16 bytes and 2 scales), ~12 slot moves, ~11 for
the stack, ~6 for the loop: ~100, against ~38-45 for the same rows and group at one token in
gemv_group (8 units of its ~150-182 a unit, over 32 lanes). So ~2.5x a decode GEMV's instructions
for up to 16 tokens, not the ~1.4x docs/SPECULATIVE.md hoped: the mma itself and the float terms
(26 of the ~100) are about what decode spends on the same weights; the rest is the replay's
bookkeeping, which more rows a warp (A loads shared by several column tiles) would amortize.

Scope (a dev variant): residual epilogue only; replays gemv_group at R = 1 and K <= 4096 (the
decode tile of one row makes every row's leaves the same lanes; a longer K makes a lane's partial a
chain of FMAs, which the same stack takes with a chain per leaf, not built); the whole of every
token's x staged in each block's shared memory (K/128 x 68 x 4 bytes a token: 122 KB for 16 tokens
at K = 3584), copied by cp.async from records a first kernel writes (`stage_tokens`, one block a
token, the same staging function as the decode GEMV). Not in the engine.
"""
from __future__ import annotations

import collections
import functools
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
STAGE_THREADS = 256  # the staging kernel's block (any multiple of 16: records do not depend on it)

# warps a block; depth: groups whose weights a lane has in flight.
Setting = collections.namedtuple("Setting", "warps depth", defaults=(4,))
LEVELS = 5  # warp_sum's butterfly: masks 16, 8, 4, 2, 1


@functools.cache
def build_stage(k: int, tokens: int):
    """stage_tokens(x_pairs, records): token m's x (float16 [tokens, K] as uint32 pairs) into
    records[m K/128 68 ..], one block of STAGE_THREADS a token."""
    stage = group_stager(k, STAGE_THREADS)
    words_per_token = U(k // 2)
    record_words = U(RECORD * (k // GROUP_SIZE))

    @cuda.jit
    def stage_tokens(x_pairs, records):
        m = U(cuda.blockIdx.x)
        grid_dependency_wait()
        stage(x_pairs, U(m * words_per_token), records, U(m * record_words))
        launch_dependents()

    return stage_tokens


def shared_bytes(k: int, tokens: int) -> int:
    """The verify kernel's dynamic shared memory: every token's records."""
    return 4 * tokens * RECORD * (k // GROUP_SIZE)


def leaf_order(groups: int) -> np.ndarray:
    """The groups in the order their leaves enter the butterfly: lane L = bitrev5(i) for i = 0..31,
    the lanes that own a group (L < groups)."""
    lanes = [int(f"{i:05b}"[::-1], 2) for i in range(32)]
    return np.array([lane for lane in lanes if lane < groups], np.uint32)


@functools.cache
def build(n: int, k: int, tokens: int, grid: int, setting: Setting):
    """verify(q, s, records, out): out[m N + row] += W x_m for m < tokens; q/s as gemv_group,
    records from stage_tokens, out float32 [tokens N]. Replays gemv_group at R = 1 for K <= 4096."""
    groups_count = k // GROUP_SIZE
    if n % TILE_ROWS or k % GROUP_SIZE or not 1 <= groups_count <= 32 or not 1 <= tokens <= MAX_TOKENS \
            or not 1 <= setting.depth <= groups_count:
        raise ValueError(f"{n}x{k}, {tokens} tokens, {setting}: N a multiple of {TILE_ROWS}, K a multiple of "
                         f"{GROUP_SIZE} up to 4096 (one group a decode lane), 1..{MAX_TOKENS} tokens, "
                         f"depth 1..K/{GROUP_SIZE}")
    warps, depth = setting.warps, setting.depth
    threads = 32 * warps
    groups = U(groups_count)
    words_per_row = U(k // 8)
    tiles = U(n // TILE_ROWS)
    total_warps = U(grid * warps)
    record_words = U(RECORD * groups_count)
    quads = U(tokens * RECORD * groups_count // 4)
    t_count = U(tokens)
    order = leaf_order(groups_count)
    slot_words, slot_scales = 4 * depth, 2 * depth
    stack_words = 4 * LEVELS

    @cuda.jit(device=True, inline="always")
    def load_item(q, s, tile, item, g, t, words, scl, d):
        """Item `item` of a tile (its group order[item]): row g's words 4t..4t+3 of the group and the
        scales of rows 2t and 2t + 1, into slot d."""
        group = order[item]
        first = U(tile * U(TILE_ROWS))
        at = U(U(U(first + g) * words_per_row) + U(U(U(16) * group) + U(U(4) * t)))
        words[4 * d], words[4 * d + 1], words[4 * d + 2], words[4 * d + 3] = ld_global_nc_v4_u32(q, at)
        scl[2 * d] = s[U(U(U(first + U(U(2) * t)) * groups) + group)]
        scl[2 * d + 1] = s[U(U(U(U(first + U(U(2) * t)) + U(1)) * groups) + group)]

    @cuda.jit(device=True, inline="always")
    def prefetch(q, s, tile, item, g, t, words, scl, d):
        """Slot d gets the item `item` positions on, which may be in the warp's next tile."""
        if item < groups:
            load_item(q, s, tile, item, g, t, words, scl, d)
        elif U(tile + total_warps) < tiles:
            load_item(q, s, U(tile + total_warps), U(item - groups), g, t, words, scl, d)

    @cuda.jit(device=True, inline="always")
    def leaves(records, group, g, t, words, scl, leaf):
        """The decode lane partials of this group for tokens g, g + 8 and rows 2t, 2t + 1 (slot 0's
        weights): leaf = fma(float32(dot), float32(s_w) * s_G, 0), as gemv_group's first FMA."""
        m0, m1 = g, U(g + U(8))
        base0 = U(U(m0 * record_words) + U(U(RECORD) * group))
        base1 = U(U(m1 * record_words) + U(U(RECORD) * group))
        if m0 >= t_count:  # a padding token: any record will do, its sums are never stored
            base0 = U(U(RECORD) * group)
        if m1 >= t_count:
            base1 = U(U(RECORD) * group)
        off0, off1 = int32(records[U(base0 + U(OFFSET_WORD))]), int32(records[U(base1 + U(OFFSET_WORD))])
        low0, low1, low2, low3 = off0, off0, off1, off1
        high0, high1, high2, high3 = int32(0), int32(0), int32(0), int32(0)
        for c in range(4):
            word = words[c]
            b0 = word & NIBBLE_BYTES
            b1 = (word >> U(4)) & NIBBLE_BYTES
            lo_a0, hi_a0, lo_b0, hi_b0 = ld_shared_v4_u32(records, U(base0 + U(U(U(16) * t) + U(4 * c))))
            lo_a1, hi_a1, lo_b1, hi_b1 = ld_shared_v4_u32(records, U(base1 + U(U(U(16) * t) + U(4 * c))))
            low0, low1, low2, low3 = mma_m16n8k32_u8u8(lo_a0, lo_a1, lo_b0, lo_b1, b0, b1, low0, low1, low2, low3)
            high0, high1, high2, high3 = mma_m16n8k32_s8u8(hi_a0, hi_a1, hi_b0, hi_b1, b0, b1, high0, high1, high2,
                                                           high3)
        x_scale0 = bits_float(records[U(base0 + U(SCALE_WORD))])
        x_scale1 = bits_float(records[U(base1 + U(SCALE_WORD))])
        w0, w1 = float32(scl[0]), float32(scl[1])
        zero = float32(0)
        leaf[0] = cuda.fma(float32(int32(high0 * int32(256) + low0)), w0 * x_scale0, zero)
        leaf[1] = cuda.fma(float32(int32(high1 * int32(256) + low1)), w1 * x_scale0, zero)
        leaf[2] = cuda.fma(float32(int32(high2 * int32(256) + low2)), w0 * x_scale1, zero)
        leaf[3] = cuda.fma(float32(int32(high3 * int32(256) + low3)), w1 * x_scale1, zero)

    @cuda.jit(device=True, inline="always")
    def push(stack, leaf, i):
        """Leaf i of the butterfly (lane bitrev5(i)'s partial) into the stack of left subtrees:
        while i's low bits are ones, the pending left sibling is added (left + right, as the
        lower lane adds its partner in warp_sum; the same bits either way). After leaf 31, leaf
        holds the four sums."""
        carry = True
        for level in range(LEVELS):
            if carry:
                if (i >> U(level)) & U(1):
                    for p in range(4):
                        leaf[p] = stack[LEVELS * p + level] + leaf[p]
                else:
                    for p in range(4):
                        stack[LEVELS * p + level] = leaf[p]
                    carry = False

    @cuda.jit(**({} if SIMULATOR else {"launch_bounds": (threads, 1)}))
    def verify(q, s, records_global, out):
        records = cuda.shared.array(0, uint32)  # dynamic: the tokens' records
        lane = U(cuda.laneid)
        g, t = U(lane // U(4)), U(lane % U(4))
        warp_id = U(U(U(cuda.blockIdx.x) * U(warps)) + U(U(cuda.threadIdx.x) // U(32)))
        words = cuda.local.array(slot_words, uint32)  # slot d: the weights of the item d on
        scl = cuda.local.array(slot_scales, types.float16)
        leaf = cuda.local.array(4, float32)
        stack = cuda.local.array(stack_words, float32)
        if warp_id < tiles:  # the weights do not depend on the kernel before: request them first
            for d in range(depth):
                load_item(q, s, warp_id, U(d), g, t, words, scl, d)
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
            for i in range(32):
                lane_of_leaf = U(cuda.brev(U(i)) >> U(27))
                if lane_of_leaf < groups:
                    leaves(records, lane_of_leaf, g, t, words, scl, leaf)
                    for d in range(depth - 1):  # the slots move up; the last gets the item depth on
                        for e in range(4):
                            words[4 * d + e] = words[4 * d + 4 + e]
                        scl[2 * d], scl[2 * d + 1] = scl[2 * d + 2], scl[2 * d + 3]
                    prefetch(q, s, tile, U(item + U(depth)), g, t, words, scl, depth - 1)
                    item = U(item + U(1))
                else:  # a decode lane without a group: its partial is 0
                    for p in range(4):
                        leaf[p] = float32(0)
                push(stack, leaf, U(i))
            first = U(tile * U(TILE_ROWS))
            row0 = U(first + U(U(2) * t))
            if g < t_count:
                out[U(U(g * U(n)) + row0)] += leaf[0]
                out[U(U(U(g * U(n)) + row0) + U(1))] += leaf[1]
            if U(g + U(8)) < t_count:
                out[U(U(U(g + U(8)) * U(n)) + row0)] += leaf[2]
                out[U(U(U(U(g + U(8)) * U(n)) + row0) + U(1))] += leaf[3]
            tile = U(tile + total_warps)
        launch_dependents()

    return verify


class GroupVerify:
    """out[m, :] += W x_m for `tokens` tokens, each as dev/gemv_group.py's GEMV computes it alone."""

    def __init__(self, n, k, tokens, qweight, scales, grid, setting):
        from pynanoqwen.kernels import on_device

        self.n, self.k, self.tokens, self.grid, self.warps = n, k, tokens, grid, setting.warps
        self.stage = build_stage(k, tokens)
        self.kernel = build(n, k, tokens, grid, setting)
        self.shared = shared_bytes(k, tokens)
        self.qweight = on_device(qweight, np.uint32).reshape(n * k // 8)
        self.scales = on_device(scales, np.float16).reshape(n * k // GROUP_SIZE)
        self.records = cuda.device_array(tokens * RECORD * (k // GROUP_SIZE), np.uint32)

    def launch(self, stream, x, out) -> None:
        """out float32 [tokens, N] += (W x_m)_m, x float16 [tokens, K] on the device."""
        from pynanoqwen.launch import launch

        launch(self.stage, self.tokens, STAGE_THREADS, stream, (x.reshape(self.tokens * self.k).view(np.uint32),
                                                                self.records))
        launch(self.kernel, self.grid, 32 * self.warps, stream,
               (self.qweight, self.scales, self.records, out.reshape(self.tokens * self.n)), shared_bytes=self.shared)


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
SETTING = Setting(warps=8, depth=4)  # 122 KB of records at 16 tokens leave one block a SM


def verify_grid(n: int, setting: Setting) -> int:
    """One block a SM (the records leave room for one), fewer when there are fewer tiles than warps."""
    from pynanoqwen.device import sm_count

    return max(1, min(sm_count(), -(-(n // TILE_ROWS) // setting.warps)))


def timings(replays: int = 20) -> list[dict]:
    """us a call of gemv_group's decode GEMV at DECODE (one token) and of the verify GEMV at 4, 9
    and 16 tokens, each with its ratio to the decode call; weights rotated through twice the L2."""
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
            us = time_calls(lambda weights, tokens=tokens: GroupVerify(
                n, k, tokens, *weights[0], verify_grid(n, SETTING), SETTING).launch, n, k, tokens, replays=replays)
            rows.append({"linear": name, "tokens": tokens, "form": f"verify W{SETTING.warps} D{SETTING.depth}",
                         "us a call": us, "ratio": us / one})
    return rows


def compile_targets():
    """The verify kernel at the 7B K = 3584 shapes for 9 tokens, and the staging, for tests/test_dev_variants.py."""
    from pynanoqwen.kernels import CompileTarget

    must = ("mma.sync.aligned.m16n8k32.row.col.s32.u8.u8.s32", "mma.sync.aligned.m16n8k32.row.col.s32.s8.u8.s32",
            "fma.rn.f32", "brev.b32", "ld.global.nc.v4.u32", "ld.shared.v4.u32", "cp.async.cg.shared.global",
            "griddepcontrol.wait")
    signature = types.void(types.uint32[::1], types.float16[::1], types.uint32[::1], types.float32[::1])
    targets = [CompileTarget(f"gemv_group_verify[{name} 9 tokens, W{SETTING.warps} D{SETTING.depth}]",
                             build(n, k, 9, min(132, n // TILE_ROWS // SETTING.warps), SETTING), signature, must)
               for name, (n, k) in SHAPES.items()]
    targets.append(CompileTarget("gemv_group_verify stage_tokens[K 3584, 9 tokens]", build_stage(3584, 9),
                                 types.void(types.uint32[::1], types.uint32[::1]),
                                 ("dp4a.u32.u32", "shfl.sync.bfly.b32", "prmt.b32")))
    return targets


if __name__ == "__main__":
    from harness import run

    run(check, timings, "verify GEMV of several tokens against gemv_group's decode GEMV, us a call "
                        "(weights rotated through twice the L2)")

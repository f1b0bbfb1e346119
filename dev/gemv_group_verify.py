"""Prompt lookup's verify GEMV: W x_m for up to 16 tokens m in one pass over the weights, each
token's output bit for bit what dev/gemv_group.py computes for that token alone.

Why bit for bit. A greedy verify pass is lossless only if every row of its logits is what a decode
step computes (docs/SPECULATIVE.md); a matrix product that sums in another order gives other
bits, and over 28 layers another argmax now and then. The group GEMV makes the decode order cheap
to replay: a row's value is warp_sum's butterfly over 32 lane partials, and lane L's partial is
a chain of FMAs, one a group, acc = fma(float32(dot_G), float32(s_w) * s_G, acc), over the groups
G whose unit (row, G) falls to lane L, in increasing G (gemv_group.py, work split: unit u =
(row mod R) K/128 + G of its tile, lane u mod 32). dot_G is an exact integer, so any exact
integer arithmetic may compute it; only the FMA chain and the butterfly have to be replayed.

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
- Then the lane holds dot for tokens g, g + 8 and rows 2t, 2t + 1: it replays each FMA into the
  partial of the decode lane that owns (row, G), parked in shared memory [8 rows][32 lanes][T],
  and after the tile's last group replays the butterfly over the 32 partials (masks 16, 8, 4, 2,
  1: the value every lane of warp_sum ends with), then out[m, row] += total as the decode epilogue.

Counted per 8 rows, 16 tokens and group of 128 inputs (warp instructions): 1 ld.global.nc.v4, 12
for the unpack, 8 ld.shared.v4 and 8 mma, 2 scale loads, and per lane 4 (token, row) pairs of
~7 (combine, convert, scale product, a partial's load, FMA and store): ~60, against gemv_group's
~150 a unit x 8 units / 32 lanes = ~38 for one token. So ~1.6x a decode GEMV's instructions at
up to 16 tokens, plus the butterflies (32 loads and 31 adds a row and token, ~250 a tile) and
the staging, where decode is issue-bound; not measured.

Scope (a dev variant): residual epilogue only; the whole of every token's x staged in each
block's shared memory (K/128 x 68 x 4 bytes a token: 122 KB for 16 tokens at K = 3584), copied by
cp.async from records a first kernel writes (`stage_tokens`, one block a token, the same staging
function as the decode GEMV); so K up to ~7000 at 16 tokens (down_proj's 18944 needs K split
between blocks, docs/SPECULATIVE.md). Not in the engine.
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
from gemv_group import SETTINGS as DECODE_VARIANTS  # noqa: E402
from pynanoqwen.config import GROUP_SIZE  # noqa: E402
from pynanoqwen.kernels.gemv_int4_paths import NIBBLE_BYTES  # noqa: E402
from pynanoqwen.ptx import SIMULATOR  # noqa: E402
from pynanoqwen.ptx.bits import bits_float  # noqa: E402
from pynanoqwen.ptx.griddep import grid_dependency_wait, launch_dependents  # noqa: E402
from pynanoqwen.ptx.loads import ld_global_nc_v4_u32  # noqa: E402
from pynanoqwen.ptx.warp import syncwarp  # noqa: E402
from pynanoqwen.ptx.mma import (cp_async_16, cp_async_commit_group, cp_async_wait_group,  # noqa: E402
                                ld_shared_v4_u32, mma_m16n8k32_s8u8, mma_m16n8k32_u8u8)

U = np.uint32
MAX_TOKENS = 16  # the mma's M
TILE_ROWS = 8  # the mma's N: weight rows a warp computes at once
STAGE_THREADS = 256  # the staging kernel's block (any multiple of 16: records do not depend on it)

# decode_rows: R of the decode GEMV whose order is replayed (gemv_group.Setting.rows); warps a block;
# depth: groups whose weights a lane has in flight.
Setting = collections.namedtuple("Setting", "decode_rows warps depth", defaults=(4,))


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


def shared_bytes(k: int, tokens: int, warps: int) -> int:
    """The verify kernel's dynamic shared memory: every token's records, then each warp's partials."""
    return 4 * (tokens * RECORD * (k // GROUP_SIZE) + warps * TILE_ROWS * 32 * tokens)


@functools.cache
def build(n: int, k: int, tokens: int, grid: int, setting: Setting):
    """verify(q, s, records, out): out[m N + row] += W x_m for m < tokens; q/s as gemv_group,
    records from stage_tokens, out float32 [tokens N]."""
    if (n % TILE_ROWS or k % GROUP_SIZE or not 1 <= tokens <= MAX_TOKENS or n % setting.decode_rows
            or (k // GROUP_SIZE) % setting.depth):
        raise ValueError(f"{n}x{k}, {tokens} tokens, {setting}: N a multiple of {TILE_ROWS} and of the decode "
                         f"rows, K of {GROUP_SIZE}, 1..{MAX_TOKENS} tokens, K/{GROUP_SIZE} a multiple of depth")
    warps, decode_rows, depth = setting.warps, setting.decode_rows, setting.depth
    threads = 32 * warps
    groups = U(k // GROUP_SIZE)
    words_per_row = U(k // 8)
    tiles = U(n // TILE_ROWS)
    total_warps = U(grid * warps)
    record_words = U(RECORD * (k // GROUP_SIZE))
    staged_words = U(tokens * RECORD * (k // GROUP_SIZE))
    quads = U(int(staged_words) // 4)
    partial_words = U(TILE_ROWS * 32 * tokens)
    pairs = -(-(TILE_ROWS * tokens) // 32)  # (row, token) sums a lane finishes per tile
    zero_rounds = -(-(TILE_ROWS * 32 * tokens) // 32)  # a warp's partials, 32 words a round
    slot_words, slot_scales = 4 * depth, 2 * depth
    t_count = U(tokens)

    @cuda.jit(device=True, inline="always")
    def decode_lane(row, group):
        """The lane of gemv_group's warp that sums (row, group) (module docstring)."""
        return U(U(U(U(row % U(decode_rows)) * groups) + group) % U(32))

    @cuda.jit(device=True, inline="always")
    def load_group(q, s, tile, group, g, t, words, scl, d):
        """Row g's words 4t..4t+3 of the group, and the scales of rows 2t and 2t + 1, into slot d."""
        first = U(tile * U(TILE_ROWS))
        at = U(U(U(first + g) * words_per_row) + U(U(U(16) * group) + U(U(4) * t)))
        words[4 * d], words[4 * d + 1], words[4 * d + 2], words[4 * d + 3] = ld_global_nc_v4_u32(q, at)
        scl[2 * d] = s[U(U(U(first + U(U(2) * t)) * groups) + group)]
        scl[2 * d + 1] = s[U(U(U(U(first + U(U(2) * t)) + U(1)) * groups) + group)]

    @cuda.jit(device=True, inline="always")
    def replay(records, parked, tile, group, g, t, words, scl, d):
        """The group's dots for tokens g, g + 8 and rows 2t, 2t + 1, FMAed into their decode lanes' partials."""
        m0, m1 = g, U(g + U(8))
        base0 = U(U(m0 * record_words) + U(U(RECORD) * group))
        base1 = U(U(m1 * record_words) + U(U(RECORD) * group))
        if m0 >= t_count:  # a padding token: its A row is zero (any record would do; it is never stored)
            base0 = U(0)
        if m1 >= t_count:
            base1 = U(0)
        off0, off1 = int32(records[U(base0 + U(OFFSET_WORD))]), int32(records[U(base1 + U(OFFSET_WORD))])
        low0, low1, low2, low3 = off0, off0, off1, off1
        high0, high1, high2, high3 = int32(0), int32(0), int32(0), int32(0)
        for c in range(4):
            word = words[4 * d + c]
            b0 = word & NIBBLE_BYTES
            b1 = (word >> U(4)) & NIBBLE_BYTES
            lo_a0, hi_a0, lo_b0, hi_b0 = ld_shared_v4_u32(records, U(base0 + U(U(U(16) * t) + U(4 * c))))
            lo_a1, hi_a1, lo_b1, hi_b1 = ld_shared_v4_u32(records, U(base1 + U(U(U(16) * t) + U(4 * c))))
            low0, low1, low2, low3 = mma_m16n8k32_u8u8(lo_a0, lo_a1, lo_b0, lo_b1, b0, b1, low0, low1, low2, low3)
            high0, high1, high2, high3 = mma_m16n8k32_s8u8(hi_a0, hi_a1, hi_b0, hi_b1, b0, b1, high0, high1, high2,
                                                           high3)
        x_scale0 = bits_float(records[U(base0 + U(SCALE_WORD))])
        x_scale1 = bits_float(records[U(base1 + U(SCALE_WORD))])
        first = U(tile * U(TILE_ROWS))
        row0 = U(U(2) * t)
        lane_r0 = decode_lane(U(first + row0), group)
        lane_r1 = decode_lane(U(U(first + row0) + U(1)), group)
        w0, w1 = float32(scl[2 * d]), float32(scl[2 * d + 1])
        dots = (int32(high0 * int32(256) + low0), int32(high1 * int32(256) + low1),
                int32(high2 * int32(256) + low2), int32(high3 * int32(256) + low3))
        if m0 < t_count:
            at = U(U(U(row0 * U(32)) + lane_r0) * t_count + m0)
            parked[at] = cuda.fma(float32(dots[0]), w0 * x_scale0, parked[at])
            at = U(U(U(U(row0 + U(1)) * U(32)) + lane_r1) * t_count + m0)
            parked[at] = cuda.fma(float32(dots[1]), w1 * x_scale0, parked[at])
        if m1 < t_count:
            at = U(U(U(row0 * U(32)) + lane_r0) * t_count + m1)
            parked[at] = cuda.fma(float32(dots[2]), w0 * x_scale1, parked[at])
            at = U(U(U(U(row0 + U(1)) * U(32)) + lane_r1) * t_count + m1)
            parked[at] = cuda.fma(float32(dots[3]), w1 * x_scale1, parked[at])

    @cuda.jit(device=True, inline="always")
    def finish(parked, tile, lane, out):
        """Every (row, token) of the tile: warp_sum's butterfly over its 32 partials, then the
        residual add; the partials are zeroed for the next tile."""
        first = U(tile * U(TILE_ROWS))
        sums = cuda.local.array(32, float32)
        for i in range(pairs):
            pair = U(lane + U(32 * i))
            row, m = U(pair // t_count), U(pair % t_count)
            if row < U(TILE_ROWS):
                for j in range(32):
                    at = U(U(U(row * U(32)) + U(j)) * t_count + m)
                    sums[j] = parked[at]
                    parked[at] = float32(0)
                for width in (16, 8, 4, 2, 1):
                    for j in range(width):
                        sums[j] = sums[j] + sums[j + width]
                out[U(U(m * U(n)) + U(first + row))] += sums[0]

    @cuda.jit(**({} if SIMULATOR else {"launch_bounds": (threads, 1)}))
    def verify(q, s, records_global, out):
        records = cuda.shared.array(0, uint32)  # dynamic: the tokens' records, then the warps' partials
        floats = cuda.shared.array(0, float32)  # the same memory
        lane = U(cuda.laneid)
        warp = U(U(cuda.threadIdx.x) // U(32))
        parked = floats[U(staged_words + U(warp * partial_words)):]
        g, t = U(lane // U(4)), U(lane % U(4))
        warp_id = U(U(U(cuda.blockIdx.x) * U(warps)) + warp)
        words = cuda.local.array(slot_words, uint32)  # slot d: a group's weights, `depth` groups ahead
        scl = cuda.local.array(slot_scales, types.float16)
        if warp_id < tiles:  # the weights do not depend on the kernel before: request them first
            for d in range(depth):
                load_group(q, s, warp_id, U(d), g, t, words, scl, d)
        for j in range(zero_rounds):
            parked[U(lane + U(32 * j))] = float32(0)
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
            first_group = U(0)
            while first_group < groups:
                for d in range(depth):
                    group = U(first_group + U(d))
                    replay(records, parked, tile, group, g, t, words, scl, d)
                    ahead = U(group + U(depth))  # this slot's next group, maybe the next tile's
                    if ahead < groups:
                        load_group(q, s, tile, ahead, g, t, words, scl, d)
                    elif U(tile + total_warps) < tiles:
                        load_group(q, s, U(tile + total_warps), U(ahead - groups), g, t, words, scl, d)
                first_group = U(first_group + U(depth))
            syncwarp()  # every lane's partials parked before any lane sums a row's 32
            finish(parked, tile, lane, out)
            syncwarp()  # and zeroed again before the next tile's groups park into them
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
        self.shared = shared_bytes(k, tokens, setting.warps)
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


def check(rng, shapes=None, token_counts=(1, 5, 9, 16)):
    """On the GPU: every token's row bit for bit gemv_group's at the replayed setting, on fresh
    Gaussian x and h and random INT4 weights (the float64 bound is gemv_group's check)."""
    from gemv_group import GroupGemv, grid_for
    from harness import random_int4
    from pynanoqwen.device import sm_count
    from pynanoqwen.oracles import passed

    results = []
    for name, (n, k) in (shapes or {name: SHAPES[name] for name in ("qkv", "o_proj")}).items():
        qweight, scales = random_int4(rng, n, k)
        for decode in DECODE_SETTINGS:
            decode_gemv = GroupGemv(n, k, qweight, scales, grid_for(n, decode, sm_count()), decode)
            for tokens in token_counts:
                x = rng.standard_normal((tokens, k)).astype(np.float16)
                h = (3 * rng.standard_normal((tokens, n))).astype(np.float32)
                alone = []
                for m in range(tokens):
                    out = cuda.to_device(h[m])
                    decode_gemv.launch(0, cuda.to_device(x[m]), out)
                    alone.append(out.copy_to_host())
                setting = verify_setting(k, tokens, decode.rows)
                verify = GroupVerify(n, k, tokens, qweight, scales, verify_grid(n, setting), setting)
                out = cuda.to_device(h)
                verify.launch(0, cuda.to_device(x), out)
                same = np.array_equal(out.copy_to_host(), np.array(alone))
                results.append(passed(f"{name} verify of {tokens} tokens, decode R{decode.rows}", same,
                                      "bit for bit the decode GEMV's rows" if same else "rows differ"))
    return results


SHAPES = {"qkv": (4608, 3584), "o_proj": (3584, 3584), "gate+up rows": (37888, 3584)}
DECODE_SETTINGS = [setting for setting in DECODE_VARIANTS if setting.rows in (1, 2, 8)]  # R the verify replays
SHARED_LIMIT = 227 * 1024  # an H200 block's dynamic shared memory
MAX_WARPS = 16


def verify_setting(k: int, tokens: int, decode_rows: int) -> Setting:
    """As many warps as the shared memory holds (their partials grow with the tokens), at most 16."""
    warps = max(w for w in range(1, MAX_WARPS + 1) if shared_bytes(k, tokens, w) <= SHARED_LIMIT)
    return Setting(decode_rows, warps, 4)


def verify_grid(n: int, setting: Setting) -> int:
    """One block a SM (the shared memory holds one), fewer when there are fewer tiles than warps."""
    from pynanoqwen.device import sm_count

    return max(1, min(sm_count(), -(-(n // TILE_ROWS) // setting.warps)))


def timings(replays: int = 20) -> list[dict]:
    """us a call of gemv_group's decode GEMV (one token) and of the verify GEMV at 4, 9 and 16
    tokens, each with the ratio to the decode call; weights rotated through twice the L2."""
    from gemv_group import GroupGemv, grid_for
    from gemv_group import Setting as DecodeSetting
    from harness import time_calls
    from pynanoqwen.device import sm_count

    rows = []
    decode = DecodeSetting(2, 8, 2, 4)
    for name, (n, k) in SHAPES.items():
        one = time_calls(lambda weights: GroupGemv(n, k, *weights[0], grid_for(n, decode, sm_count()), decode).launch,
                         n, k, 1, replays=replays)
        rows.append({"linear": name, "tokens": 1, "form": "decode (gemv_group R2 W8 B2 D4)", "us a call": one,
                     "ratio": 1.0})
        for tokens in (4, 9, 16):
            setting = verify_setting(k, tokens, decode.rows)
            us = time_calls(lambda weights, tokens=tokens, setting=setting: GroupVerify(
                n, k, tokens, *weights[0], verify_grid(n, setting), setting).launch, n, k, tokens, replays=replays)
            rows.append({"linear": name, "tokens": tokens, "form": f"verify W{setting.warps} D{setting.depth}",
                         "us a call": us, "ratio": us / one})
    return rows


def compile_targets():
    """The verify kernel at the 7B K = 3584 shapes for 9 tokens, and the staging, for tests/test_dev_variants.py."""
    from pynanoqwen.kernels import CompileTarget

    must = ("mma.sync.aligned.m16n8k32.row.col.s32.u8.u8.s32", "mma.sync.aligned.m16n8k32.row.col.s32.s8.u8.s32",
            "fma.rn.f32", "ld.global.nc.v4.u32", "ld.shared.v4.u32", "cp.async.cg.shared.global",
            "griddepcontrol.wait")
    signature = types.void(types.uint32[::1], types.float16[::1], types.uint32[::1], types.float32[::1])
    targets = []
    for name, (n, k) in SHAPES.items():
        setting = verify_setting(k, 9, 2)
        targets.append(CompileTarget(f"gemv_group_verify[{name} 9 tokens, {setting}]",
                                     build(n, k, 9, min(132, n // TILE_ROWS // setting.warps), setting), signature, must))
    targets.append(CompileTarget("gemv_group_verify stage_tokens[K 3584, 9 tokens]", build_stage(3584, 9),
                                 types.void(types.uint32[::1], types.uint32[::1]),
                                 ("dp4a.u32.u32", "shfl.sync.bfly.b32", "prmt.b32")))
    return targets


if __name__ == "__main__":
    from harness import run

    run(check, timings, "verify GEMV of several tokens against gemv_group's decode GEMV, us a call "
                        "(weights rotated through twice the L2)")

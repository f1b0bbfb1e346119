"""The tile shapes of the INT4 GEMM (kernels/gemm_int4.py) and which one serves which prompt size.

Three kernels compute the GEMM, told apart by the type of their tile: a `TileShape` is the mma.sync
kernel's (gemm_int4.py: BLOCK_M activation rows x BLOCK_N weight rows split over warps), a
`WgmmaTile` the wgmma kernel's (gemm_int4_wgmma.py: warpgroups of 64 weight rows x tokens), and a
`TmaTile`, a WgmmaTile too, the same kernel fed by TMA (gemm_int4_tma.py). The
product keeps the tiles some default uses, and bench's GEMM table times all of them (TILE_NAMES);
`default_tiles_for` is the choice, from that table's measurements (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import dataclasses

from ..config import GROUP_SIZE
from ..device import STATIC_SHARED_BYTES
from .gemm_int4_tma import TMA_T256
from .gemm_int4_wgmma import GemmTile, WgmmaTile, check_chunks

K_TILE = 32  # k per pipeline stage: one packed word per weight row, two mma k steps
A_ROW_WORDS = K_TILE // 2  # half2 words of one activation row in a stage (64 bytes)
B_ROW_WORDS = K_TILE // 8  # packed words of one weight row in a stage (16 bytes)
TILES_PER_GROUP = GROUP_SIZE // K_TILE  # k tiles sharing one scale


@dataclasses.dataclass(frozen=True)
class TileShape(GemmTile):
    """A block's tile: BLOCK_M activation rows x BLOCK_N weight rows (all matrices together),
    split over WARPS_M x WARPS_N warps; STAGES k tiles in flight."""

    block_m: int
    block_n: int
    warps_m: int
    warps_n: int
    stages: int = 4

    def check(self, matrices: int) -> None:
        """Raise ValueError unless every warp gets whole 16 x 8 mma tiles (of each matrix), the
        prologue's STAGES - 1 tiles fit in the smallest K (one group) and the ring in 48 KiB."""
        warp_m, warp_n = self.block_m // self.warps_m, self.block_n // self.warps_n
        if self.block_m % (16 * self.warps_m) or self.block_n % (8 * matrices * self.warps_n) \
                or warp_n % (8 * matrices) or not 2 <= self.stages <= TILES_PER_GROUP + 1 \
                or self.shared_bytes > STATIC_SHARED_BYTES:
            raise ValueError(f"{self} cannot be split into 16 x {8 * matrices} mma tiles per warp "
                             f"(warp tile {warp_m} x {warp_n}) with 2..{TILES_PER_GROUP + 1} stages in "
                             f"{STATIC_SHARED_BYTES} bytes of shared memory")

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n

    @property
    def shared_bytes(self) -> int:
        return 4 * self.stages * (self.block_m * A_ROW_WORDS + self.block_n * B_ROW_WORDS)

    dynamic_shared_bytes = 0  # the ring is a static shared array


SMALL = TileShape(16, 128, 1, 4)  # warps of 16 x 32: a handful of tokens
# wgmma tiles (gemm_int4_wgmma.py): warpgroups of 64 weight rows x tokens per block
WG1_T64 = WgmmaTile(1, 64, stages=6)  # 64 weight rows x 64 tokens: short prompts
WG1_T128 = WgmmaTile(1, 128)  # 64 x 128
WG2_T128 = WgmmaTile(2, 128)  # 128 x 128: the token tile serves two warpgroups
WG2_T256 = WgmmaTile(2, 256)  # 128 x 256: long prompts
TILE_NAMES = {SMALL: "small", WG1_T64: "wgmma_64x64", WG1_T128: "wgmma_64x128", WG2_T128: "wgmma_128x128",
              WG2_T256: "wgmma_128x256", TMA_T256: "tma_128x256"}
"""Every tile bench's GEMM table times; the name says weight rows x tokens of a wgmma block."""


def matrices_of(epilogue: str) -> int:
    """Weight matrices a GEMM with this epilogue reads: gate and up for gate_up_silu, else one."""
    return 2 if epilogue == "gate_up_silu" else 1


def candidate_tiles(n: int, k: int, epilogue: str, tiles_to_try=None) -> list:
    """Every tile shape (of TILE_NAMES, or of `tiles_to_try`) that can compute an N x K linear
    with this epilogue: what bench's GEMM table times and default_tiles_for picks from."""
    return [tiles for tiles in (TILE_NAMES if tiles_to_try is None else tiles_to_try)
            if tiles.fits(n, k, matrices_of(epilogue))]


SHORT_PROMPT_ROWS = 128  # up to here the 64-token tiles win
LONG_PROMPT_ROWS = 1024  # from here on the 256-token tiles win for qkv, o_proj and down_proj (bench, M = 2048)
TMA_GATE_UP_ROWS = 512  # from here gate/up runs TMA_T256 where its padding is WG2_T128's (M % 256 == 0) or M is long


def tma_gate_up(m: int) -> bool:
    """Whether gate/up at M rows runs TMA_T256: 0.90x WG2_T128's time at 512 rows and 0.83x at 2048
    (H100, 2026-12-06), so it pays where its 256-token tiles pad no more rows than WG2_T128's 128,
    and from LONG_PROMPT_ROWS, where 0.83 x (M rounded up to 256) < M rounded up to 128."""
    return m >= TMA_GATE_UP_ROWS and (m % 256 == 0 or m >= LONG_PROMPT_ROWS)


# K chunks of a long K (down_proj's 18944 at 7B) on the wgmma tiles that can sum them
# (gemm_int4_wgmma.py, "K chunks"). Measured (dev/gemm_k_chunks.py, H100, 2026-12-05; us a call,
# product / 4 chunks): down_proj 91.4 / 38.0 at 1 token, 91.3 / 40.6 at 22, 94.0 / 48.8 at 64,
# 94.4 / 81.6 at 128, but 147.1 / 152.7 at 512 and 525.9 / 608.1 at 2048 (no 256-token tile); qkv
# and o_proj gain 3-6 us at 1-22 tokens and lose 2-5 at 64 and 3-24 from 512 on, so a short K
# keeps one chunk (docs/PERFORMANCE.md, "Prefill GEMM at a few rows: K in chunks measured").
K_CHUNKS = 4
CHUNKED_K = 8192  # from this K on a linear sums in K_CHUNKS chunks


def k_chunks(k: int, tiles, epilogue: str, wanted: int | None = None) -> int:
    """The chunks a linear's K is summed in on these tiles: `wanted` (None: the product's choice,
    K_CHUNKS for a K of CHUNKED_K or more, else one) wherever the wgmma kernels can
    (gemm_int4_wgmma.check_chunks: not gate/up, a 256-token tile only on TMA, at least `wanted`
    scale groups), else one. Fixed by the linear, not by M, so every default tile of a linear sums
    a row alike (rows_sum_alike)."""
    if wanted is None:
        wanted = K_CHUNKS if k >= CHUNKED_K else 1
    if not isinstance(tiles, WgmmaTile):
        return 1
    try:
        check_chunks(k, tiles, epilogue, wanted)
    except ValueError:
        return 1
    return wanted


def summation(tiles, k: int, epilogue: str) -> tuple:
    """How these tiles sum a row of a linear over K: ("wgmma", chunks) or ("mma.sync",). Tiles of
    one summation give a row the same bits at any M (tests/test_gemm_gpu.py)."""
    return ("wgmma", k_chunks(k, tiles, epilogue)) if isinstance(tiles, WgmmaTile) else ("mma.sync",)


def rows_sum_alike(linears, ms) -> bool:
    """Whether every linear (name, N, K, epilogue) sums a row the same way at every M in ms on its
    default tiles, so that a prompt position's K/V has the same bits in whatever chunk computes
    it: what lets the engine's prefix cache reuse pages (docs/DECODE.md, "Prefix cache")."""
    return all(len({summation(default_tiles_for(m, n, k, epilogue), k, epilogue) for m in ms}) <= 1
               for _, n, k, epilogue in linears)


def covering_rows(linears, ms) -> list[int]:
    """Ms of `ms`, ascending, whose default tiles between them run every GEMM kernel (a linear's
    tile and K chunks) that any M in ms runs: each M whose kernels include one not run by a
    smaller M already chosen. The self-check probes a prefill chunk at each (selfcheck.py)."""
    chosen, seen = [], set()
    for m in sorted(ms):
        kernels = {(name, tiles, k_chunks(k, tiles, epilogue))
                   for name, n, k, epilogue in linears for tiles in [default_tiles_for(m, n, k, epilogue)]}
        if kernels - seen:
            chosen.append(m)
            seen |= kernels
    return chosen


def default_tiles_for(m: int, n: int, k: int, epilogue: str):
    """The tile for M activation rows of an N x K linear with this epilogue: the fastest wgmma
    tile of bench's GEMM table on the H200 at M = 64, 128, 512 and 2048 (docs/PERFORMANCE.md,
    "Prefill GEMM"), and WG1_T64 below 64 rows, where it beats mma.sync's SMALL (docs/PERFORMANCE.md,
    "Prefill GEMM at a few rows"):
    - qkv: WG1_T64 to SHORT_PROMPT_ROWS, WG1_T128 below LONG_PROMPT_ROWS, then TMA_T256 (H100,
      2026-12-06: 137.7 against WG1_T128's 154.9 us at 2048 rows, 43.3 against 42.5 at 512);
    - o_proj, down_proj: WG1_T64 to SHORT_PROMPT_ROWS, WG2_T128 below LONG_PROMPT_ROWS, TMA_T256
      from there where it sums K in the same chunks as WG2_T128 (o_proj 118.6 against WG2_T256's
      129.4 us at 2048 rows; down_proj's 4 chunks keep their totals in a workspace there,
      gemm_int4_tma.py "K chunks": 509.1 against WG2_T128's 606.6 us at 2048 rows, H100, a348b90);
    - gate_up: WG1_T64 to 64 rows, WG1_T128 to SHORT_PROMPT_ROWS, WG2_T128 from there (2026-12-03:
      280.0 against WG1_T128's 300.9 us at 512 rows, 1117.0 against WG2_T256's 1147.6 at 2048),
      and TMA_T256 where tma_gate_up says (243.5 against 270.7 us at 512, 909.3 against 1095.5 at
      2048: dev/gemm_wgmma_tma.py; whole prompts in docs/PERFORMANCE.md, "TMA").
    Every default is deterministic and sums a linear's rows one way at every M (rows_sum_alike: the
    TMA kernel's sums are the cp.async kernel's, gemm_int4_tma.py).
    Where the chosen tile does not fit the shape (a small model's) WG1_T64 serves, which sums
    alike, and where no wgmma tile fits, SMALL serves every M.
    """
    if epilogue == "gate_up_silu":
        tiles = WG1_T64 if m <= 64 else WG1_T128 if m <= SHORT_PROMPT_ROWS else TMA_T256 if tma_gate_up(m) \
            else WG2_T128
    elif m <= SHORT_PROMPT_ROWS:
        tiles = WG1_T64
    elif epilogue == "residual":
        long_tile = m >= LONG_PROMPT_ROWS and k_chunks(k, TMA_T256, epilogue) == k_chunks(k, WG2_T128, epilogue)
        tiles = TMA_T256 if long_tile else WG2_T128
    else:
        tiles = TMA_T256 if m >= LONG_PROMPT_ROWS else WG1_T128
    for candidate in (tiles, WG1_T64):
        if candidate.fits(n, k, matrices_of(epilogue)):
            return candidate
    return SMALL

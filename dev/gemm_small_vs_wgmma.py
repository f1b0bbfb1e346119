"""The mma.sync SMALL tile against the best wgmma tile at 1, 4, 8 and 16 tokens, at the 7B shapes.

The product serves prompts (and prompt chunks) of up to 16 tokens with mma.sync's SMALL tile
(16 x 128, kernels/gemm_int4.default_tiles_for) and everything longer with wgmma, whose smallest
token tile is 64: at M <= 16 three quarters or more of a wgmma tile is zero-filled padding, but
the kernel is bound by reading the weights there, as a GEMV is, so padding may cost little. That
choice was never measured. This harness measures it before SMALL is kept or dropped: each tile's
output against float64 (the product's bounds), then us per call with the weights rotated through
2x the L2 (docs/PERFORMANCE.md gets the table):

    python dev/gemm_small_vs_wgmma.py
"""

from __future__ import annotations


from harness import EPILOGUES_7B, LINEARS_7B, check_gemm, product_gemm, run, time_product_gemm
from pynanoqwen.kernels.gemm_int4_tiles import SMALL, TILE_NAMES, candidate_tiles
from pynanoqwen.kernels.gemm_int4_wgmma import WgmmaTile

TOKENS = (1, 4, 8, 16)


def wgmma_tiles(n: int, k: int, epilogue: str) -> list:
    return [tiles for tiles in candidate_tiles(n, k, epilogue) if isinstance(tiles, WgmmaTile)]


def check(rng, m: int = 7):
    """SMALL and every wgmma tile, at every 7B linear, at M = m rows, against float64."""
    results = []
    for name, (n, k) in LINEARS_7B.items():
        epilogue = EPILOGUES_7B[name]
        for tiles in [SMALL] + wgmma_tiles(n, k, epilogue):
            results.append(check_gemm(f"{TILE_NAMES[tiles]} {name} M={m}", product_gemm(n, k, epilogue, tiles), n, k, m,
                                      epilogue, rng))
    return results


def timings(tokens=TOKENS) -> list[dict]:
    rows = []
    for name, (n, k) in LINEARS_7B.items():
        epilogue = EPILOGUES_7B[name]
        for m in tokens:
            wgmma = {TILE_NAMES[t]: time_product_gemm(n, k, m, epilogue, t) for t in wgmma_tiles(n, k, epilogue)}
            best = min(wgmma, key=wgmma.get)
            rows.append({"linear": name, "M": m, "small us": time_product_gemm(n, k, m, epilogue, SMALL),
                         "best wgmma us": wgmma[best], "tile": best})
    return rows


if __name__ == "__main__":
    run(check, timings, "mma.sync SMALL against the best wgmma tile (us per call)")

"""The TMA GEMM's unit form against its blocks a tile, where the product chooses between them.

kernels/gemm_int4_tma.py runs a linear whose K is summed in fixed chunks (down_proj at 7B) either a
block a tile, the chunks in sequence, or, where chunk-sized waves end sooner
(`runs_chunk_units`: from 1152 rows at 7B on 132 SMs), a block a (tile, K chunk), "the unit form".
Both fold the chunks in the same order, so they give the same bits. This script checks the unit
form against float64 (oracles.py's bound, as bench's GEMM tests) and times both forms of the
product's down_proj on its default long-prompt tile, alternating, the weights rotated through
twice the L2 (harness.time_calls, as bench's GEMM table), by replacing the launcher's choice
(`gemm_int4.runs_chunk_units`) for the blocks-a-tile rows.

Counted (docs/PERFORMANCE.md, "2026-12-07, later"): 1024 rows, 112 tiles, one wave either way; 1536
rows, 168 tiles, 6 quarter-waves against 8; 2048 rows, 224 tiles, 7 against 8, less each unit's
ring ramp and the wait for the chunk before it.

    python dev/gemm_chunk_units.py [--rows 1024,1536,2048] [--rounds 2]
"""

from __future__ import annotations

import argparse

import numpy as np

from harness import check_gemm, print_table, product_gemm, time_product_gemm
from pynanoqwen.config import preset
from pynanoqwen.device import sm_count
from pynanoqwen.kernels import gemm_int4
from pynanoqwen.kernels.gemm_int4_tiles import default_launch, default_tiles_for, k_chunks
from pynanoqwen.kernels.gemm_int4_tma import TmaTile, runs_chunk_units


def chunked_linears():
    """(name, N, K, epilogue) of the 7B linears whose K the TMA tile sums in more than one chunk."""
    return [(name, n, k, epilogue) for name, n, k, epilogue in preset("7b").engine_linears
            if k_chunks(k, default_tiles_for(2048, n, k, epilogue), epilogue) > 1]


def time_form(n: int, k: int, m: int, epilogue: str, tiles, units: bool) -> float:
    """us a call of the product's GEMM on `tiles`, as the launcher chooses its form (units) or a
    block a tile always."""
    gemm_int4.runs_chunk_units = runs_chunk_units if units else (lambda *args: False)
    try:
        return time_product_gemm(n, k, m, epilogue, tiles)
    finally:
        gemm_int4.runs_chunk_units = runs_chunk_units


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1024,1536,2048", help="prompt rows (M) to time")
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the two forms")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    rng = np.random.default_rng()
    table = []
    for name, n, k, epilogue in chunked_linears():
        for m in rows:
            tiles = default_tiles_for(m, n, k, epilogue)
            if not isinstance(tiles, TmaTile):
                continue
            print(check_gemm(f"{name} at {m} rows, as launched", product_gemm(n, k, epilogue, tiles), n, k, m,
                             epilogue, rng).line(), flush=True)
            times = {form: [] for form in ("blocks a tile", "as launched")}
            for _ in range(args.rounds):
                for form in times:
                    times[form].append(time_form(n, k, m, epilogue, tiles, form == "as launched"))
            blocks, launched = (np.median(times[form]) for form in times)
            table.append({"linear": name, "rows": m,
                          "form launched": "unit" if default_launch(m, n, k, epilogue, sm_count())[2]
                          else "blocks a tile",
                          **{f"{form}, us": " / ".join(f"{t:.1f}" for t in times[form]) for form in times},
                          "saved, us": f"{blocks - launched:.1f}",
                          "TFLOP/s as launched": f"{2 * m * n * k / launched / 1e6:.0f}"})
    print_table("the TMA GEMM: a block a tile against a block a (tile, K chunk)", table)


if __name__ == "__main__":
    main()

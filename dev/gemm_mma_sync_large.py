"""The mma.sync INT4 GEMM at its large tile, beaten by wgmma at every 7B shape from M = 64.

The product's mma.sync kernel (pynanoqwen/kernels/gemm_int4.py) at a tile no default uses:
`LARGE` is 128 x 128 with 4 warps of 64 x 64, 128 accumulators and 64 mma per warp per 32-wide k
step; the ring holds 4 stages of 10 KiB (40 KiB, under the 48 KiB of static shared memory); per
block and k tile it moves 8 KiB of activations and 2 KiB of weights from L2 for 1 MFLOP, and
ptxas gives it 226-228 registers, so two 4-warp blocks fit an SM. It peaked at 269 TFLOP/s
(gate_up at M = 512 and 2048), against 435-487 for the wgmma tiles (docs/PERFORMANCE.md).
Kept here, as llm.c keeps beaten kernels in dev/cuda, to be measured again when either changes:

    python dev/gemm_mma_sync_large.py    # float64 check at every 7B linear, then us against the default tiles
"""

from __future__ import annotations

from numba.core import types

from harness import EPILOGUES_7B, LINEARS_7B, check_gemm, product_gemm, run, time_product_gemm
from pynanoqwen.kernels import CompileTarget
from pynanoqwen.kernels.gemm_int4 import gemm_kernel, gemm_signature
from pynanoqwen.kernels.gemm_int4_tiles import TileShape

LARGE = TileShape(128, 128, 2, 2)


def compile_targets() -> list[CompileTarget]:
    must = ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32", "cp.async.cg.shared.global", "prmt.b32")
    return [CompileTarget(f"gemm_int4_{EPILOGUES_7B[name]}_large[{name} {n}x{k}]",
                          gemm_kernel(n, k, LARGE, EPILOGUES_7B[name]),
                          gemm_signature(types.float16 if name == "gate_up" else types.float32), must)
            for name, (n, k) in LINEARS_7B.items()]


def check(rng, m: int = 64):
    """Every 7B linear at M rows with its epilogue, at LARGE, against float64."""
    return [check_gemm(f"large {name} M={m}", product_gemm(n, k, EPILOGUES_7B[name], LARGE), n, k, m,
                       EPILOGUES_7B[name], rng) for name, (n, k) in LINEARS_7B.items()]


def timings(ms=(64, 512, 2048)) -> list[dict]:
    rows = []
    for name, (n, k) in LINEARS_7B.items():
        for m in ms:
            epilogue = EPILOGUES_7B[name]
            rows.append({"linear": name, "M": m, "large us": time_product_gemm(n, k, m, epilogue, LARGE),
                         "default us": time_product_gemm(n, k, m, epilogue)})
    return rows


if __name__ == "__main__":
    run(check, timings, "mma.sync LARGE against the default tiles (us per call)")

"""The wgmma GEMM summing K in 4 chunks (sequential and split forms) against one chunk.

The product's wgmma kernel (pynanoqwen/kernels/gemm_int4_wgmma.py, "K chunks"; read it first)
can sum a linear's K in fixed chunks, and then runs few-token tiles in a split form: one block a
chunk, the tile's last block adding the chunk sums in chunk order, with the bits of the
sequential form at every M. At a few tokens that turns qkv's 72 and o_proj's and down_proj's 56
blocks of 64 weight rows into 4 times as many; a block there is latency-bound (~0.3 us a k tile
whatever the ring's depth: docs/PERFORMANCE.md, "Prefill GEMM at a few rows"). The price is at
many tokens: a second accumulator set (ptxas: 213 registers instead of 147 at WG2_T128) and no
256-token tile for o_proj and down_proj. Measured on the H100 (docs/PERFORMANCE.md, "K chunks
measured"): down_proj 2.3x faster at 1-22 tokens, qkv and o_proj 1-6 us, and every linear slower
from 64 rows on; so the product sums down_proj (a K of gemm_int4_tiles.CHUNKED_K or more) in 4
chunks and qkv and o_proj in one. This file times all three both ways.

    python dev/gemm_k_chunks.py

`check` runs both forms against float64 (the product's bound plus the 3 chunk adds, each at most
u32 of the magnitude) and compares bits: a row must
come out the same in the split form at 1 and 22 tokens, the sequential form at 22 and 100 tokens,
and the 128-token tiles at 512 and 2048. `timings` gives us per call of one chunk and of 4 on
the product's tiles at 1 to 2048 tokens, weights rotated through twice the L2.
"""

from __future__ import annotations

import numpy as np
from numba import cuda, types

from harness import EPILOGUES_7B, LINEARS_7B, check_gemm, random_int4, run, time_calls
from pynanoqwen.kernels import CompileTarget
from pynanoqwen.kernels.gemm_int4 import SplitWorkspace, gemm_kernel, gemm_signature, make_gemm_int4
from pynanoqwen.kernels.gemm_int4_tiles import LONG_PROMPT_ROWS, SHORT_PROMPT_ROWS, TILE_NAMES, WG1_T64, WG1_T128, \
    WG2_T128, WG2_T256
from pynanoqwen.oracles import U32, passed

CHUNKS = 4
CHUNKED = ("qkv", "o_proj", "down_proj")  # gate/up sums K in one chunk (k_chunks)
WORKSPACE_ROWS = SHORT_PROMPT_ROWS  # the split form serves the 64-token tiles, used up to here


def chunked_tiles(m: int, epilogue: str):
    """The product's default tiles, but WG2_T128 where it takes WG2_T256 (one chunk only)."""
    if m <= SHORT_PROMPT_ROWS:
        return WG1_T64
    return WG2_T128 if epilogue == "residual" else WG1_T128


def one_chunk_tiles(m: int, epilogue: str):
    """The tiles of a linear summed in one chunk: as chunked_tiles, but WG2_T256 for the residual
    linears from LONG_PROMPT_ROWS (what the product gives o_proj, and gave down_proj before)."""
    return WG2_T256 if epilogue == "residual" and m >= LONG_PROMPT_ROWS else chunked_tiles(m, epilogue)


def launcher(n: int, k: int, epilogue: str, chunks: int, workspace):
    """launch(stream, weights, bias, x, out) for check_gemm: this many K chunks, split where the
    workspace allows."""
    def launch(stream, weights, bias, x, out):
        m = x.shape[0]
        gemm = make_gemm_int4(n, k, *weights[0], bias=bias, tiles=chunked_tiles(m, epilogue), chunks=chunks)
        gemm.launch(stream, x, out, m, residual=epilogue == "residual", workspace=workspace)
    return launch


def compile_targets() -> list[CompileTarget]:
    """Both forms' kernels at down_proj: the 64-token tile with its split form, the 128-token tile
    with the chunk totals in registers."""
    n, k = LINEARS_7B["down_proj"]
    feed = ("wgmma.mma_async.sync.aligned", "wgmma.wait_group.sync.aligned", "prmt.b32")
    return [CompileTarget(f"gemm_int4_residual_{TILE_NAMES[tiles]}_k{CHUNKS}[down_proj {n}x{k}]",
                          gemm_kernel(n, k, tiles, "residual", CHUNKS), gemm_signature(types.float32),
                          feed + extra, cc=(9, 0, "a"))
            for tiles, extra in ((WG1_T64, ("atom.global.add.u32", "ld.global.cg.f32")), (WG2_T128, ()))]


def check(rng):
    workspace = SplitWorkspace(WORKSPACE_ROWS, max(LINEARS_7B[name][0] for name in CHUNKED), CHUNKS)
    extra = lambda magnitude, out: CHUNKS * U32 * magnitude  # noqa: E731 (the chunk adds)
    results = []
    for name in CHUNKED:
        n, k = LINEARS_7B[name]
        epilogue = EPILOGUES_7B[name]
        for m, space, form in ((22, workspace, "split"), (5, workspace, "split"), (22, None, "sequential"),
                               (100, workspace, "split, 2 token tiles" if name != "qkv" else "sequential")):
            results.append(check_gemm(f"{name} {CHUNKS} chunks, {form}, M={m}", launcher(n, k, epilogue, CHUNKS, space),
                                      n, k, m, epilogue, rng, extra))
        qweight, scales = random_int4(rng, n, k)
        bias = rng.standard_normal(n).astype(np.float16) if epilogue == "bias" else None
        x = cuda.to_device(rng.standard_normal((2048, k)).astype(np.float16))
        start = rng.standard_normal((2048, n)).astype(np.float32)
        rows = {}
        for label, m, space in (("split at M = 22", 22, workspace), ("sequential at M = 22", 22, None),
                                ("M = 100", 100, workspace), ("M = 512", 512, None), ("M = 2048", 2048, None),
                                ("split at M = 1", 1, workspace)):
            out = cuda.to_device(start)
            gemm = make_gemm_int4(n, k, qweight, scales, bias=bias, tiles=chunked_tiles(m, epilogue), chunks=CHUNKS)
            gemm.launch(0, x, out, m, residual=epilogue == "residual", workspace=space)
            rows[label] = out.copy_to_host()[:min(m, 22)]
        first = rows["split at M = 22"]
        for label, got in rows.items():
            results.append(passed(f"{name}: rows of {label} against split at M = 22",
                                  np.array_equal(got, first[:len(got)]), "bit for bit"))
    return results


def timings(ms=(1, 16, 22, 64, 128, 512, 2048)) -> list[dict]:
    workspace = SplitWorkspace(WORKSPACE_ROWS, max(LINEARS_7B[name][0] for name in CHUNKED), CHUNKS)
    rows = []
    for name in CHUNKED:
        n, k = LINEARS_7B[name]
        epilogue = EPILOGUES_7B[name]
        for m in ms:
            def build(chunks, tiles, space):
                def make(weights):
                    gemm = make_gemm_int4(n, k, *weights[0], tiles=tiles, chunks=chunks)
                    return lambda stream, x, out: gemm.launch(stream, x, out, m, residual=epilogue == "residual",
                                                              workspace=space)
                return make

            rows.append({"linear": name, "M": m, "1 chunk us": time_calls(build(1, one_chunk_tiles(m, epilogue), None), n, k, m),
                         f"{CHUNKS} chunks us": time_calls(build(CHUNKS, chunked_tiles(m, epilogue), workspace), n, k, m)})
    return rows


if __name__ == "__main__":
    run(check, timings, f"the wgmma GEMM in {CHUNKS} K chunks against one (us per call)")

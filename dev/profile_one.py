"""Launch one decode or prefill kernel a few times at a 7B shape, for Nsight Compute to profile the last launch.

    ncu --clock-control none --launch-skip 2 --launch-count 1 --section SpeedOfLight \
        --section WarpStateStats --section MemoryWorkloadAnalysis python dev/profile_one.py down
    python dev/profile_one.py attention --context 32000
    python dev/profile_one.py gemm --linear gate_up --m 2048 --tile wgmma_128x256
    python dev/profile_one.py prefill_attention --context 32000 --m 1280
    python dev/profile_one.py prefill_attention --context 4006 --m 22 --bucket 32

Kernels: qkv_rope, o_proj, gate_up, down, lm_head (default GemvPlans, or --plan R,D,W,B), decode
attention, the prefill GEMM of one linear (qkv, o_proj, gate_up, down_proj) at M rows on a tile of
gemm_int4_tiles.TILE_NAMES (default: the engine's for that M), and prefill attention of the last
M rows of a prompt of --context tokens in a bucket of --bucket rows (default the engine's 2048; a
bucket of at most SPLIT_ROWS runs split, two launches a call: split, then merge, so an odd
--launch-skip profiles the merge). Random weights and activations; nothing is checked (the tests
do that).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from numba import cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pynanoqwen.bench_kernels import random_int4  # noqa: E402
from pynanoqwen.config import preset  # noqa: E402
from pynanoqwen.engine.memory import PREFILL_BUCKETS  # noqa: E402
from pynanoqwen.kernels.attention_decode import PAGE_SIZE, make_decode_attention  # noqa: E402
from pynanoqwen.kernels.attention_prefill import make_prefill_attention  # noqa: E402
from pynanoqwen.kernels.gemm_int4 import make_gate_up_silu_gemm, make_gemm_int4  # noqa: E402
from pynanoqwen.kernels.gemm_int4_tiles import TILE_NAMES, default_tiles_for  # noqa: E402
from pynanoqwen.kernels.gemv_int4 import GemvPlan, make_gate_up_silu, make_gemv_int4  # noqa: E402
from pynanoqwen.kernels.rope_kv_write import rope_cos_sin  # noqa: E402

HIDDEN, INTERMEDIATE, QKV, VOCAB, HEADS, KV_HEADS, HEAD_DIM = 3584, 18944, 4608, 152064, 28, 4, 128
LAUNCHES = 3
PREFILL_ROWS = PREFILL_BUCKETS[-1]  # the engine's longest prefill chunk
LINEARS = preset("7b").engine_linears  # (name, N, K, epilogue) of the prefill GEMMs


def gemm_call(args, rng, stream):
    """One prefill GEMM of a 7B layer's linear, as the engine builds it (epilogue included)."""
    name, n, kdim, epilogue = next(row for row in LINEARS if row[0] == args.linear)
    tiles = next(t for t, label in TILE_NAMES.items() if label == args.tile) if args.tile else \
        default_tiles_for(args.m, n, kdim, epilogue)
    x = cuda.to_device(rng.standard_normal((args.m, kdim)).astype(np.float16))
    if epilogue == "gate_up_silu":
        gemm = make_gate_up_silu_gemm(n, kdim, *random_int4(rng, n, kdim), *random_int4(rng, n, kdim), tiles=tiles)
        out = cuda.device_array((args.m, n), np.float16)
    else:
        bias = rng.standard_normal(n).astype(np.float16) if epilogue == "bias" else None
        gemm = make_gemm_int4(n, kdim, *random_int4(rng, n, kdim), bias=bias, tiles=tiles)
        out = cuda.to_device(np.zeros((args.m, n), np.float32))
    extra = {"residual": True} if epilogue == "residual" else {}
    print(f"gemm {name} {n}x{kdim} M {args.m} tile {TILE_NAMES.get(tiles, tiles)}")
    return lambda: gemm.launch(stream, x, out, args.m, **extra)


def prefill_attention_call(args, rng, stream):
    """The engine's prefill attention (M_cap = the bucket) for rows context - m .. context - 1."""
    pages = -(-args.context // PAGE_SIZE)
    attention = make_prefill_attention(HEADS, KV_HEADS, HEAD_DIM, pages)
    k, v = (cuda.to_device(rng.standard_normal((pages, KV_HEADS, PAGE_SIZE, HEAD_DIM)).astype(np.float16))
            for _ in range(2))
    table = cuda.to_device(rng.permutation(pages).astype(np.int32))
    q = cuda.to_device(rng.standard_normal((args.bucket, HEADS, HEAD_DIM)).astype(np.float32))
    bounds = [cuda.to_device(np.array([value], np.int32)) for value in (args.context - args.m, args.m)]
    out = cuda.device_array((args.bucket, HEADS * HEAD_DIM), np.float16)
    print(f"prefill attention: rows {args.context - args.m}..{args.context - 1} in a {args.bucket}-row bucket")
    return lambda: attention.launch(stream, q, k, v, table, *bounds, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernel", choices=["qkv_rope", "o_proj", "gate_up", "down", "lm_head", "attention", "gemm",
                                                  "prefill_attention"])
    parser.add_argument("--plan", help="R,D,W,B of a GemvPlan")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--linear", choices=[row[0] for row in LINEARS], default="gate_up")
    parser.add_argument("--m", type=int, default=2048, help="rows of the prefill GEMM or attention chunk")
    parser.add_argument("--tile", choices=sorted(TILE_NAMES.values()), help="the GEMM's tile")
    parser.add_argument("--bucket", type=int, default=PREFILL_ROWS, help="prefill attention's M_cap (>= --m)")
    args = parser.parse_args()
    if args.kernel == "prefill_attention" and not 1 <= args.m <= args.bucket:
        parser.error(f"--m ({args.m}) must be between 1 and --bucket ({args.bucket})")
    rng = np.random.default_rng(0)
    stream = cuda.stream()
    plan = GemvPlan(*map(int, args.plan.split(","))) if args.plan else None
    if args.kernel == "gemm":
        run = gemm_call(args, rng, stream)
    elif args.kernel == "prefill_attention":
        run = prefill_attention_call(args, rng, stream)
    elif args.kernel == "attention":
        pages = -(-args.context // PAGE_SIZE)
        shape = (pages, KV_HEADS, PAGE_SIZE, HEAD_DIM)
        k, v = (cuda.to_device(rng.standard_normal(shape).astype(np.float16)) for _ in range(2))
        attention = make_decode_attention(HEADS, KV_HEADS, HEAD_DIM, pages)
        q = cuda.to_device(rng.standard_normal((HEADS, HEAD_DIM)).astype(np.float32))
        table = cuda.to_device(rng.permutation(pages).astype(np.int32))
        pos = cuda.to_device(np.array([args.context - 1], np.int32))
        out = cuda.device_array(HEADS * HEAD_DIM, np.float16)
        run = lambda: attention.launch(stream, q, k, v, table, pos, out)  # noqa: E731
    else:
        n, kdim = {"qkv_rope": (QKV, HIDDEN), "o_proj": (HIDDEN, HIDDEN), "gate_up": (INTERMEDIATE, HIDDEN),
                   "down": (HIDDEN, INTERMEDIATE), "lm_head": (VOCAB, HIDDEN)}[args.kernel]
        norm = dict(norm_weight=np.ones(kdim, np.float16), norm_eps=1e-6) \
            if args.kernel in ("qkv_rope", "gate_up", "lm_head") else {}
        x = cuda.to_device(rng.standard_normal(kdim).astype(np.float32 if norm else np.float16))
        if args.kernel == "gate_up":
            gemv = make_gate_up_silu(n, kdim, *random_int4(rng, n, kdim), *random_int4(rng, n, kdim), plan=plan,
                                     **norm)
            out = cuda.device_array(n, np.float16)
            run = lambda: gemv.launch(stream, x, out)  # noqa: E731
        elif args.kernel == "qkv_rope":
            gemv = make_gemv_int4(n, kdim, *random_int4(rng, n, kdim), bias=np.zeros(n, np.float16), plan=plan,
                                  rope_heads=(HEADS, KV_HEADS, HEAD_DIM), **norm)
            cos, sin = (cuda.to_device(t) for t in rope_cos_sin(HEAD_DIM, 1e6, 1024))
            kv = [cuda.device_array((64, KV_HEADS, PAGE_SIZE, HEAD_DIM), np.float16) for _ in range(2)]
            rope = (cuda.device_array((HEADS, HEAD_DIM), np.float32), *kv, cuda.to_device(np.arange(64, dtype=np.int32)),
                    cuda.to_device(np.array([100], np.int32)), cos, sin)
            run = lambda: gemv.launch_rope(stream, x, *rope)  # noqa: E731
        else:
            gemv = make_gemv_int4(n, kdim, *random_int4(rng, n, kdim), plan=plan, **norm)
            out = cuda.device_array(n, np.float32)
            residual = {"residual": True} if args.kernel in ("o_proj", "down") else {}
            run = lambda: gemv.launch(stream, x, out, **residual)  # noqa: E731
    for _ in range(LAUNCHES):
        run()
    stream.synchronize()
    print(f"{args.kernel}: {LAUNCHES} launches done")


if __name__ == "__main__":
    main()

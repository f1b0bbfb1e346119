"""Launch one decode kernel a few times at a 7B shape, for Nsight Compute to profile the last launch.

    ncu --clock-control none --launch-skip 2 --launch-count 1 --section SpeedOfLight \
        --section WarpStateStats --section MemoryWorkloadAnalysis python dev/profile_one.py down
    python dev/profile_one.py attention --context 32000

Kernels: qkv_rope, o_proj, gate_up, down, lm_head (default GemvPlans, or --plan R,D,W,B) and
attention. Random weights and activations; nothing is checked (the tests do that).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from numba import cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pynanoqwen.kernels.attention_decode import PAGE_SIZE, make_decode_attention  # noqa: E402
from pynanoqwen.kernels.gemv_int4 import GemvPlan, make_gate_up_silu, make_gemv_int4  # noqa: E402
from pynanoqwen.kernels.rope_kv_write import rope_cos_sin  # noqa: E402

HIDDEN, INTERMEDIATE, QKV, VOCAB, HEADS, KV_HEADS, HEAD_DIM = 3584, 18944, 4608, 152064, 28, 4, 128
LAUNCHES = 3


def random_int4(rng, n, k):
    return (rng.integers(0, 2**32, (n, k // 8), dtype=np.uint32),
            rng.uniform(0.005, 0.02, (n, k // 128)).astype(np.float16))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernel", choices=["qkv_rope", "o_proj", "gate_up", "down", "lm_head", "attention"])
    parser.add_argument("--plan", help="R,D,W,B of a GemvPlan")
    parser.add_argument("--context", type=int, default=512)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    stream = cuda.stream()
    plan = GemvPlan(*map(int, args.plan.split(","))) if args.plan else None
    if args.kernel == "attention":
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

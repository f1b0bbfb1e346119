"""Time the INT4 GEMV (kernels/gemv_int4.py) at every 7B linear with several GemvPlans, as
back-to-back programmatic launches and as plain launches, on the GPU.

    python dev/gemv_plans.py [--shapes qkv,o_proj] [--hot] [--json out.json]
    python dev/gemv_plans.py --epilogues

Each call reads a different copy of the weights (enough copies to exceed the L2 twice), so every
call streams from HBM, as one decode step does layer after layer; with --hot every call reads the
same copy, from L2 where it fits (60 MB on an H200): what a GEMV could gain if its weights were
prefetched into L2 while a kernel before it leaves the memory idle; calls are captured in one CUDA
graph and replayed. qkv, gate_up and lm_head read the float32 residual stream and apply their
RMSNorm (the engine's fused path); o_proj and down add into a float32 residual. Prints a table
per shape: us per call, GB/s and the share of a device-to-device copy measured first.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import numpy as np
from numba import cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import random_int4  # noqa: E402
from pynanoqwen.gpu_timing import copy_bandwidth, time_graph, weight_copies  # noqa: E402
from pynanoqwen.kernels.gemv_int4 import (ROPE_PLAN, GemvPlan, default_plan, gemv_bytes,  # noqa: E402
                                          make_gate_up_silu, make_gemv_int4)
from pynanoqwen.kernels.rope_kv_write import rope_cos_sin  # noqa: E402
from pynanoqwen.launch import plain_launches  # noqa: E402

HIDDEN, INTERMEDIATE, QKV, VOCAB = 3584, 18944, 4608, 152064
SHAPES = [("qkv", QKV, HIDDEN, "norm+bias"), ("qkv_rope", QKV, HIDDEN, "norm+rope"), ("o_proj", HIDDEN, HIDDEN, "residual"),
          ("gate_up", INTERMEDIATE, HIDDEN, "norm+silu"), ("down", HIDDEN, INTERMEDIATE, "residual"),
          ("lm_head", VOCAB, HIDDEN, "norm")]
# GemvPlan(rows, depth, warps, blocks_per_sm, split_tiles). The W8 B1 plans use at most half of
# each scheduler's registers (two warps a scheduler at 80-113 registers, ptxas for sm_90), so the
# next launch's block fits beside a running one (registers count per scheduler: docs/HARDWARE.md)
# and can issue its first loads during this launch's tail; in the other plans it cannot.
PLANS = {
    "small": [GemvPlan(2, 4, 8, 2), GemvPlan(2, 4, 8, 2, True), GemvPlan(2, 4, 16, 1, True), GemvPlan(4, 2, 8, 2),
              GemvPlan(2, 4, 8, 1), GemvPlan(4, 4, 8, 1)],
    # W8 B2 gives QKV's 2304 row-pair tiles 2112 warps, so its grid is 144 blocks whose warps take 2
    # tiles each, the second tile's loads issued only after the wait. W9 B2, W10 B2 and W6 B3 give
    # every tile its own warp, so every weight is requested before the wait, as o_proj's 1792 tiles
    # are. ptxas (sm_90) gives the rope kernel 95 registers at W9 and W10 (5 warps of a scheduler
    # fit its 16384) and 112 at W6 B3 (5 would not: it may run 2 blocks a SM). Not yet timed.
    "qkv_rope": [GemvPlan(2, 4, 8, 2), GemvPlan(2, 4, 9, 2), GemvPlan(2, 4, 10, 2), GemvPlan(2, 4, 6, 3),
                 GemvPlan(2, 4, 8, 2, True), GemvPlan(2, 4, 16, 1, True), GemvPlan(2, 4, 8, 1)],
    "gate_up": [GemvPlan(1, 4, 8, 2), GemvPlan(1, 4, 16, 1), GemvPlan(2, 4, 8, 2, True), GemvPlan(2, 2, 8, 2, True),
                GemvPlan(1, 4, 8, 1), GemvPlan(2, 4, 8, 1)],
    "down": [GemvPlan(2, 4, 8, 2, True), GemvPlan(2, 4, 16, 1, True), GemvPlan(4, 4, 8, 2, True),
             GemvPlan(4, 4, 16, 1, True), GemvPlan(4, 2, 8, 2, True), GemvPlan(2, 4, 8, 1, True),
             GemvPlan(4, 4, 8, 1, True)],
    "lm_head": [GemvPlan(2, 4, 8, 2), GemvPlan(2, 4, 8, 2, True), GemvPlan(2, 4, 8, 1)],
}
HEADS = (28, 4, 128)  # 7B's query heads, KV heads, head_dim
# --epilogues: the forms each linear is timed in, the decode step's own form last.
EPILOGUE_FORMS = {"qkv_rope": ("store", "norm+bias", "norm+rope"), "o_proj": ("store", "norm", "residual"),
                  "gate_up": ("norm+silu",), "down": ("store", "norm", "residual"), "lm_head": ("store", "residual", "norm")}


def build(name, n, k, epilogue, plan, rng, path):
    matrices = 2 if name == "gate_up" else 1
    weights = [random_int4(rng, n, k) for _ in range(matrices)]
    norm = {"norm_weight": (1 + 0.1 * rng.standard_normal(k)).astype(np.float16), "norm_eps": 1e-6} \
        if epilogue.startswith("norm") else {}
    if matrices == 2:
        return make_gate_up_silu(n, k, *weights[0], *weights[1], path=path, plan=plan, **norm)
    bias = rng.standard_normal(n).astype(np.float16) if "bias" in epilogue or "rope" in epilogue else None
    rope = {"rope_heads": HEADS} if "rope" in epilogue else {}
    return make_gemv_int4(n, k, *weights[0], path=path, bias=bias, plan=plan, **norm, **rope)


def time_plan(name, n, k, epilogue, plan, rng, stream, hot: bool, path: str) -> dict:
    matrices = 2 if name == "gate_up" else 1
    nbytes = matrices * gemv_bytes(n, k)
    copies = 1 if hot else weight_copies(nbytes)
    gemvs = [build(name, n, k, epilogue, plan, rng, path) for _ in range(copies)]
    x = cuda.to_device(rng.standard_normal(k).astype(np.float32 if epilogue.startswith("norm") else np.float16))
    out = cuda.to_device(np.zeros(n, np.float16 if matrices == 2 else np.float32))
    residual = {"residual": True} if epilogue == "residual" else {}
    calls = max(copies, 32)
    if "rope" in epilogue:
        heads, kv_heads, hd = HEADS
        cos, sin = (cuda.to_device(t) for t in rope_cos_sin(hd, 1e6, 4096))
        pages = [cuda.device_array((256, kv_heads, 16, hd), np.float16) for _ in range(2)]
        rope_args = (cuda.device_array((heads, hd), np.float32), *pages,
                     cuda.to_device(np.arange(256, dtype=np.int32)), cuda.to_device(np.array([1000], np.int32)), cos, sin)

    def enqueue():
        for c in range(calls):
            if "rope" in epilogue:
                gemvs[c % copies].launch_rope(stream, x, *rope_args)
            else:
                gemvs[c % copies].launch(stream, x, out, **residual)

    programmatic = time_graph(stream, enqueue) / calls
    with plain_launches():
        plain = time_graph(stream, enqueue) / calls
    return {"shape": name, "path": path, "n": n, "k": k, "plan": [plan.rows, plan.depth, plan.warps, plan.blocks_per_sm, plan.split_tiles],
            "grid": gemvs[0]._input.grid, "bytes": nbytes, "us": programmatic * 1e6, "plain_us": plain * 1e6,
            "default": plan == (ROPE_PLAN if "rope" in epilogue else default_plan(n, k, matrices))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    parser.add_argument("--paths", default="prmt", help="GEMV paths to time, comma-separated (prmt, fixed16, dp4a)")
    parser.add_argument("--hot", action="store_true", help="every call reads the same weights (from L2 if they fit)")
    parser.add_argument("--epilogues", action="store_true",
                        help="instead: each linear at its default plan in the forms of EPILOGUE_FORMS (what staging "
                             "and epilogue cost: float16 x stored, added into a residual, a fused RMSNorm of h, qkv's "
                             "bias and RoPE epilogues), twice")
    args = parser.parse_args()
    copy = copy_bandwidth()
    print(f"device-to-device copy: {copy / 1e9:.0f} GB/s")
    rng = np.random.default_rng(0)
    stream = cuda.stream()
    if args.epilogues:
        for round_ in range(2):  # the second round shows the run-to-run spread
            for name, n, k, _ in SHAPES:
                for epilogue, path in itertools.product(EPILOGUE_FORMS.get(name, ()), args.paths.split(",")):
                    plan = ROPE_PLAN if "rope" in epilogue else default_plan(n, k, 2 if name == "gate_up" else 1)
                    row = time_plan(name, n, k, epilogue, plan, rng, stream, args.hot, path)
                    print(f"round {round_} {name:8s} {epilogue:10s} {path:7s} PDL {row['us']:7.2f} us plain {row['plain_us']:7.2f}"
                          f" us {100 * row['bytes'] / (row['us'] * 1e-6) / copy:5.1f}% of copy", flush=True)
        return
    rows = []
    for name, n, k, epilogue in SHAPES:
        if name not in args.shapes.split(","):
            continue
        matrices = 2 if name == "gate_up" else 1
        plans = list(PLANS["small" if name in ("qkv", "o_proj") else name])
        if name != "qkv_rope" and default_plan(n, k, matrices) not in plans:
            plans.insert(0, default_plan(n, k, matrices))
        for plan, path in itertools.product(plans, args.paths.split(",")):
            row = time_plan(name, n, k, epilogue, plan, rng, stream, args.hot, path)
            row["gbs"] = row["bytes"] / row["us"] / 1e3
            row["share"] = row["bytes"] / (row["us"] * 1e-6) / copy
            row["plain_gbs"] = row["bytes"] / row["plain_us"] / 1e3
            rows.append(row)
            print(f"{name:8s} {n:6d}x{k:5d} {path:7s} plan R{plan.rows} D{plan.depth} W{plan.warps} B{plan.blocks_per_sm}{' split' if plan.split_tiles else ''}"
                  f" grid {row['grid']:4d}{' *' if row['default'] else '  '}  PDL {row['us']:7.2f} us "
                  f"{row['gbs']:6.0f} GB/s {100 * row['share']:5.1f}%   plain {row['plain_us']:7.2f} us "
                  f"{row['plain_gbs']:6.0f} GB/s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"copy_gbs": copy / 1e9, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

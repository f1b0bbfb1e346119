"""A timeline of the INT4 GEMV's launches: %globaltimer stamps at each phase of every warp, in a copy
of kernels/gemv_int4_kernel.py instrumented at run time, 32 back-to-back programmatic launches
over rotated weight copies in one CUDA graph (as dev/gemv_plans.py times them).

    python dev/gemv_timeline.py [--shapes o_proj,gate_up,down,lm_head] [--hot] [--json out.json]

What it is for: each GEMV of the decode step takes 3-6 us more than its bytes at the copy rate
(docs/PERFORMANCE.md, "Decode, 2026-12-02: the GEMV epilogues ..."), and which part of a launch
that is (the wait for the kernel before, staging x, the first weights arriving, the weight stream,
the tail of the last warps) has not been measured. The copy is the product's source with a stamp
after each anchor below (each must occur exactly once, so the script stops when the kernel changes
rather than time something else). The stamps go into the kernel's `bias_values` argument, which
the residual, silu and plain-store epilogues do not read (an int64 array [warps x 8] there), so
the shapes are timed in those forms: o_proj and down_proj adding into a residual, gate_up with its
fused RMSNorm and SiLU, the lm_head with its norm (the step's qkv, whose RoPE epilogue reads its
bias, is not). Prints, per shape, each phase's median over warps in us after the previous
launch's last warp ended (negative: before it), and the spread of the warps' ends. %globaltimer
ticks in 256 ns steps on the H200: read differences of a few hundred ns as noise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import TIMER, edited_kernel_source, load_source  # noqa: E402

PHASES = ["entry", "first loads issued", "wait returned", "x staged", "first weights here", "last load issued",
          "items done", "end"]
E8, E12, E16 = " " * 8, " " * 12, " " * 16


def stamp(indent: str, k: int, value: str = "gtimer()") -> str:
    return f"{indent}if lane == U(0):\n{indent}    bias_values[U(warp_id * U(8)) + U({k})] = {value}\n"


# (text of the product kernel, the text that replaces it): each must occur exactly once.
EDITS = [
    (E8 + "warp_id = U(U(block * U(warps)) + warp)\n", E8 + "warp_id = U(U(block * U(warps)) + warp)\n" + stamp(E8, 0)),
    (E8 + "first_cursor = tile0\n", stamp(E8, 1) + E8 + "first_cursor = tile0\n"),
    (E8 + "grid_dependency_wait()\n" + E8 + "stage(activations, xs)\n",
     E8 + "grid_dependency_wait()\n" + stamp(E8, 2) + E8 + "stage(activations, xs)\n" + stamp(E8, 3)
     + stamp(E8, 4, "gtimer() + (words0[0] & U(0))")),
    (E16 + "launch_dependents()\n" + E16 + "triggered = True\n",
     stamp(E16, 5) + E16 + "launch_dependents()\n" + E16 + "triggered = True\n"),
    (E8 + "if not triggered:\n" + E12 + "launch_dependents()\n",
     stamp(E8, 6) + E8 + "if not triggered:\n" + E12 + "launch_dependents()\n"),
    ("\n    return gemv_int4\n", "\n" + stamp(E8, 7) + "\n    return gemv_int4\n"),
]


def instrumented_source() -> str:
    return edited_kernel_source("gemv_timeline", TIMER, EDITS, kernel="gemv_int4_kernel")


def summarize(stamps: np.ndarray) -> dict:
    """stamps int64 [launches, warps, 8] of one replay -> per phase, the median over the warps that
    stamped it, in us after the previous launch's last warp ended (launches 1.. only)."""
    ts = stamps.astype(np.float64)
    ended = ts[:, :, 7].max(axis=1)  # each launch's last warp
    phases = {}
    for k, name in enumerate(PHASES):
        values = [(ts[c, :, k][ts[c, :, k] > 0] - ended[c - 1]) / 1e3 for c in range(1, len(ts))]
        values = np.concatenate(values)
        if values.size:
            phases[name] = float(np.median(values))
    ends = (ts[1:, :, 7] - ended[:-1, None]) / 1e3
    return {"period_us": float(np.median(np.diff(ended)) / 1e3), "phases_us": phases,
            "end_p10_p90_us": [float(np.percentile(ends, 10)), float(np.percentile(ends, 90))]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="o_proj,gate_up,down,lm_head")
    parser.add_argument("--hot", action="store_true",
                        help="every launch reads the same weights, from L2 where they fit (no DRAM stream queued ahead of x)")
    parser.add_argument("--json")
    args = parser.parse_args()
    from numba import cuda

    from gemv_plans import SHAPES, build
    from pynanoqwen.gpu_timing import time_graph, weight_copies
    from pynanoqwen.kernels import kernel_path
    from pynanoqwen.kernels.gemv_int4 import default_plan, gemv_bytes
    from pynanoqwen.launch import launch

    module = load_source(instrumented_source(), "gemv_timeline_kernel")
    rng = np.random.default_rng(0)
    stream = cuda.stream()
    results = {}
    for name, n, k, epilogue in SHAPES:
        if name not in args.shapes.split(","):
            continue
        matrices = 2 if name == "gate_up" else 1
        form = epilogue.split("+")[-1]  # the norm is the GEMV's prologue, not its epilogue
        form = "store" if form == "norm" else form
        if form not in ("store", "residual", "silu"):
            print(f"{name}: its {epilogue} epilogue reads bias_values, where the stamps go; not timed")
            continue
        plan = default_plan(n, k, matrices)
        copies = 1 if args.hot else weight_copies(matrices * gemv_bytes(n, k))
        gemvs = [build(name, n, k, epilogue, plan, rng, kernel_path("auto", k)) for _ in range(copies)]
        grid, calls = gemvs[0]._input.grid, max(copies, 32)
        kernel = module.gemv_kernel(gemvs[0].path, n, k, matrices, plan, grid, form, gemvs[0]._input.kernel_norm_eps)
        x = cuda.to_device(rng.standard_normal(k).astype(np.float32 if epilogue.startswith("norm") else np.float16))
        out = cuda.to_device(np.zeros(n, np.float16 if matrices == 2 else np.float32))
        stamps = cuda.to_device(np.zeros((calls, grid * plan.warps * 8), np.int64))

        def enqueue():
            for c in range(calls):
                g = gemvs[c % copies]
                q0, s0, q1, s1 = (g.gate_q, g.gate_s, g.up_q, g.up_s) if matrices == 2 else \
                    (g.qweight, g.scales, g.qweight, g.scales)
                launch(kernel, grid, 32 * plan.warps, stream,
                       (q0, s0, q1, s1, g._input.activations(stream, x), stamps[c], out))

        us = time_graph(stream, enqueue, replays=5) / calls * 1e6
        summary = summarize(stamps.copy_to_host().reshape(calls, grid * plan.warps, 8))
        summary["graph_us_a_launch"] = us
        results[name] = summary
        print(f"{name} ({plan}): {us:.2f} us a launch in the graph; stamps: a launch every "
              f"{summary['period_us']:.2f} us; warps end {summary['end_p10_p90_us'][0]:.2f}..{summary['end_p10_p90_us'][1]:.2f} us (p10..p90)")
        print("  us after the previous launch's last warp: "
              + ", ".join(f"{phase} {t:.2f}" for phase, t in summary["phases_us"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

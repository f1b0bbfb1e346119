"""A timeline of one decode-attention launch: %globaltimer stamps at each phase of every block, in
a copy of kernels/attention_decode.py instrumented at run time, 28 launches over their own KV
pools in one CUDA graph (as dev/attention_splits.py times them).

    python dev/attention_timeline.py [--contexts 16,512,4096] [--json out.json]

The copy is the product's source with a stamp inserted after each anchor line below (each anchor
must occur exactly once, so the script fails loudly when the kernel changes rather than time
something else) and a stamps argument (int64 [blocks, 16]) per launch. Prints, per context, the
median time of each phase after the launch's first block began, for blocks with pages, blocks
without, and the block that merges; and how far the launch's first block began before the
previous launch's last block ended (programmatic dependent launch). %globaltimer ticks in 256 ns
steps on the H200, so read differences of a few hundred ns as noise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import TIMER, edited_kernel_source, load_source  # noqa: E402

PHASES = ["entry", "barriers set", "pos read", "early copies issued", "wait returned", "q read", "first page here",
          "pages done", "partials met", "partials stored+fenced", "counted in", "merge began",
          "thread 0 merged", "end"]
E8, E12, E16 = " " * 8, " " * 12, " " * 16
# (text of the product kernel, the text that replaces it): each must occur exactly once.
EDITS = [
    ("arrivals):\n", "arrivals, st):\n"),
    ("page_table, pos, out) -> None:", "page_table, pos, out, st) -> None:"),
    (E16 + "self.arrivals), shared_bytes", E16 + "self.arrivals, st), shared_bytes"),
    (E8 + "gid, tq = lane // 4, lane % 4\n",
     E8 + "gid, tq = lane // 4, lane % 4\n" + E8 + "blk = split * num_kv_heads + kv_head\n"
     + E8 + "if tid == 0:\n" + E12 + "st[blk, 0] = gtimer()\n"),
    (E8 + "context = pos[0] + 1\n",
     E8 + "context = pos[0] + 1\n" + E8 + "if tid == 0:\n" + E12 + "st[blk, 1] = gtimer()\n"
     + E12 + "st[blk, 14] = context\n" + E12 + "st[blk, 2] = gtimer()\n"),
    (E8 + "grid_dependency_wait()  # q and the K/V row",
     E8 + "if warp == PRODUCER_WARP and lane == 0:\n" + E12 + "st[blk, 3] = gtimer()\n"
     + E8 + "grid_dependency_wait()  # q and the K/V row"),
    (E8 + "if warp == PRODUCER_WARP:\n" + E12 + "for i in range(early, num_pages):",
     E8 + "if tid == 0:\n" + E12 + "st[blk, 4] = gtimer()\n"
     + E8 + "if warp == PRODUCER_WARP:\n" + E12 + "for i in range(early, num_pages):"),
    (E12 + "acc = cuda.local.array(O_FLOATS, types.float32)",
     E12 + "if tid == 0:\n" + E16 + "st[blk, 5] = gtimer() + (q_hi[0] & U(0))\n"
     + E12 + "acc = cuda.local.array(O_FLOATS, types.float32)"),
    (E16 + "mbarrier_wait(full, stage, (i // stages) & 1)\n",
     E16 + "mbarrier_wait(full, stage, (i // stages) & 1)\n" + E16 + "if tid == 0 and i == 0:\n"
     + E16 + "    st[blk, 6] = gtimer()\n"),
    (E12 + "running_sum += shfl_xor(running_sum, 1)\n",
     E12 + "if tid == 0:\n" + E16 + "st[blk, 7] = gtimer()\n" + E12 + "running_sum += shfl_xor(running_sum, 1)\n"),
    (E8 + "launch_dependents()\n" + E8 + "cuda.syncthreads()\n",
     E8 + "launch_dependents()\n" + E8 + "cuda.syncthreads()\n" + E8 + "if tid == 0:\n" + E12 + "st[blk, 8] = gtimer()\n"
     + E12 + "st[blk, 15] = num_pages\n"),
    (E8 + "if tid == 0:\n" + E12 + "last_block[0] = cuda.atomic.add(arrivals, kv_head, 1) == num_splits - 1\n",
     E8 + "if tid == 0:\n" + E12 + "st[blk, 9] = gtimer()\n"
     + E12 + "last_block[0] = cuda.atomic.add(arrivals, kv_head, 1) == num_splits - 1\n"
     + E12 + "st[blk, 10] = gtimer() + last_block[0] * 0\n"),
    (E8 + "if last_block[0] == 0:\n" + E12 + "return\n",
     E8 + "if last_block[0] == 0:\n" + E12 + "if tid == 0:\n" + E16 + "st[blk, 13] = gtimer()\n" + E12 + "return\n"),
    (E8 + "cuda.threadfence()\n" + E8 + "if tid == 0:\n" + E12 + "arrivals[kv_head] = 0",
     E8 + "cuda.threadfence()\n" + E8 + "if tid == 0:\n" + E12 + "st[blk, 11] = gtimer()\n"
     + E12 + "arrivals[kv_head] = 0"),
    (E16 + "out[head * head_dim + OCTET * octet + e] = merged[e] * inverse\n",
     E16 + "out[head * head_dim + OCTET * octet + e] = merged[e] * inverse\n" + E8 + "if tid == 0:\n"
     + E12 + "st[blk, 12] = gtimer()\n" + E8 + "cuda.syncthreads()\n" + E8 + "if tid == 0:\n"
     + E12 + "st[blk, 13] = gtimer()\n"),
]


def instrumented_source() -> str:
    return edited_kernel_source("attention_timeline", TIMER, EDITS)


def load_instrumented():
    return load_source(instrumented_source(), "attention_timeline_kernel")


def summarize(stamps: np.ndarray) -> dict:
    """stamps int64 [launches, blocks, 16] of one replay -> medians (us after each launch's first block)."""
    ts = stamps[:, :, :14].astype(np.float64)
    t0 = ts[:, :, 0].min(axis=1)
    end = ts[:, :, 13].max(axis=1)
    has_pages = stamps[:, :, 15] > 0
    merged = ts[:, :, 11] > ts[:, :, 0]  # stamps 11-12 of an earlier replay are older than this one's entry
    rows = {}
    for label, mask in (("with pages", has_pages), ("without pages", ~has_pages), ("merging", merged)):
        rows[label] = {}
        for k in range(1, 14):
            stamped = mask & (ts[:, :, k] >= ts[:, :, 0])  # set in this replay (unset stamps are 0)
            if np.any(stamped):
                rows[label][PHASES[k]] = float(np.median((ts[:, :, k] - t0[:, None])[stamped]) / 1e3)
    return {"period_us": float(np.median(np.diff(t0)) / 1e3), "span_us": float(np.median(end - t0) / 1e3),
            "began_before_previous_end_us": float(np.median(end[:-1] - t0[1:]) / 1e3), "phases": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="16,512,4096")
    parser.add_argument("--json")
    args = parser.parse_args()
    from numba import cuda

    from harness import SEVEN_B, attention_inputs
    from pynanoqwen.gpu_timing import time_graph

    contexts = [int(c) for c in args.contexts.split(",")]
    heads, kv_heads, head_dim, layers = SEVEN_B.num_heads, SEVEN_B.num_kv_heads, SEVEN_B.head_dim, SEVEN_B.num_layers
    rng = np.random.default_rng(0)
    stream = cuda.stream()
    max_pages, pools, page_table, q = attention_inputs(rng, contexts, layers)
    out = cuda.device_array(heads * head_dim, np.float16)
    attention = load_instrumented().make_decode_attention(heads, kv_heads, head_dim, max_pages)
    blocks = attention.grid[0] * attention.grid[1]
    results = {}
    for context in contexts:
        pos = cuda.to_device(np.array([context - 1], np.int32))
        stamps = cuda.to_device(np.zeros((layers, blocks, 16), np.int64))

        def enqueue():
            for layer, (k_pages, v_pages) in enumerate(pools):
                attention.launch(stream, q, k_pages, v_pages, page_table, pos, out, stamps[layer])

        us = time_graph(stream, enqueue, replays=20) / layers * 1e6
        summary = summarize(stamps.copy_to_host())
        summary["graph_us_a_launch"] = us
        results[context] = summary
        print(f"context {context}: {us:.2f} us a launch in the graph; stamps: a launch every {summary['period_us']:.2f} us, "
              f"span {summary['span_us']:.2f} us, first block began {summary['began_before_previous_end_us']:.2f} us "
              "before the previous launch ended")
        for label, phases in summary["phases"].items():
            print(f"  {label:14s} " + ", ".join(f"{name} {t:.2f}" for name, t in phases.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

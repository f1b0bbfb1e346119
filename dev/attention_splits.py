"""Time decode attention (kernels/attention_decode.py) at 7B shapes over a sweep of contexts and
split settings, on the GPU: 28 launches (one per layer, each over its own KV pages, so the K/V
stream comes from HBM as in a decode step) in one CUDA graph, replayed.

    python dev/attention_splits.py [--contexts 512,545,4096,4097,16384,32000] [--json out.json]

Prints us per launch, the K/V bytes one launch must read (2 x context x kv_heads x head_dim x 2 B)
and that as GB/s and as a share of a device-to-device copy measured first.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from numba import cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import SEVEN_B, attention_inputs  # noqa: E402
from pynanoqwen.gpu_timing import copy_bandwidth, time_graph  # noqa: E402
from pynanoqwen.kernels.attention_decode import make_decode_attention  # noqa: E402
from pynanoqwen.launch import plain_launches  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, LAYERS = SEVEN_B.num_heads, SEVEN_B.num_kv_heads, SEVEN_B.head_dim, SEVEN_B.num_layers
# The product's settings; other split floors and rings; and 1 or 8 splits, whose short contexts
# (--contexts 16,512) show how much of a launch is the fixed chain (pos, page table, one page, the
# merge) rather than the pages. Deeper rings: at 32000 tokens a block's 61 pages stream at ~13 GB/s
# (37.8 us a launch), as if each consumer waited for its next page's DRAM round trip with only two
# of its pages in flight, and each page costs a consumer ~1.3 us (dev/attention_timeline.py at 4096:
# two pages already in shared memory take 2.8 us); 16 or 24 stages (128 or 192 KiB of ring) test
# that. (8 consumer warps, two a scheduler, did not launch: CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, 9
# warps at the kernel's registers exceed an SM's 64k.)
VARIANTS = [dict(), dict(min_pages_per_split=2), dict(min_pages_per_split=8), dict(consumers=4, stages=4),
            dict(stages=16), dict(stages=24), dict(num_splits=1), dict(num_splits=8)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # 545 and 4097: a partial last page, as in 15 decode steps of 16 (docs/PERFORMANCE.md, lessons)
    parser.add_argument("--contexts", default="512,545,4096,4097,16384,32000")
    parser.add_argument("--json")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    copy = copy_bandwidth()
    print(f"device-to-device copy: {copy / 1e9:.0f} GB/s")
    rng = np.random.default_rng(0)
    stream = cuda.stream()
    max_pages, pools, page_table, q = attention_inputs(rng, contexts, LAYERS)
    out = cuda.device_array(HEADS * HEAD_DIM, np.float16)
    rows = []
    for variant in VARIANTS:
        attention = make_decode_attention(HEADS, KV_HEADS, HEAD_DIM, max_pages, **variant)
        for context in contexts:
            pos = cuda.to_device(np.array([context - 1], np.int32))

            def enqueue():
                for k_pages, v_pages in pools:
                    attention.launch(stream, q, k_pages, v_pages, page_table, pos, out)

            seconds = time_graph(stream, enqueue, replays=10) / LAYERS
            with plain_launches():
                plain = time_graph(stream, enqueue, replays=10) / LAYERS
            nbytes = 2 * context * KV_HEADS * HEAD_DIM * 2
            row = {"variant": variant, "context": context, "us": seconds * 1e6, "plain_us": plain * 1e6,
                   "bytes": nbytes, "gbs": nbytes / seconds / 1e9, "share": nbytes / seconds / copy}
            rows.append(row)
            print(f"{str(variant):45s} ctx {context:6d}  PDL {row['us']:7.2f} us {row['gbs']:6.0f} GB/s "
                  f"{100 * row['share']:5.1f}%   plain {row['plain_us']:7.2f} us", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"copy_gbs": copy / 1e9, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

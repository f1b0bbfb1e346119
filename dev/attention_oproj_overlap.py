"""Time decode attention followed by the o_proj GEMV that reads its output, 28 layers in one CUDA
graph, with the attention's trigger where the product has it (once its pages are done) and at the
start (`early_trigger`), and o_proj with two plans.

    python dev/attention_oproj_overlap.py [--contexts 512,4096,32000] [--json out.json]

The question (docs/PERFORMANCE.md): at short contexts attention waits on a chain of round trips
while DRAM idles. A block of o_proj fits on an SM beside an attention block, and o_proj issues its
weight loads before it waits for attn; if attention lets it launch at once, those loads could hide
under attention's latency. Each layer has its own KV pages and its own o_proj weights (28 x 6.6 MB,
over twice the L2), as in a decode step. Prints us a layer for the pair, for each kernel alone,
and the overlap (alone + alone - pair).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from numba import cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import SEVEN_B, attention_inputs, random_int4  # noqa: E402
from pynanoqwen.gpu_timing import time_graph  # noqa: E402
from pynanoqwen.kernels.attention_decode import make_decode_attention  # noqa: E402
from pynanoqwen.kernels.gemv_int4 import GemvPlan, make_gemv_int4  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, LAYERS = SEVEN_B.num_heads, SEVEN_B.num_kv_heads, SEVEN_B.head_dim, SEVEN_B.num_layers
HIDDEN = SEVEN_B.hidden_size
O_PLANS = [GemvPlan(2, 4, 8, 2), GemvPlan(2, 4, 8, 1)]  # the default; one block a SM (fits beside attention)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="512,4096,32000")
    parser.add_argument("--json")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    rng = np.random.default_rng(0)
    stream = cuda.stream()
    max_pages, pools, page_table, q = attention_inputs(rng, contexts, LAYERS)
    attn = cuda.device_array(HEADS * HEAD_DIM, np.float16)
    h = cuda.to_device(rng.standard_normal(HIDDEN).astype(np.float32))
    weights = [random_int4(rng, HIDDEN, HIDDEN) for _ in range(LAYERS)]
    rows = []
    for plan in O_PLANS:
        o_projs = [make_gemv_int4(HIDDEN, HIDDEN, *w, plan=plan) for w in weights]
        for early in (False, True):
            attention = make_decode_attention(HEADS, KV_HEADS, HEAD_DIM, max_pages, early_trigger=early)
            for context in contexts:
                pos = cuda.to_device(np.array([context - 1], np.int32))

                def attention_only():
                    for k_pages, v_pages in pools:
                        attention.launch(stream, q, k_pages, v_pages, page_table, pos, attn)

                def o_proj_only():
                    for o_proj in o_projs:
                        o_proj.launch(stream, attn, h, residual=True)

                def pair():
                    for (k_pages, v_pages), o_proj in zip(pools, o_projs):
                        attention.launch(stream, q, k_pages, v_pages, page_table, pos, attn)
                        o_proj.launch(stream, attn, h, residual=True)

                us = {name: time_graph(stream, enqueue, replays=10) / LAYERS * 1e6
                      for name, enqueue in (("attention", attention_only), ("o_proj", o_proj_only), ("pair", pair))}
                row = {"o_plan": [plan.rows, plan.depth, plan.warps, plan.blocks_per_sm], "early_trigger": early,
                       "context": context, **us, "overlap": us["attention"] + us["o_proj"] - us["pair"]}
                rows.append(row)
                print(f"o_proj R{plan.rows} D{plan.depth} W{plan.warps} B{plan.blocks_per_sm}  "
                      f"{'early' if early else 'late '} trigger  ctx {context:6d}  pair {us['pair']:7.2f} us  "
                      f"attention {us['attention']:7.2f}  o_proj {us['o_proj']:6.2f}  overlap {row['overlap']:6.2f}",
                      flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()

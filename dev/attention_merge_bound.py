"""What folding decode attention's split merge into o_proj could save at most: us a layer of
(attention, o_proj) pairs, the step's order, with the product's attention and with a copy of it
that stops once its split partials are written (no fence, counter or merge).

    python dev/attention_merge_bound.py [--contexts 16,545,1024,2048,4096]

At short contexts most of a decode-attention launch is its cross-block merge: the split's partial
stored and fenced, the atomic counter, and the last block's L2 round trips
(kernels/attention_decode.py's cost model). One of issue 12's levers is to leave the merge to
the next kernel: attention would write its partials and end, and o_proj, which waits for
attention's grid to complete anyway, would merge them while it stages x. The copy here measures
the first half only: o_proj then reads a stale attn, so its rows are a timing, not a result, and
the price of the other half (every o_proj block reading all active splits' partials, ~131 KB at
545 tokens and 9 splits, against 7 KB of attn) is not in it. The difference of the two pair
columns bounds the gain. 28 pairs over their own KV pools and o_proj weights in one CUDA graph,
PDL launches, as a step runs them (qkv's GEMV left out). Figures: docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse

import numpy as np

from harness import SEVEN_B, attention_inputs, edited_kernel_source, load_source, random_int4

# The product kernel's line before its fence: the copy returns there.
ANCHOR = "        # Publish the partials GPU-wide, then count this block in; the last of the KV head's\n"


def without_merge():
    """The product's decode-attention module, but each block returns once its partials are written."""
    return load_source(edited_kernel_source("attention_merge_bound", "", [(ANCHOR, "        return\n" + ANCHOR)]),
                       "attention_without_merge")


def timings(contexts: list[int]) -> list[dict]:
    from numba import cuda

    from pynanoqwen.gpu_timing import time_graph
    from pynanoqwen.kernels.attention_decode import make_decode_attention
    from pynanoqwen.kernels.gemv_int4 import make_gemv_int4

    rng = np.random.default_rng(0)
    max_pages, pools, page_table, q = attention_inputs(rng, contexts, SEVEN_B.num_layers)
    shape = (SEVEN_B.num_heads, SEVEN_B.num_kv_heads, SEVEN_B.head_dim, max_pages)
    kernels = {"product": make_decode_attention(*shape), "no merge": without_merge().make_decode_attention(*shape)}
    n = k = SEVEN_B.hidden_size
    o_projs = [make_gemv_int4(n, k, *random_int4(rng, n, k), path="fixed16") for _ in pools]
    stream = cuda.stream()
    attn = cuda.to_device(np.zeros(SEVEN_B.num_heads * SEVEN_B.head_dim, np.float16))
    h = cuda.to_device(np.zeros(n, np.float32))
    rows = []
    for context in contexts:
        pos = cuda.to_device(np.array([context - 1], np.int32))
        row = {"context": context}
        for pair in (False, True):
            for name, attention in kernels.items():
                def enqueue(attention=attention, pair=pair):
                    for (k_pages, v_pages), o_proj in zip(pools, o_projs):
                        attention.launch(stream, q, k_pages, v_pages, page_table, pos, attn)
                        if pair:
                            o_proj.launch(stream, attn, h, residual=True)
                row[f"{'pair' if pair else 'attention'}, {name}"] = 1e6 * time_graph(stream, enqueue) / len(pools)
        row["bound of the saving"] = row["pair, product"] - row["pair, no merge"]
        rows.append(row)
    return rows


def main() -> None:
    from harness import print_table

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="16,545,1024,2048,4096", help="comma-separated context lengths")
    args = parser.parse_args()
    print_table("us a layer", timings([int(c) for c in args.contexts.split(",")]))


if __name__ == "__main__":
    main()

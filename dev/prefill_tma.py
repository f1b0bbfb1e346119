"""The engine's prefill with the TMA-fed GEMM (dev/gemm_wgmma_tma.py) where that measured faster,
against the product's, in one process: time to first token, and whether every bit stays.

    python dev/prefill_tma.py [--model FILE] [--tokens 512,2048,4096] [--repeats 5]

dev/gemm_wgmma_tma.py timed each linear alone: on the 256-token tile with thread 0 producing,
gate_up took 246.0 against 270.7 us at 512 rows and 898.9 against 1118.5 at 2048, o_proj 119.1
against 129.0 at 2048 (H100, docs/PERFORMANCE.md, "2026-12-06, midday"). Whether that reaches a
prompt's TTFT is this script's question, before the kernel goes into the product. It loads one 7B
engine (the file, or random weights of the 7B shape), times `generate`'s first token at each
prompt length (one warm-up that captures the prefill graphs, then `repeats` runs, as bench's
prefill sweep does), records what the prefill left (the first token, the last layer's K/V pages
over the prompt, the last row's logits), then swaps each layer's gate_up GEMM (from more than
SHORT_PROMPT_ROWS rows) and o_proj GEMM (from LONG_PROMPT_ROWS rows, where the product runs its
own 128 x 256 tile) for the TMA form, drops the captured prefill graphs, and does it all again.
Both forms sum every row in one K chunk on wgmma, so the prefill must leave the same bits
(gemm_int4_tiles.rows_sum_alike; tests/sim/test_gemm_tma_sim.py and the variant's GPU check give a
row the product's bits on each tile). Prints a PASS/FAIL line a prompt and a table of TTFTs.
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np

from gemm_wgmma_tma import TmaGemm
from pynanoqwen.config import GROUP_SIZE
from pynanoqwen.kernels import PAGE_SIZE
from pynanoqwen.kernels.gemm_int4_tiles import LONG_PROMPT_ROWS, SHORT_PROMPT_ROWS, WG2_T256

LANE_LAG = 0  # thread 0 produces, the other warps at most one tile behind it (the variant's best form)


class TmaLinear:
    """One layer's prefill linear as the engine calls it (Int4Gemm or GateUpSiluGemm's launch), on
    the TMA-fed 128 x 256 tile from `min_rows` rows and on the product's object below that."""

    def __init__(self, product, n: int, k: int, epilogue: str, min_rows: int, tiles=WG2_T256):
        pairs = [(product.gate_q, product.gate_s), (product.up_q, product.up_s)] if epilogue == "gate_up_silu" \
            else [(product.qweight, product.scales)]
        weights = [(q.reshape(n, k // 8), s.view(np.float16).reshape(n, k // GROUP_SIZE)) for q, s in pairs]
        self.tma = TmaGemm(n, k, weights, epilogue, tiles, 1, lane_lag=LANE_LAG)
        self.product, self.min_rows = product, min_rows

    def launch(self, stream, x, out, m: int, **kwargs) -> None:
        if m < self.min_rows:
            self.product.launch(stream, x, out, m, **kwargs)
        else:
            self.tma.launch(stream, x, out, m)


def use_tma(backend) -> None:
    """Each layer's gate_up and o_proj prefill GEMMs through TmaLinear; the prefill graphs, which hold
    the product's launches, dropped (the next prefill of each bucket captures them again)."""
    cfg = backend.config
    hidden, intermediate = cfg.hidden_size, cfg.intermediate_size
    layers = backend.weights.layers
    for index, layer in enumerate(layers):
        linears = layer.prefill
        layers[index] = dataclasses.replace(layer, prefill=dataclasses.replace(
            linears,
            gate_up=TmaLinear(linears.gate_up, intermediate, hidden, "gate_up_silu", SHORT_PROMPT_ROWS + 1),
            o_proj=TmaLinear(linears.o_proj, hidden, cfg.q_size, "residual", LONG_PROMPT_ROWS)))
    backend.prefill_graphs.close()


def ttft_ms(backend, prompt: list[int], repeats: int) -> float:
    from pynanoqwen.bench import time_generation

    times = [time_generation(backend, prompt, 1)[0] for _ in range(repeats + 1)][1:]  # the first captures
    return float(np.median(times))


def what_prefill_left(backend, prompt: list[int]) -> dict:
    """The first token, the last layer's K and V pages of the prompt, the last row's logits."""
    from pynanoqwen.sampling import SamplingParams

    token = next(iter(backend.generate(prompt, SamplingParams(), 1, frozenset())))
    backend.stream.synchronize()
    pages = -(-len(prompt) // PAGE_SIZE)
    table = backend.state.page_table.copy_to_host()[:pages]

    def positions(pool):  # [page, kv head, slot, dim] -> [position, kv head, dim], the prompt's only
        tiles = pool[-1].copy_to_host()[table]
        return tiles.transpose(0, 2, 1, 3).reshape(pages * PAGE_SIZE, *tiles.shape[1:2], tiles.shape[3])[:len(prompt)]

    return {"token": token, "k": positions(backend.buffers.kv.k), "v": positions(backend.buffers.kv.v),
            "logits": backend.act.logits.copy_to_host()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a .nanoqwen file (default: random weights of the 7B shape)")
    parser.add_argument("--tokens", default="512,2048,4096", help="comma-separated prompt lengths")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from pynanoqwen.engine import CudaBackend
    from pynanoqwen.synthetic import SyntheticWeights

    lengths = [int(t) for t in args.tokens.split(",")]
    backend = CudaBackend(args.model or SyntheticWeights("7b", seed=0), max_context=max(lengths) + 64)
    rng = np.random.default_rng(0)
    prompts = {n: rng.integers(0, 4000, n).tolist() for n in lengths}
    rows = {n: {"tokens": n} for n in lengths}
    left = {}
    for form in ("product", "tma"):
        if form == "tma":
            use_tma(backend)
        for n, prompt in prompts.items():
            rows[n][f"TTFT ms, {form}"] = ttft_ms(backend, prompt, args.repeats)
            left[n, form] = what_prefill_left(backend, prompt)
    for n in lengths:
        a, b = left[n, "product"], left[n, "tma"]
        differ = {name: int(np.count_nonzero(a[name] != b[name])) for name in ("k", "v", "logits")}
        same = a["token"] == b["token"] and not any(differ.values())
        print(f"{'PASS' if same else 'FAIL'}  {n} tokens: first token {a['token']} / {b['token']}, elements that "
              f"differ: {differ}")
        rows[n]["saved ms"] = rows[n]["TTFT ms, product"] - rows[n]["TTFT ms, tma"]
    from harness import print_table

    print_table("time to first token, one engine, the product's prefill GEMMs then the TMA-fed ones", list(rows.values()))
    backend.close()


if __name__ == "__main__":
    main()

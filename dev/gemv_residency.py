"""The decode step with GEMV plans whose blocks fit beside their predecessor's.

Programmatic dependent launch lets a kernel's blocks start, and issue their first weight loads,
while the kernel before it finishes, but only where they fit on a SM beside that kernel's
blocks, and registers count per scheduler, 16384 each (docs/DECODE.md, "Execution model"). By
ptxas's counts only the QKV GEMV fits beside down_proj. Two more boundaries are one plan away:
- o_proj -> gate_up. o_proj's two blocks of 8 warps at 96 registers take 12288 of a scheduler's
  16384, gate_up's block needs 5120 (2 warps at 80). o_proj at 3 blocks a SM (its launch bound
  then caps it at 85 registers, 80 allocated) takes at most 10240 where two of its blocks share a
  SM, so gate_up's block fits.
- gate_up -> down_proj. gate_up's two blocks take 10240; down_proj's one block of 16 warps at 80
  needs 10240. down_proj in two blocks of 8 warps a SM (tiles still split between warps) needs
  5120 a block: one fits.
Attention's block (5 warps at 218 registers) before o_proj is not one plan away and stays.

Predicted: the early loads of a fitting boundary go out during the predecessor's tail instead of
after it, about one DRAM round trip plus the block launch, ~1-2 us a boundary: ~30-60 us a step
each. The risk: the smaller-register or smaller-block plans are slower by themselves (o_proj at B3
runs 224 blocks; down_proj at W8 B2 stages x twice as often per SM).

Measured on an H100 (docs/PERFORMANCE.md, "2026-12-06, late night"): refuted. o_proj at B3 (79
registers) makes gate_up fit and the step 17-27 us slower (1.743 against 1.726 ms at 512 tokens
of context, 1.879 against 1.852 at 4096); down_proj in two 8-warp blocks took 116 registers, so
it does not fit after all, and changed its bits (tokens differ at 512). Not in the product.

    python dev/gemv_residency.py [--contexts 512,4096] [--repeats 3] [--model 7b.nanoqwen]

Builds the synthetic 7B engine once per variant (decode only, the prompt through decode steps),
compares greedy tokens with the product's (a whole-tile plan sums each tile in one warp in the
same order whatever the grid, so o_proj's tokens must match; down_proj's split changes which warp
sums which items, and so may its bits), prints each variant's GEMV register counts and the ITL
(median and p10-p90 of repeats x 64 tokens) at each context.
"""

from __future__ import annotations

import argparse

import numpy as np

from harness import print_table
from pynanoqwen.bench import time_generation
from pynanoqwen.bench_report import summarize
from pynanoqwen.engine import CudaBackend
from pynanoqwen.kernels import gemv_int4
from pynanoqwen.kernels.gemv_int4 import GemvPlan
from pynanoqwen.sampling import SamplingParams
from pynanoqwen.synthetic import SyntheticWeights

PRODUCT_PLAN = gemv_int4.default_plan
O_PROJ, DOWN = (3584, 3584), (3584, 18944)  # (N, K) at 7B
VARIANTS = {
    "product": {},
    "o_proj W8 B3": {O_PROJ: GemvPlan(rows=2, depth=4, warps=8, blocks_per_sm=3)},
    "down W8 B2 split": {DOWN: GemvPlan(rows=2, depth=4, warps=8, blocks_per_sm=2, split_tiles=True)},
    "both": {O_PROJ: GemvPlan(rows=2, depth=4, warps=8, blocks_per_sm=3),
             DOWN: GemvPlan(rows=2, depth=4, warps=8, blocks_per_sm=2, split_tiles=True)},
}


def plans_of(overrides: dict):
    def default_plan(n: int, k: int, matrices: int = 1) -> GemvPlan:
        return overrides.get((n, k)) if matrices == 1 and (n, k) in overrides else PRODUCT_PLAN(n, k, matrices)
    return default_plan


def registers(backend) -> str:
    """Registers a thread of each of layer 0's GEMV kernels (compiled by now)."""
    layer, out = backend.weights.layers[0], []
    for name, gemv, residual in (("qkv", layer.qkv, False), ("o_proj", layer.o_proj, True),
                                 ("gate_up", layer.gate_up, False), ("down", layer.down, True)):
        kernel = gemv.kernel(residual) if name != "gate_up" else gemv.kernel()
        try:
            counts = sorted(set(kernel.get_regs_per_thread().values()))
        except (AttributeError, TypeError, ValueError) as error:  # a count is a report, not the result
            counts = [f"unknown: {error}"]
        out.append(f"{name} {gemv.plan.warps}w x{gemv.plan.blocks_per_sm} {counts}")
    return "; ".join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="512,4096")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gen", type=int, default=64)
    parser.add_argument("--model", help="a 7B .nanoqwen file (default: synthetic weights made in memory)")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    rng = np.random.default_rng(0)
    prompts = {c: rng.integers(0, 4000, c).tolist() for c in contexts}
    rows, reference = [], {}
    for label, overrides in VARIANTS.items():
        gemv_int4.default_plan = plans_of(overrides)
        try:
            backend = CudaBackend(args.model or SyntheticWeights("7b", seed=0), verify_data=False,
                                  max_context=max(contexts) + args.gen + 16, prefill="decode")
        finally:
            gemv_int4.default_plan = PRODUCT_PLAN
        try:
            row = {"variant": label}
            for context, prompt in prompts.items():
                tokens = list(backend.generate(prompt, SamplingParams(), args.gen, frozenset()))
                same = reference.setdefault(context, tokens) == tokens
                gaps = [g for _ in range(args.repeats) for g in time_generation(backend, prompt, args.gen)[1]]
                itl = summarize(gaps)
                row[f"ITL ms at {context}"] = f"{itl['median']:.3f} ({itl['p10']:.3f}-{itl['p90']:.3f})"
                row[f"tokens at {context}"] = "same" if same else "DIFFER"
            row["registers"] = registers(backend)
            rows.append(row)
            print(row, flush=True)
        finally:
            backend.close()
    print_table("decode ITL with GEMV plans that fit beside their predecessor (synthetic 7B, graph mode)", rows)


if __name__ == "__main__":
    main()

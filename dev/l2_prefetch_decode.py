"""The decode step with the layer's next weights prefetched into L2 while attention runs.

At 512 tokens of context decode attention takes ~7.9 us a layer for ~0.25 us of bytes
(docs/PERFORMANCE.md): a latency chain during which HBM streams nothing. At the copy rate that is
~34 MB a layer the memory could move. This variant launches one more kernel after each QKV GEMV
that asks L2 for o_proj's weights (6.6 MB) and the first rows of gate and up
(`cp.async.bulk.prefetch.L2.global`: the copy engine reads the bytes into L2 and returns nothing to
the SM), so those GEMVs find part of their weights in L2. Which rows: gate_up's warps take tiles
(one gate row and one up row) round-robin, so the first rows in memory are those every warp reads
first. The kernel issues its prefetches, lets attention start (launch_dependents) and waits for
the QKV GEMV, so attention's wait still covers the QKV GEMV (docs/DECODE.md, "Execution model").

Predicted: gate_up is close to its instruction limit (fixed16, 87% of the copy rate), o_proj's
weights are mostly in flight before its wait, so the gain is what gate_up's stream saves of its
~19 us: up to ~24 MB / 4.3 TB/s = 5.6 us a layer if L2 served those bytes for free, ~1-2 us a layer
more likely; the risk is attention's KV loads queuing behind the prefetches.

Measured on an H100 (docs/PERFORMANCE.md, "L2 prefetches during decode attention"): slower in
every form. The extra launch alone costs 0.7 us a layer, o_proj's 6.6 MB 3 us more, and every
further megabyte adds (1.739 ms a token at 512 tokens of context without it, 1.838 with o_proj,
1.905 with o_proj and 40 MB). Not in the product.

    python dev/l2_prefetch_decode.py [--contexts 512,4096] [--megabytes 8,16,24]

For each variant it runs greedy decode and compares the tokens with the product's (the prefetch
changes no value, so any difference is a bug; no float64 check is needed for that), then prints
the ITL at each context: "product" (no extra kernel), "empty" (the extra kernel asking for
nothing: its launch's cost), and the prefetch of o_proj plus N MB of gate/up rows.
"""

from __future__ import annotations

import argparse

import numpy as np
from numba import cuda, types
from numba.cuda.extending import intrinsic

from harness import print_table
from pynanoqwen.bench import time_generation
from pynanoqwen.config import GROUP_SIZE
from pynanoqwen.engine import CudaBackend
from pynanoqwen.engine import schedule
from pynanoqwen.engine.capture import GraphCache
from pynanoqwen.launch import launch
from pynanoqwen.ptx.griddep import grid_dependency_wait, launch_dependents
from pynanoqwen.ptx.mbarrier import inline_ptx
from pynanoqwen.sampling import SamplingParams
from pynanoqwen.synthetic import SyntheticWeights

CHUNK = 16 * 1024  # bytes a prefetch instruction asks for
THREADS = 32  # a block's prefetching threads: one chunk each


@intrinsic
def prefetch_l2(typingctx, address, nbytes):
    """`cp.async.bulk.prefetch.L2.global [address], nbytes;` (PTX ISA: cp.async.bulk.prefetch;
    sm_90): address 16-byte aligned, nbytes a multiple of 16."""
    if not (isinstance(address, types.Integer) and isinstance(nbytes, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        addr = context.cast(builder, args[0], sig.args[0], types.uint64)
        size = context.cast(builder, args[1], sig.args[1], types.uint32)
        inline_ptx(builder, "cp.async.bulk.prefetch.L2.global [$0], $1;", "l,r,~{memory}", [addr, size])
        return context.get_dummy_value()

    return types.void(address, nbytes), codegen


@cuda.jit
def prefetch_kernel(addresses, sizes, count):
    i = cuda.grid(1)
    if i < count:
        prefetch_l2(addresses[i], sizes[i])
    launch_dependents()
    grid_dependency_wait()  # attention's wait must still mean "the QKV GEMV has completed"


def address(array) -> int:
    return array.__cuda_array_interface__["data"][0]


def chunks(start: int, nbytes: int) -> list[tuple[int, int]]:
    return [(at, min(CHUNK, start + nbytes - at)) for at in range(start, start + nbytes, CHUNK)]


class Prefetch:
    """The extra launch of one layer: its chunk table on the device."""

    def __init__(self, layer, megabytes: float, prefetch_o: bool):
        o, gu = layer.o_proj, layer.gate_up
        table = []
        if prefetch_o:
            table += chunks(address(o.qweight), o.qweight.nbytes) + chunks(address(o.scales), o.scales.nbytes)
        row_bytes = gu.k // 2 + 2 * gu.k // GROUP_SIZE
        rows = min(gu.n, int(megabytes * 1e6 / (2 * row_bytes)) // 64 * 64)
        for q, s in ((gu.gate_q, gu.gate_s), (gu.up_q, gu.up_s)):
            if rows:
                table += chunks(address(q), rows * gu.k // 2) + chunks(address(s), rows * 2 * gu.k // GROUP_SIZE)
        self.count, self.bytes = len(table), sum(n for _, n in table)
        table = table or [(0, 0)]  # an empty table: the kernel issues nothing (its launch cost alone)
        self.addresses = cuda.to_device(np.array([a for a, _ in table], np.uint64))
        self.sizes = cuda.to_device(np.array([n for _, n in table], np.uint32))

    def launch(self, stream):
        blocks = max(1, -(-self.count // THREADS))
        launch(prefetch_kernel, (blocks,), (THREADS,), stream, (self.addresses, self.sizes, np.int32(self.count)))


PRODUCT_LAYER_LAUNCHES = schedule.layer_launches  # what each variant's schedule wraps


def set_variant(backend, variant):
    """Rebuild the decode step's launch lists with `variant` (None, or (megabytes, prefetch_o))
    after each QKV GEMV, and capture them again."""
    prefetches = [Prefetch(layer, *variant) for layer in backend.weights.layers] if variant else None

    def layer_launches(ops, index):
        launches = PRODUCT_LAYER_LAUNCHES(ops, index)
        if prefetches is None or type(ops) is not schedule.DecodeOps:
            return launches
        p = prefetches[index]
        extra = schedule.Launch("prefetch", index, p.launch, (), {}, {}, 0, "l2 prefetch")
        at = [launch.stage for launch in launches].index("qkv") + 1
        return launches[:at] + [extra] + launches[at:]

    schedule.layer_launches = layer_launches
    backend.steps = {key: schedule.forward_launches(backend.ops, *key) for key in backend.steps}
    backend.graphs.close()
    backend.graphs = GraphCache(backend.stream)
    for method in {m for m, _ in backend.steps}:
        backend.reset([0], SamplingParams(temperature=1.0, top_k=2))
        schedule.run_all(backend.steps[method, True], backend.stream)
    backend.stream.synchronize()
    for key, launches in backend.steps.items():
        backend.graphs.capture(key, launches)
    return sum(p.bytes for p in prefetches) / len(prefetches) if prefetches else 0


VARIANTS = {"product": None, "empty": (0, False), "o_proj": (0, True)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", default="512,4096")
    parser.add_argument("--megabytes", default="8,16,24,32,40")
    parser.add_argument("--gen", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    variants = dict(VARIANTS)
    for mb in args.megabytes.split(","):
        if mb.strip():
            variants[f"o_proj + {mb} MB gate/up"] = (float(mb), True)
    backend = CudaBackend(SyntheticWeights("7b", seed=0), max_context=max(contexts) + args.gen + 16)
    rng = np.random.default_rng(0)
    prompts = {c: rng.integers(0, 4000, c).tolist() for c in contexts}
    tokens, rows = {}, []
    for name, variant in variants.items():
        per_layer = set_variant(backend, variant)
        row = {"variant": name, "MB a layer": per_layer / 1e6}
        for c, prompt in prompts.items():
            out = [t for t in backend.generate(prompt, SamplingParams(), args.gen, frozenset())]
            tokens.setdefault(c, out)
            row[f"same tokens {c}"] = out == tokens[c]
            gaps = [g for _ in range(args.repeats) for g in time_generation(backend, prompt, args.gen)[1]]
            row[f"ITL {c} ms"] = float(np.median(gaps))
            row[f"p10-p90 {c}"] = f"{np.percentile(gaps, 10):.3f}-{np.percentile(gaps, 90):.3f}"
        rows.append(row)
        print(row, flush=True)
    print_table("decode ITL with L2 prefetches after each QKV GEMV (synthetic 7B, graph mode)", rows)


if __name__ == "__main__":
    main()

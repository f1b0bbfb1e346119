"""One call of the TMA-fed prefill GEMM at a Qwen2.5-7B linear, checked against float64: a target for compute-sanitizer.

The kernel (kernels/gemm_int4_tma.py) brought new kinds of synchronisation into the product:
tensor-map copies (`cp.async.bulk.tensor.2d`) that complete on a stage's `full` mbarrier, and the
consumers' releases on its `empty` mbarrier before thread 0 refills the stage. The default case,
300 rows of o_proj (its residual epilogue), has a last token tile of 44 real rows (the copies
fill the rest with zeros) and 112 k tiles a block, so every one of the 4 stages is refilled 27
times: the reuse racecheck needs; `--linear down_proj` adds the K chunks' workspace. Exit status 0 when every output is within oracles.gemm_oracle's
bound of float64, 1 when one is not.

    compute-sanitizer --tool memcheck  python scripts/gemm_sanitize.py
    compute-sanitizer --tool racecheck python scripts/gemm_sanitize.py
    compute-sanitizer --tool synccheck python scripts/gemm_sanitize.py --linear gate_up
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from numba import cuda

from pynanoqwen.bench_kernels import random_int4
from pynanoqwen.config import PRESETS
from pynanoqwen.kernels.gemm_int4 import make_gate_up_silu_gemm, make_gemm_int4
from pynanoqwen.kernels.gemm_int4_tma import TMA_T256
from pynanoqwen.oracles import bound_report, gemm_epilogue_oracle

EPILOGUES = {name: epilogue for name, _, _, epilogue in PRESETS["7b"].engine_linears}
SHAPES = {name: (n, k) for name, n, k, _ in PRESETS["7b"].engine_linears}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--linear", choices=list(SHAPES), default="o_proj",
                        help="the 7B linear (down_proj: K in 4 chunks, their totals in a workspace)")
    parser.add_argument("--rows", type=int, default=300, help="activation rows M")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = np.random.default_rng(args.seed)
    (n, k), epilogue = SHAPES[args.linear], EPILOGUES[args.linear]
    weights = [random_int4(rng, n, k) for _ in range(2 if epilogue == "gate_up_silu" else 1)]
    x = rng.standard_normal((args.rows, k)).astype(np.float16)
    start = rng.standard_normal((args.rows, n)) if epilogue == "residual" else np.zeros((args.rows, n))
    start = start.astype(np.float16 if epilogue == "gate_up_silu" else np.float32)
    bias = rng.standard_normal(n).astype(np.float16) if epilogue == "bias" else None
    device = [tuple(cuda.to_device(a) for a in w) for w in weights]
    out = cuda.to_device(start)
    stream = cuda.stream()
    if epilogue == "gate_up_silu":
        make_gate_up_silu_gemm(n, k, *device[0], *device[1], tiles=TMA_T256).launch(stream, cuda.to_device(x), out,
                                                                                   args.rows)
    else:
        make_gemm_int4(n, k, *device[0], bias=None if bias is None else cuda.to_device(bias),
                       tiles=TMA_T256).launch(stream, cuda.to_device(x), out, args.rows,
                                              residual=epilogue == "residual")
    got = out.copy_to_host(stream=stream).astype(np.float64)
    stream.synchronize()

    expected, bound = gemm_epilogue_oracle(weights, x, epilogue, start, bias)
    check = bound_report(f"TMA GEMM {args.linear} {n}x{k}, {args.rows} rows", np.abs(got - expected), bound)
    print(f"{check.name}: {check.status} ({check.detail})")
    return 0 if check.status == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())

"""RMSNorm as a kernel of its own before the GEMVs that read it, against the product's fused norm.

The product's QKV, gate-up and INT4 lm_head GEMVs (pynanoqwen/kernels/gemv_int4.py, prmt path)
compute RMSNorm(h) * weight themselves while staging their activations, so a decode step launches
no norm kernel (57 fewer launches at 7B). The unfused form, what the engine ran before (its
`fused_norm=False`): kernels/rmsnorm.py writes xn = float16(RMSNorm(h) * weight), then the GEMV
reads xn. Fused, each launch in isolation was slower for gate_up and the lm_head, yet the whole step
was ~125 us faster (docs/PERFORMANCE.md): the dependent launches and their gaps left the graph.
This harness checks both forms against float64 and times both at the 7B shapes:

    python dev/unfused_norm.py
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from harness import SEVEN_B, random_int4, run
from pynanoqwen.gpu_timing import time_graph, weight_copies
from pynanoqwen.kernels.gemv_int4 import gemv_bytes, make_gate_up_silu, make_gemv_int4
from pynanoqwen.kernels.rmsnorm import make_rmsnorm
from pynanoqwen.oracles import U32, bound_report, gemv_oracle, rmsnorm_oracle, silu_product_oracle

H, EPS = SEVEN_B.hidden_size, SEVEN_B.rms_norm_eps
SHAPES = {"qkv": SEVEN_B.q_size + 2 * SEVEN_B.kv_size, "gate_up": SEVEN_B.intermediate_size,
          "lm_head": SEVEN_B.vocab_size}


def build(name: str, n: int, weights, norm_weight, fused: bool):
    """(launch(stream, h, out), out dtype) of one form: the fused GEMV, or rmsnorm + the plain GEMV."""
    norm = dict(norm_weight=norm_weight, norm_eps=EPS) if fused else {}
    if name == "gate_up":
        gemv, dtype = make_gate_up_silu(n, H, *weights[0], *weights[1], **norm), np.float16
    else:
        gemv, dtype = make_gemv_int4(n, H, *weights[0], **norm), np.float32
    if fused:
        return gemv.launch, dtype
    rmsnorm, xn = make_rmsnorm(H, EPS), cuda.device_array(H, np.float16)

    def launch(stream, h, out):
        rmsnorm.launch(stream, h, norm_weight, xn)
        gemv.launch(stream, xn, out)

    return launch, dtype


def check(rng):
    results = []
    for name, n in SHAPES.items():
        weights = [random_int4(rng, n, H) for _ in range(2 if name == "gate_up" else 1)]
        norm_weight = rng.uniform(0.5, 1.5, H).astype(np.float16)
        h = (3 * rng.standard_normal(H)).astype(np.float32)
        xn, xn_bound = rmsnorm_oracle(h, norm_weight, EPS)  # the GEMV reads xn within this of the exact
        oracles = [gemv_oracle(*w, xn, "prmt", xn_bound) for w in weights]
        if name == "gate_up":
            expected, bound = silu_product_oracle(*oracles[0], *oracles[1])
        else:
            expected, bound = oracles[0]
            bound = bound + U32 * np.abs(expected)
        for fused in (True, False):
            launch, dtype = build(name, n, [tuple(cuda.to_device(a) for a in w) for w in weights],
                                  cuda.to_device(norm_weight), fused)
            out = cuda.device_array(n, dtype)
            stream = cuda.stream()
            launch(stream, cuda.to_device(h), out)
            stream.synchronize()
            results.append(bound_report(f"{'fused' if fused else 'rmsnorm + gemv'} {name}",
                                        np.abs(out.copy_to_host().astype(np.float64) - expected), bound))
    return results


def timings(replays: int = 20) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for name, n in SHAPES.items():
        matrices = 2 if name == "gate_up" else 1
        copies = weight_copies(matrices * gemv_bytes(n, H))
        row = {"gemv": name}
        for fused in (True, False):
            launches = []
            for _ in range(copies):
                weights = [tuple(cuda.to_device(a) for a in random_int4(rng, n, H)) for _ in range(matrices)]
                launches.append(build(name, n, weights, cuda.to_device(np.ones(H, np.float16)), fused))
            stream = cuda.stream()
            h = cuda.to_device(rng.standard_normal(H).astype(np.float32), stream=stream)
            out = cuda.device_array(n, launches[0][1])
            calls = max(copies, 32)
            seconds = time_graph(stream, lambda: [launches[c % copies][0](stream, h, out) for c in range(calls)],
                                 replays) / calls
            row["fused us" if fused else "rmsnorm + gemv us"] = 1e6 * seconds
        rows.append(row)
    return rows


if __name__ == "__main__":
    run(check, timings, "RMSNorm fused into the GEMV against rmsnorm + GEMV (us per call)")

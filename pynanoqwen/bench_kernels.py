"""bench's per-kernel tables: the engine's stages and single kernels, each timed alone inside CUDA
graphs between events (gpu_timing), where bench.py times the engine end to end; bench.run_bench runs
them and bench_report renders them. Split from bench.py, which had reached the 500-line limit.

- Kernel breakdown (`kernel_breakdown`): each kernel type of one decode step, with all its launches
  of the step, replayed inside its own CUDA graph between events; `share` is its time over the sum
  of all types, and `kernel_summary` sets that sum against the graph ITL.
- Prefill kernels (`prefill_kernel_breakdown`): one prefill chunk of 512 and of 2048 rows
  (PREFILL_KERNEL_ROWS, those that are buckets of the engine), each stage with all its launches
  replayed in its own graph as the decode breakdown does, on random token ids as a prompt has;
  their sum against the TTFT of that many tokens says how much of a prompt's time lies between the
  kernels (dev/prefill_stages.py takes that apart).
- GEMV table (`gemv_paths`): both INT4 paths at every linear shape of the model, rotating weight
  copies larger than the L2 so that every call reads HBM.
- GEMM table (`gemm_tiles`): the tensor-core INT4 GEMM of each linear at M = 512 and 2048 with every
  tile shape (kernels/gemm_int4.py), TFLOP/s, rotating weight copies as the GEMV table does;
  `default` marks the tile the engine uses.
- Prefill attention (`prefill_attention_table`): one layer's causal attention for each prompt length
  of the prefill sweep, in the engine's chunks.

The breakdowns need the engine (a CudaBackend); the tables build their kernels on random weights
(`random_int4`), after bench has given the engine's memory back. TFLOP/s figures, here and in
bench's prefill sweep, are set against PEAK_TFLOPS.
"""

from __future__ import annotations

import numpy as np

from .config import ModelConfig
from .kernels import PAGE_SIZE
from .sampling import SamplingParams

PEAK_TFLOPS = 790.0  # dense bf16 matrix product through PyTorch on the H200 (docs/HARDWARE.md)
PREFILL_KERNEL_ROWS = (512, 2048)  # the chunks whose stages the prefill breakdown times


def kernel_breakdown(backend, context: int) -> list[dict]:
    """One decode step's stages, each timed in its own graph (engine.probes.kernel_groups)."""
    return time_groups(backend, backend.kernel_groups(context))


def prefill_kernel_breakdown(backend, rows: int) -> list[dict]:
    """One prefill chunk's stages at `rows` tokens, each timed in its own graph
    (engine.probes.prefill_kernel_groups)."""
    return time_groups(backend, backend.prefill_kernel_groups(rows))


def time_groups(backend, groups) -> list[dict]:
    """us (and GB/s of the bytes they must move) of each group of launches, replayed in a graph of
    its own; the engine reset after each (the groups write the KV cache)."""
    from .gpu_timing import time_graph

    rows = []
    for name, enqueue, launches, nbytes in groups:
        seconds = time_graph(backend.stream, enqueue)
        rows.append({"name": name, "launches": launches, "us": seconds * 1e6, "bytes": nbytes,
                     "gbs": nbytes / seconds / 1e9 if nbytes else None})
        backend.reset([0], SamplingParams())
    total = sum(r["us"] for r in rows)
    for r in rows:
        r["share"] = r["us"] / total
    return rows


def kernel_summary(kernels: list[dict], itl_ms: float, cfg: ModelConfig) -> dict:
    """Launches of one decode step (page_alloc runs once every PAGE_SIZE steps and is counted as
    its share) and the bubble: the graph ITL minus the sum of the kernel groups' own times, each
    group timed back to back in its own graph (time the step's kernels do not account for)."""
    kernel_us = sum(k["us"] for k in kernels)
    return {"launches_per_step": sum(k["launches"] for k in kernels) + 1 / PAGE_SIZE,
            "kernel_us": kernel_us, "itl_us": 1e3 * itl_ms, "bubble_us": 1e3 * itl_ms - kernel_us}


def random_int4(rng, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Random packed words and FP16 scales of an N x K linear (speed does not depend on values)."""
    return (rng.integers(0, 2**32, (n, k // 8), dtype=np.uint32),
            rng.uniform(0.005, 0.02, (n, k // 128)).astype(np.float16))


def gemv_paths(cfg: ModelConfig) -> list[dict]:
    """Every GEMV path at each linear shape of `cfg` (random weights: speed does not depend on values)."""
    from .gpu_timing import time_gemv
    from .kernels.gemm_int4_tiles import matrices_of
    from .kernels.gemv_int4 import PATHS, gemv_bytes, make_gate_up_silu, make_gemv_int4

    rng = np.random.default_rng(0)
    rows = []
    for name, n, k, epilogue in cfg.engine_linears + [("lm_head", cfg.vocab_size, cfg.hidden_size, "plain")]:
        matrices = matrices_of(epilogue)
        weights = [random_int4(rng, n, k) for _ in range(matrices)]
        nbytes = matrices * gemv_bytes(n, k)
        row = {"name": name, "n": n, "k": k}
        for path in PATHS:
            if matrices == 2:
                (gq, gs), (uq, us) = weights
                build = lambda p=path: make_gate_up_silu(n, k, gq, gs, uq, us, path=p)  # noqa: E731
                out_dtype = np.float16
            else:
                build = lambda p=path: make_gemv_int4(n, k, *weights[0], path=p)  # noqa: E731
                out_dtype = np.float32
            seconds = time_gemv(build, nbytes, out_dtype)
            row[f"{path}_us"], row[f"{path}_gbs"] = seconds * 1e6, nbytes / seconds / 1e9
        rows.append(row)
    return rows


def gemm_tiles(cfg: ModelConfig, ms: tuple[int, ...] = (512, 2048), tiles_to_try=None) -> list[dict]:
    """TFLOP/s of the INT4 GEMM of each linear of `cfg` at each M in `ms` with each tile shape it
    can take (gemm_int4.candidate_tiles, or those of `tiles_to_try` that fit), in CUDA graphs;
    enough weight copies are rotated that each call reads its weights from HBM, as a prefill does
    layer after layer. `default` marks the tile the engine picks (gemm_int4.default_tiles_for)."""
    from numba import cuda

    from .gpu_timing import time_graph, weight_copies
    from .kernels.gemm_int4 import gemm_flops, make_gate_up_silu_gemm, make_gemm_int4
    from .kernels.gemm_int4_tiles import TILE_NAMES, candidate_tiles, default_tiles_for, matrices_of

    rng = np.random.default_rng(0)
    stream = cuda.stream()
    rows = []
    for name, n, k, epilogue in cfg.engine_linears:
        matrices = matrices_of(epilogue)
        copies = weight_copies(matrices * (n * k // 2 + n * k // 64))
        weights = [[tuple(cuda.to_device(a) for a in random_int4(rng, n, k)) for _ in range(matrices)]
                   for _ in range(copies)]
        bias = cuda.to_device(rng.standard_normal(n).astype(np.float16)) if epilogue == "bias" else None
        extra = {"residual": True} if epilogue == "residual" else {}
        for tiles in candidate_tiles(n, k, epilogue, tiles_to_try):
            gemms = [make_gate_up_silu_gemm(n, k, *w[0], *w[1], tiles=tiles) if matrices == 2
                     else make_gemm_int4(n, k, *w[0], bias=bias, tiles=tiles) for w in weights]
            for m in ms:
                x = cuda.to_device(rng.standard_normal((m, k)).astype(np.float16), stream=stream)
                out = cuda.to_device(np.zeros((m, n), np.float16 if matrices == 2 else np.float32), stream=stream)
                calls = max(copies, 8)
                seconds = time_graph(stream, lambda: [gemms[c % copies].launch(stream, x, out, m, **extra)
                                                      for c in range(calls)], replays=5) / calls
                rows.append({"name": name, "n": n, "k": k, "m": m, "tile": TILE_NAMES.get(tiles, str(tiles)),
                             "default": tiles == default_tiles_for(m, n, k, epilogue), "us": seconds * 1e6,
                             "tflops": gemm_flops(m, n, k, matrices) / seconds / 1e12, "peak_tflops": PEAK_TFLOPS})
    return sorted(rows, key=lambda r: r["m"])


def prefill_attention_table(cfg: ModelConfig, lengths, chunk_rows: int, launches: int = 2) -> list[dict]:
    """Causal prefill attention of one layer for a prompt of each length, run as the engine runs it:
    one kernel with M_cap = chunk_rows over the chunks of engine.backend.prompt_chunks, on a paged
    K/V pool of random FP16 (speed does not depend on values) behind a shuffled page table. Each
    chunk is timed in a CUDA graph of `launches` launches; a prompt's figure is the sum over its
    chunks: us a layer, TFLOP/s of the causal work (kernels.attention_prefill.attention_flops)."""
    from numba import cuda

    from .engine.backend import prompt_chunks
    from .gpu_timing import time_graph
    from .kernels.attention_prefill import attention_flops, make_prefill_attention

    rng = np.random.default_rng(0)
    stream = cuda.stream()
    heads, kv_heads, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    pages = -(-max(lengths) // PAGE_SIZE)
    attention = make_prefill_attention(heads, kv_heads, hd, pages)
    pool = [cuda.to_device(rng.standard_normal((pages, kv_heads, PAGE_SIZE, hd)).astype(np.float16))
            for _ in range(2)]
    table = cuda.to_device(rng.permutation(pages).astype(np.int32))
    q = cuda.to_device(rng.standard_normal((chunk_rows, heads, hd)).astype(np.float32))
    out = cuda.device_array((chunk_rows, heads * hd), np.float16)
    timed = {}
    rows = []
    for tokens in lengths:
        chunks = prompt_chunks(tokens, chunk_rows)
        for start, m in chunks:
            if (start, m) not in timed:
                bounds = [cuda.to_device(np.array([v], np.int32)) for v in (start, m)]
                enqueue = lambda b=bounds: [attention.launch(stream, q, *pool, table, *b, out)  # noqa: E731
                                            for _ in range(launches)]
                timed[start, m] = time_graph(stream, enqueue, replays=3) / launches
        seconds = sum(timed[c] for c in chunks)
        flops = sum(attention_flops(start, m, heads, hd) for start, m in chunks)
        rows.append({"tokens": tokens, "chunks": len(chunks), "us_per_layer": seconds * 1e6,
                     "ms_all_layers": seconds * 1e3 * cfg.num_layers, "tflops": flops / seconds / 1e12,
                     "peak_tflops": PEAK_TFLOPS})
    return rows

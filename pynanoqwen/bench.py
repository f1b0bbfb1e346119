"""`python -m pynanoqwen bench`: how fast the GPU engine runs, measured the way METHOD.md asks.

Protocol (the seed runtime's): batch 1, a `prompt_tokens`-token prompt, `gen_tokens` generated
greedily, `repeats` timed runs after one warm-up. What each figure means:

- TTFT: host wall clock from the call to generate() to the first token in host memory: the batched
  prefill (tensor-core GEMMs, replayed as CUDA graphs per prompt-length bucket) plus the first
  sampled token.
- ITL: host wall clock between consecutive tokens of one run. The engine enqueues step p + 1
  before waiting for the token of step p, so in steady state this is the GPU time of one step.
- Sampled: the graph-mode run again with Qwen2.5-Instruct's sampling defaults (temperature 0.7,
  top-k 20, top-p 0.8: the candidates sampler) instead of greedy argmax.
- GB/s: bytes one decode step must read (every INT4 weight and scale, norms, the lm_head, one
  embedding row, and the KV cache at the mean context of the run) over the median ITL, and its
  share of a device-to-device copy measured in the same run (bytes read + written).
- Prefill sweep: TTFT of prompts of 16, 128, 512, 2048, 8192 and 32000 tokens (the longer ones run
  in chunks of 2048; 16 is the largest chunk on the SMALL mma.sync tiles, and about the rows of a
  prompt-lookup verify pass), as prompt tokens per second and as TFLOP/s (`prefill_flops`: the
  linears at every row, causal attention, the lm_head for the last row) against the ~790 TFLOP/s
  the H200 reaches in dense bf16 (bench_kernels.PEAK_TFLOPS).
- Prefix cache: TTFT of a 4006-token prompt whose first 3990 tokens an earlier request left in the
  prefix cache (an editor's /infill after one edited line), as serve's engine runs it but without
  HTTP, next to a prompt of only the tokens it computed (`prefix_cache_ttft`).
- Per-kernel tables: the decode step's and a prefill chunk's kernel breakdowns and the GEMV, GEMM
  and prefill-attention tables are timed in bench_kernels.py, whose docstring says what each figure
  means (the tables and PEAK_TFLOPS moved there from this module).

Nothing here changes clocks or needs root; GPU name, driver and clocks come from nvidia-smi.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import subprocess
import time
from pathlib import Path

import numpy as np

from . import bench_report, device
from .bench_kernels import PEAK_TFLOPS, PREFILL_KERNEL_ROWS, gemm_tiles, gemv_paths, kernel_breakdown, \
    kernel_summary, prefill_attention_table, prefill_kernel_breakdown
from .checkpoint import QWEN_SAMPLING
from .config import ModelConfig, preset
from .errors import NanoQwenError
from .fileformat import NanoQwenFile
from .kernels import GEMV_PATHS
from .sampling import SamplingParams


# The sampled run: Qwen2.5-Instruct's sampling, whose top-k / top-p take the candidates sampler.
SAMPLED = SamplingParams(**QWEN_SAMPLING, seed=1)
MIN_TOKENS_FOR_ITL = 3  # a run's first gap overlaps the next step's launch (BenchSettings.validate)


@dataclasses.dataclass(frozen=True)
class BenchSettings:
    model: str | None = None  # a .nanoqwen path, or None with `synthetic`
    synthetic: str | None = None  # a preset name: random weights in the exact layout, no file
    prompt_tokens: int = 512
    gen_tokens: int = 128
    repeats: int = 5
    eager_tokens: int = 16
    gemv: str = "auto"
    baseline: str | None = None  # "torch"
    kernels: bool = True
    gemv_paths: bool = True
    prefill_lengths: tuple[int, ...] = (16, 128, 512, 2048, 8192, 32000)  # () skips; lengths past the model's context too
    gemm_tiles: bool = True
    contexts: tuple[int, ...] = (512, 4096, 16384, 32000)  # decode ITL sweep; () skips; past the context too
    seed: int = 0

    CONTEXT_GEN_TOKENS = 32  # tokens generated per run of the context sweep
    EAGER_PROMPT_TOKENS = 16  # the prompt of the eager run: the first tokens of the graph run's

    def validate(self) -> "BenchSettings":
        if (self.model is None) == (self.synthetic is None):
            raise NanoQwenError("give exactly one of --model FILE and --synthetic PRESET")
        for name in ("prompt_tokens", "gen_tokens", "repeats", "eager_tokens"):
            if getattr(self, name) < 1:
                raise NanoQwenError(f"--{name.replace('_', '-')} must be at least 1")
        # The engine enqueues step p + 1 before it waits for token p, so the first gap of a run
        # only measures the host: an interval needs three tokens at least (two gave "0.005 ms").
        for name in ("gen_tokens", "eager_tokens"):
            if getattr(self, name) < MIN_TOKENS_FOR_ITL:
                raise NanoQwenError(f"--{name.replace('_', '-')} must be at least {MIN_TOKENS_FOR_ITL}: the first "
                                    "gap of a run overlaps the next step's launch, so fewer give no interval")
        if any(c < 1 for c in self.contexts) or any(n < 1 for n in self.prefill_lengths):
            raise NanoQwenError("--contexts and the prefill lengths must be positive token counts")
        if self.gemv not in GEMV_PATHS:
            raise NanoQwenError(f"--gemv must be {' or '.join(GEMV_PATHS)}, got {self.gemv!r}")
        if self.baseline not in (None, "torch"):
            raise NanoQwenError(f"--baseline must be torch, got {self.baseline!r}")
        # An unknown preset, a missing or malformed file and runs longer than the model's context
        # are refused before the GPU is looked for (the sweeps are cut to fit, the timed runs are not).
        model_context = (preset(self.synthetic) if self.synthetic is not None
                         else _file_config(self.model)).max_position_embeddings
        needed = self.fitting(model_context).max_context
        if needed > model_context:
            raise NanoQwenError(f"the timed runs need a context of {needed} positions (--prompt-tokens + --gen-tokens, "
                                f"or {self.EAGER_PROMPT_TOKENS} + --eager-tokens, and 16 to spare), more than the "
                                f"model's {model_context}")
        return self

    def fitting(self, model_context: int) -> "BenchSettings":
        """These settings without the sweep points a model of `model_context` positions cannot hold."""
        room = model_context - 16
        return dataclasses.replace(
            self, prefill_lengths=tuple(n for n in self.prefill_lengths if n <= room),
            contexts=tuple(c for c in self.contexts if c + self.CONTEXT_GEN_TOKENS <= room))

    @property
    def max_context(self) -> int:
        return max(self.prompt_tokens + self.gen_tokens, min(self.prompt_tokens, self.EAGER_PROMPT_TOKENS)
                   + self.eager_tokens, *self.prefill_lengths,
                   *(c + self.CONTEXT_GEN_TOKENS for c in self.contexts), 0) + 16


def gpu_info() -> dict:
    """Name, driver and current SM/memory clocks (MHz) from nvidia-smi; {} where it is missing."""
    try:
        line = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=20,
                              check=True).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return {}
    name, driver, sm, mem = (part.strip() for part in line.split(","))
    return {"name": name, "driver": driver, "clocks": f"{sm}/{mem}"}


def git_commit() -> str:
    """The commit benchmarked: $PYNANOQWEN_COMMIT when set (the GPU machine's copy of the tree has
    no trustworthy .git, so whoever starts the run passes the commit), else git's."""
    if os.environ.get("PYNANOQWEN_COMMIT"):
        return os.environ["PYNANOQWEN_COMMIT"]
    try:
        here = Path(__file__).resolve().parent
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def time_generation(backend, prompt: list[int], gen_tokens: int, params: SamplingParams = SamplingParams()
                    ) -> tuple[float, list[float], float]:
    """One run (greedy by default): (TTFT ms, inter-token gaps in ms, total ms); no stop tokens."""
    stamps = []
    start = time.perf_counter()
    for _ in backend.generate(prompt, params, gen_tokens, frozenset()):
        stamps.append(time.perf_counter())
    gaps = [1e3 * (b - a) for a, b in zip(stamps, stamps[1:])]
    return 1e3 * (stamps[0] - start), gaps, 1e3 * (stamps[-1] - start)


def measure_mode(backend, prompt, gen_tokens, repeats, bytes_per_step, copy_gbs,
                 params: SamplingParams = SamplingParams()) -> dict:
    time_generation(backend, prompt, gen_tokens, params)  # warm-up
    ttfts, gaps, totals = [], [], []
    for _ in range(repeats):
        ttft, run_gaps, total = time_generation(backend, prompt, gen_tokens, params)
        ttfts.append(ttft)
        gaps += run_gaps
        totals.append(total)
    itl = bench_report.summarize(gaps)
    return {"ttft_ms": bench_report.summarize(ttfts), "itl_ms": itl,
            "decode_tok_s": 1e3 / itl["median"],
            "e2e_tok_s": gen_tokens / (float(np.median(totals)) / 1e3),
            **bench_report.bandwidth(bytes_per_step, itl["median"], copy_gbs and copy_gbs * 1e9)}


def run_bench(settings: BenchSettings, progress=print) -> dict:
    """Every measurement of the docstring; returns a result dict (bench_report's schema)."""
    settings.validate()  # every setting first, the hardware after
    if not device.cuda_gpu_available():
        raise NanoQwenError("bench needs an NVIDIA GPU of compute capability 9.0 (H100/H200); none was found")
    from .engine import CudaBackend
    from .gpu_timing import copy_bandwidth

    model_context = (preset(settings.synthetic) if settings.synthetic else _file_config(settings.model)) \
        .max_position_embeddings
    settings = settings.fitting(model_context)
    started = gpu_info()
    progress("measuring device-to-device copy bandwidth")
    copy_gbs = copy_bandwidth() / 1e9
    source = settings.model
    if settings.synthetic:
        from .synthetic import SyntheticWeights

        source = SyntheticWeights(settings.synthetic, seed=settings.seed, progress=True)
    progress(f"loading {settings.model or 'synthetic ' + settings.synthetic} onto the GPU")
    backend = CudaBackend(source, max_context=settings.max_context, gemv=settings.gemv)
    cfg = backend.config
    rng = np.random.default_rng(settings.seed)
    prompt = rng.integers(0, min(cfg.vocab_size, 4000), settings.prompt_tokens).tolist()
    context = settings.prompt_tokens + settings.gen_tokens // 2  # the mean context of a run
    per_step = backend.bytes_per_step(context)
    by = {"weights": backend.weight_bytes_per_step, "kv": per_step - backend.weight_bytes_per_step,
          "context": context}

    progress(f"graph mode: {settings.repeats} x ({settings.prompt_tokens} + {settings.gen_tokens} tokens)")
    graph = measure_mode(backend, prompt, settings.gen_tokens, settings.repeats, per_step, copy_gbs)
    progress(f"graph mode, sampled ({SAMPLED.temperature}, top-k {SAMPLED.top_k}, top-p {SAMPLED.top_p}): "
             f"{settings.repeats} x ({settings.prompt_tokens} + {settings.gen_tokens} tokens)")
    sampled = measure_mode(backend, prompt, settings.gen_tokens, settings.repeats, per_step, copy_gbs, SAMPLED)
    progress(f"eager mode: {settings.eager_tokens} tokens")
    backend.eager = True
    eager = measure_mode(backend, prompt[:settings.EAGER_PROMPT_TOKENS], settings.eager_tokens, 1, per_step,
                         copy_gbs)
    backend.eager = False
    result = {
        "settings": {"model": settings.model or f"synthetic:{settings.synthetic}",
                     "prompt_tokens": settings.prompt_tokens, "gen_tokens": settings.gen_tokens,
                     "repeats": settings.repeats, "gemv": settings.gemv, "git_commit": git_commit(),
                     "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
        "config": dataclasses.asdict(cfg),
        "bytes": by, "graph": graph, "sampled": sampled, "eager": eager,
        "graph_over_eager": eager["itl_ms"]["median"] / graph["itl_ms"]["median"],
        "peak_memory_gib": backend.device_memory_used() / 2**30,
    }
    if settings.contexts:
        progress(f"decode at contexts {', '.join(map(str, settings.contexts))}")
        result["decode_contexts"] = context_sweep(backend, settings, rng, copy_gbs)
    if settings.kernels:
        progress("per-kernel breakdown")
        result["kernels"] = kernel_breakdown(backend, context)
        result["kernel_summary"] = kernel_summary(result["kernels"], graph["itl_ms"]["median"], cfg)
    if settings.prefill_lengths:
        progress(f"prefill sweep: {', '.join(map(str, settings.prefill_lengths))} tokens")
        result["prefill"] = prefill_sweep(backend, settings.prefill_lengths, settings.repeats, rng)
        chunks = [rows for rows in PREFILL_KERNEL_ROWS if rows in backend.prefill_buckets]
        if chunks:
            progress(f"per-kernel breakdown of one prefill chunk of {' and '.join(map(str, chunks))} rows")
            try:  # a failure costs this table, not the run
                result["prefill_kernels"] = [{"rows": rows, "kernels": prefill_kernel_breakdown(backend, rows)}
                                             for rows in chunks]
            except Exception as failure:
                result["prefill_kernels_error"] = f"{type(failure).__name__}: {failure}"
                progress(f"prefill breakdown failed: {result['prefill_kernels_error']}")
                backend.reset([0], SamplingParams())
        if backend.max_context > PREFIX_CONTEXT:
            progress(f"prefix cache: {PREFIX_CONTEXT} prompt tokens, the last {PREFIX_CHANGED} new")
            result["prefix_cache"] = prefix_cache_ttft(backend, cfg.vocab_size, settings.repeats, rng)
    chunk_rows = backend.prefill_buckets[-1] if backend.prefill_buckets else 0
    backend.close()
    del backend
    from numba import cuda

    cuda.current_context().deallocations.clear()  # give the engine's memory back before the tables and torch
    if settings.gemv_paths:
        progress("GEMV paths at every linear shape")
        result["gemv"] = gemv_paths(cfg)
    if settings.gemm_tiles:
        progress("INT4 GEMM tiles at every linear shape, M = 512 and 2048")
        result["gemm"] = gemm_tiles(cfg)
    if settings.prefill_lengths and chunk_rows:
        progress(f"prefill attention of one layer in the engine's {chunk_rows}-row chunks")
        result["prefill_attention"] = prefill_attention_table(cfg, settings.prefill_lengths, chunk_rows)
    if settings.baseline == "torch":
        from .bench_baseline import torch_baseline

        progress("torch + transformers baseline (bf16, static cache, CUDA graphs via torch.compile)")
        try:
            base = torch_baseline(source, settings, prompt)
            base.update(bench_report.bandwidth(step_bytes_bf16(cfg, by["context"]), base["itl_ms"]["median"],
                                               copy_gbs * 1e9))
            result["baseline"] = base
        except Exception as failure:  # the baseline is someone else's stack: report it, keep our figures
            result["baseline_error"] = f"{type(failure).__name__}: {failure}"
            progress(f"baseline failed: {result['baseline_error']}")
    result["gpu"] = {**started, "clocks_start": started.get("clocks"), "clocks_end": gpu_info().get("clocks"),
                     "copy_gbs": copy_gbs}
    result["gpu"].pop("clocks", None)
    return result


def _file_config(path) -> ModelConfig:
    with NanoQwenFile(path, verify_data=False) as f:
        return f.config


def context_sweep(backend, settings: BenchSettings, rng, copy_gbs: float) -> list[dict]:
    """Decode ITL after a prompt of each context length (graph mode, greedy): one warm-up run,
    then `repeats` runs of CONTEXT_GEN_TOKENS tokens; the floor is the step's bytes at the mean
    context of a run (weights + KV cache) over the copy bandwidth measured in this run."""
    cfg = backend.config
    rows = []
    for context in settings.contexts:
        prompt = rng.integers(0, min(cfg.vocab_size, 4000), context).tolist()
        gen = settings.CONTEXT_GEN_TOKENS
        time_generation(backend, prompt, gen)
        gaps = [gap for _ in range(settings.repeats) for gap in time_generation(backend, prompt, gen)[1]]
        itl = bench_report.summarize(gaps)
        row = {"context": context, "itl_ms": itl,
               **bench_report.bandwidth(backend.bytes_per_step(context + gen // 2), itl["median"], copy_gbs * 1e9)}
        rows.append(row)
    return rows


def step_bytes_bf16(cfg: ModelConfig, context: int) -> int:
    """What the bf16 baseline reads per step: every weight at 2 bytes (the embedding table once
    a row) plus the KV cache."""
    h = cfg.hidden_size
    per_layer = sum(n * k for n, k in cfg.linear_shapes.values()) + 2 * h + cfg.q_size + 2 * cfg.kv_size
    return 2 * (cfg.num_layers * per_layer + cfg.vocab_size * h + 2 * h) + 2 * cfg.num_layers * context * cfg.kv_size * 2


def prefill_flops(cfg: ModelConfig, tokens: int) -> int:
    """FLOPs of a prefill of `tokens` tokens: every linear at every row, causal attention (q k^T
    and p V over the tokens' earlier positions), and the lm_head for the last row only."""
    linears = sum(n * k for n, k in cfg.linear_shapes.values())
    attention = 2 * 2 * cfg.q_size * tokens * (tokens + 1) // 2
    return cfg.num_layers * (2 * tokens * linears + attention) + 2 * cfg.vocab_size * cfg.hidden_size


def prefill_sweep(backend, lengths, repeats: int, rng) -> list[dict]:
    """TTFT of one prompt of each length (one warm-up, which captures its buckets' graphs, then
    `repeats` timed runs): median ms, prompt tokens/s and TFLOP/s."""
    cfg = backend.config
    rows = []
    for tokens in lengths:
        prompt = rng.integers(0, min(cfg.vocab_size, 4000), tokens).tolist()
        times = [time_generation(backend, prompt, 1)[0] for _ in range(repeats + 1)][1:]
        ttft = bench_report.summarize(times)
        seconds = ttft["median"] / 1e3
        rows.append({"tokens": tokens, "ttft_ms": ttft, "tok_s": tokens / seconds,
                     "tflops": prefill_flops(cfg, tokens) / seconds / 1e12, "peak_tflops": PEAK_TFLOPS})
    return rows


# The cached /infill (docs/PERFORMANCE.md): a repository context whose last 16 tokens an edit changed.
PREFIX_CONTEXT, PREFIX_CHANGED = 4006, 16


def prefix_cache_ttft(backend, vocab_size: int, repeats: int, rng, context: int = PREFIX_CONTEXT,
                      changed: int = PREFIX_CHANGED) -> dict:
    """TTFT of a `context`-token prompt whose first context - changed tokens an earlier request left
    in the prefix cache, run as serve's engine runs it (a PrefixCache lease, generate_paged; no
    HTTP), against a prompt of as many tokens as it computed with nothing cached. One warm-up each,
    then `repeats` timed runs: ttft_ms summaries."""
    from .prefix_cache import PrefixCache

    cache = PrefixCache.for_backend(backend)
    vocab = min(vocab_size, 4000)

    def first_token(ids: list[int], reuse: bool) -> tuple[float, int]:
        """(ms to the first token, prompt tokens computed)."""
        lease = cache.lease(ids, len(ids) + 1, reuse=reuse)
        start = time.perf_counter()
        tokens = []
        for token in backend.generate_paged(ids, SamplingParams(), 1, frozenset(), lease):
            tokens.append(token)
            ms = 1e3 * (time.perf_counter() - start)
        cache.commit(lease, ids + tokens)
        return ms, len(ids) - lease.cached_tokens

    base = rng.integers(0, vocab, context).tolist()
    first_token(base, reuse=True)  # leaves the context's pages in the cache
    warm, cold = [], []
    for run in range(repeats + 1):
        edited = base[:context - changed] + rng.integers(0, vocab, changed).tolist()
        ms, computed = first_token(edited, reuse=True)
        cold_ms, _ = first_token(rng.integers(0, vocab, computed).tolist(), reuse=False)
        if run:
            warm.append(ms)
            cold.append(cold_ms)
    return {"prompt_tokens": context, "computed_tokens": computed, "ttft_ms": bench_report.summarize(warm),
            "cold_ttft_ms": bench_report.summarize(cold)}

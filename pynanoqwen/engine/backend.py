"""`CudaBackend`: a .nanoqwen model on an NVIDIA GPU (sm_90), what `generate --device cuda` runs.

Loading does everything that allocates, once:
1. check the GPU and that it has room for what follows (memory.py);
2. copy the weights, q/k/v packed into one matrix, and build the GEMVs and GEMMs over them (weights.py);
3. allocate the buffers of docs/DECODE.md: step state, one token's activations, the paged FP16 KV
   cache, the RoPE tables, the prefill rows (buffers.py);
4. build the other kernels with the model's dimensions baked in, and the launch lists of the
   six kinds of decode step (schedule.py); run each once, which compiles them, and capture them
   as CUDA graphs (capture.py).

A decode step is then one cuGraphLaunch (with eager=True, the same launches one by one).
Everything that changes between steps lives in device memory (buffers.StepState).

Prefill (`prefill`): the prompt runs as rows through the tensor-core GEMMs, in chunks of at most
`prefill_rows` (2048) tokens. A chunk of m tokens at positions start.. is one launch list of the
schedule (PrefillOps): page_alloc_range numbers the pages the chunk starts as m decode steps
would, the layers run over the rows, last_row copies the chunk's last row into the decode `h` and
sets pos = start + m - 1, and the decode head samples tokens[start + m] (a chunk that does not end
the prompt runs only the "prompt" sampler, which advances pos). So the first token is drawn by the
same kernels at the same pos as after token-by-token prefill, and decode continues from identical
page tables. `start` and `m` live in device memory, so one graph per bucket of rows (16 .. 2048)
and method serves every chunk that fits it. A bucket's first chunk runs eagerly (compiling its
kernels) and its graph is captured right after; `prepare` does that before the clock starts.
`prefill="decode"` keeps the old path: one decode step per prompt token.

Generation: prefill and the first sampled token, then one step per token. The host learns each
token by a 4-byte copy into pinned memory and an event; it launches step p + 1 before waiting for
the token of step p, so the GPU never idles on the host, and a stop token costs one wasted step
whose results the next generation overwrites.

The measurement and validation hooks (validate, bench, the self-check) are probes.py's, part of
backend.GpuEngine, the interface they are declared in.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
from numba import cuda

from ..device import device_name, require_gpu
from ..errors import NanoQwenError
from ..fileformat import NanoQwenFile
from ..kernels import GEMV_PATHS, PAGE_SIZE
from ..kernels.gemm_int4_tiles import rows_sum_alike
from ..kernels.sampling import METHODS, device_params, method_for
from ..prefix_cache import PageLease
from ..prompt_lookup import LookupParams, check_device
from ..sampling import SamplingParams
from . import buffers as device_buffers
from .capture import GraphCache
from .memory import PREFILL_BUCKETS, check_free_memory, device_bytes, prefill_buckets, stored_nbytes
from .probes import EngineProbes
from .schedule import DecodeOps, Kernels, Launch, PrefillOps, forward_launches, run_all
from .weights import load_weights

PREFILL_MODES = ("batched", "decode")


def prompt_chunks(n: int, longest: int, first: int = 0) -> list[tuple[int, int]]:
    """(start, rows) of each prefill chunk of prompt positions first..n-1: chunks of `longest`
    rows, the last one what is left. bench times prefill attention over these same chunks."""
    starts = list(range(first, n, longest))
    ends = starts[1:] + [n]
    return [(start, end - start) for start, end in zip(starts, ends)]


class CudaBackend(EngineProbes):
    """A .nanoqwen model on an NVIDIA GPU (sm_90), decoding through CUDA graphs (backend.GpuEngine)."""

    def __init__(self, model, *, max_context: int = 32768, gemv: str = "auto", eager: bool = False,
                 verify_data: bool = True, prefill: str = "batched", prefill_rows: int = PREFILL_BUCKETS[-1]):
        """`model`: a .nanoqwen path, or any reference.WeightSource (.config, .lm_head_int4,
        .tensor(name)), e.g. synthetic.SyntheticWeights. verify_data checks a file's checksums.
        gemv: the INT4 GEMVs' path, "auto", "prmt" or "dp4a" (kernels.GEMV_PATHS). prefill: "batched"
        runs prompts through the tensor-core GEMMs in chunks of at most prefill_rows tokens (one
        of PREFILL_BUCKETS, 16..2048); "decode" one decode step per token (and allocates nothing for
        the batched path)."""
        require_gpu()
        if gemv not in GEMV_PATHS:
            raise NanoQwenError(f"gemv must be one of {', '.join(GEMV_PATHS)}, got {gemv!r}")
        if prefill not in PREFILL_MODES:
            raise NanoQwenError(f"prefill must be one of {', '.join(PREFILL_MODES)}, got {prefill!r}")
        if prefill_rows not in PREFILL_BUCKETS:
            raise NanoQwenError(f"prefill_rows must be one of {', '.join(map(str, PREFILL_BUCKETS))}, "
                                f"got {prefill_rows}")
        self.prefill_mode, self.max_context, self.gemv, self.eager = prefill, max_context, gemv, eager
        is_path = isinstance(model, (str, os.PathLike))
        source = NanoQwenFile(model, verify_data=verify_data) if is_path else model
        try:
            cfg = self.config = source.config
            if not 1 <= max_context <= cfg.max_position_embeddings:
                raise NanoQwenError(f"max_context {max_context} must be between 1 and the model's "
                                    f"max_position_embeddings {cfg.max_position_embeddings}")
            self.prefill_buckets = prefill_buckets(max_context, prefill_rows) if prefill == "batched" else ()
            self.memory = device_bytes(cfg, sum(stored_nbytes(cfg, source.lm_head_int4).values()), max_context,
                                       prefill_rows if prefill == "batched" else 0)
            check_free_memory(self.memory, max_context, *cuda.current_context().get_memory_info())
            self.name = f"cuda ({device_name()}, INT4 {gemv} GEMV, {'eager launches' if eager else 'CUDA graphs'})"
            self.lookup_stats = None  # backend.Backend: no prompt lookup here yet
            self.stream = cuda.stream()
            self.weights = load_weights(source, cfg, gemv, self.stream, prefill=bool(self.prefill_buckets))
        finally:
            if is_path:
                source.close()
        self.buffers = device_buffers.allocate(cfg, max_context, self.prefill_buckets, self.stream)
        self.state, self.act, self.kv = self.buffers.state, self.buffers.act, self.buffers.kv
        self.max_pages = device_buffers.max_pages(max_context)
        self.kernels = Kernels.build(cfg, self.max_pages, bool(self.prefill_buckets))
        self.ops = DecodeOps(cfg, self.weights, self.kernels, self.buffers)
        self.steps = {(method, new_page): forward_launches(self.ops, method, new_page)
                      for method in METHODS for new_page in (False, True)}
        self.graphs, self.prefill_graphs = GraphCache(self.stream), GraphCache(self.stream)
        for method in METHODS:  # compile every kernel: each method's step that starts a page runs them all
            self.reset([0], SamplingParams(temperature=1.0, top_k=2))
            run_all(self.steps[method, True], self.stream)
        self.stream.synchronize()
        if not eager:
            for key, launches in self.steps.items():
                self.graphs.capture(key, launches)

    @property
    def weight_bytes_per_step(self) -> int:
        return self.weights.bytes_per_step

    def close(self) -> None:
        """Free the graphs (device memory goes when the arrays are garbage collected)."""
        self.graphs.close()
        self.prefill_graphs.close()

    # -- one step and one chunk ------------------------------------------------------------------

    def step(self, position: int, method: str) -> None:
        """Enqueue the step of the token at `position` (it must equal the device's pos)."""
        key = (method, position % PAGE_SIZE == 0)
        if self.eager:
            run_all(self.steps[key], self.stream)
        else:
            self.graphs.launch(key)

    def prefill_launches(self, rows: int, method: str) -> list[Launch]:
        """The launch list of one prefill chunk in the bucket of `rows` rows, sampling by `method`."""
        return forward_launches(PrefillOps(self.config, self.weights, self.kernels, self.buffers, rows),
                                method)

    @property
    def rows_sum_alike(self) -> bool:
        """Whether a prompt row's results have the same bits in every bucket (gemm_int4_tiles.rows_sum_alike)."""
        return bool(self.prefill_buckets) and rows_sum_alike(self.config.engine_linears, self.prefill_buckets)

    def _bucket(self, m: int) -> int:
        return next(bucket for bucket in self.prefill_buckets if bucket >= m)

    def _prefill_chunk(self, start: int, m: int, method: str) -> None:
        """Enqueue the chunk of m prompt tokens at positions start.. (the device's pos is start)."""
        rows = self._bucket(m)
        self.buffers.chunk.copy_to_device(np.array([start, m], np.int32), stream=self.stream)
        if not self.eager and (rows, method) in self.prefill_graphs:
            self.prefill_graphs.launch((rows, method))
            return
        launches = self.prefill_launches(rows, method)
        run_all(launches, self.stream)
        if not self.eager:  # its kernels are compiled now: record the bucket's graph for later chunks
            self.stream.synchronize()
            self.prefill_graphs.capture((rows, method), launches)

    def _chunks(self, n: int, method: str, first: int = 0) -> list[tuple[int, int, str]]:
        """(start, m, method) of each chunk of prompt positions first..n-1 (prompt_chunks): the
        last samples by `method`."""
        bounds = prompt_chunks(n, self.prefill_buckets[-1], first)
        return [(start, m, method if start + m == n else "prompt") for start, m in bounds]

    def prepare(self, prompt_tokens: int, params: SamplingParams) -> None:
        """Compile and capture, before the clock starts, the prefill graphs a prompt of this many
        tokens will replay: a bucket's first use otherwise compiles its kernels (seconds, once per
        process) inside the time to first token. Runs each missing chunk shape once on a prompt
        of zeros; generate() resets everything after. Decode graphs are ready from load."""
        if self.eager or not self.prefill_buckets:
            return
        for _, m, chunk_method in self._chunks(prompt_tokens, method_for(params)):
            if (self._bucket(m), chunk_method) not in self.prefill_graphs:
                self.reset([0] * m, params)
                self._prefill_chunk(0, m, chunk_method)
        self.stream.synchronize()

    def prefill(self, n: int, method: str, *, mode: str | None = None, first: int = 0) -> None:
        """Run the prompt tokens[first:n] (reset() put it there, and the KV of positions before
        `first`) through the model and sample the token after it, tokens[n], by `method`
        (kernels/sampling.py); afterwards pos = n and the KV cache holds positions 0..n-1. mode:
        "batched" (chunks through the GEMMs) or "decode" (one decode step per token); by default
        the constructor's `prefill`."""
        mode = mode or self.prefill_mode
        if mode == "decode":
            for position in range(first, n - 1):
                self.step(position, "prompt")
            self.step(n - 1, method)
            return
        if mode != "batched" or not self.prefill_buckets:
            raise ValueError(f"prefill mode {mode!r} is not available (engine built with prefill="
                             f"{self.prefill_mode!r})")
        for start, m, chunk_method in self._chunks(n, method, first):
            self._prefill_chunk(start, m, chunk_method)

    # -- generation ----------------------------------------------------------------------------------

    def reset(self, prompt_ids, params: SamplingParams, lease: PageLease | None = None) -> None:
        """Start a sequence: the prompt in tokens[0:n], pos 0, an empty KV cache, these params.
        With a prefix-cache lease: pos = lease.cached_tokens, the lease's reused pages mapped to the
        first logical pages, and its allocatable pages as the allocator's free list."""
        ids = np.asarray(prompt_ids, dtype=np.int64)
        if ids.ndim != 1 or len(ids) == 0:
            raise NanoQwenError("the prompt has no tokens")
        if len(ids) > self.max_context:
            raise NanoQwenError(f"the prompt is {len(ids)} tokens, more than max_context {self.max_context}")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise NanoQwenError(f"token id {int(ids[(ids < 0) | (ids >= self.config.vocab_size)][0])} is outside "
                                f"the vocabulary [0, {self.config.vocab_size})")
        s, state = self.stream, self.state
        state.tokens[:len(ids)].copy_to_device(ids.astype(np.int32), stream=s)
        free_pages = np.arange(self.max_pages, dtype=np.int32)
        if lease is not None:
            free_pages[:len(lease.allocatable)] = lease.allocatable
            if lease.reused:
                state.page_table[:len(lease.reused)].copy_to_device(np.array(lease.reused, np.int32), stream=s)
        state.free_pages.copy_to_device(free_pages, stream=s)
        state.pos.copy_to_device(np.array([lease.cached_tokens if lease else 0], np.int32), stream=s)
        state.next_free_page.copy_to_device(np.zeros(1, np.int32), stream=s)
        for buffer, value in zip((state.sampling, state.top_k, state.seed), device_params(params)):
            buffer.copy_to_device(value, stream=s)

    def _request_token(self, index: int) -> None:
        """Start copying tokens[index] to the host (4 bytes into a pinned slot)."""
        slot = index % 2
        self.state.tokens[index:index + 1].copy_to_host(self.buffers.host_tokens[slot:slot + 1], stream=self.stream)
        self.buffers.token_ready[slot].record(self.stream)

    def _wait_token(self, index: int) -> int:
        slot = index % 2
        self.buffers.token_ready[slot].synchronize()
        return int(self.buffers.host_tokens[slot])

    def generate(self, prompt_ids: list[int], params: SamplingParams, max_new_tokens: int,
                 stop_ids: frozenset[int], lookup: LookupParams = LookupParams()) -> Iterator[int]:
        """backend.Backend: run the prompt, then yield each sampled id as soon as it is known."""
        check_device(lookup, "cuda")
        n = len(prompt_ids)
        if n + max_new_tokens > self.max_context:
            raise NanoQwenError(f"{n} prompt tokens + {max_new_tokens} new ones exceed max_context "
                                f"{self.max_context}")
        method = method_for(params)
        self.reset(prompt_ids, params)
        if max_new_tokens < 1:
            return
        self.prefill(n, method)
        yield from self._decode_tokens(n, method, max_new_tokens, stop_ids)

    def _decode_tokens(self, n: int, method: str, max_new_tokens: int, stop_ids: frozenset[int],
                       lease: PageLease | None = None) -> Iterator[int]:
        """After the prefill of n prompt tokens: yield each sampled id as soon as it is known.
        lease.written follows the positions whose KV the enqueued steps write."""
        self._request_token(n)
        for i in range(max_new_tokens):
            position = n - 1 + i  # the step whose sampled token is tokens[position + 1]
            if i + 1 < max_new_tokens:
                self.step(position + 1, method)
                self._request_token(position + 2)
                if lease is not None:
                    lease.written = position + 2
            token = self._wait_token(position + 1)
            yield token
            if token in stop_ids:
                return

    # -- the prefix cache (prefix_cache.PagedBackend) -------------------------------------------------

    page_size = PAGE_SIZE
    min_prefill = 1  # a chunk of any rows computes them as a longer one would (rows_sum_alike)

    @property
    def num_pages(self) -> int:
        """The KV pool's pages: what a prefix cache of this engine hands out."""
        return self.max_pages

    def generate_paged(self, prompt_ids: list[int], params: SamplingParams, max_new_tokens: int,
                       stop_ids: frozenset[int], lease: PageLease,
                       lookup: LookupParams = LookupParams()) -> Iterator[int]:
        """generate() with the KV cache in the lease's pages, prefilling only the prompt's
        positions after lease.cached_tokens, at least min_prefill of them. Full prompt pages are
        reported reusable where the model's linears sum a row alike at every bucket
        (gemm_int4_tiles.rows_sum_alike): a position's KV is then the same bits whichever chunk
        computes it (docs/DECODE.md, "Prefix cache"), which tests/test_gemm_gpu.py and
        tests/test_prefill_gpu.py check. Generated positions are not (decode steps round
        differently from prefill rows), nor is the prompt's partial last page."""
        check_device(lookup, "cuda")
        n, cached = len(prompt_ids), lease.cached_tokens
        if n + max_new_tokens > self.max_context:
            raise NanoQwenError(f"{n} prompt tokens + {max_new_tokens} new ones exceed max_context "
                                f"{self.max_context}")
        if cached >= n:
            raise ValueError(f"{cached} cached positions leave none of the {n} prompt tokens to run")
        if len(lease.page_table()) * PAGE_SIZE < n + max_new_tokens or len(lease.page_table()) > self.max_pages:
            raise ValueError(f"a lease of {len(lease.page_table())} pages cannot hold {n + max_new_tokens} "
                             f"positions in a pool of {self.max_pages}")
        method = method_for(params)
        self.reset(prompt_ids, params, lease)
        lease.written = lease.reusable = cached
        # max_new_tokens 0 still runs the prompt: llama.cpp's editors send n_predict 0 to fill the cache.
        self.prefill(n, method, first=cached)
        lease.written, lease.reusable = n, n // PAGE_SIZE * PAGE_SIZE if self.rows_sum_alike else cached
        if max_new_tokens < 1:
            return
        # Closed early, the generator leaves enqueued steps running: the next request's work
        # follows them on the same stream, so they finish before it touches their pages.
        yield from self._decode_tokens(n, method, max_new_tokens, stop_ids, lease)

    def bytes_per_step(self, context: int) -> int:
        """Bytes a decode step must read from memory at `context` cached positions: the weights
        (once) and the K and V of every layer (the roofline's numerator)."""
        cfg = self.config
        return self.weights.bytes_per_step + 2 * cfg.num_layers * context * cfg.kv_size * 2

    def device_memory_used(self) -> int:
        """Bytes of device memory in use on this GPU (total - free): the engine's buffers and
        workspaces, the CUDA context and its modules, and whatever else holds memory there."""
        free, total = cuda.current_context().get_memory_info()
        return total - free

"""The engine's device buffers (docs/DECODE.md), allocated once at load and never again.

- `StepState`: everything that changes between steps, in device memory, so that one captured graph
  serves every step: the position, the tokens (the embedding reads tokens[pos], the sampler writes
  tokens[pos + 1] and advances pos), the page table and its allocator, the sampling parameters.
  The allocator's free list is 0, 1, 2, ... except while a request runs in a prefix-cache lease
  (CudaBackend.generate_paged).
- `Activations`: one token's activations, from the residual stream h to the logits.
- `KvPool`: the paged FP16 KV cache of every layer, PAGE_SIZE positions a page.
- `PrefillRows`: the prefill activations of one bucket of rows, views of the largest bucket's.
- `split`: the prefill GEMMs' kernels/gemm_int4.SplitWorkspace, where a linear sums K in chunks
  split between blocks at a few rows (down_proj at 7B).
Pools and prefill rows are zeroed once, so that no buffer ever holds NaN bit patterns that a
padding row or an unused page could carry into a sum.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from numba import cuda
from numba.cuda.cudadrv.driver import device_memset

from ..config import ModelConfig
from ..kernels import PAGE_SIZE
from ..kernels.gemm_int4 import SplitWorkspace
from ..kernels.gemm_int4_tiles import K_CHUNKS
from ..kernels.rope_kv_write import rope_cos_sin
from .memory import split_workspace_shape


@dataclasses.dataclass(frozen=True)
class StepState:
    pos: object  # int32 [1]: the position of the token being computed
    tokens: object  # int32 [max_context + 1]: the prompt, then each sampled token
    page_table: object  # int32 [max_pages]: logical page -> physical page of the pool
    free_pages: object  # int32 [max_pages]: the physical pages kernels/page_alloc.py hands out, in order
    next_free_page: object  # int32 [1]: how many of free_pages are taken
    sampling: object  # float32 [2]: temperature, top_p (kernels/sampling.device_params)
    top_k: object  # int32 [1]
    seed: object  # uint64 [1]


@dataclasses.dataclass(frozen=True)
class Activations:
    h: object  # float32 [hidden]: the residual stream
    xn: object  # float16 [hidden]: RMSNorm(h), where a kernel does not normalise itself
    q: object  # float32 [heads, head_dim]: rotated (the QKV GEMV's epilogue writes it)
    attn: object  # float16 [q_size]
    mlp: object  # float16 [intermediate]: silu(gate) * up
    logits: object  # float32 [vocab]


@dataclasses.dataclass(frozen=True)
class KvPool:
    k: object  # float16 [layers, max_pages, kv_heads, PAGE_SIZE, head_dim]
    v: object


@dataclasses.dataclass(frozen=True)
class PrefillRows:
    """The prefill activations of one bucket: the first `rows` rows of each prefill buffer."""

    h: object  # float32 [rows, hidden]
    xn: object  # float16 [rows, hidden]
    qkv: object  # float32 [rows, q_size + 2 kv_size]
    q: object  # float32 [rows, heads, head_dim]
    attn: object  # float16 [rows, q_size]
    mlp: object  # float16 [rows, intermediate]


@dataclasses.dataclass(frozen=True)
class Buffers:
    state: StepState
    act: Activations
    kv: KvPool
    rope_cos: object  # float32 [max_context, head_dim / 2]
    rope_sin: object
    prefill: dict[int, PrefillRows]  # bucket rows -> its views; empty without batched prefill
    chunk: object  # int32 [2]: (start, m) of the prefill chunk in flight, written by the host
    host_tokens: object  # pinned int32 [2]: the host's two slots of token streaming
    token_ready: list  # the event of each slot's copy
    split: object = None  # SplitWorkspace of the prefill GEMMs; None without batched prefill or chunked linears


def max_pages(max_context: int) -> int:
    return -(-max_context // PAGE_SIZE)


def allocate(cfg: ModelConfig, max_context: int, buckets: tuple[int, ...], stream) -> Buffers:
    """Every buffer of the module docstring for `max_context` positions and these prefill buckets."""
    pages = max_pages(max_context)
    state = StepState(pos=cuda.device_array(1, np.int32), tokens=cuda.device_array(max_context + 1, np.int32),
                      page_table=cuda.device_array(pages, np.int32),
                      free_pages=cuda.to_device(np.arange(pages, dtype=np.int32), stream=stream),
                      next_free_page=cuda.device_array(1, np.int32),
                      sampling=cuda.device_array(2, np.float32), top_k=cuda.device_array(1, np.int32),
                      seed=cuda.device_array(1, np.uint64))
    act = Activations(h=cuda.device_array(cfg.hidden_size, np.float32),
                      xn=cuda.device_array(cfg.hidden_size, np.float16),
                      q=cuda.device_array((cfg.num_heads, cfg.head_dim), np.float32),
                      attn=cuda.device_array(cfg.q_size, np.float16),
                      mlp=cuda.device_array(cfg.intermediate_size, np.float16),
                      logits=cuda.device_array(cfg.vocab_size, np.float32))
    shape = (cfg.num_layers, pages, cfg.num_kv_heads, PAGE_SIZE, cfg.head_dim)
    kv = KvPool(_zeros(shape, np.float16, stream), _zeros(shape, np.float16, stream))
    prefill, split = {}, None
    if buckets:
        rows = buckets[-1]
        full = PrefillRows(h=_zeros((rows, cfg.hidden_size), np.float32, stream),
                           xn=_zeros((rows, cfg.hidden_size), np.float16, stream),
                           qkv=_zeros((rows, cfg.q_size + 2 * cfg.kv_size), np.float32, stream),
                           q=_zeros((rows, cfg.num_heads, cfg.head_dim), np.float32, stream),
                           attn=_zeros((rows, cfg.q_size), np.float16, stream),
                           mlp=_zeros((rows, cfg.intermediate_size), np.float16, stream))
        views = [getattr(full, field.name) for field in dataclasses.fields(full)]
        prefill = {bucket: PrefillRows(*(view[:bucket] for view in views)) for bucket in buckets}
        shape = split_workspace_shape(cfg, rows)
        split = SplitWorkspace(*shape[:2], K_CHUNKS, stream=stream, total_rows=shape[2]) if shape else None
    cos, sin = rope_cos_sin(cfg.head_dim, cfg.rope_theta, max_context)
    return Buffers(state, act, kv, cuda.to_device(cos, stream=stream), cuda.to_device(sin, stream=stream), prefill,
                   chunk=cuda.device_array(2, np.int32), host_tokens=cuda.pinned_array(2, np.int32),
                   token_ready=[cuda.event(timing=False) for _ in range(2)], split=split)


def _zeros(shape, dtype, stream):
    array = cuda.device_array(shape, dtype)
    device_memset(array, 0, array.nbytes, stream=stream)
    return array

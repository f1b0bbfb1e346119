"""The engine's memory plan: what it allocates on the device for a model, checked before anything is.

The engine allocates everything once, at load (docs/DECODE.md): the weights as the file stores them
(q/k/v packed into one matrix, no other copy), the paged FP16 KV cache for `max_context` positions,
the RoPE tables, one token's activations and the step state, the prefill rows of the largest
bucket, and the kernels' workspaces. `device_bytes` adds them up from the config alone, so a GPU
without room is refused with one line before the first copy.
"""

from __future__ import annotations

import math

import numpy as np

from ..config import ModelConfig
from ..errors import NanoQwenError
from ..kernels.attention_decode import default_num_splits
from ..kernels.attention_prefill import split_records
from ..kernels import PAGE_SIZE
from ..kernels.gemm_int4 import SplitWorkspace
from ..kernels.gemm_int4_tiles import K_CHUNKS, SHORT_PROMPT_ROWS, TMA_T256, WG1_T64, default_tiles_for, k_chunks
from ..kernels.gemm_int4_tma import TmaTile
from ..kernels.sampling import Sampler
from ..tensors import stored_tensors

RESERVED_BYTES = 512 * 2**20  # CUDA context, kernel modules, graphs, workspaces: kept free on top
# Rows of the prefill graphs: 16, 32, 64, then every PREFILL_STEP rows to 2048. A chunk runs in the
# smallest bucket that holds it, so past 64 rows it computes at most PREFILL_STEP - 1 padding rows:
# with powers of two a 522-token prompt ran as 1024 rows (32.1 ms against 17.5 for 512 on the H200,
# docs/PERFORMANCE.md). The GEMM kernels take M at run time, so a bucket adds a graph, not a compile.
PREFILL_STEP = 128
PREFILL_BUCKETS = (16, 32, 64) + tuple(range(PREFILL_STEP, 2048 + 1, PREFILL_STEP))


def prefill_buckets(max_context: int, prefill_rows: int = PREFILL_BUCKETS[-1]) -> tuple[int, ...]:
    """The chunk sizes the batched prefill captures graphs for: PREFILL_BUCKETS up to prefill_rows,
    or only up to the first that holds max_context tokens. The last is the longest chunk."""
    buckets = [rows for rows in PREFILL_BUCKETS if rows <= prefill_rows]
    fits = [rows for rows in buckets if rows >= max_context]
    return tuple(buckets[:buckets.index(fits[0]) + 1] if fits else buckets)


def prefill_row_bytes(cfg: ModelConfig) -> int:
    """Device bytes of one prefill row: h f32, xn f16, qkv f32, q f32, attn f16, mlp f16."""
    return 6 * cfg.hidden_size + 4 * (cfg.q_size + 2 * cfg.kv_size) + 6 * cfg.q_size + 2 * cfg.intermediate_size


def split_workspace_shape(cfg: ModelConfig, longest: int) -> tuple[int, int, int] | None:
    """(rows, N, total_rows) of the prefill GEMMs' SplitWorkspace for buckets of up to `longest`
    rows: the rows of the 64-token tiles (up to SHORT_PROMPT_ROWS) by the widest linear that sums
    K in chunks (down_proj at 7B), and the rows whose running totals the TMA kernel keeps there
    (the longest bucket, in whole 256-token tiles) where such a linear runs on it; None when no
    linear of this model sums K in chunks (gemm_int4_tiles.k_chunks)."""
    chunked = [(n, k, epilogue) for _, n, k, epilogue in cfg.engine_linears if k_chunks(k, WG1_T64, epilogue) > 1]
    if not chunked:
        return None
    on_tma = any(isinstance(tiles, TmaTile) and k_chunks(k, tiles, epilogue) > 1
                 for n, k, epilogue in chunked for tiles in [default_tiles_for(longest, n, k, epilogue)])
    total_rows = -(-longest // TMA_T256.tokens) * TMA_T256.tokens if on_tma else 0
    return SHORT_PROMPT_ROWS, max(n for n, _, _ in chunked), total_rows


def device_bytes(cfg: ModelConfig, weight_bytes: int, max_context: int, prefill_rows: int = PREFILL_BUCKETS[-1],
                 *, attention_splits: int | None = None) -> dict[str, int]:
    """What the engine allocates on the device for a model whose file tensors total weight_bytes
    (prefill_rows 0: no batched prefill). attention_splits sizes the decode attention's workspace;
    None: the engine's default on the current device (kernels/attention_decode.py)."""
    pages = -(-max_context // PAGE_SIZE)
    splits = default_num_splits(cfg.num_kv_heads) if attention_splits is None else attention_splits
    split_attention = 4 * split_records(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, pages) if prefill_rows else 0
    longest = prefill_buckets(max_context, prefill_rows)[-1] if prefill_rows else 0
    split_shape = split_workspace_shape(cfg, longest) if prefill_rows else None
    split_gemm = SplitWorkspace.nbytes(*split_shape[:2], K_CHUNKS, split_shape[2]) if split_shape else 0
    return {
        "weights": weight_bytes,
        "kv cache": 2 * cfg.num_layers * pages * cfg.num_kv_heads * PAGE_SIZE * cfg.head_dim * 2,
        "rope tables": 2 * max_context * (cfg.head_dim // 2) * 4,
        "activations and state": (6 * cfg.hidden_size + 6 * cfg.q_size + 2 * cfg.intermediate_size
                                  + 4 * cfg.vocab_size + 4 * (max_context + 1) + 4 * pages + 64),
        "prefill activations": longest * prefill_row_bytes(cfg) + 8 if prefill_rows else 0,
        "workspaces": (Sampler.scratch_nbytes(cfg.vocab_size) + 4 * cfg.num_heads * splits * (cfg.head_dim + 2)
                       + 4 * cfg.num_kv_heads + split_attention + split_gemm),
        "reserve": RESERVED_BYTES,
    }


def stored_nbytes(cfg: ModelConfig, lm_head_int4: bool) -> dict[str, int]:
    """Bytes of each tensor a model stores (tensors.stored_tensors), all of which the engine copies."""
    return {name: math.prod(shape) * np.dtype(dtype).itemsize
            for name, (dtype, shape) in stored_tensors(cfg, lm_head_int4).items()}


def check_free_memory(needed: dict[str, int], max_context: int, free: int, total: int) -> None:
    """Raise NanoQwenError, naming every part, when `needed` does not fit the `free` device bytes."""
    if sum(needed.values()) > free:
        parts = ", ".join(f"{name} {size / 2**30:.2f}" for name, size in needed.items())
        raise NanoQwenError(f"the model needs {sum(needed.values()) / 2**30:.2f} GiB of GPU memory ({parts} GiB, "
                            f"at max_context {max_context}) but only {free / 2**30:.2f} of {total / 2**30:.2f} GiB "
                            "are free; lower --max-context or free the GPU")

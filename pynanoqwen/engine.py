"""The GPU engine: a .nanoqwen model on the device, its buffers, KV pages and CUDA graphs.

`CudaBackend` is what `generate --device cuda` runs (generate.Backend). Loading does everything
that allocates, once:

1. check that there is a GPU and that it has room for what step 2 allocates (`device_bytes`);
2. copy each tensor of the file to the device, one host-to-device copy per tensor straight from
   the mmap; q/k/v rows (and biases) go into one QKV matrix so that QKV is one GEMV;
3. allocate the buffers of docs/DECODE.md: per-step state, activations, the paged KV cache
   (FP16, max_context / 16 pages of 16 positions per layer) and the RoPE tables;
4. build the kernels (dims baked in) and run one step of each kind eagerly, which compiles them;
5. capture six CUDA graphs (graphs.py): {prompt, argmax, candidates} (kernels/sampling.py) x
   {same page, new page}; a step at a position p with p % 16 == 0 starts a KV page, so its
   graph begins with page_alloc. The prefill graphs (below) are captured later, on first use.

A step is then one cuGraphLaunch (or, with eager=True, the same kernels launched one by one).
Everything that changes between steps lives in device memory: the position, the tokens (the
embedding reads tokens[pos], the sampler writes tokens[pos + 1] and advances pos), the page
table and the sampling parameters.

Prefill (`prefill`): the whole prompt runs as a batch of rows through the tensor-core INT4 GEMMs
(kernels/gemm_int4.py, built over the same weight arrays as the GEMVs: no second copy) in chunks
of at most `prefill_rows` (2048) tokens. Per chunk of m tokens at positions start..start + m - 1:
page_alloc_range (the pages the chunk starts, numbered as m decode steps would number them) ->
embedding_rows -> per layer: rmsnorm_rows -> QKV GEMM (+ bias) -> rope_kv_write (K/V into
the pages) -> prefill attention (each row attends to every earlier position through the pages)
-> o_proj GEMM += h -> rmsnorm_rows -> gate-up-SiLU GEMM -> down GEMM += h; then last_row copies
the chunk's last row into the decode `h` and sets pos = start + m - 1, and the decode step's own
final norm, lm_head and sampler sample tokens[start + m] and advance pos (a chunk that does not
end the prompt runs only the "prompt" sampler, which advances pos). So the first token is drawn
by the same kernels at the same pos as after token-by-token prefill; the logits differ only by
the GEMMs' rounding against the GEMVs' (FP32 against partly FP16 accumulation), and decode
continues from identical page tables. `start` and `m` live in device memory (`chunk`), so one
CUDA graph per bucket of rows (16, 32, ..., 2048) and sampling method serves every chunk that
fits it: rows m..bucket - 1 are padding (zero embeddings; computed by the GEMMs, never written to
the KV cache, never read). A bucket's first chunk runs eagerly, which compiles its kernels, and
its graph is captured right after. `prefill="decode"` (or `prefill(..., mode="decode")`) keeps
the old path: one decode step per prompt token (the "prompt" graphs, without lm_head).

Generation: prefill and the first sampled token, then one step per token. The host learns each
token by a 4-byte copy into pinned memory and an event; it launches step p + 1 before waiting
for the token of step p, so the GPU never idles on the host, and a stop token costs one wasted
step whose results the next generation overwrites.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import warnings
from collections.abc import Callable, Iterator

import numpy as np
from numba import cuda
from numba.cuda.core.errors import NumbaPerformanceWarning

from .config import GROUP_SIZE, ModelConfig
from .errors import NanoQwenError
from .fileformat import NanoQwenFile
from .graphs import CudaGraph, capture
from .kernels.attention_decode import default_num_splits, make_decode_attention
from .kernels.attention_prefill import make_prefill_attention
from .kernels.embedding import make_embedding
from .kernels.embedding_prefill import make_embedding_rows
from .kernels.gemm_int4 import make_gate_up_silu_gemm, make_gemm_int4
from .kernels.gemv_fp16 import fp16_gemv_bytes, make_gemv_fp16
from .kernels.gemv_int4 import gemv_bytes, make_gate_up_silu, make_gemv_int4
from .kernels.last_row_prefill import make_last_row
from .kernels.page_alloc import PAGE_SIZE, make_page_alloc
from .kernels.page_alloc_prefill import make_page_alloc_range
from .kernels.rmsnorm import make_rmsnorm, make_rmsnorm_rows
from .kernels.rope_kv_write import make_rope_kv_write, rope_cos_sin
from .kernels.sampling import METHODS, Sampler, device_params, method_for
from .sampling import SamplingParams
from .tensors import QWEIGHT, SCALES, layer_prefix, stored_tensors

# Decode launches one-block kernels on purpose (RMSNorm, sampling); Numba warns about each one.
warnings.filterwarnings("ignore", message="Grid size", category=NumbaPerformanceWarning)

RESERVED_BYTES = 512 * 2**20  # CUDA context, kernel modules, graphs, workspaces: kept free on top
PREFILL_BUCKETS = tuple(16 << i for i in range(8))  # rows of the prefill graphs: 16, 32, ..., 2048


def prefill_buckets(max_context: int, prefill_rows: int = PREFILL_BUCKETS[-1]) -> tuple[int, ...]:
    """The chunk sizes the batched prefill captures graphs for: 16, 32, ... up to prefill_rows,
    or only up to the first that holds max_context tokens. The last is the longest chunk."""
    buckets = [rows for rows in PREFILL_BUCKETS if rows <= prefill_rows]
    fits = [rows for rows in buckets if rows >= max_context]
    return tuple(buckets[:buckets.index(fits[0]) + 1] if fits else buckets)


def prefill_row_bytes(cfg: ModelConfig) -> int:
    """Device bytes of one prefill row: h f32, xn f16, qkv f32, q f32, attn f16, mlp f16."""
    return 6 * cfg.hidden_size + 4 * (cfg.q_size + 2 * cfg.kv_size) + 6 * cfg.q_size + 2 * cfg.intermediate_size


def device_bytes(cfg: ModelConfig, weight_bytes: int, max_context: int,
                 prefill_rows: int = PREFILL_BUCKETS[-1]) -> dict[str, int]:
    """What the engine allocates on the device for a model whose file tensors total weight_bytes
    (prefill_rows 0: no batched prefill)."""
    pages = -(-max_context // PAGE_SIZE)
    qkv = cfg.q_size + 2 * cfg.kv_size
    splits = default_num_splits(cfg.num_kv_heads)
    return {
        "weights": weight_bytes,
        "kv cache": 2 * cfg.num_layers * pages * cfg.num_kv_heads * PAGE_SIZE * cfg.head_dim * 2,
        "rope tables": 2 * max_context * (cfg.head_dim // 2) * 4,
        "activations and state": (6 * cfg.hidden_size + 4 * qkv + 6 * cfg.q_size + 2 * cfg.intermediate_size
                                  + 4 * cfg.vocab_size + 4 * (max_context + 1) + 4 * pages + 64),
        "prefill activations": (prefill_buckets(max_context, prefill_rows)[-1] * prefill_row_bytes(cfg) + 8
                                if prefill_rows else 0),
        "workspaces": (Sampler.scratch_nbytes(cfg.vocab_size) + 4 * cfg.num_heads * splits * (cfg.head_dim + 2)
                       + 4 * cfg.num_kv_heads),
        "reserve": RESERVED_BYTES,
    }


def stored_nbytes(cfg: ModelConfig, lm_head_int4: bool) -> dict[str, int]:
    """Bytes of each tensor a model stores (tensors.stored_tensors), all of which the engine copies."""
    return {name: math.prod(shape) * np.dtype(dtype).itemsize
            for name, (dtype, shape) in stored_tensors(cfg, lm_head_int4).items()}


def _require_gpu() -> None:
    from .generate import cuda_gpu_available

    if not cuda_gpu_available():
        raise NanoQwenError("no CUDA GPU with compute capability 9.0 or newer found; use --device cpu")


def _check_free_memory(needed: dict[str, int], max_context: int) -> None:
    free, total = cuda.current_context().get_memory_info()
    if sum(needed.values()) > free:
        parts = ", ".join(f"{name} {size / 2**30:.2f}" for name, size in needed.items())
        raise NanoQwenError(f"the model needs {sum(needed.values()) / 2**30:.2f} GiB of GPU memory ({parts} GiB, "
                            f"at max_context {max_context}) but only {free / 2**30:.2f} of {total / 2**30:.2f} GiB "
                            "are free; lower --max-context or free the GPU")


@dataclasses.dataclass
class Layer:
    """One decoder layer on the device: norms, its four GEMVs (which hold the INT4 weights) and
    its KV pages, views into the engine's pool."""

    input_norm: object
    post_attention_norm: object
    qkv: object
    o_proj: object
    gate_up: object
    down: object
    k_pages: object
    v_pages: object
    prefill: "PrefillLinears | None" = None  # the same weights as tensor-core GEMMs (batched prefill)


@dataclasses.dataclass
class PrefillLinears:
    """A layer's INT4 GEMMs for prefill (kernels/gemm_int4.py), over the GEMVs' weight arrays."""

    qkv: object
    o_proj: object
    gate_up: object
    down: object


@dataclasses.dataclass
class PrefillRows:
    """The prefill activations of one bucket: the first `rows` rows of each prefill buffer."""

    h: object  # float32 [rows, hidden], the residual stream
    xn: object  # float16 [rows, hidden]
    qkv: object  # float32 [rows, q_size + 2 kv_size]
    q: object  # float32 [rows, num_heads, head_dim]
    attn: object  # float16 [rows, q_size]
    mlp: object  # float16 [rows, intermediate]


class CudaBackend:
    """A .nanoqwen model on an NVIDIA GPU (sm_90), decoding through CUDA graphs (generate.Backend)."""

    def __init__(self, model, *, max_context: int = 32768, gemv: str = "prmt", eager: bool = False,
                 verify_data: bool = True, fused_norm: bool = True, prefill: str = "batched",
                 prefill_rows: int = PREFILL_BUCKETS[-1]):
        """`model`: a .nanoqwen path, or any reference.WeightSource (.config, .lm_head_int4,
        .tensor(name)), e.g. synthetic.SyntheticWeights. verify_data checks a file's checksums.
        fused_norm: the QKV, gate-up and INT4 lm_head GEMVs apply their RMSNorm themselves (on the
        prmt path inside the GEMV kernel); False runs kernels/rmsnorm.py into xn before each.
        prefill: "batched" runs prompts through the tensor-core GEMMs in chunks of at most
        prefill_rows tokens (a power of two, 16..2048); "decode" one decode step per token (and
        allocates nothing for the batched path)."""
        _require_gpu()
        if gemv not in ("prmt", "dp4a"):
            raise NanoQwenError(f"gemv must be 'prmt' or 'dp4a', got {gemv!r}")
        if prefill not in ("batched", "decode"):
            raise NanoQwenError(f"prefill must be 'batched' or 'decode', got {prefill!r}")
        if prefill_rows not in PREFILL_BUCKETS:
            raise NanoQwenError(f"prefill_rows must be one of {', '.join(map(str, PREFILL_BUCKETS))}, "
                                f"got {prefill_rows}")
        self.prefill_mode = prefill
        self.max_context = max_context
        self.gemv = gemv
        self.eager = eager
        self.fused_norm = fused_norm
        is_path = isinstance(model, (str, os.PathLike))
        weights = NanoQwenFile(model, verify_data=verify_data) if is_path else model
        try:
            cfg = self.config = weights.config
            self.lm_head_int4 = weights.lm_head_int4
            if not 1 <= max_context <= cfg.max_position_embeddings:
                raise NanoQwenError(f"max_context {max_context} must be between 1 and the model's "
                                    f"max_position_embeddings {cfg.max_position_embeddings}")
            self.prefill_buckets = prefill_buckets(max_context, prefill_rows) if prefill == "batched" else ()
            self.memory = device_bytes(cfg, sum(stored_nbytes(cfg, self.lm_head_int4).values()), max_context,
                                       prefill_rows if prefill == "batched" else 0)
            _check_free_memory(self.memory, max_context)
            device = cuda.get_current_device().name
            device = device.decode() if isinstance(device, bytes) else device
            self.name = f"cuda ({device}, INT4 {gemv} GEMV, {'eager launches' if eager else 'CUDA graphs'})"
            self.stream = cuda.stream()
            self._load_weights(weights)
        finally:
            if is_path:
                weights.close()
        self._allocate_buffers()
        self._build_kernels()
        self.graphs: dict[tuple[str, bool], CudaGraph] = {}
        self.prefill_graphs: dict[tuple[int, str], CudaGraph] = {}  # (bucket rows, method), captured on first use
        self._compile()
        if not eager:
            self._capture_graphs()

    # -- loading ---------------------------------------------------------------------------------

    def _copy(self, array: np.ndarray):
        """One host-to-device copy of a stored tensor (for a file, a view of its mmap)."""
        return cuda.to_device(array, stream=self.stream)

    def _norm(self, weight) -> dict:
        """The RMSNorm arguments of a GEMV that reads the normalised h (none unless fused_norm)."""
        return dict(norm_weight=weight, norm_eps=self.config.rms_norm_eps) if self.fused_norm else {}

    @property
    def lm_head_fused_norm(self) -> bool:
        """Whether the lm_head normalises h itself (the FP16 lm_head never does)."""
        return self.fused_norm and self.lm_head_int4

    def _load_weights(self, file) -> None:
        cfg, s = self.config, self.stream
        self.embed_tokens = self._copy(file.tensor("model.embed_tokens.weight"))
        self.final_norm = self._copy(file.tensor("model.norm.weight"))
        q, kv = cfg.q_size, cfg.kv_size
        qkv_rows = (("q_proj", slice(0, q)), ("k_proj", slice(q, q + kv)), ("v_proj", slice(q + kv, q + 2 * kv)))
        self.layers: list[Layer] = []
        for index in range(cfg.num_layers):
            p = layer_prefix(index)
            # One QKV matrix: the three projections' rows stacked, each copied into its slice.
            qkv_q = cuda.device_array((q + 2 * kv, cfg.hidden_size // 8), np.uint32)
            qkv_s = cuda.device_array((q + 2 * kv, cfg.hidden_size // GROUP_SIZE), np.float16)
            qkv_bias = cuda.device_array(q + 2 * kv, np.float16)
            for module, rows in qkv_rows:
                name = f"{p}self_attn.{module}"
                qkv_q[rows].copy_to_device(file.tensor(name + ".weight" + QWEIGHT), stream=s)
                qkv_s[rows].copy_to_device(file.tensor(name + ".weight" + SCALES), stream=s)
                qkv_bias[rows].copy_to_device(file.tensor(name + ".bias"), stream=s)

            def linear(module: str):
                name = p + module + ".weight"
                return self._copy(file.tensor(name + QWEIGHT)), self._copy(file.tensor(name + SCALES))

            o_q, o_s = linear("self_attn.o_proj")
            gate_q, gate_s = linear("mlp.gate_proj")
            up_q, up_s = linear("mlp.up_proj")
            down_q, down_s = linear("mlp.down_proj")
            h, i = cfg.hidden_size, cfg.intermediate_size
            input_norm = self._copy(file.tensor(p + "input_layernorm.weight"))
            post_attention_norm = self._copy(file.tensor(p + "post_attention_layernorm.weight"))
            self.layers.append(Layer(
                input_norm=input_norm,
                post_attention_norm=post_attention_norm,
                qkv=make_gemv_int4(q + 2 * kv, h, qkv_q, qkv_s, path=self.gemv, bias=qkv_bias,
                                   **self._norm(input_norm)),
                o_proj=make_gemv_int4(h, q, o_q, o_s, path=self.gemv),
                gate_up=make_gate_up_silu(i, h, gate_q, gate_s, up_q, up_s, path=self.gemv,
                                          **self._norm(post_attention_norm)),
                down=make_gemv_int4(h, i, down_q, down_s, path=self.gemv),
                k_pages=None, v_pages=None,
                prefill=PrefillLinears(
                    qkv=make_gemm_int4(q + 2 * kv, h, qkv_q, qkv_s, bias=qkv_bias),
                    o_proj=make_gemm_int4(h, q, o_q, o_s),
                    gate_up=make_gate_up_silu_gemm(i, h, gate_q, gate_s, up_q, up_s),
                    down=make_gemm_int4(h, i, down_q, down_s)) if self.prefill_buckets else None))
        # Weight bytes one step reads: everything but the embedding table, of which it reads one
        # row, unless the table is also the (tied, FP16) lm_head.
        stored = stored_nbytes(cfg, file.lm_head_int4)
        embed_bytes = stored["model.embed_tokens.weight"]
        self.weight_bytes_per_step = sum(stored.values()) - embed_bytes + 2 * cfg.hidden_size
        if file.lm_head_int4:
            self.lm_head = make_gemv_int4(cfg.vocab_size, cfg.hidden_size,
                                          self._copy(file.tensor("lm_head.weight" + QWEIGHT)),
                                          self._copy(file.tensor("lm_head.weight" + SCALES)), path=self.gemv,
                                          **self._norm(self.final_norm))
        elif cfg.tie_word_embeddings:  # the FP16 lm_head *is* the embedding table: no second copy
            self.lm_head = make_gemv_fp16(cfg.vocab_size, cfg.hidden_size, self.embed_tokens)
            self.weight_bytes_per_step += embed_bytes
        else:
            self.lm_head = make_gemv_fp16(cfg.vocab_size, cfg.hidden_size, self._copy(file.tensor("lm_head.weight")))
        self.stream.synchronize()  # a file's mmap closes next: every copy from it must be done

    def _allocate_buffers(self) -> None:
        cfg = self.config
        self.max_pages = -(-self.max_context // PAGE_SIZE)
        # Per-step state (docs/DECODE.md).
        self.pos = cuda.device_array(1, np.int32)
        self.tokens = cuda.device_array(self.max_context + 1, np.int32)
        self.page_table = cuda.device_array(self.max_pages, np.int32)
        self.next_free_page = cuda.device_array(1, np.int32)
        self.sampling = cuda.device_array(2, np.float32)
        self.top_k = cuda.device_array(1, np.int32)
        self.seed = cuda.device_array(1, np.uint64)
        # Activations of one token.
        self.h = cuda.device_array(cfg.hidden_size, np.float32)
        self.xn = cuda.device_array(cfg.hidden_size, np.float16)
        self.qkv = cuda.device_array(cfg.q_size + 2 * cfg.kv_size, np.float32)
        self.q = cuda.device_array((cfg.num_heads, cfg.head_dim), np.float32)
        self.attn = cuda.device_array(cfg.q_size, np.float16)
        self.mlp = cuda.device_array(cfg.intermediate_size, np.float16)
        self.logits = cuda.device_array(cfg.vocab_size, np.float32)
        # The KV page pool, zeroed once so that no page ever holds NaN bit patterns.
        shape = (cfg.num_layers, self.max_pages, cfg.num_kv_heads, PAGE_SIZE, cfg.head_dim)
        self.k_pool = cuda.device_array(shape, np.float16)
        self.v_pool = cuda.device_array(shape, np.float16)
        from numba.cuda.cudadrv.driver import device_memset

        for pool in (self.k_pool, self.v_pool):
            device_memset(pool, 0, pool.nbytes, stream=self.stream)
        for index, layer in enumerate(self.layers):
            layer.k_pages, layer.v_pages = self.k_pool[index], self.v_pool[index]
        if self.prefill_buckets:
            self._allocate_prefill_buffers()
        cos, sin = rope_cos_sin(cfg.head_dim, cfg.rope_theta, self.max_context)
        self.rope_cos, self.rope_sin = self._copy(cos), self._copy(sin)
        # The host side of token streaming: two pinned slots, each with the event of its copy.
        self.host_tokens = cuda.pinned_array(2, np.int32)
        self.token_ready = [cuda.event(timing=False) for _ in range(2)]

    def _allocate_prefill_buffers(self) -> None:
        """The prefill rows for the largest bucket (docs in the module docstring), zeroed once so
        that padding rows never hold NaN bit patterns, and each bucket's views of them."""
        from numba.cuda.cudadrv.driver import device_memset

        cfg, rows = self.config, self.prefill_buckets[-1]
        full = PrefillRows(h=cuda.device_array((rows, cfg.hidden_size), np.float32),
                           xn=cuda.device_array((rows, cfg.hidden_size), np.float16),
                           qkv=cuda.device_array((rows, cfg.q_size + 2 * cfg.kv_size), np.float32),
                           q=cuda.device_array((rows, cfg.num_heads, cfg.head_dim), np.float32),
                           attn=cuda.device_array((rows, cfg.q_size), np.float16),
                           mlp=cuda.device_array((rows, cfg.intermediate_size), np.float16))
        buffers = [getattr(full, field.name) for field in dataclasses.fields(full)]
        for buffer in buffers:
            device_memset(buffer, 0, buffer.nbytes, stream=self.stream)
        self.prefill_views = {bucket: PrefillRows(*(buffer[:bucket] for buffer in buffers))
                              for bucket in self.prefill_buckets}
        # The chunk in flight: (start, m), written by the host before each chunk's graph.
        self.chunk = cuda.device_array(2, np.int32)
        self.chunk_start, self.chunk_rows = self.chunk[0:1], self.chunk[1:2]

    def _build_kernels(self) -> None:
        cfg = self.config
        self.embedding = make_embedding(cfg.hidden_size)
        self.rmsnorm = make_rmsnorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope_kv_write = make_rope_kv_write(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.attention = make_decode_attention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.max_pages)
        self.page_alloc = make_page_alloc()
        self.sampler = Sampler(cfg.vocab_size)
        if self.prefill_buckets:
            self.page_alloc_range = make_page_alloc_range()
            self.embedding_rows = make_embedding_rows(cfg.hidden_size)
            self.rmsnorm_rows = make_rmsnorm_rows(cfg.hidden_size, cfg.rms_norm_eps)
            self.prefill_attention = make_prefill_attention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                                            self.max_pages)
            self.last_row = make_last_row(cfg.hidden_size)

    def _compile(self) -> None:
        """Launch every kernel once (Numba compiles on first launch), each sampling method once."""
        for method in METHODS:
            self.reset([0], SamplingParams(temperature=1.0, top_k=2))
            self._enqueue_step(method, new_page=True)
        self.stream.synchronize()

    def _capture_graphs(self) -> None:
        for method in METHODS:
            for new_page in (False, True):
                self.graphs[method, new_page] = capture(self.stream,
                                                        functools.partial(self._enqueue_step, method, new_page))

    def close(self) -> None:
        """Free the graphs (device memory goes when the arrays are garbage collected)."""
        for graphs in (self.graphs, self.prefill_graphs):
            for graph in graphs.values():
                graph.close()
            graphs.clear()

    # -- one step ----------------------------------------------------------------------------------

    def _layer_stages(self, layer: Layer) -> list[tuple[str, Callable[[], None]]]:
        """The kernels of one decoder layer for one token, in order: (stage name, launch)."""
        s = self.stream
        stages = []
        if not self.fused_norm:
            stages.append(("input_norm", lambda: self.rmsnorm.launch(s, self.h, layer.input_norm, self.xn)))
        x = self.h if self.fused_norm else self.xn
        stages += [
            ("qkv", lambda: layer.qkv.launch(s, x, self.qkv)),
            ("rope_kv_write", lambda: self.rope_kv_write.launch(s, self.qkv, self.rope_cos, self.rope_sin, self.pos,
                                                                self.page_table, self.q, layer.k_pages,
                                                                layer.v_pages)),
            ("attention", lambda: self.attention.launch(s, self.q, layer.k_pages, layer.v_pages, self.page_table,
                                                        self.pos, self.attn)),
            ("o_proj", lambda: layer.o_proj.launch(s, self.attn, self.h, residual=True))]
        if not self.fused_norm:
            stages.append(("post_attention_norm",
                           lambda: self.rmsnorm.launch(s, self.h, layer.post_attention_norm, self.xn)))
        return stages + [("gate_up", lambda: layer.gate_up.launch(s, x, self.mlp)),
                         ("down", lambda: layer.down.launch(s, self.mlp, self.h, residual=True))]

    def _lm_head_stages(self) -> list[tuple[str, Callable[[], None]]]:
        s = self.stream
        if self.lm_head_fused_norm:
            return [("lm_head", lambda: self.lm_head.launch(s, self.h, self.logits))]
        return [("final_norm", lambda: self.rmsnorm.launch(s, self.h, self.final_norm, self.xn)),
                ("lm_head", lambda: self.lm_head.launch(s, self.xn, self.logits))]

    def _step_stages(self, method: str, new_page: bool) -> list[tuple[int | None, str, Callable[[], None]]]:
        """The kernels of one decode step, in order (docs/DECODE.md): (layer or None, stage, launch)."""
        s = self.stream
        stages = []
        if new_page:
            stages.append((None, "page_alloc",
                           lambda: self.page_alloc.launch(s, self.pos, self.page_table, self.next_free_page)))
        stages.append((None, "embedding", lambda: self.embedding.launch(s, self.embed_tokens, self.tokens, self.pos,
                                                                          self.h)))
        for index, layer in enumerate(self.layers):
            stages += [(index, name, launch) for name, launch in self._layer_stages(layer)]
        if method != "prompt":
            stages += [(None, name, launch) for name, launch in self._lm_head_stages()]
        stages.append((None, "sampler", lambda: self.sampler.launch(s, method, self.logits, self.sampling, self.top_k,
                                                                     self.seed, self.tokens, self.pos)))
        return stages

    def _enqueue_layer(self, layer: Layer) -> None:
        for _, launch in self._layer_stages(layer):
            launch()

    def _enqueue_lm_head(self) -> None:
        for _, launch in self._lm_head_stages():
            launch()

    def _enqueue_step(self, method: str, new_page: bool) -> None:
        """The kernels of one decode step, in order (docs/DECODE.md), on self.stream."""
        for _, _, launch in self._step_stages(method, new_page):
            launch()

    def step(self, position: int, method: str) -> None:
        """Enqueue the step of the token at `position` (it must equal the device's pos)."""
        new_page = position % PAGE_SIZE == 0
        if self.eager:
            self._enqueue_step(method, new_page)
        else:
            self.graphs[method, new_page].launch(self.stream)

    # -- prefill -------------------------------------------------------------------------------------

    def _enqueue_prefill_layer(self, layer: Layer, rows: int) -> None:
        s, b, gemm = self.stream, self.prefill_views[rows], layer.prefill
        start, m = self.chunk_start, self.chunk_rows
        self.rmsnorm_rows.launch(s, b.h, layer.input_norm, b.xn)
        gemm.qkv.launch(s, b.xn, b.qkv, rows)
        self.rope_kv_write.launch_rows(s, b.qkv, self.rope_cos, self.rope_sin, start, m, self.page_table, b.q,
                                       layer.k_pages, layer.v_pages)
        self.prefill_attention.launch(s, b.q, layer.k_pages, layer.v_pages, self.page_table, start, m, b.attn)
        gemm.o_proj.launch(s, b.attn, b.h, rows, residual=True)
        self.rmsnorm_rows.launch(s, b.h, layer.post_attention_norm, b.xn)
        gemm.gate_up.launch(s, b.xn, b.mlp, rows)
        gemm.down.launch(s, b.mlp, b.h, rows, residual=True)

    def _enqueue_prefill(self, rows: int, method: str) -> None:
        """The kernels of one prefill chunk in a bucket of `rows` rows, in order, on self.stream:
        the tokens at positions chunk_start .. chunk_start + chunk_rows - 1, then the token after
        them by `method` (the module docstring's Prefill)."""
        s = self.stream
        start, m = self.chunk_start, self.chunk_rows
        self.page_alloc_range.launch(s, start, m, self.page_table, self.next_free_page)
        self.embedding_rows.launch(s, self.embed_tokens, self.tokens, start, m, self.prefill_views[rows].h)
        for layer in self.layers:
            self._enqueue_prefill_layer(layer, rows)
        self.last_row.launch(s, self.prefill_views[rows].h, start, m, self.h, self.pos)
        if method != "prompt":
            self._enqueue_lm_head()
        self.sampler.launch(s, method, self.logits, self.sampling, self.top_k, self.seed, self.tokens, self.pos)

    def _prefill_chunk(self, start: int, m: int, method: str) -> None:
        """Enqueue the chunk of m prompt tokens at positions start.. (the device's pos is start)."""
        rows = next(bucket for bucket in self.prefill_buckets if bucket >= m)
        self.chunk.copy_to_device(np.array([start, m], np.int32), stream=self.stream)
        graph = self.prefill_graphs.get((rows, method))
        if graph is not None and not self.eager:
            graph.launch(self.stream)
            return
        self._enqueue_prefill(rows, method)
        if not self.eager:  # its kernels are compiled now: record the bucket's graph for later chunks
            self.stream.synchronize()
            self.prefill_graphs[rows, method] = capture(self.stream,
                                                        functools.partial(self._enqueue_prefill, rows, method))

    def _chunks(self, n: int, method: str) -> list[tuple[int, int, str]]:
        """(start, m, method) of each chunk of an n-token prompt: the last samples by `method`."""
        longest = self.prefill_buckets[-1]
        return [(start, min(longest, n - start), method if start + longest >= n else "prompt")
                for start in range(0, n, longest)]

    def prepare(self, prompt_tokens: int, params: SamplingParams) -> None:
        """Compile and capture, before the clock starts, the prefill graphs a prompt of this many
        tokens will replay: a bucket's first use otherwise compiles its kernels (seconds, once per
        process) inside the time to first token. Runs each missing chunk shape once on a prompt
        of zeros; generate() resets everything after. Decode graphs are ready from load."""
        if self.eager or not self.prefill_buckets:
            return
        method = method_for(params)
        for _, m, chunk_method in self._chunks(prompt_tokens, method):
            rows = next(bucket for bucket in self.prefill_buckets if bucket >= m)
            if (rows, chunk_method) not in self.prefill_graphs:
                self.reset([0] * m, params)
                self._prefill_chunk(0, m, chunk_method)
        self.stream.synchronize()

    def prefill(self, n: int, method: str, *, mode: str | None = None) -> None:
        """Run the prompt tokens[0:n] (reset() put it there) through the model and sample the
        token after it, tokens[n], by `method` (kernels/sampling.py); afterwards pos = n and the KV
        cache holds positions 0..n-1. mode: "batched" (chunks through the GEMMs) or "decode" (one
        decode step per token); by default the constructor's `prefill`."""
        mode = mode or self.prefill_mode
        if mode == "decode":
            for position in range(n - 1):
                self.step(position, "prompt")
            self.step(n - 1, method)
            return
        if mode != "batched" or not self.prefill_buckets:
            raise ValueError(f"prefill mode {mode!r} is not available (engine built with prefill="
                             f"{self.prefill_mode!r})")
        for start, m, chunk_method in self._chunks(n, method):
            self._prefill_chunk(start, m, chunk_method)

    # -- generation ----------------------------------------------------------------------------------

    def reset(self, prompt_ids, params: SamplingParams) -> None:
        """Start a sequence: the prompt in tokens[0:n], pos 0, an empty KV cache, these params."""
        ids = np.asarray(prompt_ids, dtype=np.int64)
        if ids.ndim != 1 or len(ids) == 0:
            raise NanoQwenError("the prompt has no tokens")
        if len(ids) > self.max_context:
            raise NanoQwenError(f"the prompt is {len(ids)} tokens, more than max_context {self.max_context}")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise NanoQwenError(f"token id {int(ids[(ids < 0) | (ids >= self.config.vocab_size)][0])} is outside "
                                f"the vocabulary [0, {self.config.vocab_size})")
        s = self.stream
        self.tokens[:len(ids)].copy_to_device(ids.astype(np.int32), stream=s)
        self.pos.copy_to_device(np.zeros(1, np.int32), stream=s)
        self.next_free_page.copy_to_device(np.zeros(1, np.int32), stream=s)
        for buffer, value in zip((self.sampling, self.top_k, self.seed), device_params(params)):
            buffer.copy_to_device(value, stream=s)

    def _request_token(self, index: int) -> None:
        """Start copying tokens[index] to the host (4 bytes into a pinned slot)."""
        slot = index % 2
        self.tokens[index:index + 1].copy_to_host(self.host_tokens[slot:slot + 1], stream=self.stream)
        self.token_ready[slot].record(self.stream)

    def _wait_token(self, index: int) -> int:
        slot = index % 2
        self.token_ready[slot].synchronize()
        return int(self.host_tokens[slot])

    def generate(self, prompt_ids: list[int], params: SamplingParams, max_new_tokens: int,
                 stop_ids: frozenset[int]) -> Iterator[int]:
        """generate.Backend: run the prompt, then yield each sampled id as soon as it is known."""
        n = len(prompt_ids)
        if n + max_new_tokens > self.max_context:
            raise NanoQwenError(f"{n} prompt tokens + {max_new_tokens} new ones exceed max_context "
                                f"{self.max_context}")
        method = method_for(params)
        self.reset(prompt_ids, params)
        if max_new_tokens < 1:
            return
        self.prefill(n, method)
        self._request_token(n)
        for i in range(max_new_tokens):
            position = n - 1 + i  # the step whose sampled token is tokens[position + 1]
            if i + 1 < max_new_tokens:
                self.step(position + 1, method)
                self._request_token(position + 2)
            token = self._wait_token(position + 1)
            yield token
            if token in stop_ids:
                return

    def bytes_per_step(self, context: int) -> int:
        """Bytes a decode step must read from memory at `context` cached positions: the weights
        (once) and the K and V of every layer (the roofline's numerator)."""
        cfg = self.config
        return self.weight_bytes_per_step + 2 * cfg.num_layers * context * cfg.kv_size * 2

    # -- measurement and validation helpers (bench.py, selfcheck.py, validate.py, tests/test_engine_gpu.py)

    def device_memory_used(self) -> int:
        """Bytes of device memory in use on this GPU (total - free): the engine's buffers and
        workspaces, the CUDA context and its modules, and whatever else holds memory there."""
        free, total = cuda.current_context().get_memory_info()
        return total - free

    def kernel_groups(self, context: int = 512,
                      method: str = "argmax") -> list[tuple[str, Callable[[], None], int, int]]:
        """One decode step's kernels grouped by type, for timing each group in its own CUDA graph.

        Each group is (name, enqueue, launches, bytes): enqueue() makes every launch of that type
        that one step makes (per layer, with that layer's weights, so the L2 does not keep them),
        bytes is the memory traffic they must cause (reads and writes). RoPE/KV-write and
        attention run at position `context` through a private pos and an identity page table,
        and the sampler through a private pos and tokens buffer, so no group needs a sequence;
        RoPE/KV-write does overwrite the K/V slot of position `context` of the first pages, so
        time groups between generations. Left out: page_alloc (one thread, once every 16 steps).
        Allocates its private buffers when called, never while generating.
        """
        if not 0 <= context < self.max_context:
            raise NanoQwenError(f"context {context} must be below max_context {self.max_context}")
        cfg, s, layers = self.config, self.stream, self.layers
        h, i, q_size, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.vocab_size
        qkv = q_size + 2 * cfg.kv_size
        at_context = cuda.to_device(np.array([context], np.int32), stream=s)
        identity_pages = cuda.to_device(np.arange(self.max_pages, dtype=np.int32), stream=s)
        sampler_pos = cuda.to_device(np.zeros(1, np.int32), stream=s)
        sampler_tokens = cuda.device_array(self.max_context + 1, np.int32)
        lm_head_bytes = (gemv_bytes(vocab, h) if self.lm_head_int4 else fp16_gemv_bytes(vocab, h)) + 4 * vocab
        # With fused_norm the QKV, gate-up and INT4 lm_head GEMVs read h (and their norm weight:
        # 6 bytes per input instead of 2) and only the FP16 lm_head's norm remains a kernel.
        norms = [] if self.fused_norm else [w for layer in layers for w in (layer.input_norm,
                                                                            layer.post_attention_norm)]
        norms += [] if self.lm_head_fused_norm else [self.final_norm]
        x = self.h if self.fused_norm else self.xn
        x_lm_head = self.h if self.lm_head_fused_norm else self.xn
        fused = " +rmsnorm" if self.fused_norm else ""
        extra = 4 * h if self.fused_norm else 0
        norm_group = [("rmsnorm", lambda: [self.rmsnorm.launch(s, self.h, w, self.xn) for w in norms],
                       len(norms), len(norms) * 8 * h)] if norms else []
        return [
            ("embedding", lambda: self.embedding.launch(s, self.embed_tokens, self.tokens, self.pos, self.h),
             1, 6 * h),
            *norm_group,
            (f"qkv gemv {self.gemv}{fused}", lambda: [layer.qkv.launch(s, x, self.qkv) for layer in layers],
             len(layers), len(layers) * (gemv_bytes(qkv, h) + 6 * qkv + extra)),
            ("rope_kv_write", lambda: [self.rope_kv_write.launch(s, self.qkv, self.rope_cos, self.rope_sin, at_context,
                                                                 identity_pages, self.q, layer.k_pages, layer.v_pages)
                                       for layer in layers],
             len(layers), len(layers) * (4 * qkv + 4 * q_size + 4 * cfg.kv_size + 4 * cfg.head_dim)),
            (f"attention ctx {context + 1}", lambda: [self.attention.launch(s, self.q, layer.k_pages, layer.v_pages,
                                                                            identity_pages, at_context, self.attn)
                                                      for layer in layers],
             len(layers), len(layers) * (4 * (context + 1) * cfg.kv_size + 6 * q_size)),
            (f"o_proj gemv {self.gemv}", lambda: [layer.o_proj.launch(s, self.attn, self.h, residual=True)
                                                  for layer in layers],
             len(layers), len(layers) * (gemv_bytes(h, q_size) + 8 * h)),
            (f"gate_up_silu {self.gemv}{fused}", lambda: [layer.gate_up.launch(s, x, self.mlp) for layer in layers],
             len(layers), len(layers) * (2 * gemv_bytes(i, h) + 2 * i + extra)),
            (f"down gemv {self.gemv}", lambda: [layer.down.launch(s, self.mlp, self.h, residual=True)
                                                for layer in layers],
             len(layers), len(layers) * (gemv_bytes(h, i) + 8 * h)),
            (f"lm_head {'gemv ' + self.gemv if self.lm_head_int4 else 'gemv fp16'}"
             f"{' +rmsnorm' if self.lm_head_fused_norm else ''}",
             lambda: self.lm_head.launch(s, x_lm_head, self.logits), 1, lm_head_bytes),
            (f"sampling {method}", lambda: self.sampler.launch(s, method, self.logits, self.sampling, self.top_k,
                                                               self.seed, sampler_tokens, sampler_pos),
             1, 4 * vocab),
        ]


    def teacher_forced_logits(self, token_ids) -> np.ndarray:
        """float32 logits [len(token_ids), vocab]: row p after running token_ids[0..p] (each step
        is the prompt step, then the final norm and lm_head)."""
        self.reset(token_ids, SamplingParams())
        out = np.empty((len(token_ids), self.config.vocab_size), dtype=np.float32)
        for position in range(len(token_ids)):
            self.step(position, "prompt")
            self._enqueue_lm_head()
            self.logits.copy_to_host(out[position], stream=self.stream)
        self.stream.synchronize()
        return out

    def layer_outputs(self, layer: int, hidden_states: np.ndarray) -> np.ndarray:
        """Run float32 hidden states [seq, hidden] through decoder layer `layer` alone, as the
        tokens at positions 0..seq-1 (filling that layer's KV cache); returns [seq, hidden]."""
        self.reset([0], SamplingParams())
        x = np.ascontiguousarray(hidden_states, dtype=np.float32)
        out = np.empty_like(x)
        for position in range(len(x)):
            if position % PAGE_SIZE == 0:
                self.page_alloc.launch(self.stream, self.pos, self.page_table, self.next_free_page)
            self.h.copy_to_device(x[position], stream=self.stream)
            self._enqueue_layer(self.layers[layer])
            self.h.copy_to_host(out[position], stream=self.stream)
            self.sampler.launch(self.stream, "prompt", self.logits, self.sampling, self.top_k, self.seed,
                                self.tokens, self.pos)
            self.stream.synchronize()
        return out

    def probed_step(self, first_token: int, token: int) -> dict[tuple[int | None, str], dict[str, np.ndarray]]:
        """Run first_token at position 0, then token at position 1 (greedy), eagerly, and copy to
        the host what each kernel of the second step wrote, right after it ran (selfcheck.py).

        Returns {(layer or None, stage): {buffer name: host array}} for the stages of
        _step_stages: embedding and o_proj/down -> h; rmsnorm stages -> xn; qkv -> qkv;
        rope_kv_write -> q and the layer's first KV page (k_page, v_page: positions 0 and 1);
        attention -> attn; gate_up -> mlp; lm_head -> logits; sampler -> tokens[0:3].
        """
        self.reset([first_token, token], SamplingParams())
        for _, _, launch in self._step_stages("prompt", new_page=True):
            launch()
        page = int(self.page_table[0:1].copy_to_host(stream=self.stream)[0])
        written = {"embedding": ("h",), "o_proj": ("h",), "down": ("h",), "qkv": ("qkv",), "attention": ("attn",),
                   "gate_up": ("mlp",), "lm_head": ("logits",), "input_norm": ("xn",),
                   "post_attention_norm": ("xn",), "final_norm": ("xn",)}
        captured = {}
        for layer, stage, launch in self._step_stages("argmax", new_page=False):
            launch()
            if stage == "rope_kv_write":
                buffers = {"q": self.q, "k_page": self.layers[layer].k_pages[page],
                           "v_page": self.layers[layer].v_pages[page]}
            elif stage == "sampler":
                buffers = {"tokens": self.tokens[0:3]}
            else:
                buffers = {name: getattr(self, name) for name in written[stage]}
            # Copies into pageable host memory return once done: the next kernel cannot overwrite them.
            captured[layer, stage] = {name: buffer.copy_to_host(stream=self.stream) for name, buffer in buffers.items()}
        self.stream.synchronize()
        return captured

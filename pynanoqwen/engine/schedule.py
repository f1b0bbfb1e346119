"""The schedule: which kernels one decode step or one prefill chunk launches, in which order, with what.

This module is the one place the order of a decoder layer's launches is written (`layer_launches`)
and the one place the whole forward pass is (`forward_launches`). Everything that runs the model
iterates the lists they return: the eager step and the captured CUDA graphs (backend.py,
capture.py), the prefill chunks, bench's per-kernel breakdown and the self-check's probes
(probes.py). A fusion is one edit here.

A `Launch` is one call of a kernel object's `.launch(stream, ...)` (or `.launch_rows`): its stage
name, its layer, the bound method and its arguments, the buffers it writes (what a probe copies
back), and the bytes of memory traffic it must cause (what bench divides by its time). A stage
means the same thing in both modes, so the self-check can name it:

    page_alloc -> embedding -> per layer: [input_norm] -> qkv -> [rope_kv_write] -> attention ->
    o_proj -> [post_attention_norm] -> gate_up -> down -> [last_row] -> [final_norm] -> lm_head -> sampler

How a stage launches is the mode's business: `DecodeOps` (one token: GEMVs that normalise their
own input, so no norm launches; the QKV GEMV's epilogue adds the bias, applies RoPE and writes the
position's K/V page slots, so no rope_kv_write launch; decode attention) and `PrefillOps` (the
chunk's rows: rmsnorm_rows, the tensor-core GEMMs, rope_kv_write over rows, prefill attention; then
last_row hands the chunk's last row to the decode buffers, whose lm_head and sampler finish it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ..config import ModelConfig
from ..kernels.attention_decode import make_decode_attention
from ..kernels.attention_prefill import make_prefill_attention
from ..kernels.embedding import make_embedding
from ..kernels.embedding_prefill import make_embedding_rows
from ..kernels.gemv_fp16 import fp16_gemv_bytes
from ..kernels.gemv_int4 import gemv_bytes
from ..kernels.last_row_prefill import make_last_row
from ..kernels.page_alloc import make_page_alloc
from ..kernels.page_alloc_prefill import make_page_alloc_range
from ..kernels.rmsnorm import make_rmsnorm, make_rmsnorm_rows
from ..kernels.rope_kv_write import make_rope_kv_write
from ..kernels.sampling import Sampler
from .buffers import Buffers, StepState
from .weights import DeviceLayer, DeviceWeights


@dataclasses.dataclass(frozen=True)
class Launch:
    stage: str  # e.g. "qkv", the same name in decode and prefill
    layer: int | None  # None outside the decoder layers
    launch: Callable  # a kernel object's bound launch method; called as launch(stream, *args, **kwargs)
    args: tuple
    kwargs: dict
    writes: dict  # buffer name -> the device array this launch writes (what a probe copies back)
    bytes: int  # memory traffic it must cause, reads and writes
    kernel: str = ""  # what runs, for reports: "gemv prmt +rmsnorm", "gemm"

    def run(self, stream) -> None:
        self.launch(stream, *self.args, **self.kwargs)


def run_all(launches: list[Launch], stream) -> None:
    for launch in launches:
        launch.run(stream)


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The kernels that are not linears (those live with their weights), built for one model."""

    embedding: object
    rmsnorm: object
    rope_kv_write: object
    attention: object
    page_alloc: object
    sampler: object
    # batched prefill (None without it)
    page_alloc_range: object = None
    embedding_rows: object = None
    rmsnorm_rows: object = None
    prefill_attention: object = None
    last_row: object = None

    @classmethod
    def build(cls, cfg: ModelConfig, max_pages: int, prefill: bool) -> "Kernels":
        heads, kv_heads, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        rows = dict(page_alloc_range=make_page_alloc_range(), embedding_rows=make_embedding_rows(cfg.hidden_size),
                    rmsnorm_rows=make_rmsnorm_rows(cfg.hidden_size, cfg.rms_norm_eps),
                    prefill_attention=make_prefill_attention(heads, kv_heads, hd, max_pages),
                    last_row=make_last_row(cfg.hidden_size)) if prefill else {}
        return cls(embedding=make_embedding(cfg.hidden_size), rmsnorm=make_rmsnorm(cfg.hidden_size, cfg.rms_norm_eps),
                   rope_kv_write=make_rope_kv_write(heads, kv_heads, hd),
                   attention=make_decode_attention(heads, kv_heads, hd, max_pages), page_alloc=make_page_alloc(),
                   sampler=Sampler(cfg.vocab_size), **rows)


def layer_launches(ops: "DecodeOps", index: int) -> list[Launch]:
    """Decoder layer `index` in the mode of `ops` (DecodeOps or PrefillOps), in order: the layer
    schedule, written once."""
    layer = ops.weights.layers[index]
    return [*ops.norm("input_norm", index, layer.input_norm),
            ops.qkv(index, layer),
            *ops.rope_kv_write(index),
            ops.attention(index),
            ops.o_proj(index, layer),
            *ops.norm("post_attention_norm", index, layer.post_attention_norm),
            ops.gate_up(index, layer),
            ops.down(index, layer)]


def forward_launches(ops: "DecodeOps", method: str, new_page: bool = True) -> list[Launch]:
    """One decode step (ops a DecodeOps) or one prefill chunk (a PrefillOps) and the token after it,
    sampled by `method` (kernels/sampling.py; "prompt" only advances pos, without the lm_head).
    new_page: the decode step's position starts a KV page (a prefill chunk always allocates)."""
    launches = [*ops.page_alloc(new_page), ops.embedding()]
    for index in range(len(ops.weights.layers)):
        launches += layer_launches(ops, index)
    launches += ops.last_row()
    if method != "prompt":
        launches += ops.lm_head()
    return launches + [ops.sampler(method)]


class DecodeOps:
    """How each stage launches for one token at pos (state.pos), reading the layer's KV pages
    through state.page_table. `context` only sets the attention's traffic in `Launch.bytes`."""

    def __init__(self, cfg: ModelConfig, weights: DeviceWeights, kernels: Kernels, buffers: Buffers,
                 *, state: StepState | None = None, context: int = 0):
        self.cfg, self.weights, self.kernels, self.context = cfg, weights, kernels, context
        self.buffers, self.act, self.kv = buffers, buffers.act, buffers.kv
        self.state = buffers.state if state is None else state

    def _launch(self, stage, layer, launch, args, writes, nbytes, kernel="", **kwargs) -> Launch:
        return Launch(stage, layer, launch, args, kwargs, writes, nbytes, kernel)

    def page_alloc(self, new_page: bool) -> list[Launch]:
        s = self.state
        return [self._launch("page_alloc", None, self.kernels.page_alloc.launch,
                             (s.pos, s.page_table, s.free_pages, s.next_free_page),
                             {"page_table": s.page_table, "next_free_page": s.next_free_page}, 16)] if new_page else []

    def embedding(self) -> Launch:
        h = self.cfg.hidden_size
        return self._launch("embedding", None, self.kernels.embedding.launch,
                            (self.weights.embed_tokens, self.state.tokens, self.state.pos, self.act.h),
                            {"h": self.act.h}, 6 * h)

    def norm(self, stage: str, index: int, weight) -> list[Launch]:
        return []  # the QKV and gate-up GEMVs normalise h themselves

    def qkv(self, index: int, layer: DeviceLayer) -> Launch:
        cfg, a, s = self.cfg, self.act, self.state
        h, n = cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size
        k, v = self.kv.k[index], self.kv.v[index]
        # h float32 and the norm weight (6 bytes per input, against the 2 of gemv_bytes' FP16 x), the
        # bias, q written (float32), the position's K and V (FP16) and its RoPE angles.
        return self._launch("qkv", index, layer.qkv.launch_rope,
                            (a.h, a.q, k, v, s.page_table, s.pos, self.buffers.rope_cos, self.buffers.rope_sin),
                            {"q": a.q, "k_pages": k, "v_pages": v},
                            gemv_bytes(n, h) + 4 * h + 2 * n + 4 * cfg.q_size + 4 * cfg.kv_size + 4 * cfg.head_dim,
                            f"gemv {layer.qkv.path} +rmsnorm +rope")

    def rope_kv_write(self, index: int) -> list[Launch]:
        return []  # the QKV GEMV's epilogue does it

    def attention(self, index: int) -> Launch:
        cfg, a, s = self.cfg, self.act, self.state
        return self._launch("attention", index, self.kernels.attention.launch,
                            (a.q, self.kv.k[index], self.kv.v[index], s.page_table, s.pos, a.attn), {"attn": a.attn},
                            4 * (self.context + 1) * cfg.kv_size + 6 * cfg.q_size, f"decode ctx {self.context + 1}")

    def o_proj(self, index: int, layer: DeviceLayer) -> Launch:
        h = self.cfg.hidden_size
        return self._launch("o_proj", index, layer.o_proj.launch, (self.act.attn, self.act.h), {"h": self.act.h},
                            gemv_bytes(h, self.cfg.q_size) + 8 * h, f"gemv {layer.o_proj.path}", residual=True)

    def gate_up(self, index: int, layer: DeviceLayer) -> Launch:
        h, i = self.cfg.hidden_size, self.cfg.intermediate_size
        return self._launch("gate_up", index, layer.gate_up.launch, (self.act.h, self.act.mlp), {"mlp": self.act.mlp},
                            2 * gemv_bytes(i, h) + 4 * h + 2 * i, f"gemv {layer.gate_up.path} +rmsnorm")

    def down(self, index: int, layer: DeviceLayer) -> Launch:
        h = self.cfg.hidden_size
        return self._launch("down", index, layer.down.launch, (self.act.mlp, self.act.h), {"h": self.act.h},
                            gemv_bytes(h, self.cfg.intermediate_size) + 8 * h, f"gemv {layer.down.path}", residual=True)

    def last_row(self) -> list[Launch]:
        return []  # the step's h is already the decode buffer

    def lm_head(self) -> list[Launch]:
        """The final norm (a launch only for the FP16 lm_head, which does not normalise) and the lm_head."""
        cfg, a, w = self.cfg, self.act, self.weights
        h, vocab = cfg.hidden_size, cfg.vocab_size
        if w.lm_head_int4:
            return [self._launch("lm_head", None, w.lm_head.launch, (a.h, a.logits), {"logits": a.logits},
                                 gemv_bytes(vocab, h) + 4 * h + 4 * vocab, f"gemv {w.lm_head.path} +rmsnorm")]
        return [self._launch("final_norm", None, self.kernels.rmsnorm.launch, (a.h, w.final_norm, a.xn), {"xn": a.xn},
                             8 * h, "rmsnorm"),
                self._launch("lm_head", None, w.lm_head.launch, (a.xn, a.logits), {"logits": a.logits},
                             fp16_gemv_bytes(vocab, h) + 4 * vocab, "gemv fp16")]

    def sampler(self, method: str) -> Launch:
        s = self.state
        return self._launch("sampler", None, self.kernels.sampler.launch,
                            (method, self.act.logits, s.sampling, s.top_k, s.seed, s.tokens, s.pos),
                            {"tokens": s.tokens, "pos": s.pos}, 4 * self.cfg.vocab_size, method)


class PrefillOps(DecodeOps):
    """How each stage launches for the rows of one prefill chunk in the bucket of `rows` rows: the
    tokens at positions start .. start + m - 1, (start, m) in device memory (buffers.chunk), rows
    m..rows-1 padding (computed by the GEMMs, never written to the KV cache, never read). The head
    (final norm, lm_head, sampler) is decode's, inherited: last_row has put the chunk's last row
    into the decode buffers and set pos, so the first token is drawn as after token-by-token prefill."""

    def __init__(self, cfg: ModelConfig, weights: DeviceWeights, kernels: Kernels, buffers: Buffers, rows: int,
                 *, state: StepState | None = None):
        super().__init__(cfg, weights, kernels, buffers, state=state)
        self.rows, self.b = rows, buffers.prefill[rows]
        self.start, self.m = buffers.chunk[0:1], buffers.chunk[1:2]

    def _gemm(self, n: int, k: int, out_bytes: int, matrices: int = 1) -> int:
        """Weights once, the rows' inputs once, their outputs (read and written when accumulating)."""
        return matrices * (gemv_bytes(n, k) - 2 * k) + self.rows * (2 * k + out_bytes * n)

    def page_alloc(self, new_page: bool) -> list[Launch]:
        s = self.state
        return [self._launch("page_alloc", None, self.kernels.page_alloc_range.launch,
                             (self.start, self.m, s.page_table, s.free_pages, s.next_free_page),
                             {"page_table": s.page_table, "next_free_page": s.next_free_page}, 16)]

    def embedding(self) -> Launch:
        return self._launch("embedding", None, self.kernels.embedding_rows.launch,
                            (self.weights.embed_tokens, self.state.tokens, self.start, self.m, self.b.h),
                            {"h": self.b.h}, self.rows * 6 * self.cfg.hidden_size, "rows")

    def norm(self, stage: str, index: int, weight) -> list[Launch]:
        h = self.cfg.hidden_size
        return [self._launch(stage, index, self.kernels.rmsnorm_rows.launch, (self.b.h, weight, self.b.xn),
                             {"xn": self.b.xn}, self.rows * 6 * h + 2 * h, "rmsnorm rows")]

    def qkv(self, index: int, layer: DeviceLayer) -> Launch:
        n = self.cfg.q_size + 2 * self.cfg.kv_size
        return self._launch("qkv", index, layer.prefill.qkv.launch, (self.b.xn, self.b.qkv, self.rows),
                            {"qkv": self.b.qkv}, self._gemm(n, self.cfg.hidden_size, 4) + 2 * n, "gemm",
                            workspace=self.buffers.split)

    def rope_kv_write(self, index: int) -> list[Launch]:
        cfg, b, s = self.cfg, self.b, self.state
        k, v = self.kv.k[index], self.kv.v[index]
        n = cfg.q_size + 2 * cfg.kv_size
        return [self._launch("rope_kv_write", index, self.kernels.rope_kv_write.launch_rows,
                             (b.qkv, self.buffers.rope_cos, self.buffers.rope_sin, self.start, self.m, s.page_table,
                              b.q, k, v), {"q": b.q, "k_pages": k, "v_pages": v},
                             self.rows * (4 * n + 4 * cfg.q_size + 4 * cfg.kv_size + 4 * cfg.head_dim), "rows")]

    def attention(self, index: int) -> Launch:
        cfg, b, s = self.cfg, self.b, self.state
        # From start 0: the chunk's K and V once, q read, attn written.
        return self._launch("attention", index, self.kernels.prefill_attention.launch,
                            (b.q, self.kv.k[index], self.kv.v[index], s.page_table, self.start, self.m, b.attn),
                            {"attn": b.attn}, self.rows * (4 * cfg.kv_size + 6 * cfg.q_size), "prefill")

    def o_proj(self, index: int, layer: DeviceLayer) -> Launch:
        h = self.cfg.hidden_size
        return self._launch("o_proj", index, layer.prefill.o_proj.launch, (self.b.attn, self.b.h, self.rows),
                            {"h": self.b.h}, self._gemm(h, self.cfg.q_size, 8), "gemm", residual=True,
                            workspace=self.buffers.split)

    def gate_up(self, index: int, layer: DeviceLayer) -> Launch:
        h, i = self.cfg.hidden_size, self.cfg.intermediate_size
        return self._launch("gate_up", index, layer.prefill.gate_up.launch, (self.b.xn, self.b.mlp, self.rows),
                            {"mlp": self.b.mlp}, self._gemm(i, h, 2, matrices=2), "gemm")

    def down(self, index: int, layer: DeviceLayer) -> Launch:
        h = self.cfg.hidden_size
        return self._launch("down", index, layer.prefill.down.launch, (self.b.mlp, self.b.h, self.rows),
                            {"h": self.b.h}, self._gemm(h, self.cfg.intermediate_size, 8), "gemm", residual=True,
                            workspace=self.buffers.split)

    def last_row(self) -> list[Launch]:
        a, s = self.act, self.state
        return [self._launch("last_row", None, self.kernels.last_row.launch, (self.b.h, self.start, self.m, a.h, s.pos),
                             {"h": a.h, "pos": s.pos}, 8 * self.cfg.hidden_size + 8)]

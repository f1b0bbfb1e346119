"""The numpy reference model: a Qwen2 forward pass over the dequantized weights of a .nanoqwen file.

It is the oracle for every GPU kernel (the standalone functions below are what kernel tests compare
against) and the engine of `generate --device cpu`. tests/test_reference.py proves it against
transformers' Qwen2ForCausalLM (float64, eager attention) on the `tiny` preset.

One decoder layer, for the tokens x [seq, hidden] at positions p .. p+seq-1:

    h = rms_norm(x, input_norm);  q, k, v = h @ Wq.T + bq, h @ Wk.T + bk, h @ Wv.T + bv
    q, k = apply_rope(q, k at positions);  append k, v to the KV cache
    x = x + causal_attention(q, K cache, V cache) @ Wo.T
    h = rms_norm(x, post_attention_norm);  x = x + (silu(h @ Wg.T) * (h @ Wu.T)) @ Wd.T

then logits = rms_norm(x, final_norm) @ lm_head.T.

Precision: activations, weights and matmuls are float32 (BLAS). float64 where a float32 sum would be
the largest error in the model: the mean of squares in RMSNorm, the RoPE angles (position * inv_freq
reaches 32767 rad; transformers' float32 angles are off by up to 2.4e-3 rad there, measured at
head_dim 128, theta 1e6), the softmax (max, exp and sum over the context), and SiLU (cheap, and
then exact to float32 rounding).

Memory: weights are dequantized from the source one layer at a time (`cache_layers=False`), so a
7B model needs about one layer of float32 weights (0.93 GB; 1.4 GB peak RSS measured while one is
dequantized) plus the KV cache, not 30 GB. The price is time: dequantizing one 7B layer took 8 s
on a busy 2-core machine, so the 7B model decodes at minutes per token. Long prompts go through
each layer in token blocks sized to keep the attention scores and MLP activations under
ACTIVATION_BUDGET bytes; short prompts are one matmul per linear for all tokens. The KV cache grows
in KV_CHUNK-token steps up to `max_context`, so a 32k context costs memory only once it is used.
The lm_head is applied LM_HEAD_ROWS vocabulary rows at a time for the same reason.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np

from .config import ModelConfig
from .errors import NanoQwenError
from .quant import dequantize_int4, quantize_int4
from .tensors import QWEIGHT, SCALES, layer_prefix, stored_tensors

ACTIVATION_BUDGET = 256 * 2**20  # bytes of temporaries one block of prompt tokens may use per layer
KV_CHUNK = 256                   # the KV cache grows by whole multiples of this many positions
LM_HEAD_ROWS = 16384             # vocabulary rows of lm_head dequantized at once (235 MB at 7B)
CACHE_LAYERS_BELOW = 2 * 2**30   # cache_layers defaults on when the float32 weights are smaller


# ----------------------------------------------------------------------------------------------
# Where the weights come from

class WeightSource(Protocol):
    """What the reference model reads: a .nanoqwen file (fileformat.NanoQwenFile) or InMemoryWeights.

    `tensor(name)` returns the stored tensor under its .nanoqwen name (tensors.stored_tensors):
    `<hf name>.qweight` / `<hf name>.scales` for INT4 linears, the HF name for FP16 tensors.
    """

    config: ModelConfig
    lm_head_int4: bool

    def tensor(self, name: str) -> np.ndarray: ...


@dataclasses.dataclass(frozen=True)
class InMemoryWeights:
    """A WeightSource holding numpy arrays: what a .nanoqwen file would store, without the file."""

    config: ModelConfig
    lm_head_int4: bool
    tensors: Mapping[str, np.ndarray]

    @property
    def names(self) -> list[str]:
        return list(self.tensors)

    def tensor(self, name: str) -> np.ndarray:
        return self.tensors[name]

    @classmethod
    def quantize(cls, cfg: ModelConfig, hf_weights: Mapping[str, np.ndarray],
                 lm_head_int4: bool) -> "InMemoryWeights":
        """Store HF float tensors as `convert` does: INT4 linears (quant.quantize_int4), FP16 the rest.

        With tied embeddings an INT4 lm_head is quantized from model.embed_tokens.weight.
        """
        def hf_tensor(name: str) -> np.ndarray:
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                name = "model.embed_tokens.weight"
            return np.asarray(hf_weights[name])

        stored = stored_tensors(cfg, lm_head_int4)
        tensors: dict[str, np.ndarray] = {}
        for name in stored:
            if name.endswith(QWEIGHT):
                hf_name = name[: -len(QWEIGHT)]
                tensors[name], tensors[hf_name + SCALES] = quantize_int4(hf_tensor(hf_name))
            elif not name.endswith(SCALES):
                tensors[name] = hf_tensor(name).astype(np.float16)
        for name, (_, shape) in stored.items():
            if tensors[name].shape != shape:
                raise ValueError(f"{name}: shape {tensors[name].shape}, expected {shape}")
        return cls(cfg, lm_head_int4, tensors)


@dataclasses.dataclass(frozen=True)
class LayerWeights:
    """One decoder layer in float32; linear weights are [out_features, in_features] as HF stores them."""

    input_norm: np.ndarray
    q_proj: np.ndarray
    q_bias: np.ndarray
    k_proj: np.ndarray
    k_bias: np.ndarray
    v_proj: np.ndarray
    v_bias: np.ndarray
    o_proj: np.ndarray
    post_attention_norm: np.ndarray
    gate_proj: np.ndarray
    up_proj: np.ndarray
    down_proj: np.ndarray


def dequantize_linear(weights: WeightSource, name: str, rows: slice = slice(None)) -> np.ndarray:
    """The float32 [N, K] weight of the INT4 linear `name` (an HF name ending in .weight), or some rows."""
    return dequantize_int4(weights.tensor(name + QWEIGHT)[rows], weights.tensor(name + SCALES)[rows])


def load_layer(weights: WeightSource, layer: int) -> LayerWeights:
    """Dequantize decoder layer `layer` of `weights` to float32."""
    p = layer_prefix(layer)

    def fp32(name: str) -> np.ndarray:
        return np.asarray(weights.tensor(p + name), dtype=np.float32)

    def linear(module: str) -> np.ndarray:
        return dequantize_linear(weights, p + module + ".weight")

    return LayerWeights(
        input_norm=fp32("input_layernorm.weight"),
        q_proj=linear("self_attn.q_proj"), q_bias=fp32("self_attn.q_proj.bias"),
        k_proj=linear("self_attn.k_proj"), k_bias=fp32("self_attn.k_proj.bias"),
        v_proj=linear("self_attn.v_proj"), v_bias=fp32("self_attn.v_proj.bias"),
        o_proj=linear("self_attn.o_proj"),
        post_attention_norm=fp32("post_attention_layernorm.weight"),
        gate_proj=linear("mlp.gate_proj"), up_proj=linear("mlp.up_proj"),
        down_proj=linear("mlp.down_proj"),
    )


def layer_nbytes(cfg: ModelConfig) -> int:
    """Bytes of one decoder layer in float32 (what cache_layers=False holds at a time)."""
    per_layer = sum(n * k for n, k in cfg.linear_shapes.values())
    per_layer += 2 * cfg.hidden_size + cfg.q_size + 2 * cfg.kv_size  # norms and biases
    return 4 * per_layer


def dequantized_nbytes(cfg: ModelConfig) -> int:
    """Bytes of every decoder layer and the lm_head in float32 (what cache_layers=True keeps)."""
    return cfg.num_layers * layer_nbytes(cfg) + 4 * cfg.vocab_size * cfg.hidden_size


# ----------------------------------------------------------------------------------------------
# The operations, standalone: each is the numpy oracle of a GPU kernel. All return float32.

def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x * weight / sqrt(mean(x^2) + eps) over the last axis; the mean of squares in float64."""
    x64 = np.asarray(x, dtype=np.float64)
    inv_rms = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    return (x64 * inv_rms * np.asarray(weight, dtype=np.float64)).astype(np.float32)


def rope_tables(head_dim: int, theta: float, positions: np.ndarray | Sequence[int]
                ) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin), each float32 [len(positions), head_dim], of the HF Qwen2 rotary embedding.

    inv_freq[i] = theta^(-2i/head_dim) for i < head_dim/2, angle = position * inv_freq, computed in
    float64; both halves of a row hold the same angles (HF's cat(freqs, freqs)), matching apply_rope.
    """
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.outer(np.asarray(positions, dtype=np.float64), inv_freq)
    angles = np.concatenate([angles, angles], axis=-1)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate x [..., heads, head_dim] by cos, sin [..., head_dim] (one row per leading index of x).

    HF's rotate_half convention: element i pairs with element i + head_dim/2 (not with i + 1):
    out[:d/2] = x1 cos - x2 sin, out[d/2:] = x2 cos + x1 sin, where x1, x2 = x[:d/2], x[d/2:].
    """
    x = np.asarray(x, dtype=np.float32)
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[..., None, :] + rotated * sin[..., None, :]


def causal_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray) -> np.ndarray:
    """Grouped-query causal attention of q [seq, heads, hd] against caches [ctx, kv_heads, hd].

    The queries are the last `seq` positions of the cache: query i sits at ctx - seq + i and sees
    keys 0 .. ctx - seq + i. Query head h reads kv head h // (heads // kv_heads) (HF's repeat_kv).
    Scores are float32 matmuls scaled by 1/sqrt(hd); the softmax is float64; returns [seq, heads, hd].
    """
    seq, heads, hd = q.shape
    ctx, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    q_grouped = np.asarray(q, dtype=np.float32).reshape(seq, kv_heads, group, hd).transpose(1, 2, 0, 3)
    keys = np.asarray(k_cache, dtype=np.float32).transpose(1, 2, 0)      # [kv_heads, hd, ctx]
    values = np.asarray(v_cache, dtype=np.float32).transpose(1, 0, 2)    # [kv_heads, ctx, hd]
    scores = (q_grouped @ keys[:, None]).astype(np.float64) / math.sqrt(hd)  # [kv, group, seq, ctx]
    query_pos = np.arange(ctx - seq, ctx)
    scores[..., np.arange(ctx)[None, :] > query_pos[:, None]] = -np.inf
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    out = probs.astype(np.float32) @ values[:, None]                        # [kv, group, seq, hd]
    return out.transpose(2, 0, 1, 3).reshape(seq, heads, hd)


def attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray) -> np.ndarray:
    """One decode query q [heads, hd] against the whole cache [ctx, kv_heads, hd] -> [heads, hd]."""
    return causal_attention(q[None], k_cache, v_cache)[0]


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x), in float64; sigmoid from exp(-|x|), which never overflows for any input."""
    x64 = np.asarray(x, dtype=np.float64)
    e = np.exp(-np.abs(x64))
    sigmoid = np.where(x64 >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    return (x64 * sigmoid).astype(np.float32)


def linear_int4(x: np.ndarray, qweight: np.ndarray, scales: np.ndarray,
                bias: np.ndarray | None = None) -> np.ndarray:
    """x [..., K] @ dequantize_int4(qweight, scales).T (+ bias): the INT4 GEMV/GEMM, in float32."""
    y = np.asarray(x, dtype=np.float32) @ dequantize_int4(qweight, scales).T
    return y if bias is None else y + np.asarray(bias, dtype=np.float32)


def mlp(x: np.ndarray, w: LayerWeights) -> np.ndarray:
    """The SiLU-gated MLP of normalised x [..., hidden]: (silu(x Wg.T) * x Wu.T) Wd.T."""
    return (silu(x @ w.gate_proj.T) * (x @ w.up_proj.T)) @ w.down_proj.T


def decoder_layer(x: np.ndarray, w: LayerWeights, cfg: ModelConfig, k_cache: np.ndarray,
                  v_cache: np.ndarray, position: int) -> np.ndarray:
    """One decoder layer for x [seq, hidden] at positions position .. position+seq-1.

    Writes the rotated keys and the values into k_cache, v_cache [>= position+seq, kv_heads, hd]
    (this layer's slice of the model's cache) and returns the new residual stream [seq, hidden].
    """
    seq = x.shape[0]
    heads, kv_heads, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    cos, sin = rope_tables(hd, cfg.rope_theta, np.arange(position, position + seq))
    h = rms_norm(x, w.input_norm, cfg.rms_norm_eps)
    q = apply_rope((h @ w.q_proj.T + w.q_bias).reshape(seq, heads, hd), cos, sin)
    k = apply_rope((h @ w.k_proj.T + w.k_bias).reshape(seq, kv_heads, hd), cos, sin)
    end = position + seq
    k_cache[position:end] = k
    v_cache[position:end] = (h @ w.v_proj.T + w.v_bias).reshape(seq, kv_heads, hd)
    attn = causal_attention(q, k_cache[:end], v_cache[:end])
    x = x + attn.reshape(seq, heads * hd) @ w.o_proj.T
    return x + mlp(rms_norm(x, w.post_attention_norm, cfg.rms_norm_eps), w)


def prompt_block(cfg: ModelConfig, context: int) -> int:
    """How many tokens go through a layer at once so that temporaries stay under ACTIVATION_BUDGET.

    Per token: float64 attention scores over `context` keys (plus the float64 probabilities and
    their float32 copy), and three float32 intermediate-size MLP activations.
    """
    per_token = cfg.num_heads * context * (8 + 8 + 4) + 3 * 4 * cfg.intermediate_size
    return max(1, ACTIVATION_BUDGET // per_token)


# ----------------------------------------------------------------------------------------------
# The model

class ReferenceModel:
    """Qwen2 in numpy with a KV cache. `forward` appends tokens at `position` and returns logits.

    cache_layers: keep every dequantized layer (and lm_head) in memory after first use; by default
    on when they total under CACHE_LAYERS_BELOW bytes, otherwise each forward dequantizes one layer
    at a time from `weights` (a file's mmap) and drops it before the next.
    """

    def __init__(self, weights: WeightSource, *, max_context: int | None = None,
                 cache_layers: bool | None = None):
        cfg = weights.config
        if max_context is None:
            max_context = cfg.max_position_embeddings
        if not 0 < max_context <= cfg.max_position_embeddings:
            raise NanoQwenError(f"max_context {max_context} must be between 1 and the model's "
                                f"max_position_embeddings {cfg.max_position_embeddings}")
        if cache_layers is None:
            cache_layers = dequantized_nbytes(cfg) < CACHE_LAYERS_BELOW
        self.weights = weights
        self.config = cfg
        self.max_context = max_context
        self.cache_layers = cache_layers
        self._layers: dict[int, LayerWeights] = {}
        self._lm_head: np.ndarray | None = None
        self.reset()

    def reset(self) -> None:
        """Empty the KV cache (and give its memory back)."""
        self.position = 0
        cfg = self.config
        shape = (cfg.num_layers, 0, cfg.num_kv_heads, cfg.head_dim)
        self.k_cache = np.zeros(shape, dtype=np.float32)
        self.v_cache = np.zeros(shape, dtype=np.float32)

    def load_kv(self, k: np.ndarray, v: np.ndarray) -> None:
        """Start from a KV cache that already holds positions 0..p-1: k, v float32
        [num_layers, p, num_kv_heads, head_dim], e.g. pages a prefix cache kept. The next forward
        runs at position p."""
        p = k.shape[1]
        if p > self.max_context:
            raise NanoQwenError(f"{p} cached positions exceed max_context {self.max_context}")
        self.reset()
        self._grow_kv_cache(p)
        self.k_cache[:, :p] = k
        self.v_cache[:, :p] = v
        self.position = p

    def forward(self, tokens: Sequence[int], *, last_only: bool = False, row_by_row: bool = False) -> np.ndarray:
        """Run `tokens` at positions position.. and append them to the KV cache.

        Returns float32 logits [len(tokens), vocab], or [1, vocab] for the last token only when
        last_only (what sampling after a long prompt needs, without a [prompt, vocab] array).

        row_by_row: every matrix product on one row at a time, so that each row's logits are bit
        for bit those of running the tokens one forward call each (numpy's float32 matmul rounds
        differently for different numbers of rows). Prompt lookup's verify pass needs that to be
        lossless; the layers are still dequantized once for all the rows.
        """
        hidden = self.forward_hidden(tokens, row_by_row=row_by_row)
        return self.logits(hidden[-1:] if last_only else hidden, row_by_row=row_by_row)

    def rewind(self, position: int) -> None:
        """Forget positions position.. of the KV cache (a verify pass's rejected draft tokens): the
        next forward runs at `position` and overwrites them."""
        if not 0 <= position <= self.position:
            raise ValueError(f"cannot rewind to position {position}: the cache holds {self.position}")
        self.position = position

    def forward_hidden(self, tokens: Sequence[int], *, row_by_row: bool = False) -> np.ndarray:
        """Like forward, but returns the final-normed hidden states [len(tokens), hidden] (lm_head input)."""
        ids = self._check_tokens(tokens)
        cfg = self.config
        start, end = self.position, self.position + len(ids)
        self._grow_kv_cache(end)
        x = np.asarray(self.weights.tensor("model.embed_tokens.weight")[ids], dtype=np.float32)
        block = 1 if row_by_row else prompt_block(cfg, end)
        for layer in range(cfg.num_layers):
            w = self.layer_weights(layer)
            for first in range(0, len(ids), block):
                rows = slice(first, first + block)
                x[rows] = decoder_layer(x[rows], w, cfg, self.k_cache[layer], self.v_cache[layer],
                                        start + first)
        self.position = end
        return rms_norm(x, self.weights.tensor("model.norm.weight"), cfg.rms_norm_eps)

    def logits(self, hidden: np.ndarray, *, row_by_row: bool = False) -> np.ndarray:
        """lm_head: hidden [seq, hidden_size] -> float32 logits [seq, vocab] (row_by_row: as forward's)."""
        def product(weight: np.ndarray) -> np.ndarray:
            if row_by_row:
                return np.concatenate([hidden[row:row + 1] @ weight.T for row in range(len(hidden))])
            return hidden @ weight.T

        if self._lm_head is None and self.cache_layers:
            self._lm_head = self.lm_head_rows(slice(0, self.config.vocab_size))
        if self._lm_head is not None:
            return product(self._lm_head)
        vocab = self.config.vocab_size
        out = np.empty((hidden.shape[0], vocab), dtype=np.float32)
        for first in range(0, vocab, LM_HEAD_ROWS):
            rows = slice(first, min(first + LM_HEAD_ROWS, vocab))
            out[:, rows] = product(self.lm_head_rows(rows))
        return out

    def lm_head_rows(self, rows: slice) -> np.ndarray:
        """Rows of the lm_head weight in float32: INT4 dequantized, or the FP16 (possibly tied) table."""
        if self.weights.lm_head_int4:
            return dequantize_linear(self.weights, "lm_head.weight", rows)
        name = "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"
        return np.asarray(self.weights.tensor(name)[rows], dtype=np.float32)

    def layer_weights(self, layer: int) -> LayerWeights:
        """Decoder layer `layer` dequantized to float32 (kept when cache_layers is on)."""
        if layer in self._layers:
            return self._layers[layer]
        w = load_layer(self.weights, layer)
        if self.cache_layers:
            self._layers[layer] = w
        return w

    def _check_tokens(self, tokens: Sequence[int]) -> np.ndarray:
        if len(tokens) == 0:
            raise NanoQwenError("no tokens to run: the prompt is empty")
        ids = np.asarray(tokens)
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise NanoQwenError(f"tokens must be a flat sequence of integer ids, got dtype {ids.dtype} "
                                f"shape {ids.shape}")
        vocab = self.config.vocab_size
        outside = ids[(ids < 0) | (ids >= vocab)]
        if outside.size:
            raise NanoQwenError(f"token id {int(outside[0])} is outside the vocabulary [0, {vocab})")
        if self.position + len(ids) > self.max_context:
            raise NanoQwenError(f"prompt/context too long: {self.position} tokens in the cache + "
                                f"{len(ids)} new exceed max_context {self.max_context}")
        return ids.astype(np.int64)

    def _grow_kv_cache(self, needed: int) -> None:
        """Make the KV cache hold `needed` positions: double it, in KV_CHUNK steps, up to max_context."""
        capacity = self.k_cache.shape[1]
        if needed <= capacity:
            return
        grown = max(needed, 2 * capacity)
        grown = min(self.max_context, -(-grown // KV_CHUNK) * KV_CHUNK)
        for name in ("k_cache", "v_cache"):
            old = getattr(self, name)
            new = np.zeros((old.shape[0], grown) + old.shape[2:], dtype=np.float32)
            new[:, :capacity] = old
            setattr(self, name, new)

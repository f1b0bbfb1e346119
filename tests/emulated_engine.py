"""A numpy stand-in for the GPU engine's probes (backends.GpuEngine.probed_step, probed_prefill),
written here from the engine's documented buffers and dtypes (docs/DECODE.md, engine/probes.py):
h float32, xn float16, qkv and q float32, the KV cache float16, attn and the MLP product float16,
logits float32. Its arithmetic is float64 rounded to those types, so it is what a correct engine
produces up to the kernels' own rounding; options make it compute what a broken kernel would.
"""

import math

import numpy as np

from pynanoqwen.kernels import PAGE_SIZE
from pynanoqwen.quant import dequantize_int4
from pynanoqwen.reference import rope_tables
from pynanoqwen.tensors import QWEIGHT, SCALES, layer_prefix


def f16(x):
    return np.asarray(x, np.float32).astype(np.float16)


class Emulation:
    """One sequence through the model, rows at a time, with the engine's buffer types."""

    def __init__(self, weights, *, rope_shift: int = 0, attend_all: bool = True, prefill: bool = False):
        self.weights, self.cfg, self.prefill = weights, weights.config, prefill
        self.rope_shift, self.attend_all = rope_shift, attend_all  # a wrong angle; attention skipping key 0
        cfg = self.cfg
        self.k = np.zeros((cfg.num_layers, 0, cfg.num_kv_heads, cfg.head_dim), np.float16)
        self.v = self.k.copy()

    def linear(self, name, x):
        w = dequantize_int4(self.weights.tensor(name + QWEIGHT), self.weights.tensor(name + SCALES), np.float64)
        return np.asarray(x, np.float64) @ w.T

    def norm(self, h, name):
        h64 = h.astype(np.float64)
        return f16(h64 / np.sqrt(np.mean(h64 * h64, axis=-1, keepdims=True) + self.cfg.rms_norm_eps)
                   * self.weights.tensor(name).astype(np.float64))

    def layer(self, layer: int, h: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, dict]:
        """Layer `layer` on rows h [rows, hidden] at `positions`: (output rows, {stage: buffers})."""
        cfg, p = self.cfg, layer_prefix(layer)
        heads, kv_heads, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        stages = {}
        xn = self.norm(h, p + "input_layernorm.weight")
        stages["input_norm"] = {"xn": xn}
        qkv = np.concatenate([self.linear(f"{p}self_attn.{m}_proj.weight", xn)
                              + self.weights.tensor(f"{p}self_attn.{m}_proj.bias") for m in "qkv"], 1)
        qkv = qkv.astype(np.float32)
        stages["qkv"] = {"qkv": qkv}
        cos, sin = (t[:, None, :hd // 2] for t in rope_tables(hd, cfg.rope_theta, positions + self.rope_shift))
        parts = qkv.reshape(len(h), heads + 2 * kv_heads, hd)
        x1, x2 = parts[..., :hd // 2], parts[..., hd // 2:]
        rotated = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(np.float32)
        if self.k.shape[1] < positions[-1] + 1:
            grow = positions[-1] + 1 - self.k.shape[1]
            pad = np.zeros((cfg.num_layers, grow, kv_heads, hd), np.float16)
            self.k, self.v = np.concatenate([self.k, pad], 1), np.concatenate([self.v, pad], 1)
        self.k[layer, positions] = f16(rotated[:, heads:heads + kv_heads])
        self.v[layer, positions] = f16(parts[:, heads + kv_heads:])
        stages["rope_kv_write"] = {"q": rotated[:, :heads].copy(), "k": self.k[layer].copy(), "v": self.v[layer].copy()}
        attn = np.empty((len(h), heads * hd), np.float16)
        for row, position in enumerate(positions):
            first_key = 0 if self.attend_all or position == 0 else 1
            keys = self.k[layer, first_key:position + 1].astype(np.float64)
            values = self.v[layer, first_key:position + 1].astype(np.float64)
            # In log2 units, as both kernels compute; the prefill kernel feeds the tensor cores FP16 q.
            q = rotated[row, :heads] * np.float32(math.log2(math.e) / math.sqrt(hd))
            q = (f16(q) if self.prefill else q).astype(np.float64).reshape(kv_heads, heads // kv_heads, hd)
            scores = np.einsum("kgd,ckd->kgc", q, keys)
            probs = np.exp2(scores - scores.max(-1, keepdims=True))
            attn[row] = f16((np.einsum("kgc,ckd->kgd", probs, values) / probs.sum(-1)[..., None]).reshape(-1))
        stages["attention"] = {"attn": attn}
        h = (h + self.linear(p + "self_attn.o_proj.weight", attn)).astype(np.float32)
        stages["o_proj"] = {"h": h.copy()}
        xn = self.norm(h, p + "post_attention_layernorm.weight")
        stages["post_attention_norm"] = {"xn": xn}
        g, u = self.linear(p + "mlp.gate_proj.weight", xn), self.linear(p + "mlp.up_proj.weight", xn)
        mlp = f16(g / (1 + np.exp(-g)) * u)
        stages["gate_up"] = {"mlp": mlp}
        h = (h + self.linear(p + "mlp.down_proj.weight", mlp)).astype(np.float32)
        stages["down"] = {"h": h.copy()}
        return h, stages

    def embed(self, tokens) -> np.ndarray:
        return self.weights.tensor("model.embed_tokens.weight")[np.asarray(tokens)].astype(np.float32)

    def head(self, h: np.ndarray) -> tuple[np.ndarray, dict]:
        """The final norm and lm_head of one row h [hidden]: (logits, {stage: buffers})."""
        cfg = self.cfg
        xn = self.norm(h, "model.norm.weight")
        stages = {"final_norm": {"xn": xn}}
        if self.weights.lm_head_int4:
            logits = self.linear("lm_head.weight", xn)
        else:
            table = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
            logits = self.weights.tensor(table).astype(np.float64) @ xn.astype(np.float64)
        stages["lm_head"] = {"logits": logits.astype(np.float32)}
        return stages["lm_head"]["logits"], stages


def _keep(captured: dict, layer, stages: dict, row_shape, fused_norm: bool) -> None:
    for stage, buffers in stages.items():
        if fused_norm and stage.endswith("norm"):
            continue
        captured[layer, stage] = {name: array if name in ("k", "v") else row_shape(array)
                                  for name, array in buffers.items()}


def emulate_probed_step(weights, first: int, token: int, *, fused_norm: bool = True, rope_position: int = 1,
                        attend_all: bool = True) -> dict:
    """What probed_step returns: the step at position 1 after `first` at 0. fused_norm=False: as
    an engine with norm kernels of its own would (their xn captured too). rope_position: the
    angle the broken RoPE uses; attend_all=False: attention that ignores key 0."""
    emulation = Emulation(weights)
    h = emulation.embed([first])
    for layer in range(weights.config.num_layers):
        h, _ = emulation.layer(layer, h, np.array([0]))
    emulation.rope_shift, emulation.attend_all = rope_position - 1, attend_all
    captured = {}
    h = emulation.embed([token])
    captured[None, "embedding"] = {"h": h[0].copy()}
    for layer in range(weights.config.num_layers):
        h, stages = emulation.layer(layer, h, np.array([1]))
        stages["qkv"] = stages.pop("rope_kv_write")  # decode's QKV GEMV rotates and writes K/V itself
        _keep(captured, layer, stages, lambda a: a[0], fused_norm)
    logits, stages = emulation.head(h[0])
    _keep(captured, None, stages, lambda a: a, fused_norm and weights.lm_head_int4)
    captured[None, "sampler"] = {"tokens": np.array([first, token, int(np.argmax(logits))], np.int32),
                                 "pos": np.array([2], np.int32)}
    return captured


def emulate_probed_prefill(weights, prompt: list[int], *, attend_all: bool = True, last_row: int = -1) -> dict:
    """What probed_prefill returns for `prompt` as one chunk. attend_all=False: attention that
    ignores key 0; last_row: the row a broken last_row hands over."""
    emulation = Emulation(weights, attend_all=attend_all, prefill=True)
    m = len(prompt)
    pages = -(-m // PAGE_SIZE)
    captured = {(None, "page_alloc"): {"page_table": np.arange(pages + 3, dtype=np.int32),
                                       "next_free_page": np.array([pages], np.int32)}}
    h = emulation.embed(prompt)
    captured[None, "embedding"] = {"h": h.copy()}
    positions = np.arange(m)
    for layer in range(weights.config.num_layers):
        h, stages = emulation.layer(layer, h, positions)
        _keep(captured, layer, stages, lambda a: a, fused_norm=False)
    handed = h[last_row].copy()
    captured[None, "last_row"] = {"h": handed, "pos": np.array([m - 1], np.int32)}
    logits, stages = emulation.head(handed)
    _keep(captured, None, stages, lambda a: a, weights.lm_head_int4)
    tokens = np.zeros(m + 1, np.int32)
    tokens[:m], tokens[m] = prompt, int(np.argmax(logits))
    captured[None, "sampler"] = {"tokens": tokens, "pos": np.array([m], np.int32)}
    return captured


class EmulatedEngine:
    """The probes of backends.GpuEngine from the emulation, on (possibly broken) weights."""

    gemv = "prmt"
    max_context = 64
    rows_sum_alike = True
    buckets = (32, 1024)  # as the 7B's first two of GpuEngine.probe_buckets: 1024 runs the TMA-fed tiles

    def __init__(self, weights, bucket_weights=None):
        self.weights = weights
        self.bucket_weights = bucket_weights or {}  # rows -> the weights that bucket's (broken) kernels see

    def probed_step(self, first, token):
        return emulate_probed_step(self.weights, first, token)

    def probed_prefill(self, token_ids, rows=None):
        return emulate_probed_prefill(self.bucket_weights.get(rows, self.weights), list(token_ids))

    def probe_buckets(self, probe_tokens, prompt_tokens=None):
        return list(self.buckets)

    def prepare(self, prompt_tokens, params):
        """The emulation compiles nothing."""

    def close(self):
        """It holds nothing beyond garbage-collected memory."""

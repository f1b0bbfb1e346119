"""A model's weights on the device, and the linear-algebra objects built over them.

Each tensor of the source goes to the device in one host-to-device copy (for a file, straight from
its mmap); nothing is converted. The q, k and v projections of a layer (rows and biases) are copied
into their slices of one QKV matrix, so that QKV is one GEMV and one GEMM. Over the same arrays the
loader builds the decode GEMVs (kernels/gemv_int4.py, the GEMV path chosen at load; the QKV,
gate-up and INT4 lm_head ones apply their RMSNorm themselves) and, for batched prefill, the
tensor-core GEMMs (kernels/gemm_int4.py): two views of one copy of the weights.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from numba import cuda

from ..config import GROUP_SIZE, ModelConfig
from ..kernels.gemm_int4 import make_gate_up_silu_gemm, make_gemm_int4
from ..kernels.gemv_fp16 import make_gemv_fp16
from ..kernels.gemv_int4 import make_gate_up_silu, make_gemv_int4
from ..tensors import QWEIGHT, SCALES, layer_prefix
from .memory import stored_nbytes


@dataclasses.dataclass(frozen=True)
class PrefillLinears:
    """A layer's INT4 GEMMs for batched prefill, over the decode GEMVs' weight arrays."""

    qkv: object
    o_proj: object
    gate_up: object
    down: object


@dataclasses.dataclass(frozen=True)
class DeviceLayer:
    """One decoder layer on the device: its norm weights and its linears (GEMVs, and GEMMs)."""

    input_norm: object  # float16 [hidden]
    post_attention_norm: object
    qkv: object  # RMSNorm(h) -> q, k, v (+ bias): one GEMV over the packed QKV matrix
    o_proj: object  # attn -> h += ...
    gate_up: object  # RMSNorm(h) -> silu(gate) * up
    down: object  # mlp -> h += ...
    prefill: PrefillLinears | None  # None when the engine was built without batched prefill


@dataclasses.dataclass(frozen=True)
class DeviceWeights:
    """Every weight of the model on the device."""

    embed_tokens: object  # float16 [vocab, hidden]
    final_norm: object  # float16 [hidden]
    layers: list[DeviceLayer]
    lm_head: object  # INT4 GEMV reading RMSNorm(h), or FP16 GEMV (maybe over embed_tokens) reading xn
    lm_head_int4: bool
    bytes_per_step: int  # what one decode step reads of them (the roofline's weight term)


def load_weights(source, cfg: ModelConfig, gemv: str, stream, *, prefill: bool) -> DeviceWeights:
    """Copy `source` (a NanoQwenFile or any reference.WeightSource) to the device and build its
    linears for the GEMV path `gemv` (and the prefill GEMMs when `prefill`). Returns once every
    copy has finished: the caller may close a file's mmap right after."""

    def copy(name: str):
        return cuda.to_device(source.tensor(name), stream=stream)

    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    qkv_rows = (("q_proj", slice(0, q)), ("k_proj", slice(q, q + kv)), ("v_proj", slice(q + kv, q + 2 * kv)))
    final_norm = copy("model.norm.weight")
    embed_tokens = copy("model.embed_tokens.weight")
    layers = []
    for index in range(cfg.num_layers):
        p = layer_prefix(index)
        qkv_q = cuda.device_array((q + 2 * kv, h // 8), np.uint32)
        qkv_s = cuda.device_array((q + 2 * kv, h // GROUP_SIZE), np.float16)
        qkv_bias = cuda.device_array(q + 2 * kv, np.float16)
        for module, rows in qkv_rows:
            name = f"{p}self_attn.{module}"
            qkv_q[rows].copy_to_device(source.tensor(name + ".weight" + QWEIGHT), stream=stream)
            qkv_s[rows].copy_to_device(source.tensor(name + ".weight" + SCALES), stream=stream)
            qkv_bias[rows].copy_to_device(source.tensor(name + ".bias"), stream=stream)

        def linear(module: str):
            return copy(p + module + ".weight" + QWEIGHT), copy(p + module + ".weight" + SCALES)

        o_q, o_s = linear("self_attn.o_proj")
        gate_q, gate_s = linear("mlp.gate_proj")
        up_q, up_s = linear("mlp.up_proj")
        down_q, down_s = linear("mlp.down_proj")
        input_norm = copy(p + "input_layernorm.weight")
        post_attention_norm = copy(p + "post_attention_layernorm.weight")
        layers.append(DeviceLayer(
            input_norm=input_norm,
            post_attention_norm=post_attention_norm,
            qkv=make_gemv_int4(q + 2 * kv, h, qkv_q, qkv_s, path=gemv, bias=qkv_bias, norm_weight=input_norm,
                               norm_eps=cfg.rms_norm_eps, rope_heads=(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)),
            o_proj=make_gemv_int4(h, q, o_q, o_s, path=gemv),
            gate_up=make_gate_up_silu(i, h, gate_q, gate_s, up_q, up_s, path=gemv, norm_weight=post_attention_norm,
                                      norm_eps=cfg.rms_norm_eps),
            down=make_gemv_int4(h, i, down_q, down_s, path=gemv),
            prefill=PrefillLinears(
                qkv=make_gemm_int4(q + 2 * kv, h, qkv_q, qkv_s, bias=qkv_bias),
                o_proj=make_gemm_int4(h, q, o_q, o_s),
                gate_up=make_gate_up_silu_gemm(i, h, gate_q, gate_s, up_q, up_s),
                down=make_gemm_int4(h, i, down_q, down_s)) if prefill else None))

    # A step reads every stored byte but the embedding table, of which it reads one row, unless
    # the table is also the (tied, FP16) lm_head.
    stored = stored_nbytes(cfg, source.lm_head_int4)
    embed_bytes = stored["model.embed_tokens.weight"]
    bytes_per_step = sum(stored.values()) - embed_bytes + 2 * h
    if source.lm_head_int4:
        lm_head = make_gemv_int4(cfg.vocab_size, h, copy("lm_head.weight" + QWEIGHT), copy("lm_head.weight" + SCALES),
                                 path=gemv, norm_weight=final_norm, norm_eps=cfg.rms_norm_eps)
    elif cfg.tie_word_embeddings:  # the FP16 lm_head *is* the embedding table: no second copy
        lm_head = make_gemv_fp16(cfg.vocab_size, h, embed_tokens)
        bytes_per_step += embed_bytes
    else:
        lm_head = make_gemv_fp16(cfg.vocab_size, h, copy("lm_head.weight"))
    stream.synchronize()
    return DeviceWeights(embed_tokens, final_norm, layers, lm_head, source.lm_head_int4, bytes_per_step)

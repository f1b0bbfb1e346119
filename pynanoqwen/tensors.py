"""Which tensors a Qwen2 checkpoint holds and which a .nanoqwen file stores, with dtypes and shapes.

The converter checks a checkpoint against `hf_tensors`, the file reader checks a file against
`stored_tensors`; both are derived from the config alone, so nothing else needs a list of names.
Quantized linears are stored as two tensors, `<name>.qweight` (uint32 [N, K/8], ValueShuffle
layout, see quant.py) and `<name>.scales` (float16 [N, K/128]).
"""

from __future__ import annotations

from .config import GROUP_SIZE, ModelConfig

QWEIGHT, SCALES = ".qweight", ".scales"


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def hf_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in a Hugging Face Qwen2ForCausalLM checkpoint."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size)}
    for layer in range(cfg.num_layers):
        p = layer_prefix(layer)
        shapes[p + "input_layernorm.weight"] = (cfg.hidden_size,)
        shapes[p + "post_attention_layernorm.weight"] = (cfg.hidden_size,)
        for module, shape in cfg.linear_shapes.items():
            shapes[p + module + ".weight"] = shape
        shapes[p + "self_attn.q_proj.bias"] = (cfg.q_size,)
        shapes[p + "self_attn.k_proj.bias"] = (cfg.kv_size,)
        shapes[p + "self_attn.v_proj.bias"] = (cfg.kv_size,)
    shapes["model.norm.weight"] = (cfg.hidden_size,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    return shapes


def is_quantized(name: str, lm_head_int4: bool) -> bool:
    """Whether the HF tensor `name` is stored as INT4 (every linear weight; lm_head if asked)."""
    if name == "lm_head.weight":
        return lm_head_int4
    return name.endswith("_proj.weight")


def stored_tensors(cfg: ModelConfig, lm_head_int4: bool) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Name -> (dtype, shape) of every tensor in a .nanoqwen file, in file order.

    dtype is "uint32" for packed INT4 words and "float16" for everything else. With tied
    embeddings, an INT4 lm_head is a quantized copy of embed_tokens; an FP16 one is not stored.
    """
    hf = hf_tensors(cfg)
    if lm_head_int4 and cfg.tie_word_embeddings:
        hf["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, shape in hf.items():
        if is_quantized(name, lm_head_int4):
            n, k = shape
            out[name + QWEIGHT] = ("uint32", (n, k // 8))
            out[name + SCALES] = ("float16", (n, k // GROUP_SIZE))
        else:
            out[name] = ("float16", shape)
    return out

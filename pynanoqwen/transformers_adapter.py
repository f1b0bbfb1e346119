"""transformers' Qwen2 on a .nanoqwen file's weights, in float64: the reference model's own oracle.

validate's reference tier and tests/test_tiny_coder.py hold the numpy reference (reference.py)
against it. It needs torch and transformers (`pip install pynanoqwen[validate]`), imported here
only: `missing()` names the first of them that is not installed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math

import numpy as np

from .quant import dequantize_int4
from .tensors import QWEIGHT, SCALES, hf_tensors, layer_prefix

INSTALL_HINT = "pip install pynanoqwen[validate]"


def missing() -> str | None:
    """The first of torch and transformers that is not installed, or None."""
    return next((name for name in ("torch", "transformers") if importlib.util.find_spec(name) is None), None)


def dequantized_hf_weights(weights) -> tuple:
    """(config transformers should use, {HF name: float64 array}) of a .nanoqwen file's weights.

    A tied model with an INT4 lm_head computes with dequantize(quantize(embed)), not embed, so
    transformers must hold it as an untied model.
    """
    cfg = weights.config
    hf_cfg = dataclasses.replace(cfg, tie_word_embeddings=cfg.tie_word_embeddings and not weights.lm_head_int4)
    out = {}
    for name in hf_tensors(hf_cfg):
        if name.endswith("_proj.weight") or (name == "lm_head.weight" and weights.lm_head_int4):
            out[name] = dequantize_int4(weights.tensor(name + QWEIGHT), weights.tensor(name + SCALES), np.float64)
        else:
            out[name] = np.asarray(weights.tensor(name), dtype=np.float64)
    return hf_cfg, out


def transformers_model(weights):
    """transformers' Qwen2ForCausalLM in float64, eager attention, holding the file's dequantized weights."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hf_cfg, tensors = dequantized_hf_weights(weights)
    model = Qwen2ForCausalLM._from_config(Qwen2Config(**hf_cfg.to_hf_dict()), attn_implementation="eager",
                                          dtype=torch.float64)
    state = {name: torch.from_numpy(w) for name, w in tensors.items()}
    if hf_cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    return model.eval()


def transformers_logits(model, prompt: list[int]) -> np.ndarray:
    """float64 logits [len(prompt), vocab] of one prompt, without a KV cache."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([prompt]), use_cache=False).logits[0].numpy()


def transformers_layer_outputs(weights, layer: int, x: np.ndarray) -> np.ndarray:
    """transformers' Qwen2DecoderLayer (float64, eager) on hidden states x [seq, hidden] at positions 0.."""
    import torch
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

    cfg = weights.config
    config = Qwen2Config(**cfg.to_hf_dict())
    config._attn_implementation = "eager"
    module = Qwen2DecoderLayer(config, layer_idx=layer).to(torch.float64).eval()
    prefix = layer_prefix(layer)
    state = {}
    for name in module.state_dict():
        full = prefix + name
        if full.endswith("_proj.weight"):
            state[name] = dequantize_int4(weights.tensor(full + QWEIGHT), weights.tensor(full + SCALES), np.float64)
        else:
            state[name] = np.asarray(weights.tensor(full), dtype=np.float64)
    module.load_state_dict({name: torch.from_numpy(w) for name, w in state.items()}, strict=True)
    seq = len(x)
    hidden = torch.from_numpy(np.asarray(x, dtype=np.float64))[None]
    positions = torch.arange(seq)[None]
    cos_sin = Qwen2RotaryEmbedding(config)(hidden, positions)
    causal = torch.full((seq, seq), -math.inf, dtype=torch.float64).triu(1)[None, None]
    with torch.no_grad():
        out = module(hidden, attention_mask=causal, position_ids=positions, position_embeddings=cos_sin)
    return out[0].numpy()


def transformers_greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy continuations of equal-length prompts, all in one batch, with transformers' KV cache."""
    import torch

    ids = torch.tensor(prompts)
    out_tokens = []
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        for step in range(new_tokens):
            ids = out.logits[:, -1].argmax(dim=-1, keepdim=True)
            out_tokens.append(ids[:, 0])
            if step + 1 < new_tokens:
                out = model(input_ids=ids, use_cache=True, **_cache_argument(out))
    return torch.stack(out_tokens, dim=1).tolist()


def _cache_argument(out) -> dict:
    """The KV cache a model output hands to the next call: transformers 5.2x calls it `cache`,
    earlier versions (5.17 on the GPU machine) `past_key_values`."""
    return {"cache": out.cache} if hasattr(out, "cache") else {"past_key_values": out.past_key_values}

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
from .reference import layer_nbytes
from .tensors import QWEIGHT, SCALES, is_quantized, layer_prefix

INSTALL_HINT = "pip install pynanoqwen[validate]"
ROW_BLOCK = 4096  # rows of a tensor dequantized at once while a model is filled


def missing() -> str | None:
    """The first of torch and transformers that is not installed, or None."""
    return next((name for name in ("torch", "transformers") if importlib.util.find_spec(name) is None), None)


def float64_bytes(cfg) -> int:
    """Bytes of the float64 transformers model of `cfg` (its parameters; a tied lm_head once)."""
    tables = (1 if cfg.tie_word_embeddings else 2) * cfg.vocab_size * cfg.hidden_size
    return 2 * cfg.num_layers * layer_nbytes(cfg) + 8 * (tables + cfg.hidden_size)


def fill_block_bytes(cfg) -> int:
    """What filling a parameter holds at once: its largest block of rows (at most ROW_BLOCK) in
    float64, with numpy's temporaries of the dequantization (4x)."""
    shapes = list(cfg.linear_shapes.values()) + [(cfg.vocab_size, cfg.hidden_size)]
    return 4 * 8 * max(min(ROW_BLOCK, n) * k for n, k in shapes)


def _fill(parameter, weights, name: str) -> None:
    """Copy the stored tensor `name` (HF name) into a float64 parameter, ROW_BLOCK rows at a time:
    an INT4 linear dequantized exactly, an FP16 tensor widened. No float64 copy of the whole
    tensor is ever made, so building a model costs its parameters plus one block."""
    import torch

    quantized = is_quantized(name, weights.lm_head_int4)
    rows = parameter.shape[0]
    with torch.no_grad():
        for first in range(0, rows, ROW_BLOCK):
            block = slice(first, min(first + ROW_BLOCK, rows))
            if quantized:
                values = dequantize_int4(weights.tensor(name + QWEIGHT)[block], weights.tensor(name + SCALES)[block],
                                         np.float64)
            else:
                values = np.asarray(weights.tensor(name)[block], dtype=np.float64)
            parameter[block] = torch.from_numpy(values)


def transformers_model(weights):
    """transformers' Qwen2ForCausalLM in float64, eager attention, holding the file's dequantized
    weights, filled in place (float64_bytes of memory, plus one block).

    A tied model with an INT4 lm_head computes with dequantize(quantize(embed)), not embed, so
    transformers must hold it as an untied model.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = weights.config
    hf_cfg = dataclasses.replace(cfg, tie_word_embeddings=cfg.tie_word_embeddings and not weights.lm_head_int4)
    model = Qwen2ForCausalLM._from_config(Qwen2Config(**hf_cfg.to_hf_dict()), attn_implementation="eager",
                                          dtype=torch.float64)
    for name, parameter in model.named_parameters():  # a tied lm_head is the embedding's parameter
        _fill(parameter, weights, name)
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
    for name, parameter in module.named_parameters():
        _fill(parameter, weights, layer_prefix(layer) + name)
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

"""Random Qwen2 checkpoints in the Hugging Face layout, for tests and benchmarks of any preset.

`make_checkpoint` writes what `Qwen2ForCausalLM.save_pretrained` plus a tokenizer would:
config.json, generation_config.json, tokenizer.json, tokenizer_config.json (with Qwen2.5-Instruct's
ChatML chat template) and the weights as safetensors, one model.safetensors or numbered shards
with model.safetensors.index.json when they exceed the shard size.

Weights: N(0, 0.02) for embeddings, lm_head and linears, 1 + N(0, 0.02) for RMSNorm weights,
N(0, 0.02) for the QKV biases. Each tensor has its own generator seeded by (seed, tensor index),
so its values do not depend on the dtype or the sharding.

Why the safetensors writer is our own 40 lines: numpy has no bfloat16, so `safetensors.numpy`
cannot save BF16, and it takes the whole model as one dict. The format is simple (8-byte
little-endian header length, a JSON header giving each tensor's dtype, shape and byte range, then
the raw data), and since every shape is known from the config before any value is drawn, the
header is written first and each tensor is then generated and written in row blocks: making the
7B checkpoint (15 GB in BF16) takes memory near one block, not one tensor, let alone the model.
BF16 is float32 rounded to nearest-even on its upper 16 bits. Measured: the 7B preset (15.23 GB,
4 shards) took 294 s at a peak RSS of 183 MB on a 2-core CPU shared with other jobs.

The tokenizer is a byte-level BPE trained in about a second on the Python standard library's
top-level modules (sorted, so the same machine always makes the same tokenizer), with Qwen2's
pre-tokenizer regex and Qwen2.5's special tokens at ids 0..8. Its vocabulary is a few thousand
tokens; config.json keeps the preset's vocab_size, so ids past the tokenizer's are never produced.
bos/eos in config.json are this tokenizer's <|endoftext|> and <|im_end|> ids.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from pathlib import Path

import numpy as np

from .config import ModelConfig, preset
from .tensors import hf_tensors

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_prefix|>", "<|fim_middle|>",
                  "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")
DTYPES = {"bf16": ("BF16", 2), "fp16": ("F16", 2), "fp32": ("F32", 4)}  # our name -> (safetensors name, bytes)
DEFAULT_SHARD_BYTES = 5_000_000_000  # save_pretrained's max_shard_size="5GB"
INIT_STD = 0.02
BLOCK_ELEMENTS = 1 << 22  # values generated and written per step (16 MB of float32)
MAX_TOKENIZER_VOCAB = 4096

# Qwen2's split regex, as in the pre_tokenizer of Qwen2.5's tokenizer.json.
QWEN2_SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                       r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# The chat_template of Qwen2.5-Instruct's tokenizer_config.json, verbatim.
QWEN25_CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def make_checkpoint(model: ModelConfig | str, out_dir: str | Path, *, seed: int = 0, dtype: str = "bf16",
                    shard_bytes: int = DEFAULT_SHARD_BYTES) -> ModelConfig:
    """Write a random checkpoint of `model` (a config or a preset name) into out_dir.

    Returns the config written to config.json: `model` with bos/eos set to the tokenizer's ids.
    """
    cfg = preset(model) if isinstance(model, str) else model.validate()
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    from tokenizers import Tokenizer

    tokenizer_json = trained_tokenizer_json(min(cfg.vocab_size * 15 // 16, MAX_TOKENIZER_VOCAB))
    tokenizer = Tokenizer.from_str(tokenizer_json)
    cfg = dataclasses.replace(cfg, bos_token_id=tokenizer.token_to_id("<|endoftext|>"),
                              eos_token_id=tokenizer.token_to_id("<|im_end|>"))
    hf_config = cfg.to_hf_dict()
    hf_config["torch_dtype"] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[dtype]
    _write_json(out / "config.json", hf_config)
    _write_json(out / "generation_config.json", generation_config(cfg))
    (out / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    _write_json(out / "tokenizer_config.json", tokenizer_config(cfg))
    write_random_weights(cfg, out, seed=seed, dtype=dtype, shard_bytes=shard_bytes)
    return cfg


@functools.cache
def trained_tokenizer_json(vocab_size: int) -> str:
    """train_tokenizer(vocab_size) as tokenizer.json text, trained once per process (tests make many)."""
    return train_tokenizer(vocab_size).to_str(pretty=True)


def train_tokenizer(vocab_size: int):
    """A byte-level BPE with Qwen2's pre-tokenizer and Qwen2.5's special tokens at ids 0..8."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    stdlib = Path(os.__file__).parent
    texts = [path.read_text(encoding="utf-8", errors="replace") for path in sorted(stdlib.glob("*.py"))]
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def tokenizer_config(cfg: ModelConfig) -> dict:
    """tokenizer_config.json as Qwen2.5-Instruct ships it, for our special tokens."""
    added = {str(i): {"content": tok, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for i, tok in enumerate(SPECIAL_TOKENS)}
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "bos_token": None,
        "chat_template": QWEN25_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": cfg.max_position_embeddings,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


QWEN_SAMPLING = {"temperature": 0.7, "top_p": 0.8, "top_k": 20}  # Qwen2.5-Instruct's generation_config.json


def generation_config(cfg: ModelConfig) -> dict:
    """Qwen2.5-Instruct's sampling defaults, with our token ids."""
    return {"bos_token_id": cfg.bos_token_id, "pad_token_id": cfg.bos_token_id,
            "eos_token_id": [cfg.eos_token_id, cfg.bos_token_id], "do_sample": True,
            "repetition_penalty": 1.05, **QWEN_SAMPLING}


def write_random_weights(cfg: ModelConfig, out_dir: Path, *, seed: int, dtype: str,
                         shard_bytes: int) -> list[Path]:
    """Write every tensor of hf_tensors(cfg) as safetensors; returns the files written."""
    st_dtype, itemsize = DTYPES[dtype]
    shapes = hf_tensors(cfg)
    seeds = {name: index for index, name in enumerate(shapes)}
    shards: list[list[str]] = [[]]
    shard_size = 0
    for name, shape in shapes.items():  # greedy: start a new shard when this tensor would overflow
        nbytes = math.prod(shape) * itemsize
        if shards[-1] and shard_size + nbytes > shard_bytes:
            shards.append([])
            shard_size = 0
        shards[-1].append(name)
        shard_size += nbytes

    if len(shards) == 1:
        files = [out_dir / "model.safetensors"]
    else:
        files = [out_dir / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for path, names in zip(files, shards):
        with open(path, "wb") as f:
            f.write(safetensors_header({name: shapes[name] for name in names}, st_dtype, itemsize))
            for name in names:
                rng = np.random.default_rng([seed, seeds[name]])
                for block in _random_blocks(name, shapes[name], rng):
                    f.write(memoryview(encode(block, dtype)).cast("B"))
    if len(files) > 1:
        total = sum(math.prod(shape) for shape in shapes.values()) * itemsize
        _write_json(out_dir / "model.safetensors.index.json", {
            "metadata": {"total_size": total},
            "weight_map": {name: path.name for path, names in zip(files, shards) for name in names},
        })
    return files


def safetensors_header(shapes: dict[str, tuple[int, ...]], st_dtype: str, itemsize: int) -> bytes:
    """Length prefix + JSON header for tensors laid out back to back in the given order."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        end = offset + math.prod(shape) * itemsize
        header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # data starts 8-byte aligned, as the safetensors library writes it
    return len(text).to_bytes(8, "little") + text


def encode(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values -> the little-endian array stored for `dtype` (bf16 as uint16 bit patterns)."""
    if dtype == "bf16":
        return float32_to_bf16_bits(values)
    return np.ascontiguousarray(values, dtype="<f2" if dtype == "fp16" else "<f4")


def float32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """Round float32 to the nearest bfloat16 (ties to even) and return its 16 bits as uint16.

    Adding 0x7FFF plus the lowest kept bit to the 32-bit pattern carries into the upper half exactly
    when the dropped half is above one half ULP, or equal to it with an odd kept part.
    """
    bits = np.ascontiguousarray(values, dtype="<f4").view("<u4")
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    return (rounded >> np.uint32(16)).astype("<u2")


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """uint16 bfloat16 bit patterns -> float32 (exact: bf16 is the upper half of a float32)."""
    return (np.asarray(bits, dtype="<u2").astype("<u4") << np.uint32(16)).view("<f4")


def _random_blocks(name: str, shape: tuple[int, ...], rng: np.random.Generator):
    """The tensor's float32 values in row blocks of about BLOCK_ELEMENTS."""
    row = math.prod(shape[1:])
    rows_per_block = max(1, BLOCK_ELEMENTS // row)
    for start in range(0, shape[0], rows_per_block):
        rows = min(rows_per_block, shape[0] - start)
        block = rng.standard_normal((rows,) + tuple(shape[1:]), dtype=np.float32)
        block *= np.float32(INIT_STD)
        if name.endswith("norm.weight"):
            block += np.float32(1.0)
        yield block


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")

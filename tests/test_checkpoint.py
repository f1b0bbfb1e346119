"""Random HF checkpoints (checkpoint.py): transformers and the safetensors library must read what we
write, BF16 rounding must match torch's, and the tokenizer must carry Qwen2.5's special tokens."""

import dataclasses
import json
import math

import numpy as np
import pytest
from tokenizers import Tokenizer

from pynanoqwen.checkpoint import (QWEN25_CHAT_TEMPLATE, SPECIAL_TOKENS, bf16_bits_to_float32,
                                   float32_to_bf16_bits, make_checkpoint, train_tokenizer,
                                   trained_tokenizer_json)
from pynanoqwen.config import PRESETS, ModelConfig
from pynanoqwen.tensors import hf_tensors

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    return out, make_checkpoint("tiny", out, seed=1)


def test_tokenizer_special_tokens_and_round_trip():
    tok = Tokenizer.from_str(trained_tokenizer_json(1920))  # tiny's tokenizer
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert tok.get_vocab_size() == 1920
    text = ('import os\n\ndef spam(eggs: int = 42) -> str:\n    """Ünïcödé ✓ 漢字 🚀."""\n'
            '\treturn f"{eggs!r:>10}"  # tabs, quotes, emoji\r\n')
    ids = tok.encode(text).ids
    assert tok.decode(ids, skip_special_tokens=False) == text
    code = "    def __init__(self, path):\n        return self.path\n"
    assert len(tok.encode(code).ids) < len(code) // 3  # common Python merged into few tokens: it was trained
    chat = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    chat_ids = tok.encode(chat).ids
    assert chat_ids[0] == 1 and 2 in chat_ids and chat_ids.count(1) == 2  # special tokens stay whole
    assert tok.decode(chat_ids, skip_special_tokens=False) == chat


def test_tokenizer_is_deterministic():
    assert train_tokenizer(1920).to_str(pretty=True) == trained_tokenizer_json(1920)


def test_checkpoint_files_and_config(tiny_dir):
    out, cfg = tiny_dir
    assert cfg == dataclasses.replace(PRESETS["tiny"], bos_token_id=0, eos_token_id=2)
    assert ModelConfig.from_hf_dir(out) == cfg
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_cfg["chat_template"] == QWEN25_CHAT_TEMPLATE
    assert tok_cfg["eos_token"] == "<|im_end|>" and tok_cfg["pad_token"] == "<|endoftext|>"
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [2, 0]


def test_big_preset_config_uses_tokenizer_ids(tmp_path, monkeypatch):
    # The weights of a 7B are out of reach here; the config and tokenizer are what differs by preset.
    monkeypatch.setattr("pynanoqwen.checkpoint.write_random_weights", lambda *args, **kwargs: [])
    cfg = make_checkpoint("7b", tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert (hf["vocab_size"], hf["bos_token_id"], hf["eos_token_id"]) == (152064, 0, 2)
    assert cfg == dataclasses.replace(PRESETS["7b"], bos_token_id=0, eos_token_id=2)


def test_transformers_loads_checkpoint_and_chat_template(tiny_dir):
    transformers = pytest.importorskip("transformers")
    out, cfg = tiny_dir
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    params = dict(model.named_parameters())
    assert set(params) == set(hf_tensors(cfg))
    emb = params["model.embed_tokens.weight"].detach().numpy()
    assert abs(emb.std() - 0.02) < 0.001 and abs(emb.mean()) < 0.001
    norm = params["model.layers.0.input_layernorm.weight"].detach().numpy()
    assert abs(norm.mean() - 1.0) < 0.01 and 0.01 < norm.std() < 0.03

    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.eos_token_id == 2 and tok.pad_token_id == 0
    text = tok.apply_chat_template([{"role": "user", "content": "print(1)"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
                    "assistant.<|im_end|>\n<|im_start|>user\nprint(1)<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("dtype, torch_dtype", [("bf16", "bfloat16"), ("fp16", "float16"), ("fp32", "float32")])
def test_sharded_checkpoint_matches_single_file(tmp_path, dtype, torch_dtype):
    """Sharding changes the files, never the values; safetensors' own reader agrees with the index."""
    from safetensors import safe_open

    cfg = dataclasses.replace(PRESETS["tiny"], tie_word_embeddings=True)
    make_checkpoint(cfg, tmp_path / "single", seed=3, dtype=dtype)
    make_checkpoint(cfg, tmp_path / "sharded", seed=3, dtype=dtype, shard_bytes=700_000)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and set(index["weight_map"]) == set(hf_tensors(cfg))
    itemsize = 4 if dtype == "fp32" else 2
    assert index["metadata"]["total_size"] == sum(math.prod(s) for s in hf_tensors(cfg).values()) * itemsize

    with safe_open(tmp_path / "single" / "model.safetensors", framework="pt") as single:
        assert set(single.keys()) == set(hf_tensors(cfg))
        for shard in shards:
            with safe_open(tmp_path / "sharded" / shard, framework="pt") as part:
                for name in part.keys():
                    assert index["weight_map"][name] == shard
                    a, b = single.get_tensor(name), part.get_tensor(name)
                    assert a.dtype == getattr(torch, torch_dtype) and tuple(a.shape) == hf_tensors(cfg)[name]
                    assert torch.equal(a, b)


def test_values_do_not_depend_on_dtype(tmp_path):
    """Each tensor has its own seeded generator: the BF16 file is the FP32 file rounded."""
    from safetensors import safe_open

    cfg = PRESETS["tiny"]
    make_checkpoint(cfg, tmp_path / "f32", seed=5, dtype="fp32")
    make_checkpoint(cfg, tmp_path / "b16", seed=5, dtype="bf16")
    with safe_open(tmp_path / "f32" / "model.safetensors", framework="pt") as f32, \
         safe_open(tmp_path / "b16" / "model.safetensors", framework="pt") as b16:
        for name in ("model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight", "model.norm.weight"):
            assert torch.equal(f32.get_tensor(name).to(torch.bfloat16), b16.get_tensor(name))


def test_bf16_rounding_matches_torch():
    rng = np.random.default_rng(11)
    x = np.concatenate([
        (rng.standard_normal(100_000) * rng.choice([1e-30, 1e-3, 1.0, 1e30], 100_000)).astype(np.float32),
        # exact ties between two bf16 values (lower 16 bits = 0x8000), both even and odd kept parts
        (rng.integers(0, 2**16, 1000, dtype=np.uint32) << 16 | 0x8000).astype(np.uint32).view(np.float32),
        np.array([0.0, -0.0, np.inf, -np.inf, 3.3895314e38], dtype=np.float32),
    ])
    x = x[~np.isnan(x)]  # NaN payloads differ between implementations; they never reach a file
    ours = float32_to_bf16_bits(x)
    theirs = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(ours, theirs)
    np.testing.assert_array_equal(bf16_bits_to_float32(ours), torch.from_numpy(theirs.view(np.int16))
                                  .view(torch.bfloat16).float().numpy())

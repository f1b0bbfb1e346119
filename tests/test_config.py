"""ModelConfig from config.json: what we accept, what we refuse, and the presets."""

import dataclasses

import pytest

from pynanoqwen.config import PRESETS, ModelConfig, preset
from pynanoqwen.errors import ConfigError


def test_presets_round_trip_through_hf_config():
    for name, cfg in PRESETS.items():
        assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg, name


def test_transformers5_rope_parameters_are_read():
    """transformers 5's save_pretrained nests rope_theta in rope_parameters: it must not fall back
    to 10000 silently (the real Qwen2.5 value is 1e6)."""
    hf = PRESETS["7b"].to_hf_dict()
    del hf["rope_theta"]
    hf["rope_parameters"] = {"rope_type": "default", "rope_theta": 1_000_000.0}
    assert ModelConfig.from_hf_dict(hf).rope_theta == 1_000_000.0
    hf["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 4.0}
    with pytest.raises(ConfigError, match="yarn"):
        ModelConfig.from_hf_dict(hf)


@pytest.mark.parametrize("edit, message", [
    ({"model_type": "llama"}, "model_type"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"intermediate_size": 18900}, "group size"),
    ({"num_key_value_heads": 5}, "multiple"),
    ({"hidden_size": "big"}, "malformed"),
])
def test_unsupported_configs_are_refused(edit, message):
    hf = {**PRESETS["7b"].to_hf_dict(), **edit}
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict(hf)


def test_missing_key_and_unknown_preset():
    hf = PRESETS["tiny"].to_hf_dict()
    del hf["vocab_size"]
    with pytest.raises(ConfigError, match="vocab_size"):
        ModelConfig.from_hf_dict(hf)
    with pytest.raises(ConfigError, match="unknown preset"):
        preset("13b")


@pytest.mark.parametrize("edit, message", [
    ({"num_attention_heads": 0}, "malformed num_attention_heads: expected a positive integer, got 0"),
    ({"num_key_value_heads": 0}, "malformed num_key_value_heads: expected a positive integer, got 0"),
    ({"hidden_size": 256.7}, "malformed hidden_size: expected a positive integer, got 256.7"),
    ({"hidden_size": 3584.0}, "malformed hidden_size: expected a positive integer, got 3584.0"),
    ({"hidden_size": "3584"}, "malformed hidden_size: expected a positive integer, got '3584'"),
    ({"hidden_size": True}, "malformed hidden_size: expected a positive integer, got True"),
    ({"intermediate_size": -18944}, "malformed intermediate_size"),
    ({"num_hidden_layers": [28]}, "malformed num_hidden_layers"),
    ({"vocab_size": 2**31}, "vocab_size 2147483648 is beyond 2147483647"),
    ({"max_position_embeddings": 2**32 - 1}, "max_position_embeddings 4294967295 is beyond 2147483647"),
    ({"max_position_embeddings": 0}, "malformed max_position_embeddings"),
    ({"head_dim": 127}, "head_dim .127. must be even"),
    ({"head_dim": 0}, "malformed head_dim"),
    ({"head_dim": None, "hidden_size": 3600}, "hidden_size 3600 is not a multiple of num_attention_heads 28"),
    ({"num_key_value_heads": 8}, r"num_heads \(28\) is not a multiple of num_kv_heads \(8\)"),
    ({"rope_theta": 0}, "malformed rope_theta: expected a positive finite number, got 0"),
    ({"rope_theta": "1e6"}, "malformed rope_theta"),
    ({"rope_theta": float("inf")}, "malformed rope_theta"),
    ({"rope_theta": float("nan")}, "malformed rope_theta"),  # Python's json reads a bare NaN
    ({"rms_norm_eps": -1e-6}, "malformed rms_norm_eps"),
    ({"rms_norm_eps": False}, "malformed rms_norm_eps"),
    ({"tie_word_embeddings": "false"}, "malformed tie_word_embeddings: expected true or false, got 'false'"),
    ({"tie_word_embeddings": 0}, "malformed tie_word_embeddings"),
    ({"use_sliding_window": "no"}, "malformed use_sliding_window"),
    ({"eos_token_id": 2**32 - 1}, "eos_token_id 4294967295 is not a token id of the 152064-token vocabulary"),
    ({"eos_token_id": -1}, "malformed eos_token_id in config.json"),
    ({"eos_token_id": []}, "empty eos_token_id list"),
    ({"eos_token_id": [151645, "x"]}, "malformed eos_token_id in config.json"),
    ({"bos_token_id": 152064}, "bos_token_id 152064 is not a token id"),
    ({"bos_token_id": 1.5}, "malformed bos_token_id"),
])
def test_every_config_number_is_checked_not_coerced(edit, message):
    """Each number of config.json must be the right JSON type and in range: 256.7 is refused, not
    truncated to 256; "false" is refused, not read as a true (non-empty) string."""
    hf = {**PRESETS["7b"].to_hf_dict(), **edit}
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict(hf)


def test_optional_numbers_may_be_absent_or_null():
    hf = PRESETS["7b"].to_hf_dict()
    for key in ("head_dim", "num_key_value_heads", "rms_norm_eps", "max_position_embeddings",
                "tie_word_embeddings", "use_sliding_window"):
        hf[key] = None
    cfg = ModelConfig.from_hf_dict(hf)
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.max_position_embeddings) == (128, 28, 32768)
    assert ModelConfig.from_hf_dict({**hf, "eos_token_id": [151645, 151643]}).eos_token_id == 151645


@pytest.mark.parametrize("field, value, message", [
    ("bos_token_id", 2**32 - 1, "bos_token_id 4294967295 is not a token id of the 152064-token"),
    ("eos_token_id", 152064, "eos_token_id 152064 is not a token id"),
    ("max_position_embeddings", 2**32 - 1, "beyond 2147483647"),
    ("qkv_bias", False, "qkv_bias=False is not supported"),
    ("tie_word_embeddings", 1, "tie_word_embeddings must be true or false"),
])
def test_validate_refuses_ids_outside_the_vocabulary_and_contexts_beyond_int32(field, value, message):
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(PRESETS["7b"], **{field: value}).validate()

"""ModelConfig from config.json: what we accept, what we refuse, and the presets."""

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

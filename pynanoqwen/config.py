"""The Qwen2 model configuration: one dataclass, read from a Hugging Face config.json or a preset.

Every kernel is specialised on these numbers (they become compile-time constants), so this is
also where we refuse what we do not run: other architectures, RoPE scaling, sizes that the INT4
group size (128) does not divide.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import stat
import sys
from pathlib import Path

from .errors import ConfigError, NanoQwenError

GROUP_SIZE = 128  # input elements that share one FP16 scale in every INT4 linear layer
MAX_INT32 = 2**31 - 1  # token ids, positions and the page table are int32 on the GPU (engine.py)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    qkv_bias: bool = True
    bos_token_id: int = 151643
    eos_token_id: int = 151645

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(out_features, in_features) of each per-layer linear, keyed by its HF module name."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "self_attn.q_proj": (self.q_size, h),
            "self_attn.k_proj": (self.kv_size, h),
            "self_attn.v_proj": (self.kv_size, h),
            "self_attn.o_proj": (h, self.q_size),
            "mlp.gate_proj": (i, h),
            "mlp.up_proj": (i, h),
            "mlp.down_proj": (h, i),
        }

    @property
    def engine_linears(self) -> list[tuple[str, int, int, str]]:
        """(name, N, K, epilogue) of each linear of a decoder layer as the GPU engine builds them
        (QKV one matrix with bias, gate and up one fused SiLU product, o and down adding to the
        residual: kernels/gemm_int4.py's epilogues)."""
        h, i = self.hidden_size, self.intermediate_size
        return [("qkv", self.q_size + 2 * self.kv_size, h, "bias"), ("o_proj", h, self.q_size, "residual"),
                ("gate_up", i, h, "gate_up_silu"), ("down_proj", h, i, "residual")]

    def validate(self) -> "ModelConfig":
        positive = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                    "head_dim", "vocab_size", "max_position_embeddings")
        for name in positive:
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads ({self.num_heads}) is not a multiple of "
                              f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim ({self.head_dim}) must be even for RoPE")
        for name, (_, k) in self.linear_shapes.items():
            if k % GROUP_SIZE:
                raise ConfigError(f"{name} has {k} input features, not a multiple of the "
                                  f"INT4 group size {GROUP_SIZE}")
        for name in ("vocab_size", "max_position_embeddings"):
            if getattr(self, name) > MAX_INT32:
                raise ConfigError(f"{name} {getattr(self, name)} is beyond {MAX_INT32}: token ids and "
                                  "positions are 32-bit signed integers on the GPU")
        for name in ("bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            if not _is_int(value) or not 0 <= value < self.vocab_size:
                raise ConfigError(f"{name} {value!r} is not a token id of the {self.vocab_size}-token vocabulary")
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ConfigError(f"{name} must be positive and finite, got {value!r}")
        for name in ("tie_word_embeddings", "qkv_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not self.qkv_bias:
            raise ConfigError("qkv_bias=False is not supported: Qwen2's q, k and v projections have biases, "
                              "and every file stores them")
        return self

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> "ModelConfig":
        """The config of a Hugging Face config.json; every number is checked, none is coerced
        (256.7 or "256" is refused, not truncated or parsed)."""
        model_type = cfg.get("model_type")
        if model_type != "qwen2":
            raise ConfigError(f"model_type {model_type!r} is not supported (only 'qwen2')")
        if cfg.get("rope_scaling"):
            raise ConfigError(f"rope_scaling {cfg['rope_scaling']!r} is not implemented; "
                              "remove it from config.json to run at the native context")
        # transformers 5 writes RoPE settings as rope_parameters = {"rope_type": ..., "rope_theta": ...}
        # instead of a top-level rope_theta; read either, and refuse any RoPE type but the default.
        rope = cfg.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"rope_parameters must be an object, got {rope!r}")
        if rope.get("rope_type", "default") != "default":
            raise ConfigError(f"rope_parameters rope_type {rope['rope_type']!r} is not implemented "
                              "(only the default RoPE)")
        if _hf_flag(cfg, "use_sliding_window", False):
            raise ConfigError("use_sliding_window=true is not implemented")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act {act!r} is not supported (only 'silu')")
        heads = _hf_int(cfg, "num_attention_heads")
        hidden = _hf_int(cfg, "hidden_size")
        if cfg.get("head_dim") is None:  # transformers' Qwen2 then uses hidden_size // num_attention_heads
            if hidden % heads:
                raise ConfigError(f"config.json has no head_dim and hidden_size {hidden} is not a multiple "
                                  f"of num_attention_heads {heads}")
            head_dim = hidden // heads
        else:
            head_dim = _hf_int(cfg, "head_dim")
        bos = cfg.get("bos_token_id", 151643)
        return cls(
            hidden_size=hidden,
            intermediate_size=_hf_int(cfg, "intermediate_size"),
            num_layers=_hf_int(cfg, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=_hf_int(cfg, "num_key_value_heads", heads),
            head_dim=head_dim,
            vocab_size=_hf_int(cfg, "vocab_size"),
            rope_theta=_hf_number(cfg, "rope_theta", _hf_number(rope, "rope_theta", 10000.0)),
            rms_norm_eps=_hf_number(cfg, "rms_norm_eps", 1e-6),
            max_position_embeddings=_hf_int(cfg, "max_position_embeddings", 32768),
            tie_word_embeddings=_hf_flag(cfg, "tie_word_embeddings", False),
            qkv_bias=True,
            bos_token_id=0 if bos is None else _hf_token_id("bos_token_id", bos),
            eos_token_id=hf_eos_token_ids(cfg.get("eos_token_id", 151645), "config.json")[0],
        ).validate()

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "ModelConfig":
        return cls.from_hf_dict(read_json_object(Path(path) / "config.json", ConfigError))

    def to_hf_dict(self) -> dict:
        """The config.json that transformers' Qwen2ForCausalLM reads for this model."""
        return {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "max_window_layers": self.num_layers,
            "tie_word_embeddings": self.tie_word_embeddings,
            "use_sliding_window": False,
            "sliding_window": None,
            "rope_scaling": None,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": "bfloat16",
            "use_cache": True,
        }


def read_json_object(path: Path, error: type[NanoQwenError]) -> dict:
    """The JSON object in `path`; anything else (absent, unreadable, not UTF-8 JSON, not an
    object) raises `error` naming the file."""
    try:
        value = json.loads(read_file_bytes(path, error).decode("utf-8"))
    except FileNotFoundError:
        raise error(f"{path} not found") from None
    except IsADirectoryError:
        raise error(f"{path} is a directory, not a JSON file") from None
    except OSError as err:
        raise error(f"cannot read {path}: {err.strerror or err}") from None
    # ValueError: not UTF-8, not JSON, or an integer of over 4300 digits; RecursionError: nested too deep
    except (ValueError, RecursionError) as bad:
        raise error(f"{path} is not valid JSON: {bad}") from None
    if not isinstance(value, dict):
        raise error(f"{path} is not a JSON object")
    return value


def resolved(path: Path) -> Path:
    """path.resolve(), with a symlink loop raised as the OSError (ELOOP) it is from Python 3.13 on:
    before, Path.resolve raises RuntimeError, which the callers' OSError handlers did not catch."""
    try:
        return path.resolve()
    except RuntimeError:
        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), str(path)) from None


def read_file_bytes(path: Path, error: type[NanoQwenError]) -> bytes:
    """The bytes of the file at `path`. A FIFO, socket or device raises `error` (opening a FIFO
    waits for a writer, forever); OSError (absent, a directory, unreadable) propagates."""
    mode = os.stat(path).st_mode
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):  # a directory: read_bytes says so
        raise error(f"{path} is not a regular file")
    return path.read_bytes()


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not the number 1


_REQUIRED = object()


def _hf_value(cfg: dict, key: str, default):
    """cfg[key], where null counts as absent (save_pretrained writes null for unset options)."""
    value = cfg.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ConfigError(f"config.json lacks {key!r}")
        return default
    return value


def _hf_int(cfg: dict, key: str, default=_REQUIRED) -> int:
    """A positive integer of config.json; its absence is an error unless a default is given."""
    value = _hf_value(cfg, key, default)
    if not _is_int(value) or value <= 0:
        raise ConfigError(f"config.json has a malformed {key}: expected a positive integer, got {value!r}")
    return value


def _hf_number(cfg: dict, key: str, default: float) -> float:
    value = _hf_value(cfg, key, default)
    # An integer beyond any double (1 followed by 400 zeros) is below math.inf but has no float.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= sys.float_info.max:
        raise ConfigError(f"config.json has a malformed {key}: expected a positive finite number, got {value!r}")
    return float(value)


def _hf_flag(cfg: dict, key: str, default: bool) -> bool:
    value = _hf_value(cfg, key, default)
    if not isinstance(value, bool):  # bool("false") is True: a string must not pass as a flag
        raise ConfigError(f"config.json has a malformed {key}: expected true or false, got {value!r}")
    return value


def _hf_token_id(key: str, value) -> int:
    if not _is_int(value) or value < 0:
        raise ConfigError(f"config.json has a malformed {key}: expected a token id (an integer >= 0), "
                          f"got {value!r}")
    return value


def hf_eos_token_ids(value, source: str) -> list[int]:
    """The ids of an `eos_token_id` entry of config.json or generation_config.json: an id or a
    non-empty list of ids."""
    ids = value if isinstance(value, list) else [value]
    if not ids:
        raise ConfigError(f"{source} has an empty eos_token_id list")
    return [_hf_token_id(f"eos_token_id in {source}", i) for i in ids]


# The real Qwen2.5-Coder shapes (from their config.json files) and a tiny one for tests.
# `tiny` keeps the 7B's structure (GQA, untied lm_head, QKV bias) at a few MB.
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(hidden_size=256, intermediate_size=640, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=64, vocab_size=2048, max_position_embeddings=2048,
                        bos_token_id=0, eos_token_id=2),
    "0.5b": ModelConfig(896, 4864, 24, 14, 2, 64, 151936, tie_word_embeddings=True),
    "1.5b": ModelConfig(1536, 8960, 28, 12, 2, 128, 151936, tie_word_embeddings=True),
    "3b": ModelConfig(2048, 11008, 36, 16, 2, 128, 151936, tie_word_embeddings=True),
    "7b": ModelConfig(3584, 18944, 28, 28, 4, 128, 152064),
    "14b": ModelConfig(5120, 13824, 48, 40, 8, 128, 152064),
    "32b": ModelConfig(5120, 27648, 64, 40, 8, 128, 152064),
}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None

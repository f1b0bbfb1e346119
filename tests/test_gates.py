"""validate's logits gates (pynanoqwen/gates.py): garbage fails them, a correct engine's rounding
passes them, and the estimates they rest on hold when measured on the reference alone.

1. An all-zero and a shuffled output FAIL the KL gate and top-1 on clear rows, on the embedded
   model's real logits and on random ones, at the depths validate meets (4 and 28 layers).
2. An estimate too large to tell garbage apart makes the check a SKIP (a comparison), never a PASS.
3. The estimates, measured: the path's rounding is emulated in numpy on the reference model
   (activations rounded where the GEMVs read them: FP16 on prmt, INT8 per 128-group on dp4a; K and
   V stored in FP16), on fresh seeds, and the emulated logits' relative error and KL ratio must sit
   under the path's estimate. The limits of this file are its own; what it asserts about
   gates.logits_error is the estimate itself, measured.
"""

import dataclasses

import numpy as np
import pytest

from pynanoqwen import gates
from pynanoqwen.config import PRESETS
from pynanoqwen.data import EMBEDDED_MODEL
from pynanoqwen.fileformat import NanoQwenFile
from pynanoqwen.reference import (InMemoryWeights, ReferenceModel, apply_rope, causal_attention, load_layer,
                                  rms_norm, rope_tables, silu)
from pynanoqwen.tensors import hf_tensors


@pytest.fixture(scope="module")
def embedded():
    with NanoQwenFile(EMBEDDED_MODEL) as f:
        yield InMemoryWeights(f.config, f.lm_head_int4, {name: np.array(f.tensor(name)) for name in f.names})


def random_weights(cfg, seed):
    rng = np.random.default_rng(seed)
    hf = {name: (rng.standard_normal(shape) * (0.05 if len(shape) == 2 else 0.1)
                 + (1.0 if name.endswith("norm.weight") else 0.0)).astype(np.float32)
          for name, shape in hf_tensors(cfg).items()}
    return InMemoryWeights.quantize(cfg, hf, lm_head_int4=True)


def reference_logits(weights, rng, sequences=4, length=24):
    tokens = rng.integers(0, weights.config.vocab_size, (sequences, length))
    return np.stack([ReferenceModel(weights, max_context=length).forward(list(row)) for row in tokens]), tokens


def garbage(kind: str, logits: np.ndarray, rng) -> np.ndarray:
    if kind == "zeros":
        return np.zeros_like(logits)
    return np.take_along_axis(logits, np.argsort(rng.random(logits.shape), axis=-1), axis=-1)


@pytest.mark.parametrize("kind", ["zeros", "shuffled"])
@pytest.mark.parametrize("path, layers", [("prmt", 4), ("prmt", 28), ("dp4a", 4), ("prefill", 28)])
def test_garbage_fails_the_logits_gate(embedded, kind, path, layers):
    rng = np.random.default_rng()
    for weights in (embedded, random_weights(PRESETS["tiny"], int(rng.integers(1000)))):
        reference, _ = reference_logits(weights, rng)
        eps = gates.logits_error(path, layers, "prmt" if path == "prefill" else None)
        check = gates.logits_check("logits", garbage(kind, reference, rng), reference, eps, "rows")
        assert check.status == "FAIL", check.detail
        assert gates.kl_ratio(reference, garbage(kind, reference, rng)) > 0.5  # 1 for a constant output


def test_a_constant_output_has_a_kl_ratio_of_exactly_one(embedded):
    reference, _ = reference_logits(embedded, np.random.default_rng())
    assert gates.kl_ratio(reference, np.full_like(reference, 3.0)) == pytest.approx(1.0, rel=1e-9)


def test_an_estimate_beyond_what_tells_garbage_apart_is_a_comparison_not_a_pass(embedded):
    reference, _ = reference_logits(embedded, np.random.default_rng())
    eps = gates.logits_error("dp4a", 28)
    assert (gates.KL_FACTOR * eps) ** 2 >= 1
    for output in (reference, np.zeros_like(reference)):
        check = gates.logits_check("dp4a logits", output, reference, eps, "rows")
        assert check.status == "SKIP" and "a comparison, not a gate" in check.detail


def test_the_other_output_is_compared_with_the_reference_scale(embedded):
    """prefill vs decode: two outputs under test against each other, rows and scale the reference's."""
    rng = np.random.default_rng()
    reference, _ = reference_logits(embedded, rng)
    noisy = reference + 1e-3 * np.std(reference, axis=-1, keepdims=True) * rng.standard_normal(reference.shape)
    eps = gates.logits_error("prmt", 4) + gates.logits_error("prefill", 4, "prmt")
    assert gates.logits_check("pair", noisy, reference, eps, "rows", base=reference).status == "PASS"
    assert gates.logits_check("pair", np.zeros_like(reference), reference, eps, "rows", base=noisy).status == "FAIL"


# ----------------------------------------------------------------------------------------------
# The estimates, measured on the reference with the path's rounding emulated

def int8_groups(x: np.ndarray) -> np.ndarray:
    """x as the dp4a GEMV reads it: FP16, then INT8 per group of 128 with scale max|x| / 127."""
    x = x.astype(np.float16).astype(np.float64)
    groups = x.reshape(*x.shape[:-1], -1, 128)
    scale = np.abs(groups).max(axis=-1, keepdims=True) / 127
    return (np.round(groups / np.where(scale > 0, scale, 1)) * scale).reshape(x.shape)


def fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float64)


def emulated_logits(weights, tokens, path: str) -> np.ndarray:
    """The reference forward of `tokens` with the GEMV inputs of `path` rounded, and K/V in FP16."""
    cfg = weights.config
    read = int8_groups if path == "dp4a" else fp16
    x = np.asarray(weights.tensor("model.embed_tokens.weight")[tokens], np.float64)
    cos, sin = rope_tables(cfg.head_dim, cfg.rope_theta, np.arange(len(tokens)))
    for layer in range(cfg.num_layers):
        w = load_layer(weights, layer)
        h = read(rms_norm(x, w.input_norm, cfg.rms_norm_eps))
        q = apply_rope((h @ w.q_proj.T + w.q_bias).reshape(len(tokens), cfg.num_heads, cfg.head_dim), cos, sin)
        k = fp16(apply_rope((h @ w.k_proj.T + w.k_bias).reshape(len(tokens), cfg.num_kv_heads, cfg.head_dim),
                            cos, sin))
        v = fp16((h @ w.v_proj.T + w.v_bias).reshape(len(tokens), cfg.num_kv_heads, cfg.head_dim))
        attn = read(causal_attention(q, k, v).reshape(len(tokens), -1))
        x = x + attn @ w.o_proj.T
        h = read(rms_norm(x, w.post_attention_norm, cfg.rms_norm_eps))
        x = x + read(silu(h @ w.gate_proj.T) * (h @ w.up_proj.T)) @ w.down_proj.T
    model = ReferenceModel(weights)
    return model.logits(read(rms_norm(x, weights.tensor("model.norm.weight"), cfg.rms_norm_eps)).astype(np.float32))


@pytest.mark.parametrize("path", ["prmt", "dp4a"])
def test_the_logits_estimate_holds_when_the_paths_rounding_is_emulated(embedded, path):
    rng = np.random.default_rng()
    deep = dataclasses.replace(PRESETS["tiny"], num_layers=8)
    for weights in (embedded, random_weights(deep, int(rng.integers(1000)))):
        reference, tokens = reference_logits(weights, rng, sequences=3)
        emulated = np.stack([emulated_logits(weights, list(row), path) for row in tokens])
        eps = gates.logits_error(path, weights.config.num_layers)
        measured = gates.relative_error(emulated, reference)
        ratio = gates.kl_ratio(reference, emulated)
        print(f"{path} {weights.config.num_layers} layers: relative error {measured:.2e} (estimate {eps:.2e}), "
              f"KL ratio {ratio:.1e} (limit {(gates.KL_FACTOR * eps) ** 2:.1e})")
        assert measured < eps
        assert ratio < (gates.KL_FACTOR * eps) ** 2
        assert gates.logits_check("emulated", emulated, reference, eps, "rows").status in ("PASS", "SKIP")

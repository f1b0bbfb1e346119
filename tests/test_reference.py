"""The numpy reference model against transformers' Qwen2ForCausalLM, and its operations against loops.

The model tests build a random `tiny` checkpoint (scripts/measure_int4_drift.random_hf_weights),
quantize it as `convert` does, and load the DEQUANTIZED weights into Qwen2ForCausalLM in float64
with eager attention, so both sides compute with identical weights and any difference is the
reference model's (float32) arithmetic. Measured: relative error about 6e-7, bound 1e-4.
"""

import dataclasses
import functools
import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from pynanoqwen import reference
from pynanoqwen.config import PRESETS
from pynanoqwen.errors import NanoQwenError
from pynanoqwen.fileformat import NanoQwenFile
from pynanoqwen.filewriter import NanoQwenWriter
from pynanoqwen.quant import SLOT_TO_WEIGHT, dequantize_int4, quantize_int4
from pynanoqwen.reference import (InMemoryWeights, ReferenceModel, apply_rope, attention,
                                  causal_attention, dequantized_nbytes, linear_int4, rms_norm,
                                  rope_tables, silu)
from pynanoqwen.tensors import QWEIGHT, SCALES, hf_tensors

_spec = importlib.util.spec_from_file_location(
    "measure_int4_drift", Path(__file__).resolve().parents[1] / "scripts" / "measure_int4_drift.py")
drift = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(drift)

TINY = PRESETS["tiny"]
MAX_REL_ERROR = 1e-4
VARIANTS = [(tied, lm_head_int4) for tied in (False, True) for lm_head_int4 in (False, True)]


def variant_id(variant):
    tied, lm_head_int4 = variant
    return f"{'tied' if tied else 'untied'}-lm_head_{'int4' if lm_head_int4 else 'fp16'}"


@functools.cache
def tiny_pair(tied, lm_head_int4):
    """(INT4 weights, Qwen2ForCausalLM float64 on the same weights dequantized) for one variant."""
    cfg = dataclasses.replace(TINY, tie_word_embeddings=tied)
    weights = InMemoryWeights.quantize(cfg, drift.random_hf_weights(cfg, seed=7), lm_head_int4)
    # A tied model with an INT4 lm_head computes with lm_head = dequantized(quantized(embed)), which
    # differs from embed: transformers holds that as an untied model.
    hf_cfg = dataclasses.replace(cfg, tie_word_embeddings=tied and not lm_head_int4)
    dequantized = {}
    for name in hf_tensors(hf_cfg):
        if name + QWEIGHT in weights.tensors:
            dequantized[name] = dequantize_int4(weights.tensor(name + QWEIGHT), weights.tensor(name + SCALES),
                                                np.float64)
        else:
            dequantized[name] = weights.tensor(name).astype(np.float64)
    return weights, drift.hf_model(hf_cfg, dequantized)


@pytest.fixture(params=VARIANTS, ids=variant_id)
def tiny(request):
    return tiny_pair(*request.param)


@pytest.fixture
def untied_fp16():
    return tiny_pair(False, False)


def random_tokens(n, seed):
    return np.random.default_rng(seed).integers(0, TINY.vocab_size, n)


def assert_logits_close(ours, theirs):
    """||ours - theirs|| / ||theirs|| below MAX_REL_ERROR over everything and for every row."""
    assert ours.dtype == np.float32 and ours.shape == theirs.shape
    assert np.linalg.norm(ours - theirs) / np.linalg.norm(theirs) < MAX_REL_ERROR
    rows = np.linalg.norm(ours - theirs, axis=1) / np.linalg.norm(theirs, axis=1)
    assert rows.max() < MAX_REL_ERROR


# ----------------------------------------------------------------------------------------------
# The model against transformers

def test_full_sequence_logits_match_transformers(tiny):
    weights, hf = tiny
    tokens = random_tokens(32, seed=1)
    assert_logits_close(ReferenceModel(weights).forward(tokens), drift.hf_logits(hf, tokens))


def test_kv_cache_decode_matches_transformers(tiny):
    weights, hf = tiny
    tokens = random_tokens(32, seed=2)
    expected = drift.hf_logits(hf, tokens)
    model = ReferenceModel(weights)
    one_by_one = np.concatenate([model.forward([t]) for t in tokens])
    assert model.position == 32
    assert_logits_close(one_by_one, expected)
    model.reset()
    pieces = [model.forward(tokens[:13]), model.forward(tokens[13:20])]
    pieces += [model.forward([t]) for t in tokens[20:]]
    assert_logits_close(np.concatenate(pieces), expected)


def assert_same_but_blocking(ours, theirs):
    """Equal up to float32 rounding: BLAS sums in a different order when a matmul has other
    shapes (one row instead of 9, 500 lm_head rows instead of 2048). Measured: about 3e-7."""
    assert ours.shape == theirs.shape
    assert np.linalg.norm(ours - theirs) / np.linalg.norm(theirs) < 1e-5


def test_last_only_is_the_last_row(tiny):
    weights, _ = tiny
    tokens = random_tokens(9, seed=3)
    assert_same_but_blocking(ReferenceModel(weights).forward(tokens, last_only=True),
                             ReferenceModel(weights).forward(tokens)[-1:])


@pytest.mark.parametrize("lm_head_int4", [False, True], ids=["lm_head_fp16", "lm_head_int4"])
def test_greedy_tokens_match_transformers(lm_head_int4):
    """32 greedy tokens after an 8-token prompt: the reference decodes with its KV cache,
    transformers recomputes the whole sequence each step. The smallest top1 - top2 logit margin on
    the way must dwarf the logit error, or identical tokens would prove nothing. Untied only: a
    random tied model greedily repeats one token (its own embedding dominates its logit)."""
    weights, hf = tiny_pair(False, lm_head_int4)
    model = ReferenceModel(weights)
    sequence = list(random_tokens(8, seed=4))
    ours = [int(np.argmax(model.forward(sequence)[-1]))]
    for _ in range(31):
        ours.append(int(np.argmax(model.forward(ours[-1:])[-1])))
    theirs, margins = [], []
    for _ in range(32):
        logits = drift.hf_logits(hf, sequence + theirs)[-1]
        top2 = np.sort(logits)[-2:]
        margins.append(top2[1] - top2[0])
        theirs.append(int(np.argmax(logits)))
    assert ours == theirs
    print(f"min top1-top2 margin {min(margins):.4g}, distinct tokens {len(set(theirs))}")
    assert min(margins) > 1e-3  # the logits agree to about 1e-5 absolute
    assert len(set(theirs)) > 16  # not a degenerate repetition


def test_prompt_blocks_match_transformers(untied_fp16, monkeypatch):
    """A long prompt goes through each layer in blocks; force 5-token blocks on a 32-token prompt."""
    weights, hf = untied_fp16
    monkeypatch.setattr(reference, "ACTIVATION_BUDGET", 5 * (TINY.num_heads * 32 * 20 + 12 * TINY.intermediate_size))
    assert reference.prompt_block(TINY, 32) == 5
    tokens = random_tokens(32, seed=5)
    model = ReferenceModel(weights)
    assert_logits_close(np.concatenate([model.forward(tokens[:3]), model.forward(tokens[3:])]),
                        drift.hf_logits(hf, tokens))


def test_kv_cache_grows_in_chunks(untied_fp16):
    weights, hf = untied_fp16
    tokens = random_tokens(300, seed=6)
    model = ReferenceModel(weights, max_context=1000)
    assert model.k_cache.nbytes == 0
    pieces = [model.forward(tokens[:10])]
    assert model.k_cache.shape == (TINY.num_layers, reference.KV_CHUNK, TINY.num_kv_heads, TINY.head_dim)
    pieces += [model.forward(tokens[10:250]), model.forward(tokens[250:260])]
    assert model.k_cache.shape[1] == model.v_cache.shape[1] == 2 * reference.KV_CHUNK
    pieces += [model.forward([t]) for t in tokens[260:]]
    assert_logits_close(np.concatenate(pieces), drift.hf_logits(hf, tokens))
    model.forward(random_tokens(700, seed=7))
    assert model.k_cache.shape[1] == 1000  # capped at max_context, not rounded past it


def test_layers_dequantized_per_forward_match_cached(tiny, monkeypatch):
    """cache_layers=False (one layer at a time, lm_head in row chunks) computes the same logits."""
    weights, hf = tiny
    monkeypatch.setattr(reference, "LM_HEAD_ROWS", 500)  # 2048 rows: three full chunks and a partial
    tokens = random_tokens(16, seed=8)
    cached = ReferenceModel(weights, cache_layers=True)
    streamed = ReferenceModel(weights, cache_layers=False)
    ours = streamed.forward(tokens)
    assert not streamed._layers and streamed._lm_head is None
    assert_same_but_blocking(ours, cached.forward(tokens))
    assert_logits_close(ours, drift.hf_logits(hf, tokens))


def test_runs_from_a_nanoqwen_file_mmap(tmp_path):
    """The same weights written to a .nanoqwen file and streamed from its read-only mmap."""
    weights, _ = tiny_pair(False, True)
    path = tmp_path / "tiny.nanoqwen"
    with NanoQwenWriter(path, TINY, lm_head_int4=True, tokenizer_json=b"{}", chat_template=None) as out:
        for name in weights.names:
            out.add_tensor(name, weights.tensor(name))
    tokens = random_tokens(10, seed=13)
    with NanoQwenFile(path) as f:
        from_file = ReferenceModel(f, cache_layers=False)
        ours = np.concatenate([from_file.forward(tokens[:6]), from_file.forward(tokens[6:])])
    in_memory = ReferenceModel(weights)
    np.testing.assert_array_equal(ours, np.concatenate([in_memory.forward(tokens[:6]),
                                                        in_memory.forward(tokens[6:])]))


def test_cache_layers_default_depends_on_model_size():
    assert ReferenceModel(InMemoryWeights(TINY, False, {})).cache_layers
    big = ReferenceModel(InMemoryWeights(PRESETS["7b"], True, {}))
    assert dequantized_nbytes(PRESETS["7b"]) > 25 * 2**30
    assert not big.cache_layers
    assert big.max_context == 32768 and big.k_cache.nbytes == 0  # nothing allocated upfront


def test_reset_starts_over(untied_fp16):
    weights, _ = untied_fp16
    tokens = random_tokens(12, seed=9)
    model = ReferenceModel(weights)
    first = model.forward(tokens)
    model.forward(random_tokens(5, seed=10))
    model.reset()
    assert model.position == 0
    np.testing.assert_array_equal(model.forward(tokens), first)


def test_user_errors(untied_fp16):
    weights, _ = untied_fp16
    model = ReferenceModel(weights, max_context=20)
    model.forward(random_tokens(15, seed=11))
    with pytest.raises(NanoQwenError, match="too long: 15 tokens in the cache \\+ 6 new exceed max_context 20"):
        model.forward(random_tokens(6, seed=12))
    assert model.position == 15  # a refused call leaves the cache alone
    for bad in ([5, -1], [TINY.vocab_size]):
        with pytest.raises(NanoQwenError, match="outside the vocabulary"):
            model.forward(bad)
    with pytest.raises(NanoQwenError, match="prompt is empty"):
        model.forward([])
    with pytest.raises(NanoQwenError, match="integer ids"):
        model.forward([1.5, 2.0])
    for max_context in (0, TINY.max_position_embeddings + 1):
        with pytest.raises(NanoQwenError, match="max_context"):
            ReferenceModel(weights, max_context=max_context)


def test_int4_drift_is_as_recorded():
    """docs/QUANTIZATION.md records seed 0 of scripts/measure_int4_drift.py; measure it again."""
    recorded = {False: (0.18537, 49 / 64, 0.18519), True: (0.21941, 41 / 64, 0.27301)}
    for lm_head_int4, (rel_l2, top1, mean_kl) in recorded.items():
        measured = drift.measure_drift(seed=0, lm_head_int4=lm_head_int4)
        assert measured.rel_l2 == pytest.approx(rel_l2, rel=1e-3)
        assert measured.mean_kl == pytest.approx(mean_kl, rel=1e-3)
        assert abs(measured.top1_agreement - top1) <= 1 / 64


# ----------------------------------------------------------------------------------------------
# The operations against straightforward float64 loops

def test_rms_norm_matches_loop():
    rng = np.random.default_rng(20)
    x = (rng.normal(size=(5, 256)) * 3).astype(np.float32)
    weight = rng.normal(1.0, 0.3, size=256).astype(np.float16)
    eps = 1e-6
    expected = np.empty((5, 256))
    for r in range(5):
        mean_square = sum(float(v) ** 2 for v in x[r]) / 256
        for i in range(256):
            expected[r, i] = float(x[r, i]) / math.sqrt(mean_square + eps) * float(weight[i])
    out = rms_norm(x, weight, eps)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_matches_loop(head_dim):
    rng = np.random.default_rng(21)
    theta = 1_000_000.0
    positions = rng.integers(0, 32768, size=6)
    x = rng.normal(size=(6, 3, head_dim)).astype(np.float32)
    half = head_dim // 2
    expected = np.empty(x.shape)
    for s, pos in enumerate(positions):
        for i in range(half):
            angle = int(pos) * theta ** (-2 * i / head_dim)
            c, si = math.cos(angle), math.sin(angle)
            for h in range(3):
                a, b = float(x[s, h, i]), float(x[s, h, i + half])
                expected[s, h, i] = a * c - b * si
                expected[s, h, i + half] = b * c + a * si
    cos, sin = rope_tables(head_dim, theta, positions)
    assert cos.shape == sin.shape == (6, head_dim) and cos.dtype == np.float32
    np.testing.assert_allclose(apply_rope(x, cos, sin), expected, rtol=0, atol=2e-6)


def loop_attention(q, k, v, position):
    """softmax(q.k / sqrt(d)) v for each head of one query at `position`, kv head h // group."""
    heads, hd = q.shape
    group = heads // k.shape[1]
    out = np.zeros((heads, hd))
    for h in range(heads):
        scores = [float(np.dot(q[h].astype(np.float64), k[j, h // group])) / math.sqrt(hd)
                  for j in range(position + 1)]
        top = max(scores)
        weights = [math.exp(s - top) for s in scores]
        for j, w in enumerate(weights):
            out[h] += w / sum(weights) * v[j, h // group].astype(np.float64)
    return out


def test_decode_attention_matches_loop():
    rng = np.random.default_rng(22)
    q = (rng.normal(size=(8, 64)) * 2).astype(np.float32)
    k, v = rng.normal(size=(2, 37, 2, 64)).astype(np.float32)
    np.testing.assert_allclose(attention(q, k, v), loop_attention(q, k, v, 36), rtol=1e-5, atol=1e-6)


def test_causal_attention_matches_loop():
    rng = np.random.default_rng(23)
    q = (rng.normal(size=(5, 6, 32)) * 2).astype(np.float32)
    k, v = rng.normal(size=(2, 12, 3, 32)).astype(np.float32)
    out = causal_attention(q, k, v)
    for i in range(5):
        np.testing.assert_allclose(out[i], loop_attention(q[i], k, v, 12 - 5 + i), rtol=1e-5, atol=1e-6)


def test_silu_matches_loop_without_overflow():
    x = np.concatenate([np.random.default_rng(24).normal(size=200) * 20, [-1e4, -750.0, 750.0]]).astype(np.float32)
    with np.errstate(over="raise", invalid="raise"):
        out = silu(x)
    expected = [v / (1 + math.exp(-v)) if v > -700 else 0.0 for v in map(float, x)]
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-30)


def test_linear_int4_matches_loop():
    rng = np.random.default_rng(25)
    qweight, scales = quantize_int4(rng.normal(size=(24, 256)))
    x = rng.normal(size=(3, 256)).astype(np.float32)
    bias = rng.normal(size=24).astype(np.float16)
    # Decode each word from the layout spec: nibble slot p holds weight SLOT_TO_WEIGHT[p] of its 8.
    w = np.empty((24, 256))
    for n in range(24):
        for word in range(32):
            for slot in range(8):
                k = 8 * word + int(SLOT_TO_WEIGHT[slot])
                code = (int(qweight[n, word]) >> (4 * slot)) & 0xF
                w[n, k] = (code - 8) * float(scales[n, k // 128])
    expected = x.astype(np.float64) @ w.T + bias.astype(np.float64)
    np.testing.assert_allclose(linear_int4(x, qweight, scales, bias), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(linear_int4(x, qweight, scales), expected - bias, rtol=1e-5, atol=1e-5)

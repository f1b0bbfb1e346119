"""Each kernel of a decode step on the GPU against float64, at a model's shapes (validate's unit tier).

Fresh random activations (never zeros), the model's own weights for the linears, every output
row; each bound is the kernel's, derived in pynanoqwen/oracles.py. `weights` is a NanoQwenFile or
a reference.InMemoryWeights. tests/sim/test_validate_sim.py runs the small ones under the CUDA
simulator; they take the kernel factories from their modules at call time, so a test can swap one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
from numba import cuda

from .kernels import PAGE_SIZE, attention_decode, embedding, gemv_fp16, gemv_int4, rmsnorm, \
    rope_kv_write, sampling
from .kernels.kv_layout import swizzle_rows
from .oracles import FP16_TINY, U16, U32, Check, attention_oracle, bound_report, fp16_gemv_oracle, gemv_oracle, \
    passed, rmsnorm_oracle, rope_oracle, silu_product_oracle
from .sampling import SamplingParams
from .tensors import QWEIGHT, SCALES, layer_prefix

CHECKED_CONTEXT = 4096  # the most positions RoPE and attention are checked at


def _stream_run(launch) -> None:
    stream = cuda.stream()
    launch(stream)
    stream.synchronize()


def _int(value: int):
    return cuda.to_device(np.array([value], np.int32))


def check_embedding(weights, rng) -> Iterator[Check]:
    cfg = weights.config
    table = np.asarray(weights.tensor("model.embed_tokens.weight"))
    tokens = rng.integers(0, cfg.vocab_size, 8).astype(np.int32)
    position = int(rng.integers(0, 8))
    h = cuda.to_device(np.full(cfg.hidden_size, np.nan, np.float32))
    _stream_run(lambda s: embedding.make_embedding(cfg.hidden_size).launch(
        s, cuda.to_device(table), cuda.to_device(tokens), _int(position), h))
    ok = np.array_equal(h.copy_to_host(), table[tokens[position]].astype(np.float32))
    yield passed("embedding", ok, f"row of token {tokens[position]} " + ("copied exactly" if ok else "differs"))


def check_rmsnorm(weights, rng) -> Iterator[Check]:
    cfg = weights.config
    h = (rng.standard_normal(cfg.hidden_size) * rng.uniform(0.1, 10)).astype(np.float32)
    weight = np.asarray(weights.tensor(layer_prefix(0) + "input_layernorm.weight"))
    xn = cuda.to_device(np.zeros(cfg.hidden_size, np.float16))
    _stream_run(lambda s: rmsnorm.make_rmsnorm(cfg.hidden_size, cfg.rms_norm_eps).launch(
        s, cuda.to_device(h), cuda.to_device(weight), xn))
    expected, bound = rmsnorm_oracle(h, weight, cfg.rms_norm_eps)
    yield bound_report("rmsnorm", np.abs(xn.copy_to_host().astype(np.float64) - expected), bound)


def check_rope_kv_write(weights, rng) -> Iterator[Check]:
    cfg = weights.config
    heads, kv_heads, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    max_context = min(cfg.max_position_embeddings, CHECKED_CONTEXT)
    pages = -(-max_context // PAGE_SIZE)
    position = int(rng.integers(0, max_context))
    qkv = rng.standard_normal((heads + 2 * kv_heads) * hd).astype(np.float32)
    page_table = rng.permutation(pages).astype(np.int32)
    cos, sin = rope_kv_write.rope_cos_sin(hd, cfg.rope_theta, max_context)
    k_init = rng.standard_normal((pages, kv_heads, PAGE_SIZE, hd)).astype(np.float16)
    v_init = rng.standard_normal((pages, kv_heads, PAGE_SIZE, hd)).astype(np.float16)
    q, k_pages, v_pages = (cuda.to_device(a) for a in (np.zeros((heads, hd), np.float32), k_init, v_init))
    _stream_run(lambda s: rope_kv_write.make_rope_kv_write(heads, kv_heads, hd).launch(
        s, cuda.to_device(qkv), cuda.to_device(cos), cuda.to_device(sin), _int(position), cuda.to_device(page_table),
        q, k_pages, v_pages))

    parts, rotated, f32 = (a[0] for a in rope_oracle(qkv[None], np.array([position]), heads, kv_heads, hd,
                                                     cfg.rope_theta))
    page, slot = page_table[position // PAGE_SIZE], position % PAGE_SIZE
    # In logical order (kernels/kv_layout.py); the init too, so that untouched slots compare alike.
    k_got, v_got = swizzle_rows(k_pages.copy_to_host()), swizzle_rows(v_pages.copy_to_host())
    k_init, v_init = swizzle_rows(k_init), swizzle_rows(v_init)
    k_rot = rotated[heads:heads + kv_heads]
    untouched = np.ones(k_init.shape[:3], bool)
    untouched[page, :, slot] = False
    writes_ok = (np.array_equal(v_got[page, :, slot], parts[heads + kv_heads:].astype(np.float16))
                 and np.array_equal(k_got[untouched], k_init[untouched])
                 and np.array_equal(v_got[untouched], v_init[untouched]))
    if not writes_ok:
        yield passed("rope_kv_write", False, f"position {position}: v slot wrong or another KV slot was written")
        return
    check = bound_report("rope_kv_write", np.concatenate([
        np.abs(q.copy_to_host() - rotated[:heads]).ravel(),
        np.abs(k_got[page, :, slot].astype(np.float64) - k_rot).ravel()]), np.concatenate([
            f32[:heads].ravel(), (U16 * np.abs(k_rot) + f32[heads:heads + kv_heads] + FP16_TINY).ravel()]))
    yield dataclasses.replace(check, detail=f"position {position}: " + check.detail)


def random_attention_case(rng, heads: int, kv_heads: int, head_dim: int, max_pages: int, context: int):
    """Decode attention's inputs for one token at position context - 1 and their float64 answer:
    ((q, k_pages, v_pages, page_table, pos), expected, bound), host arrays, the pages in their stored
    order (kernels/kv_layout.py). Fresh random q and K/V, a shuffled page table, NaN in every slot
    outside the context (reading one poisons the output)."""
    shape = (max_pages, kv_heads, PAGE_SIZE, head_dim)
    page_table = rng.permutation(max_pages).astype(np.int32)
    k_pages, v_pages = np.full(shape, np.nan, np.float16), np.full(shape, np.nan, np.float16)
    positions = np.arange(context)
    pages, slots = page_table[positions // PAGE_SIZE], positions % PAGE_SIZE
    k_pages[pages, :, slots] = rng.standard_normal((context, kv_heads, head_dim))
    v_pages[pages, :, slots] = rng.standard_normal((context, kv_heads, head_dim))
    q = (3.0 * rng.standard_normal((heads, head_dim))).astype(np.float32)
    expected, bound = attention_oracle(q[None], k_pages[pages, :, slots], v_pages[pages, :, slots],
                                       np.array([context - 1]), fp16_operands=False)
    return ((q, swizzle_rows(k_pages), swizzle_rows(v_pages), page_table, np.array([context - 1], np.int32)),
            expected[0], bound[0])


def check_attention(weights, rng) -> Iterator[Check]:
    cfg = weights.config
    heads, kv_heads, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    max_context = min(cfg.max_position_embeddings, CHECKED_CONTEXT)
    max_pages = -(-max_context // PAGE_SIZE)
    context = int(rng.integers(1, max_context + 1))
    inputs, expected, bound = random_attention_case(rng, heads, kv_heads, hd, max_pages, context)
    out = cuda.to_device(np.full(heads * hd, np.nan, np.float16))
    kernel = attention_decode.make_decode_attention(heads, kv_heads, hd, max_pages)
    _stream_run(lambda s: kernel.launch(s, *(cuda.to_device(a) for a in inputs), out))
    check = bound_report("decode attention", np.abs(out.copy_to_host().astype(np.float64) - expected), bound)
    yield dataclasses.replace(check, detail=f"context {context}: " + check.detail)


def _linear(weights, name: str) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(weights.tensor(name + QWEIGHT)), np.asarray(weights.tensor(name + SCALES))


def _run_gemv(gemv, x: np.ndarray, out: np.ndarray, **epilogue) -> np.ndarray:
    out_device = cuda.to_device(out)
    _stream_run(lambda s: gemv.launch(s, cuda.to_device(x), out_device, **epilogue))
    return out_device.copy_to_host().astype(np.float64)


def check_linears(weights, rng) -> Iterator[Check]:
    """Every INT4 GEMV of layer 0 as the engine builds them (fused QKV with bias, o_proj and down
    accumulating into the residual, gate/up with SiLU) and the lm_head, on both GEMV paths."""
    cfg = weights.config
    p = layer_prefix(0)
    h, i, q_size = cfg.hidden_size, cfg.intermediate_size, cfg.q_size
    parts = [_linear(weights, f"{p}self_attn.{m}_proj.weight") for m in "qkv"]
    qkv_q, qkv_s = np.concatenate([a for a, _ in parts]), np.concatenate([b for _, b in parts])
    qkv_bias = np.concatenate([np.asarray(weights.tensor(f"{p}self_attn.{m}_proj.bias")) for m in "qkv"])

    def fp16(n: int) -> np.ndarray:  # fresh FP16 activations
        return rng.standard_normal(n).astype(np.float16)

    for path in gemv_int4.PATHS:
        x = fp16(h)
        expected, bound = gemv_oracle(qkv_q, qkv_s, x, path)
        expected += qkv_bias
        y = _run_gemv(gemv_int4.make_gemv_int4(len(qkv_q), h, qkv_q, qkv_s, path=path, bias=qkv_bias), x,
                      np.zeros(len(qkv_q), np.float32))
        yield bound_report(f"gemv {path} qkv+bias", np.abs(y - expected), bound + U32 * np.abs(expected))

        for module, k in (("self_attn.o_proj", q_size), ("mlp.down_proj", i)):
            qw, sc = _linear(weights, f"{p}{module}.weight")
            x, residual = fp16(k), rng.standard_normal(h).astype(np.float32)
            expected, bound = gemv_oracle(qw, sc, x, path)
            expected += residual
            y = _run_gemv(gemv_int4.make_gemv_int4(h, k, qw, sc, path=path), x, residual, residual=True)
            yield bound_report(f"gemv {path} {module.split('.')[1]}+residual", np.abs(y - expected),
                               bound + U32 * np.abs(expected))

        gate, up = _linear(weights, f"{p}mlp.gate_proj.weight"), _linear(weights, f"{p}mlp.up_proj.weight")
        x = fp16(h)
        expected, bound = silu_product_oracle(*gemv_oracle(*gate, x, path), *gemv_oracle(*up, x, path))
        y = _run_gemv(gemv_int4.make_gate_up_silu(i, h, *gate, *up, path=path), x, np.zeros(i, np.float16))
        yield bound_report(f"gemv {path} gate_up_silu", np.abs(y - expected), bound)

        if weights.lm_head_int4:
            qw, sc = _linear(weights, "lm_head.weight")
            x = fp16(h)
            expected, bound = gemv_oracle(qw, sc, x, path)
            y = _run_gemv(gemv_int4.make_gemv_int4(cfg.vocab_size, h, qw, sc, path=path), x,
                          np.zeros(cfg.vocab_size, np.float32))
            yield bound_report(f"gemv {path} lm_head", np.abs(y - expected), bound)

    if not weights.lm_head_int4:
        name = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        table = np.asarray(weights.tensor(name))
        x = fp16(h)
        expected, bound = fp16_gemv_oracle(table, x)
        y = _run_gemv(gemv_fp16.make_gemv_fp16(cfg.vocab_size, h, table), x, np.zeros(cfg.vocab_size, np.float32))
        yield bound_report("gemv fp16 lm_head", np.abs(y - expected), bound)


def check_argmax(weights, rng) -> Iterator[Check]:
    vocab = weights.config.vocab_size
    logits = (rng.standard_normal(vocab) * rng.uniform(1, 4)).astype(np.float32)
    ties = rng.choice(vocab, 3, replace=False)
    logits[ties] = logits.max() + 1  # greedy must take the lowest id among equal maxima, as numpy does
    position = int(rng.integers(0, 100))
    tokens = cuda.to_device(np.full(position + 2, -1, np.int32))
    pos = _int(position)
    params = (cuda.to_device(a) for a in sampling.device_params(SamplingParams()))
    sampler = sampling.Sampler(vocab)
    _stream_run(lambda s: sampler.launch(s, "argmax", cuda.to_device(logits), *params, tokens, pos))
    got = int(tokens.copy_to_host()[position + 1])
    ok = got == int(np.argmax(logits)) and int(pos.copy_to_host()[0]) == position + 1
    yield passed("argmax sampler", ok, f"vocab {vocab}, 3-way tie at the max: chose {got}, "
                                       f"expected {int(np.argmax(logits))}")


UNIT_CHECKS = (check_embedding, check_rmsnorm, check_linears, check_rope_kv_write, check_attention, check_argmax)


def run_unit_checks(weights, rng, checks=UNIT_CHECKS) -> Iterator[Check]:
    """Every unit check on `weights`."""
    for check in checks:
        yield from check(weights, rng)

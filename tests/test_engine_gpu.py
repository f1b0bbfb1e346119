"""The GPU engine's validation ladder (needs an sm_90 GPU; skipped elsewhere).

1. unit: the step's small kernels (embedding, RMSNorm, RoPE + KV write, page_alloc, sampling,
   the FP16 GEMV) at the 7B model's shapes against numpy on fresh random inputs;
2. layer: the engine's decoder layer (7B dims, INT4 weights) against transformers'
   Qwen2DecoderLayer holding the same weights dequantized, in float64;
3. model: a random 7B-shaped .nanoqwen (pynanoqwen/synthetic.py): teacher-forced logits over 64
   tokens against the numpy ReferenceModel; graph and eager decoding give identical tokens;
   128 decode steps allocate no device memory.

The comparison helpers return plain dicts, printed (run with -s) next to what each test asserts.
Environment: PYNANOQWEN_7B_FILE, a prebuilt 7B file (otherwise one is written to a temporary
directory, 1-2 minutes); PYNANOQWEN_GRAPH_EAGER_PROMPTS, prompts in the graph-versus-eager test
(default 8; an acceptance run uses 100).

Error bounds of the engine against float64 (layer and model), on the layer's update (output
minus input: the residual passes the input through exactly), relative L2 per position:
- prmt: activations are rounded to FP16 where the GEMVs read them (xn before QKV and gate-up, attn,
  the MLP product), K/V are stored in FP16, each a relative error of up to 2^-11, and the GEMV
  accumulates 16 products per half in FP16. Bound 8 * 2^-11 = 3.9e-3: eight such roundings.
  A numpy emulation of this arithmetic at 7B dims gave 1.6e-3.
- dp4a: each GEMV input is also rounded to INT8 per group of 128, an error uniform within
  +-max/254, rms max/440, so a relative rms error of (max/rms)/440 per input; four inputs in
  series (xn, attn, xn, MLP product) with max/rms <= 8 bound it by 4 * 8/440 = 7.3e-2.
  The same emulation gave 2.0e-2.
- auto (the engine's default): every GEMV but down_proj runs fixed16, which reads xn unrounded,
  rounds its other inputs to 16-bit integers per chunk of 32 (relative L2 over a chunk at most
  sqrt(32)/65534 + 2^-22 < 2^-13) and sums exactly; down_proj runs prmt. attn, the MLP product,
  K and V in FP16 (4 * 2^-11), four 16-bit roundings (< 2^-11 together) and down_proj's FP16
  accumulation (2 * 2^-11): bound 7 * 2^-11 = 3.4e-3.
These limits are this file's own, derived here; the product's (pynanoqwen/gates.py) are not imported.
"""

import dataclasses
import os

import numpy as np
import pytest
from numba import cuda

from pynanoqwen.config import PRESETS
from pynanoqwen.engine import CudaBackend, check_free_memory, device_bytes, prefill_buckets
from pynanoqwen.errors import NanoQwenError
from pynanoqwen.fileformat import NanoQwenFile
from pynanoqwen.kernels.embedding import make_embedding
from pynanoqwen.kernels.kv_layout import swizzle_rows
from pynanoqwen.kernels.gemv_fp16 import make_gemv_fp16
from pynanoqwen.kernels.page_alloc import PAGE_SIZE, make_page_alloc
from pynanoqwen.kernels.rmsnorm import make_rmsnorm
from pynanoqwen.kernels.rope_kv_write import make_rope_kv_write, rope_cos_sin
from pynanoqwen.kernels.sampling import CANDIDATES, Sampler, device_params, uniform_reference
from pynanoqwen.reference import ReferenceModel, load_layer
from pynanoqwen.sampling import SamplingParams, candidate_probabilities
from pynanoqwen.synthetic import write_synthetic_nanoqwen

gpu = pytest.mark.gpu

SEVEN_B = PRESETS["7b"]
FP16_HALF_ULP = 2.0 ** -11
FP32_EPS = 2.0 ** -23
LAYER_REL_BOUND = {"auto": 7 * FP16_HALF_ULP, "prmt": 8 * FP16_HALF_ULP, "dp4a": 4 * 8 / 440}  # module docstring
H200_SM_COUNT = 132  # the CPU tests' device: 33 attention splits per KV head at 7B
CHI2_7_DOF_P1E6 = 42.0  # P(chi-square with 7 degrees of freedom > 42) = 5.2e-7


def run(launch):
    stream = cuda.stream()
    launch(stream)
    stream.synchronize()


def finite_fp16(rng, shape):
    """Random FP16 bit patterns with the top exponent bit of inf/NaN cleared: fast, finite, wide."""
    bits = rng.integers(0, 2**16, size=shape, dtype=np.uint16) & np.uint16(0xFBFF)
    return bits.view(np.float16)


# ================================================================================================
# 1. Unit: the small kernels at 7B shapes

@gpu
def test_embedding_7b():
    rng = np.random.default_rng()
    table = finite_fp16(rng, (SEVEN_B.vocab_size, SEVEN_B.hidden_size))
    d_table = cuda.to_device(table)
    tokens = np.array([0, SEVEN_B.vocab_size - 1, *rng.integers(0, SEVEN_B.vocab_size, 6)], np.int32)
    h = cuda.device_array(SEVEN_B.hidden_size, np.float32)
    for position in range(len(tokens)):
        run(lambda s: make_embedding(SEVEN_B.hidden_size).launch(
            s, d_table, cuda.to_device(tokens), cuda.to_device(np.array([position], np.int32)), h))
        np.testing.assert_array_equal(h.copy_to_host(), table[tokens[position]].astype(np.float32))


@gpu
def test_rmsnorm_7b():
    rng = np.random.default_rng()
    hidden, eps = SEVEN_B.hidden_size, SEVEN_B.rms_norm_eps
    for scale in (1e-2, 1.0, 300.0):
        h = (rng.standard_normal(hidden) * scale).astype(np.float32)
        weight = rng.uniform(0.2, 3.0, hidden).astype(np.float16)
        xn = cuda.device_array(hidden, np.float16)
        run(lambda s: make_rmsnorm(hidden, eps).launch(s, cuda.to_device(h), cuda.to_device(weight), xn))
        h64 = h.astype(np.float64)
        expected = h64 / np.sqrt(np.mean(h64 * h64) + eps) * weight.astype(np.float64)
        error = np.abs(xn.copy_to_host().astype(np.float64) - expected)
        np.testing.assert_array_less(error, (FP16_HALF_ULP + 64 * FP32_EPS) * np.abs(expected) + 2.0**-25)


@gpu
def test_rope_kv_write_7b():
    rng = np.random.default_rng()
    cfg, max_context = SEVEN_B, 32768
    heads, kv_heads, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    half, pages = hd // 2, max_context // PAGE_SIZE
    cos, sin = rope_cos_sin(hd, cfg.rope_theta, max_context)
    d_cos, d_sin = cuda.to_device(cos), cuda.to_device(sin)
    page_table = rng.permutation(pages).astype(np.int32)
    d_table = cuda.to_device(page_table)
    k_pages = cuda.to_device(finite_fp16(rng, (pages, kv_heads, PAGE_SIZE, hd)))
    v_pages = cuda.to_device(finite_fp16(rng, (pages, kv_heads, PAGE_SIZE, hd)))
    q = cuda.device_array((heads, hd), np.float32)
    kernel = make_rope_kv_write(heads, kv_heads, hd)
    inv_freq = cfg.rope_theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    for position in (0, 1, 15, 16, 4097, max_context - 1, int(rng.integers(0, max_context))):
        qkv = (rng.standard_normal((heads + 2 * kv_heads) * hd) * 3).astype(np.float32)
        at = cuda.to_device(np.array([position], np.int32))
        run(lambda s: kernel.launch(s, cuda.to_device(qkv), d_cos, d_sin, at, d_table, q, k_pages, v_pages))
        angle = position * inv_freq
        parts = qkv.astype(np.float64).reshape(heads + 2 * kv_heads, hd)
        x1, x2 = parts[:, :half], parts[:, half:]
        rotated = np.concatenate([x1 * np.cos(angle) - x2 * np.sin(angle), x2 * np.cos(angle) + x1 * np.sin(angle)], 1)
        bound = 8 * FP32_EPS * np.tile(np.abs(x1) + np.abs(x2), 2)
        np.testing.assert_array_less(np.abs(q.copy_to_host() - rotated[:heads]), bound[:heads] + 1e-30)
        page, slot = page_table[position // PAGE_SIZE], position % PAGE_SIZE
        k_slot = swizzle_rows(k_pages.copy_to_host()[page])[:, slot].astype(np.float64)
        k_expected = rotated[heads:heads + kv_heads]
        np.testing.assert_array_less(np.abs(k_slot - k_expected),
                                     FP16_HALF_ULP * np.abs(k_expected) + bound[heads:heads + kv_heads] + 2.0**-25)
        np.testing.assert_array_equal(swizzle_rows(v_pages.copy_to_host()[page])[:, slot],
                                      parts[heads + kv_heads:].astype(np.float16))


@gpu
def test_page_alloc_on_the_gpu():
    rng = np.random.default_rng()
    table = rng.integers(0, 2048, 2048).astype(np.int32)
    free_pages = rng.permutation(2048).astype(np.int32)
    d_table, d_free_pages, d_taken = cuda.to_device(table), cuda.to_device(free_pages), cuda.to_device(
        np.array([5], np.int32))
    for step, logical in enumerate((0, 1, 2047)):
        run(lambda s: make_page_alloc().launch(s, cuda.to_device(np.array([logical * PAGE_SIZE], np.int32)),
                                               d_table, d_free_pages, d_taken))
        table[logical] = free_pages[5 + step]
    np.testing.assert_array_equal(d_table.copy_to_host(), table)
    assert d_taken.copy_to_host()[0] == 8


# -- sampling at the 7B vocabulary, default (GPU) block shapes

def draw(sampler, method, logits, params, positions: int, first_position: int = 0) -> np.ndarray:
    """Run the sampler `positions` times from first_position (it advances pos itself); the ids."""
    tokens = cuda.to_device(np.full(first_position + positions + 1, -1, np.int32))
    pos = cuda.to_device(np.array([first_position], np.int32))
    sampling, top_k, seed = (cuda.to_device(a) for a in device_params(params))
    d_logits = cuda.to_device(logits)

    def launch(stream):
        for _ in range(positions):
            sampler.launch(stream, method, d_logits, sampling, top_k, seed, tokens, pos)

    run(launch)
    assert pos.copy_to_host()[0] == first_position + positions
    return tokens.copy_to_host()[first_position + 1:]


def random_logits(rng, vocab=SEVEN_B.vocab_size, scale=3.0):
    return (rng.standard_normal(vocab) * scale).astype(np.float32)


@gpu
def test_argmax_7b_is_exact_with_lowest_id_on_ties():
    rng = np.random.default_rng()
    sampler = Sampler(SEVEN_B.vocab_size)
    for _ in range(3):
        logits = random_logits(rng)
        ties = rng.choice(SEVEN_B.vocab_size, 3, replace=False)
        logits[ties] = logits.max() + 0.5
        got = draw(sampler, "argmax", logits, SamplingParams(), 1, int(rng.integers(0, 30000)))
        assert got[0] == np.argmax(logits) == ties.min()


@gpu
def test_gumbel_sampling_7b_is_the_argmax_of_the_perturbed_logits():
    rng = np.random.default_rng()
    sampler = Sampler(SEVEN_B.vocab_size)
    logits = random_logits(rng)
    params = SamplingParams(temperature=0.7, seed=int(rng.integers(0, 2**63)))
    got = draw(sampler, "argmax", logits, params, 16)
    for position, token in enumerate(got):
        noise = -np.log(-np.log(uniform_reference(params.seed, position, np.arange(SEVEN_B.vocab_size))))
        perturbed = logits.astype(np.float64) / params.temperature + noise
        best, second = np.sort(perturbed)[-2:][::-1]
        assert perturbed[token] >= best - 1e-4  # float32 on the device
        if best - second > 1e-4:
            assert token == np.argmax(perturbed)


@pytest.mark.parametrize("top_k, top_p", [(50, 1.0), (256, 0.95), (0, 0.9), (20, 0.8)])
@gpu
def test_candidate_sampling_7b_matches_the_numpy_sampler(top_k, top_p):
    rng = np.random.default_rng()
    sampler = Sampler(SEVEN_B.vocab_size)
    logits = random_logits(rng, scale=1.0)
    # 30 tokens hold all but ~1e-3 of the mass at these temperatures: the nucleus fits in 256 tokens,
    # where the GPU sampler is exact.
    logits[rng.choice(SEVEN_B.vocab_size, 30, replace=False)] += 20
    params = SamplingParams(temperature=float(rng.uniform(0.6, 1.2)), top_k=top_k, top_p=top_p,
                            seed=int(rng.integers(0, 2**63)))
    got = draw(sampler, "candidates", logits, params, 8)
    # Merge block b leaves the top CANDIDATES of its group of slices (larger logit, then lower id), in order.
    group_logits = -(-SEVEN_B.vocab_size // sampler.lists) * (sampler.lists // sampler.merge_blocks)
    merged = sampler.merged_indices.copy_to_host()
    for b in range(sampler.merge_blocks):
        group = np.arange(b * group_logits, min(SEVEN_B.vocab_size, (b + 1) * group_logits))
        order = group[np.argsort(-logits[group], kind="stable")[:CANDIDATES]]
        np.testing.assert_array_equal(merged[b * CANDIDATES:(b + 1) * CANDIDATES], order)
    ids, probs = candidate_probabilities(logits, params)
    cdf = np.cumsum(probs)
    for position, token in enumerate(got):
        u = uniform_reference(params.seed, position, SEVEN_B.vocab_size)
        if np.min(np.abs(cdf - u)) > 1e-5:  # away from a CDF boundary float32 cannot move the draw
            assert token == ids[min(int(np.searchsorted(cdf, u, side="right")), len(ids) - 1)]
        else:
            assert token in ids


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(np.sum((counts - expected) ** 2 / expected))


@gpu
def test_sampled_frequencies_follow_the_distribution():
    """8 bins each (7 degrees of freedom), 20000 draws per method: the top-8 candidates, and
    Gumbel-max over the whole vocabulary with 7 boosted tokens plus 'everything else'."""
    rng = np.random.default_rng()
    sampler = Sampler(SEVEN_B.vocab_size)
    logits = random_logits(rng, scale=1.0)
    params = SamplingParams(temperature=1.0, top_k=8, seed=int(rng.integers(0, 2**63)))
    ids, probs = candidate_probabilities(logits, params)
    got = draw(sampler, "candidates", logits, params, 20000)
    counts = np.array([np.sum(got == i) for i in ids])
    assert counts.sum() == len(got) and chi_square(counts, probs) < CHI2_7_DOF_P1E6

    boosted = rng.choice(SEVEN_B.vocab_size, 7, replace=False)
    logits[boosted] = np.log(np.linspace(2e4, 1e5, 7))  # comparable to the rest's total mass
    params = SamplingParams(temperature=1.0, seed=int(rng.integers(0, 2**63)))
    weights = np.exp(logits.astype(np.float64))
    probs = np.append(weights[boosted], weights.sum() - weights[boosted].sum()) / weights.sum()
    got = draw(sampler, "argmax", logits, params, 20000)
    counts = np.array([np.sum(got == i) for i in boosted] + [np.sum(~np.isin(got, boosted))])
    assert chi_square(counts, probs) < CHI2_7_DOF_P1E6


@gpu
def test_gemv_fp16_7b_lm_head():
    rng = np.random.default_rng()
    n, k = SEVEN_B.vocab_size, SEVEN_B.hidden_size
    weight = (rng.standard_normal((n, k), dtype=np.float32) * 0.05).astype(np.float16)
    x = rng.standard_normal(k).astype(np.float16)
    out = cuda.device_array(n, np.float32)
    gemv = make_gemv_fp16(n, k, weight)
    run(lambda s: gemv.launch(s, cuda.to_device(x), out))
    w64, x64 = weight.astype(np.float64), x.astype(np.float64)
    expected = w64 @ x64
    # Products of FP16 values are exact in float32; each lane then adds k/256 * 8 of them in
    # sequence and a 5-step warp_sum folds the lanes: at most (8k/256 + 6) roundings of the sum.
    bound = (8 * k // 256 + 6) * FP32_EPS / 2 * (np.abs(w64) @ np.abs(x64))
    np.testing.assert_array_less(np.abs(out.copy_to_host() - expected), bound + 1e-30)


# ================================================================================================
# 2. Layer: the engine's decoder layer against transformers' Qwen2DecoderLayer

def hf_decoder_layer(cfg, file, layer: int):
    """transformers' Qwen2DecoderLayer in float64 with layer `layer` of `file`, dequantized."""
    import torch
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

    hf_cfg = Qwen2Config(**cfg.to_hf_dict(), attn_implementation="eager")
    module = Qwen2DecoderLayer(hf_cfg, layer).to(torch.float64).eval()
    w = load_layer(file, layer)
    state = {f"self_attn.{m}_proj.weight": getattr(w, f"{m}_proj") for m in "qkvo"}
    state |= {f"self_attn.{m}_proj.bias": getattr(w, f"{m}_bias") for m in "qkv"}
    state |= {f"mlp.{m}_proj.weight": getattr(w, f"{m}_proj") for m in ("gate", "up", "down")}
    state |= {"input_layernorm.weight": w.input_norm, "post_attention_layernorm.weight": w.post_attention_norm}
    module.load_state_dict({k: torch.from_numpy(np.asarray(v, np.float64)) for k, v in state.items()}, strict=True)
    return module, Qwen2RotaryEmbedding(hf_cfg)


def hf_layer_outputs(module, rotary, x: np.ndarray) -> np.ndarray:
    import torch

    seq = len(x)
    hidden = torch.from_numpy(x.astype(np.float64))[None]
    positions = torch.arange(seq)[None]
    cos, sin = rotary(hidden, positions)
    mask = torch.full((seq, seq), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    with torch.no_grad():
        out = module(hidden_states=hidden, attention_mask=mask, position_embeddings=(cos, sin))
    out = out[0] if isinstance(out, tuple) else out
    return out[0].numpy()


def relative_errors(ours: np.ndarray, theirs: np.ndarray) -> dict:
    rows = np.linalg.norm(ours - theirs, axis=-1) / np.linalg.norm(theirs, axis=-1)
    return {"rel_l2": float(np.linalg.norm(ours - theirs) / np.linalg.norm(theirs)),
            "max_row_rel_l2": float(rows.max()),
            "max_abs_err_over_max_abs": float(np.abs(ours - theirs).max() / np.abs(theirs).max())}


def layer_vs_transformers(tmp_dir, gemv: str = "prmt", seq: int = 24, seed: int = 0) -> dict:
    """One 7B-dimension decoder layer: engine (INT4) against Qwen2DecoderLayer (float64)."""
    cfg = dataclasses.replace(SEVEN_B, num_layers=1, vocab_size=2048)
    path = os.path.join(tmp_dir, f"layer7b_{seed}.nanoqwen")
    cfg = write_synthetic_nanoqwen(path, cfg, seed)
    x = np.random.default_rng(seed).standard_normal((seq, cfg.hidden_size)).astype(np.float32)
    backend = CudaBackend(path, max_context=64, gemv=gemv, eager=True)
    ours = backend.layer_outputs(0, x)
    with NanoQwenFile(path) as file:
        module, rotary = hf_decoder_layer(cfg, file, 0)
    theirs = hf_layer_outputs(module, rotary, x)
    # The layer's own contribution (output - input) is what its arithmetic changed; the residual
    # passes x through exactly, so it is also reported relative to that.
    update = relative_errors(ours - x, theirs - x)
    return {"gemv": gemv, "positions": seq, **relative_errors(ours, theirs),
            "update_rel_l2": update["rel_l2"], "update_max_row_rel_l2": update["max_row_rel_l2"]}


@pytest.mark.slow
@pytest.mark.parametrize("gemv", ["auto", "prmt", "dp4a"])
@gpu
def test_decoder_layer_matches_transformers(tmp_path, gemv):
    result = layer_vs_transformers(tmp_path, gemv)
    print(result)
    assert result["update_max_row_rel_l2"] < LAYER_REL_BOUND[gemv]


# ================================================================================================
# 3. Model: a random 7B-shaped model

@pytest.fixture(scope="module")
def model_7b(tmp_path_factory):
    given = os.environ.get("PYNANOQWEN_7B_FILE")
    if given:
        return given
    path = tmp_path_factory.mktemp("model") / "random7b.nanoqwen"
    write_synthetic_nanoqwen(path, SEVEN_B, seed=0)
    return str(path)


@pytest.fixture(scope="module")
def backend_7b(model_7b):
    backend = CudaBackend(model_7b, max_context=4096)
    yield backend
    backend.close()


@pytest.mark.slow
@gpu
def test_self_check_passes_and_names_a_corrupted_layer_7b(backend_7b, model_7b):
    """generate's self-check (selfcheck.py) on the 7B model: passes as loaded, then fails naming
    layer 5's down projection, in the decode step and in the prefill chunk (the GEMV and the GEMM
    share the weights), once that layer's scales are negated on the device. The chunk runs again
    in every bucket with other GEMM tiles (the TMA-fed ones among them), with the first bucket's
    bits, broken weights or not (the time it takes is printed)."""
    from pynanoqwen.selfcheck import run_self_check

    with NanoQwenFile(model_7b, verify_data=False) as weights:
        result = run_self_check(backend_7b, weights)
        print(f"\n7b {result.summary()}")
        assert not result.failed, result.summary()
        assert result.buckets == (32, 128, 256, 512, 1024)
        scales = backend_7b.weights.layers[5].down.scales
        original = scales.copy_to_host()
        scales.copy_to_device(-original)
        try:
            broken = run_self_check(backend_7b, weights)
        finally:
            scales.copy_to_device(original)
    assert [c.name for c in broken.failed] == ["layer 5 down", "prefill layer 5 down"], broken.summary()


@pytest.mark.slow
@gpu
def test_prepare_captures_every_prefill_graph_a_prompt_needs(backend_7b):
    """After prepare(n), generating from an n-token prompt captures no graph (nothing compiles
    inside the time to first token), for a one-chunk and a two-chunk prompt."""
    rng = np.random.default_rng()
    for tokens in (300, backend_7b.prefill_buckets[-1] + 300):
        backend_7b.prepare(tokens, SamplingParams())
        captured = set(backend_7b.prefill_graphs)
        ids = rng.integers(0, SEVEN_B.vocab_size, tokens).tolist()
        assert len(list(backend_7b.generate(ids, SamplingParams(), 2, frozenset()))) == 2
        assert set(backend_7b.prefill_graphs) == captured


def teacher_forced_vs_reference(backend, path, tokens: int = 64, seed: int = 0) -> dict:
    """Logits of `tokens` random ids, GPU (teacher forcing) against the numpy ReferenceModel."""
    ids = np.random.default_rng(seed).integers(0, backend.config.vocab_size, tokens)
    ours = backend.teacher_forced_logits(ids)
    with NanoQwenFile(path, verify_data=False) as file:
        theirs = ReferenceModel(file, max_context=tokens).forward(ids)
    errors = relative_errors(ours, theirs)
    top2 = np.sort(theirs, axis=1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    max_abs = float(np.abs(ours - theirs).max())
    clear = margin > 2 * max_abs  # rows whose reference winner no error of this size can change
    agree = ours.argmax(1) == theirs.argmax(1)
    return {"tokens": tokens, **errors, "max_abs_err": max_abs, "top1_agreement": float(agree.mean()),
            "rows_with_clear_winner": int(clear.sum()), "top1_agreement_clear_rows": float(agree[clear].mean())
            if clear.any() else None}


def graph_vs_eager(backend, prompts: int, new_tokens: int = 32, seed: int = 0) -> dict:
    """Tokens of `prompts` random prompts, greedy (and a few sampled), in graph and eager mode."""
    rng = np.random.default_rng(seed)
    cases = []
    for index in range(prompts):
        ids = rng.integers(0, backend.config.vocab_size, int(rng.integers(1, 17))).tolist()
        params = SamplingParams() if index % 4 else SamplingParams(temperature=0.8, top_k=40, top_p=0.9,
                                                                   seed=index)
        cases.append((ids, params))
    results = {}
    for eager in (False, True):
        backend.eager = eager
        results[eager] = [list(backend.generate(ids, params, new_tokens, frozenset())) for ids, params in cases]
    backend.eager = False
    mismatches = [i for i, (a, b) in enumerate(zip(results[False], results[True])) if a != b]
    return {"prompts": prompts, "new_tokens": new_tokens, "mismatched_prompts": mismatches,
            "identical": not mismatches}


def allocations_during_decode(backend, steps: int = 128) -> dict:
    """Device allocations (numba's memalloc) and the change in free memory over `steps` tokens."""
    from numba.cuda.cudadrv import driver

    calls = []
    original = driver.Context.memalloc

    def counting(self, size):
        calls.append(size)
        return original(self, size)

    results = {}
    for eager in (False, True):
        backend.eager = eager
        list(backend.generate([1, 2, 3], SamplingParams(), 2, frozenset()))  # warm the Python paths
        cuda.synchronize()
        free_before, _ = cuda.current_context().get_memory_info()
        driver.Context.memalloc = counting
        try:
            tokens = list(backend.generate([1, 2, 3], SamplingParams(), steps, frozenset()))
            cuda.synchronize()
        finally:
            driver.Context.memalloc = original
        free_after, _ = cuda.current_context().get_memory_info()
        results["eager" if eager else "graph"] = {"tokens": len(tokens), "memalloc_calls": len(calls),
                                                  "free_bytes_change": int(free_after - free_before)}
        calls.clear()
    backend.eager = False
    return results


@pytest.mark.slow
@gpu
def test_teacher_forced_logits_match_the_reference_model(backend_7b, model_7b):
    result = teacher_forced_vs_reference(backend_7b, model_7b)
    print(result)
    # 28 layers of errors within the layer bound of the backend's path, each added to a residual
    # stream that keeps them.
    assert result["max_row_rel_l2"] < SEVEN_B.num_layers * LAYER_REL_BOUND[backend_7b.gemv]
    assert result["rows_with_clear_winner"] == 0 or result["top1_agreement_clear_rows"] == 1.0


@pytest.mark.slow
@gpu
def test_graph_and_eager_give_identical_tokens(backend_7b):
    result = graph_vs_eager(backend_7b, int(os.environ.get("PYNANOQWEN_GRAPH_EAGER_PROMPTS", "8")))
    print(result)
    assert result["identical"], result


@pytest.mark.slow
@gpu
def test_prefill_kernel_groups_cover_a_chunk_and_leave_generation_alone(backend_7b):
    """bench's prefill breakdown (engine.probes.prefill_kernel_groups): the stages of a 512-row
    chunk, every launch of it but the page allocation, in the chunk's order; replayed, then the
    engine reset, a generation gives the tokens it gave before."""
    from pynanoqwen.bench_kernels import prefill_kernel_breakdown

    prompt = np.random.default_rng().integers(0, 4000, 300).tolist()
    before = list(backend_7b.generate(prompt, SamplingParams(), 8, frozenset()))
    launches = [launch for launch in backend_7b.prefill_launches(512, "argmax") if launch.stage != "page_alloc"]
    groups = backend_7b.prefill_kernel_groups(512)
    assert sum(group.launches for group in groups) == len(launches)
    assert [group.name.split()[0] for group in groups] == list(dict.fromkeys(launch.stage for launch in launches))
    rows = prefill_kernel_breakdown(backend_7b, 512)
    print({row["name"]: round(row["us"], 1) for row in rows})
    assert all(row["us"] > 0 for row in rows)
    assert list(backend_7b.generate(prompt, SamplingParams(), 8, frozenset())) == before


@pytest.mark.slow
@gpu
def test_decoding_allocates_no_device_memory(backend_7b):
    result = allocations_during_decode(backend_7b, 128)
    print(result)
    for mode in ("graph", "eager"):
        assert result[mode]["tokens"] == 128
        assert result[mode]["memalloc_calls"] == 0
        assert result[mode]["free_bytes_change"] == 0


@pytest.mark.slow
@gpu
def test_prompt_too_long_for_max_context_is_a_clear_error(backend_7b):
    with pytest.raises(NanoQwenError, match="exceed max_context"):
        list(backend_7b.generate([1] * 4000, SamplingParams(), 200, frozenset()))


# ================================================================================================
# What the engine refuses, checked without a GPU

def test_kv_cache_size_of_7b_at_32k_context():
    needed = device_bytes(SEVEN_B, weight_bytes=0, max_context=32768, attention_splits=H200_SM_COUNT // 4)
    # K and V, 28 layers, 32768 positions, 4 KV heads x 128 dims, 2 bytes each: 1.75 GiB.
    assert needed["kv cache"] == 2 * 28 * 32768 * 4 * 128 * 2
    assert needed["rope tables"] == 2 * 32768 * 64 * 4


def test_the_prefill_workspaces_are_counted():
    """Prefill attention's split form keeps a lane's 68 floats for every (row block of 16 in 128 rows,
    KV head, 512-key segment, warp): 8 x 4 x 64 x 7 x 32 x 68 floats at 7B and 32768 positions. The
    GEMMs sum down_proj's K in 4 chunks: the split form keeps 4 chunk sums of 128 rows x 3584
    outputs, and the TMA kernel (from 1024 rows) a running total for each of the longest bucket's
    2048 rows x 3584 outputs, in the same words, so the larger of the two; and an arrival counter
    for each of 8 x 56 block tiles (16 rows x 64 outputs each)."""
    with_prefill = device_bytes(SEVEN_B, weight_bytes=0, max_context=32768, attention_splits=H200_SM_COUNT // 4)
    without = device_bytes(SEVEN_B, weight_bytes=0, max_context=32768, prefill_rows=0,
                           attention_splits=H200_SM_COUNT // 4)
    attention = 4 * 8 * 4 * 64 * 7 * 32 * 68
    gemm = 4 * max(4 * 128, 2048) * 3584 + 4 * 8 * 56
    assert with_prefill["workspaces"] - without["workspaces"] == attention + gemm


def test_the_self_check_probes_the_buckets_a_prompt_uses():
    """probe_buckets (no GPU): the probe's own bucket, then those of the prompt's chunks (every
    bucket for serve) that launch GEMM kernels it does not; an engine without batched prefill
    leaves probed_prefill to say why no chunk runs."""
    backend = CudaBackend.__new__(CudaBackend)
    backend.prefill_buckets, backend.config = prefill_buckets(32768), SEVEN_B
    assert backend.probe_buckets(24) == [32, 128, 256, 512, 1024]
    assert backend.probe_buckets(24, 24) == [32]
    assert backend.probe_buckets(24, 600) == [32, 640]  # one chunk in 640 rows: the 128-token tiles
    assert backend.probe_buckets(24, 5000) == [32, 1024]  # 2048 + 2048 + 904 (in 1024 rows): the TMA tiles
    backend.prefill_buckets = ()
    assert backend.probe_buckets(24) == [None]


@pytest.mark.parametrize("first", [0, 16, 2032])
@pytest.mark.parametrize("tokens", [1, 15, 16, 2047, 2048, 2049, 2064, 2065, 4096, 4100, 5000])
def test_prompt_chunks_cover_the_prompt_and_only_the_last_samples(tokens, first):
    """The batched prefill's chunks (also what prepare() compiles), from position `first` (0, or
    what a prefix-cache lease reused): consecutive, at most the longest bucket each, covering every
    token once, the last one sampling by the method."""
    if first >= tokens:
        return
    backend = CudaBackend.__new__(CudaBackend)  # _chunks needs only the buckets: no GPU
    backend.prefill_buckets = prefill_buckets(32768)
    chunks = backend._chunks(tokens, "argmax", first)
    assert chunks[0][0] == first and all(a + m == b for (a, m, _), (b, _, _) in zip(chunks, chunks[1:]))
    assert sum(m for _, m, _ in chunks) == tokens - first and all(1 <= m <= 2048 for _, m, _ in chunks)
    assert [method for _, _, method in chunks] == ["prompt"] * (len(chunks) - 1) + ["argmax"]


@pytest.mark.parametrize("tokens", [1, 16, 17, 64, 65, 128, 129, 522, 1000, 2047, 2048, 4006, 5000])
def test_a_chunk_runs_in_a_bucket_at_most_127_rows_longer(tokens):
    """Every chunk of a prompt runs in the smallest bucket that holds it, and past 64 rows that
    bucket pads it by fewer than PREFILL_STEP rows (a 522-token prompt ran as 1024 rows when the
    buckets were powers of two); the buckets stay sorted, distinct and within the longest."""
    from pynanoqwen.engine.memory import PREFILL_STEP

    backend = CudaBackend.__new__(CudaBackend)
    backend.prefill_buckets = prefill_buckets(32768)
    assert list(backend.prefill_buckets) == sorted(set(backend.prefill_buckets))
    assert backend.prefill_buckets[:3] == (16, 32, 64) and backend.prefill_buckets[-1] == 2048
    for _, m, _ in backend._chunks(tokens, "argmax"):
        rows = backend._bucket(m)
        assert rows >= m and all(bucket < m for bucket in backend.prefill_buckets if bucket < rows)
        assert m <= 64 or rows - m < PREFILL_STEP


def test_too_little_gpu_memory_is_a_clear_error():
    needed = device_bytes(SEVEN_B, weight_bytes=4 * 2**30, max_context=32768, attention_splits=H200_SM_COUNT // 4)
    with pytest.raises(NanoQwenError, match=r"needs .* GiB of GPU memory .* only 3.00 of 80.00 GiB are free"):
        check_free_memory(needed, 32768, free=3 * 2**30, total=80 * 2**30)


def test_without_a_gpu_the_engine_is_a_clear_error(tmp_path):
    from conftest import gpu_available

    if gpu_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(NanoQwenError, match="no CUDA GPU"):
        CudaBackend(tmp_path / "model.nanoqwen")

"""The self-check `generate` runs on the GPU before it streams a token: one decode step and one
prefill chunk of the loaded model, kernel by kernel, against float64 on the same weights.

Why: a model that loads and runs can still compute garbage (a kernel miscompiled for this GPU or
driver, weights damaged on their way to the device, a file whose tensors are not the model its
header says), and greedy decoding would print that garbage fluently. The check costs one decode
step, one short prefill and a slice of the weights on the host, so it runs every time
(`--skip-selfcheck` turns it off).

How: the engine runs its own launch lists eagerly and copies to the host what every launch wrote,
right after it ran (backends.GpuEngine.probed_step, probed_prefill):
- decode: a random token at position 0, then a second one at position 1, whose step is checked
  (position 1, so that RoPE rotates by a non-zero angle and attention weighs two keys);
- prefill: PREFILL_TOKENS random tokens (fewer if the context is shorter) as one chunk (the
  32-row bucket: a wgmma GEMM tile, kernels/gemm_int4_tiles.default_tiles_for), then the first
  token; then the same chunk in each bucket that launches GEMM kernels the ones before did not
  (longer prompts run other tiles: the TMA-fed kernel from 512 rows at 7B), among the buckets the
  prompt will use (`generate`) or all of them (`serve`, `validate`): GpuEngine.probe_buckets. Where
  the model's linears sum a row alike at every bucket (gemm_int4_tiles.rows_sum_alike, which the
  prefix cache relies on), every output of such a chunk must be bit for bit the float64-checked
  chunk's; otherwise it is checked against float64 in full. Their kernels compile at the first
  start (the kernel cache keeps them, kernel_cache.py).
Each output is recomputed in float64 from the inputs the GPU gave that launch (its predecessor's
captured output), so a failure names one kernel of one layer, and errors never compound:

    embedding        h is the token's embedding row, exactly
    norms            (where a kernel of its own runs them) xn, all of it
    qkv              SAMPLED_ROWS output features of W RMSNorm(h) + b, from each of q, k and v; in
                     decode, where the GEMV's epilogue also rotates and writes K/V, sampled
                     (d, d + head_dim/2) pairs of q and of the K and V slots
    rope_kv_write    (prefill) q, and the K and V cache slots of the positions, all of them
    attention        causal softmax over the cached positions, all heads
    o_proj, down     SAMPLED_ROWS features of the residual update
    gate_up          SAMPLED_ROWS features of silu(Wg xn) * (Wu xn)
    last_row         (prefill) the decode h is the chunk's last row, and pos its position
    lm_head          LM_HEAD_ROWS rows of the logits, the GPU's argmax row among them
    sampler          the sampled token is the argmax of the GPU's logits

Sampling features keeps the host's share to a few rows of each matrix: for the 7B model 28 layers
x ~60 rows, about 20 MB of weights read from the file's mmap instead of 3.6 GB. A wrong kernel is
wrong in most rows (a layout or fragment mistake), so a handful of random rows finds it; the
validate command's unit tier checks every row. Bounds: pynanoqwen/oracles.py, each derived from
the kernel's arithmetic; a GEMV that normalises its own input reads RMSNorm(h) within
oracles.rmsnorm_oracle's bound of the exact one.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from .config import ModelConfig
from .errors import NanoQwenError
from .fileformat import NanoQwenFile
from .kernels import PAGE_SIZE
from .oracles import FP16_TINY, U16, U32, Check, attention_oracle, bound_report, fp16_gemv_oracle, gemm_oracle, gemv_oracle, \
    passed, rmsnorm_oracle, rope_oracle, silu_product_oracle
from .reference import WeightSource
from .tensors import QWEIGHT, SCALES, layer_prefix

SAMPLED_ROWS = 16  # output features of each linear checked per layer (qkv: 8 of q, 4 of k, 4 of v)
LM_HEAD_ROWS = 64
POSITION = 1  # the checked decode step's position: RoPE rotates, attention sees two keys
PREFILL_TOKENS = 24


@dataclasses.dataclass(frozen=True)
class SelfCheckResult:
    checks: list[Check]
    seconds: float
    buckets: tuple[int, ...] = ()  # the prefill buckets the chunk ran in, the float64-checked one first

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status == "FAIL"]

    def summary(self) -> str:
        if self.failed:
            first = "; ".join(f"{c.name}: {c.detail}" for c in self.failed[:3])
            return f"self-check FAILED ({len(self.failed)} of {len(self.checks)} kernel checks): {first}"
        again = f", again in {', '.join(map(str, self.buckets[1:]))} rows" if len(self.buckets) > 1 else ""
        return (f"self-check passed: one decode step and one prefill chunk{again}, {len(self.checks)} kernel "
                f"checks against float64 or its bits ({self.seconds:.2f} s)")


def run_self_check(backend, weights: WeightSource, rng: np.random.Generator | None = None,
                   prompt_tokens: int | None = None) -> SelfCheckResult:
    """Probe one decode step and one prefill chunk of `backend` (backends.GpuEngine) and check
    them against `weights`, the weights it was loaded from; then run the chunk again in every
    bucket that launches other GEMM kernels (GpuEngine.probe_buckets: of those a prompt of
    prompt_tokens uses, or of all buckets when None) and check that too."""
    start = time.perf_counter()
    rng = np.random.default_rng() if rng is None else rng
    vocab = weights.config.vocab_size
    first, token = (int(t) for t in rng.integers(0, vocab, 2))
    checks = check_probed_step(weights, backend.probed_step(first, token), token, backend.gemv, rng)
    prompt = [int(t) for t in rng.integers(0, vocab, min(PREFILL_TOKENS, backend.max_context))]
    buckets = backend.probe_buckets(len(prompt), prompt_tokens)
    probed = backend.probed_prefill(prompt, buckets[0])
    checks += [dataclasses.replace(c, name=f"prefill {c.name}")
               for c in check_probed_prefill(weights, probed, prompt, backend.gemv, rng)]
    for rows in buckets[1:]:
        again = backend.probed_prefill(prompt, rows)
        if backend.rows_sum_alike:
            checks.append(same_bits_check(f"prefill in {rows} rows", again, probed, f"in {buckets[0]} rows"))
        else:
            checks += [dataclasses.replace(c, name=f"prefill in {rows} rows {c.name}")
                       for c in check_probed_prefill(weights, again, prompt, backend.gemv, rng)]
    return SelfCheckResult(checks, time.perf_counter() - start, tuple(buckets))


def same_bits_check(name: str, captured: dict, expected: dict, expected_name: str) -> Check:
    """Every output of a probed chunk bit for bit that of the same chunk probed in another bucket
    (expected, already checked against float64): what a model whose linears sum a row alike at
    every bucket promises (gemm_int4_tiles.rows_sum_alike), and what its prefix cache relies on."""
    differ = [f"{'' if layer is None else f'layer {layer} '}{stage} {buffer}"
              for (layer, stage), out in expected.items() for buffer, array in out.items()
              if (layer, stage) not in captured or buffer not in captured[layer, stage]
              or captured[layer, stage][buffer].tobytes() != array.tobytes()]
    outputs = sum(len(out) for out in expected.values())
    return passed(name, not differ, f"all {outputs} outputs bit for bit those {expected_name}" if not differ else
                  f"{len(differ)} of {outputs} outputs differ from those {expected_name}, first: {differ[0]}")


def require_self_check(backend, model_path, prompt_tokens: int | None = None) -> str:
    """Self-check a backend loaded from the .nanoqwen file model_path (for a prompt of
    prompt_tokens, or for every prompt: run_self_check): its summary line, or a NanoQwenError
    that says what failed and what to do."""
    with NanoQwenFile(model_path, verify_data=False) as weights:
        result = run_self_check(backend, weights, prompt_tokens=prompt_tokens)
    if result.failed:
        raise NanoQwenError(f"{result.summary()}. The GPU engine does not compute this model as the reference "
                            f"does; `python -m pynanoqwen validate --model {model_path}` gives the full report, "
                            "and --skip-selfcheck generates anyway")
    return result.summary()


def _gemv_linears(path: str):
    """The oracle of the decode GEMVs on `path`, for one token row (linear's contract in _check_layer)."""

    def linear(weights, name, features, x, x_error):
        expected, bound = gemv_oracle(*_rows(weights, name, features), x[0], path,
                                      None if x_error is None else x_error[0])
        return expected[None], bound[None]

    return linear


def _gemm_linears(weights, name, features, x, x_error):
    """The oracle of the prefill GEMMs over every row of x (they read captured inputs: no x_error)."""
    return gemm_oracle(*_rows(weights, name, features), x)


def check_probed_step(weights: WeightSource, captured: dict, token: int, path: str,
                      rng: np.random.Generator) -> list[Check]:
    """Every check of the module docstring on what GpuEngine.probed_step captured."""
    cfg = weights.config
    h = captured[None, "embedding"]["h"][None]
    checks = [_embedding_check(weights, h, [token])]
    positions = np.array([POSITION])
    for layer in range(cfg.num_layers):
        stages = _stages(captured, layer, lambda a: a[None])
        layer_checks, h = _check_layer(weights, layer, stages, h, positions, _gemv_linears(path), rng)
        checks += [dataclasses.replace(c, name=f"layer {layer} {c.name}") for c in layer_checks]
    return checks + _check_head(weights, _stages(captured, None, lambda a: a), h[0], path, rng, POSITION)


def check_probed_prefill(weights: WeightSource, captured: dict, prompt: list[int], path: str,
                         rng: np.random.Generator) -> list[Check]:
    """Every check of the module docstring on what GpuEngine.probed_prefill captured for `prompt`."""
    cfg, m = weights.config, len(prompt)
    pages = -(-m // PAGE_SIZE)
    alloc = captured[None, "page_alloc"]
    ok = np.array_equal(alloc["page_table"][:pages], np.arange(pages)) and int(alloc["next_free_page"][0]) == pages
    checks = [passed("page_alloc", ok, f"pages 0..{pages - 1}, in order" if ok else
                     f"not the first {pages} pages in order, as {m} decode steps would take them")]
    h = captured[None, "embedding"]["h"]
    checks.append(_embedding_check(weights, h, prompt))
    positions = np.arange(m)
    for layer in range(cfg.num_layers):
        layer_checks, h = _check_layer(weights, layer, _stages(captured, layer, lambda a: a), h, positions,
                                       _gemm_linears, rng)
        checks += [dataclasses.replace(c, name=f"layer {layer} {c.name}") for c in layer_checks]
    handed = captured[None, "last_row"]
    ok = np.array_equal(handed["h"], h[-1]) and int(handed["pos"][0]) == m - 1
    checks.append(passed("last_row", ok, f"row {m - 1} and pos {m - 1}" if ok else "not the chunk's last row and pos"))
    return checks + _check_head(weights, _stages(captured, None, lambda a: a), handed["h"], path, rng, m - 1)


def _stages(captured: dict, layer: int | None, shape) -> dict:
    """{stage: {buffer: array}} of one layer (or of the launches outside the layers)."""
    return {stage: {name: shape(array) if name not in ("k", "v") else array for name, array in out.items()}
            for (index, stage), out in captured.items() if index == layer}


def _rows(weights: WeightSource, name: str, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(qweight, scales) of some rows of an INT4 linear, read from the file's mmap."""
    return np.asarray(weights.tensor(name + QWEIGHT)[rows]), np.asarray(weights.tensor(name + SCALES)[rows])


def _sample(rng: np.random.Generator, n: int, count: int = SAMPLED_ROWS) -> np.ndarray:
    return np.sort(rng.choice(n, min(count, n), replace=False))


def _embedding_check(weights: WeightSource, h: np.ndarray, tokens) -> Check:
    rows = np.asarray(weights.tensor("model.embed_tokens.weight")[np.asarray(tokens)]).astype(np.float32)
    ok = np.array_equal(h, rows)
    return passed("embedding", ok, f"{len(rows)} token(s): " + ("their rows, exactly" if ok else "not their rows"))


def _normed_input(stages: dict, stage: str, h: np.ndarray, weight: np.ndarray, eps: float) -> tuple:
    """The input of a linear that reads RMSNorm(h): (x, x_error, checks). With a norm kernel of its
    own (captured as `stage`) x is that kernel's FP16 output, exact, and that output is checked."""
    xn, bound = rmsnorm_oracle(h, weight, eps)
    if stage not in stages:
        return xn, bound, []
    got = stages[stage]["xn"].astype(np.float64)
    return got, None, [bound_report(stage.replace("_", " "), np.abs(got - xn), bound)]


def _check_layer(weights: WeightSource, layer: int, stages: dict, h: np.ndarray, positions: np.ndarray, linear,
                 rng: np.random.Generator) -> tuple[list[Check], np.ndarray]:
    """The checks of one layer whose input rows h [tokens, hidden] (float32) sit at `positions`;
    returns them and the layer's output rows. `linear(weights, name, features, x, x_error)` is
    the oracle of the mode's linears: (expected, bound) [tokens, features]."""
    cfg: ModelConfig = weights.config
    prefix = layer_prefix(layer)
    checks = []

    x, x_error, norm_checks = _normed_input(stages, "input_norm", h, weights.tensor(prefix + "input_layernorm.weight"),
                                            cfg.rms_norm_eps)
    checks += norm_checks
    if "rope_kv_write" not in stages:  # decode: the QKV GEMV rotates and writes K/V itself
        checks.append(_fused_qkv_check(weights, layer, stages["qkv"], x, x_error, positions, linear, rng))
        rope = stages["qkv"]
    else:
        checks += _qkv_and_rope_checks(weights, layer, stages, x, x_error, positions, linear, rng)
        rope = stages["rope_kv_write"]

    # Attention of the rotated q over the cached positions (the GPU's cache, as the kernel read it).
    context = int(positions[-1]) + 1
    prefill = len(positions) > 1
    expected, bound = attention_oracle(rope["q"], rope["k"][:context], rope["v"][:context], positions,
                                       fp16_operands=prefill)
    attn = stages["attention"]["attn"]
    checks.append(bound_report("attention", np.abs(attn.astype(np.float64) - expected), bound))

    # o_proj: sampled features of the residual update h_mid - h.
    h_mid = stages["o_proj"]["h"]
    checks.append(_residual_check("o_proj", weights, prefix + "self_attn.o_proj.weight", attn, h, h_mid, linear, rng))

    # gate_up: sampled features of silu(Wg xn) * (Wu xn).
    x, x_error, norm_checks = _normed_input(stages, "post_attention_norm", h_mid,
                                            weights.tensor(prefix + "post_attention_layernorm.weight"),
                                            cfg.rms_norm_eps)
    checks += norm_checks
    features = _sample(rng, cfg.intermediate_size)
    g, g_bound = linear(weights, prefix + "mlp.gate_proj.weight", features, x, x_error)
    u, u_bound = linear(weights, prefix + "mlp.up_proj.weight", features, x, x_error)
    expected, bound = silu_product_oracle(g, g_bound, u, u_bound)
    mlp = stages["gate_up"]["mlp"]
    checks.append(bound_report("gate_up", np.abs(mlp[:, features].astype(np.float64) - expected), bound))

    h_out = stages["down"]["h"]
    checks.append(_residual_check("down", weights, prefix + "mlp.down_proj.weight", mlp, h_mid, h_out, linear, rng))
    return checks, h_out


def _qkv_and_rope_checks(weights: WeightSource, layer: int, stages: dict, x, x_error, positions, linear,
                         rng: np.random.Generator) -> list[Check]:
    """Prefill: sampled features of the QKV output buffer, then RoPE and the K/V slots it wrote."""
    cfg: ModelConfig = weights.config
    prefix = layer_prefix(layer)
    heads, kv_heads, hd, q_size, kv_size = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.q_size, cfg.kv_size
    checks = []
    qkv = stages["qkv"]["qkv"].astype(np.float64)
    errors, bounds = [], []
    for offset, module, n, count in ((0, "q_proj", q_size, SAMPLED_ROWS // 2),
                                     (q_size, "k_proj", kv_size, SAMPLED_ROWS // 4),
                                     (q_size + kv_size, "v_proj", kv_size, SAMPLED_ROWS // 4)):
        features = _sample(rng, n, count)
        name = f"{prefix}self_attn.{module}"
        expected, bound = linear(weights, name + ".weight", features, x, x_error)
        expected = expected + np.asarray(weights.tensor(name + ".bias")[features], np.float64)
        errors.append(np.abs(qkv[:, offset + features] - expected))
        bounds.append(bound + U32 * np.abs(expected))
    checks.append(bound_report("qkv", np.concatenate(errors, 1), np.concatenate(bounds, 1)))

    # RoPE at the positions on q and k, and the K/V slots it writes.
    _, rotated, f32 = rope_oracle(qkv, positions, heads, kv_heads, hd, cfg.rope_theta)
    rope = stages["rope_kv_write"]
    k_slots, v_slots = rope["k"][positions], rope["v"][positions]  # [tokens, kv_heads, hd] float16
    k_rot = rotated[:, heads:heads + kv_heads]
    if not np.array_equal(v_slots, rotated[:, heads + kv_heads:].astype(np.float32).astype(np.float16)):
        checks.append(passed("rope_kv_write", False, "a V slot of the positions is not float16(v)"))
    else:
        checks.append(bound_report("rope_kv_write", np.concatenate([
            np.abs(rope["q"].astype(np.float64) - rotated[:, :heads]).ravel(),
            np.abs(k_slots.astype(np.float64) - k_rot).ravel()]), np.concatenate([
                f32[:, :heads].ravel(), (U16 * np.abs(k_rot) + f32[:, heads:heads + kv_heads] + FP16_TINY).ravel()])))

    return checks


def _fused_qkv_check(weights: WeightSource, layer: int, written: dict, x, x_error, positions, linear,
                     rng: np.random.Generator) -> Check:
    """Decode: the QKV GEMV with the RoPE + KV-write epilogue (kernels/gemv_int4.py). Sampled pairs
    (d, d + head_dim/2) of q, k and v heads: W x + b in float64 for both rows, rotated at the
    position (q into q, k into its K slot), v into its V slot. Bound: the linear's bounds e1, e2
    carried through the rotation (|cos| e1 + |sin| e2 <= e1 + e2), the rotation's float32 rounding
    (oracles.rope_oracle: 16 u32 (|x1| + |x2|)), and for K/V the FP16 store (u16 |y| + FP16_TINY)."""
    cfg: ModelConfig = weights.config
    prefix = layer_prefix(layer)
    heads, kv_heads, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    half, position = hd // 2, int(positions[-1])
    errors, bounds = [], []
    for module, part_heads, count, rotate in (("q_proj", heads, SAMPLED_ROWS // 4, True),
                                              ("k_proj", kv_heads, SAMPLED_ROWS // 8, True),
                                              ("v_proj", kv_heads, SAMPLED_ROWS // 8, False)):
        # Random pairs, and dims (0, half) of a random head: the fastest-turning pair, where a wrong
        # angle shows for certain (the slowest turn by ~theta^-1 radians a position).
        pairs = np.union1d(_sample(rng, part_heads * half, count), [int(rng.integers(part_heads)) * half])
        count = len(pairs)
        head, d = pairs // half, pairs % half
        first = head * hd + d
        name = f"{prefix}self_attn.{module}"
        expected, bound = linear(weights, name + ".weight", np.concatenate([first, first + half]), x, x_error)
        expected = expected[-1] + np.asarray(weights.tensor(name + ".bias")[np.concatenate([first, first + half])],
                                             np.float64)
        bound = bound[-1] + U32 * np.abs(expected)
        x1, x2, e1, e2 = expected[:count], expected[count:], bound[:count], bound[count:]
        if rotate:
            angle = position * cfg.rope_theta ** (-2.0 * d / hd)
            y1, y2 = x1 * np.cos(angle) - x2 * np.sin(angle), x2 * np.cos(angle) + x1 * np.sin(angle)
            e1 = e2 = e1 + e2 + 16 * U32 * (np.abs(x1) + np.abs(x2))
        else:
            y1, y2 = x1, x2
        if module == "q_proj":
            got = written["q"][-1]
            errors += [np.abs(got[head, d] - y1), np.abs(got[head, d + half] - y2)]
            bounds += [e1, e2]
        else:
            slots = written["k" if module == "k_proj" else "v"][position].astype(np.float64)
            errors += [np.abs(slots[head, d] - y1), np.abs(slots[head, d + half] - y2)]
            bounds += [e1 + U16 * np.abs(y1) + FP16_TINY, e2 + U16 * np.abs(y2) + FP16_TINY]
    return bound_report("qkv", np.concatenate(errors), np.concatenate(bounds))


def _residual_check(name: str, weights: WeightSource, tensor: str, x16: np.ndarray, before: np.ndarray,
                    after: np.ndarray, linear, rng: np.random.Generator) -> Check:
    """Sampled features of after - before = W x16 (a linear adding into the float32 residual stream)."""
    features = _sample(rng, before.shape[-1])
    expected, bound = linear(weights, tensor, features, x16, None)
    expected = expected + before[:, features].astype(np.float64)
    return bound_report(name, np.abs(after[:, features].astype(np.float64) - expected), bound + U32 * np.abs(expected))


def _check_head(weights: WeightSource, stages: dict, h: np.ndarray, path: str, rng: np.random.Generator,
                position: int) -> list[Check]:
    """lm_head rows (the GPU's argmax among them) from the last hidden state h [hidden], and the
    sampler, which wrote the token after `position`."""
    cfg = weights.config
    logits = stages["lm_head"]["logits"]
    top = int(np.argmax(logits))
    rows = np.union1d(_sample(rng, cfg.vocab_size, LM_HEAD_ROWS), [top])
    x, x_error, checks = _normed_input(stages, "final_norm", h, weights.tensor("model.norm.weight"),
                                       cfg.rms_norm_eps)
    if weights.lm_head_int4:
        expected, bound = gemv_oracle(*_rows(weights, "lm_head.weight", rows), x, path, x_error)
    else:
        table = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        expected, bound = fp16_gemv_oracle(np.asarray(weights.tensor(table)[rows]), x, x_error)
    checks.append(bound_report("lm_head", np.abs(logits[rows].astype(np.float64) - expected), bound))
    sampled = int(stages["sampler"]["tokens"][position + 1])
    checks.append(passed("sampler", sampled == top, f"greedy token {sampled}, argmax of the logits {top}"))
    return checks

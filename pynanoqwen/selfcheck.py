"""The self-check `generate` runs on the GPU before it streams a token: one decode step of the
loaded model, kernel by kernel, against the numpy reference on the same weights.

Why: a model that loads and runs can still compute garbage (a kernel miscompiled for this GPU or
driver, weights damaged on their way to the device, a file whose tensors are not the model its
header says), and greedy decoding would print that garbage fluently. The check costs one decode
step and a slice of the weights on the host, so it runs every time (`--skip-selfcheck` turns it off).

How: the engine runs a random token at position 0 and a second one at position 1, eagerly, and
copies to the host what every kernel of the second step wrote (`CudaBackend.probed_step`).
Position 1, so that RoPE rotates by a non-zero angle and attention weighs two keys. Each kernel's
output is recomputed in float64 from the inputs the GPU gave that kernel (its predecessor's
captured output), so a failure names one kernel of one layer, and errors never compound:

    embedding        h is the token's embedding row, exactly
    rmsnorm          (engines without the fused norm) xn, all of it
    qkv              SAMPLED_ROWS rows of W RMSNorm(h) + b, from each of the q, k and v parts
    rope_kv_write    q, and the K and V cache slots of position 1, all of them
    attention        softmax over the two cached positions, all heads
    o_proj, down     SAMPLED_ROWS rows of the residual update
    gate_up          SAMPLED_ROWS rows of silu(Wg xn) * (Wu xn)
    lm_head          LM_HEAD_ROWS rows of the logits, the GPU's argmax row among them
    sampler          the sampled token is the argmax of the GPU's logits

Sampling rows keeps the host's share to a few rows of each matrix: for the 7B model 28 layers x
~60 rows, about 20 MB of weights read from the file's mmap instead of 3.6 GB. A wrong kernel is
wrong in most rows (a layout or fragment mistake), so a handful of random rows finds it; the
validate command's unit tier checks every row.

Bounds: an output passes when its error is within the bound of the kernel's arithmetic, the same
bounds as the validate unit tier (validate.gemv_oracle and the rope/attention checks), plus, for
the GEMVs that normalise their own input, the FP16 rounding of RMSNorm(h).
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from .config import ModelConfig
from .errors import NanoQwenError
from .fileformat import NanoQwenFile
from .reference import WeightSource, silu
from .tensors import QWEIGHT, SCALES, layer_prefix
from .validate import U16, U32, Check, bound_report, gemv_oracle, passed

SAMPLED_ROWS = 16  # rows of each linear checked per layer (qkv: 8 of q, 4 of k, 4 of v)
LM_HEAD_ROWS = 64
POSITION = 1  # the checked step's position: RoPE rotates, attention sees two keys
NORM_ROUNDING = U16 + 128 * U32  # FP16 rounding of an RMSNorm output plus its float32 arithmetic
ATTENTION_ABS, ATTENTION_REL = 2e-3, 2e-3  # exp2.approx weights and FP16 output (validate's check_attention)


@dataclasses.dataclass(frozen=True)
class SelfCheckResult:
    checks: list[Check]
    seconds: float

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status == "FAIL"]

    def summary(self) -> str:
        if self.failed:
            first = "; ".join(f"{c.name}: {c.detail}" for c in self.failed[:3])
            return f"self-check FAILED ({len(self.failed)} of {len(self.checks)} kernel checks): {first}"
        return (f"self-check passed: one decode step, {len(self.checks)} kernel outputs against the numpy "
                f"reference ({self.seconds:.2f} s)")


def run_self_check(backend, weights: WeightSource, rng: np.random.Generator | None = None) -> SelfCheckResult:
    """One probed decode step of `backend` (engine.CudaBackend) checked against `weights`, the
    weights it was loaded from."""
    start = time.perf_counter()
    rng = np.random.default_rng() if rng is None else rng
    first, token = (int(t) for t in rng.integers(0, weights.config.vocab_size, 2))
    captured = backend.probed_step(first, token)
    checks = check_probed_step(weights, captured, token, backend.gemv, rng)
    return SelfCheckResult(checks, time.perf_counter() - start)


def require_self_check(backend, model_path) -> str:
    """Self-check a backend loaded from the .nanoqwen file model_path: its summary line, or a
    NanoQwenError that says what failed and what to do."""
    with NanoQwenFile(model_path, verify_data=False) as weights:
        result = run_self_check(backend, weights)
    if result.failed:
        raise NanoQwenError(f"{result.summary()}. The GPU engine does not compute this model as the reference "
                            f"does; `python -m pynanoqwen validate --model {model_path}` gives the full report, "
                            "and --skip-selfcheck generates anyway")
    return result.summary()


def check_probed_step(weights: WeightSource, captured: dict, token: int, path: str,
                      rng: np.random.Generator) -> list[Check]:
    """Every check of the module docstring on what CudaBackend.probed_step captured."""
    cfg = weights.config
    checks = []
    h = captured[None, "embedding"]["h"]
    row = np.asarray(weights.tensor("model.embed_tokens.weight")[token]).astype(np.float32)
    checks.append(passed("embedding", np.array_equal(h, row),
                         f"token {token}: " + ("its row, exactly" if np.array_equal(h, row) else "not its row")))
    for layer in range(cfg.num_layers):
        prefix = layer_prefix(layer)
        stages = {stage: out for (index, stage), out in captured.items() if index == layer}
        layer_checks, h = _check_layer(weights, cfg, prefix, stages, h, path, rng)
        checks += [dataclasses.replace(c, name=f"layer {layer} {c.name}") for c in layer_checks]
    checks += _check_head(weights, cfg, captured, h, path, rng)
    return checks


def _rows(weights: WeightSource, name: str, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(qweight, scales) of some rows of an INT4 linear, read from the file's mmap."""
    return np.asarray(weights.tensor(name + QWEIGHT)[rows]), np.asarray(weights.tensor(name + SCALES)[rows])


def _sample(rng: np.random.Generator, n: int, count: int = SAMPLED_ROWS) -> np.ndarray:
    return np.sort(rng.choice(n, min(count, n), replace=False))


def _normed(h: np.ndarray, weight: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """(RMSNorm(h) * weight in float64, what the GPU's FP16 copy of it may be off by)."""
    h64 = h.astype(np.float64)
    xn = h64 / math.sqrt(np.mean(h64 * h64) + eps) * np.asarray(weight, np.float64)
    return xn, NORM_ROUNDING * np.abs(xn) + 2.0**-25


def _normed_input(stages: dict, stage: str, h: np.ndarray, weight: np.ndarray, eps: float) -> tuple:
    """The input of a GEMV that reads RMSNorm(h): (x, x_error, checks). With a separate rmsnorm
    kernel (captured as `stage`) x is its FP16 output, exact, and that output is checked here."""
    xn, error = _normed(h, weight, eps)
    if stage not in stages:
        return xn, error, []
    got = stages[stage]["xn"].astype(np.float64)
    return got, None, [bound_report(stage.replace("_", " "), np.abs(got - xn), error)]


def _check_layer(weights: WeightSource, cfg: ModelConfig, prefix: str, stages: dict, h: np.ndarray, path: str,
                 rng: np.random.Generator) -> tuple[list[Check], np.ndarray]:
    """The checks of one layer whose input was h (float32); returns them and the layer's output."""
    heads, kv_heads, hd, q_size, kv_size = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.q_size, cfg.kv_size
    eps = cfg.rms_norm_eps
    checks = []

    # QKV: sampled rows of each part, against the GPU's own output buffer.
    x, x_error, norm_checks = _normed_input(stages, "input_norm", h, weights.tensor(prefix + "input_layernorm.weight"),
                                            eps)
    checks += norm_checks
    qkv = stages["qkv"]["qkv"].astype(np.float64)
    errors, bounds = [], []
    for offset, module, n, count in ((0, "q_proj", q_size, SAMPLED_ROWS // 2),
                                     (q_size, "k_proj", kv_size, SAMPLED_ROWS // 4),
                                     (q_size + kv_size, "v_proj", kv_size, SAMPLED_ROWS // 4)):
        rows = _sample(rng, n, count)
        name = f"{prefix}self_attn.{module}"
        expected, bound = gemv_oracle(*_rows(weights, name + ".weight", rows), x, path, x_error)
        expected += np.asarray(weights.tensor(name + ".bias")[rows], np.float64)
        errors.append(np.abs(qkv[offset + rows] - expected))
        bounds.append(bound + U32 * np.abs(expected))
    checks.append(bound_report("qkv", np.concatenate(errors), np.concatenate(bounds)))

    # RoPE at POSITION on q and k, and the K/V slot it writes.
    angle = POSITION * cfg.rope_theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    parts = qkv.reshape(heads + 2 * kv_heads, hd)
    half = hd // 2
    x1, x2 = parts[:, :half], parts[:, half:]
    rotated = np.concatenate([x1 * np.cos(angle) - x2 * np.sin(angle), x2 * np.cos(angle) + x1 * np.sin(angle)], 1)
    f32 = 16 * U32 * np.tile(np.abs(x1) + np.abs(x2), 2) + 1e-30
    rope = stages["rope_kv_write"]
    k_page, v_page = rope["k_page"], rope["v_page"]  # [kv_heads, page size, hd] float16
    k_rot = rotated[heads:heads + kv_heads]
    if not np.array_equal(v_page[:, POSITION], parts[heads + kv_heads:].astype(np.float16)):
        checks.append(passed("rope_kv_write", False, "the V slot of the position is not float16(v)"))
    else:
        checks.append(bound_report("rope_kv_write", np.concatenate([
            np.abs(rope["q"].astype(np.float64) - rotated[:heads]).ravel(),
            np.abs(k_page[:, POSITION].astype(np.float64) - k_rot).ravel()]), np.concatenate([
                f32[:heads].ravel(), (U16 * np.abs(k_rot) + f32[heads:heads + kv_heads] + 2.0**-25).ravel()])))

    # Attention of the rotated q over the two cached positions (the GPU's cache, as the kernel read it).
    q = rope["q"].astype(np.float64).reshape(kv_heads, heads // kv_heads, hd)
    keys = k_page[:, :POSITION + 1].astype(np.float64)
    values = v_page[:, :POSITION + 1].astype(np.float64)
    scores = np.einsum("kgd,kcd->kgc", q, keys) / math.sqrt(hd)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    expected = np.einsum("kgc,kcd->kgd", probs, values).reshape(-1)
    attn = stages["attention"]["attn"]
    checks.append(bound_report("attention", np.abs(attn.astype(np.float64) - expected),
                               ATTENTION_ABS + ATTENTION_REL * np.abs(expected)))

    # o_proj: sampled rows of the residual update h_mid - h.
    h_mid = stages["o_proj"]["h"]
    checks.append(_residual_check("o_proj", weights, prefix + "self_attn.o_proj.weight", attn, h, h_mid, path, rng))

    # gate_up: sampled rows of silu(Wg xn) * (Wu xn).
    x, x_error, norm_checks = _normed_input(stages, "post_attention_norm", h_mid,
                                            weights.tensor(prefix + "post_attention_layernorm.weight"), eps)
    checks += norm_checks
    rows = _sample(rng, cfg.intermediate_size)
    g, g_bound = gemv_oracle(*_rows(weights, prefix + "mlp.gate_proj.weight", rows), x, path, x_error)
    u, u_bound = gemv_oracle(*_rows(weights, prefix + "mlp.up_proj.weight", rows), x, path, x_error)
    s = silu(g).astype(np.float64)
    expected = s * u
    # validate.check_linears' bound: FP16 store, float32 silu and product, g's and u's errors carried.
    bound = (U16 + 8 * U32) * np.abs(expected) + 2.0**-25 + 1.1 * np.abs(u) * g_bound \
        + (np.abs(s) + 1.1 * g_bound) * u_bound
    mlp = stages["gate_up"]["mlp"]
    checks.append(bound_report("gate_up", np.abs(mlp[rows].astype(np.float64) - expected), bound))

    h_out = stages["down"]["h"]
    checks.append(_residual_check("down", weights, prefix + "mlp.down_proj.weight", mlp, h_mid, h_out, path, rng))
    return checks, h_out


def _residual_check(name: str, weights: WeightSource, tensor: str, x16: np.ndarray, before: np.ndarray,
                    after: np.ndarray, path: str, rng: np.random.Generator) -> Check:
    """Sampled rows of after - before = W x16 (a GEMV adding into the float32 residual stream)."""
    rows = _sample(rng, len(before))
    expected, bound = gemv_oracle(*_rows(weights, tensor, rows), x16, path)
    expected += before[rows].astype(np.float64)
    return bound_report(name, np.abs(after[rows].astype(np.float64) - expected), bound + U32 * np.abs(expected))


def _check_head(weights: WeightSource, cfg: ModelConfig, captured: dict, h: np.ndarray, path: str,
                rng: np.random.Generator) -> list[Check]:
    """lm_head rows (the GPU's argmax among them) from the last layer's output, and the sampler."""
    stages = {stage: out for (index, stage), out in captured.items() if index is None}
    logits = stages["lm_head"]["logits"]
    top = int(np.argmax(logits))
    rows = np.union1d(_sample(rng, cfg.vocab_size, LM_HEAD_ROWS), [top])
    x, x_error, checks = _normed_input(stages, "final_norm", h, weights.tensor("model.norm.weight"),
                                       cfg.rms_norm_eps)
    if weights.lm_head_int4:
        expected, bound = gemv_oracle(*_rows(weights, "lm_head.weight", rows), x, path, x_error)
    else:
        table = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        w = np.asarray(weights.tensor(table)[rows], np.float64)
        expected = w @ x
        # FP16 x FP16 products are exact in float32; only the sums round (validate.check_linears).
        bound = (cfg.hidden_size // 32 + 8) * U32 * (np.abs(w) @ np.abs(x))
        if x_error is not None:
            bound = bound + np.abs(w) @ x_error
    checks.append(bound_report("lm_head", np.abs(logits[rows].astype(np.float64) - expected), bound))
    sampled = int(stages["sampler"]["tokens"][POSITION + 1])
    checks.append(passed("sampler", sampled == top, f"greedy token {sampled}, argmax of the logits {top}"))
    return checks

"""`python -m pynanoqwen validate`: the runtime's correctness ladder, run on the user's own machine.

Every check prints one line, `PASS|FAIL|SKIP  tier  check  detail`, as soon as it finishes; a
summary line follows, and the command exits 1 if any check failed. The tiers, cheapest first:

  format     the file opens with every checksum verified (fileformat.NanoQwenFile) and its
             tokenizer and chat template load.
  reference  (CPU; needs torch and transformers) the numpy reference model against transformers'
             Qwen2 in float64 on the same dequantized weights: one decoder layer on fresh random
             hidden states; the logits of a code prompt; and, on the embedded model, the greedy
             continuations of the prompts, which must be identical.
  unit       (GPU) each kernel of a decode step against numpy in float64, on fresh random
             activations at the model's shapes (its own weights for the linears), within error
             bounds derived from the kernel's arithmetic (the same bounds as tests/sim).
  layer      (GPU) decoder layer 0 of the engine against the reference, on fresh random hidden states;
             and the self-check generate runs (selfcheck.py: one decode step, kernel by kernel).
  graph      (GPU) greedy continuations of the prompts, per GEMV variant: CUDA graph replay against
             eager launches (identical tokens, bit-identical teacher-forced logits), and against the
             reference (identical tokens on the embedded model; on any model, the teacher-forced
             logit error and top-1 agreement).

The prompts are the starts of functions in held-out standard library files (pynanoqwen.data):
PROMPT_TOKENS tokens each, continued by NEW_TOKENS. Where a tier cannot run (no GPU, no
transformers, a file that failed the format checks) its checks are SKIP with the reason; --device
cuda on a machine without a GPU is a FAIL.

Tolerances of the GPU tiers against the reference, per GEMV path (GPU_LAYER_MAX_REL_ERROR; the
derivation is tests/test_engine_gpu.py's): prmt rounds activations to FP16 where the GEMVs read
them and stores K/V in FP16, eight roundings of 2^-11 a layer: 3.9e-3. dp4a also rounds each GEMV
input to INT8 per group of 128, four inputs in series with max/rms <= 8: 4 x 8/440 = 7.3e-2.
Teacher-forced logits may carry every layer's error: num_layers times the layer bound. A wrong
kernel gives errors of order 1. Top-1 agreement must be total on the rows whose reference winner
leads by more than twice the largest logit error (on random weights many rows are near-ties that
any rounding may flip; a wrong kernel flips clear rows too). Greedy tokens on the embedded model
must be identical on the prmt path; dp4a computes with INT8 activations, a different rounding of
the model, so a continuation may leave the reference's only where the reference's own top two
logits are within twice that largest error of each other (a near-tie), and nowhere else. Each line prints
the measured figure, so a user can compare it with docs and other machines.
"""

from __future__ import annotations

import dataclasses
import gc
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from .data import EMBEDDED_MODEL, held_out_prompts
from .errors import NanoQwenError
from .fileformat import NanoQwenFile
from .generate import GEMV_VARIANTS, CpuBackend, cuda_gpu_available, load_backend
from .quant import dequantize_int4
from .reference import ReferenceModel, decoder_layer, dequantized_nbytes, load_layer, rms_norm
from .sampling import SamplingParams
from .tensors import QWEIGHT, SCALES, hf_tensors, layer_prefix
from .tokenizer import Tokenizer

DEFAULT_PROMPTS = 100
PROMPT_TOKENS = 24
NEW_TOKENS = 16
TEACHER_FORCED_PROMPTS = 8     # prompts whose logits are compared (vocab floats per position)
LAYER_TOKENS = 32              # positions in the one-layer checks
REFERENCE_MAX_REL_ERROR = 1e-4  # reference vs transformers float64, as tests/test_reference.py
GPU_LAYER_MAX_REL_ERROR = {"prmt": 8 * 2.0**-11, "dp4a": 4 * 8 / 440}  # see the docstring
FLOAT64_MODEL_BYTES = 4 * 2**30  # largest float64 copy of the whole model built for transformers
GEMV_ROW_BLOCK = 4096           # lm_head rows dequantized at once for the float64 GEMV oracle
U16, U32 = 2.0**-11, 2.0**-24   # unit roundoffs of float16 and float32


@dataclasses.dataclass(frozen=True)
class Check:
    status: str  # "PASS", "FAIL" or "SKIP"
    tier: str
    name: str
    detail: str

    def line(self) -> str:
        return f"{self.status:<5} {self.tier:<9} {self.name:<34} {self.detail}"


def passed(name: str, ok: bool, detail: str) -> Check:
    """A check of the current tier (the runner fills in the tier)."""
    return Check("PASS" if ok else "FAIL", "", name, detail)


def skipped(name: str, reason: str) -> Check:
    return Check("SKIP", "", name, reason)


@dataclasses.dataclass
class Report:
    checks: list[Check]
    seed: int

    @property
    def failed(self) -> bool:
        return any(c.status == "FAIL" for c in self.checks)

    def summary(self) -> str:
        counts = {s: sum(c.status == s for c in self.checks) for s in ("PASS", "FAIL", "SKIP")}
        skipped_tiers = sorted({c.tier for c in self.checks if c.status == "SKIP"}
                               - {c.tier for c in self.checks if c.status != "SKIP"})
        verdict = "FAILED" if self.failed else "OK"
        return (f"validate {verdict}: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped"
                + (f" (tiers skipped: {', '.join(skipped_tiers)})" if skipped_tiers else "")
                + f"; random inputs from seed {self.seed}")


class Target:
    """The model under validation and what the tiers share: the open file, tokenizer, prompts, rng."""

    def __init__(self, path: Path, embedded: bool, prompts: int, seed: int):
        self.path, self.embedded, self.prompt_count = path, embedded, prompts
        self.rng = np.random.default_rng(seed)
        self.file: NanoQwenFile | None = None
        self.tokenizer: Tokenizer | None = None
        self._prompts: list[list[int]] | None = None
        self._reference_tokens: list[list[int]] | None = None
        self._teacher_forced: dict[tuple, np.ndarray] = {}

    @property
    def config(self):
        return self.file.config

    def prompts(self) -> list[list[int]]:
        if self._prompts is None:
            if self.config.max_position_embeddings <= PROMPT_TOKENS:
                raise NanoQwenError(f"the model's context ({self.config.max_position_embeddings} positions) has "
                                    f"no room to continue a {PROMPT_TOKENS}-token prompt")
            try:
                self._prompts = held_out_prompts(self.tokenizer.encode, self.prompt_count, PROMPT_TOKENS)
            except ValueError as err:
                raise NanoQwenError(str(err)) from None
        return self._prompts

    def max_context(self) -> int:
        return min(PROMPT_TOKENS + NEW_TOKENS, self.config.max_position_embeddings)

    def new_tokens(self) -> int:
        return self.max_context() - PROMPT_TOKENS

    def reference_tokens(self) -> list[list[int]]:
        """The reference model's greedy continuations of every prompt (computed once)."""
        if self._reference_tokens is None:
            self._reference_tokens = reference_greedy(self.file, self.prompts(), self.new_tokens())
        return self._reference_tokens

    def reference_teacher_forced(self, sequences: list[list[int]]) -> np.ndarray:
        """reference_teacher_forced for the rows that predict the generated tokens; computed once per
        set of sequences (both GEMV variants usually generate the same tokens)."""
        key = tuple(map(tuple, sequences))
        if key not in self._teacher_forced:
            self._teacher_forced[key] = reference_teacher_forced(self.file, sequences, PROMPT_TOKENS - 1)
        return self._teacher_forced[key]


# ----------------------------------------------------------------------------------------------
# The command

def validate(model: str | None, device: str = "auto", prompts: int = DEFAULT_PROMPTS, seed: int | None = None,
             on_line: Callable[[str], None] = print) -> Report:
    """Run every tier on `model` (None: the embedded tiny-coder); `device` is auto, cpu or cuda."""
    if device not in ("auto", "cpu", "cuda"):
        raise NanoQwenError(f"--device must be auto, cpu or cuda, got {device!r}")
    if prompts < 1:
        raise NanoQwenError(f"--prompts must be >= 1, got {prompts}")
    if seed is not None and seed < 0:
        raise NanoQwenError(f"--seed must be >= 0, got {seed}")
    path = Path(model) if model is not None else EMBEDDED_MODEL
    embedded = model is None or path.resolve() == EMBEDDED_MODEL.resolve()
    seed = int(np.random.SeedSequence().entropy % 2**32) if seed is None else seed
    target = Target(path, embedded, prompts, seed)
    on_line(f"validating {path}{' (the embedded tiny-coder)' if embedded else ''}, device {device}")
    report = Report([], seed)
    gpu_reason = _gpu_unavailable(device)
    try:
        for tier, run_tier, needs_gpu in TIERS:
            if tier != "format" and target.file is None:
                checks = iter([skipped("all", "the file did not pass the format checks")])
            elif needs_gpu and gpu_reason is not None:
                status = "FAIL" if device == "cuda" else "SKIP"
                checks = iter([Check(status, "", "all", gpu_reason)])
            else:
                checks = _guarded(run_tier(target))
            for check in checks:
                check = dataclasses.replace(check, tier=tier)
                report.checks.append(check)
                on_line(check.line())
    finally:
        if target.file is not None:
            target.file.close()
    on_line(report.summary())
    return report


def _gpu_unavailable(device: str) -> str | None:
    """Why the GPU tiers cannot run, or None when they can."""
    if device == "cpu":
        return "--device cpu"
    if not cuda_gpu_available():
        return "no CUDA GPU (compute capability 9.0+) found"
    return None


def _guarded(checks: Iterator[Check]) -> Iterator[Check]:
    """The tier's checks; an exception ends the tier with one FAIL line instead of a traceback.

    A NanoQwenError is a problem the user can act on (a bad file, a GPU without room); anything
    else escaping a check is a failure of the runtime itself (a kernel launch error, a bug), which
    is exactly what validate exists to report, so it is a FAIL too, named by its type.
    """
    try:
        yield from checks
    except NanoQwenError as err:
        yield Check("FAIL", "", "error", str(err))
    except Exception as err:  # noqa: BLE001 - reported, not swallowed: see the docstring
        first_line = str(err).splitlines()[0] if str(err) else ""
        yield Check("FAIL", "", "error", f"{type(err).__name__}: {first_line}")


# ----------------------------------------------------------------------------------------------
# Tier: format

def format_tier(t: Target) -> Iterator[Check]:
    try:
        t.file = NanoQwenFile(t.path, verify_data=True)
    except NanoQwenError as err:
        yield passed("open and checksums", False, str(err))
        return
    cfg = t.config
    yield passed("open and checksums", True,
                 f"{len(t.file.names)} tensors, CRC-32 verified; {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
                 f"vocab {cfg.vocab_size}, lm_head {'INT4' if t.file.lm_head_int4 else 'FP16'}")
    try:
        t.tokenizer = Tokenizer.from_json_bytes(t.file.tokenizer_json, t.file.chat_template,
                                                bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id)
    except NanoQwenError as err:
        t.file.close()
        t.file = None
        yield passed("tokenizer", False, str(err))
        return
    prompt = t.tokenizer.apply_chat_template([{"role": "user", "content": "def f():"}])
    yield passed("tokenizer", True, f"tokenizer.json loads; chat template "
                                    f"{'embedded' if t.tokenizer.has_chat_template else 'absent (ChatML used)'} "
                                    f"renders ({len(t.tokenizer.encode(prompt))} tokens for a one-line chat)")


# ----------------------------------------------------------------------------------------------
# Tier: reference (CPU), and the float64 transformers oracle it uses

def dequantized_hf_weights(weights) -> tuple:
    """(config transformers should use, {HF name: float64 array}) of a .nanoqwen file's weights.

    A tied model with an INT4 lm_head computes with dequantize(quantize(embed)), not embed, so
    transformers must hold it as an untied model.
    """
    cfg = weights.config
    hf_cfg = dataclasses.replace(cfg, tie_word_embeddings=cfg.tie_word_embeddings and not weights.lm_head_int4)
    out = {}
    for name in hf_tensors(hf_cfg):
        if name.endswith("_proj.weight") or (name == "lm_head.weight" and weights.lm_head_int4):
            out[name] = dequantize_int4(weights.tensor(name + QWEIGHT), weights.tensor(name + SCALES), np.float64)
        else:
            out[name] = np.asarray(weights.tensor(name), dtype=np.float64)
    return hf_cfg, out


def transformers_model(weights):
    """transformers' Qwen2ForCausalLM in float64, eager attention, holding the file's dequantized weights."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hf_cfg, tensors = dequantized_hf_weights(weights)
    model = Qwen2ForCausalLM._from_config(Qwen2Config(**hf_cfg.to_hf_dict()), attn_implementation="eager",
                                          dtype=torch.float64)
    state = {name: torch.from_numpy(w) for name, w in tensors.items()}
    if hf_cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    return model.eval()


def transformers_layer_outputs(weights, layer: int, x: np.ndarray) -> np.ndarray:
    """transformers' Qwen2DecoderLayer (float64, eager) on hidden states x [seq, hidden] at positions 0.."""
    import torch
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

    cfg = weights.config
    config = Qwen2Config(**cfg.to_hf_dict())
    config._attn_implementation = "eager"
    module = Qwen2DecoderLayer(config, layer_idx=layer).to(torch.float64).eval()
    prefix = layer_prefix(layer)
    state = {}
    for name in module.state_dict():
        full = prefix + name
        if full.endswith("_proj.weight"):
            state[name] = dequantize_int4(weights.tensor(full + QWEIGHT), weights.tensor(full + SCALES), np.float64)
        else:
            state[name] = np.asarray(weights.tensor(full), dtype=np.float64)
    module.load_state_dict({name: torch.from_numpy(w) for name, w in state.items()}, strict=True)
    seq = len(x)
    hidden = torch.from_numpy(np.asarray(x, dtype=np.float64))[None]
    positions = torch.arange(seq)[None]
    cos_sin = Qwen2RotaryEmbedding(config)(hidden, positions)
    causal = torch.full((seq, seq), -math.inf, dtype=torch.float64).triu(1)[None, None]
    with torch.no_grad():
        out = module(hidden, attention_mask=causal, position_ids=positions, position_embeddings=cos_sin)
    return out[0].numpy()


def transformers_greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy continuations of equal-length prompts, all in one batch, with transformers' KV cache."""
    import torch

    ids = torch.tensor(prompts)
    out_tokens = []
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        for step in range(new_tokens):
            ids = out.logits[:, -1].argmax(dim=-1, keepdim=True)
            out_tokens.append(ids[:, 0])
            if step + 1 < new_tokens:
                out = model(input_ids=ids, use_cache=True, **_cache_argument(out))
    return torch.stack(out_tokens, dim=1).tolist()


def _cache_argument(out) -> dict:
    """The KV cache a model output hands to the next call: transformers 5.2x calls it `cache`,
    earlier versions (5.17 on the GPU machine) `past_key_values`."""
    return {"cache": out.cache} if hasattr(out, "cache") else {"past_key_values": out.past_key_values}


def reference_greedy(weights, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """The numpy reference model's greedy continuations (generate --device cpu), no stop tokens."""
    backend = CpuBackend(ReferenceModel(weights, max_context=len(prompts[0]) + new_tokens))
    return [list(backend.generate(p, SamplingParams(), new_tokens, frozenset())) for p in prompts]


def relative_error(ours: np.ndarray, theirs: np.ndarray) -> float:
    """Worst row of ||ours - theirs|| / ||theirs|| (rows: last axis)."""
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    return float(np.max(np.linalg.norm(ours - theirs, axis=-1) / np.linalg.norm(theirs, axis=-1)))


def random_hidden_states(t: Target) -> np.ndarray:
    """Fresh hidden states [LAYER_TOKENS, hidden] with the RMS of the model's embedding rows."""
    table = t.file.tensor("model.embed_tokens.weight")
    rows = np.asarray(table[t.rng.integers(0, t.config.vocab_size, 64)], dtype=np.float64)
    rms = float(np.sqrt(np.mean(rows * rows))) or 1.0
    return (rms * t.rng.standard_normal((LAYER_TOKENS, t.config.hidden_size))).astype(np.float32)


def reference_layer_outputs(t: Target, layer: int, x: np.ndarray) -> np.ndarray:
    cfg = t.config
    cache = np.zeros((2, len(x), cfg.num_kv_heads, cfg.head_dim), dtype=np.float32)
    return decoder_layer(x, load_layer(t.file, layer), cfg, cache[0], cache[1], 0)


def reference_tier(t: Target) -> Iterator[Check]:
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as err:
        yield skipped("all", f"needs torch and transformers ({err.name} is not installed)")
        return
    x = random_hidden_states(t)
    delta_ours = reference_layer_outputs(t, 0, x) - x
    delta_theirs = transformers_layer_outputs(t.file, 0, x) - x
    error = relative_error(delta_ours, delta_theirs)
    yield passed("layer 0 vs transformers", error < REFERENCE_MAX_REL_ERROR,
                 f"{LAYER_TOKENS} random positions: layer output - input, worst row relative error "
                 f"{error:.2e} (limit {REFERENCE_MAX_REL_ERROR:.0e})")

    float64_bytes = 2 * dequantized_nbytes(t.config)
    if float64_bytes > FLOAT64_MODEL_BYTES:
        why = (f"the float64 transformers model would take {float64_bytes / 2**30:.1f} GiB "
               f"(limit {FLOAT64_MODEL_BYTES / 2**30:.0f})")
        yield skipped("logits vs transformers", why)
        yield skipped("greedy tokens vs transformers", why)
        return
    model = transformers_model(t.file)
    prompt = t.prompts()[0]
    ours = ReferenceModel(t.file, max_context=len(prompt)).forward(prompt)
    with torch.no_grad():
        theirs = model(torch.tensor([prompt]), use_cache=False).logits[0].numpy()
    error = relative_error(ours, theirs)
    top1 = float(np.mean(ours.argmax(axis=1) == theirs.argmax(axis=1)))
    yield passed("logits vs transformers", error < REFERENCE_MAX_REL_ERROR,
                 f"code prompt of {len(prompt)} tokens: worst row relative error {error:.2e} "
                 f"(limit {REFERENCE_MAX_REL_ERROR:.0e}), top-1 agreement {top1:.0%}")
    if not t.embedded:
        yield skipped("greedy tokens vs transformers", "asserted on the embedded model only, whose peaked "
                                                        "predictions leave no near-ties; see the logits check")
        return
    ours = t.reference_tokens()
    theirs = transformers_greedy(model, t.prompts(), t.new_tokens())
    yield _compare_tokens("greedy tokens vs transformers", ours, theirs)


def _compare_tokens(name: str, ours: list[list[int]], theirs: list[list[int]]) -> Check:
    """PASS when every continuation is identical; otherwise where the first difference is."""
    total = sum(len(seq) for seq in ours)
    differing = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    if not differing:
        return passed(name, True, f"{len(ours)} prompts x {len(ours[0])} tokens: all {total} identical")
    i = differing[0]
    position = next((j for j, (a, b) in enumerate(zip(ours[i], theirs[i])) if a != b),
                    min(len(ours[i]), len(theirs[i])))
    return passed(name, False, f"{len(differing)} of {len(ours)} continuations differ; first: prompt {i}, "
                               f"token {position}")


# ----------------------------------------------------------------------------------------------
# Tier: unit (GPU), each kernel at the model's shapes

def unit_tier(t: Target) -> Iterator[Check]:
    return run_unit_checks(t.file, t.rng)


def _stream_run(launch) -> None:
    from numba import cuda

    stream = cuda.stream()
    launch(stream)
    stream.synchronize()


def bound_report(name: str, error: np.ndarray, bound: np.ndarray) -> Check:
    """PASS when every |error| is within its bound; the detail gives the worst error/bound ratio."""
    ratio = np.asarray(error, np.float64) / np.maximum(np.asarray(bound, np.float64), np.finfo(np.float64).tiny)
    worst = int(np.argmax(ratio))
    ok = bool(np.all(np.asarray(error) <= np.asarray(bound)))
    return passed(name, ok, f"{ratio.size} outputs, worst error {ratio.flat[worst]:.2f} of its bound"
                            + ("" if ok else f" at output {worst}"))


def check_embedding(weights, rng) -> Iterator[Check]:
    from numba import cuda

    from .kernels.embedding import make_embedding

    cfg = weights.config
    table = np.asarray(weights.tensor("model.embed_tokens.weight"))
    tokens = rng.integers(0, cfg.vocab_size, 8).astype(np.int32)
    position = int(rng.integers(0, 8))
    h = cuda.to_device(np.full(cfg.hidden_size, np.nan, np.float32))
    _stream_run(lambda s: make_embedding(cfg.hidden_size).launch(
        s, cuda.to_device(table), cuda.to_device(tokens), cuda.to_device(np.array([position], np.int32)), h))
    ok = np.array_equal(h.copy_to_host(), table[tokens[position]].astype(np.float32))
    yield passed("embedding", ok, f"row of token {tokens[position]} " + ("copied exactly" if ok else "differs"))


def check_rmsnorm(weights, rng) -> Iterator[Check]:
    from numba import cuda

    from .kernels.rmsnorm import make_rmsnorm

    cfg = weights.config
    h = (rng.standard_normal(cfg.hidden_size) * rng.uniform(0.1, 10)).astype(np.float32)
    weight = np.asarray(weights.tensor(layer_prefix(0) + "input_layernorm.weight"))
    xn = cuda.to_device(np.zeros(cfg.hidden_size, np.float16))
    _stream_run(lambda s: make_rmsnorm(cfg.hidden_size, cfg.rms_norm_eps).launch(
        s, cuda.to_device(h), cuda.to_device(weight), xn))
    h64 = h.astype(np.float64)
    expected = h64 / np.sqrt(np.mean(h64 * h64) + cfg.rms_norm_eps) * weight.astype(np.float64)
    # One FP16 rounding of the output, plus float32 arithmetic (sum of squares, rsqrt, products).
    bound = (U16 + 128 * U32) * np.abs(expected) + 2.0**-25
    yield bound_report("rmsnorm", np.abs(xn.copy_to_host().astype(np.float64) - expected), bound)


def check_rope_kv_write(weights, rng) -> Iterator[Check]:
    from numba import cuda

    from .kernels.page_alloc import PAGE_SIZE
    from .kernels.rope_kv_write import make_rope_kv_write, rope_cos_sin

    cfg = weights.config
    heads, kv_heads, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    half = hd // 2
    max_context = min(cfg.max_position_embeddings, 4096)
    pages = -(-max_context // PAGE_SIZE)
    position = int(rng.integers(0, max_context))
    qkv = rng.standard_normal((heads + 2 * kv_heads) * hd).astype(np.float32)
    page_table = rng.permutation(pages).astype(np.int32)
    cos, sin = rope_cos_sin(hd, cfg.rope_theta, max_context)
    k_init = rng.standard_normal((pages, kv_heads, PAGE_SIZE, hd)).astype(np.float16)
    v_init = rng.standard_normal((pages, kv_heads, PAGE_SIZE, hd)).astype(np.float16)
    q, k_pages, v_pages = (cuda.to_device(a) for a in (np.zeros((heads, hd), np.float32), k_init, v_init))
    _stream_run(lambda s: make_rope_kv_write(heads, kv_heads, hd).launch(
        s, cuda.to_device(qkv), cuda.to_device(cos), cuda.to_device(sin),
        cuda.to_device(np.array([position], np.int32)), cuda.to_device(page_table), q, k_pages, v_pages))

    parts = qkv.astype(np.float64).reshape(heads + 2 * kv_heads, hd)
    angle = position * cfg.rope_theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    x1, x2 = parts[:, :half], parts[:, half:]
    rotated = np.concatenate([x1 * np.cos(angle) - x2 * np.sin(angle), x2 * np.cos(angle) + x1 * np.sin(angle)], 1)
    # float32 cos/sin (one rounding each), two products and a sum in float32: |x1| + |x2| bounds each output.
    f32 = 16 * U32 * np.tile(np.abs(x1) + np.abs(x2), 2)
    page, slot = page_table[position // PAGE_SIZE], position % PAGE_SIZE
    k_got, v_got = k_pages.copy_to_host(), v_pages.copy_to_host()
    q_error = np.abs(q.copy_to_host() - rotated[:heads])
    k_rot = rotated[heads:heads + kv_heads]
    k_error = np.abs(k_got[page, :, slot].astype(np.float64) - k_rot)
    k_bound = U16 * np.abs(k_rot) + f32[heads:heads + kv_heads] + 2.0**-25
    untouched = np.ones(k_init.shape[:3], bool)
    untouched[page, :, slot] = False
    writes_ok = (np.array_equal(v_got[page, :, slot], parts[heads + kv_heads:].astype(np.float16))
                 and np.array_equal(k_got[untouched], k_init[untouched])
                 and np.array_equal(v_got[untouched], v_init[untouched]))
    if not writes_ok:
        yield passed("rope_kv_write", False, f"position {position}: v slot wrong or another KV slot was written")
        return
    check = bound_report("rope_kv_write", np.concatenate([q_error.ravel(), k_error.ravel()]),
                          np.concatenate([f32[:heads].ravel() + 1e-30, k_bound.ravel()]))
    yield dataclasses.replace(check, detail=f"position {position}: " + check.detail)


def check_attention(weights, rng) -> Iterator[Check]:
    from numba import cuda

    from .kernels.attention_decode import PAGE_SIZE, make_decode_attention

    cfg = weights.config
    heads, kv_heads, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    max_context = min(cfg.max_position_embeddings, 4096)
    max_pages = -(-max_context // PAGE_SIZE)
    context = int(rng.integers(1, max_context + 1))
    shape = (max_pages, kv_heads, PAGE_SIZE, hd)
    page_table = rng.permutation(max_pages).astype(np.int32)
    # Slots outside the context hold NaN: reading one would poison the output.
    k_pages, v_pages = np.full(shape, np.nan, np.float16), np.full(shape, np.nan, np.float16)
    positions = np.arange(context)
    pages, slots = page_table[positions // PAGE_SIZE], positions % PAGE_SIZE
    k_pages[pages, :, slots] = rng.standard_normal((context, kv_heads, hd))
    v_pages[pages, :, slots] = rng.standard_normal((context, kv_heads, hd))
    q = (3.0 * rng.standard_normal((heads, hd))).astype(np.float32)
    out = cuda.to_device(np.full(heads * hd, np.nan, np.float16))
    attention = make_decode_attention(heads, kv_heads, hd, max_pages)
    _stream_run(lambda s: attention.launch(s, *(cuda.to_device(a) for a in (
        q, k_pages, v_pages, page_table, np.array([context - 1], np.int32))), out))

    keys = k_pages[pages, :, slots].astype(np.float64)
    values = v_pages[pages, :, slots].astype(np.float64)
    group = heads // kv_heads
    scores = np.einsum("kgd,ckd->kgc", q.astype(np.float64).reshape(kv_heads, group, hd), keys) / math.sqrt(hd)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    expected = (np.einsum("kgc,ckd->kgd", probs, values) / probs.sum(axis=-1)[..., None]).reshape(-1)
    # FP16 output and exp2.approx weights: the tolerance of tests/test_attention_gpu.py.
    error = np.abs(out.copy_to_host().astype(np.float64) - expected)
    error[np.isnan(error)] = np.inf
    check = bound_report("decode attention", error, 2e-3 + 2e-3 * np.abs(expected))
    yield dataclasses.replace(check, detail=f"context {context}: " + check.detail)


def _linear(weights, name: str) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(weights.tensor(name + QWEIGHT)), np.asarray(weights.tensor(name + SCALES))


def gemv_oracle(qweight, scales, x: np.ndarray, path: str,
                input_error: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(W x in float64, the bound on |GEMV(x) - W x| for `path`), for W the dequantized INT4 weight.

    input_error: x is the exact input, and the GEMV reads a copy of it that may be off by up to
    input_error elementwise (a fused RMSNorm's FP16 output); the bound grows by |W| input_error.

    float32: each lane sums K/32/32 chunk results, then 5 warp_sum steps, then the epilogue: at
    most K/32 + 8 roundings of u32 times sum |w x|. prmt: each FP16 half-accumulator rounds 16
    times by at most u16 of the partial sum. dp4a: the integer dot is exact; x is rounded to INT8
    per 128-input group (|error| <= scale/2 + 2^-22 |x|, scale = max |x| / 127 over the group).
    """
    k = x.shape[0]
    x64 = x.astype(np.float64)
    if path == "dp4a":
        scale = np.abs(x64.reshape(-1, 128)).max(axis=1).astype(np.float32) / np.float32(127)
        rounding = np.repeat(scale.astype(np.float64), 128) / 2 + 2.0**-22 * np.abs(x64)
    else:
        rounding = np.zeros(k)
    expected, bound = np.empty(len(qweight)), np.empty(len(qweight))
    for first in range(0, len(qweight), GEMV_ROW_BLOCK):
        rows = slice(first, first + GEMV_ROW_BLOCK)
        w = dequantize_int4(qweight[rows], scales[rows], np.float64)
        magnitude = np.abs(w) @ (np.abs(x64) + rounding)
        expected[rows] = w @ x64
        bound[rows] = (k // 32 + 8) * U32 * magnitude + np.abs(w) @ (
            rounding if input_error is None else rounding + input_error)
        if path == "prmt":
            bound[rows] += 16 * U16 * magnitude
    return expected, bound


def _run_gemv(gemv, x: np.ndarray, out: np.ndarray, **epilogue) -> np.ndarray:
    from numba import cuda

    out_device = cuda.to_device(out)
    _stream_run(lambda s: gemv.launch(s, cuda.to_device(x), out_device, **epilogue))
    return out_device.copy_to_host().astype(np.float64)


def check_linears(weights, rng) -> Iterator[Check]:
    """Every INT4 GEMV of layer 0 as the engine builds it (fused QKV with bias, o_proj and down
    accumulating into the residual, gate/up with SiLU) and the lm_head, on both GEMV paths."""
    from .kernels.gemv_fp16 import make_gemv_fp16
    from .kernels.gemv_int4 import make_gate_up_silu, make_gemv_int4

    cfg = weights.config
    p = layer_prefix(0)
    h, i, q_size = cfg.hidden_size, cfg.intermediate_size, cfg.q_size
    parts = [_linear(weights, f"{p}self_attn.{m}_proj.weight") for m in "qkv"]
    qkv_q, qkv_s = np.concatenate([a for a, _ in parts]), np.concatenate([b for _, b in parts])
    qkv_bias = np.concatenate([np.asarray(weights.tensor(f"{p}self_attn.{m}_proj.bias")) for m in "qkv"])

    def fp16(n: int) -> np.ndarray:  # fresh FP16 activations
        return rng.standard_normal(n).astype(np.float16)

    for path in GEMV_VARIANTS:
        x = fp16(h)
        expected, bound = gemv_oracle(qkv_q, qkv_s, x, path)
        expected += qkv_bias
        y = _run_gemv(make_gemv_int4(len(qkv_q), h, qkv_q, qkv_s, path=path, bias=qkv_bias), x,
                      np.zeros(len(qkv_q), np.float32))
        yield bound_report(f"gemv {path} qkv+bias", np.abs(y - expected), bound + U32 * np.abs(expected))

        for module, k in (("self_attn.o_proj", q_size), ("mlp.down_proj", i)):
            qw, sc = _linear(weights, f"{p}{module}.weight")
            x, residual = fp16(k), rng.standard_normal(h).astype(np.float32)
            expected, bound = gemv_oracle(qw, sc, x, path)
            expected += residual
            y = _run_gemv(make_gemv_int4(h, k, qw, sc, path=path), x, residual, residual=True)
            yield bound_report(f"gemv {path} {module.split('.')[1]}+residual", np.abs(y - expected),
                                bound + U32 * np.abs(expected))

        gate, up = _linear(weights, f"{p}mlp.gate_proj.weight"), _linear(weights, f"{p}mlp.up_proj.weight")
        x = fp16(h)
        g, g_bound = gemv_oracle(*gate, x, path)
        u, u_bound = gemv_oracle(*up, x, path)
        silu = g / (1 + np.exp(-g))
        expected = silu * u
        y = _run_gemv(make_gate_up_silu(i, h, *gate, *up, path=path), x, np.zeros(i, np.float16))
        # FP16 output rounding; the errors of g and u carried through silu (slope <= 1.1) and the
        # product; float32 exp, divide and multiply (a few u32 of the result).
        bound = ((U16 + 8 * U32) * np.abs(expected) + 1.1 * np.abs(u) * g_bound
                 + (np.abs(silu) + 1.1 * g_bound) * u_bound)
        yield bound_report(f"gemv {path} gate_up_silu", np.abs(y - expected), bound)

        if weights.lm_head_int4:
            qw, sc = _linear(weights, "lm_head.weight")
            x = fp16(h)
            expected, bound = gemv_oracle(qw, sc, x, path)
            y = _run_gemv(make_gemv_int4(cfg.vocab_size, h, qw, sc, path=path), x,
                          np.zeros(cfg.vocab_size, np.float32))
            yield bound_report(f"gemv {path} lm_head", np.abs(y - expected), bound)

    if not weights.lm_head_int4:
        name = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        table = np.asarray(weights.tensor(name))
        x = fp16(h)
        x64 = x.astype(np.float64)
        expected, bound = np.empty(cfg.vocab_size), np.empty(cfg.vocab_size)
        for first in range(0, cfg.vocab_size, GEMV_ROW_BLOCK):
            w = table[first:first + GEMV_ROW_BLOCK].astype(np.float64)
            expected[first:first + len(w)] = w @ x64
            # FP16 x FP16 products are exact in float32; only the sums round (as in gemv_oracle).
            bound[first:first + len(w)] = (h // 32 + 8) * U32 * (np.abs(w) @ np.abs(x64))
        y = _run_gemv(make_gemv_fp16(cfg.vocab_size, h, table), x, np.zeros(cfg.vocab_size, np.float32))
        yield bound_report("gemv fp16 lm_head", np.abs(y - expected), bound)


def check_argmax(weights, rng) -> Iterator[Check]:
    from numba import cuda

    from .kernels.sampling import Sampler, device_params

    vocab = weights.config.vocab_size
    logits = (rng.standard_normal(vocab) * rng.uniform(1, 4)).astype(np.float32)
    ties = rng.choice(vocab, 3, replace=False)
    logits[ties] = logits.max() + 1  # greedy must take the lowest id among equal maxima, as numpy does
    position = int(rng.integers(0, 100))
    tokens = cuda.to_device(np.full(position + 2, -1, np.int32))
    pos = cuda.to_device(np.array([position], np.int32))
    sampling, top_k, seed = (cuda.to_device(a) for a in device_params(SamplingParams()))
    sampler = Sampler(vocab)
    _stream_run(lambda s: sampler.launch(s, "argmax", cuda.to_device(logits), sampling, top_k, seed, tokens, pos))
    got = int(tokens.copy_to_host()[position + 1])
    ok = got == int(np.argmax(logits)) and int(pos.copy_to_host()[0]) == position + 1
    yield passed("argmax sampler", ok, f"vocab {vocab}, 3-way tie at the max: chose {got}, "
                                        f"expected {int(np.argmax(logits))}")


UNIT_CHECKS = (check_embedding, check_rmsnorm, check_linears, check_rope_kv_write, check_attention, check_argmax)


def run_unit_checks(weights, rng) -> Iterator[Check]:
    """Every unit check on `weights` (a NanoQwenFile or reference.InMemoryWeights)."""
    for check in UNIT_CHECKS:
        yield from check(weights, rng)


# ----------------------------------------------------------------------------------------------
# Tiers: layer and graph (GPU), through the engine's backend

def _load_engine(t: Target, gemv: str, eager: bool):
    return load_backend(t.path, "cuda", t.max_context(), gemv, eager)


def _release(backend) -> None:
    """Free a backend's graphs and device memory before the next one is loaded."""
    close = getattr(backend, "close", None)
    if close is not None:
        close()
    gc.collect()


def layer_tier(t: Target) -> Iterator[Check]:
    from .selfcheck import run_self_check

    x = random_hidden_states(t)
    ours_delta = reference_layer_outputs(t, 0, x) - x
    for gemv in GEMV_VARIANTS:
        backend = _load_engine(t, gemv, eager=True)
        try:
            layer_outputs = getattr(backend, "layer_outputs", None)
            if layer_outputs is None:
                yield skipped(f"{gemv} layer 0 vs reference", "this engine has no layer_outputs()")
                continue
            error = relative_error(layer_outputs(0, x) - x, ours_delta)
            self_check = run_self_check(backend, t.file, t.rng) if hasattr(backend, "probed_step") else None
        finally:
            _release(backend)
        yield passed(f"{gemv} layer 0 vs reference", error < GPU_LAYER_MAX_REL_ERROR[gemv],
                     f"{LAYER_TOKENS} random positions: layer output - input, worst row relative error "
                     f"{error:.2e} (limit {GPU_LAYER_MAX_REL_ERROR[gemv]:.1e})")
        if self_check is not None:  # what generate runs before it streams (selfcheck.py)
            yield passed(f"{gemv} generate's self-check", not self_check.failed, self_check.summary())


def reference_teacher_forced(weights, sequences: list[list[int]], first_row: int) -> np.ndarray:
    """The reference's logits [len(sequences), len - first_row, vocab] for rows first_row.. of each
    sequence (one prefill each). Each layer is dequantized once for all sequences, so a model too
    large to keep dequantized costs one pass over its weights, not one per sequence."""
    cfg = weights.config
    model = ReferenceModel(weights, max_context=max(map(len, sequences)), cache_layers=False)
    table = weights.tensor("model.embed_tokens.weight")
    xs = [np.asarray(table[np.asarray(s)], dtype=np.float32) for s in sequences]
    for layer in range(cfg.num_layers):
        w = load_layer(weights, layer)
        for index, x in enumerate(xs):
            cache = np.zeros((2, len(x), cfg.num_kv_heads, cfg.head_dim), dtype=np.float32)
            xs[index] = decoder_layer(x, w, cfg, cache[0], cache[1], 0)
    hidden = np.stack([rms_norm(x[first_row:], weights.tensor("model.norm.weight"), cfg.rms_norm_eps) for x in xs])
    return model.logits(hidden.reshape(-1, cfg.hidden_size)).reshape(len(xs), -1, cfg.vocab_size)


def graph_tier(t: Target) -> Iterator[Check]:
    prompts = t.prompts()
    new = t.new_tokens()
    forced = prompts[:TEACHER_FORCED_PROMPTS]
    for gemv in GEMV_VARIANTS:
        tokens, logits = {}, {}
        for eager in (True, False):
            backend = _load_engine(t, gemv, eager)
            try:
                tokens[eager] = [list(backend.generate(p, SamplingParams(), new, frozenset())) for p in prompts]
                teacher_forced_logits = getattr(backend, "teacher_forced_logits", None)
                if teacher_forced_logits is not None:
                    logits[eager] = np.stack([teacher_forced_logits(p + seq[:-1])[len(p) - 1:]
                                              for p, seq in zip(forced, tokens[eager])])
            finally:
                _release(backend)
        yield _compare_tokens(f"{gemv} graph vs eager tokens", tokens[False], tokens[True])
        if len(logits) == 2:
            same = np.array_equal(logits[False].view(np.uint32), logits[True].view(np.uint32))
            yield passed(f"{gemv} graph vs eager logits", same,
                         f"{len(forced)} prompts x {new} positions teacher-forced: "
                         + ("bit-identical" if same else "differ (graph replay must launch the same kernels)"))
        if not logits:
            yield skipped(f"{gemv} logits vs reference", "this engine has no teacher_forced_logits()")
            largest_error = None
        else:
            sequences = [p + seq[:-1] for p, seq in zip(forced, tokens[False])]
            ours = t.reference_teacher_forced(sequences)
            error = relative_error(logits[False], ours)
            largest_error = float(np.abs(logits[False] - ours).max())
            agree = logits[False].argmax(axis=-1) == ours.argmax(axis=-1)
            clear = np.diff(np.sort(ours, axis=-1)[..., -2:], axis=-1)[..., 0] > 2 * largest_error
            limit = t.config.num_layers * GPU_LAYER_MAX_REL_ERROR[gemv]
            yield passed(f"{gemv} logits vs reference", error < limit and bool(agree[clear].all()),
                         f"{len(forced)} prompts x {new} teacher-forced positions: worst row relative error "
                         f"{error:.2e} (limit {limit:.1e}); top-1 agreement {agree.mean():.1%}, "
                         f"{agree[clear].mean() if clear.any() else 1:.0%} on the {int(clear.sum())} rows with a "
                         "clear winner (must be 100%)")
        name = f"{gemv} graph vs reference tokens"
        if not t.embedded:
            yield skipped(name, "asserted on the embedded model only, whose peaked predictions leave few near-ties")
        elif gemv == "prmt" or largest_error is None:
            yield _compare_tokens(name, tokens[False], t.reference_tokens())
        else:
            yield _divergences_at_near_ties(name, t, tokens[False], largest_error)


def _divergences_at_near_ties(name: str, t: Target, ours: list[list[int]], largest_error: float) -> Check:
    """PASS when every continuation either equals the reference's or leaves it at a position where
    the reference's top two logits are within 2 x largest_error (the docstring's near-tie)."""
    theirs = t.reference_tokens()
    prompts = t.prompts()
    model = ReferenceModel(t.file, max_context=t.max_context())
    differing, margins = 0, []
    for prompt, a, b in zip(prompts, ours, theirs):
        if a == b:
            continue
        differing += 1
        at = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
        model.reset()
        logits = model.forward(prompt + a[:at], last_only=True)[0].astype(np.float64)
        margins.append(float(logits[b[at]] - logits[a[at]]))  # how far the GPU's token trailed the reference's
    worst = max(margins, default=0.0)
    ok = worst <= 2 * largest_error
    total = sum(len(seq) for seq in ours)
    return passed(name, ok, f"{len(ours)} prompts x {len(ours[0])} tokens: {len(ours) - differing} continuations "
                            f"identical; {differing} leave the reference, where its top logit led the GPU's choice by "
                            f"at most {worst:.3f} (near-tie limit 2 x {largest_error:.3f}); {total} tokens in all")


TIERS = (("format", format_tier, False), ("reference", reference_tier, False), ("unit", unit_tier, True),
         ("layer", layer_tier, True), ("graph", graph_tier, True))

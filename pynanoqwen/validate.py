"""`python -m pynanoqwen validate`: the runtime's correctness ladder, run on the user's own machine.

Every check prints one line, `PASS|FAIL|SKIP  tier  check  detail`, as soon as it finishes; a
summary line follows, and the command exits 1 if any check failed. The tiers, cheapest first:

  format     the file opens with every checksum verified (fileformat.NanoQwenFile) and its
             tokenizer and chat template load.
  reference  (CPU; needs torch and transformers: pip install pynanoqwen[validate]) the numpy
             reference model against transformers' Qwen2 in float64 on the same dequantized
             weights: one decoder layer on fresh random hidden states; the logits of a code
             prompt; and, on the embedded model, the greedy continuations of the prompts.
  unit       (GPU) each kernel of a decode step against float64, on fresh random activations at
             the model's shapes (its own weights for the linears), within the error bounds of
             oracles.py (unit_checks.py).
  layer      (GPU) decoder layer 0 of the engine against the reference, on fresh random hidden
             states; and the self-check generate runs (selfcheck.py: one decode step and one
             prefill chunk, kernel by kernel).
  graph      (GPU) greedy continuations of the prompts, per GEMV path: CUDA graph replay against
             eager launches (identical tokens, bit-identical teacher-forced logits); teacher-forced
             logits through decode steps and through one batched prefill, against the reference
             and against each other; and, on the embedded model, the tokens against the reference's.

The prompts are the starts of functions in held-out standard library files (pynanoqwen.data):
PROMPT_TOKENS tokens each, continued by NEW_TOKENS. --prompts above their count
(data.held_out_function_count(), 580 on Python 3.11) is refused with the other arguments; a
tokenizer that finds a function shorter than PROMPT_TOKENS tokens leaves fewer (the tiny-coder's:
579), and asking for more than that is a FAIL line of the reference tier. Where a tier cannot
run (no GPU, no transformers, a file that failed the format checks) its checks are SKIP with the
reason; --device cuda on a machine without a GPU is a FAIL.

Limits (gates.py derives or estimates each one, from the path's arithmetic and the reference's own
outputs, never from the output under test): the layer update's relative error under the path's
LAYER_ERROR; logits by the KL gate and top-1 on the rows the reference leads clearly, for the
path's estimated logit error, which an all-zero or shuffled output fails; where a path's estimate
at the model's depth makes that gate unable to tell a correct engine from garbage (dp4a, the seed's
Path A, at 7B), the line is a SKIP that shows the comparison's figures and passes nothing. Greedy
tokens on the embedded model must be identical on the prmt path and on auto (whose layer bound,
gates.py, is below prmt's); dp4a computes with INT8
activations, so a continuation may leave the reference's only where the reference's own lead of
its choice over the GPU's is within the clear margin of gates.py. REFERENCE_MAX_REL_ERROR is an
estimate: the reference computes in float32 (matmuls) and float64 (norms, softmax, RoPE angles);
measured against float64 transformers it errs by 6e-7 on the tiny preset (tests/test_reference.py),
and 1e-4 leaves room for deeper and wider models while staying 40x under the prmt layer bound.

Memory. The memory validate allocates (anonymous memory: arrays and tensors; the file's mapped
pages belong to the page cache) stays under CPU_MEMORY_BYTES, 4 GiB. The reference model streams
one layer at a time (reference.ReferenceModel(cache_layers=False)); the float64 transformers
model and layer are filled in place, block by block (transformers_adapter.py); and a check that
would not fit beside what the process already holds is a SKIP that says so.
"""

from __future__ import annotations

import dataclasses
import gc
import resource
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from . import device, gates, transformers_adapter
from .backends import CpuBackend, load_engine
from .data import EMBEDDED_MODEL, held_out_function_count, held_out_prompts
from .errors import NanoQwenError
from .fileformat import NanoQwenFile, model_path
from .kernels import GEMV_PATHS
from .oracles import Check, passed, skipped
from .reference import LM_HEAD_ROWS, ReferenceModel, decoder_layer, layer_nbytes, load_layer, rms_norm
from .sampling import SamplingParams
from .selfcheck import run_self_check
from .tokenizer import Tokenizer
from .unit_checks import UNIT_CHECKS, run_unit_checks

DEFAULT_PROMPTS = 100
PROMPT_TOKENS = 24
NEW_TOKENS = 16
TEACHER_FORCED_PROMPTS = 8     # prompts whose logits are compared (vocab floats per position)
LAYER_TOKENS = 32              # positions in the one-layer checks
REFERENCE_MAX_REL_ERROR = 1e-4  # an estimate: the module docstring
CPU_MEMORY_BYTES = 4 * 2**30  # what validate may hold on the CPU at once: the module docstring


@dataclasses.dataclass
class Report:
    checks: list[Check]
    seed: int
    notes: list[str] = dataclasses.field(default_factory=list)  # what a user should know about what did not run

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
                + "".join(f"; {note}" for note in self.notes) + f"; random inputs from seed {self.seed}")


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
        self.notes: list[str] = []  # for the report's summary

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
        set of sequences (both GEMV paths usually generate the same tokens)."""
        key = tuple(map(tuple, sequences))
        if key not in self._teacher_forced:
            self._teacher_forced[key] = reference_teacher_forced(self.file, sequences, PROMPT_TOKENS - 1)
        return self._teacher_forced[key]


# ----------------------------------------------------------------------------------------------
# The command

def validate(model: str | None, device_name: str = "auto", prompts: int = DEFAULT_PROMPTS, seed: int | None = None,
             on_line: Callable[[str], None] = print) -> Report:
    """Run every tier on `model` (None: the embedded tiny-coder); `device_name` is auto, cpu or cuda."""
    if device_name not in ("auto", "cpu", "cuda"):
        raise NanoQwenError(f"--device must be auto, cpu or cuda, got {device_name!r}")
    if prompts < 1:
        raise NanoQwenError(f"--prompts must be >= 1, got {prompts}")
    if seed is not None and seed < 0:
        raise NanoQwenError(f"--seed must be >= 0, got {seed}")
    if prompts > (most := held_out_function_count()):
        raise NanoQwenError(f"--prompts must be at most {most}, got {prompts}: the held-out standard library "
                            f"files of this Python hold {most} functions to draw prompts from")
    path = model_path(model) if model is not None else EMBEDDED_MODEL  # an empty path is an argument error
    embedded = model is None or path.resolve() == EMBEDDED_MODEL.resolve()
    seed = int(np.random.SeedSequence().entropy % 2**32) if seed is None else seed
    target = Target(path, embedded, prompts, seed)
    on_line(f"validating {path}{' (the embedded tiny-coder)' if embedded else ''}, device {device_name}")
    report = Report([], seed, target.notes)
    gpu_reason = _gpu_unavailable(device_name)
    try:
        for tier, run_tier, needs_gpu in TIERS:
            if tier != "format" and target.file is None:
                checks = iter([skipped("all", "the file did not pass the format checks")])
            elif needs_gpu and gpu_reason is not None:
                status = "FAIL" if device_name == "cuda" else "SKIP"
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


def _gpu_unavailable(device_name: str) -> str | None:
    """Why the GPU tiers cannot run, or None when they can."""
    if device_name == "cpu":
        return "--device cpu"
    if not device.cuda_gpu_available():
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
        t.tokenizer = Tokenizer.from_json_bytes(t.file.tokenizer_json, t.file.chat_template, vocab_size=cfg.vocab_size,
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
# Tier: reference (CPU), against transformers

def reference_tier(t: Target) -> Iterator[Check]:
    absent = transformers_adapter.missing()
    if absent is not None:
        t.notes.append(f"the reference tier did not run ({absent} is not installed): "
                       f"`{transformers_adapter.INSTALL_HINT}` adds torch and transformers")
        yield skipped("all", f"the reference tier was not run: it needs torch and transformers ({absent} is not "
                             f"installed); `{transformers_adapter.INSTALL_HINT}` adds them")
        return
    cfg = t.config
    layer, block = layer_nbytes(cfg), transformers_adapter.fill_block_bytes(cfg)  # one float32 layer; a fill block
    no_room = _no_room(3 * layer + block, "a float32 and a float64 copy of layer 0")
    if no_room:
        for name in ("layer 0 vs transformers", "logits vs transformers", "greedy tokens vs transformers"):
            yield skipped(name, no_room)
        return
    x = random_hidden_states(t)
    delta_ours = reference_layer_outputs(t, 0, x) - x
    delta_theirs = transformers_adapter.transformers_layer_outputs(t.file, 0, x) - x
    error = gates.relative_error(delta_ours, delta_theirs)
    yield passed("layer 0 vs transformers", error < REFERENCE_MAX_REL_ERROR,
                 f"{LAYER_TOKENS} random positions: layer output - input, worst row relative error "
                 f"{error:.2e} (limit {REFERENCE_MAX_REL_ERROR:.0e})")

    prompt = t.prompts()[0]
    # The float64 model, the reference's one streamed layer and lm_head block, both prompts' logits.
    needed = (transformers_adapter.float64_bytes(cfg) + layer + block + 4 * LM_HEAD_ROWS * cfg.hidden_size
              + 24 * len(prompt) * cfg.vocab_size)
    no_room = _no_room(needed, "the float64 transformers model")
    if no_room:
        yield skipped("logits vs transformers", no_room)
        yield skipped("greedy tokens vs transformers", no_room)
        return
    model = transformers_adapter.transformers_model(t.file)
    ours = ReferenceModel(t.file, max_context=len(prompt), cache_layers=False).forward(prompt)
    theirs = transformers_adapter.transformers_logits(model, prompt)
    error = gates.relative_error(ours, theirs)
    top1 = float(np.mean(ours.argmax(axis=1) == theirs.argmax(axis=1)))
    yield passed("logits vs transformers", error < REFERENCE_MAX_REL_ERROR,
                 f"code prompt of {len(prompt)} tokens: worst row relative error {error:.2e} "
                 f"(limit {REFERENCE_MAX_REL_ERROR:.0e}), top-1 agreement {top1:.0%}")
    if not t.embedded:
        yield skipped("greedy tokens vs transformers", "asserted on the embedded model only, whose peaked "
                                                        "predictions leave no near-ties; see the logits check")
        return
    ours = t.reference_tokens()
    theirs = transformers_adapter.transformers_greedy(model, t.prompts(), t.new_tokens())
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


def allocated_bytes() -> int:
    """The anonymous memory this process holds now (RssAnon: not the file's mapped pages, which
    are the page cache's); where /proc is missing, the peak resident size so far."""
    try:
        with open("/proc/self/status") as status:
            return 1024 * int(next(line.split()[1] for line in status if line.startswith("RssAnon:")))
    except (OSError, StopIteration):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else 1024 * peak


def _no_room(nbytes: int, what: str) -> str | None:
    """Why `what` (nbytes more) does not fit under CPU_MEMORY_BYTES beside what the process holds,
    or None when it does."""
    held = allocated_bytes()
    if held + nbytes <= CPU_MEMORY_BYTES:
        return None
    return (f"{what} ({nbytes / 2**30:.1f} GiB) would not fit under validate's memory cap of "
            f"{CPU_MEMORY_BYTES / 2**30:.1f} GiB beside the {held / 2**30:.1f} GiB it holds")


# ----------------------------------------------------------------------------------------------
# Tier: unit (GPU), each kernel at the model's shapes

def unit_tier(t: Target) -> Iterator[Check]:
    return run_unit_checks(t.file, t.rng, UNIT_CHECKS)


# ----------------------------------------------------------------------------------------------
# Tiers: layer and graph (GPU), through the engine (backends.GpuEngine)

def _release(engine) -> None:
    """Free an engine's graphs and device memory before the next one is loaded."""
    engine.close()
    gc.collect()


def layer_tier(t: Target) -> Iterator[Check]:
    x = random_hidden_states(t)
    ours_delta = reference_layer_outputs(t, 0, x) - x
    for gemv in GEMV_PATHS:
        engine = load_engine(t.path, t.max_context(), gemv, eager=True)
        try:
            error = gates.relative_error(engine.layer_outputs(0, x) - x, ours_delta)
            self_check = run_self_check(engine, t.file, t.rng)
        finally:
            _release(engine)
        limit = gates.LAYER_ERROR[gemv]
        yield passed(f"{gemv} layer 0 vs reference", error < limit,
                     f"{LAYER_TOKENS} random positions: layer output - input, worst row relative error "
                     f"{error:.2e} (limit {limit:.1e})")
        yield passed(f"{gemv} generate's self-check", not self_check.failed, self_check.summary())


def graph_tier(t: Target) -> Iterator[Check]:
    prompts, new, layers = t.prompts(), t.new_tokens(), t.config.num_layers
    forced = prompts[:TEACHER_FORCED_PROMPTS]
    for gemv in GEMV_PATHS:
        tokens, logits = {}, {}
        for eager in (True, False):
            engine = load_engine(t.path, t.max_context(), gemv, eager)
            try:
                tokens[eager] = [list(engine.generate(p, SamplingParams(), new, frozenset())) for p in prompts]
                logits[eager] = np.stack([engine.teacher_forced_logits(p + seq[:-1])[len(p) - 1:]
                                          for p, seq in zip(forced, tokens[eager])])
                if not eager:
                    prefill = np.stack([engine.prefill_logits(p + seq[:-1])[len(p) - 1:]
                                        for p, seq in zip(forced, tokens[eager])])
            finally:
                _release(engine)
        yield _compare_tokens(f"{gemv} graph vs eager tokens", tokens[False], tokens[True])
        same = np.array_equal(logits[False].view(np.uint32), logits[True].view(np.uint32))
        yield passed(f"{gemv} graph vs eager logits", same,
                     f"{len(forced)} prompts x {new} positions teacher-forced: "
                     + ("bit-identical" if same else "differ (graph replay must launch the same kernels)"))
        ours = t.reference_teacher_forced([p + seq[:-1] for p, seq in zip(forced, tokens[False])])
        rows = f"{len(forced)} prompts x {new} teacher-forced positions"
        decode_error = gates.logits_error(gemv, layers)
        prefill_error = gates.logits_error("prefill", layers, gemv)
        yield gates.logits_check(f"{gemv} logits vs reference", logits[False], ours, decode_error, rows)
        yield gates.logits_check(f"{gemv} prefill vs reference", prefill, ours, prefill_error,
                                 rows + " through one batched prefill")
        yield gates.logits_check(f"{gemv} prefill vs decode", prefill, ours, prefill_error + decode_error,
                                 rows + ", batched prefill against decode steps", base=logits[False])
        name = f"{gemv} graph vs reference tokens"
        if not t.embedded:
            yield skipped(name, "asserted on the embedded model only, whose peaked predictions leave few near-ties")
        elif gemv in ("auto", "prmt"):
            yield _compare_tokens(name, tokens[False], t.reference_tokens())
        else:
            yield _divergences_at_near_ties(name, t, tokens[False], decode_error)


def _divergences_at_near_ties(name: str, t: Target, ours: list[list[int]], eps: float) -> Check:
    """PASS when every continuation either equals the reference's or leaves it at a position where
    the reference's lead of its token over the GPU's is within gates.clear_margin for the
    estimated logit error eps (a near-tie), and nowhere else."""
    theirs = t.reference_tokens()
    model = ReferenceModel(t.file, max_context=t.max_context())
    differing, leads = 0, []
    for prompt, a, b in zip(t.prompts(), ours, theirs):
        if a == b:
            continue
        differing += 1
        at = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
        model.reset()
        logits = model.forward(prompt + a[:at], last_only=True)[0].astype(np.float64)
        leads.append((float(logits[b[at]] - logits[a[at]]), float(gates.clear_margin(logits, eps))))
    ok = all(lead <= margin for lead, margin in leads)
    worst = max(leads, default=(0.0, 0.0), key=lambda pair: pair[0] - pair[1])
    total = sum(len(seq) for seq in ours)
    return passed(name, ok, f"{len(ours)} prompts x {len(ours[0])} tokens: {len(ours) - differing} continuations "
                            f"identical; {differing} leave the reference, where its token led the GPU's by at most "
                            f"{worst[0]:.3f} (clear margin there {worst[1]:.3f}); {total} tokens in all")


# ----------------------------------------------------------------------------------------------
# The reference side of the GPU tiers

def reference_greedy(weights, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """The numpy reference model's greedy continuations (generate --device cpu), no stop tokens."""
    backend = CpuBackend(ReferenceModel(weights, max_context=len(prompts[0]) + new_tokens))
    return [list(backend.generate(p, SamplingParams(), new_tokens, frozenset())) for p in prompts]


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


TIERS = (("format", format_tier, False), ("reference", reference_tier, False), ("unit", unit_tier, True),
         ("layer", layer_tier, True), ("graph", graph_tier, True))

"""`python -m pynanoqwen generate`: prompt text -> token ids -> a backend -> streamed text.

A backend (backends.py: the numpy reference on the CPU, or the GPU engine) owns the loaded model
and turns prompt ids into new token ids. Everything around it lives here: building the prompt
(raw, ChatML chat or fill-in-the-middle), refusing what cannot run, streaming the text, and the
timing summary.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path

from . import device as cuda_device
from .backends import Backend, load_backend
from .errors import NanoQwenError
from .fileformat import NanoQwenFile, model_path
from .kernels import GEMV_PATHS
from .prompt_lookup import LookupParams, LookupStats, check_device
from .sampling import SamplingParams
from .selfcheck import require_self_check
from .tokenizer import Tokenizer

DEFAULT_MAX_CONTEXT = 32768
DEFAULT_MAX_NEW_TOKENS = 256


@dataclasses.dataclass(frozen=True)
class GenerateOptions:
    """Everything `python -m pynanoqwen generate` takes, as typed by the user."""

    prompt: str | None = None  # exactly one of prompt and prompt_file
    prompt_file: str | None = None  # a path, or "-" for standard input
    model: str | None = None
    device: str | None = None  # None: cuda if a GPU is present, else cpu
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    sampling: SamplingParams = SamplingParams()
    lookup: LookupParams = LookupParams()  # prompt-lookup speculative decoding, off by default
    chat: bool = False
    system: str | None = None
    fim_suffix: str | None = None
    max_context: int = DEFAULT_MAX_CONTEXT
    gemv: str = "auto"
    eager: bool = False
    self_check: bool = True  # GPU only: one checked decode step before generating (selfcheck.py)

    def validate(self) -> "GenerateOptions":
        self.sampling.validate()
        self.lookup.validate()
        if self.max_new_tokens < 1:
            raise NanoQwenError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.max_context < 2:
            raise NanoQwenError(f"--max-context must be >= 2, got {self.max_context}")
        if self.gemv not in GEMV_PATHS:
            raise NanoQwenError(f"--gemv must be one of {', '.join(GEMV_PATHS)}, got {self.gemv!r}")
        if self.system is not None and not self.chat:
            raise NanoQwenError("--system needs --chat")
        if self.fim_suffix is not None and self.chat:
            raise NanoQwenError("--fim-suffix builds a fill-in-the-middle prompt; it cannot be used with --chat")
        if self.prompt is not None and self.prompt_file is not None:
            raise NanoQwenError("give the prompt as PROMPT or with --prompt-file, not both")
        if self.prompt is None and self.prompt_file is None:
            raise NanoQwenError("no prompt: give PROMPT, or --prompt-file FILE ('-' reads standard input)")
        check_utf8("--system", self.system)
        check_utf8("--fim-suffix", self.fim_suffix)
        if self.prompt is not None:
            check_prompt(self.prompt, self.fim_suffix)
        return self


def check_utf8(what: str, text: str | None) -> None:
    """Refuse text that cannot be encoded as UTF-8. Python decodes a command-line byte that is not
    UTF-8 into a lone surrogate (U+DC80..U+DCFF, "surrogateescape"), which the tokenizer rejects."""
    if text is None:
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as bad:
        code = ord(text[bad.start])
        culprit = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"lone surrogate U+{code:04X}"
        raise NanoQwenError(f"{what} is not valid UTF-8 text ({culprit} at character {bad.start})") from None


def check_prompt(prompt: str, fim_suffix: str | None, what: str = "the prompt") -> None:
    """A prompt is UTF-8 text with something besides white space in it or in the FIM suffix."""
    check_utf8(what, prompt)
    if not prompt.strip() and not (fim_suffix or "").strip():
        raise NanoQwenError(f"{what} is empty" + (" (only white space)" if prompt else ""))


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    prompt_tokens: int
    tokens: list[int]  # generated ids, the stop token included when there was one
    text: str  # what was streamed: the decoded tokens without the stop token
    stop_reason: str  # "stop token", "max-new-tokens" or "context full"
    time_to_first_token_s: float
    total_s: float
    lookup: LookupStats | None = None  # what prompt lookup did, when it was on

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens per second after the first (which includes the prompt's prefill)."""
        decode_s = self.total_s - self.time_to_first_token_s
        return (len(self.tokens) - 1) / decode_s if len(self.tokens) > 1 and decode_s > 0 else None

    def summary(self) -> str:
        rate = self.decode_tokens_per_s
        return (f"{self.prompt_tokens} prompt tokens, {len(self.tokens)} generated ({self.stop_reason}); "
                f"time to first token {1000 * self.time_to_first_token_s:.1f} ms; "
                + (f"{rate:.2f} tokens/s" if rate is not None else "tokens/s n/a (one token)")
                + (f"; {self.lookup.summary()}" if self.lookup is not None else ""))


def build_prompt(tokenizer: Tokenizer, prompt: str, *, chat: bool, system: str | None,
                 fim_suffix: str | None) -> str:
    """The text the model sees: the prompt itself, a ChatML conversation, or a FIM prompt."""
    if fim_suffix is not None:
        return tokenizer.fim_prompt(prompt, fim_suffix)
    if chat:
        messages = [{"role": "system", "content": system}] if system is not None else []
        return tokenizer.apply_chat_template(messages + [{"role": "user", "content": prompt}],
                                             add_generation_prompt=True)
    return prompt


def check_fits(prompt_tokens: int, max_context: int) -> None:
    if prompt_tokens + 1 > max_context:
        raise NanoQwenError(f"the prompt is {prompt_tokens} tokens, which leaves no room to generate in a "
                            f"context of {max_context} tokens (at most {max_context - 1} prompt tokens)")


def generate(backend: Backend, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams,
             max_new_tokens: int, on_text: Callable[[str], None],
             lookup: LookupParams = LookupParams()) -> GenerationResult:
    """Run one generation, calling `on_text` with each piece of finished text as it arrives."""
    check_fits(len(prompt_ids), backend.max_context)
    budget = min(max_new_tokens, backend.max_context - len(prompt_ids))
    stop_ids = tokenizer.stop_ids
    decoder = tokenizer.stream_decoder()
    tokens: list[int] = []
    pieces: list[str] = []
    start = time.perf_counter()
    first = None
    for token in backend.generate(prompt_ids, params, budget, stop_ids, lookup):
        if first is None:
            first = time.perf_counter()
        tokens.append(token)
        if token in stop_ids:
            break
        piece = decoder.push(token)
        if piece:
            pieces.append(piece)
            on_text(piece)
    end = time.perf_counter()
    rest = decoder.flush()
    if rest:
        pieces.append(rest)
        on_text(rest)
    if tokens and tokens[-1] in stop_ids:
        reason = "stop token"
    else:
        reason = "max-new-tokens" if len(tokens) == max_new_tokens else "context full"
    return GenerationResult(len(prompt_ids), tokens, "".join(pieces), reason,
                            (first if first is not None else end) - start, end - start,
                            backend.lookup_stats if lookup.enabled else None)


def resolve_prompt(options: GenerateOptions) -> str:
    """The prompt text: PROMPT as given, or the whole of --prompt-file (`-`: standard input) as
    UTF-8, verbatim (its final newline included; only a leading byte-order mark is dropped)."""
    if options.prompt_file is None:
        return options.prompt
    name = options.prompt_file
    if not name.strip():  # Path("") is ".", which was reported as "--prompt-file : is a directory"
        raise NanoQwenError("--prompt-file is an empty path; give a file, or '-' for standard input")
    label = "--prompt-file - (standard input)" if name == "-" else f"--prompt-file {name}"
    try:
        data = sys.stdin.buffer.read() if name == "-" else Path(name).read_bytes()
    except FileNotFoundError:
        raise NanoQwenError(f"{label}: no such file") from None
    except IsADirectoryError:
        raise NanoQwenError(f"{label}: is a directory") from None
    except OSError as err:
        raise NanoQwenError(f"{label}: cannot read: {err.strerror or err}") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as bad:
        raise NanoQwenError(f"{label} is not UTF-8 text ({bad.reason} at byte {bad.start})") from None
    check_prompt(text, options.fim_suffix, label)
    return text


def resolve_model(model: str | None) -> Path:
    """The model file to run: --model, or the embedded tiny-coder (pynanoqwen/data) without one."""
    if model is not None:
        return model_path(model)
    from .data import EMBEDDED_MODEL

    if not EMBEDDED_MODEL.is_file():
        raise NanoQwenError(f"no --model given and the embedded model {EMBEDDED_MODEL} is missing "
                            "(a broken install?); pass --model FILE")
    return EMBEDDED_MODEL


def resolve_device(device: str | None, on_status: Callable[[str], None]) -> str:
    if device is not None:
        return device
    device = "cuda" if cuda_device.cuda_gpu_available() else "cpu"
    on_status(f"device: {device} ({'a CUDA GPU was found' if device == 'cuda' else 'no CUDA GPU found'}; "
              "pass --device to choose)")
    return device


def run(options: GenerateOptions, on_text: Callable[[str], None],
        on_status: Callable[[str], None]) -> GenerationResult:
    """The `generate` command: check everything cheap first, then load the model and stream."""
    options.validate()
    prompt = resolve_prompt(options)
    model_path = resolve_model(options.model)
    with NanoQwenFile(model_path, verify_data=False) as f:
        config = f.config
        # The template is compiled only for --chat: a file whose template is broken still
        # completes raw and fill-in-the-middle prompts.
        tokenizer = Tokenizer.from_json_bytes(f.tokenizer_json, f.chat_template if options.chat else None,
                                              vocab_size=config.vocab_size,
                                              bos_token_id=config.bos_token_id,
                                              eos_token_id=config.eos_token_id, extra_eos_ids=f.extra_eos_ids)
    max_context = min(options.max_context, config.max_position_embeddings)
    prompt_ids = tokenizer.encode(build_prompt(tokenizer, prompt, chat=options.chat,
                                               system=options.system, fim_suffix=options.fim_suffix))
    check_fits(len(prompt_ids), max_context)
    device = resolve_device(options.device, on_status)
    check_device(options.lookup, device)
    # Loaded before the embedded model is described, so that --device cuda without a GPU fails
    # before a line that names "the GPU engine".
    backend = load_backend(model_path, device, max_context, options.gemv, options.eager)
    if options.model is None:
        on_status(f"model: the embedded tiny-coder ({model_path.stat().st_size / 1e6:.1f} MB, a "
                  f"{config.num_layers}-layer model trained on Python's standard library) on "
                  f"{'the GPU engine' if device == 'cuda' else 'the CPU (numpy reference)'}; pass --model FILE "
                  "for another")
    if device == "cuda" and options.self_check:
        on_status(require_self_check(backend, model_path, len(prompt_ids)))
    backend.prepare(len(prompt_ids), options.sampling)
    result = generate(backend, tokenizer, prompt_ids, options.sampling, options.max_new_tokens, on_text,
                      options.lookup)
    on_text("\n")
    on_status(f"{backend.name}: {result.summary()}")
    return result

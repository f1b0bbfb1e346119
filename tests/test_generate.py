"""`generate`: the CPU backend and the CLI end to end on a tiny random model (made by the
checkpoint writer and `convert`), checked against independent loops over the reference model;
stop conditions, streaming, and every refusal as one `error:` line."""

import re
import subprocess
import sys

import numpy as np
import pytest
import tokenizers
from click.testing import CliRunner

from pynanoqwen import backends, device
from pynanoqwen import generate as gen
from pynanoqwen.checkpoint import make_checkpoint
from pynanoqwen.cli import main
from pynanoqwen.convert import convert_checkpoint
from pynanoqwen.errors import NanoQwenError
from pynanoqwen.fileformat import NanoQwenFile
from pynanoqwen.reference import ReferenceModel
from pynanoqwen.sampling import SamplingParams, sample
from pynanoqwen.tokenizer import Tokenizer

PROMPT = "def fibonacci(n):\n    "
SUMMARY = re.compile(r"^cpu \(numpy reference\): (\d+) prompt tokens, (\d+) generated \(([a-z -]+)\); "
                     r"time to first token [\d.]+ ms; ([\d.]+ tokens/s|tokens/s n/a \(one token\))$")


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    """A tiny random Qwen2 (2 layers, vocab 2048) with a trained tokenizer, converted to .nanoqwen."""
    root = tmp_path_factory.mktemp("tiny_generate")
    make_checkpoint("tiny", root / "hf", seed=3)
    convert_checkpoint(root / "hf", root / "tiny.nanoqwen", progress=False)
    return str(root / "tiny.nanoqwen")


@pytest.fixture(scope="module")
def reference(tiny_file):
    """An independent view of the file: the raw `tokenizers` library and a fresh ReferenceModel."""
    f = NanoQwenFile(tiny_file)
    raw = tokenizers.Tokenizer.from_str(f.tokenizer_json.decode())
    stops = {raw.token_to_id("<|endoftext|>"), raw.token_to_id("<|im_end|>"), f.config.eos_token_id}
    return raw, ReferenceModel(f), stops


def run_cli(*args, **kwargs):
    return CliRunner().invoke(main, ["generate", *args], **kwargs)


def reference_generation(reference, prompt_ids, params, max_new_tokens):
    """Each step recomputes the whole sequence from scratch (no KV cache reuse) and samples the next
    token from the last logits; stops at a stop id, which is not part of the text."""
    raw, model, stops = reference
    rng = np.random.default_rng(params.seed)
    out = []
    for _ in range(max_new_tokens):
        model.reset()
        logits = model.forward(prompt_ids + out)[-1]
        token = int(np.argmax(logits)) if params.greedy else sample(logits, params, rng)
        if token in stops:
            break
        out.append(token)
    return raw.decode(out, skip_special_tokens=False)


def test_greedy_cli_equals_step_by_step_argmax_of_the_reference_model(tiny_file, reference):
    result = run_cli("--model", tiny_file, "--device", "cpu", "--max-new-tokens", "20", PROMPT)
    assert result.exit_code == 0, result.stderr
    prompt_ids = reference[0].encode(PROMPT, add_special_tokens=False).ids
    assert result.stdout == reference_generation(reference, prompt_ids, SamplingParams(), 20) + "\n"
    summary = SUMMARY.match(result.stderr.strip())
    assert summary, result.stderr
    assert int(summary[1]) == len(prompt_ids) and int(summary[2]) == 20 and summary[3] == "max-new-tokens"


def test_seeded_sampling_is_reproducible_and_matches_the_sampler(tiny_file, reference):
    args = ["--model", tiny_file, "--device", "cpu", "--max-new-tokens", "12", "--temperature", "0.9",
            "--top-k", "40", "--top-p", "0.95"]
    first = run_cli(*args, "--seed", "5", PROMPT)
    again = run_cli(*args, "--seed", "5", PROMPT)
    other = run_cli(*args, "--seed", "6", PROMPT)
    assert first.exit_code == again.exit_code == other.exit_code == 0
    assert first.stdout == again.stdout != other.stdout
    prompt_ids = reference[0].encode(PROMPT, add_special_tokens=False).ids
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=5)
    assert first.stdout == reference_generation(reference, prompt_ids, params, 12) + "\n"


def prompt_tokens_of(result) -> int:
    summary = SUMMARY.match(result.stderr.strip().splitlines()[-1])
    assert summary, result.stderr
    return int(summary[1])


def test_chat_and_fim_prompts(tiny_file, reference):
    raw = reference[0]
    chat = run_cli("--model", tiny_file, "--device", "cpu", "--max-new-tokens", "2", "--chat",
                   "--system", "Be brief.", "Hi 世界")
    assert chat.exit_code == 0, chat.stderr
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 世界<|im_end|>\n<|im_start|>assistant\n"
    assert prompt_tokens_of(chat) == len(raw.encode(expected, add_special_tokens=False).ids)

    fim = run_cli("--model", tiny_file, "--device", "cpu", "--max-new-tokens", "2",
                  "--fim-suffix", "\n    return y\n", "def f(x):\n")
    assert fim.exit_code == 0, fim.stderr
    expected = "<|fim_prefix|>def f(x):\n<|fim_suffix|>\n    return y\n<|fim_middle|>"
    assert prompt_tokens_of(fim) == len(raw.encode(expected, add_special_tokens=False).ids)


def test_build_prompt_modes(tiny_file):
    with NanoQwenFile(tiny_file) as f:
        tok = Tokenizer.from_json_bytes(f.tokenizer_json, f.chat_template, eos_token_id=f.config.eos_token_id)
    assert tok.has_chat_template  # convert embedded Qwen2.5-Instruct's template
    assert gen.build_prompt(tok, "x = 1", chat=False, system=None, fim_suffix=None) == "x = 1"
    assert gen.build_prompt(tok, "Hi", chat=True, system=None, fim_suffix=None) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert gen.build_prompt(tok, "a", chat=False, system=None, fim_suffix="b") == \
        "<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>"


class ScriptedModel:
    """Stands in for ReferenceModel: the next token is always script[i] (one-hot logits), and it
    records what it is fed so the test can check the backend's use of the KV cache."""

    def __init__(self, script, vocab, max_context):
        self.script, self.vocab, self.max_context = script, vocab, max_context
        self.fed: list[list[int]] = []

    def reset(self):
        self.fed = []

    def forward(self, tokens, *, last_only=False):
        self.fed.append(list(tokens))
        logits = np.random.default_rng(len(self.fed)).standard_normal((1, self.vocab)).astype(np.float32)
        logits[0, self.script[len(self.fed) - 1]] = 100.0
        return logits


@pytest.fixture(scope="module")
def tokenizer(tiny_file):
    with NanoQwenFile(tiny_file) as f:
        return Tokenizer.from_json_bytes(f.tokenizer_json, f.chat_template, eos_token_id=f.config.eos_token_id)


def test_generation_stops_at_a_stop_token_which_is_not_printed(tokenizer):
    im_end = tokenizer.token_to_id("<|im_end|>")
    word = tokenizer.encode(" hello world")
    model = ScriptedModel(word + [im_end, 50, 51], 2048, 64)
    pieces = []
    result = gen.generate(backends.CpuBackend(model), tokenizer, [10, 11, 12], SamplingParams(), 100, pieces.append)
    assert result.tokens == word + [im_end] and result.stop_reason == "stop token"
    assert "".join(pieces) == result.text == " hello world"
    # The prompt goes in once, then each sampled token once; the stop token is never fed back.
    assert model.fed == [[10, 11, 12]] + [[t] for t in word]


def test_max_new_tokens_and_a_full_context_end_generation(tokenizer):
    script = tokenizer.encode("abc def ghi jkl mno pqr stu")
    prompt = [20, 21, 22, 23]
    result = gen.generate(backends.CpuBackend(ScriptedModel(script, 2048, 64)), tokenizer, prompt,
                          SamplingParams(), 3, lambda text: None)
    assert result.tokens == script[:3] and result.stop_reason == "max-new-tokens"
    # Context 7 holds the 4 prompt tokens and 3 generated ones, whatever --max-new-tokens says.
    result = gen.generate(backends.CpuBackend(ScriptedModel(script, 2048, 7)), tokenizer, prompt,
                          SamplingParams(), 100, lambda text: None)
    assert result.tokens == script[:3] and result.stop_reason == "context full"
    with pytest.raises(NanoQwenError, match="leaves no room"):
        gen.generate(backends.CpuBackend(ScriptedModel(script, 2048, 4)), tokenizer, prompt,
                     SamplingParams(), 100, lambda text: None)


def test_text_streams_while_tokens_arrive_and_never_splits_a_character(tokenizer):
    text = "naïve 世界 🙂🚀 ok"
    ids = tokenizer.encode(text)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # some tokens hold part of a character
    events = []

    class ScriptedBackend:
        name, max_context = "scripted", 100

        def generate(self, prompt_ids, params, max_new_tokens, stop_ids):
            assert max_new_tokens == len(ids)
            for token in ids:
                events.append(("token", token))
                yield token

    def on_text(piece):
        assert "\ufffd" not in piece
        events.append(("text", piece))

    result = gen.generate(ScriptedBackend(), tokenizer, [1, 2], SamplingParams(), len(ids), on_text)
    assert result.text == text and result.stop_reason == "max-new-tokens"
    texts = [i for i, (kind, _) in enumerate(events) if kind == "text"]
    tokens = [i for i, (kind, _) in enumerate(events) if kind == "token"]
    assert len(texts) > 3 and texts[0] < tokens[-1]  # text came out before the last token was made


@pytest.mark.parametrize("args,message", [
    (["--model", "/nonexistent/model.nanoqwen", "--device", "cpu", "hi"], "no such file"),
    (["--model", "{tiny}", "--device", "cpu", ""], "the prompt is empty"),
    (["--model", "{tiny}", "--device", "cpu", "  \n "], "the prompt is empty"),
    (["--model", "{tiny}", "--device", "cpu", "--max-context", "16", PROMPT * 4], "leaves no room"),
    (["--model", "{tiny}", "--device", "cpu", "--max-context", "100000", "word " * 2100],
     r"at most 2047 prompt tokens"),
    (["--model", "{tiny}", "--temperature", "-1", "hi"], "--temperature must be"),
    (["--model", "{tiny}", "--temperature", "nan", "hi"], "--temperature must be"),
    (["--model", "{tiny}", "--top-p", "0", "hi"], r"--top-p must be in \(0, 1\]"),
    (["--model", "{tiny}", "--top-p", "1.5", "hi"], r"--top-p must be in \(0, 1\]"),
    (["--model", "{tiny}", "--top-k", "-3", "hi"], "--top-k must be >= 0"),
    (["--model", "{tiny}", "--seed", "-1", "hi"], "--seed must be"),
    (["--model", "{tiny}", "--max-new-tokens", "0", "hi"], "--max-new-tokens must be >= 1"),
    (["--model", "{tiny}", "--max-context", "1", "hi"], "--max-context must be >= 2"),
    (["--model", "{tiny}", "--system", "s", "hi"], "--system needs --chat"),
    (["--model", "{tiny}", "--chat", "--fim-suffix", "x", "hi"], "cannot be used with --chat"),
    (["--model", "{tiny}", "--device", "cuda", "hi"], "no CUDA GPU found; use --device cpu"),
])
def test_refusals_are_one_error_line(tiny_file, monkeypatch, args, message):
    monkeypatch.setattr(device, "cuda_gpu_available", lambda: False)
    result = run_cli(*[a.replace("{tiny}", tiny_file) for a in args])
    assert result.exit_code == 1
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and re.search(message, lines[0]), result.stderr
    assert result.stdout == "" and "Traceback" not in result.output


def test_a_file_that_is_not_a_model_is_refused(tmp_path):
    bogus = tmp_path / "notes.nanoqwen"
    bogus.write_text("just some text, long enough to be read as a header" * 10)
    result = run_cli("--model", str(bogus), "--device", "cpu", "hi")
    assert result.exit_code == 1 and result.stderr.startswith("error: ") and "not a .nanoqwen file" in result.stderr


def test_prompt_that_exactly_fits_generates_one_token(tiny_file, reference):
    n = len(reference[0].encode(PROMPT, add_special_tokens=False).ids)
    result = run_cli("--model", tiny_file, "--device", "cpu", "--max-context", str(n + 1), PROMPT)
    assert result.exit_code == 0, result.stderr
    summary = SUMMARY.match(result.stderr.strip())
    assert summary and int(summary[2]) == 1 and summary[3] in ("context full", "stop token")


def test_device_defaults_to_cpu_without_a_gpu_and_says_so(tiny_file, monkeypatch):
    monkeypatch.setattr(device, "cuda_gpu_available", lambda: False)
    result = run_cli("--model", tiny_file, "--max-new-tokens", "1", "x")
    assert result.exit_code == 0, result.stderr
    assert result.stderr.splitlines()[0] == "device: cpu (no CUDA GPU found; pass --device to choose)"


def test_cuda_without_an_importable_engine_is_a_clear_error(tiny_file, monkeypatch):
    monkeypatch.setattr(device, "cuda_gpu_available", lambda: True)
    monkeypatch.setitem(sys.modules, "pynanoqwen.engine", None)  # makes `from .engine import` fail
    with pytest.raises(NanoQwenError, match="GPU engine cannot be loaded.*use --device cpu"):
        backends.load_backend(tiny_file, "cuda", 64)


def test_python_dash_m_streams_and_fails_cleanly(tiny_file):
    base = [sys.executable, "-m", "pynanoqwen", "generate", "--model", tiny_file, "--device", "cpu"]
    ok = subprocess.run(base + ["--max-new-tokens", "8", PROMPT], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout == run_cli("--model", tiny_file, "--device", "cpu", "--max-new-tokens", "8", PROMPT).stdout
    bad = subprocess.run(base + ["--top-p", "2", PROMPT], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and bad.stdout == ""
    assert bad.stderr == "error: --top-p must be in (0, 1], got 2.0\n"

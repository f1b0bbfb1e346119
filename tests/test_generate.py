"""`generate`: the CPU backend and the CLI end to end on a tiny random model (made by the
checkpoint writer and `convert`), checked against independent loops over the reference model;
stop conditions, streaming, and every refusal as one `error:` line."""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tokenizers
from click.testing import CliRunner

from pynanoqwen import backends, device
from pynanoqwen import generate as gen
from pynanoqwen.backends import CpuBackend
from pynanoqwen.device import cuda_gpu_available
from pynanoqwen.checkpoint import make_checkpoint
from pynanoqwen.cli import main
from pynanoqwen.convert import convert_checkpoint
from pynanoqwen.errors import NanoQwenError
from pynanoqwen.fileformat import NanoQwenFile
from pynanoqwen.filewriter import NanoQwenWriter
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
        tok = Tokenizer.from_json_bytes(f.tokenizer_json, f.chat_template, vocab_size=f.config.vocab_size,
                                        eos_token_id=f.config.eos_token_id)
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
        return Tokenizer.from_json_bytes(f.tokenizer_json, f.chat_template, vocab_size=f.config.vocab_size,
                                         eos_token_id=f.config.eos_token_id)


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

        def generate(self, prompt_ids, params, max_new_tokens, stop_ids, lookup=None):
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
    (["--model", "{tiny}", "--prompt-lookup", "16", "hi"], r"--prompt-lookup must be between 0 \(off\) and 15"),
    (["--model", "{tiny}", "--prompt-lookup", "4", "--lookup-ngram", "2:1", "hi"], "1 <= min <= max"),
    (["--model", "{tiny}", "--prompt-lookup", "4", "--lookup-ngram", "two", "hi"], "--lookup-ngram must be MIN:MAX"),
    (["--model", "{tiny}", "--device", "cuda", "--prompt-lookup", "4", "hi"],
     r"--prompt-lookup runs on the CPU reference only \(--device cpu\)"),
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


def test_prompt_lookup_prints_the_same_text_and_what_it_accepted(tiny_file):
    repeated = PROMPT + "\n" + PROMPT[:len(PROMPT) // 2]  # a prompt whose continuation it already holds
    plain = run_cli("--model", tiny_file, "--device", "cpu", "--max-new-tokens", "24", repeated)
    looked_up = run_cli("--model", tiny_file, "--device", "cpu", "--max-new-tokens", "24", "--prompt-lookup", "6",
                        "--lookup-ngram", "1:4", repeated)
    assert plain.exit_code == looked_up.exit_code == 0, looked_up.stderr
    assert looked_up.stdout == plain.stdout
    summary = looked_up.stderr.strip().splitlines()[-1]
    assert re.search(r"; prompt lookup: \d+ of \d+ drafted tokens accepted( \(\d+%\))? in \d+ verify passes "
                     r"and \d+ plain steps$", summary), summary


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


# ---- bad input through `python -m pynanoqwen generate`, as a user types it ----

def run_module(*args, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    """Arguments may be bytes: Linux passes them to Python undecoded, as a terminal would."""
    return subprocess.run([sys.executable, "-m", "pynanoqwen", *args], input=stdin, capture_output=True,
                          timeout=300)


def one_error_line(result: subprocess.CompletedProcess, message: str, code: int = 1) -> None:
    stderr = result.stderr.decode("utf-8", "backslashreplace")
    assert result.returncode == code and result.stdout == b"", stderr
    assert stderr.count("\n") == 1 and stderr.startswith("error: ") and re.search(message, stderr), stderr


@pytest.mark.parametrize("args, message", [
    ([b"def f\xff():"], r"the prompt is not valid UTF-8 text \(byte 0xff at character 5\)"),
    ([b"--chat", b"--system", b"caf\xe9", b"hi"], r"--system is not valid UTF-8 text \(byte 0xe9 at character 3\)"),
    ([b"--fim-suffix", b"\xc3(", b"def f():"], r"--fim-suffix is not valid UTF-8 text \(byte 0xc3 at character 0\)"),
], ids=["prompt", "system", "fim-suffix"])
def test_text_that_is_not_utf8_is_one_error_line(tiny_file, args, message):
    """It used to be `TypeError: TextInputSequence must be str` and a 32-line traceback."""
    one_error_line(run_module("generate", "--model", tiny_file, "--device", "cpu", *args), message)


def test_prompt_file_and_standard_input_give_the_same_tokens_as_the_argument(tiny_file, tmp_path):
    prompt_file = tmp_path / "prompt.py"
    prompt_file.write_text(PROMPT, encoding="utf-8")
    base = ["generate", "--model", tiny_file, "--device", "cpu", "--max-new-tokens", "6"]
    from_argument = run_module(*base, PROMPT)
    from_file = run_module(*base, "--prompt-file", str(prompt_file))
    from_stdin = run_module(*base, "--prompt-file", "-", stdin=PROMPT.encode())
    assert from_argument.returncode == 0, from_argument.stderr
    for result in (from_file, from_stdin):
        assert result.returncode == 0, result.stderr
        assert result.stdout == from_argument.stdout
        assert result.stderr.splitlines()[-1].split(b";")[0] == from_argument.stderr.splitlines()[-1].split(b";")[0]


def test_a_prompt_longer_than_the_command_line_allows(tiny_file, tmp_path):
    """Past ~128 KB an argument is refused by the OS ("Argument list too long"); a file is not."""
    prompt_file = tmp_path / "context.py"
    prompt_file.write_text("x = 1\n" * 40_000, encoding="utf-8")  # 240 KB
    result = run_module("generate", "--model", tiny_file, "--device", "cpu", "--prompt-file", str(prompt_file))
    one_error_line(result, r"the prompt is \d+ tokens, which leaves no room to generate in a context of 2048")


@pytest.mark.parametrize("setup, message", [
    (lambda d: ([str(d / "absent.txt")], None), r"--prompt-file .*absent.txt: no such file"),
    (lambda d: ([str(d)], None), r"--prompt-file .*: is a directory"),
    (lambda d: ([str(d / "latin1.txt")], b"caf\xe9 = 1\n"), r"latin1.txt is not UTF-8 text \(invalid continuation"),
    (lambda d: ([str(d / "empty.txt")], b""), r"--prompt-file .*empty.txt is empty$"),
    (lambda d: ([str(d / "blank.txt")], b" \n\t\n"), r"blank.txt is empty \(only white space\)"),
    (lambda d: (["-"], b"\xff"), r"--prompt-file - \(standard input\) is not UTF-8 text"),
    (lambda d: (["-"], b""), r"--prompt-file - \(standard input\) is empty"),
    (lambda d: ([str(d / "p.txt"), "also-an-argument"], b"x"),
     "give the prompt as PROMPT or with --prompt-file, not both"),
    (lambda d: ([""], None), r"^error: --prompt-file is an empty path; give a file, or '-' for standard input$"),
], ids=["missing", "directory", "not-utf8", "empty", "blank", "stdin-not-utf8", "stdin-empty", "both", "empty-path"])
def test_prompt_file_refusals(tiny_file, tmp_path, setup, message):
    args, content = setup(tmp_path)
    if content is not None and args[0] != "-":
        Path(args[0]).write_bytes(content)
    stdin = content if args[0] == "-" else b""
    result = run_module("generate", "--model", tiny_file, "--device", "cpu", "--prompt-file", *args, stdin=stdin)
    one_error_line(result, message)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_prompt_file_is_one_error_line(tiny_file, tmp_path):
    locked = tmp_path / "locked.txt"
    locked.write_text("x")
    locked.chmod(0)
    result = run_module("generate", "--model", tiny_file, "--device", "cpu", "--prompt-file", str(locked))
    one_error_line(result, "locked.txt: cannot read: Permission denied")


def test_no_prompt_at_all_is_one_error_line(tiny_file):
    one_error_line(run_module("generate", "--model", tiny_file, "--device", "cpu"),
                   r"no prompt: give PROMPT, or --prompt-file FILE \('-' reads standard input\)")


def rewritten(source: str, path: Path, **changes) -> str:
    """The model in `source` written again with some header or tokenizer fields changed, the way
    a file written by an older converter (or by hand) may hold them."""
    with NanoQwenFile(source) as f:
        fields = dict(lm_head_int4=f.lm_head_int4, tokenizer_json=bytes(f.tokenizer_json),
                      chat_template=f.chat_template, extra_eos_ids=f.extra_eos_ids)
        fields.update(changes)
        with NanoQwenWriter(path, f.config, **fields) as writer:
            for name in f.names:
                writer.add_tensor(name, f.tensor(name))
    return str(path)


def test_a_file_whose_chat_template_is_broken_still_completes_raw_prompts(tiny_file, reference, tmp_path):
    """Files converted before convert compiled templates may hold one that does not compile: raw and
    fill-in-the-middle generation must still work; --chat is refused with the template's error."""
    broken = rewritten(tiny_file, tmp_path / "broken-template.nanoqwen", chat_template="{% for m in messages %}")
    base = ["generate", "--model", broken, "--device", "cpu", "--max-new-tokens", "5"]
    raw = run_module(*base, PROMPT)
    assert raw.returncode == 0, raw.stderr
    ids = reference[0].encode(PROMPT, add_special_tokens=False).ids
    assert raw.stdout.decode() == reference_generation(reference, ids, SamplingParams(), 5) + "\n"
    assert run_module(*base, "--fim-suffix", "\n    return y\n", "def f(x):\n").returncode == 0
    one_error_line(run_module(*base, "--chat", "hi"), r"the chat template does not compile: .* \(line 1\)")


def test_a_tokenizer_larger_than_the_vocabulary_is_refused_by_every_command(tmp_path):
    """A file whose tokenizer has an id past config.vocab_size (a tokenizer.json from another model,
    or written by hand) is refused when it loads, by every command, with the cause: before, `info`
    described it without a word and generate refused only a prompt that reached such an id, once
    the model had loaded ("token id 4096 is outside the vocabulary")."""
    import json

    from pynanoqwen.data import EMBEDDED_MODEL

    with NanoQwenFile(EMBEDDED_MODEL) as f:
        vocab = f.config.vocab_size  # the embedded tokenizer fills it exactly
        tokenizer = json.loads(bytes(f.tokenizer_json))
    tokenizer["added_tokens"].append({"id": vocab, "content": "<|beyond|>", "single_word": False, "lstrip": False,
                                      "rstrip": False, "normalized": False, "special": True})
    beyond = rewritten(EMBEDDED_MODEL, tmp_path / "beyond.nanoqwen", tokenizer_json=json.dumps(tokenizer).encode())
    message = rf"the embedded tokenizer's ids reach {vocab} but the model's vocabulary has {vocab}"
    one_error_line(run_module("generate", "--model", beyond, "--device", "cpu", "<|beyond|>"), message)
    one_error_line(run_module("info", beyond), message)
    report = run_module("validate", "--model", beyond, "--device", "cpu", "--prompts", "1")  # a FAIL of its own
    assert report.returncode == 1 and re.search(message, report.stdout.decode()), report.stdout


def test_generation_stops_at_the_files_extra_end_of_generation_ids(tiny_file, reference, tmp_path):
    """The first greedy token of PROMPT, made an extra end-of-generation id in the header, ends the
    generation at once: nothing is printed and the summary says why."""
    raw, model, stops = reference
    ids = raw.encode(PROMPT, add_special_tokens=False).ids
    model.reset()
    first = int(np.argmax(model.forward(ids)[-1]))
    assert first not in stops
    stopping = rewritten(tiny_file, tmp_path / "extra-eos.nanoqwen", extra_eos_ids=(first,))
    result = run_module("generate", "--model", stopping, "--device", "cpu", "--max-new-tokens", "5", PROMPT)
    assert result.returncode == 0, result.stderr
    assert result.stdout == b"\n" and b"1 generated (stop token)" in result.stderr


@pytest.mark.parametrize("token", ["<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<|fim_prefix|>",
                                   "<|fim_middle|>", "<|fim_suffix|>", "<|endoftext|>"])
def test_generation_stops_at_every_end_of_generation_special_token(tokenizer, token):
    """Qwen2.5-Coder's FIM completions end with one of these; they used to be printed."""
    stop = tokenizer.token_to_id(token)
    word = tokenizer.encode(" hello")
    result = gen.generate(CpuBackend(ScriptedModel(word + [stop, 50], 2048, 64)), tokenizer, [10, 11],
                          SamplingParams(), 100, lambda text: None)
    assert result.tokens == word + [stop] and result.stop_reason == "stop token" and result.text == " hello"


def test_device_cuda_without_a_gpu_says_nothing_about_the_model_first():
    """The embedded model's status line used to come first, naming "the GPU engine", then the error."""
    if cuda_gpu_available():
        pytest.skip("a GPU is present")
    one_error_line(run_module("generate", "--device", "cuda", "def f():"),
                   r"^error: no CUDA GPU found; use --device cpu$")


@pytest.mark.parametrize("args, message", [
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["--max-new-tokens", "-5"], "--max-new-tokens must be >= 1, got -5"),
    (["--max-context", "-3"], "--max-context must be >= 2, got -3"),
    (["--top-p", "2"], r"--top-p must be in \(0, 1\], got 2.0"),
    (["--top-k", str(2**40)], "--top-k must be at most 2147483647"),
    (["--temperature", "inf"], "--temperature must be between 0 and 100"),
    (["--seed", str(2**64)], r"--seed must be in \[0, 2\^63\)"),
    (["--max-new-tokens", "many"], r"Invalid value for '--max-new-tokens': 'many' is not a valid integer; "
                                   r"see 'python -m pynanoqwen generate --help'"),
    (["--gemv", "fast"], "Invalid value for '--gemv'"),
])
def test_bad_numbers_are_one_error_line_before_the_model_loads(args, message):
    code = 2 if "Invalid value" in message else 1
    one_error_line(run_module("generate", "--device", "cpu", *args, "def f():"), message, code)


def test_a_huge_max_new_tokens_is_capped_by_the_context(tiny_file):
    result = run_module("generate", "--model", tiny_file, "--device", "cpu", "--max-context", "24",
                        "--max-new-tokens", str(10**30), PROMPT)
    assert result.returncode == 0, result.stderr
    assert re.search(rb"\d+ generated \((context full|stop token)\)", result.stderr), result.stderr

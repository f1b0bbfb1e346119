"""The embedded tiny-coder (pynanoqwen/data/tiny-coder.nanoqwen): a small valid file, exact greedy
tokens against transformers, and `generate` with no --model.

Exact tokens: 100 prompts, the first PROMPT_TOKENS tokens of functions in held-out standard
library files (pynanoqwen.data.held_out_prompts), each continued greedily for NEW_TOKENS tokens by
the numpy reference model on the shipped file and by transformers' Qwen2ForCausalLM (float64,
eager attention) holding the same dequantized weights. A trained model's predictions are peaked,
so no float32-vs-float64 rounding flips an argmax and the continuations must be identical.
"""

import os
import re
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

import pynanoqwen.data
from pynanoqwen.cli import main
from pynanoqwen.data import EMBEDDED_MODEL, corpus_files, held_out_prompts, is_held_out
from pynanoqwen.fileformat import NanoQwenFile
from pynanoqwen.tokenizer import Tokenizer
from pynanoqwen.transformers_adapter import transformers_greedy, transformers_model
from pynanoqwen.validate import reference_greedy

PROMPTS = 100
PROMPT_TOKENS = 24
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def tiny_coder():
    with NanoQwenFile(EMBEDDED_MODEL) as f:
        tokenizer = Tokenizer.from_json_bytes(f.tokenizer_json, f.chat_template, vocab_size=f.config.vocab_size)
        yield f, tokenizer


def test_shipped_file_is_small_and_a_qwen2_model(tiny_coder):
    f, tokenizer = tiny_coder
    assert EMBEDDED_MODEL.stat().st_size < 10 * 2**20
    cfg = f.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 256, 4, 2, 64)
    assert cfg.tie_word_embeddings and not f.lm_head_int4  # FP16 lm_head: exact logits, no extra bytes
    assert [tokenizer.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]


def test_held_out_prompts_come_from_held_out_files_only():
    held_out = [f for f in corpus_files() if is_held_out(f)]
    assert 0 < len(held_out) < len(corpus_files()) / 10
    prompts = held_out_prompts(lambda text: list(text.encode()), 5, 12)  # bytes as tokens
    texts = [bytes(p).decode() for p in prompts]
    assert all(t.lstrip().startswith("def ") and len(t) == 12 for t in texts), texts
    sources = [pynanoqwen.data.read_source(f) for f in held_out]
    assert all(any(t in s for s in sources) for t in texts)


def test_reference_and_transformers_give_identical_greedy_continuations(tiny_coder):
    f, tokenizer = tiny_coder
    prompts = held_out_prompts(tokenizer.encode, PROMPTS, PROMPT_TOKENS)
    assert len({tuple(p) for p in prompts}) == PROMPTS
    ours = reference_greedy(f, prompts, NEW_TOKENS)
    theirs = transformers_greedy(transformers_model(f), prompts, NEW_TOKENS)
    differing = [i for i in range(PROMPTS) if ours[i] != theirs[i]]
    assert not differing, f"prompt {differing[0]}: {ours[differing[0]]} vs {theirs[differing[0]]}"
    # The continuations are not degenerate: they vary from prompt to prompt.
    assert len({tuple(seq) for seq in ours}) > PROMPTS // 2
    assert np.mean([len(set(seq)) for seq in ours]) > 4


def test_generate_without_model_writes_python_and_names_the_embedded_model():
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "pynanoqwen", "generate", "def fibonacci(n):", "--device", "cpu",
                           "--max-new-tokens", "40"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    status = [line for line in proc.stderr.splitlines() if "embedded tiny-coder" in line]
    assert len(status) == 1 and "CPU" in status[0], proc.stderr
    code = proc.stdout
    # The function gets an indented body with Python keywords and names in it.
    assert re.match(r"\n( {4}|\t)\S", code), code
    words = set(re.findall(r"[A-Za-z_]\w*", code))
    assert len(words) >= 3 and words & {"return", "if", "for", "in", "def", "self", "n", "else", "while"}, code


def test_missing_embedded_model_is_one_error_line(monkeypatch, tmp_path):
    monkeypatch.setattr(pynanoqwen.data, "EMBEDDED_MODEL", tmp_path / "gone.nanoqwen")
    result = CliRunner().invoke(main, ["generate", "hi", "--device", "cpu"])
    assert result.exit_code == 1
    assert re.fullmatch(r"error: no --model given and the embedded model .*gone.nanoqwen is missing .*\n",
                        result.output), result.output

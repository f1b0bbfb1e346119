"""The embedded default model, tiny-coder, and the Python-source corpus it was trained and is checked on.

`tiny-coder.nanoqwen` (next to this file) is a 4-layer Qwen2 model trained by
scripts/train_tiny_coder.py on the Python standard library's own source; docs/TINY_CODER.md is
its training record. `generate` and `validate` run it when no --model is given.

The corpus is defined here, not in the training script, because four places need the same split:
the training script (train on one part, measure the held-out loss on the other), the exact-token
test (tests/test_tiny_coder.py), `validate`'s graph tier and prompt lookup's editing workload
(tests/test_prompt_lookup.py), which draw their prompts from the held-out files: code the model has
not been trained on, on every machine that has Python.
"""

from __future__ import annotations

import functools
import os
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

EMBEDDED_MODEL = Path(__file__).parent / "tiny-coder.nanoqwen"

# Test folders, `encodings` (mostly codec tables) and `pydoc_data` (one 750 kB string) are data,
# not code; site-packages is not the standard library.
SKIPPED_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "__pycache__", "encodings", "pydoc_data"})
HELD_OUT_EVERY = 25  # a file is held out when crc32(its path) % 25 == 0: about 4% of the files
CHARS_PER_TOKEN_BOUND = 40  # a prompt of n tokens is cut from at most 40 n characters of source


def stdlib_dir() -> Path:
    return Path(os.__file__).parent


def corpus_files() -> list[str]:
    """Paths (relative to the stdlib, '/'-separated, sorted) of the .py files of the corpus."""
    root = stdlib_dir()
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if not SKIPPED_DIRS & set(rel.parts[:-1]):
            files.append(rel.as_posix())
    return sorted(files)


def is_held_out(rel_path: str) -> bool:
    """Whether a corpus file is held out; a hash of the path, so the split is the same everywhere."""
    return zlib.crc32(rel_path.encode()) % HELD_OUT_EVERY == 0


def read_source(rel_path: str) -> str:
    return (stdlib_dir() / rel_path).read_text(encoding="utf-8", errors="replace")


@functools.cache
def _held_out_functions() -> tuple[tuple[str, int], ...]:
    """(source of a held-out file, offset of one of its `def` lines) for every `def` line of the
    held-out files, in file order: where held_out_prompts may start a prompt."""
    functions = []
    for rel in corpus_files():
        if not is_held_out(rel):
            continue
        text = read_source(rel)
        start = 0
        for line in text.splitlines(keepends=True):
            if line.lstrip().startswith("def "):
                functions.append((text, start))
            start += len(line)
    return tuple(functions)


def held_out_function_count() -> int:
    """How many functions the held-out files hold: the most prompts held_out_prompts can give, with
    any tokenizer and length (it gives fewer where a function's source is shorter than `length`
    tokens). The standard library of the running Python decides it; no model or tokenizer is needed."""
    return len(_held_out_functions())


def held_out_prompts(encode: Callable[[str], list[int]], count: int, length: int) -> list[list[int]]:
    """`count` prompts of exactly `length` token ids (`encode`: text -> ids): starts of held-out functions.

    Every `def` line of the held-out files, in file order, is a candidate: the source from the start
    of that line (indentation included) on, of which the first `length` tokens are kept. `count` of
    them are taken evenly spaced, so the prompts spread over all the held-out files.
    Raises ValueError when the held-out files have fewer than `count` such functions.
    """
    candidates = [text[start:start + CHARS_PER_TOKEN_BOUND * length] for text, start in _held_out_functions()]
    prompts = [ids[:length] for ids in map(encode, candidates) if len(ids) >= length]
    if len(prompts) < count:
        raise ValueError(f"the held-out standard library files hold {len(prompts)} functions of "
                         f"{length} tokens or more, fewer than the {count} prompts asked for")
    return [prompts[i] for i in np.linspace(0, len(prompts) - 1, count).round().astype(int)]


def editing_prompts(encode: Callable[[str], list[int]], count: int, source_tokens: int,
                    repeat_tokens: int) -> list[list[int]]:
    """`count` prompts of an editing workload, for prompt lookup (prompt_lookup.py): a held-out
    function's first `source_tokens` tokens, then its first `repeat_tokens` again, so that the text
    the model goes on to write is mostly already in its prompt, as when an assistant rewrites a
    file with a local change. Drawn like held_out_prompts (code the model was not trained on)."""
    if not 0 < repeat_tokens < source_tokens:
        raise ValueError(f"repeat_tokens {repeat_tokens} must be between 1 and source_tokens {source_tokens}")
    return [ids + ids[:repeat_tokens] for ids in held_out_prompts(encode, count, source_tokens)]

"""What the server tests share: the embedded model served on a free 127.0.0.1 port by a real uvicorn
server in a thread, a scripted backend that yields chosen tokens at a chosen pace, and the
`generate` path to compare the server with."""

from __future__ import annotations

import contextlib
import re
import time
from pathlib import Path

from pynanoqwen.data import EMBEDDED_MODEL
from pynanoqwen.fileformat import NanoQwenFile
from pynanoqwen.generate import CpuBackend, generate
from pynanoqwen.reference import ReferenceModel
from pynanoqwen.sampling import SamplingParams
from pynanoqwen.server.protocol import ModelInfo
from pynanoqwen.server.run import ServerThread, load_model, make_app

CONTEXT = 256  # the embedded model's whole context


def embedded(max_context: int = CONTEXT):
    """(PagedCpuBackend, ModelInfo) of the embedded model, as `serve` loads it on the CPU."""
    return load_model(Path(EMBEDDED_MODEL), "cpu", max_context, self_check=False, on_status=lambda line: None)


@contextlib.contextmanager
def serving(backend, model: ModelInfo, *, api_key=None, max_queue=8, prefix_cache=True):
    """The base URL of a server running `backend`, for the length of the with-block."""
    with ServerThread(make_app(backend, model, api_key=api_key, max_queue=max_queue,
                               prefix_cache=prefix_cache)) as server:
        yield server.url


def generate_text(model: ModelInfo, prompt_ids: list[int], max_new_tokens: int, stop_ids=None,
                  params: SamplingParams = SamplingParams()) -> tuple[str, list[int]]:
    """What `generate` streams for these prompt ids, on a fresh CPU backend: (text, tokens)."""
    backend = CpuBackend(ReferenceModel(NanoQwenFile(EMBEDDED_MODEL), max_context=model.max_context))
    tokenizer = model.tokenizer
    if stop_ids is not None:
        tokenizer = _WithStops(tokenizer, stop_ids)
    result = generate(backend, tokenizer, prompt_ids, params, max_new_tokens, on_text=lambda text: None)
    return result.text, result.tokens


class _WithStops:
    """A tokenizer whose stop ids are given (the FIM end tokens for a fill-in-the-middle)."""

    def __init__(self, tokenizer, stop_ids):
        self._tokenizer, self.stop_ids = tokenizer, stop_ids

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


class ScriptedBackend:
    """A generate.Backend that yields `script` (as far as max_new_tokens and stop ids let it), one
    token every `step_s` seconds, and counts the tokens it was asked for."""

    name = "scripted"

    def __init__(self, script: list[int], max_context: int = CONTEXT, step_s: float = 0.0):
        self.script, self.max_context, self.step_s = script, max_context, step_s
        self.prompts: list[list[int]] = []
        self.steps = 0  # tokens produced over all calls

    def generate(self, prompt_ids, params, max_new_tokens, stop_ids):
        self.prompts.append(list(prompt_ids))
        for token in self.script[:max_new_tokens]:
            time.sleep(self.step_s)
            self.steps += 1
            yield token
            if token in stop_ids:
                return


def scripted(script: list[int], step_s: float = 0.0, max_context: int = CONTEXT):
    """(ScriptedBackend, ModelInfo) with the embedded model's tokenizer."""
    _, model = embedded(max_context)
    return ScriptedBackend(script, max_context, step_s), ModelInfo("scripted", model.tokenizer, max_context,
                                                                    model.vocab_size)


def metric(text: str, name: str, **labels) -> float:
    """The value of one sample in Prometheus text (0 when absent)."""
    selector = ",".join(f'{key}="{value}"' for key, value in labels.items())
    pattern = re.escape(name) + (r"\{" + re.escape(selector) + r"\}" if labels else "") + r" (\S+)"
    found = re.search("^" + pattern + "$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0

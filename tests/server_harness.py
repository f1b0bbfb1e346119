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
from pynanoqwen.filewriter import NanoQwenWriter
from pynanoqwen.backends import CpuBackend
from pynanoqwen.generate import generate
from pynanoqwen.prompt_lookup import LookupParams
from pynanoqwen.reference import ReferenceModel
from pynanoqwen.sampling import SamplingParams
from pynanoqwen.server.protocol import ModelInfo
from pynanoqwen.server.run import ServerThread, load_model, make_app

CONTEXT = 2048  # the embedded model's whole context


def embedded(max_context: int = CONTEXT):
    """(PagedCpuBackend, ModelInfo) of the embedded model, as `serve` loads it on the CPU."""
    return load_model(Path(EMBEDDED_MODEL), "cpu", max_context, self_check=False, on_status=lambda line: None)


@contextlib.contextmanager
def serving(backend, model: ModelInfo, *, api_key=None, max_queue=8, prefix_cache=True, lookup=LookupParams()):
    """The base URL of a server running `backend`, for the length of the with-block."""
    with ServerThread(make_app(backend, model, api_key=api_key, max_queue=max_queue,
                               prefix_cache=prefix_cache, lookup=lookup)) as server:
        yield server.url


def rewritten(path: Path, **changes) -> Path:
    """The embedded model written again with some header or tokenizer fields changed, as a file
    from an older converter (or written by hand) may hold them."""
    with NanoQwenFile(EMBEDDED_MODEL) as f:
        fields = dict(lm_head_int4=f.lm_head_int4, tokenizer_json=bytes(f.tokenizer_json),
                      chat_template=f.chat_template, extra_eos_ids=f.extra_eos_ids)
        with NanoQwenWriter(path, f.config, **{**fields, **changes}) as writer:
            for name in f.names:
                writer.add_tensor(name, f.tensor(name))
    return path


def generate_text(model: ModelInfo, prompt_ids: list[int], max_new_tokens: int,
                  params: SamplingParams = SamplingParams()) -> tuple[str, list[int]]:
    """What `generate` streams for these prompt ids, on a fresh CPU backend: (text, tokens)."""
    backend = CpuBackend(ReferenceModel(NanoQwenFile(EMBEDDED_MODEL), max_context=model.max_context))
    result = generate(backend, model.tokenizer, prompt_ids, params, max_new_tokens, on_text=lambda text: None)
    return result.text, result.tokens


class ScriptedBackend:
    """A generate.Backend that yields `script` (as far as max_new_tokens and stop ids let it), one
    token every `step_s` seconds, and counts the tokens it was asked for."""

    name = "scripted"

    def __init__(self, script: list[int], max_context: int = CONTEXT, step_s: float = 0.0):
        self.script, self.max_context, self.step_s = script, max_context, step_s
        self.prompts: list[list[int]] = []
        self.steps = 0  # tokens produced over all calls

    def generate(self, prompt_ids, params, max_new_tokens, stop_ids, lookup=None):
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

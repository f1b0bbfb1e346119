"""`serve` on the GPU engine with the embedded model (skipped without an sm_90 GPU): what it sends
is what `generate` writes on the same engine, streamed or not, a dropped stream frees it, and the
prefix cache prefills only what changed and answers what a cold server answers."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from pynanoqwen.data import EMBEDDED_MODEL
from pynanoqwen.backends import load_backend
from pynanoqwen.generate import generate
from pynanoqwen.sampling import SamplingParams
from pynanoqwen.server.run import load_model
from server_harness import CONTEXT, metric, serving

pytestmark = pytest.mark.gpu
PROMPT = "def fibonacci(n):\n"


def test_serve_on_the_gpu_engine_writes_what_generate_writes():
    backend, model = load_model(Path(EMBEDDED_MODEL), "cuda", CONTEXT, self_check=True, on_status=print)
    ids = model.tokenizer.encode(PROMPT)
    direct = load_backend(Path(EMBEDDED_MODEL), "cuda", CONTEXT)
    expected = generate(direct, model.tokenizer, ids, SamplingParams(), 32, on_text=lambda text: None).text
    with serving(backend, model) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        whole = client.completions.create(model=model.id, prompt=PROMPT, max_tokens=32, temperature=0)
        chunks = client.completions.create(model=model.id, prompt=PROMPT, max_tokens=32, temperature=0, stream=True)
        assert whole.choices[0].text == expected == "".join(c.choices[0].text for c in chunks)
        body = {"model": model.id, "prompt": PROMPT, "max_tokens": CONTEXT - len(ids), "stream": True}
        with httpx.Client(base_url=url) as http:
            with http.stream("POST", "/v1/completions", json=body) as stream:
                for _ in zip(range(4), stream.iter_lines()):
                    pass
            assert client.completions.create(model=model.id, prompt=PROMPT, max_tokens=2).usage.completion_tokens
            assert metric(http.get("/metrics").text, "pynanoqwen_cancelled_requests_total", reason="disconnect") == 1


def test_the_prefix_cache_on_the_gpu_reuses_pages_and_changes_nothing():
    """An editor's keystrokes against the GPU engine: the same repository context, another
    current line. The second request prefills only the new tokens; a server without the cache
    answers it with the same tokens."""
    backend, model = load_model(Path(EMBEDDED_MODEL), "cuda", CONTEXT, self_check=False, on_status=print)
    helper = "".join(f"def helper_{i}(value):\n    return value * {i} + {i * i}\n\n" for i in range(40))
    body = {"input_prefix": "import helpers\n\n", "input_suffix": "", "n_predict": 10, "temperature": 0,
            "input_extra": [{"filename": "helpers.py", "text": helper}], "return_tokens": True}
    with serving(backend, model) as url, httpx.Client(base_url=url, timeout=60) as http:
        first = http.post("/infill", json={**body, "prompt": "x = helpers.helper_"}).json()
        second = http.post("/infill", json={**body, "prompt": "y = helpers.help"}).json()
        hits = metric(http.get("/metrics").text, "pynanoqwen_prefix_cache_hit_tokens_total")
    print(f"prompt tokens computed: {first['timings']['prompt_n']}, then {second['timings']['prompt_n']} "
          f"({second['tokens_cached']} cached)")
    assert second["tokens_cached"] >= 256 and second["timings"]["prompt_n"] < first["timings"]["prompt_n"] - 200
    assert hits == second["tokens_cached"]
    with serving(backend, model, prefix_cache=False) as url, httpx.Client(base_url=url, timeout=60) as http:
        cold = http.post("/infill", json={**body, "prompt": "y = helpers.help"}).json()
    assert cold["tokens_cached"] == 0
    assert second["tokens"] == cold["tokens"] and second["content"] == cold["content"]

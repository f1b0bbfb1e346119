"""`serve` with the embedded model on the CPU, through the official openai client and httpx, against
a real uvicorn server on a free localhost port: every endpoint, streaming, FIM, /infill with
repository context, the prefix cache, the API key, disconnects and error answers. What it sends
is compared with what `generate` makes of the same prompt."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from pynanoqwen.data import EMBEDDED_MODEL
from pynanoqwen.errors import FormatError
from pynanoqwen.fileformat import NanoQwenFile
from pynanoqwen.prompt_lookup import LookupParams
from pynanoqwen.server.prompts import infill_prompt
from pynanoqwen.server.run import load_model
from server_harness import CONTEXT, embedded, generate_text, metric, rewritten, scripted, serving

PROMPTS = ("def fibonacci(n):\n", "import os\n\n\nclass Config:\n    def __init__(self", "for i in range(10):\n")
# A file long enough that /infill prompts span many KV pages (156 tokens with the FIM layout).
HELPER = "".join(f"def helper_{i}(x):\n    return x + {i}\n\n" for i in range(8))


@pytest.fixture(scope="module")
def server():
    backend, model = embedded()
    with serving(backend, model) as url:
        yield url, model


@pytest.fixture(scope="module")
def client(server):
    url, _ = server
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server[0], timeout=60) as http:
        yield http


def test_completions_are_what_generate_writes(server, client):
    _, model = server
    for prompt in PROMPTS:
        ids = model.tokenizer.encode(prompt)
        text, tokens = generate_text(model, ids, 24)
        answer = client.completions.create(model=model.id, prompt=prompt, max_tokens=24, temperature=0)
        assert answer.choices[0].text == text
        assert answer.choices[0].finish_reason == ("stop" if len(tokens) < 24 else "length")
        assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(ids), len(tokens))
        assert answer.model == model.id and answer.object == "text_completion"


def test_a_prompt_of_token_ids(server, client):
    _, model = server
    ids = model.tokenizer.encode(PROMPTS[0])
    answer = client.completions.create(model=model.id, prompt=ids, max_tokens=8, temperature=0)
    assert answer.choices[0].text == generate_text(model, ids, 8)[0]


def test_chat_goes_through_the_chat_template(server, client):
    _, model = server
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."},
                {"role": "assistant", "content": "sorted(xs)"}, {"role": "user", "content": "In place?"}]
    ids = model.tokenizer.encode(model.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    answer = client.chat.completions.create(model=model.id, messages=messages, max_tokens=12, temperature=0)
    assert answer.choices[0].message.content == generate_text(model, ids, 12)[0]
    assert answer.choices[0].message.role == "assistant"
    assert answer.usage.prompt_tokens == len(ids)


def test_streamed_text_is_the_whole_text(server, client):
    _, model = server
    whole = client.completions.create(model=model.id, prompt=PROMPTS[1], max_tokens=20, temperature=0)
    chunks = list(client.completions.create(model=model.id, prompt=PROMPTS[1], max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens and not chunks[-1].choices
    messages = [{"role": "user", "content": "def add(a, b):"}]
    whole = client.chat.completions.create(model=model.id, messages=messages, max_tokens=15, temperature=0)
    chunks = list(client.chat.completions.create(model=model.id, messages=messages, max_tokens=15, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content


def test_seeded_sampling_repeats_and_follows_the_sampler(server, client):
    _, model = server
    ids = model.tokenizer.encode(PROMPTS[2])
    params = dict(model=model.id, prompt=PROMPTS[2], max_tokens=16, temperature=0.9, top_p=0.95, seed=1234)
    first, again = (client.completions.create(**params).choices[0].text for _ in range(2))
    assert first == again == generate_text(model, ids, 16, params=_sampling(0.9, 0, 0.95, 1234))[0]


def _sampling(temperature, top_k, top_p, seed):
    from pynanoqwen.sampling import SamplingParams

    return SamplingParams(temperature, top_k, top_p, seed)


def test_fim_with_a_suffix(server, client):
    _, model = server
    prefix, suffix = "def area(r):\n    ", "\n    return result\n"
    ids = model.tokenizer.encode(model.tokenizer.fim_prompt(prefix, suffix))
    answer = client.completions.create(model=model.id, prompt=prefix, suffix=suffix, max_tokens=20, temperature=0)
    assert answer.choices[0].text == generate_text(model, ids, 20)[0]
    assert answer.usage.prompt_tokens == len(ids)


def test_infill_lays_out_the_repository_and_answers_as_llama_cpp(server, http):
    _, model = server
    extra = [{"filename": "helpers.py", "text": HELPER}, {"text": "CONSTANT = 3\n", "time": [1, 2]}]
    body = {"input_prefix": "from helpers import helper_1\n\ndef main():\n", "input_suffix": "\n\nmain()\n",
            "input_extra": extra, "prompt": "    value = ", "n_predict": 16, "temperature": 0, "return_tokens": True}
    text = infill_prompt(body["input_prefix"], body["input_suffix"],
                         [{"filename": "helpers.py", "text": HELPER}, {"filename": "tmp", "text": "CONSTANT = 3\n"}],
                         body["prompt"])
    assert text.startswith("<|repo_name|>myproject\n<|file_sep|>helpers.py\ndef helper_0(x):")
    assert "<|file_sep|>tmp\nCONSTANT = 3\n<|file_sep|>filename\n<|fim_prefix|>from helpers" in text
    assert text.endswith("def main():\n    value = <|fim_suffix|>\n\nmain()\n<|fim_middle|>")
    ids = model.tokenizer.encode(text)
    expected, tokens = generate_text(model, ids, 16)
    answer = http.post("/infill", json=body).json()
    assert answer["content"] == expected and answer["tokens"] == tokens
    assert answer["stop"] is True and answer["stop_type"] in ("eos", "limit") and answer["truncated"] is False
    assert answer["tokens_evaluated"] == len(ids) and answer["timings"]["predicted_n"] == len(tokens)
    only = http.post("/infill", json={**body, "response_fields": ["content", "timings/prompt_n", "nope"]}).json()
    assert set(only) == {"content", "timings/prompt_n"} and only["content"] == expected


def test_streamed_infill(server, http):
    body = {"input_prefix": "def f(x):\n", "input_suffix": "\n", "n_predict": 12, "temperature": 0}
    whole = http.post("/infill", json=body).json()
    with http.stream("POST", "/infill", json={**body, "stream": True}) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    assert "".join(e["content"] for e in events) == whole["content"]
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    assert events[-1]["tokens_predicted"] == whole["tokens_predicted"]
    # With return_tokens every generated id is an event of its own as it comes (llama.cpp's
    # streamed tokens), even one whose text is not complete yet: what a client times tokens by.
    with http.stream("POST", "/infill", json={**body, "stream": True, "return_tokens": True}) as response:
        pieces = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")][:-1]
    assert [len(e["tokens"]) for e in pieces] == [1] * whole["tokens_predicted"]
    assert "".join(e["content"] for e in pieces) == whole["content"]


def test_the_prefix_cache_reuses_pages_and_changes_nothing(server, http):
    """An editor's keystrokes: the same long context, a different current line. The second
    request prefills only what changed and writes exactly what a cold server writes for it."""
    url, model = server
    body = {"input_prefix": "import helpers\n\n", "input_suffix": "", "input_extra": [{"filename": "h.py",
                                                                                      "text": HELPER}],
            "n_predict": 10, "temperature": 0, "return_tokens": True}
    before = http.get("/metrics").text
    first = http.post("/infill", json={**body, "prompt": "x = helpers.helper_"}).json()
    second = http.post("/infill", json={**body, "prompt": "y = helpers.help"}).json()
    assert second["tokens_cached"] >= 128 and second["timings"]["prompt_n"] < first["timings"]["prompt_n"] - 100
    assert second["timings"]["cache_n"] == second["tokens_cached"]
    backend, model = embedded()
    with serving(backend, model) as cold_url, httpx.Client(base_url=cold_url, timeout=60) as cold:
        cold_answer = cold.post("/infill", json={**body, "prompt": "y = helpers.help"}).json()
    assert cold_answer["tokens_cached"] == 0
    assert second["tokens"] == cold_answer["tokens"] and second["content"] == cold_answer["content"]
    after = http.get("/metrics").text
    hits = metric(after, "pynanoqwen_prefix_cache_hit_tokens_total") - metric(before,
                                                                             "pynanoqwen_prefix_cache_hit_tokens_total")
    assert hits == second["tokens_cached"]
    assert 0 < metric(after, "pynanoqwen_prefix_cache_hit_rate") <= 1


def test_openai_usage_reports_cached_tokens(server, client):
    _, model = server
    prompt = HELPER + "def main():\n"
    client.completions.create(model=model.id, prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=model.id, prompt=prompt, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16 * ((again.usage.prompt_tokens - 1) // 16) - 16


def test_models_health_metrics_and_the_published_schema(server, client, http):
    _, model = server
    assert [m.id for m in client.models.list().data] == [model.id]
    assert client.models.retrieve(model.id).id == model.id
    assert http.get("/health").json() == {"status": "ok"}
    schema = http.get("/openapi.json").json()
    assert set(schema["paths"]) >= {"/v1/completions", "/v1/chat/completions", "/infill", "/v1/models"}
    assert "input_extra" in schema["paths"]["/infill"]["post"]["requestBody"]["content"]["application/json"][
        "schema"]["properties"]
    text = http.get("/metrics").text
    assert metric(text, "pynanoqwen_requests_total", endpoint="/v1/completions", status="200") >= 1
    assert metric(text, "pynanoqwen_time_to_first_token_seconds_count") >= 1
    assert metric(text, "pynanoqwen_time_to_start_seconds_count") >= 1
    assert metric(text, "pynanoqwen_time_to_start_seconds_sum") > 0
    assert metric(text, "pynanoqwen_inter_token_latency_seconds_count") >= 1
    assert metric(text, "pynanoqwen_generated_tokens_total") >= 1


def test_a_client_that_disconnects_mid_stream_frees_the_engine(server, http):
    url, model = server
    before = metric(http.get("/metrics").text, "pynanoqwen_cancelled_requests_total", reason="disconnect")
    body = {"model": model.id, "prompt": "def f():\n", "max_tokens": CONTEXT - 8, "temperature": 0, "stream": True}
    with httpx.Client(base_url=url, timeout=60) as other, other.stream("POST", "/v1/completions", json=body) as stream:
        for _ in zip(range(3), stream.iter_lines()):
            pass
    answer = http.post("/v1/completions", json={"model": model.id, "prompt": "x = 1\n", "max_tokens": 2})
    assert answer.status_code == 200
    assert metric(http.get("/metrics").text, "pynanoqwen_cancelled_requests_total", reason="disconnect") == before + 1


@pytest.mark.parametrize("path, body, status, param, code", [
    ("/v1/completions", {"prompt": "x"}, 400, "model", "missing_field"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model", "model_not_found"),
    ("/v1/completions", {"model": "M", "prompt": "x", "max_tokens": "8"}, 400, "max_tokens", "invalid_type"),
    ("/v1/completions", {"model": "M", "prompt": "x", "temperature": 3}, 400, "temperature", "invalid_value"),
    ("/v1/completions", {"model": "M", "prompt": "x", "frobnicate": 1}, 400, "frobnicate", "unknown_field"),
    ("/v1/completions", {"model": "M", "prompt": "x", "n": 2}, 400, "n", "unsupported_value"),
    ("/v1/completions", {"model": "M", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop",
     "invalid_value"),
    ("/v1/completions", {"model": "M", "prompt": [1, 999999]}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {"model": "M", "prompt": ""}, 400, "prompt", "empty_prompt"),
    ("/v1/completions", {"model": "M", "prompt": "x\ud800"}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {"model": "M", "prompt": "x", "max_tokens": CONTEXT + 144}, 400, "max_tokens",
     "context_length_exceeded"),
    ("/v1/completions", {"model": "M", "prompt": "word " * (CONTEXT + 44)}, 400, "prompt", "context_length_exceeded"),
    ("/v1/chat/completions", {"model": "M", "messages": []}, 400, "messages", "invalid_value"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages[0].role", "invalid_value"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": 5}]}, 400,
     "messages[0].content", "invalid_type"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function"}]}, 400, "tools", "unsupported_value"),
    ("/infill", {"input_prefix": "x"}, 400, "input_suffix", "missing_field"),
    ("/infill", {"input_prefix": "x", "input_suffix": "", "input_extra": [{"filename": "a"}]}, 400,
     "input_extra[0].text", "missing_field"),
    ("/infill", {"input_prefix": "x", "input_suffix": "", "input_extra": {"text": "a"}}, 400, "input_extra",
     "invalid_type"),
    ("/infill", {"input_prefix": "x", "input_suffix": "", "n_predict": CONTEXT + 44}, 400, "n_predict",
     "context_length_exceeded"),
    ("/infill", {"input_prefix": "x", "input_suffix": "", "repeat_penalty": 1.1}, 400, "repeat_penalty",
     "unknown_field"),
    ("/infill", {"input_prefix": "x", "input_suffix": "", "input_extra": [{"text": "y = 1\n" * 4000}]}, 400,
     "input_prefix", "context_length_exceeded"),  # a body parsed on a worker thread
    # These were 500s: a top_k beyond int32 (SamplingParams refused it), a number beyond any double.
    ("/v1/completions", {"model": "M", "prompt": "x", "top_k": 2**31}, 400, "top_k", "invalid_value"),
    ("/infill", {"input_prefix": "x", "input_suffix": "", "top_k": 2**40}, 400, "top_k", "invalid_value"),
    ("/v1/completions", {"model": "M", "prompt": "x", "temperature": 10**400}, 400, "temperature", "invalid_value"),
    ("/v1/completions", {"model": "M", "prompt": "x", "presence_penalty": 10**400}, 400, "presence_penalty",
     "invalid_value"),
    ("/v1/completions", {"model": "M", "prompt": "x", "logit_bias": {"7": -10**400}}, 400, "logit_bias.7",
     "invalid_value"),
    # These were 500s: an error naming a key that is half a character, which UTF-8 cannot encode.
    ("/v1/completions", {"model": "M", "prompt": "x", "\ud800": 1}, 400, "\ud800", "unknown_field"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x", "\udc80": 1}]}, 400,
     "messages[0].\udc80", "unknown_field"),
    ("/v1/completions", {"model": "M", "prompt": "x", "logit_bias": {"\udfff": "x"}}, 400, "logit_bias.\udfff",
     "invalid_type"),
    # The error named max_tokens (1 here) when max_completion_tokens was the one too large.
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
                              "max_completion_tokens": CONTEXT + 144}, 400, "max_completion_tokens",
     "context_length_exceeded"),
    # stream_options without stream was ignored (no usage event can come); OpenAI refuses it.
    ("/v1/completions", {"model": "M", "prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options", "invalid_value"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}], "stream": False,
                              "stream_options": {"include_usage": True}}, 400, "stream_options", "invalid_value"),
])
def test_bad_requests_get_openai_errors(server, http, path, body, status, param, code):
    _, model = server
    if body.get("model") == "M":
        body = {**body, "model": model.id}
    answer = http.post(path, content=json.dumps(body))  # ASCII JSON: "\ud800" stays an escape
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert (error["param"], error["code"]) == (param, code) and error["message"] and error["type"]


def test_an_infill_of_no_tokens_only_runs_the_prompt(http):
    """llama.vim's cache warm-up (n_predict 0) generated until the context was full, then was a 500."""
    answer = http.post("/infill", json={"input_prefix": "def f(x):\n", "input_suffix": "\n", "n_predict": 0})
    assert answer.status_code == 200, answer.text
    assert (answer.json()["content"], answer.json()["tokens_predicted"]) == ("", 0)


def test_context_errors_say_by_how_much(server, http):
    _, model = server
    answer = http.post("/v1/completions", json={"model": model.id, "prompt": "x = 1", "max_tokens": CONTEXT + 44}).json()
    n = len(model.tokenizer.encode("x = 1"))
    assert f"{n + 44} too many" in answer["error"]["message"]


@pytest.mark.parametrize("method, path, content, status", [
    ("POST", "/v1/completions", b"{not json", 400),
    ("POST", "/v1/completions", b'{"model": NaN}', 400),
    ("POST", "/v1/completions", b"\xff\xfe\x00", 400),
    ("POST", "/v1/completions", b"[" * 100000, 400),
    ("POST", "/v1/completions", b'{"model": "x", "prompt": "x", "temperature": 1e400}', 400),
    ("POST", "/v1/completions", b"x" * (16 * 2**20 + 1), 413),
    ("GET", "/v1/completions", b"", 405),
    ("GET", "/nowhere", b"", 404),
])
def test_malformed_requests_are_json_errors(http, method, path, content, status):
    answer = http.request(method, path, content=content)
    assert answer.status_code == status
    assert answer.json()["error"]["message"]


def test_a_405_says_which_methods_are_allowed(http):
    """HTTP requires Allow with a 405 (RFC 9110, 15.5.6); the JSON error had dropped Starlette's."""
    for method, path, allowed in (("GET", "/v1/completions", {"POST"}), ("DELETE", "/health", {"GET", "HEAD"}),
                                  ("PUT", "/v1/models", {"GET", "HEAD"})):
        answer = http.request(method, path)
        assert answer.status_code == 405 and answer.json()["error"]["message"]
        assert {m.strip() for m in answer.headers["allow"].split(",")} == allowed


def test_a_stray_trailing_slash_is_a_json_404_naming_the_path(http):
    """Starlette answered /v1/completions/ with a 307 and an empty body, which a client may not
    follow for a POST; now a JSON 404 whose message names the path without the slash."""
    for method, path in (("POST", "/v1/completions/"), ("GET", "/health/"), ("POST", "/infill/")):
        answer = http.request(method, path, follow_redirects=False, json={})
        assert answer.status_code == 404, (path, answer.status_code)
        assert f"did you mean {path.rstrip('/')}?" in answer.json()["error"]["message"]
    answer = http.get("/nowhere/")
    assert answer.status_code == 404 and "did you mean" not in answer.json()["error"]["message"]


def test_the_api_key():
    backend, model = embedded()
    with serving(backend, model, api_key="sesame") as url, httpx.Client(base_url=url) as http:
        assert http.get("/health").status_code == 200
        missing, wrong = http.get("/v1/models"), http.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert (missing.status_code, missing.json()["error"]["code"]) == (401, "missing_api_key")
        assert (wrong.status_code, wrong.json()["error"]["code"]) == (401, "invalid_api_key")
        assert missing.headers["www-authenticate"] == "Bearer"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()
        good = openai.OpenAI(base_url=url + "/v1", api_key="sesame", max_retries=0)
        assert good.completions.create(model=model.id, prompt="x", max_tokens=2).choices[0].finish_reason


def test_a_model_whose_chat_template_does_not_compile_still_completes(tmp_path):
    """Files converted before convert checked templates may hold one that does not compile."""
    path = rewritten(tmp_path / "broken-template.nanoqwen", chat_template="{% for m in messages %}")
    lines = []
    backend, model = load_model(path, "cpu", CONTEXT, self_check=False, on_status=lines.append)
    assert lines[0].startswith("warning: the chat template does not compile")
    with serving(backend, model) as url, httpx.Client(base_url=url, timeout=60) as http:
        chat = http.post("/v1/chat/completions", json={"model": model.id, "messages": [{"role": "user",
                                                                                       "content": "x"}]})
        assert (chat.status_code, chat.json()["error"]["code"]) == (501, "chat_template_error")
        answer = http.post("/v1/completions", json={"model": model.id, "prompt": PROMPTS[0], "max_tokens": 4,
                                                    "temperature": 0})
        assert answer.json()["choices"][0]["text"] == generate_text(model, model.tokenizer.encode(PROMPTS[0]), 4)[0]


def test_messages_a_chat_template_refuses_are_a_400(tmp_path):
    """A template that calls raise_exception on some conversations (many do: "roles must alternate")
    made such a request a 500 with a traceback in the server log; it is the request's fault."""
    template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('the first message must be the user\\'s') }}"
                "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "<|im_start|>assistant\n")
    path = rewritten(tmp_path / "raising-template.nanoqwen", chat_template=template)
    backend, model = load_model(path, "cpu", CONTEXT, self_check=False, on_status=lambda line: None)
    with serving(backend, model) as url, httpx.Client(base_url=url, timeout=60) as http:
        for stream in (False, True):
            refused = http.post("/v1/chat/completions", json={"model": model.id, "stream": stream,
                                                              "messages": [{"role": "system", "content": "x"}]})
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"] == {"message": "The chat template failed: the first message must be the "
                                                          "user's.", "type": "invalid_request_error",
                                               "param": "messages", "code": "chat_template_failed"}
        answer = http.post("/v1/chat/completions", json={"model": model.id, "max_tokens": 2,
                                                         "messages": [{"role": "user", "content": "x"}]})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2


def test_prompt_lookup_serves_the_same_tokens_and_counts_its_drafts(server, http):
    """serve --prompt-lookup 6: greedy answers token for token those of the server without it, on
    requests whose context holds what they write (HELPER's repeated functions), with the prefix
    cache on; /metrics counts the drafted and accepted tokens."""
    plain_url, model = server
    bodies = [{"input_prefix": HELPER + "def helper_8(x):\n", "input_suffix": "", "prompt": "    return x + ",
               "n_predict": 24, "temperature": 0, "return_tokens": True},
              {"input_prefix": "import helpers\n\n", "input_suffix": "", "prompt": "def helper_",
               "input_extra": [{"filename": "h.py", "text": HELPER}], "n_predict": 24, "temperature": 0,
               "return_tokens": True}]
    backend, _ = embedded()
    with serving(backend, model, lookup=LookupParams(6)) as url, httpx.Client(base_url=url, timeout=60) as looked_up:
        for body in bodies:
            assert looked_up.post("/infill", json=body).json()["tokens"] == http.post("/infill", json=body).json()["tokens"]
        scraped = looked_up.get("/metrics").text
    drafted = metric(scraped, "pynanoqwen_prompt_lookup_drafted_tokens_total")
    assert 0 < metric(scraped, "pynanoqwen_prompt_lookup_accepted_tokens_total") <= drafted


def test_a_tokenizer_beyond_the_model_vocabulary_is_refused_at_load_and_token_ids_beyond_it_are_a_400(tmp_path):
    """A file whose tokenizer.json has a token past vocab_size (convert refuses such a tokenizer; a
    file written otherwise may hold one) is not served: text could encode to ids the weights lack
    (once a 500 from the engine). A prompt of token ids past the vocabulary is the client's error."""
    with NanoQwenFile(EMBEDDED_MODEL) as f:
        tokenizer_json = json.loads(bytes(f.tokenizer_json))
        vocab_size = f.config.vocab_size
    tokenizer_json["added_tokens"].append({"id": vocab_size, "content": "<|beyond|>", "single_word": False,
                                           "lstrip": False, "rstrip": False, "normalized": False, "special": True})
    path = rewritten(tmp_path / "beyond.nanoqwen", tokenizer_json=json.dumps(tokenizer_json).encode())
    with pytest.raises(FormatError, match=f"the embedded tokenizer's ids reach {vocab_size} but the model's "
                                          f"vocabulary has {vocab_size}"):
        load_model(path, "cpu", CONTEXT, self_check=False, on_status=lambda line: None)
    backend, model = load_model(EMBEDDED_MODEL, "cpu", CONTEXT, self_check=False, on_status=lambda line: None)
    with serving(backend, model) as url, httpx.Client(base_url=url, timeout=60) as http:
        refused = http.post("/v1/completions", json={"model": model.id, "prompt": [5, vocab_size]})
        assert refused.status_code == 400, refused.text
        assert (refused.json()["error"]["param"], refused.json()["error"]["code"]) == ("prompt", "invalid_value")
        assert f"Token id {vocab_size} is outside the vocabulary" in refused.json()["error"]["message"]
        answer = http.post("/v1/completions", json={"model": model.id, "prompt": "x", "max_tokens": 2})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2


def test_small_bodies_are_parsed_on_the_event_loop_and_large_ones_on_a_worker_thread(monkeypatch):
    """Each route has its parser bound when the app is built (no URL parsed to find it). A body of
    up to PARSE_IN_THREAD_BYTES is checked and tokenized on the event loop, which saves a thread hop
    from the time to first token; a larger one on a worker thread, so the loop keeps serving."""
    from pynanoqwen.server import app, protocol

    parse, on_loop = protocol.ENDPOINTS["/infill"][1], []

    def recording(body, model):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return parse(body, model)

    monkeypatch.setitem(protocol.ENDPOINTS, "/infill", (protocol.INFILL, recording))
    backend, model = scripted([300])
    with serving(backend, model) as url, httpx.Client(base_url=url, timeout=60) as http:
        statuses = [http.post("/infill", json={"input_prefix": prefix, "input_suffix": "", "n_predict": 1}).status_code
                    for prefix in ("x = 1\n", "x = 1\n" * (app.PARSE_IN_THREAD_BYTES // 6))]
    assert on_loop == [True, False]
    assert statuses == [200, 400]  # the large prefix is more tokens than the context holds

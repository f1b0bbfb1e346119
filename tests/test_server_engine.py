"""The server's engine behaviour, with a scripted backend that yields chosen tokens at a chosen pace:
stop tokens and stop strings on the detokenized stream, llama.cpp's n_indent and t_max_predict_ms,
cancellation within a decode step, the bounded queue, superseded /infill requests, and a backend
that fails."""

from __future__ import annotations

import concurrent.futures
import json
import re
import time

import httpx

from pynanoqwen.server.run import model_info
from server_harness import metric, rewritten, scripted, serving

STEP_S = 0.05  # one scripted decode step: long enough to tell "stopped" from "kept going"


def ids(model, *texts):
    return [token for text in texts for token in model.tokenizer.encode(text)]


def wait_until(condition, timeout_s=30.0):
    deadline = time.perf_counter() + timeout_s
    while not condition():
        assert time.perf_counter() < deadline, "timed out"
        time.sleep(0.005)


def queued(url):
    with httpx.Client(base_url=url) as http:
        return metric(http.get("/metrics").text, "pynanoqwen_queued_requests")


def complete(url, model, **body):
    with httpx.Client(base_url=url, timeout=60) as http:
        return http.post("/v1/completions", json={"model": model.id, "prompt": "x", "max_tokens": 64, **body})


def test_a_stop_string_split_across_tokens_is_caught_and_not_sent():
    backend, model = scripted([])
    backend.script = ids(model, "foo", "\n", "\n", "bar")  # "\n\n" arrives as two tokens
    assert len(backend.script) == 4
    with serving(backend, model) as url:
        whole = complete(url, model, stop=["\n\n"]).json()
        body = {"model": model.id, "prompt": "x", "stop": "\n\n", "stream": True}
        with httpx.Client(base_url=url) as http, http.stream("POST", "/v1/completions", json=body) as r:
            pieces = [json.loads(line[6:])["choices"] for line in r.iter_lines() if line.startswith("data: {")]
    assert whole["choices"][0] == {"index": 0, "text": "foo", "logprobs": None, "finish_reason": "stop"}
    sent = "".join(choice[0]["text"] for choice in pieces if choice)
    assert sent == "foo"


def test_end_of_generation_tokens_end_the_text_on_every_endpoint(tmp_path):
    backend, model = scripted([])
    tokenizer = model.tokenizer
    for end in ("<|endoftext|>", "<|im_end|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>"):
        backend.script = ids(model, "a = 1") + [tokenizer.token_to_id(end)] + ids(model, "junk")
        with serving(backend, model) as url, httpx.Client(base_url=url) as http:
            infill = http.post("/infill", json={"input_prefix": "", "input_suffix": "", "n_predict": 20}).json()
            chat = http.post("/v1/chat/completions", json={"model": model.id, "messages": [
                {"role": "user", "content": "x"}]}).json()["choices"][0]
            for choice in (complete(url, model, suffix="\n").json()["choices"][0],
                           complete(url, model).json()["choices"][0]):
                assert (choice["text"], choice["finish_reason"]) == ("a = 1", "stop")
        assert (infill["content"], infill["stop_type"]) == ("a = 1", "eos")
        assert (chat["message"]["content"], chat["finish_reason"]) == ("a = 1", "stop")
    # A file's own end-of-generation ids (generation_config.json's eos_token_id list) too.
    path = rewritten(tmp_path / "extra-eos.nanoqwen", extra_eos_ids=(ids(model, " junk")[0],))
    model = model_info(path, 256)
    backend.script = ids(model, "a = 1", " junk", " more")
    with serving(backend, model) as url:
        assert complete(url, model).json()["choices"][0]["text"] == "a = 1"
    backend.script = ids(model, "done") + [tokenizer.token_to_id("<|endoftext|>")] + ids(model, "junk")
    with serving(backend, model) as url:
        answer = complete(url, model).json()
    # The stop token counts as generated: it was computed.
    assert answer["choices"][0]["text"] == "done"
    assert answer["usage"]["completion_tokens"] == len(ids(model, "done")) + 1


def test_n_indent_ends_at_an_outdented_line():
    backend, model = scripted([])
    backend.script = ids(model, "x = 1\n", "    y = 2\n", "  ", "z = 3\n")
    with serving(backend, model) as url, httpx.Client(base_url=url) as http:
        answer = http.post("/infill", json={"input_prefix": "", "input_suffix": "", "n_indent": 4}).json()
    assert answer["content"] == "x = 1\n    y = 2\n  " and answer["stop_type"] == "limit"


def test_t_max_predict_ms_ends_at_a_line_break_after_the_time():
    backend, model = scripted([], step_s=STEP_S)
    backend.script = ids(model, *["a" * 3, "\n"] * 20)
    with serving(backend, model) as url, httpx.Client(base_url=url, timeout=60) as http:
        answer = http.post("/infill", json={"input_prefix": "", "input_suffix": "", "t_max_predict_ms": 200}).json()
    lines = answer["content"].count("\n")
    # 200 ms is 4 steps after the first token: the line break at the 6th token ends it.
    assert answer["stop_type"] == "limit" and answer["content"].endswith("\n") and 2 <= lines <= 5


def test_a_disconnect_stops_generation_within_a_step_and_the_next_request_is_served_at_once():
    backend, model = scripted([], step_s=STEP_S)
    backend.script = ids(model, "tok ") * 200  # 10 s of generation
    with serving(backend, model) as url:
        with httpx.Client(base_url=url, timeout=60) as http, http.stream(
                "POST", "/v1/completions",
                json={"model": model.id, "prompt": "x", "max_tokens": 200, "stream": True}) as stream:
            lines = stream.iter_lines()
            while not next(lines).startswith("data: "):
                pass
        start = time.perf_counter()
        steps_at_disconnect = backend.steps
        assert complete(url, model, max_tokens=1).status_code == 200
        served_in = time.perf_counter() - start
        with httpx.Client(base_url=url) as http:
            text = http.get("/metrics").text
    # The cancelled request ran at most a few more steps: the next one waited for those alone.
    assert backend.steps - steps_at_disconnect <= 5
    assert served_in < 20 * STEP_S  # not the 10 s the cancelled request had left
    assert metric(text, "pynanoqwen_cancelled_requests_total", reason="disconnect") == 1
    assert metric(text, "pynanoqwen_cancel_latency_seconds_sum") < 5 * STEP_S


def test_a_full_queue_is_503_with_retry_after():
    backend, model = scripted([], step_s=STEP_S)
    backend.script = ids(model, "tok ") * 20  # one second each
    with serving(backend, model, max_queue=1) as url, concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = pool.submit(complete, url, model, max_tokens=20)
        wait_until(lambda: backend.steps > 0)
        waiting = pool.submit(complete, url, model, max_tokens=20)
        wait_until(lambda: queued(url) == 1)
        refused = complete(url, model, max_tokens=20)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "queue_full"
        assert running.result().status_code == 200 and waiting.result().status_code == 200


def test_a_newer_infill_from_the_same_client_supersedes_the_older():
    backend, model = scripted([], step_s=STEP_S)
    backend.script = ids(model, "tok ") * 100  # 5 s
    body = {"input_prefix": "", "input_suffix": "", "n_predict": 100}

    def infill(agent, **extra):
        with httpx.Client(base_url=url, timeout=60, headers={"User-Agent": agent}) as http:
            return http.post("/infill", json={**body, **extra})

    with serving(backend, model) as url, concurrent.futures.ThreadPoolExecutor(3) as pool:
        old = pool.submit(infill, "editor")
        wait_until(lambda: backend.steps > 0)
        other = pool.submit(infill, "another editor", n_predict=3)  # queued behind: not superseded
        wait_until(lambda: queued(url) == 1)
        warm = pool.submit(infill, "editor", n_predict=0)  # a cache warm-up supersedes nothing
        wait_until(lambda: queued(url) == 2)
        start = time.perf_counter()
        new = infill("editor", n_predict=2)
        waited = time.perf_counter() - start
        old = old.result()
        assert (old.status_code, old.json()["error"]["code"]) == (409, "superseded")
        assert new.status_code == 200 and new.json()["tokens_predicted"] == 2
        assert other.result().status_code == 200 and warm.result().status_code == 200
    assert waited < 30 * STEP_S  # not the 5 s the old one would have taken


class FailingBackend:
    name, max_context = "failing", 256

    def generate(self, prompt_ids, params, max_new_tokens, stop_ids, lookup=None):
        yield 300  # an ordinary token, then the failure
        raise RuntimeError("a bug in the engine")


def test_a_failing_backend_is_a_500_and_the_server_keeps_serving(capfd):
    _, model = scripted([])
    with serving(FailingBackend(), model) as url, httpx.Client(base_url=url) as http:
        for _ in range(2):
            answer = complete(url, model)
            assert answer.status_code == 500 and answer.json()["error"]["code"] == "engine_error"
        with http.stream("POST", "/v1/completions", json={"model": model.id, "prompt": "x", "stream": True}) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert json.loads(events[-1][6:])["error"]["code"] == "engine_error"
        assert http.get("/health").status_code == 200
    assert "a bug in the engine" in capfd.readouterr().err


def test_with_no_queue_an_idle_server_still_serves():
    backend, model = scripted([])
    backend.script = ids(model, "ok")
    with serving(backend, model, max_queue=0) as url:
        assert complete(url, model).json()["choices"][0]["text"] == "ok"


def test_the_gpu_engine_compiles_every_prefill_graph_before_serving(monkeypatch):
    """load_model asks the engine (here a stand-in with its prefill_buckets and prepare) for every
    prompt length whose chunks use a bucket: each bucket as the last chunk, the longest inside."""
    from pathlib import Path

    from pynanoqwen.data import EMBEDDED_MODEL
    from pynanoqwen.server import run

    class Engine:
        prefill_buckets = (16, 32, 64)

        def __init__(self, path, device, max_context):
            self.prepared = []

        def prepare(self, prompt_tokens, params):
            self.prepared.append((prompt_tokens, params.greedy))

    monkeypatch.setattr(run, "load_backend", Engine)
    for max_context, lengths in ((256, [16, 32, 64, 65]), (48, [16, 32, 47])):
        status = []
        engine, _ = run.load_model(Path(EMBEDDED_MODEL), "cuda", max_context, self_check=False,
                                   on_status=status.append)
        assert engine.prepared == [(n, greedy) for n in lengths for greedy in (True, False)]
        # The long step says how much it will do and how long it took.
        assert f"compiling the prefill graphs: {len(lengths)} prompt lengths, greedy and sampled" in status
        assert re.fullmatch(r"prefill graphs ready in \d+\.\d s", status[-1])


def test_after_a_streamed_jobs_first_event_the_engine_waits_until_the_response_wrote_it(monkeypatch):
    """The worker resumes the backend after a streamed job's first event only once the response has
    set job.first_sent (or scheduler.FIRST_EVENT_WAIT_S has passed), so that the event loop writes
    that event with the GIL to itself; for a job that is not streamed it does not wait."""
    import asyncio

    from pynanoqwen.sampling import SamplingParams
    from pynanoqwen.server import scheduler as engine
    from pynanoqwen.server.metrics import Metrics

    monkeypatch.setattr(engine, "FIRST_EVENT_WAIT_S", 30.0)  # only first_sent ends the wait in time
    _, model = scripted([])

    class Backend:
        name, max_context = "two tokens", model.max_context
        resumed = 0.0  # when the worker asked for the second token

        def generate(self, prompt_ids, params, max_new_tokens, stop_ids, lookup=None):
            yield 300
            self.resumed = time.perf_counter()
            yield 301

    async def run(streamed: bool) -> tuple[float, float]:
        backend = Backend()
        scheduler = engine.Scheduler(backend, model.tokenizer, Metrics(None), 8, None)
        scheduler.start()
        try:
            request = engine.GenerationRequest([1, 2], SamplingParams(), 2, frozenset(), every_token=True)
            job = scheduler.submit(request, time.perf_counter(), streamed=streamed)
            assert isinstance(await job.events.get(), engine.Text)
            if streamed:
                await asyncio.sleep(0.2)  # the response writing the event
                written = time.perf_counter()
                job.first_sent.set()
            else:
                written = time.perf_counter()
            while not isinstance(await asyncio.wait_for(job.events.get(), 10), engine.Done):
                pass
            return written, backend.resumed
        finally:
            scheduler.stop()

    written, resumed = asyncio.run(run(streamed=True))
    assert resumed >= written
    asyncio.run(run(streamed=False))  # done within 10 s: no 30 s wait


def test_a_job_submitted_to_an_idle_worker_has_started_when_submit_returns(monkeypatch):
    """submit waits (at most scheduler.START_WAIT_S) until an idle worker has taken the job, so the
    engine starts before the event loop writes the response's headers; behind a running job it
    does not wait, and the job waits in the queue."""
    import asyncio
    import threading

    from pynanoqwen.sampling import SamplingParams
    from pynanoqwen.server import scheduler as engine
    from pynanoqwen.server.metrics import Metrics

    monkeypatch.setattr(engine, "START_WAIT_S", 30.0)  # only the worker taking the job ends the wait in time
    _, model = scripted([])
    release = threading.Event()

    class Backend:
        name, max_context = "held", model.max_context

        def generate(self, prompt_ids, params, max_new_tokens, stop_ids, lookup=None):
            release.wait(10)
            yield 300

    async def run():
        scheduler = engine.Scheduler(Backend(), model.tokenizer, Metrics(None), 8, None)
        scheduler.start()
        try:
            request = engine.GenerationRequest([1, 2], SamplingParams(), 1, frozenset())
            began = time.perf_counter()
            first = scheduler.submit(request, began)
            assert first.state == "running" and time.perf_counter() - began < 10
            second = scheduler.submit(request, time.perf_counter())
            assert second.state == "queued"
            release.set()
            for job in (first, second):
                while not isinstance(await asyncio.wait_for(job.events.get(), 10), engine.Done):
                    pass
        finally:
            release.set()
            scheduler.stop()

    asyncio.run(run())


def test_a_bug_in_a_route_is_a_500_and_the_server_keeps_serving(capfd, monkeypatch):
    """A generation POST bypasses Starlette's middleware (app.GenerationRoute); an exception in its
    route must still be OpenAI's error JSON with a 500, the traceback must reach the log, and the
    server must serve the next request."""
    from pynanoqwen.server import protocol

    def broken(body, model):
        raise RuntimeError("a bug in the route")

    monkeypatch.setitem(protocol.ENDPOINTS, "/infill", (protocol.INFILL, broken))
    backend, model = scripted([])
    backend.script = ids(model, "ok")
    with serving(backend, model) as url, httpx.Client(base_url=url) as http:
        for _ in range(2):
            answer = http.post("/infill", json={"input_prefix": "x"})
            assert answer.status_code == 500 and answer.json()["error"]["code"] == "internal_error"
        assert complete(url, model).json()["choices"][0]["text"] == "ok"
    assert "a bug in the route" in capfd.readouterr().err

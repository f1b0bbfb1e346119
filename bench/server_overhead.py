"""What the server alone adds to a request, with a backend that costs nothing; no GPU needed.

    python bench/server_overhead.py [--requests 150] [--prompt-tokens 512] [--prefill-ms 0 --launch-us 0]
                                    [--route infill|completions]

The app `serve` runs, on a real uvicorn server in this process (server.run.ServerThread), over a
backend that yields its tokens at once (letting other threads run after each): every millisecond
the client waits for the first event of a streamed /infill (return_tokens, so each id is an
event) is the HTTP stack's, the route's (parsing, the prompt, tokenizing it), the hand-offs to
the engine thread and back, and httpx's. The client (httpx, as bench/server_latency.py's) runs in
a child process, as the real bench's does: in this process it would take the GIL from the
server's threads.

Prints the medians of `--requests` timed requests of each kind, after WARM_UP untimed ones:
GET /health's round trip; the first event of a short /infill at n_predict 1 and 16, and the gap
between events; and the first event of a cold /infill at n_predict 1, in its phases. That prompt
is bench/server_latency.py's (prompt_of, with its --prompt-tokens: 512 makes the same ~522-token
/infill prompt as its 7B figure): every line names the request, so no chunk of the tokenizer's
cache serves it and the route tokenizes every token (--route completions: the same text as the
prompt of a streamed /v1/completions, max_tokens 1, instead). Its phases, from the stamps the
server puts in /metrics (read between requests, as bench/server_latency.py does) and the
backend's stamp of its first token, on the same clock as the client's (time.perf_counter,
CLOCK_MONOTONIC on Linux):
- send -> route: httpx sending, the kernel, uvicorn and Starlette up to the route's first line;
- route -> job start: pynanoqwen_time_to_start_seconds (the body, its schema, the prompt,
  tokenizing it, the hand-off to the engine thread);
- job start -> first token: the rest of pynanoqwen_time_to_first_token_seconds (the backend's
  prefill: ~0, or --prefill-ms);
- first token -> first event: from the backend yielding the token to the client reading its event
  (the hand-off to the event loop, detokenizing, the event's JSON, the write, httpx's read).
Two options make the backend more like the engine. --prefill-ms: it sleeps that long (GIL
released) before its first token, as the engine waits for the GPU's prefill; the server then
writes the response's headers meanwhile, as it does at 7B, instead of between the first token
and its event. --launch-us: after each token it runs Python for that long, holding the GIL, as the
engine thread does while it launches its next step; the event loop then competes with it for the
GIL to send the event (scheduler.FIRST_EVENT_WAIT_S). bench/server_latency.py measures the same
overhead against a real engine.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

WARM_UP = 20  # requests before the timed ones: uvicorn's and httpx's first connections, imports
PHASES = {"send_to_route_ms": "send -> route", "route_to_job_start_ms": "route -> job start",
          "job_start_to_first_token_ms": "job start -> first token",
          "first_token_to_event_ms": "first token -> first event"}


class InstantBackend:
    """A generate.Backend whose tokens cost nothing: ids 300, 301, ... up to max_new_tokens, the
    first after `prefill_ms` (asleep, as the engine waits for the GPU). After each token it runs
    Python for `launch_us` (the engine's launch of its next step, GIL held), then lets other threads
    run, as the engine does while the GPU computes the next token.
    `first_tokens` holds the time.perf_counter() at which each generation yielded its first id."""

    name = "instant"

    def __init__(self, max_context: int, prefill_ms: float = 0.0, launch_us: float = 0.0):
        self.max_context = max_context
        self.prefill_ms, self.launch_us = prefill_ms, launch_us
        self.first_tokens: list[float] = []

    def generate(self, prompt_ids, params, max_new_tokens, stop_ids, lookup=None):
        time.sleep(self.prefill_ms / 1e3)
        for token in range(300, 300 + max_new_tokens):
            if token == 300:
                self.first_tokens.append(time.perf_counter())
            yield token
            launched = time.perf_counter() + self.launch_us / 1e6
            while time.perf_counter() < launched:
                pass
            time.sleep(0)


# -- the client (a child process) ------------------------------------------------------------------

def metric(text: str, name: str) -> float:
    found = re.search(f"^{re.escape(name)} (\\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def infill(client, body: dict) -> tuple[float, list[float]]:
    """Send a streamed /infill: (time.perf_counter() at the send, at each data event)."""
    return post(client, "/infill", {**body, "stream": True, "return_tokens": True, "cache_prompt": False})


def post(client, path: str, body: dict) -> tuple[float, list[float]]:
    """Send a request with a streamed answer: (time.perf_counter() at the send, at each data event)."""
    start = time.perf_counter()
    with client.stream("POST", path, json=body) as response:
        response.raise_for_status()
        return start, [time.perf_counter() for line in response.iter_lines() if line.startswith("data:")]


def client_main(url: str, requests: int, prompt_tokens: int, route: str = "infill") -> dict:
    """Every request of the bench, in order (the server pairs its /infill ones with its backend's
    first-token stamps), timed here: ms of /health round trips; for each /infill the send and the
    data events' times, and for the cold ones the two /metrics histograms' growth in ms; and the
    cold prompts' median length in tokens."""
    import httpx

    from server_latency import prompt_of  # the 7B bench's cold prompt (bench/ is this script's path)

    from pynanoqwen.data import EMBEDDED_MODEL
    from pynanoqwen.server.prompts import infill_prompt
    from pynanoqwen.server.run import model_info

    tokenizer = model_info(Path(EMBEDDED_MODEL), 4096).tokenizer
    out: dict = {"health_ms": [], "short_1": [], "short_16": [], "cold": [], "cold_tokens": []}
    with httpx.Client(base_url=url, timeout=30) as client:
        for _ in range(WARM_UP + requests):
            start = time.perf_counter()
            client.get("/health")
            out["health_ms"].append(1e3 * (time.perf_counter() - start))
        for n_predict in (1, 16):
            for i in range(WARM_UP + requests):
                body = {"input_prefix": f"# request {i}\ndef add(a, b):\n", "input_suffix": "", "n_predict": n_predict}
                out[f"short_{n_predict}"].append(infill(client, body))
        histograms = ("pynanoqwen_time_to_start_seconds_sum", "pynanoqwen_time_to_first_token_seconds_sum")
        model_id = client.get("/v1/models").json()["data"][0]["id"]
        for i in range(WARM_UP + requests):
            prefix = prompt_of(tokenizer, prompt_tokens, 1 + i)
            if route == "infill":
                out["cold_tokens"].append(len(tokenizer.encode(infill_prompt(prefix, "", (), ""))))
                body = {"input_prefix": prefix, "input_suffix": "", "n_predict": 1, "temperature": 0}
            else:
                out["cold_tokens"].append(len(tokenizer.encode(prefix)))
                body = {"model": model_id, "prompt": prefix, "max_tokens": 1, "temperature": 0, "stream": True}
            before = client.get("/metrics").text
            sent, events = infill(client, body) if route == "infill" else post(client, "/v1/completions", body)
            after = client.get("/metrics").text
            to_start, to_first = (1e3 * (metric(after, name) - metric(before, name)) for name in histograms)
            out["cold"].append((sent, events, to_start, to_first))
    out["cold_tokens"] = statistics.median(out["cold_tokens"])
    return out


# -- the server (this process) ---------------------------------------------------------------------

def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=150, help="timed requests of each kind (at least 1)")
    parser.add_argument("--prompt-tokens", type=int, default=512,
                        help="the cold /infill's prompt_of length, as bench/server_latency.py's --prompt-tokens")
    parser.add_argument("--prefill-ms", type=float, default=0.0,
                        help="the backend's sleep before its first token, as the engine's prefill")
    parser.add_argument("--launch-us", type=float, default=0.0,
                        help="Python the backend runs after each token, GIL held, as the engine's step launch")
    parser.add_argument("--route", choices=("infill", "completions"), default="infill",
                        help="the cold request's route: /infill, or /v1/completions with the same text as its prompt")
    parser.add_argument("--client", help=argparse.SUPPRESS)  # the child process: the server's URL
    args = parser.parse_args(argv)
    if args.requests < 1:
        parser.error("--requests must be at least 1")
    if args.client:
        print(json.dumps(client_main(args.client, args.requests, args.prompt_tokens, args.route)))
        return {}

    from pynanoqwen.data import EMBEDDED_MODEL
    from pynanoqwen.prompt_lookup import LookupParams
    from pynanoqwen.server.protocol import ModelInfo
    from pynanoqwen.server.run import ServerThread, load_model, make_app

    _, model = load_model(Path(EMBEDDED_MODEL), "cpu", 2048, self_check=False, on_status=lambda line: None)
    backend = InstantBackend(model.max_context, args.prefill_ms, args.launch_us)
    info = ModelInfo("instant", model.tokenizer, model.max_context, model.vocab_size)
    app = make_app(backend, info, api_key=None, max_queue=8, prefix_cache=False, lookup=LookupParams())
    with ServerThread(app) as server:
        child = subprocess.run([sys.executable, __file__, "--client", server.url, "--requests", str(args.requests),
                                "--prompt-tokens", str(args.prompt_tokens), "--route", args.route],
                               capture_output=True, text=True)
    if child.returncode:
        raise SystemExit(f"the client failed:\n{child.stderr}")
    times = json.loads(child.stdout)
    first_tokens = iter(backend.first_tokens)  # one a generation, in the order the client sent them

    def first_events(kind: str) -> tuple[list[float], list[float], list[float]]:
        """The timed requests' ms to the first event, between their tokens' events, and from the
        backend's first token to the first event."""
        first, gaps, handoff = [], [], []
        for i, (sent, stamps, *_) in enumerate(times[kind]):
            token = next(first_tokens)
            if i >= WARM_UP:
                first.append(1e3 * (stamps[0] - sent))
                gaps += [1e3 * (b - a) for a, b in zip(stamps, stamps[1:-1])]  # the tokens' events only
                handoff.append(1e3 * (stamps[0] - token))
        return first, gaps, handoff

    first_1, _, _ = first_events("short_1")
    first_16, gaps, _ = first_events("short_16")
    cold, _, to_event = first_events("cold")
    timed = times["cold"][WARM_UP:]
    to_start = [to_start for *_, to_start, _ in timed]
    to_first = [to_first for *_, to_first in timed]
    phases = {"send_to_route_ms": [total - first - event for total, first, event in zip(cold, to_first, to_event)],
              "route_to_job_start_ms": to_start,
              "job_start_to_first_token_ms": [first - start for first, start in zip(to_first, to_start)],
              "first_token_to_event_ms": to_event}
    result = {"health_ms": statistics.median(times["health_ms"][WARM_UP:]),
              "first_event_ms": statistics.median(first_1), "first_event_16_ms": statistics.median(first_16),
              "event_gap_ms": statistics.median(gaps), "cold_first_event_ms": statistics.median(cold),
              **{name: statistics.median(values) for name, values in phases.items()},
              "cold_prompt_tokens": times["cold_tokens"]}
    print(f"| what the server adds (medians of {args.requests}, ms) | |\n| --- | ---: |")
    labels = {"health_ms": "GET /health round trip", "first_event_ms": "/infill, first event (n_predict 1)",
              "first_event_16_ms": "/infill, first event (n_predict 16)", "event_gap_ms": "/infill, between events",
              "cold_first_event_ms": f"{'/infill' if args.route == 'infill' else '/v1/completions'} of a cold "
                                     f"{times['cold_tokens']:.0f}-token prompt, first event",
              **{name: f"... {label}" for name, label in PHASES.items()}}
    for name, label in labels.items():
        print(f"| {label} | {result[name]:.3f} |")
    return result


if __name__ == "__main__":
    main()

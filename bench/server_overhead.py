"""What the server alone adds to a request, with a backend that costs nothing; no GPU needed.

    python bench/server_overhead.py [--requests 150]

The app `serve` runs, on a real uvicorn server in this process (server.run.ServerThread), over a
backend that yields its tokens at once (letting other threads run after each): every millisecond
the client waits for the first event of a streamed /infill (return_tokens, so each id is an
event) is the HTTP stack's, the route's (parsing, the prompt, tokenizing it), the hand-offs to
the engine thread and back, and httpx's.
Prints the medians: GET /health's round trip, the first event at n_predict 1 and 16, and the gap
between events. bench/server_latency.py measures the same overhead against a real engine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import httpx

from pynanoqwen.data import EMBEDDED_MODEL
from pynanoqwen.prompt_lookup import LookupParams
from pynanoqwen.server.protocol import ModelInfo
from pynanoqwen.server.run import ServerThread, load_model, make_app

WARM_UP = 20  # requests before the timed ones: uvicorn's and httpx's first connections, imports


class InstantBackend:
    """A generate.Backend whose tokens cost nothing: ids 300, 301, ... up to max_new_tokens. It lets
    other threads run after each token, as the engine does while the GPU computes the next."""

    name = "instant"

    def __init__(self, max_context: int):
        self.max_context = max_context

    def generate(self, prompt_ids, params, max_new_tokens, stop_ids, lookup=None):
        for token in range(300, 300 + max_new_tokens):
            yield token
            time.sleep(0)


def first_events(client: httpx.Client, n_predict: int, requests: int) -> tuple[list[float], list[float]]:
    """ms from sending each /infill to its first event, and between its later events."""
    first, gaps = [], []
    for i in range(WARM_UP + requests):
        body = {"input_prefix": f"# request {i}\ndef add(a, b):\n", "input_suffix": "", "n_predict": n_predict,
                "stream": True, "return_tokens": True, "cache_prompt": False}
        start = time.perf_counter()
        with client.stream("POST", "/infill", json=body) as response:
            stamps = [time.perf_counter() for line in response.iter_lines() if line.startswith("data:")]
        if i >= WARM_UP:
            first.append(1e3 * (stamps[0] - start))
            gaps += [1e3 * (b - a) for a, b in zip(stamps, stamps[1:n_predict])]  # the tokens' events only
    return first, gaps


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=150, help="timed requests of each kind (at least 1)")
    args = parser.parse_args(argv)
    if args.requests < 1:
        parser.error("--requests must be at least 1")
    _, model = load_model(Path(EMBEDDED_MODEL), "cpu", 2048, self_check=False, on_status=lambda line: None)
    backend = InstantBackend(model.max_context)
    info = ModelInfo("instant", model.tokenizer, model.max_context, model.vocab_size)
    app = make_app(backend, info, api_key=None, max_queue=8, prefix_cache=False, lookup=LookupParams())
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        health = []
        for i in range(WARM_UP + args.requests):
            start = time.perf_counter()
            client.get("/health")
            if i >= WARM_UP:
                health.append(1e3 * (time.perf_counter() - start))
        first_1, _ = first_events(client, 1, args.requests)
        first_16, gaps = first_events(client, 16, args.requests)
    result = {"health_ms": statistics.median(health), "first_event_ms": statistics.median(first_1),
              "first_event_16_ms": statistics.median(first_16), "event_gap_ms": statistics.median(gaps)}
    print("| what the server adds (medians, ms) | |\n| --- | ---: |")
    labels = {"health_ms": "GET /health round trip", "first_event_ms": "/infill, first event (n_predict 1)",
              "first_event_16_ms": "/infill, first event (n_predict 16)", "event_gap_ms": "/infill, between events"}
    for name, label in labels.items():
        print(f"| {label} | {result[name]:.3f} |")
    return result


if __name__ == "__main__":
    main()

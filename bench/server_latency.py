"""What `serve` adds to a generation, measured over HTTP on localhost; writes a markdown table and JSON.

    python bench/server_latency.py --model FILE [--device cuda|cpu] [--json out.json]
    python bench/server_latency.py --device cpu --prompt-tokens 64 --gen-tokens 16 --context-tokens 200

1. Overhead. The same prompt runs `repeats` times through the backend in this process (loaded
   as `serve` loads it, run as its engine runs it: generate_paged with a page lease where the
   backend has it, else generate, timed as `generate` times it, on the ids the server makes of
   it) and through the server (a `serve` subprocess on a free port; a streamed /infill with
   return_tokens, which sends an event for every generated id whether its text is complete or
   not, timed at the client from sending the request to each event), in turns. Events per id
   matter for a random-weight model, most of whose ids have no text in its small tokenizer.
   TTFT and ITL are medians; the overhead is server minus direct. Every repeat's prompt is other
   text on every line, so no run reuses another's KV pages or the tokenizer's cached chunks: both
   paths prefill every token, and the server tokenizes every one.
   The server's TTFT is split where the server stamps it (/metrics' histograms, read between
   requests): from the route's entry to the engine starting the job, and to the engine's first
   token; and from the job's start to that token (the last event's timings.prompt_ms). The direct
   run's page lease, which its timer leaves out and the server's job includes, is timed on its own.
2. Prefix cache. An /infill with ~`context_tokens` of repository context, sent once, then again
   `repeats` times with only the current line (`prompt`, at the end) changed: TTFT of those, the
   prompt tokens the server actually computed (timings.prompt_n), and the same request with
   cache_prompt: false for comparison.
3. Cancellation. A long streamed /infill is dropped after a few tokens; the server's own
   figure (pynanoqwen_cancel_latency_seconds: from noticing the disconnect to the engine being
   free) and the client's: TTFT of a one-token request sent right after the drop, minus its TTFT
   on the idle server.

Greedy decoding throughout. The direct and server runs load the same file on the same device, at the
same time (the server in its subprocess while this process loads its own backend).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from pynanoqwen.bench import git_commit, gpu_info
from pynanoqwen.generate import resolve_device, resolve_model
from pynanoqwen.prefix_cache import PrefixCache
from pynanoqwen.sampling import SamplingParams
from pynanoqwen.server.prompts import infill_prompt
from pynanoqwen.server.run import load_model, model_info

GREEDY = SamplingParams()


def prompt_of(tokenizer, tokens: int, run: int) -> str:
    """About `tokens` tokens of Python source that names the run on every line: no two runs share a
    KV page or a chunk of the server tokenizer's cache (tokenizer.encode_cached)."""
    source = "".join(f"def step_{run}_{i}(state_{run}, value):\n    state_{run}.total += value * {i}\n"
                     f"    return state_{run}\n\n" for i in range(tokens))
    return f"# run {run}\n" + tokenizer.decode(tokenizer.encode(source)[:tokens - 8])


def infill_body(prefix: str, n_predict: int) -> dict:
    """A streamed /infill of `prefix` whose every generated id is an event (return_tokens)."""
    return {"input_prefix": prefix, "input_suffix": "", "n_predict": n_predict, "temperature": 0,
            "return_tokens": True, "cache_prompt": False}


class Direct:
    """The backend in this process, run as the server's engine runs it."""

    def __init__(self, backend, tokenizer):
        self.backend, self.stop_ids = backend, tokenizer.stop_ids
        self.cache = PrefixCache.for_backend(backend) if hasattr(backend, "generate_paged") else None

    def stamps(self, prompt: list[int], gen_tokens: int) -> list[float]:
        """Seconds from the call to each generated token (self.lease_s: the lease before it)."""
        start = time.perf_counter()
        lease = self.cache.lease(prompt, len(prompt) + gen_tokens) if self.cache else None
        self.lease_s = time.perf_counter() - start
        start = time.perf_counter()
        tokens = (self.backend.generate_paged(prompt, GREEDY, gen_tokens, self.stop_ids, lease) if lease
                  else self.backend.generate(prompt, GREEDY, gen_tokens, self.stop_ids))
        stamps = [time.perf_counter() - start for _ in tokens]
        if lease:
            self.cache.commit(lease, prompt)
        return stamps


def streamed(http: httpx.Client, path: str, body: dict) -> tuple[list[float], dict]:
    """Seconds from sending the request to each data event, and the last event's JSON. The request
    (its JSON encoding, httpx's headers) is built before the clock starts: that is the client's
    work, which an editor does too and the direct run has no counterpart of (on the 2-core VM it
    was 0.3-0.4 ms of httpx's ~0.8 ms from the call to the request's first byte at the server)."""
    request = http.build_request("POST", path, json={**body, "stream": True})
    start = time.perf_counter()
    stamps, last = [], {}
    response = http.send(request, stream=True)
    try:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter() - start)
                last = json.loads(line[6:])
    finally:
        response.close()
    return stamps, last


def histogram_sum(http, name: str) -> float:
    return metric(http.get("/metrics").text, f"{name}_sum")


def overhead_times(direct: Direct, http, tokenizer, prompts, gen_tokens) -> tuple[dict[str, tuple[list, list]], dict]:
    """TTFTs and inter-token latencies of both paths, run in turns so that both see the same machine,
    and the server's TTFT in its phases (module docstring), ms; the first prompt warms both up and
    is not counted."""
    times = {"direct": ([], []), "server": ([], [])}
    phases = {"route_to_job_start": [], "route_to_first_token": [], "job_to_first_token": [], "direct_lease": []}
    histograms = {"route_to_job_start": "pynanoqwen_time_to_start_seconds",
                  "route_to_first_token": "pynanoqwen_time_to_first_token_seconds"}
    for i, prefix in enumerate(prompts):
        ids = tokenizer.encode(infill_prompt(prefix, "", (), ""))  # what the server makes of the request
        before = {phase: histogram_sum(http, name) for phase, name in histograms.items()}
        server_stamps, last = streamed(http, "/infill", infill_body(prefix, gen_tokens))
        after = {phase: histogram_sum(http, name) for phase, name in histograms.items()}
        runs = {"direct": direct.stamps(ids, gen_tokens), "server": server_stamps[:-1]}  # last: the summary
        if i:
            for phase in histograms:
                phases[phase].append(1000 * (after[phase] - before[phase]))
            phases["job_to_first_token"].append(last["timings"]["prompt_ms"])
            phases["direct_lease"].append(1000 * direct.lease_s)
        for side, stamps in runs.items():
            if len(stamps) < 2:
                raise SystemExit(f"error: the {side} run generated {len(stamps)} token(s) of {gen_tokens}: "
                                 "a stop token came first; try another --prompt-tokens")
            if i:
                times[side][0].append(stamps[0])
                times[side][1].extend(b - a for a, b in zip(stamps, stamps[1:]))
    return times, {name: statistics.median(values) for name, values in phases.items()}


def infill_times(http, tokenizer, context_tokens, repeats) -> dict:
    chunk = "".join(f"def helper_{i}(x, y):\n    return (x + {i}) * y\n\n" for i in range(context_tokens))
    ids = tokenizer.encode(chunk)
    body = {"input_extra": [{"filename": "helpers.py", "text": tokenizer.decode(ids[:context_tokens - 40])}],
            "input_prefix": "import helpers\n\n\ndef main():\n", "input_suffix": "", "n_predict": 4,
            "temperature": 0, "return_tokens": True}  # so the first event is the first token
    streamed(http, "/infill", {**body, "prompt": "    start = helpers.helper_0(1, 2)"})  # fills the cache

    def line(i):  # the edited current line: the only text that differs between requests
        return f"    result_{i} = helpers.helper_{i}(start, {i})"

    warm, cold, computed, prompt_tokens = [], [], [], 0
    for i in range(1, repeats + 1):
        stamps, last = streamed(http, "/infill", {**body, "prompt": line(i)})
        warm.append(stamps[0])
        computed.append(last["timings"]["prompt_n"])
        prompt_tokens = last["tokens_evaluated"]
        stamps, _ = streamed(http, "/infill", {**body, "prompt": line(i) + " ", "cache_prompt": False})
        cold.append(stamps[0])
    return {"prompt_tokens": prompt_tokens, "computed_tokens": statistics.median(computed),
            "ttft_ms": 1000 * statistics.median(warm), "ttft_ms_without_cache": 1000 * statistics.median(cold)}


def metric(text: str, name: str) -> float:
    found = re.search(f"^{re.escape(name)} (\\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def cancel_times(http, url, prefix, repeats) -> dict:
    short = infill_body(prefix, 1)
    idle = statistics.median(streamed(http, "/infill", short)[0][0] for _ in range(repeats))
    after = []
    before = http.get("/metrics").text
    for _ in range(repeats):
        long = {**infill_body(prefix, -1), "stream": True}  # until the end of the context
        with httpx.Client(base_url=url, timeout=600) as dropped, dropped.stream("POST", "/infill",
                                                                               json=long) as response:
            response.raise_for_status()
            for _, _ in zip(range(8), response.iter_lines()):  # 4 events: 4 tokens generated
                pass
        after.append(streamed(http, "/infill", short)[0][0])
    now = http.get("/metrics").text
    count, total = (metric(now, f"pynanoqwen_cancel_latency_seconds_{part}")
                    - metric(before, f"pynanoqwen_cancel_latency_seconds_{part}") for part in ("count", "sum"))
    return {"server_ms": 1000 * total / count if count else None, "cancelled": count,
            "client_visible_ms": 1000 * (statistics.median(after) - idle)}


def start_server(model: Path, device: str, max_context: int, skip_selfcheck: bool):
    """(the `serve` subprocess, a function that waits for its URL). Its stderr is relayed from a
    thread, so the caller can load its own backend while the server loads and prepares."""
    command = [sys.executable, "-m", "pynanoqwen", "serve", "--model", str(model), "--device", device, "--port", "0",
               "--max-context", str(max_context)] + (["--skip-selfcheck"] if skip_selfcheck else [])
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    found, ready = [], threading.Event()

    def relay():
        for line in server.stderr:
            print(f"[serve] {line.rstrip()}", file=sys.stderr)
            url = re.search(r"at (http://\S+):", line)
            if url and not found:
                found.append(url.group(1))
                ready.set()
        ready.set()  # the server exited

    threading.Thread(target=relay, daemon=True).start()

    def url() -> str:
        ready.wait()
        if not found:
            raise SystemExit(f"serve exited with code {server.wait()} before printing its URL")
        return found[0]

    return server, url


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a .nanoqwen file [default: the embedded tiny-coder]")
    parser.add_argument("--device", choices=["cuda", "cpu"])
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--context-tokens", type=int, default=4000, help="repository context of the /infill test")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-selfcheck", action="store_true")
    parser.add_argument("--json", dest="json_path", help="also write every figure to this file")
    args = parser.parse_args(argv)
    model_path = resolve_model(args.model)
    device = resolve_device(args.device, lambda line: print(line, file=sys.stderr))
    wanted = max(args.prompt_tokens + args.gen_tokens, args.context_tokens + 256)
    max_context = model_info(model_path, wanted).max_context
    server, server_url = start_server(model_path, device, max_context, args.skip_selfcheck)  # loads beside ours
    try:
        backend, info = load_model(model_path, device, max_context, self_check=False,
                                   on_status=lambda line: print(f"[direct] {line}", file=sys.stderr))
        tokenizer = info.tokenizer
        prompts = [prompt_of(tokenizer, args.prompt_tokens, run) for run in range(2 + args.repeats)]
        url = server_url()
        with httpx.Client(base_url=url, timeout=600) as http:
            times, phases = overhead_times(Direct(backend, tokenizer), http, tokenizer, prompts[1:], args.gen_tokens)
            infill = infill_times(http, tokenizer, min(args.context_tokens, max_context - 64), args.repeats)
            cancel = cancel_times(http, url, prompts[0][:64], args.repeats)
    finally:
        server.terminate()
        server.wait(timeout=120)
    ms = lambda xs: 1000 * statistics.median(xs)  # noqa: E731
    result = {
        "model": str(model_path), "device": device, "gpu": gpu_info().get("name") if device == "cuda" else None,
        "git_commit": git_commit(), "prompt_tokens": args.prompt_tokens,
        "gen_tokens": args.gen_tokens, "repeats": args.repeats,
        **{side: {"ttft_ms": ms(ttfts), "itl_ms": ms(itls)} for side, (ttfts, itls) in times.items()},
        "server_ttft_phases_ms": phases, "infill_prefix_cache": infill, "cancellation": cancel,
    }
    result["overhead"] = {key: result["server"][key] - result["direct"][key] for key in ("ttft_ms", "itl_ms")}
    rows = [("TTFT, direct / server / overhead (ms)", f"{result['direct']['ttft_ms']:.3f} / "
             f"{result['server']['ttft_ms']:.3f} / {result['overhead']['ttft_ms']:.3f}"),
            ("server TTFT: route to job start / to first token; job start to first token; direct's lease (ms)",
             f"{phases['route_to_job_start']:.3f} / {phases['route_to_first_token']:.3f}; "
             f"{phases['job_to_first_token']:.3f}; {phases['direct_lease']:.3f}"),
            ("ITL, direct / server / overhead (ms)", f"{result['direct']['itl_ms']:.4f} / "
             f"{result['server']['itl_ms']:.4f} / {result['overhead']['itl_ms']:.4f}"),
            (f"/infill TTFT, {infill['prompt_tokens']} prompt tokens, {infill['computed_tokens']:.0f} computed (ms)",
             f"{infill['ttft_ms']:.2f} (without the cache: {infill['ttft_ms_without_cache']:.2f})"),
            ("cancellation, server / client-visible (ms)",
             f"{cancel['server_ms']:.2f} / {cancel['client_visible_ms']:.2f}" if cancel["server_ms"] is not None
             else "no cancellation seen")]
    print(f"| {model_path.name} on {device} | |\n| --- | --- |")
    for name, value in rows:
        print(f"| {name} | {value} |")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()

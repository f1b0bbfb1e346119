"""The engine behind the HTTP routes: one worker thread runs one request at a time, in arrival order.

The event loop never runs the model. A route builds a GenerationRequest, `Scheduler.submit` puts
it in a bounded queue (full: QueueFull, which the route answers with 503 and Retry-After) and
returns its Job. The worker thread takes jobs in order, runs each through the backend, turns tokens
into text (tokenizer.StreamDecoder, then textstream.TextStops) and hands every piece to the event
loop with loop.call_soon_threadsafe onto the job's asyncio.Queue, so a streaming response awaits
its next event without ever blocking the loop. After a streamed job's first event the worker waits,
at most FIRST_EVENT_WAIT_S, until the response has written it: the loop then has the GIL to itself
for that event, the one that sets the time to first token. The other way round, a job submitted to
an idle worker is taken up before `submit` returns (at most START_WAIT_S), so the engine starts
before the loop writes the response's headers.

Cancellation: `Job.cancel` (the client went away, or server/protocol.py's newer /infill from the
same client) sets a flag that the worker reads after every token; it then closes the backend's
generator, so the engine is free within one decode step. A job cancelled while queued leaves the
queue at once and never runs.

With a backend that implements prefix_cache.PagedBackend, every request leases its KV pages from
the PrefixCache and commits them when it ends, cancelled or not; other backends run cold.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import sys
import threading
import time
import traceback
from collections.abc import Iterator

from ..backends import Backend
from ..prefix_cache import PrefixCache
from ..prompt_lookup import LookupParams
from ..sampling import SamplingParams
from ..tokenizer import Tokenizer
from .errors import ApiError
from .metrics import Metrics
from .textstream import TextStops


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """What the engine runs; the caller has checked that it fits (prompt + max_new_tokens <= context)."""

    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    stop_ids: frozenset[int]
    stop: tuple[str, ...] = ()
    n_indent: int = 0                # llama.cpp: end at a line indented less (textstream.py)
    t_max_predict_ms: int = 0        # llama.cpp: past this time, end at the next line break (0: off)
    reuse_cache: bool = True         # llama.cpp's cache_prompt
    every_token: bool = False        # an event for each generated id, text or not (a streamed return_tokens)


@dataclasses.dataclass(frozen=True)
class Text:
    text: str
    tokens: tuple[int, ...]  # the generated ids this text completes


@dataclasses.dataclass(frozen=True)
class Done:
    """The end of a job. reason: "eos" (a stop token), "word" (a stop string; stopping_word),
    "limit" (max tokens, context, n_indent or t_max_predict_ms), "cancelled" or "error"."""

    reason: str
    stopping_word: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    tokens: tuple[int, ...]
    prompt_ms: float     # from the start of the job to its first token
    predicted_ms: float  # from the first token to the last
    cancel_reason: str | None = None
    error: ApiError | None = None  # set with reason "error"


class QueueFull(Exception):
    pass


# How long the worker waits, after a streamed job's first event, for the response to write it.
# During the wait the event loop has the GIL to itself, instead of waiting for the worker to launch
# the engine's next step first. The GPU engine has already enqueued that step
# (engine.backend._decode_tokens), so the wait costs it nothing while it is shorter than a step
# (~1.7 ms at 7B); a backend that computes the next token only when asked (the CPU reference)
# starts it that much later, once a generation. 2-core VM, bench/server_overhead.py with a backend
# that runs 300 us of Python after each token (--prefill-ms 5 --launch-us 300): first token to
# first event 0.73-0.84 -> 0.40-0.51 ms (medians of 150, three interleaved rounds).
FIRST_EVENT_WAIT_S = 0.001
# How long `submit` waits, when the worker is idle, for it to take the job just queued. The loop
# waits with the GIL released, so the worker starts the job at once, instead of after the route has
# written the response's headers and the loop has nothing left to run; the headers go out while
# the backend computes the prefill. 2-core VM, bench/server_overhead.py --prefill-ms 5
# --launch-us 300, a cold 523-token /infill: route to job start 0.57-0.62 -> 0.43-0.55 ms (medians
# of 150, six interleaved rounds). A busy worker is not waited for: the job waits in the queue.
START_WAIT_S = 0.001


class Job:
    """One request in the engine. Its events (Text..., then one Done) arrive on `events`."""

    def __init__(self, request: GenerationRequest, arrival: float, loop: asyncio.AbstractEventLoop,
                 scheduler: "Scheduler", streamed: bool = False):
        self.request = request
        self.arrival = arrival  # time.perf_counter() when the request came in
        self.events: asyncio.Queue = asyncio.Queue()
        # A streamed response sets it once it has written its first event (FIRST_EVENT_WAIT_S).
        self.first_sent = threading.Event() if streamed else None
        self._loop = loop
        self._scheduler = scheduler
        self._cancel = threading.Event()
        self.cancel_reason: str | None = None
        self.cancelled_at = 0.0
        self.state = "queued"  # -> "running" -> "done"

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def emit(self, event) -> None:
        """From the worker thread: deliver an event to the event loop."""
        try:
            self._loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: the server is gone, and nobody waits for this
            pass

    def cancel(self, reason: str) -> None:
        """Stop this job: at once if it is queued, after the current decode step if it runs."""
        self._scheduler.cancel(self, reason)


class Scheduler:
    def __init__(self, backend: Backend, tokenizer: Tokenizer, metrics: Metrics, max_queue: int,
                 cache: PrefixCache | None, lookup: LookupParams = LookupParams()):
        self.backend = backend
        self.lookup = lookup  # prompt lookup for every request (prompt_lookup.py)
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.max_queue = max_queue
        self.cache = cache
        self._pending: collections.deque[Job] = collections.deque()
        self._lock = threading.Condition()
        self._running: Job | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._work, name="pynanoqwen-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Cancel what runs, drop what waits, and end the worker thread."""
        with self._lock:
            self._stopping = True
            pending, self._pending = list(self._pending), collections.deque()
            running = self._running
            self._lock.notify_all()
        for job in pending:
            self._finish_unrun(job, "shutdown")
        if running is not None:
            self.cancel(running, "shutdown")
        self._thread.join()

    def submit(self, request: GenerationRequest, arrival: float, streamed: bool = False) -> Job:
        """Queue a request (from the event loop) that came in at `arrival` (time.perf_counter());
        QueueFull when max_queue requests already wait. `streamed`: its response sets
        job.first_sent after writing its first event."""
        job = Job(request, arrival, asyncio.get_running_loop(), self, streamed)
        with self._lock:
            if self._stopping or (len(self._pending) >= self.max_queue and self._running is not None):
                raise QueueFull()
            idle = self._running is None and not self._pending
            self._pending.append(job)
            self.metrics.queued.set(len(self._pending))
            self._lock.notify()
            if idle:  # the worker takes it up now, the lock and the GIL released meanwhile
                self._lock.wait_for(lambda: job.state != "queued", START_WAIT_S)
        return job

    def cancel(self, job: Job, reason: str) -> None:
        with self._lock:
            if job.state == "done" or job.cancelled:
                return
            job.cancel_reason, job.cancelled_at = reason, time.perf_counter()
            job._cancel.set()
            queued = job.state == "queued"
            if queued:
                self._pending.remove(job)
                self.metrics.queued.set(len(self._pending))
        if queued:
            self._finish_unrun(job, reason)

    def _finish_unrun(self, job: Job, reason: str) -> None:
        job.state = "done"
        self.metrics.cancelled.labels(reason).inc()
        job.emit(Done("cancelled", "", len(job.request.prompt_ids), 0, 0, (), 0.0, 0.0, cancel_reason=reason))

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._pending and not self._stopping:
                    self._lock.wait()
                if self._stopping:
                    return
                job = self._running = self._pending.popleft()
                job.state = "running"
                self.metrics.queued.set(len(self._pending))
                self._lock.notify_all()  # a submit waiting for its job to start (START_WAIT_S)
            try:
                done = self._run(job)
            except Exception:  # a bug or a backend failure: answer this request, keep serving
                traceback.print_exc(file=sys.stderr)
                done = Done("error", "", len(job.request.prompt_ids), 0, 0, (), 0.0, 0.0,
                            error=ApiError(500, "the engine failed on this request; the server log has the "
                                                "traceback", code="engine_error"))
            with self._lock:
                job.state, self._running = "done", None
            if job.cancelled:
                self.metrics.cancelled.labels(job.cancel_reason).inc()
                self.metrics.cancel_latency.observe(time.perf_counter() - job.cancelled_at)
            job.emit(done)

    def _tokens(self, request: GenerationRequest) -> tuple[Iterator[int], object]:
        """The backend's token generator for this request, and the page lease it runs in (or None)."""
        prompt = request.prompt_ids
        if self.cache is None:
            return self.backend.generate(prompt, request.params, request.max_new_tokens, request.stop_ids,
                                         self.lookup), None
        lease = self.cache.lease(prompt, len(prompt) + request.max_new_tokens, reuse=request.reuse_cache)
        return self.backend.generate_paged(prompt, request.params, request.max_new_tokens, request.stop_ids,
                                           lease, self.lookup), lease

    def _run(self, job: Job) -> Done:
        request, metrics = job.request, self.metrics
        start = time.perf_counter()
        if job.cancelled:  # between leaving the queue and starting
            return Done("cancelled", "", len(request.prompt_ids), 0, 0, (), 0.0, 0.0, cancel_reason=job.cancel_reason)
        metrics.time_to_start.observe(start - job.arrival)
        decoder = self.tokenizer.stream_decoder()
        stops = TextStops(request.stop, request.n_indent)
        generated: list[int] = []
        unsent = 0  # generated ids whose text has not been sent yet
        reason = "limit"
        first = last = None
        tokens, lease = self._tokens(request)
        try:
            for token in tokens:
                now = time.perf_counter()
                if first is None:
                    first = now
                    metrics.time_to_first_token.observe(now - job.arrival)
                else:
                    metrics.inter_token_latency.observe(now - last)
                last = now
                generated.append(token)
                if token in request.stop_ids:
                    reason = "eos"
                    break
                text = stops.push(decoder.push(token))
                if text or request.every_token:
                    job.emit(Text(text, tuple(generated[unsent:])))
                    if not unsent and job.first_sent is not None:  # the first event
                        job.first_sent.wait(FIRST_EVENT_WAIT_S)
                    unsent = len(generated)
                if stops.reason is not None:
                    reason = stops.reason if stops.reason == "word" else "limit"
                    break
                if job.cancelled:
                    reason = "cancelled"
                    break
                if (request.t_max_predict_ms > 0 and "\n" in text
                        and 1000 * (now - first) > request.t_max_predict_ms):
                    break
            if reason in ("eos", "limit") and stops.reason is None:
                rest = stops.push(decoder.flush()) + stops.flush()
                if rest:
                    job.emit(Text(rest, tuple(generated[unsent:len(generated) - (reason == "eos")])))
        finally:
            tokens.close()  # stops the backend after the step it is in
            if lease is not None:
                self.cache.commit(lease, request.prompt_ids + generated)
        end = time.perf_counter()
        metrics.prompt_tokens.inc(len(request.prompt_ids))
        metrics.generated_tokens.inc(len(generated))
        lookup = getattr(self.backend, "lookup_stats", None) if self.lookup.enabled else None
        if lookup is not None:
            metrics.lookup_drafted.inc(lookup.drafted)
            metrics.lookup_accepted.inc(lookup.accepted)
        return Done(reason, stops.stopping_word, len(request.prompt_ids), lease.cached_tokens if lease else 0,
                    len(generated), tuple(generated), 1000 * ((first or end) - start), 1000 * (end - (first or end)),
                    cancel_reason=job.cancel_reason)

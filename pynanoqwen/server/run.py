"""`python -m pynanoqwen serve`: load the model as `generate` does, then serve it over HTTP.

The order: check the options, bind the socket (a taken port fails before minutes of loading),
load the tokenizer and the backend (generate.load_backend: the GPU engine when there is a GPU,
the numpy reference otherwise), self-check it on the GPU, compile its prefill graphs, then print
the URLs and hand the socket to uvicorn. `ServerThread` runs the same app on a thread, for tests
and the benchmark.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import uvicorn

from ..cpu_pages import PagedCpuBackend
from ..errors import FormatError, NanoQwenError
from ..fileformat import NanoQwenFile
from ..backends import CpuBackend, load_backend
from ..generate import DEFAULT_MAX_CONTEXT, check_utf8, resolve_device, resolve_model
from ..prefix_cache import PrefixCache
from ..prompt_lookup import LookupParams, check_device
from ..sampling import SamplingParams
from ..tokenizer import Tokenizer, compile_chat_template
from .app import build_app
from .metrics import Metrics
from .protocol import ModelInfo
from .scheduler import Scheduler

DEFAULT_PORT = 8080
DEFAULT_MAX_QUEUE = 8


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """Everything `python -m pynanoqwen serve` takes."""

    model: str | None = None
    device: str | None = None
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    max_context: int = DEFAULT_MAX_CONTEXT
    api_key: str | None = None
    max_queue: int = DEFAULT_MAX_QUEUE
    prefix_cache: bool = True
    self_check: bool = True
    lookup: LookupParams = LookupParams()  # prompt-lookup speculative decoding for every request

    def validate(self) -> "ServeOptions":
        # A byte that is not UTF-8 arrives as a lone surrogate: the socket cannot encode such a
        # host (a TypeError), nor the key check such a key (a 500 for every request).
        check_utf8("--host", self.host)
        check_utf8("--api-key", self.api_key)
        if not self.host.strip():  # the socket would listen on every interface, as for 0.0.0.0
            raise NanoQwenError("--host is empty; give an address (0.0.0.0 opens the server to the network)")
        if not 0 <= self.port <= 65535:
            raise NanoQwenError(f"--port must be between 0 and 65535, got {self.port}")
        if self.max_context < 2:
            raise NanoQwenError(f"--max-context must be >= 2, got {self.max_context}")
        if self.max_queue < 0:
            raise NanoQwenError(f"--max-queue must be >= 0, got {self.max_queue}")
        if self.api_key is not None:
            _check_api_key(self.api_key)
        self.lookup.validate()
        return self


def _check_api_key(key: str) -> None:
    """Refuse a key no request could match: an HTTP header value loses the white space at its ends
    and cannot carry control characters."""
    if not key.strip():
        raise NanoQwenError("--api-key is empty")
    if key != key.strip():
        raise NanoQwenError("--api-key starts or ends with white space, which no Authorization header can "
                            "carry; remove it")
    if any(ord(c) < 32 or ord(c) == 127 for c in key):
        raise NanoQwenError("--api-key contains a control character, which no Authorization header can carry")


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free one)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # proto IPPROTO_TCP, not 0: asyncio turns Nagle's algorithm off only on sockets that say
        # they are TCP, and with it on, a response's body waits ~40 ms behind its headers.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as err:
        raise NanoQwenError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    except TypeError:  # a non-ASCII name that IDNA cannot encode ("encoding of hostname failed")
        raise NanoQwenError(f"cannot listen on {host}:{port}: not a valid host name") from None
    sock.setblocking(False)
    return sock


def model_info(path: Path, max_context: int) -> ModelInfo:
    """What the routes need of the model file at `path`, without loading its weights: the tokenizer
    (with the file's end-of-generation ids), the context, and whether its chat template compiles
    (files converted before convert checked templates may hold one that does not; such a file still
    serves completions and /infill)."""
    with NanoQwenFile(path, verify_data=False) as f:
        config, template, chat_error = f.config, f.chat_template, None
        if template is not None:
            try:
                compile_chat_template(template)
            except FormatError as err:
                template, chat_error = None, str(err)
        tokenizer = Tokenizer.from_json_bytes(f.tokenizer_json, template, vocab_size=config.vocab_size,
                                              bos_token_id=config.bos_token_id,
                                              eos_token_id=config.eos_token_id, extra_eos_ids=f.extra_eos_ids)
    return ModelInfo(path.stem, tokenizer, min(max_context, config.max_position_embeddings), config.vocab_size,
                     chat_error)


def load_model(path: Path, device: str, max_context: int, *, self_check: bool,
               on_status: Callable[[str], None]):
    """(backend, ModelInfo) for the model file at `path` on `device`, ready to serve."""
    model = model_info(path, max_context)
    if model.chat_error:
        on_status(f"warning: {model.chat_error}: /v1/chat/completions is refused, completions and /infill work")
    on_status(f"loading {path} ({path.stat().st_size / 1e6:.1f} MB, context {model.max_context}) on "
              f"{'the GPU engine' if device == 'cuda' else 'the CPU (numpy reference)'}")
    backend = load_backend(path, device, model.max_context)
    if device == "cuda" and self_check:
        from ..selfcheck import require_self_check

        on_status(require_self_check(backend, path))
    buckets = getattr(backend, "prefill_buckets", ())
    if buckets:  # the GPU engine: compile every prefill graph a request may replay, before serving
        # Each bucket as a last chunk, and (one past the longest) the longest as an inner chunk.
        lengths = sorted({min(rows, model.max_context - 1) for rows in buckets + (buckets[-1] + 1,)})
        on_status(f"compiling the prefill graphs: {len(lengths)} prompt lengths, greedy and sampled")
        started = time.perf_counter()
        for length in lengths:
            for params in (SamplingParams(), SamplingParams(temperature=1.0)):  # greedy and sampled
                backend.prepare(length, params)
        on_status(f"prefill graphs ready in {time.perf_counter() - started:.1f} s")
    if isinstance(backend, CpuBackend):  # the reference keeps its KV in pages for the prefix cache
        backend = PagedCpuBackend(backend.model)
    return backend, model


def make_app(backend, model: ModelInfo, *, api_key: str | None, max_queue: int, prefix_cache: bool,
             lookup: LookupParams = LookupParams()):
    """The app serving `backend`; the prefix cache only where the backend keeps paged KV."""
    paged = prefix_cache and hasattr(backend, "generate_paged")
    cache = PrefixCache.for_backend(backend) if paged else None
    metrics = Metrics(cache)
    return build_app(Scheduler(backend, model.tokenizer, metrics, max_queue, cache, lookup), model, metrics, api_key)


def uvicorn_server(app) -> uvicorn.Server:
    return uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on"))


def serve(options: ServeOptions, on_status: Callable[[str], None]) -> None:
    options.validate()
    model_path = resolve_model(options.model)
    sock = bind(options.host, options.port)
    device = resolve_device(options.device, on_status)
    check_device(options.lookup, device)
    backend, model = load_model(model_path, device, options.max_context, self_check=options.self_check,
                                on_status=on_status)
    app = make_app(backend, model, api_key=options.api_key, max_queue=options.max_queue,
                   prefix_cache=options.prefix_cache, lookup=options.lookup)
    host, port = sock.getsockname()[:2]
    base = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    on_status(f"serving `{model.id}` at {base}: OpenAI base URL {base}/v1, llama.cpp /infill {base}/infill "
              f"(Ctrl-C stops)")
    uvicorn_server(app).run(sockets=[sock])


class ServerThread:
    """The app on a uvicorn server in a background thread, on a free port of 127.0.0.1."""

    def __init__(self, app):
        self.sock = bind("127.0.0.1", 0)
        self.url = "http://127.0.0.1:%d" % self.sock.getsockname()[1]
        self.server = uvicorn_server(app)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the server thread died while starting")
            self.thread.join(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join()

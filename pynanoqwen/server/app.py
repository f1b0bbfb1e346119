"""The HTTP side: a Starlette app whose routes check a request, queue it and relay its events.

Routes (`Gate` first checks the API key on all but /health and /openapi.json, and counts them):
    POST /v1/completions, /v1/chat/completions, /infill   generation (protocol.py, responses.py)
    GET  /v1/models, /v1/models/{id}                        the one model served
    GET  /health                                            {"status": "ok"} once the model is loaded
    GET  /metrics                                           Prometheus text (metrics.py)
    GET  /openapi.json                                      the request schemas the routes validate with

Every failure is OpenAI's error JSON with its status (errors.py): 400 malformed JSON, wrong types,
unknown fields or a prompt that does not fit; 401 a missing or wrong key; 404 an unknown path or
model; 405 a wrong method; 409 an /infill superseded by a newer one from the same client; 413 a
body over MAX_BODY_BYTES; 501 chat with a model whose chat template does not compile; 503 a full
queue (with Retry-After); 500 a bug, and the server keeps serving.

A client is known by its address and User-Agent: a newer /infill asking for tokens from the same
client cancels its older ones (an editor that moved on), queued or running.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import sys
import time
import traceback

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .errors import ApiError
from .metrics import Metrics
from .protocol import ENDPOINTS, ModelInfo
from .responses import Formatter, cancelled_error
from .scheduler import Job, QueueFull, Scheduler, Text

MAX_BODY_BYTES = 16 * 2**20  # far more text than a 32k-token context holds
# Bodies larger than this are checked and tokenized on a worker thread (the tokenizer library
# releases the GIL; Tokenizer's piece path, for less new text than PIECE_PATH_CHARS, does not), not
# on the event loop: tokenizing took ~0.7 us per character on a 2-core development machine (the
# piece path ~0.1-0.2), so 16 KiB would stall every other response for ~11 ms. Smaller ones stay
# on the loop, which saves the thread hop from the time to first token.
PARSE_IN_THREAD_BYTES = 16 * 2**10
PUBLIC_PATHS = ("/health", "/openapi.json")
RETRY_AFTER_S = 1


def error_response(err: ApiError) -> Response:
    # ASCII JSON (json.dumps' default): a message may name a key of the request, and a JSON key may be
    # half a character ("\ud800"), which JSONResponse's UTF-8 cannot encode; an escape can hold it.
    return Response(json.dumps(err.body()), status_code=err.status, headers=err.headers,
                    media_type="application/json")


def server_error_response() -> Response:
    return error_response(ApiError(500, "Internal server error; the server log has the traceback.",
                                   code="internal_error"))


async def read_json(request: Request):
    """(the request body as JSON, its size): ApiError 413 past MAX_BODY_BYTES, 400 when it does
    not parse."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ApiError(413, f"The body is {declared} bytes, more than the {MAX_BODY_BYTES} this server reads.",
                       code="body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise ApiError(413, f"The body is more than the {MAX_BODY_BYTES} bytes this server reads.",
                           code="body_too_large")
        chunks.append(chunk)

    def refuse(constant):  # json.loads takes NaN and Infinity, which JSON does not have
        raise ValueError(f"{constant} is not JSON")

    try:
        return json.loads(b"".join(chunks), parse_constant=refuse), size
    except (ValueError, RecursionError) as err:
        raise ApiError(400, f"We could not parse the JSON body of your request ({err}).", code="invalid_json") from None


def watch_disconnect(job: Job, receive) -> asyncio.Task:
    """A task that cancels the job when its client goes away (once the body is read, receive()
    only reports that). The job then ends with a Done within one decode step, as always."""
    async def watch():
        while (await receive())["type"] != "http.disconnect":
            pass
        job.cancel("disconnect")

    return asyncio.ensure_future(watch())


class EventStream:
    """The streamed answer of one job (an ASGI response): its events as they come, until its Done.
    After a disconnect the server still writes, and uvicorn drops what it writes."""

    def __init__(self, job: Job, formatter: Formatter):
        self.job, self.formatter = job, formatter

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                                (b"x-accel-buffering", b"no")]})
        watcher = watch_disconnect(self.job, receive)
        try:
            for data in self.formatter.opening():
                await send({"type": "http.response.body", "body": data, "more_body": True})
            while isinstance(event := await self.job.events.get(), Text):
                await send({"type": "http.response.body", "body": self.formatter.piece(event), "more_body": True})
                if not self.job.first_sent.is_set():  # the engine thread waits for it (scheduler.FIRST_EVENT_WAIT_S)
                    self.job.first_sent.set()
            for data in self.formatter.closing(event):
                await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()
            self.job.first_sent.set()


class GenerationRoute:
    """One generation endpoint as an ASGI app: `handle(request, parse)` gives its response, and an
    ApiError or a bug becomes the error JSON that Starlette's handlers would give. Gate calls it for
    a POST directly: from the Gate to the route's first line took 0.053-0.070 ms through Starlette's
    middleware and router and takes 0.020-0.026 without them (2-core VM, medians of 150 cold
    /infill requests with stamps in both places), on the way to the first token. Starlette's Route
    keeps it for the 405 that other methods get."""

    def __init__(self, handle, parse):
        self.handle, self.parse = handle, parse

    async def __call__(self, scope, receive, send) -> None:
        try:
            response = await self.handle(Request(scope, receive), self.parse)
        except ApiError as err:
            response = error_response(err)
        except Exception:  # a bug: answer this request, keep serving, log it as uvicorn would
            traceback.print_exc(file=sys.stderr)
            response = server_error_response()
        await response(scope, receive, send)


class Gate:
    """ASGI middleware: the bearer-token check (401), the request counter of /metrics, and the
    generation POSTs handed to their GenerationRoute."""

    def __init__(self, app, api_key: str | None, metrics: Metrics, known_paths: tuple[str, ...],
                 posts: dict[str, "GenerationRoute"]):
        self.app, self.api_key, self.metrics, self.known_paths = app, api_key, metrics, known_paths
        self.posts = posts  # the generation endpoints, which a POST reaches without Starlette's router

    def _refusal(self, scope) -> ApiError | None:
        if not self.api_key or scope["path"] in PUBLIC_PATHS:
            return None
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not given:
            return ApiError(401, "You didn't provide an API key: send it as `Authorization: Bearer KEY`.",
                            code="missing_api_key", headers={"WWW-Authenticate": "Bearer"})
        scheme, _, key = given.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(key.strip(), self.api_key.encode()):
            return ApiError(401, "Incorrect API key provided.", code="invalid_api_key",
                            headers={"WWW-Authenticate": "Bearer"})
        return None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500  # what a response that never started counts as

        async def counting_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        path = scope["path"]
        endpoint = path if path in self.known_paths else "/v1/models/{id}" if path.startswith("/v1/models/") \
            else "other"
        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                await error_response(refusal)(scope, receive, counting_send)
            elif scope["method"] == "POST" and path in self.posts:
                await self.posts[path](scope, receive, counting_send)
            else:
                await self.app(scope, receive, counting_send)
        finally:
            self.metrics.requests.labels(endpoint, str(status)).inc()


def openapi_document(model_id: str) -> dict:
    """OpenAPI 3.0 for the routes; the request schemas are the ones that validate (schema.py)."""
    error = {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": "string", "nullable": True}, "code": {"type": "string", "nullable": True}}}}}
    errors = {"4XX": {"description": "OpenAI's error object", "content": {"application/json": {"schema": error}}}}
    paths = {path: {"post": {
        "requestBody": {"required": True, "content": {"application/json": {"schema": schema.schema()}}},
        "responses": {"200": {"description": "the completion, or server-sent events when stream is true",
                              "content": {"application/json": {}, "text/event-stream": {}}}, **errors}}}
        for path, (schema, _) in ENDPOINTS.items()}
    for path, what in (("/health", "ready"), ("/v1/models", "the model served"), ("/metrics", "Prometheus text")):
        paths[path] = {"get": {"responses": {"200": {"description": what}, **errors}}}
    return {"openapi": "3.0.3", "info": {"title": f"pynanoqwen serving {model_id}", "version": "1"}, "paths": paths}


def build_app(scheduler: Scheduler, model: ModelInfo, metrics: Metrics, api_key: str | None = None) -> Gate:
    """The ASGI app serving `model` through `scheduler` (started and stopped with the app)."""
    started = int(time.time())
    infill_jobs: dict[tuple, Job] = {}  # the latest /infill of each client (the event loop's only)
    model_entry = {"id": model.id, "object": "model", "created": started, "owned_by": "pynanoqwen",
                   "max_context": model.max_context}

    async def generation(request: Request, parse):
        arrival = time.perf_counter()
        body, size = await read_json(request)
        if size > PARSE_IN_THREAD_BYTES:
            generation_request, reply = await run_in_threadpool(parse, body, model)
        else:
            generation_request, reply = parse(body, model)
        client = (request.client.host if request.client else "", request.headers.get("user-agent", ""))
        if reply.supersedes and client in infill_jobs:
            infill_jobs.pop(client).cancel("superseded")
        try:
            job = scheduler.submit(generation_request, arrival, streamed=reply.stream)
        except QueueFull:
            raise ApiError(503, f"The server is busy: {scheduler.max_queue} requests are already waiting.",
                           code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        if reply.supersedes:
            infill_jobs[client] = job
        formatter = Formatter(reply, model.id)
        if reply.stream:
            return EventStream(job, formatter)
        watcher = watch_disconnect(job, request.receive)
        texts = []
        try:
            while isinstance(event := await job.events.get(), Text):
                texts.append(event.text)
        finally:
            watcher.cancel()
        if infill_jobs.get(client) is job:
            del infill_jobs[client]
        if event.error is not None or event.reason == "cancelled":
            raise event.error or cancelled_error(event)
        return JSONResponse(formatter.body("".join(texts), event))

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [model_entry]})

    async def one_model(request: Request):
        if request.path_params["name"] != model.id:
            raise ApiError(404, f"The model `{request.path_params['name']}` does not exist.", param="model",
                           code="model_not_found")
        return JSONResponse(model_entry)

    async def health(request: Request):
        return JSONResponse({"status": "ok"})

    async def prometheus(request: Request):
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    document = openapi_document(model.id)

    async def openapi(request: Request):
        return JSONResponse(document)

    async def api_error(request: Request, err: ApiError):
        return error_response(err)

    async def http_error(request: Request, err: HTTPException):
        # err.headers carries a 405's Allow, which HTTP requires with it (RFC 9110, 15.5.6).
        path = request.url.path
        hint = f" (did you mean {path.rstrip('/')}?)" if err.status_code == 404 and path.rstrip("/") in known else ""
        return error_response(ApiError(err.status_code, f"{request.method} {path}: {err.detail}{hint}",
                                       code="not_found" if err.status_code == 404 else None, headers=err.headers))

    async def server_error(request: Request, err: Exception):
        return server_error_response()

    # Each endpoint's parser bound to its route: finding it by request.url.path built and parsed the
    # URL on every request (~35 us of the route's time on the 2-core VM, its caches cold).
    posts = {path: GenerationRoute(generation, parse) for path, (_, parse) in ENDPOINTS.items()}
    routes = [Route(path, route, methods=["POST"]) for path, route in posts.items()]
    routes += [Route(path, endpoint, methods=["GET"]) for path, endpoint in (
        ("/v1/models", models), ("/v1/models/{name:path}", one_model), ("/health", health), ("/metrics", prometheus),
        ("/openapi.json", openapi))]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        yield
        scheduler.stop()

    known = tuple(ENDPOINTS) + ("/v1/models", "/health", "/metrics", "/openapi.json")
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={ApiError: api_error, HTTPException: http_error, Exception: server_error})
    # Starlette answers a path with a stray trailing slash with an empty-bodied 307 to the path
    # without it, which a client may not follow for a POST: a JSON 404 that names the path instead.
    app.router.redirect_slashes = False
    return Gate(app, api_key, metrics, known, posts)

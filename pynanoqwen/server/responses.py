"""Response bodies and server-sent events, as OpenAI and llama.cpp send them.

OpenAI (/v1/completions, /v1/chat/completions): a `text_completion` or `chat.completion` object
with one choice, finish_reason "stop" (a stop token or string) or "length" (max_tokens or the
end of the context), and usage with prompt_tokens_details.cached_tokens (prompt tokens whose KV
came from the prefix cache). Streamed: one `data: {json}` event per piece of text (chat: the
first event carries the role, later ones `delta.content`), a last event with the finish_reason,
a usage event when stream_options.include_usage asks for it, then `data: [DONE]`.

llama.cpp (/infill): `content`, `stop`, `stop_type` ("eos", "word" or "limit"), `stopping_word`,
`tokens_predicted`, `tokens_evaluated`, `tokens_cached`, `truncated` (always false: nothing is
cut) and `timings` with prompt_n (prompt tokens computed, not cached), prompt_ms, predicted_n and
predicted_ms and their rates. `response_fields` keeps only the named fields of a non-streamed
response, a nested one as "timings/prompt_n" at the top level (llama.cpp's rule). Streamed:
events {"content": piece, "stop": false}, then the full response with "stop": true, no [DONE].
"""

from __future__ import annotations

import json
import secrets
import time

from .errors import ApiError
from .protocol import Reply
from .scheduler import Done, Text

FINISH_REASONS = {"eos": "stop", "word": "stop", "limit": "length"}


def sse(payload) -> bytes:
    """One server-sent event: `data: ...` and the blank line that ends it."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


def cancelled_error(done: Done) -> ApiError:
    """The answer to a cancelled request (a client that disconnected gets it too, and drops it)."""
    if done.cancel_reason == "superseded":
        return ApiError(409, "Superseded by a newer /infill request from the same client.", code="superseded")
    if done.cancel_reason == "disconnect":
        return ApiError(499, "The client disconnected.", code="client_disconnected")  # nginx's code for it
    return ApiError(503, "The server is shutting down.", code="shutting_down", headers={"Retry-After": "1"})


class Formatter:
    """The JSON of one request's answer, whole or as events."""

    def __init__(self, reply: Reply, model_id: str):
        self.reply = reply
        self.model_id = model_id
        prefix = {"completion": "cmpl", "chat": "chatcmpl", "infill": "infill"}[reply.endpoint]
        self.id = f"{prefix}-{secrets.token_hex(12)}"
        self.created = int(time.time())

    # -- OpenAI -------------------------------------------------------------------------------

    def _envelope(self, streamed: bool) -> dict:
        chat = self.reply.endpoint == "chat"
        kind = ("chat.completion.chunk" if streamed else "chat.completion") if chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_id}

    def _choice(self, text: str | None, finish_reason: str | None, streamed: bool) -> dict:
        if self.reply.endpoint == "completion":
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        if streamed:
            delta = {"content": text} if text is not None else {}
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish_reason}

    @staticmethod
    def _usage(done: Done) -> dict:
        return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
                "total_tokens": done.prompt_tokens + done.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}

    # -- llama.cpp ----------------------------------------------------------------------------

    def _infill(self, content: str, done: Done) -> dict:
        computed = done.prompt_tokens - done.cached_tokens
        n = done.completion_tokens
        body = {
            "index": 0, "id_slot": 0, "model": self.model_id, "content": content,
            "tokens": list(done.tokens) if self.reply.return_tokens else [], "stop": True,
            "stop_type": done.reason, "stopping_word": done.stopping_word, "tokens_predicted": n,
            "tokens_evaluated": done.prompt_tokens, "tokens_cached": done.cached_tokens, "truncated": False,
            "has_new_line": "\n" in content,
            "timings": {"cache_n": done.cached_tokens, "prompt_n": computed, "prompt_ms": done.prompt_ms,
                        "prompt_per_token_ms": done.prompt_ms / computed,
                        "prompt_per_second": 1000 * computed / done.prompt_ms if done.prompt_ms else 0.0,
                        "predicted_n": n, "predicted_ms": done.predicted_ms,
                        "predicted_per_token_ms": done.predicted_ms / n if n else 0.0,
                        "predicted_per_second": 1000 * n / done.predicted_ms if done.predicted_ms else 0.0},
        }
        return body

    @staticmethod
    def _only(fields: tuple[str, ...], body: dict) -> dict:
        out = {}
        for path in fields:
            value = body
            for key in path.split("/"):
                value = value.get(key) if isinstance(value, dict) else None
            if value is not None:
                out[path] = value
        return out

    # -- what the routes call -----------------------------------------------------------------

    def body(self, text: str, done: Done) -> dict:
        """The whole answer of a request that was not streamed."""
        if self.reply.endpoint == "infill":
            body = self._infill(text, done)
            return self._only(self.reply.response_fields, body) if self.reply.response_fields else body
        return {**self._envelope(False), "choices": [self._choice(text, FINISH_REASONS[done.reason], False)],
                "usage": self._usage(done)}

    def opening(self) -> list[bytes]:
        """Events sent before any text."""
        if self.reply.endpoint != "chat":
            return []
        opening = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return [sse({**self._envelope(True), "choices": [opening]})]

    def piece(self, event: Text) -> bytes:
        if self.reply.endpoint == "infill":
            return sse({"index": 0, "id_slot": 0, "content": event.text, "tokens": list(event.tokens), "stop": False})
        return sse({**self._envelope(True), "choices": [self._choice(event.text, None, True)]})

    def closing(self, done: Done) -> list[bytes]:
        """Events that end a stream."""
        if done.error is not None or done.reason == "cancelled":
            error = done.error or cancelled_error(done)
            return [sse(error.body())]
        if self.reply.endpoint == "infill":
            return [sse(self._infill("", done))]
        events = [sse({**self._envelope(True), "choices": [self._choice(None, FINISH_REASONS[done.reason], True)]})]
        if self.reply.include_usage:
            events.append(sse({**self._envelope(True), "choices": [], "usage": self._usage(done)}))
        return events + [sse("[DONE]")]

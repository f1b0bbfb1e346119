"""The generation endpoints' request bodies, and how each becomes a GenerationRequest.

- POST /v1/completions: OpenAI's legacy completions. `suffix` makes it Qwen2.5-Coder
  fill-in-the-middle (tokenizer.fim_prompt, as `generate --fim-suffix`).
- POST /v1/chat/completions: OpenAI's chat; the messages go through the model's chat template.
- POST /infill: llama.cpp's server, the fields llama.vscode and llama.vim send (server/prompts.py
  lays out input_extra as repository context).

Unknown fields are refused (400), as OpenAI does. OpenAI options this server cannot honour
(n > 1, logprobs, echo, penalties, logit_bias, tools) are accepted only at the value that turns
them off (schema.Neutral). /infill accepts llama.cpp options that tune llama.cpp itself and have
no counterpart in a batch-1 engine, and ignores them: `id_slot` (one slot), `samplers` (the order
is always temperature, top-k, top-p), `t_max_prompt_ms` (llama.cpp does not implement it either),
`timings_per_token`, and a chunk's `time` (llama.vim's timestamp). Everything else it accepts is
honoured.

Context: a request gets the model's context capped by --max-context. A prompt that does not fit
with one generated token, or prompt + max_tokens beyond the context, is a 400 that says by how
many tokens; nothing is truncated. Without max_tokens (chat; /infill's n_predict -1) the budget
is what the context has left. /v1/completions' default max_tokens is OpenAI's, 16.
"""

from __future__ import annotations

import dataclasses
import secrets

from ..config import MAX_INT32
from ..errors import NanoQwenError
from ..generate import build_prompt
from ..sampling import SamplingParams
from ..tokenizer import Tokenizer
from .errors import ApiError
from .prompts import CHUNK_PLACEHOLDER, infill_prompt
from .scheduler import GenerationRequest
from .schema import (Anything, Bool, Choice, Field, Int, ListOf, MapOf, Neutral, Nullable, Number, Object, OneOf,
                     Str, fields, text_list)

SEED = Int(0, 2**63 - 1)
TOP_K = Int(0, MAX_INT32)  # the GPU sampler holds it in an int32 (sampling.SamplingParams.validate)
STOP = Nullable(OneOf((Str(min_length=1), ListOf(Str(min_length=1), max_items=4))))
OPENAI_SAMPLING = fields(
    temperature=Field(Nullable(Number(0.0, 2.0)), 1.0),
    top_p=Field(Nullable(Number(0.0, 1.0, exclusive_minimum=True)), 1.0),
    top_k=Field(Nullable(TOP_K), 0, description="not OpenAI's: sample among the K most probable (0: all)"),
    seed=Field(Nullable(SEED), description="the same seed and request give the same tokens; none: random"),
    stop=Field(STOP, description="up to 4 strings; the text ends before the first one generated"),
    stream=Field(Nullable(Bool()), False),
    stream_options=Nullable(Object(fields(include_usage=Field(Nullable(Bool()), False)))),
    n=Neutral(Int(), 1, "one choice per request"),
    presence_penalty=Neutral(Number(), 0.0, "no penalties"),
    frequency_penalty=Neutral(Number(), 0.0, "no penalties"),
    logit_bias=Neutral(MapOf(Number()), {}, "no logit bias"),
    user=Nullable(Str()),
)
COMPLETION = Object(fields(
    model=Field(Str(), required=True),
    prompt=Field(OneOf((Str(), ListOf(Str(), 1, 1), ListOf(Int(0), 1))), required=True,
                    description="text, a list of one text, or token ids"),
    suffix=Field(Nullable(Str()), description="the code after the hole: fill in the middle"),
    max_tokens=Field(Nullable(Int(1)), 16),
    **OPENAI_SAMPLING,
    logprobs=Neutral(Int(), None, "no log probabilities"),
    echo=Neutral(Bool(), False, "the prompt is not echoed"),
    best_of=Neutral(Int(), 1, "one completion per request"),
))
CONTENT_PART = Object(fields(type=Field(Choice(("text",)), required=True), text=Field(Str(), required=True)))
MESSAGE = Object(fields(role=Field(Choice(("system", "user", "assistant")), required=True),
                        content=Field(OneOf((Str(), ListOf(CONTENT_PART))), required=True)))
CHAT = Object(fields(
    model=Field(Str(), required=True),
    messages=Field(ListOf(MESSAGE, 1), required=True),
    max_tokens=Field(Nullable(Int(1)), description="none: what the context has left"),
    max_completion_tokens=Field(Nullable(Int(1)), description="the same as max_tokens"),
    **OPENAI_SAMPLING,
    logprobs=Neutral(Bool(), False, "no log probabilities"),
    top_logprobs=Neutral(Int(), None, "no log probabilities"),
    response_format=Neutral(Object(fields(type=Field(Str(), required=True))), {"type": "text"}, "text only"),
    tools=Neutral(ListOf(Anything()), [], "no tool calls"),
    tool_choice=Neutral(Str(), "none", "no tool calls"),
    parallel_tool_calls=Neutral(Bool(), False, "no tool calls"),
))
CHUNK = Object(fields(text=Field(Str(), required=True), filename=Field(Str(), CHUNK_PLACEHOLDER), time=Anything()))
INFILL = Object(fields(
    input_prefix=Field(Str(), required=True, description="the code before the cursor"),
    input_suffix=Field(Str(), required=True, description="the code after the cursor"),
    input_extra=Field(ListOf(CHUNK), description="repository context: other files or parts of them"),
    prompt=Field(Str(), "", description="the current line up to the cursor; ends the prefix"),
    n_predict=Field(Int(-1), -1, description="-1: until a stop or the end of the context; 0: only the prompt"),
    stream=Field(Bool(), False),
    temperature=Field(Number(0.0, 100.0), 0.8),
    top_k=Field(TOP_K, 40),
    top_p=Field(Number(0.0, 1.0, exclusive_minimum=True), 0.95),
    seed=Field(Int(-1, 2**63 - 1), -1, description="-1: random"),
    stop=Field(ListOf(Str(min_length=1))),
    n_indent=Field(Int(0), 0, description="end at a generated line indented less than this"),
    t_max_predict_ms=Field(Int(), 0, description="after this long, end at the next line break (0: off)"),
    cache_prompt=Field(Bool(), True, description="false: reuse no cached KV pages"),
    response_fields=Field(ListOf(Str()), description="only these fields ('a/b' for nested ones)"),
    return_tokens=Field(Bool(), False),
    model=Str(),
    id_slot=Field(Int(), description="ignored: one slot"),
    samplers=Field(ListOf(Str()), description="ignored: always temperature, top-k, top-p"),
    t_max_prompt_ms=Field(Int(), description="ignored, as in llama.cpp"),
    timings_per_token=Field(Bool(), description="ignored"),
))


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What the routes know of the model they serve."""

    id: str
    tokenizer: Tokenizer
    max_context: int
    vocab_size: int
    chat_error: str | None = None  # why the file's chat template cannot be used, if it cannot


@dataclasses.dataclass(frozen=True)
class Reply:
    """How to answer: what the response formatter needs besides the generated text (responses.py)."""

    endpoint: str  # "completion", "chat" or "infill"
    stream: bool
    include_usage: bool = False
    response_fields: tuple[str, ...] = ()
    return_tokens: bool = False
    supersedes: bool = False  # an /infill that asks for tokens ends the client's older ones


def check_model(body: dict, model: ModelInfo) -> None:
    name = body.get("model")
    if name is not None and name != model.id:
        raise ApiError(404, f"The model `{name}` does not exist; this server serves `{model.id}` (GET /v1/models).",
                       param="model", code="model_not_found")


def budget(prompt_ids: list[int], max_tokens: int | None, model: ModelInfo, prompt_param: str,
           max_param: str = "max_tokens") -> int:
    """Tokens the request may generate; ApiError 400 when it does not fit the context."""
    n, context = len(prompt_ids), model.max_context
    if n == 0:
        raise ApiError(400, "The prompt is empty: there is nothing to continue.", param=prompt_param,
                       code="empty_prompt")
    if n + 1 > context:
        raise ApiError(400, f"The prompt is {n} tokens, {n + 1 - context} more than the {context - 1} that fit in "
                            f"this model's context of {context} tokens with one generated token.",
                       param=prompt_param, code="context_length_exceeded")
    if max_tokens is None:
        return context - n
    if n + max_tokens > context:
        raise ApiError(400, f"This model's context is {context} tokens, and {n + max_tokens} were requested "
                            f"({n} in the prompt, {max_tokens} to generate): {n + max_tokens - context} too many. "
                            f"Shorten the prompt or lower {max_param}.", param=max_param,
                       code="context_length_exceeded")
    return max_tokens


def openai_sampling(body: dict) -> SamplingParams:
    seed = body["seed"] if body["seed"] is not None else secrets.randbits(63)
    return SamplingParams(body["temperature"], body["top_k"], body["top_p"], seed).validate()


def completion_request(body, model: ModelInfo) -> tuple[GenerationRequest, Reply]:
    body = COMPLETION.check(body, "")
    check_model(body, model)
    prompt, suffix, tokenizer = body["prompt"], body["suffix"], model.tokenizer
    if isinstance(prompt, list) and isinstance(prompt[0], int):
        if suffix is not None:
            raise ApiError(400, "A prompt of token ids cannot take a suffix.", param="suffix", code="invalid_value")
        outside = [t for t in prompt if t >= model.vocab_size]
        if outside:
            raise ApiError(400, f"Token id {outside[0]} is outside the vocabulary [0, {model.vocab_size}).",
                           param="prompt", code="invalid_value")
        prompt_ids = prompt
    else:
        text = prompt if isinstance(prompt, str) else prompt[0]
        prompt_ids = tokenizer.encode_cached(build_prompt(tokenizer, text, chat=False, system=None, fim_suffix=suffix))
    request = GenerationRequest(prompt_ids, openai_sampling(body), budget(prompt_ids, body["max_tokens"], model,
                                                                          "prompt"),
                                tokenizer.stop_ids, text_list(body["stop"]))
    return request, Reply("completion", body["stream"], _include_usage(body))


def chat_request(body, model: ModelInfo) -> tuple[GenerationRequest, Reply]:
    body = CHAT.check(body, "")
    check_model(body, model)
    if model.chat_error:
        raise ApiError(501, f"This model cannot chat: {model.chat_error}. /v1/completions and /infill work.",
                       code="chat_template_error")
    messages = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
                 else "\n".join(part["text"] for part in m["content"])} for m in body["messages"]]
    tokenizer = model.tokenizer
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except NanoQwenError as err:  # the template refused these messages (raise_exception) or failed on them
        raise ApiError(400, f"The {str(err).removeprefix('the ')}.", param="messages", code="chat_template_failed") \
            from None
    prompt_ids = tokenizer.encode_cached(text)
    max_param = "max_completion_tokens" if body["max_completion_tokens"] is not None else "max_tokens"
    request = GenerationRequest(prompt_ids, openai_sampling(body),
                                budget(prompt_ids, body[max_param], model, "messages", max_param),
                                tokenizer.stop_ids, text_list(body["stop"]))
    return request, Reply("chat", body["stream"], _include_usage(body))


def infill_request(body, model: ModelInfo) -> tuple[GenerationRequest, Reply]:
    body = INFILL.check(body, "")
    check_model(body, model)
    tokenizer = model.tokenizer
    prompt_ids = tokenizer.encode_cached(infill_prompt(body["input_prefix"], body["input_suffix"],
                                                       body["input_extra"] or (), body["prompt"]))
    n_predict = None if body["n_predict"] == -1 else body["n_predict"]
    seed = body["seed"] if body["seed"] != -1 else secrets.randbits(63)
    params = SamplingParams(body["temperature"], body["top_k"], body["top_p"], seed).validate()
    request = GenerationRequest(prompt_ids, params, budget(prompt_ids, n_predict, model, "input_prefix", "n_predict"),
                                tokenizer.stop_ids, text_list(body["stop"]), body["n_indent"],
                                body["t_max_predict_ms"], body["cache_prompt"],
                                every_token=body["stream"] and body["return_tokens"])
    return request, Reply("infill", body["stream"], response_fields=tuple(body["response_fields"] or ()),
                          return_tokens=body["return_tokens"], supersedes=body["n_predict"] != 0)


def _include_usage(body: dict) -> bool:
    if body["stream_options"] is not None and not body["stream"]:  # OpenAI's 400: it would do nothing
        raise ApiError(400, "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                       param="stream_options", code="invalid_value")
    return bool(body["stream_options"] and body["stream_options"]["include_usage"])


ENDPOINTS = {  # path -> (request schema, parser)
    "/v1/completions": (COMPLETION, completion_request),
    "/v1/chat/completions": (CHAT, chat_request),
    "/infill": (INFILL, infill_request),
}

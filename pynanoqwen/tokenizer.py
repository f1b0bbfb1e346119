"""Text <-> token ids for Qwen2.5: the embedded tokenizer.json, chat and fill-in-the-middle prompts,
and a streaming detokenizer.

The .nanoqwen file carries the checkpoint's tokenizer.json (a byte-level BPE) and, for Instruct
models, its Jinja chat template (fileformat.py reads both). Encoding and decoding are the
`tokenizers` library's; this module adds the three things generation needs around them:

- `Tokenizer.apply_chat_template` renders the embedded template the way transformers does (same
  sandboxed Jinja environment and globals) and falls back to Qwen2.5-Instruct's ChatML.
- `Tokenizer.fim_prompt` builds Qwen2.5-Coder's fill-in-the-middle prompt.
- `StreamDecoder` turns token ids into text as they arrive. A byte-level BPE token is a run of
  bytes, not of characters: a 4-byte emoji may arrive as two tokens of two bytes each, so the
  decoder only ever emits text up to the last complete character.
"""

from __future__ import annotations

import collections
import itertools
import json
import re
import threading

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

from .errors import FormatError, NanoQwenError

FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE = "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"
# Tokens after which a Qwen2.5(-Coder) model has finished: the end of a document (base models), the
# end of an assistant turn (Instruct models), and the FIM and repository markers a fill-in-the-middle
# completion may emit once the hole is filled. That is the eos_token_id list of Qwen's own FIM
# example (QwenLM/Qwen2.5-Coder, examples/Qwen2.5-Coder-fim.py): every special token but <|im_start|>.
# The file's eos_token_id and extra end-of-generation ids (generation_config.json) are added to them.
STOP_TOKENS = ("<|endoftext|>", "<|im_end|>", FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX, "<|fim_pad|>",
               "<|repo_name|>", "<|file_sep|>")

QWEN_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

# Qwen2.5-Instruct's template without its tool-calling branches: ChatML turns, and the default
# system prompt when the conversation does not start with one. Used when the file has no template.
CHATML_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\n" + QWEN_DEFAULT_SYSTEM + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message['role'] == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


# Qwen2's pre-tokenizer (tokenizer.json of every Qwen2.5 model, and of the embedded one): NFC, then
# this pattern cuts the text into pieces, each encoded on its own after the byte-level mapping.
QWEN2_SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                       r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Line starts where that pattern cuts whatever the text around (a match's end): after a line feed,
# before spaces or tabs (group 1: the indentation) and a printable ASCII character. The piece
# holding the line feed ends there: it is one of newlines (\s*[\r\n]+, which ends at the last line
# feed of a run, and the run has no other before the next printable character) or of punctuation
# and newlines; no letter or digit piece holds a line feed. A piece starting there depends only on
# the text after it (the pattern looks ahead, never back), and NFC joins nothing across it (an
# ASCII character composes with nothing before it). GPT-2's pattern (\s+(?!\S) first) would glue
# the line feed to the indentation: no cuts there.
LINE_CUT = re.compile(r"\n(?=([ \t]*)[!-~])")
LINE_CUT_COLUMN0 = re.compile(r"\n(?=[!-~])")  # LINE_CUT's matches without indentation
NON_ASCII = re.compile(r"[^\x00-\x7f]+")
# QWEN2_SPLIT_PATTERN on ASCII text, for the standard library's `re`: there \p{L} is [A-Za-z], \p{N} is
# [0-9], and \s (Unicode's White_Space, as the library's Oniguruma reads it) is tab, line feed,
# vertical tab, form feed, carriage return and space; Python's own \s would add \x1c-\x1f, which
# are not White_Space. (?!\S) is "not followed by a character outside \s", as below. Both engines
# try the alternatives in order at the leftmost position, so the pieces are the same
# (tests/test_tokenizer.py checks every ASCII character in every context it has, on two tokenizers).
_ASCII_SPACE = r"\t\n\x0b\x0c\r "
ASCII_SPLIT = re.compile(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\nA-Za-z0-9]?[A-Za-z]+|[0-9]"
                         rf"| ?[^{_ASCII_SPACE}A-Za-z0-9]+[\r\n]*|[{_ASCII_SPACE}]*[\r\n]+"
                         rf"|[{_ASCII_SPACE}]+(?![^{_ASCII_SPACE}])|[{_ASCII_SPACE}]+", re.ASCII)
# Text the construction checks the piece path against the library with: every ASCII character
# alone, after a letter and before one, and the pattern's cases (contractions, runs of spaces and
# line feeds before a letter, punctuation before line feeds, digits).
_PIECE_CHECK = ("".join(f"a{chr(c)}b{chr(c)}{chr(c)} {chr(c)}\n" for c in range(128))
                + "It's they'RE x'll 'd 1234 ab12cd  \n\n   \tx\r\n  y):\n\n\tz  ;;\r\r\n    return f(x)  \n")


def cuts_like_qwen2(hf_tokenizer: tokenizers.Tokenizer) -> bool:
    """Whether the tokenizer normalises and pre-tokenizes as Qwen2's does, so LINE_CUT's cuts
    leave its ids unchanged (trim_offsets only moves offsets)."""
    def config(component) -> dict | None:
        return None if component is None else json.loads(component.__getstate__())

    pre_tokenizer = config(hf_tokenizer.pre_tokenizer) or {}
    if pre_tokenizer.get("type") != "Sequence" or len(pre_tokenizer.get("pretokenizers", ())) != 2:
        return False
    split, byte_level = pre_tokenizer["pretokenizers"]
    return (config(hf_tokenizer.normalizer) in (None, {"type": "NFC"})
            and split == {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT_PATTERN}, "behavior": "Isolated",
                          "invert": False}
            and byte_level.get("type") == "ByteLevel"
            and byte_level.get("add_prefix_space") is False and byte_level.get("use_regex") is False)


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers replaces Jinja's tojson, which HTML-escapes '<' and '>', with plain json.dumps.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the environment transformers' apply_chat_template uses; a
    template that does not compile raises FormatError with Jinja's message and line.

    Templates come from downloaded checkpoints, so they run sandboxed (no attribute access to
    Python internals, no mutation of the data they are given)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                      extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as err:
        raise FormatError(f"the chat template does not compile: {err.message} (line {err.lineno})") from None
    except jinja2.exceptions.TemplateError as err:
        raise FormatError(f"the chat template does not compile: {err}") from None


class Tokenizer:
    """A Qwen2.5 tokenizer: the embedded tokenizer.json plus its chat template and stop tokens."""

    def __init__(self, hf_tokenizer: tokenizers.Tokenizer, chat_template: str | None,
                 bos_token_id: int | None = None, eos_token_id: int | None = None,
                 extra_eos_ids: tuple[int, ...] = ()):
        self._tok = hf_tokenizer
        self.has_chat_template = chat_template is not None
        self._template = compile_chat_template(chat_template if chat_template is not None else CHATML_TEMPLATE)
        # The template globals bos_token / eos_token (None when the id has no token, as in HF).
        self.bos_token = hf_tokenizer.id_to_token(bos_token_id) if bos_token_id is not None else None
        self.eos_token = hf_tokenizer.id_to_token(eos_token_id) if eos_token_id is not None else None
        stops = {self._tok.token_to_id(t) for t in STOP_TOKENS} | {eos_token_id, *extra_eos_ids}
        self.stop_ids: frozenset[int] = frozenset(i for i in stops if i is not None)
        # encode_cached splits text where `tokenizers` itself splits it first: at the added tokens
        # it matches before normalising (normalized false), and only those with no stripping or
        # word rule, whose match depends on nothing around them. Longest first, as it matches.
        plain = sorted((t.content for t in hf_tokenizer.get_added_tokens_decoder().values()
                        if not (t.normalized or t.lstrip or t.rstrip or t.single_word)), key=len, reverse=True)
        self._added_split = re.compile("(" + "|".join(map(re.escape, plain)) + ")") if plain else None
        self._added_ids = {content: hf_tokenizer.token_to_id(content) for content in plain}
        self.line_cuts = cuts_like_qwen2(hf_tokenizer)
        self._chunk_ids: collections.OrderedDict[str, tuple[int, ...]] = collections.OrderedDict()
        self._cached_chars = 0
        self._chunks_lock = threading.Lock()
        # The piece path of encode_cached (_encode_pieces): ASCII text split here, each piece's ids
        # from the library's own model. Only for Qwen2's normaliser and pre-tokenizer, a model that
        # always gives a piece the same ids (no BPE dropout), and added tokens that _added_split
        # finds all of; and only if it gives the library's ids on _PIECE_CHECK.
        self._piece_ids: dict[str, tuple[int, ...]] = {}
        self._byte_chars: dict[int, str] | None = None
        self._model = hf_tokenizer.model
        if (self.line_cuts and len(plain) == len(hf_tokenizer.get_added_tokens_decoder())
                and getattr(self._model, "dropout", None) is None):
            byte_chars = {c: hf_tokenizer.pre_tokenizer.pre_tokenize_str(chr(c)) for c in range(128)}
            if all(len(pieces) == 1 and len(pieces[0][0]) == 1 for pieces in byte_chars.values()):
                self._byte_chars = {c: pieces[0][0] for c, pieces in byte_chars.items()}
                if self._encode_pieces(_PIECE_CHECK) != self.encode(_PIECE_CHECK):
                    self._byte_chars = None
                    self._piece_ids.clear()

    @classmethod
    def from_json_bytes(cls, tokenizer_json: bytes, chat_template: str | None, *, vocab_size: int,
                        bos_token_id: int | None = None, eos_token_id: int | None = None,
                        extra_eos_ids: tuple[int, ...] = ()) -> "Tokenizer":
        """Load the tokenizer.json bytes stored in a .nanoqwen file (vocab_size and the bos/eos ids
        come from its header). A tokenizer with more tokens than the model's vocabulary is an
        error here, not later: text could encode to an id the embedding table has no row for."""
        try:
            hf_tokenizer = tokenizers.Tokenizer.from_str(tokenizer_json.decode("utf-8"))
        except Exception as err:  # invalid UTF-8, or the Rust parser's bare Exception
            raise FormatError(f"the embedded tokenizer.json cannot be loaded: {err}") from None
        tokenizer = cls(hf_tokenizer, chat_template, bos_token_id, eos_token_id, extra_eos_ids)
        if tokenizer.size > vocab_size:
            raise FormatError(f"the embedded tokenizer's ids reach {tokenizer.size - 1} but the model's vocabulary "
                              f"has {vocab_size}: text could encode to ids the model has no embedding for")
        return tokenizer

    @property
    def piece_path(self) -> bool:
        """Whether encode_cached splits new ASCII text itself (_encode_pieces)."""
        return self._byte_chars is not None

    @property
    def size(self) -> int:
        """One past the largest id the tokenizer can produce (added tokens included)."""
        return max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (`<|im_start|>`) become their
        ids, as in transformers; nothing is added around the text (Qwen2.5 has no BOS).
        `encode_batch_fast` is `encode` without the character offsets, which nothing here reads:
        on the 2-core VM, 0.35 ms against 0.42 for ~512 tokens of Python and 3.0 against 3.7 for
        ~4000 (medians, three rounds), time inside `serve`'s time to first token
        (docs/PERFORMANCE.md, "Serve, 2026-12-04 late")."""
        return self._tok.encode_batch_fast([text], add_special_tokens=False)[0].ids

    # Each chunk is one call into the library (~10 us): 512 characters, ~150 tokens, keep that small.
    CHUNK_MIN_CHARS = 512
    CHUNK_MAX_CHARS = 2048  # past this, a chunk ends at any line start LINE_CUT finds
    CACHE_MIN_CHARS = 256  # shorter runs cost less to encode than to look up and keep
    CACHE_CHARS = 2**21  # characters of chunks kept (~600k tokens, ~25 MB with their ids), least recent out
    PARALLEL_CHARS = 8192  # new text from which the library's threads pay (2-core VM; docs/PERFORMANCE.md)
    PIECE_PATH_CHARS = 2**14  # new text from which the library encodes it all, GIL released (encode_cached)
    PIECE_MAX_CHARS = 64  # longer pieces (a run of spaces, a long name) are not kept
    PIECES_KEPT = 2**16  # distinct pieces kept (a few MB); past it the table starts again empty

    def encode_cached(self, text: str) -> list[int]:
        """encode(text), from the ids of the chunks of it seen before; the rest is encoded now.

        `tokenizers` cuts the text at added tokens (`<|file_sep|>`, `<|fim_prefix|>`, ...) before
        anything else and encodes each run between them on its own. With Qwen2's pre-tokenizer
        (`line_cuts`) a run is cut further into chunks at line starts that LINE_CUT finds, where the
        pre-tokenizer cuts too. So the ids of a chunk do not depend on what surrounds it, and the
        result is encode's, token for token (tests check it on three tokenizers, on text that writes
        the added tokens itself, and at every line start).

        An editor sends the same text again and again: the same files of repository context with
        every keystroke, and the file around the cursor, which changes in one place. Only the
        chunks not seen before are encoded, inside `serve`'s time to first token. A chunk ends at
        the first line start in column 0 (a top-level statement) past CHUNK_MIN_CHARS, so an edit,
        or a window of lines that moved by one, changes the chunks around it and leaves the cuts
        after it where they were.

        New text under PIECE_PATH_CHARS takes the piece path where there is one (`piece_path`,
        _encode_new): its ASCII lines are split here and each piece's ids looked up, ~4x faster
        than the library from 500 to 4000 tokens (2-core VM: ~0.1 against ~0.4 us a character).
        It holds the GIL meanwhile, so more new text than that goes to the library, which lets
        other threads (the engine's) run; PARALLEL_CHARS or more of it in one `encode_batch_fast`
        call, which encodes its chunks on all cores."""
        items: list[int | tuple[int, ...] | str] = []  # an added token's id, a known chunk's ids, a new chunk
        for index, part in enumerate(self._added_split.split(text) if self._added_split else (text,)):
            if not part:
                continue
            if index % 2:  # an added token
                items.append(self._added_ids[part])
                continue
            for chunk in self._chunks(part):
                known = None
                if len(chunk) >= self.CACHE_MIN_CHARS:  # shorter chunks are never kept
                    with self._chunks_lock:
                        known = self._chunk_ids.get(chunk)
                        if known is not None:
                            self._chunk_ids.move_to_end(chunk)
                items.append(chunk if known is None else known)
        new = [item for item in items if isinstance(item, str)]
        new_chars = sum(map(len, new))
        if self._byte_chars is not None and new_chars < self.PIECE_PATH_CHARS:
            encoded = {chunk: self._encode_new(chunk) for chunk in new}
        elif new_chars >= self.PARALLEL_CHARS:
            encoded = dict(zip(new, (e.ids for e in self._tok.encode_batch_fast(new, add_special_tokens=False))))
        else:
            encoded = {chunk: self.encode(chunk) for chunk in new}
        with self._chunks_lock:
            for chunk, chunk_ids in encoded.items():
                if self.CACHE_MIN_CHARS <= len(chunk) <= self.CACHE_CHARS and chunk not in self._chunk_ids:
                    self._chunk_ids[chunk] = tuple(chunk_ids)
                    self._cached_chars += len(chunk)
            while self._cached_chars > self.CACHE_CHARS:
                self._cached_chars -= len(self._chunk_ids.popitem(last=False)[0])
        ids: list[int] = []
        for item in items:
            if isinstance(item, int):
                ids.append(item)
            else:
                ids += encoded[item] if isinstance(item, str) else item
        return ids

    def _chunks(self, run: str) -> list[str]:
        """`run` (text between added tokens) in chunks for encode_cached; the whole run where the
        pre-tokenizer is not Qwen2's. A chunk ends at the first LINE_CUT in column 0 at least
        CHUNK_MIN_CHARS after its start, or at the first of any indentation at least
        CHUNK_MAX_CHARS after it, whichever comes first (two searches a chunk, not a step a line)."""
        if not self.line_cuts or len(run) < 2 * self.CHUNK_MIN_CHARS:
            return [run]
        chunks, start = [], 0
        while True:
            cut = LINE_CUT_COLUMN0.search(run, start + max(self.CHUNK_MIN_CHARS - 1, 0))
            if cut is None or cut.end() - start > self.CHUNK_MAX_CHARS:
                indented = LINE_CUT.search(run, start + max(self.CHUNK_MAX_CHARS - 1, 0))
                if indented is not None and (cut is None or indented.end() < cut.end()):
                    cut = indented
            if cut is None:
                break
            chunks.append(run[start:cut.end()])
            start = cut.end()
        chunks.append(run[start:])
        return chunks

    def _encode_new(self, chunk: str) -> list[int]:
        """encode(chunk) on the piece path: its ASCII stretches by _encode_pieces, and the whole
        lines around any other character (from the LINE_CUT before it to the one after it) by the
        library."""
        if chunk.isascii():
            return self._encode_pieces(chunk)
        ids: list[int] = []
        done = 0  # the chunk up to here is encoded; a LINE_CUT (or the chunk's start)
        while (other := NON_ASCII.search(chunk, done)) is not None:
            start = other.start()  # back to the line start before it, or to `done`
            while (line_feed := chunk.rfind("\n", done, start)) >= 0 and not LINE_CUT.match(chunk, line_feed):
                start = line_feed
            start = line_feed + 1 if line_feed >= 0 else done
            after = LINE_CUT.search(chunk, other.end())
            end = after.end() if after is not None else len(chunk)
            if start > done:
                ids += self._encode_pieces(chunk[done:start])
            ids += self.encode(chunk[start:end])
            done = end
        if done < len(chunk):
            ids += self._encode_pieces(chunk[done:])
        return ids

    def _encode_pieces(self, text: str) -> list[int]:
        """encode(text) for ASCII text (`piece_path`): ASCII_SPLIT's pieces, each one's ids kept
        after the library's model gave them for its byte-level characters, as the library does."""
        pieces = ASCII_SPLIT.findall(text)
        try:
            return list(itertools.chain.from_iterable(map(self._piece_ids.__getitem__, pieces)))
        except KeyError:  # a piece not seen yet, or not kept
            return [i for piece in pieces for i in self._piece(piece)]

    def _piece(self, piece: str) -> tuple[int, ...]:
        ids = self._piece_ids.get(piece)
        if ids is None:
            ids = tuple(token.id for token in self._model.tokenize(piece.translate(self._byte_chars)))
            if len(piece) <= self.PIECE_MAX_CHARS:
                if len(self._piece_ids) >= self.PIECES_KEPT:
                    self._piece_ids.clear()
                self._piece_ids[piece] = ids
        return ids

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`, special tokens included; incomplete UTF-8 at the end becomes U+FFFD."""
        return self._tok.decode(ids, skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render a conversation ([{"role": ..., "content": ...}]) as the prompt text the model
        was trained on, ending with the opening of the assistant's turn if asked."""
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=None, documents=None, bos_token=self.bos_token,
                                         eos_token=self.eos_token)
        except jinja2.exceptions.TemplateError as err:
            raise NanoQwenError(f"the chat template failed: {err}") from None
        except Exception as err:  # noqa: BLE001 - a template's own bug (1 + 'a'), not ours: one line
            raise NanoQwenError(f"the chat template failed: {type(err).__name__}: {err}") from None

    def fim_prompt(self, prefix: str, suffix: str) -> str:
        """Qwen2.5-Coder's fill-in-the-middle prompt: the model writes the code between the two."""
        return f"{FIM_PREFIX}{prefix}{FIM_SUFFIX}{suffix}{FIM_MIDDLE}"

    def stream_decoder(self) -> "StreamDecoder":
        return StreamDecoder(self)


class StreamDecoder:
    """Turns token ids into text one token at a time, never splitting a UTF-8 character.

    Decoding the ids seen so far gives U+FFFD for a character whose bytes have not all arrived,
    and only at the end: bytes already decoded into complete characters never change as more
    arrive (UTF-8 is self-synchronising). So the text up to the trailing U+FFFD run is final.
    `pending` holds the ids since the last point where everything decoded was complete, so each
    step decodes a few tokens, not the whole generation.
    """

    REPLACEMENT = "\ufffd"

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._pending: list[int] = []
        self._emitted = 0  # characters of decode(pending) already returned

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly "")."""
        self._pending.append(token_id)
        text = self._tokenizer.decode(self._pending)
        final = text.rstrip(self.REPLACEMENT)
        new = final[self._emitted:]
        if len(final) == len(text):
            self._pending.clear()
            self._emitted = 0
        else:
            self._emitted = len(final)
        return new

    def flush(self) -> str:
        """The rest: characters left incomplete at the end of the generation come out as U+FFFD."""
        rest = self._tokenizer.decode(self._pending)[self._emitted:]
        self._pending.clear()
        self._emitted = 0
        return rest

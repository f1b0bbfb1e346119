"""The tokenizer module: encoding with special tokens, chat templates against transformers'
rendering, FIM prompts, stop ids, and the streaming decoder at every UTF-8 byte boundary."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers

from pynanoqwen.checkpoint import QWEN25_CHAT_TEMPLATE
from pynanoqwen.errors import FormatError, NanoQwenError
from pynanoqwen import tokenizer as tokenizer_module
from pynanoqwen.tokenizer import (ASCII_SPLIT, LINE_CUT, QWEN2_SPLIT_PATTERN, QWEN_DEFAULT_SYSTEM, StreamDecoder,
                                 Tokenizer)

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_prefix|>", "<|fim_middle|>",
           "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]
TRAINING_TEXT = ["def hello(name):\n    return f'hello {name}'\n", "世界你好，中文文本。", "emoji 🙂🚀 café naïve",
                 "for i in range(10):\n    print(i)\n"]
MIXED_TEXT = "héllo 世界 🙂🚀 ok\n中文😀x"


def byte_level_backend() -> HFTokenizer:
    """A byte-level BPE trained on a few strings, with Qwen2.5's special tokens at ids 0..8."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TRAINING_TEXT, trainer)
    return tok


def gpt2_byte_to_char() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE vocabularies are written in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_TO_CHAR = gpt2_byte_to_char()


@pytest.fixture(scope="module")
def backend():
    return byte_level_backend()


@pytest.fixture(scope="module")
def tokenizer(backend):
    return Tokenizer.from_json_bytes(backend.to_str().encode(), None, vocab_size=backend.get_vocab_size(),
                                     bos_token_id=0, eos_token_id=2)


def test_encode_decode_round_trip_and_special_tokens(tokenizer):
    for text in ["def hello(name):", MIXED_TEXT, "naïve café\r\n\tx"]:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    ids = tokenizer.encode("<|im_start|>user\nhi 世界<|im_end|>\n")
    assert ids[0] == 1 and 2 in ids
    assert ids[ids.index(2) + 1:] == tokenizer.encode("\n")
    # Nothing is added around the text (Qwen2.5 has no BOS): decode, which keeps special tokens,
    # gives back exactly the input.
    assert tokenizer.decode(tokenizer.encode("hello")) == "hello"
    assert all(i >= len(SPECIAL) for i in tokenizer.encode("hello"))


def test_stop_ids_are_the_end_and_fim_tokens_the_config_eos_and_the_extra_eos_ids(backend):
    """<|endoftext|>, <|im_end|> and the FIM/repository markers (ids 3..8 here; not <|im_start|>,
    id 1), the header's eos_token_id and its extra end-of-generation ids."""
    json_bytes, vocab = backend.to_str().encode(), {"vocab_size": backend.get_vocab_size()}
    assert Tokenizer.from_json_bytes(json_bytes, None, **vocab).stop_ids == {0, 2, 3, 4, 5, 6, 7, 8}
    assert Tokenizer.from_json_bytes(json_bytes, None, **vocab, eos_token_id=17).stop_ids == {0, 2, 3, 4, 5, 6, 7, 8, 17}
    assert Tokenizer.from_json_bytes(json_bytes, None, **vocab, eos_token_id=2,
                                     extra_eos_ids=(40, 41)).stop_ids == {0, 2, 3, 4, 5, 6, 7, 8, 40, 41}


def test_a_broken_tokenizer_json_is_a_format_error():
    with pytest.raises(FormatError, match="tokenizer.json"):
        Tokenizer.from_json_bytes(b'{"version": "1.0", "model": 5}', None, vocab_size=16)
    with pytest.raises(FormatError, match="tokenizer.json"):
        Tokenizer.from_json_bytes(b"\xff\xfe", None, vocab_size=16)


def test_fallback_chatml_adds_qwen_default_system_prompt(tokenizer):
    assert not tokenizer.has_chat_template
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi 世界"}])
    assert text == (f"<|im_start|>system\n{QWEN_DEFAULT_SYSTEM}<|im_end|>\n"
                    "<|im_start|>user\nHi 世界<|im_end|>\n<|im_start|>assistant\n")
    text = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Q1"},
                                          {"role": "assistant", "content": "A1"},
                                          {"role": "user", "content": "Q2"}], add_generation_prompt=False)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nQ1<|im_end|>\n"
                    "<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nQ2<|im_end|>\n")


CONVERSATIONS = [
    [{"role": "user", "content": "Write quicksort in Python."}],
    [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "Q1 🙂"}, {"role": "assistant", "content": "A1 世界"},
     {"role": "user", "content": "Q2\nwith lines"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
     {"role": "system", "content": "a later system turn"}, {"role": "user", "content": "U2"}],
]


def transformers_render(backend, template, messages, add_generation_prompt, **special):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=template, **special)
    return hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_embedded_qwen25_template_and_fallback_match_transformers(backend, add_generation_prompt):
    embedded = Tokenizer(backend, QWEN25_CHAT_TEMPLATE, eos_token_id=2)
    fallback = Tokenizer(backend, None, eos_token_id=2)
    assert embedded.has_chat_template
    for messages in CONVERSATIONS:
        expected = transformers_render(backend, QWEN25_CHAT_TEMPLATE, messages, add_generation_prompt,
                                       eos_token="<|im_end|>")
        assert embedded.apply_chat_template(messages, add_generation_prompt) == expected
        # The built-in ChatML is the real template's tool-free path, so it renders the same text.
        assert fallback.apply_chat_template(messages, add_generation_prompt) == expected


# Uses what HF templates rely on beyond plain loops: bos/eos globals, tojson (no HTML escaping),
# loop controls, namespace-free whitespace control, and raise_exception.
FEATURE_TEMPLATE = """\
{{ bos_token }}
{% for message in messages %}
    {% if message['role'] not in ['user', 'assistant'] %}
        {{ raise_exception('roles must be user or assistant, got ' + message['role']) }}
    {% endif %}
    {% if loop.index > 3 %}{% break %}{% endif %}
    [{{ message['role'] }}] {{ message['content'] | tojson }}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}[assistant]{% endif %}
"""


def test_template_globals_filters_and_whitespace_match_transformers(backend):
    tok = Tokenizer(backend, FEATURE_TEMPLATE, bos_token_id=0, eos_token_id=2)
    messages = [{"role": "user", "content": "<tag> & \"quotes\" 世界"}, {"role": "assistant", "content": "a"},
                {"role": "user", "content": "b"}, {"role": "assistant", "content": "cut by break"}]
    expected = transformers_render(backend, FEATURE_TEMPLATE, messages, True,
                                   bos_token="<|endoftext|>", eos_token="<|im_end|>")
    assert tok.apply_chat_template(messages) == expected
    assert "<tag>" in expected and "cut by break" not in expected
    with pytest.raises(NanoQwenError, match="roles must be user or assistant, got tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_templates_run_sandboxed(backend):
    mutating = Tokenizer(backend, "{{ messages.append(1) }}")
    with pytest.raises(NanoQwenError, match="chat template failed"):
        mutating.apply_chat_template([{"role": "user", "content": "x"}])
    escaping = Tokenizer(backend, "{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(NanoQwenError, match="chat template failed"):
        escaping.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(FormatError, match="does not compile"):
        Tokenizer(backend, "{% for m in messages %}")


def test_a_template_that_fails_while_rendering_is_one_error(backend):
    with pytest.raises(NanoQwenError, match="chat template failed: TypeError"):
        Tokenizer(backend, "{{ 1 + 'a' }}").apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(FormatError, match=r"does not compile: .*\(line 2\)"):
        Tokenizer(backend, "ok\n{% if %}")


def test_fim_prompt(tokenizer):
    prompt = tokenizer.fim_prompt("def add(a, b):\n", "\n    return c\n")
    assert prompt == "<|fim_prefix|>def add(a, b):\n<|fim_suffix|>\n    return c\n<|fim_middle|>"
    ids = tokenizer.encode(prompt)
    fim_prefix, fim_suffix, fim_middle = (tokenizer.token_to_id(t) for t in
                                          ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"))
    assert ids[0] == fim_prefix and ids[-1] == fim_middle
    split = ids.index(fim_suffix)
    assert tokenizer.decode(ids[1:split]) == "def add(a, b):\n"
    assert tokenizer.decode(ids[split + 1:-1]) == "\n    return c\n"


def complete_prefix(data: bytes) -> str:
    """The characters whose bytes have all arrived (data is a prefix of valid UTF-8)."""
    return data.decode("utf-8", errors="ignore")


def tokenizer_with_pieces(pieces: list[bytes]) -> Tokenizer:
    """A byte-level tokenizer whose vocabulary is exactly `pieces` (ids in order), for driving the
    stream decoder with chosen byte splits; encoding is never used, so it needs no merges."""
    vocab = {}
    for piece in pieces:
        vocab.setdefault("".join(BYTE_TO_CHAR[b] for b in piece), len(vocab))
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.ByteLevel()
    return Tokenizer(tok, None)


def check_stream(tokenizer: Tokenizer, ids: list[int], token_bytes: list[bytes]) -> None:
    """Push ids one at a time; after each push the output is exactly the complete characters."""
    decoder = StreamDecoder(tokenizer)
    out, data = "", b""
    for token_id, piece in zip(ids, token_bytes):
        out += decoder.push(token_id)
        data += piece
        assert out == complete_prefix(data)
    out += decoder.flush()
    assert out == data.decode("utf-8")


@pytest.mark.parametrize("text", [MIXED_TEXT, "🙂", "世", "é", "a🚀b", "日本語のテキスト"])
def test_stream_decoder_one_byte_per_token(backend, tokenizer, text):
    data = text.encode("utf-8")
    ids = [backend.token_to_id(BYTE_TO_CHAR[b]) for b in data]
    check_stream(tokenizer, ids, [bytes([b]) for b in data])


def test_stream_decoder_on_trained_merges(backend, tokenizer):
    split_tokens = 0
    for text in [MIXED_TEXT, "世界你好，中文文本。emoji 🙂🚀 café", "🙂🙂🙂🚀🚀", "日本語"]:
        ids = tokenizer.encode(text)
        pieces = [bytes(tokenizer_bytes(backend, i)) for i in ids]
        split_tokens += sum(not _is_whole_chars(p) for p in pieces)
        check_stream(tokenizer, ids, pieces)
    # The trained merges cut characters ("ðŁ" + "ĻĤ" is 🙂 in two tokens): the case that matters.
    assert split_tokens >= 4


def tokenizer_bytes(backend, token_id: int) -> list[int]:
    char_to_byte = {c: b for b, c in BYTE_TO_CHAR.items()}
    return [char_to_byte[c] for c in backend.id_to_token(token_id)]


def _is_whole_chars(piece: bytes) -> bool:
    try:
        piece.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


@settings(max_examples=150, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("ab \né世界中🙂🚀😀ß\u00a0")), min_size=1, max_size=12),
       cuts=st.lists(st.integers(min_value=1, max_value=60), max_size=20))
def test_stream_decoder_at_arbitrary_byte_splits(text, cuts):
    data = text.encode("utf-8")
    bounds = sorted({c for c in cuts if c < len(data)} | {0, len(data)})
    pieces = [data[a:b] for a, b in zip(bounds, bounds[1:])]
    tokenizer = tokenizer_with_pieces(pieces)
    ids = [tokenizer.token_to_id("".join(BYTE_TO_CHAR[b] for b in p)) for p in pieces]
    check_stream(tokenizer, ids, pieces)


def test_stream_decoder_special_tokens_and_flush(backend, tokenizer):
    decoder = tokenizer.stream_decoder()
    assert decoder.push(tokenizer.token_to_id("<|fim_pad|>")) == "<|fim_pad|>"
    emoji = "🙂".encode()
    first_half = [backend.token_to_id(BYTE_TO_CHAR[b]) for b in emoji[:2]]
    assert decoder.push(first_half[0]) == "" and decoder.push(first_half[1]) == ""
    # A character cut off by the end of the generation comes out as replacement characters.
    rest = decoder.flush()
    assert rest and set(rest) == {"\ufffd"}
    assert decoder.flush() == ""


def test_stream_decoder_holds_a_real_replacement_character_until_it_is_final():
    pieces = ["a".encode(), "\ufffd".encode(), "b".encode()]
    tokenizer = tokenizer_with_pieces(pieces)
    decoder = tokenizer.stream_decoder()
    assert decoder.push(0) == "a"
    assert decoder.push(1) == ""  # it could still be a character whose bytes are arriving
    assert decoder.push(2) == "\ufffdb"
    assert decoder.push(1) == "" and decoder.flush() == "\ufffd"


def embedded_tokenizer() -> Tokenizer:
    """The embedded model's tokenizer: Qwen2's NFC normaliser and split pattern, Qwen2.5's tokens."""
    from pynanoqwen.data import EMBEDDED_MODEL
    from pynanoqwen.fileformat import NanoQwenFile

    with NanoQwenFile(EMBEDDED_MODEL) as f:
        return Tokenizer.from_json_bytes(bytes(f.tokenizer_json), f.chat_template, vocab_size=f.config.vocab_size)


def qwen2_pattern_tokenizer() -> Tokenizer:
    """A byte-level BPE trained on the test's strings with Qwen2's NFC and split pattern, and the
    trim_offsets of Qwen2.5's own tokenizer.json (the embedded one has true there)."""
    tok = HFTokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TRAINING_TEXT, trainer)
    return Tokenizer.from_json_bytes(tok.to_str().encode(), None, vocab_size=tok.get_vocab_size())


EMBEDDED_TOKENIZER = embedded_tokenizer()
QWEN2_PATTERN_TOKENIZER = qwen2_pattern_tokenizer()
# Runs of text around which a boundary could matter: code, a combining accent that NFC joins to the
# letter before it (e\u0301 -> é), spaces, tabs and newlines that the split pattern groups (\r\n,
# and whitespace that is not a space: form feed, no-break space, line separator), punctuation that
# takes the newlines after it, CJK and emoji.
PIECES = ["def f(x):\n    return x + 1\n", "e\u0301", "\u0301", "  ", "\t", "\n", "\n\n", "\r\n", "\x0c", "\u00a0",
          "\u2028", " x", "x", "):", "#", "世界", "🙂", "'s", "<|", "|>", "file_sep", "0123"]
LONG = "".join(f"def helper_{i}(x):\n    return x * {i}\n\n" for i in range(12))  # over the cache's minimum


def test_line_cuts_only_where_the_pretokenizer_is_qwen2s(tokenizer):
    """Chunks at line starts keep the ids of Qwen2's pattern and not of GPT-2's, which glues a line
    feed to the indentation after it; so only the first two cut."""
    assert EMBEDDED_TOKENIZER.line_cuts and QWEN2_PATTERN_TOKENIZER.line_cuts and not tokenizer.line_cuts
    text = "x\n    y"
    assert tokenizer.encode(text) != tokenizer.encode("x\n") + tokenizer.encode("    y")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=40))
def test_every_line_cut_keeps_the_ids(parts):
    """The property encode_cached rests on: text cut at every LINE_CUT match, each piece encoded
    on its own, gives the ids of the whole text, on the two tokenizers with Qwen2's pattern."""
    text = "".join(parts)
    cuts = [0] + [line.end() for line in LINE_CUT.finditer(text)] + [len(text)]
    for tok in (EMBEDDED_TOKENIZER, QWEN2_PATTERN_TOKENIZER):
        assert sum((tok.encode(text[a:b]) for a, b in zip(cuts, cuts[1:])), []) == tok.encode(text)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(PIECES + SPECIAL + [LONG, LONG + "e", "\u0301" + LONG, "x = 'é'\n" + LONG]),
                max_size=14),
       st.sampled_from([(1, 1), (1, 64), (512, 2048)]), st.booleans(), st.booleans())
def test_encode_cached_is_encode_token_for_token(tokenizer, parts, chunk_chars, parallel, piece_path):
    """Whatever the runs between added tokens, however they are cut into chunks (at every line
    start, at column 0 only, as shipped), encoded one by one or in one call, ASCII lines by the
    piece path or not, and however often a chunk comes back (cached or not), encode_cached gives
    encode's ids, on three tokenizers."""
    text = "".join(parts)
    for tok in (tokenizer, EMBEDDED_TOKENIZER, QWEN2_PATTERN_TOKENIZER):
        tok.CHUNK_MIN_CHARS, tok.CHUNK_MAX_CHARS = chunk_chars
        tok.PARALLEL_CHARS = 0 if parallel else Tokenizer.PARALLEL_CHARS
        byte_chars = tok._byte_chars
        if not piece_path:
            tok._byte_chars = None
        try:
            expected = tok.encode(text)
            assert tok.encode_cached(text) == expected
            assert tok.encode_cached(text) == expected  # now from the cache
        finally:
            del tok.CHUNK_MIN_CHARS, tok.CHUNK_MAX_CHARS, tok.PARALLEL_CHARS
            tok._byte_chars = byte_chars


def test_an_edited_line_encodes_only_its_chunk(monkeypatch):
    """An editor's file again with one line changed in the middle: encode_cached encodes the chunk
    that holds the change and takes every other chunk from the cache."""
    tok = embedded_tokenizer()
    functions = [f"def helper_{i}(x, y):\n    total = x * {i} + y\n    return total\n\n\n" for i in range(200)]
    tok.encode_cached("<|fim_prefix|>" + "".join(functions))
    functions[100] = functions[100].replace("total = x", "total = 2 * x")
    edited = "<|fim_prefix|>" + "".join(functions)
    encoded = []
    monkeypatch.setattr(tok, "encode", lambda text: encoded.append(text) or Tokenizer.encode(tok, text))
    monkeypatch.setattr(tok, "_encode_pieces",
                        lambda text: encoded.append(text) or Tokenizer._encode_pieces(tok, text))
    assert tok.encode_cached(edited) == Tokenizer.encode(tok, edited)
    assert len(encoded) == 1 and functions[100] in encoded[0] and len(encoded[0]) < 2 * Tokenizer.CHUNK_MIN_CHARS


# Characters for the piece path's tests: one of each kind the split pattern tells apart in ASCII
# (letters, among them those of the contractions and in both cases, digits, each White_Space
# character, the control characters that Python's \s would take as space and the pattern does not,
# punctuation, the apostrophe), and all 128 in the checks that pair them.
ASCII_KINDS = "aZsSrRetTvVmMlLdD09 \t\n\r\x0b\x0c\x1c\x1f\x00\x7f'(.:;#_-"
CODE = ["def f(x):\n", "    return x\n", "\n\n", "  ", "\t", "\r\n", "It's", " 'LL", "x'd", "0123", "):\n",
        "  # ok\n", "<|", "|>", "file_sep"]


def library_pieces(tok: Tokenizer, text: str) -> list[str]:
    """The library's pre-tokenizer's pieces of `text`, in the text's own characters."""
    char_bytes = {char: chr(byte) for byte, char in tok._byte_chars.items()}
    return ["".join(char_bytes[c] for c in piece) for piece, _ in tok._tok.pre_tokenizer.pre_tokenize_str(text)]


def test_ascii_split_is_the_librarys_split_of_every_ascii_pair_and_kind_triple():
    """ASCII_SPLIT cuts ASCII text where the library's pre-tokenizer, with Qwen2's pattern (the real
    Qwen2.5 tokenizer's), cuts it: every two ASCII characters, every three of ASCII_KINDS."""
    tok = EMBEDDED_TOKENIZER
    texts = [a + b for a in map(chr, range(128)) for b in map(chr, range(128))]
    texts += [a + b + c for a in ASCII_KINDS for b in ASCII_KINDS for c in ASCII_KINDS]
    joined = "\x01".join(texts)  # the pieces of every text at once, and each text's own below
    assert ASCII_SPLIT.findall(joined) == library_pieces(tok, joined)
    for text in texts[::7]:
        assert ASCII_SPLIT.findall(text) == library_pieces(tok, text)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(CODE), st.text(alphabet=st.characters(max_codepoint=127), max_size=6)),
                max_size=30))
def test_the_piece_path_is_the_librarys_encode_on_ascii_text(parts):
    """On any ASCII text (without added tokens), the piece path's ids are the library's, on both
    tokenizers with Qwen2's pattern; kept pieces give the same ids again."""
    text = "".join(parts)
    for tok in (EMBEDDED_TOKENIZER, QWEN2_PATTERN_TOKENIZER):
        for added in tok._added_ids:
            text = text.replace(added, "")
        assert "".join(ASCII_SPLIT.findall(text)) == text
        expected = tok.encode(text)
        assert tok._encode_pieces(text) == expected
        assert tok._encode_pieces(text) == expected


def test_the_piece_path_only_where_it_gives_the_librarys_ids(tokenizer, monkeypatch):
    """On for Qwen2's pattern; off for GPT-2's (no line cuts), and off when the construction's check
    against the library fails (here: a split pattern that keeps a line feed with the indentation)."""
    assert EMBEDDED_TOKENIZER.piece_path and QWEN2_PATTERN_TOKENIZER.piece_path and not tokenizer.piece_path
    monkeypatch.setattr(tokenizer_module, "ASCII_SPLIT", tokenizer_module.re.compile(r"\s+(?!\S)|\S+|\s+"))
    tok = embedded_tokenizer()
    assert not tok.piece_path and not tok._piece_ids
    text = "<|fim_prefix|>" + LONG + "x\n    y"
    assert tok.encode_cached(text) == tok.encode(text)


def test_a_non_ascii_character_sends_only_its_lines_to_the_library(monkeypatch):
    """A new chunk with one non-ASCII line: the library encodes the lines from the line start before
    it to the one after it; the rest takes the piece path. The ids are encode's."""
    tok = embedded_tokenizer()
    lines = [f"def helper_{i}(x):\n    return x * {i}\n" for i in range(30)]
    lines[12] = "def helper_12(x):\n    return x * '\u00e9'  # caf\u00e9\n"
    text = "<|fim_prefix|>" + "".join(lines) + "<|fim_suffix|>"
    library = []
    monkeypatch.setattr(tok, "encode", lambda text: library.append(text) or Tokenizer.encode(tok, text))
    assert tok.encode_cached(text) == Tokenizer.encode(tok, text)
    assert library == ["    return x * '\u00e9'  # caf\u00e9\n"]


def test_the_piece_table_is_bounded():
    """Pieces longer than PIECE_MAX_CHARS are not kept, and the table starts again empty past
    PIECES_KEPT; the ids stay the library's."""
    tok = embedded_tokenizer()
    tok.PIECES_KEPT = 40
    text = "".join(f"name_{i} = {i} + value_{i}\n" for i in range(100)) + " " * 100 + "x" * 100
    assert tok._encode_pieces(text) == tok.encode(text)
    assert 0 < len(tok._piece_ids) <= 40 and max(map(len, tok._piece_ids)) <= tok.PIECE_MAX_CHARS
    assert tok._encode_pieces(text) == tok.encode(text)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(PIECES + SPECIAL + [LONG]), max_size=14))
def test_encode_is_the_librarys_encode_without_offsets(tokenizer, parts):
    """Tokenizer.encode runs `encode_batch_fast` on one text for speed; its ids must be `encode`'s."""
    text = "".join(parts)
    for tok in (tokenizer, EMBEDDED_TOKENIZER):
        assert tok.encode(text) == tok._tok.encode(text, add_special_tokens=False).ids


def test_encode_cached_keeps_a_bounded_number_of_characters():
    """The cache holds at most CACHE_CHARS characters of chunks, the most recent ones, and no chunk
    longer than that (a body may be 16 MiB of one line)."""
    tok = embedded_tokenizer()
    tok.CACHE_CHARS = 50 * len(LONG)
    files = [f"<|file_sep|>f{i}.py\n{LONG}{i}" for i in range(60)]
    for text in files + ["x" * (tok.CACHE_CHARS + 1)]:
        assert tok.encode_cached(text) == tok.encode(text)
    kept = sum(map(len, tok._chunk_ids))
    assert kept == tok._cached_chars and tok.CACHE_CHARS - len(LONG) - 3 < kept <= tok.CACHE_CHARS
    assert files[-1].split("<|file_sep|>")[1] in tok._chunk_ids and files[0].split("<|file_sep|>")[1] not in tok._chunk_ids


def test_much_new_text_goes_to_the_library_at_once(monkeypatch):
    """New text of PIECE_PATH_CHARS or more is the library's (it lets other threads run while it
    encodes); less takes the piece path. Either way the ids are encode's."""
    tok = embedded_tokenizer()
    tok.PIECE_PATH_CHARS = 4 * len(LONG)
    split = []
    monkeypatch.setattr(tok, "_encode_pieces", lambda text: split.append(text) or Tokenizer._encode_pieces(tok, text))
    much = "<|fim_prefix|>" + "".join(LONG.replace("helper", f"much_{i}") for i in range(4))
    assert tok.encode_cached(much) == tok.encode(much) and not split
    little = "<|fim_prefix|>" + LONG.replace("helper", "little")
    assert tok.encode_cached(little) == tok.encode(little) and split

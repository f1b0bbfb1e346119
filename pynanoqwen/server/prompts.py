"""The prompt layout of the server's endpoint that `generate` does not have: /infill's, with
repository context. (What ends a fill-in-the-middle is the tokenizer's: tokenizer.STOP_TOKENS.)

/infill lays its request out as llama.cpp's server does for a model with repository tokens, which
is Qwen2.5-Coder's repository-level completion format (its model card):

    <|repo_name|>myproject\\n
    <|file_sep|>{input_extra[0].filename}\\n{input_extra[0].text}
    <|file_sep|>{input_extra[1].filename}\\n{input_extra[1].text}
    ...
    <|file_sep|>filename\\n
    <|fim_prefix|>{input_prefix}{prompt}<|fim_suffix|>{input_suffix}<|fim_middle|>

"myproject" and "filename" are llama.cpp's placeholders: the request names neither the repository
nor the file being edited, and keeping llama.cpp's text keeps completions the same as there. A
chunk without a filename is named "tmp", as in llama.cpp. `prompt` (the editor's current line up
to the cursor) ends the prefix, where llama.cpp's code places it. Unlike llama.cpp nothing is cut
to fit: a prompt longer than the context is refused (server/protocol.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..tokenizer import FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX

REPO_NAME, FILE_SEP = "<|repo_name|>", "<|file_sep|>"
REPO_PLACEHOLDER, FILE_PLACEHOLDER, CHUNK_PLACEHOLDER = "myproject", "filename", "tmp"


def infill_prompt(input_prefix: str, input_suffix: str, input_extra: Sequence[dict], prompt: str) -> str:
    """The text of an /infill request in the repository-level layout above; each chunk of
    input_extra has its "filename" (CHUNK_PLACEHOLDER where the request gave none) and "text"."""
    files = "".join(f"{FILE_SEP}{chunk['filename']}\n{chunk['text']}"
                    for chunk in input_extra)
    return (f"{REPO_NAME}{REPO_PLACEHOLDER}\n{files}{FILE_SEP}{FILE_PLACEHOLDER}\n"
            f"{FIM_PREFIX}{input_prefix}{prompt}{FIM_SUFFIX}{input_suffix}{FIM_MIDDLE}")


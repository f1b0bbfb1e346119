"""Text-level stops, applied to the detokenized stream as it grows.

A stop string is matched on text, not on tokens: "\\n\\n" may arrive as "\\n" + "\\n", or inside a
token "\\n\\n\\t". So `TextStops.push` holds back the end of the text for as long as it could be the
start of a stop string, and never emits a stop string or anything after it.

It also applies llama.cpp's `n_indent` (/infill): after the first line break in the generated
text, a line whose first non-blank character is indented less than n_indent ends the generation
before that character (its indentation is kept, as llama.cpp keeps it).
"""

from __future__ import annotations

from collections.abc import Sequence

INDENT_CHARS = " \t"


class TextStops:
    def __init__(self, stop: Sequence[str] = (), n_indent: int = 0):
        self.stop = tuple(s for s in stop if s)
        self.n_indent = n_indent
        self._held = ""               # text not sent yet: it may be the start of a stop string
        self._at_line_start = False   # only indentation so far on a line after a line break
        self._indent = 0
        self.reason: str | None = None  # "word" or "indent" once stopped
        self.stopping_word = ""

    def push(self, text: str) -> str:
        """Add generated text; return what can be sent now. Once `reason` is set, generation
        must stop and nothing more is sent."""
        if self.reason is not None:
            return ""
        cut = self._indent_cut(text)
        if cut is not None:
            text = text[:cut]
        buffer = self._held + text
        found = [(buffer.find(s), s) for s in self.stop if s in buffer]
        if found:
            at, self.stopping_word = min(found)
            self.reason, self._held = "word", ""
            return buffer[:at]
        if cut is not None:
            self.reason, self._held = "indent", ""
            return buffer
        keep = max((j for s in self.stop for j in range(1, len(s)) if buffer.endswith(s[:j])), default=0)
        self._held = buffer[len(buffer) - keep:]
        return buffer[:len(buffer) - keep]

    def flush(self) -> str:
        """At the end of the generation: the text held back, which turned out not to be a stop."""
        rest, self._held = ("" if self.reason else self._held), ""
        return rest

    def _indent_cut(self, text: str) -> int | None:
        """Where in `text` an under-indented line begins, or None; advances the line state."""
        if not self.n_indent:
            return None
        for i, char in enumerate(text):
            if char == "\n":
                self._at_line_start = True
                self._indent = 0
            elif self._at_line_start and char in INDENT_CHARS:
                self._indent += 1
            elif self._at_line_start:
                self._at_line_start = False
                if self._indent < self.n_indent:
                    return i
        return None

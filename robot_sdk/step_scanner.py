"""Finds the complete elements of a plan's ``steps`` array while its JSON text is still arriving.

A streamed plan looks like ``{"steps": [{...}, {...`` for most of its life. ``StepScanner``
reads each new character once (a small JSON tokenizer: a container stack, string and escape
state, and whether the next string is a key) and reports every element of the top-level
object's ``steps`` array as soon as its closing brace arrives::

    {"steps": [{"skill": "pick", "args": {"x": "}"}}, {"skill": ...
              |<------------ element 0 ------------>|  ^ reported here

It does not validate: on malformed text it may report fewer elements, or text that does not
decode; decoding and checking each element is the caller's job, and the whole answer is
decoded again at the end.
"""

from __future__ import annotations

import json


class StepScanner:
    def __init__(self) -> None:
        self._text = ""
        self._pos = 0  # next character to read
        self._stack: list[str] = []  # open containers: "{" or "["
        self._in_string = False
        self._escape = False
        self._string_start = 0
        self._string_is_key = False
        self._expect_key = False  # inside an object, after "{" or ","
        self._top_key: str | None = None  # the last key of the top-level object
        self._in_steps = False  # inside the top-level "steps" array
        self._element_start: int | None = None
        self._count = 0

    @property
    def text(self) -> str:
        return self._text

    def feed(self, delta: str) -> list[tuple[int, str]]:
        """Append ``delta``; returns ``(index, element JSON text)`` for each ``steps`` element
        completed by it, in order, each exactly once over the life of the scanner."""
        self._text += delta
        found: list[tuple[int, str]] = []
        text = self._text
        for i in range(self._pos, len(text)):
            c = text[i]
            if self._in_string:
                self._read_string_char(c, i)
            elif c == '"':
                self._in_string, self._string_start = True, i
                self._string_is_key, self._expect_key = self._expect_key, False
            elif c in "{[":
                self._open(c, i)
            elif c in "}]":
                element = self._close(c, i)
                if element is not None:
                    found.append((self._count, element))
                    self._count += 1
            elif c == "," and self._stack and self._stack[-1] == "{":
                self._expect_key = True
        self._pos = len(text)
        return found

    def _read_string_char(self, c: str, i: int) -> None:
        if self._escape:
            self._escape = False
        elif c == "\\":
            self._escape = True
        elif c == '"':
            self._in_string = False
            if self._string_is_key and len(self._stack) == 1:
                self._top_key = json.loads(self._text[self._string_start: i + 1])

    def _open(self, c: str, i: int) -> None:
        depth = len(self._stack)
        if c == "[" and depth == 1 and self._top_key == "steps":
            self._in_steps = True
        if c == "{" and depth == 2 and self._in_steps:
            self._element_start = i
        self._stack.append(c)
        self._expect_key = c == "{"

    def _close(self, c: str, i: int) -> str | None:
        """Pops a container; returns an element's text when this closed one."""
        if self._stack:
            self._stack.pop()
        self._expect_key = False
        depth = len(self._stack)
        if depth == 1 and c == "]":
            self._in_steps = False
        if depth == 2 and c == "}" and self._in_steps and self._element_start is not None:
            start, self._element_start = self._element_start, None
            return self._text[start: i + 1]
        return None

"""Names the user chose, made safe for the text partc writes: reports and emitted code.

A model's name, a factory's, a module's or a layer's comes from the user and may hold
anything a Python string holds. :func:`one_line` keeps such a name on its line, with
control characters (a newline, a terminal's escape sequence) written as their Python
escapes: inside a ``#`` comment of generated code a newline would otherwise start a live
line. :func:`identifier` makes a Python identifier of a name that must be one (a class
in the emitted code). Markdown's own escaping is the report's
(:func:`partc.report.text.markdown_text`).
"""

from __future__ import annotations

import keyword
import re

# C0 and C1 control characters, and the two Unicode line breaks Python also splits on.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_NOT_WORD = re.compile(r"\W")
_NOT_ASCII_WORD = re.compile(r"[^A-Za-z0-9_]")


def one_line(text: object) -> str:
    """``text`` on one line: each control character written as its Python escape
    (``"a\\nb"`` -> ``a\\\\nb``); everything else as it is."""
    return _CONTROL.sub(lambda found: repr(found.group())[1:-1], str(text))


def identifier(name: str) -> str:
    """``name`` as a Python identifier: every character that cannot be in one replaced
    by ``_``, and ``_`` in front of a leading digit, a keyword or nothing (``"0"`` ->
    ``_0``, ``"a-b"`` -> ``a_b``)."""
    word = _NOT_WORD.sub("_", name)
    if not word or not word.isidentifier() or keyword.iskeyword(word):
        word = "_" + word
    # A word character Python does not take in names (a combining mark first, ...).
    return word if word.isidentifier() else _NOT_ASCII_WORD.sub("_", word)

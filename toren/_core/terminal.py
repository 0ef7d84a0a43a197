"""Text from runs, made safe to print on a terminal.

Everything a run holds came from somewhere untrusted: model output, tool results, human
messages, error texts, even agent and worker names. Printed as it is, such text can drive the
terminal (``\\x1b[2J`` clears it, ``\\x1b]8;;URL\\x1b\\\\`` hides a link behind harmless words,
``\\x1b]0;...\\x07`` retitles the window), reorder what the reader sees (the bidi overrides
U+202A-U+202E and U+2066-U+2069, as in "Trojan Source"), or, read as rich markup
(``[link=...]``, ``[/oops]``), restyle the output or crash the command.

:func:`printable` is the one escaping function the CLI prints run text through: control
characters become visible escapes, so every sequence prints inert::

    "\\x1b[31mred"   ->  "\\\\x1b[31mred"   (the four characters backslash, x, 1, b)
    "abc\\u202edef"  ->  "abc\\\\u202edef"

and :func:`plain` wraps the result in a :class:`rich.text.Text`, which rich never parses for
markup, emoji codes or highlighting. Backslashes are not doubled (a path or a JSON text stays
readable), so the escapes are for reading, not for decoding: text that already holds
``\\x1b`` prints the same as an escaped ESC, but neither drives the terminal.
"""

from __future__ import annotations

import re

from rich.text import Text

# C0 controls but newline and tab, DEL, C1 controls: written \xNN.
_CONTROLS = [*range(0x09), *range(0x0B, 0x20), *range(0x7F, 0xA0)]
# Bidi embeddings, overrides and isolates, and the implicit marks: written \uNNNN.
_BIDI = [0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)]
_SURROGATES = range(0xD800, 0xE000)  # lone surrogates (UTF-8 cannot even encode them)
# What breaks a line or hides text without showing: the line and paragraph separators, the
# zero-width space, the word joiner and invisible operators, the byte order mark, and the tag
# characters (invisible letters, used to smuggle text past a reader).
_INVISIBLE = [0x2028, 0x2029, 0x200B, *range(0x2060, 0x2065), 0xFEFF]
_TAGS = range(0xE0000, 0xE0080)

_ESCAPES: dict[int, str] = {
    **{c: f"\\x{c:02x}" for c in _CONTROLS},
    **{c: f"\\u{c:04x}" for c in (*_BIDI, *_SURROGATES, *_INVISIBLE)},
    **{c: f"\\U{c:08x}" for c in _TAGS},
}
_UNSAFE = re.compile(
    "["
    + "".join(re.escape(chr(c)) for c in (*_CONTROLS, *_BIDI, *_INVISIBLE))
    + "\ud800-\udfff\U000e0000-\U000e007f]"
)


def printable(text: str) -> str:
    """``text`` with every character that could drive or reorder a terminal written as an
    escape: C0 controls but newline and tab, DEL, C1 controls, bidi controls, lone
    surrogates, and the invisible characters that break a line or hide text (line and paragraph
    separators, zero-width space, word joiner, byte order mark, tag characters). Text without
    any is returned as it is (one regular-expression scan), so escaping twice is escaping
    once."""
    if _UNSAFE.search(text):
        return text.translate(_ESCAPES)
    return text


def plain(text: str, style: str = "") -> Text:
    """:func:`printable` ``text`` as a rich :class:`~rich.text.Text`: printed or put in a table
    cell, it is never read as markup (``[link=...]`` stays those characters) nor highlighted."""
    return Text(printable(text), style=style)

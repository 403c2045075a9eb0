"""How every command writes for a person: text made safe for a terminal, times and durations
in words, and tables whose columns follow their content. ``--json`` output needs none of it."""

from __future__ import annotations

import time
import unicodedata
from collections.abc import Sequence

#: Format characters kept as they are: the joiner inside emoji sequences.
_KEPT_FORMAT_CHARACTERS = frozenset("\u200d")


def printable(value: object, keep_newlines: bool = False) -> str:
    """``value`` as text safe for a terminal: control characters (ESC sequences, carriage
    returns, newlines unless ``keep_newlines``...), line separators and invisible format
    characters (bidirectional overrides, zero-width spaces) written as ``\\xNN`` or
    ``\\uNNNN``. Row values are producer data: printed raw, they could rewrite the screen or
    hide text from the operator reading it. JSON output needs none of this: JSON escapes."""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(char if (keep_newlines and char == "\n") or not _hidden(char) else _escaped(char) for char in text)


def format_app(app_code: str) -> str:
    """An app code as the operator would type it after ``--app-code``: the default app (``''``)
    quoted, so that it does not read as nothing."""
    return printable(app_code) if app_code else "''"


def _hidden(char: str) -> bool:
    category = unicodedata.category(char)
    return category in ("Cc", "Zl", "Zp") or (category == "Cf" and char not in _KEPT_FORMAT_CHARACTERS)


def _escaped(char: str) -> str:
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def format_time(epoch_ms: int, now_ms: int) -> str:
    """``2026-12-01 09:01:02 (3 min ago)`` or ``(in 25 s)``: local time, for a person; the
    ``--json`` output keeps the epoch milliseconds."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch_ms / 1000))
    return f"{stamp} ({format_relative(epoch_ms - now_ms)})"


def format_relative(delta_ms: int) -> str:
    """``3 min ago`` for a negative difference, ``in 3 min`` for a positive one."""
    amount = format_age(abs(delta_ms))
    return f"{amount} ago" if delta_ms <= 0 else f"in {amount}"


def format_age(ms: float) -> str:
    """A duration in milliseconds as a person reads it, in whole units of the largest that
    fits: ``25 s``, ``3 min``, ``2 h``, ``7 d`` (negative: ``0 s``). Every command's ages and
    waits use it."""
    seconds = int(max(0, ms)) // 1000
    unit, size = next(((unit, size) for unit, size in _UNITS if seconds >= size), ("s", 1))
    return f"{seconds // size} {unit}"


_UNITS = (("d", 86400), ("h", 3600), ("min", 60), ("s", 1))


#: The tables' cell for "no value".
NONE = "-"


def format_table(
    headers: Sequence[str], rows: Sequence[Sequence[object]], right: Sequence[str] = (), indent: str = ""
) -> list[str]:
    """Lines of a table; ``right``: the headers of the columns aligned right (counts, ages)."""
    cells = [[printable(cell) for cell in row] for row in rows]
    widths = [max([len(header), *(len(row[i]) for row in cells)]) for i, header in enumerate(headers)]
    last = len(headers) - 1

    def aligned(i: int, value: str) -> str:
        if headers[i] in right:
            return value.rjust(widths[i])
        return value if i == last else value.ljust(widths[i])  # the last column stays ragged

    def line(values: Sequence[str]) -> str:
        return (indent + "  ".join(aligned(i, value) for i, value in enumerate(values))).rstrip()

    return [line(list(headers)), *(line(row) for row in cells)]

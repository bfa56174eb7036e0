"""JSON text as it streams in, rewritten in the canonical form of `json.dumps(value, ensure_ascii=False)`.

A tool parser reports a call's arguments as `json.dumps` of the parsed value (whitespace and number
spelling normalised). While the call is still being generated, `canonical_json_prefix` gives the part of
that final string already certain from the raw text so far, so streamed argument fragments concatenate to
exactly the non-streamed `arguments`. Incomplete tokens (a number that may go on, a half escape) are held.
"""

from __future__ import annotations

import json

_WS = " \t\n\r"
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_SCALAR_CHARS = frozenset("+-0123456789.eEtruefalsnNaIiy")


def _dump_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def _scan_string(raw: str, i: int) -> tuple[str, int | None]:
    """Decode the string whose opening quote is at `i`: (decoded text so far, index after the closing quote
    or None while the string is incomplete)."""
    out: list[str] = []
    j = i + 1
    n = len(raw)
    while j < n:
        c = raw[j]
        if c == '"':
            return "".join(out), j + 1
        if c != "\\":
            out.append(c)
            j += 1
            continue
        if j + 1 >= n:
            break
        e = raw[j + 1]
        if e in _ESCAPES:
            out.append(_ESCAPES[e])
            j += 2
            continue
        if e != "u" or j + 6 > n:
            break  # an invalid escape, or a \\u escape not complete yet
        try:
            code = int(raw[j + 2 : j + 6], 16)
        except ValueError:
            break
        if 0xD800 <= code < 0xDC00:  # a high surrogate: json.loads pairs it with a following \\uDCxx
            rest = raw[j + 6 : j + 12]
            if len(rest) < 6 and "\\u".startswith(rest[:2]) and len(raw) == j + 6 + len(rest):
                break  # the pair may still come
            if rest.startswith("\\u"):
                try:
                    low = int(rest[2:6], 16)
                except ValueError:
                    low = 0
                if 0xDC00 <= low < 0xE000:
                    out.append(chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)))
                    j += 12
                    continue
        out.append(chr(code))
        j += 6
    return "".join(out), None


def canonical_json_prefix(raw: str, start: int = 0) -> tuple[str, int | None]:
    """The canonical text certain so far of the JSON value starting at `raw[start]` (leading whitespace
    allowed), and the index just past the value once it is complete (None while it is not, or where the
    text stops being JSON)."""
    out: list[str] = []
    depth = 0
    i = start
    n = len(raw)
    while i < n:
        c = raw[i]
        if c in _WS:
            i += 1
            continue
        if c in "{[":
            depth += 1
            out.append(c)
            i += 1
            continue
        if c in "}]":
            if depth == 0:
                break
            depth -= 1
            out.append(c)
            i += 1
            if depth == 0:
                return "".join(out), i
            continue
        if depth > 0 and c == ":":
            out.append(": ")
            i += 1
            continue
        if depth > 0 and c == ",":
            out.append(", ")
            i += 1
            continue
        if c == '"':
            text, end = _scan_string(raw, i)
            if end is None:
                out.append(_dump_str(text)[:-1])  # the opening quote and the characters so far
                return "".join(out), None
            out.append(_dump_str(text))
            i = end
            if depth == 0:
                return "".join(out), i
            continue
        if c in _SCALAR_CHARS:
            j = i
            while j < n and raw[j] in _SCALAR_CHARS:
                j += 1
            if j == n:
                break  # a number or literal that may go on
            try:
                value = json.loads(raw[i:j])
            except ValueError:
                break
            out.append(json.dumps(value))
            i = j
            if depth == 0:
                return "".join(out), i
            continue
        break
    return "".join(out), None

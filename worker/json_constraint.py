"""JSON mode's validator: whether bytes extend a prefix of one JSON object (RFC 8259), byte by byte.

A pushdown automaton whose state is a small mode plus the stack of open containers ('{' or '['):

    state = ("start", "")        nothing yet (whitespace may come before the object)
    advance(state, b'{"a": [1')  -> ("int", "{[")      inside a number, in an array, in an object
    advance(_, b"]}")            -> ("done", "")       the object is complete: no byte may follow
    advance(("start", ""), b"[") -> None               the top-level value must be an object

States are plain tuples of strings: hashable (token masks are cached per state, json_vocab.py) and
copied for free. Control bytes below 0x20 are refused in strings (RFC 8259 wants them escaped), and so is
any byte >= 0x80 that is not part of well-formed UTF-8 (RFC 3629: no overlong form, no surrogate
D800-DFFF, nothing past U+10FFFF), since a JSON text must be UTF-8; for the same reason an escaped
surrogate (\\uD83D\\uDE00) is accepted only as a high-low pair. A character may be split across
tokens: its lead byte opens a mode "<string mode>~<bytes left><lowest><highest next byte, hex>",

    advance(("str", "{"), b"\xe4")  -> ("str~280bf", "{")  two continuation bytes 80..BF to come
    advance(("str", "{"), b"\xed")  -> ("str~2809f", "{")  80..9F next: ED A0..BF would be a surrogate
    advance(("str~280bf", "{"), b'\xb8"') -> None           the quote cuts the character
"""

from __future__ import annotations

import re

JsonState = tuple[str, str]  # (mode, open containers, innermost last)

START: JsonState = ("start", "")
DONE = "done"

_WS = frozenset(b" \t\n\r")
_DIGITS = frozenset(b"0123456789")
_HEX = frozenset(b"0123456789abcdefABCDEF")
_ESCAPES = frozenset(b'"\\/bfnrt')
_LITERALS = {ord("t"): "lit:rue", ord("f"): "lit:alse", ord("n"): "lit:ull"}
_NUMBER_ENDS = frozenset({"zero", "int", "frac", "exp_int"})  # a number may end here (on a delimiter)

# A run of plain string content: printable ASCII but '"' and '\\', and whole well-formed UTF-8 characters.
_PLAIN_RUN = re.compile(
    rb"(?:[\x20\x21\x23-\x5b\x5d-\x7f]|[\xc2-\xdf][\x80-\xbf]|\xe0[\xa0-\xbf][\x80-\xbf]"
    rb"|[\xe1-\xec\xee\xef][\x80-\xbf]{2}|\xed[\x80-\x9f][\x80-\xbf]|\xf0[\x90-\xbf][\x80-\xbf]{2}"
    rb"|[\xf1-\xf3][\x80-\xbf]{3}|\xf4[\x80-\x8f][\x80-\xbf]{2})*"
)


def _utf8_leads() -> dict[int, str]:
    """Lead byte -> the mode suffix it opens: continuation bytes left, then the range of the next one."""
    leads = {c: "180bf" for c in range(0xC2, 0xE0)}  # C0, C1 would be overlong
    leads |= {c: "280bf" for c in range(0xE1, 0xF0)}
    leads |= {0xE0: "2a0bf", 0xED: "2809f"}  # no overlong 3-byte form; no surrogate
    leads |= {c: "380bf" for c in range(0xF1, 0xF4)}
    leads |= {0xF0: "390bf", 0xF4: "3808f"}  # no overlong 4-byte form; nothing past U+10FFFF
    return leads


_UTF8_LEADS = _utf8_leads()


def is_complete(state: JsonState) -> bool:
    return state[0] == DONE


def is_in_string(state: JsonState) -> bool:
    """Inside a key or value string, outside an escape or a character: plain content leaves the state as it is."""
    return state[0] in ("str", "key")


def _value(c: int, stack: str) -> JsonState | None:
    """The state after the first byte `c` of a value."""
    if c == 0x22:  # '"'
        return "str", stack
    if c == 0x7B:  # '{'
        return "obj_open", stack + "{"
    if c == 0x5B:  # '['
        return "arr_open", stack + "["
    if c == 0x2D:  # '-'
        return "minus", stack
    if c == 0x30:
        return "zero", stack
    if c in _DIGITS:
        return "int", stack
    lit = _LITERALS.get(c)
    return (lit, stack) if lit else None


def _close(stack: str) -> JsonState:
    stack = stack[:-1]
    return (DONE, "") if not stack else ("after", stack)


def _after(c: int, stack: str) -> JsonState | None:
    """After a value inside a container: whitespace, ',' or the matching closing bracket."""
    if c in _WS:
        return "after", stack
    top = stack[-1]
    if c == 0x2C:  # ','
        return ("obj_key", stack) if top == "{" else ("value", stack)
    if (c == 0x7D and top == "{") or (c == 0x5D and top == "["):
        return _close(stack)
    return None


def _step(mode: str, stack: str, c: int) -> JsonState | None:
    """One byte outside the plain-string fast path."""
    if mode in ("str", "key"):
        if c == 0x22:
            return ("after", stack) if mode == "str" else ("colon", stack)
        if c == 0x5C:  # '\\'
            return mode + "_esc", stack
        lead = _UTF8_LEADS.get(c)  # else a control byte, a stray continuation byte or one never in UTF-8
        return (f"{mode}~{lead}", stack) if lead else None
    if "~" in mode:  # inside a UTF-8 character
        base, rest = mode.split("~")
        if not int(rest[1:3], 16) <= c <= int(rest[3:5], 16):
            return None
        left = int(rest[0]) - 1
        return (base, stack) if left == 0 else (f"{base}~{left}80bf", stack)
    if mode.endswith("_esc"):
        base = mode[:-4]
        if c in _ESCAPES:
            return base, stack
        return (base + "_u4", stack) if c == 0x75 else None  # 'u'
    if mode.startswith(("str_", "key_")):  # inside a \u escape (four hex digits)
        nxt = _unicode_escape(mode, c)
        return None if nxt is None else (nxt, stack)
    if mode == "start":
        if c in _WS:
            return "start", ""
        return ("obj_open", "{") if c == 0x7B else None
    if mode in ("value", "arr_open"):
        if c in _WS:
            return mode, stack
        if mode == "arr_open" and c == 0x5D:
            return _close(stack)
        return _value(c, stack)
    if mode in ("obj_open", "obj_key"):
        if c in _WS:
            return mode, stack
        if c == 0x22:
            return "key", stack
        return _close(stack) if mode == "obj_open" and c == 0x7D else None
    if mode == "colon":
        if c in _WS:
            return "colon", stack
        return ("value", stack) if c == 0x3A else None
    if mode == "after":
        return _after(c, stack)
    if mode.startswith("lit:"):
        rest = mode[4:]
        if c != ord(rest[0]):
            return None
        return ("after", stack) if len(rest) == 1 else ("lit:" + rest[1:], stack)
    return _number(mode, stack, c)


def _unicode_escape(mode: str, c: int) -> str | None:
    """The mode after byte `c` inside a \\u escape (four hex digits) of a string or key. A surrogate (D800-DFFF) is only
    valid as a pair, a high one then an escaped low one: a lone surrogate is not text, and strict parsers
    (serde_json, Go's encoding/json replaces it) refuse or mangle it. Modes: `_u<n>` n hex digits left,
    `_ud` a D was read, `_h<n>` digits left of a high surrogate, `_hi` its pair's backslash next, `_hiu` its
    'u', `_lo4` its D, `_lo3` its second digit C-F."""
    base, _, part = mode.partition("_")
    if part == "hi":
        return f"{base}_hiu" if c == 0x5C else None
    if part == "hiu":
        return f"{base}_lo4" if c == 0x75 else None
    if c not in _HEX:
        return None
    digit = int(chr(c), 16)
    if part == "u4":
        return f"{base}_ud" if digit == 0xD else f"{base}_u3"
    if part == "ud":  # D0-D7: a BMP character; D8-DB: a high surrogate; DC-DF: a lone low one
        return f"{base}_u2" if digit < 8 else f"{base}_h2" if digit < 0xC else None
    if part in ("u3", "u2", "u1"):
        left = int(part[1]) - 1
        return base if left == 0 else f"{base}_u{left}"
    if part in ("h2", "h1"):
        return f"{base}_h1" if part == "h2" else f"{base}_hi"
    if part == "lo4":
        return f"{base}_lo3" if digit == 0xD else None
    if part == "lo3":
        return f"{base}_u2" if digit >= 0xC else None
    raise AssertionError(f"unknown escape mode {mode!r}")


def _number(mode: str, stack: str, c: int) -> JsonState | None:
    digit = c in _DIGITS
    if mode == "minus":
        return ("zero" if c == 0x30 else "int", stack) if digit else None
    if mode == "int" and digit:
        return "int", stack
    if mode in ("zero", "int") and c == 0x2E:  # '.'
        return "dot", stack
    if mode in ("zero", "int", "frac") and c in (0x65, 0x45):  # 'e', 'E'
        return "exp", stack
    if mode in ("dot", "frac") and digit:
        return "frac", stack
    if mode == "exp" and c in (0x2B, 0x2D):  # '+', '-'
        return "exp_sign", stack
    if mode in ("exp", "exp_sign", "exp_int") and digit:
        return "exp_int", stack
    if mode in _NUMBER_ENDS:  # the number ended: this byte follows it
        return _after(c, stack)
    return None


def advance(state: JsonState, data: bytes) -> JsonState | None:
    """The state after `data`, or None when `data` cannot continue a JSON object's prefix from `state`."""
    mode, stack = state
    i, n = 0, len(data)
    while i < n:
        if mode == DONE:
            return None
        if mode in ("str", "key"):  # skip the run of plain content at once
            i = _PLAIN_RUN.match(data, i).end()
            if i == n:
                return mode, stack
        nxt = _step(mode, stack, data[i])
        if nxt is None:
            return None
        mode, stack = nxt
        i += 1
    return mode, stack


def is_valid_prefix(data: bytes) -> bool:
    return advance(START, data) is not None


class JsonObjectGrammar:
    """JSON mode's grammar in the interface JsonGuide and JsonVocab take (json_schema_grammar.SchemaGrammar's too)."""

    key = "json_object"  # names the grammar in the vocabulary's mask cache
    start = START
    pads = True  # JSON whitespace may follow the complete value (JsonGuide._pads)

    @staticmethod
    def advance(state: JsonState, data: bytes) -> JsonState | None:
        return advance(state, data)

    @staticmethod
    def is_complete(state: JsonState) -> bool:
        return state[0] == DONE

    @staticmethod
    def is_in_string(state: JsonState) -> bool:
        return is_in_string(state)

    @staticmethod
    def may_stop(state: JsonState) -> bool:
        """Only a complete object ends (is_complete)."""
        return False

    @staticmethod
    def regex_reading(state: JsonState) -> None:
        return None

    @staticmethod
    def string_room(state: JsonState) -> int | None:
        """JSON mode's strings have no length."""
        return None

    @staticmethod
    def ws_uniform(state: JsonState) -> bool:
        """Every whitespace byte leads to the same state (inside a string, is_in_string's path is taken)."""
        return True


class CompactJsonObjectGrammar(JsonObjectGrammar):
    """JSON mode with no whitespace between the tokens of JSON (vLLM's disable_any_whitespace): inside strings
    whitespace is content as ever."""

    key = "json_object:compact"

    @staticmethod
    def advance(state: JsonState, data: bytes) -> JsonState | None:
        if not _WS.intersection(data):
            return advance(state, data)
        for c in data:  # byte by byte: whether a whitespace byte is inside a string depends on those before it
            if c in _WS and not state[0].startswith(("str", "key")):
                return None
            state = advance(state, bytes((c,)))
            if state is None:
                return None
        return state


JSON_OBJECT = JsonObjectGrammar()
COMPACT_JSON_OBJECT = CompactJsonObjectGrammar()


_PLAIN_BYTES = frozenset(range(0x20, 0x80)) - {0x22, 0x5C}  # one-byte string content


def string_byte(mode: str, c: int) -> str | None:
    """The string mode after byte `c` ("after": the closing quote), None when it cannot follow."""
    if mode == "str" and c in _PLAIN_BYTES:
        return "str"
    nxt = _step(mode, "", c)
    return None if nxt is None else nxt[0]


def string_mode(data: bytes) -> str | None:
    """The string mode after `data` from inside a string's quotes, None when `data` cannot be string content."""
    mode = "str"
    for c in data:
        mode = string_byte(mode, c)
        if mode is None or mode == "after":
            return None
    return mode

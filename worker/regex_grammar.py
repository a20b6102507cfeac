"""Text held to a regular expression (regex_dfa.py), byte by byte: vLLM's `guided_regex` (RegexGrammar, the
whole output) and a schema's `pattern` (text_byte with json_string=True, read by json_schema_grammar.py).

A character is taken when its last byte is: the bytes before it (a UTF-8 lead and continuation bytes, or a
JSON escape's backslash) are kept, and each is taken only when some character it may still become has a
transition, so a state reached can always go on. Inside a JSON string a character is written as UTF-8, or as a
short escape (`\\" \\\\ \\/ \\b \\f \\n \\r \\t`; a control character has no other form here); `\\u` escapes are
not taken (every character they write has a UTF-8 form).
"""

from __future__ import annotations

from functools import lru_cache

from lorafleet.worker.regex_dfa import Regex
from lorafleet.worker.regex_parse import TEXT, RegexError, intersect, norm

# Characters a JSON string's reader here can write: not a surrogate, and no control character but those with a
# short escape.
JSON_TEXT = intersect(TEXT, norm([(0x08, 0x0A), (0x0C, 0x0D), (0x20, 0x10FFFF)]))
_SHORT = {0x22: 0x22, 0x5C: 0x5C, 0x2F: 0x2F, 0x62: 0x08, 0x66: 0x0C, 0x6E: 0x0A, 0x72: 0x0D, 0x74: 0x09}
_LEADS = {**{b: (2, 0x80, 0xBF) for b in range(0xC2, 0xE0)}, 0xE0: (3, 0xA0, 0xBF), 0xED: (3, 0x80, 0x9F),
          **{b: (3, 0x80, 0xBF) for b in (*range(0xE1, 0xED), 0xEE, 0xEF)}, 0xF0: (4, 0x90, 0xBF),
          0xF1: (4, 0x80, 0xBF), 0xF2: (4, 0x80, 0xBF), 0xF3: (4, 0x80, 0xBF), 0xF4: (4, 0x80, 0x8F)}
_FLOOR = {2: 0x80, 3: 0x800, 4: 0x10000}
CLOSE = "close"  # text_byte: the closing quote of a JSON string whose text matches


def text_byte(regex: Regex, dstate: frozenset, pending: bytes, c: int, json_string: bool):
    """The reader after byte `c`: (dstate, pending), CLOSE (json_string: the closing quote, the text matching),
    or None when `c` cannot go on."""
    if pending == b"\\":  # a JSON escape's second byte
        ch = _SHORT.get(c)
        return None if ch is None else _take(regex, dstate, ch)
    if pending:  # a UTF-8 character's continuation byte
        size, lo, hi = _LEADS[pending[0]]
        if not (lo <= c <= hi if len(pending) == 1 else 0x80 <= c <= 0xBF):
            return None
        data = pending + bytes((c,))
        if len(data) == size:
            return _take(regex, dstate, ord(data.decode()))
        return (dstate, data) if _may_become(regex, dstate, data, size) else None
    if json_string and c == 0x22:
        return CLOSE if regex.accepts(dstate) else None
    if json_string and c == 0x5C:
        return (dstate, b"\\") if any(regex.step(dstate, ch) for ch in _SHORT.values()) else None
    if c < 0x80:
        return None if json_string and c < 0x20 else _take(regex, dstate, c)
    lead = _LEADS.get(c)
    return (dstate, bytes((c,))) if lead and _may_become(regex, dstate, bytes((c,)), lead[0]) else None


def completed_char(pending: bytes, c: int) -> str:
    """The character byte `c` completes after `pending`, where text_byte took it with nothing left pending."""
    if pending == b"\\":
        return chr(_SHORT[c])
    return (pending + bytes((c,))).decode() if pending else chr(c)


def _take(regex: Regex, dstate: frozenset, ch: int):
    nxt = regex.step(dstate, ch)
    return None if nxt is None else (nxt, b"")


def _may_become(regex: Regex, dstate: frozenset, data: bytes, size: int) -> bool:
    """Whether a character whose first UTF-8 bytes are `data` may have a transition."""
    return regex.can_step(dstate, *_code_points(data, size))


def _code_points(data: bytes, size: int) -> tuple[int, int]:
    """[lo, hi]: the code points a character whose first UTF-8 bytes are `data` may still be, from its bits
    (clamped to those of its length)."""
    bits = data[0] & (0xFF >> (size + 1))
    for b in data[1:]:
        bits = bits << 6 | b & 0x3F
    left = 6 * (size - len(data))
    return max(bits << left, _FLOOR[size]), min((bits << left) | ((1 << left) - 1), 0x10FFFF)


def pending_chars(pending: bytes) -> list[tuple[int, int]]:
    """The characters a character begun with `pending` (text_byte's: an escape's backslash, or UTF-8 lead and
    continuation bytes) may still become, as inclusive code point ranges."""
    if pending == b"\\":
        return [(ch, ch) for ch in sorted(_SHORT.values())]
    return [_code_points(pending, _LEADS[pending[0]][0])]


@lru_cache(maxsize=16)
def compile_pattern(pattern: str, search: bool, json_string: bool) -> Regex:
    """A pattern's Regex (RegexError when it cannot be held), compiled once per text and reading."""
    try:
        return Regex(pattern, search=search, writable=JSON_TEXT if json_string else TEXT)
    except RecursionError:  # e.g. thousands of stacked quantifiers: each level is one more call deep
        raise RegexError("the pattern nests too deeply to compile (stacked quantifiers or groups)") from None


DONE = "done"


class TextGrammar:
    """The whole output is a text `machine` takes: a Regex, or a machine with its interface (gbnf.py). A state
    is (the machine's state, pending bytes), or DONE once the text matches and no character may follow. Where
    it matches and may also go on, the request's stop tokens may end it (may_stop)."""

    def __init__(self, machine: Regex) -> None:
        self.regex = machine
        self.key = machine.key
        self.start = DONE if self.regex.is_final(self.regex.start) else (self.regex.start, b"")
        self.pads = False  # nothing may follow the text

    @staticmethod
    def is_complete(state) -> bool:
        return state == DONE

    def may_stop(self, state) -> bool:
        """Whether a stop token may end the output here: the text so far matches."""
        return state == DONE or (not state[1] and self.regex.accepts(state[0]))

    @staticmethod
    def is_in_string(state) -> bool:
        return False

    def regex_reading(self, state):
        """(regex, DFA state, False) between characters (JsonVocab's class-trie masks), else None."""
        return None if state == DONE or state[1] else (self.regex, state[0], False)

    @staticmethod
    def rescanned_bytes(state) -> set[int]:
        """First bytes of tokens a regex_reading mask reads through the grammar, not the trie: none here."""
        return set()

    @staticmethod
    def ws_uniform(state) -> bool:
        return False  # whitespace is text the pattern reads

    def advance(self, state, data: bytes):
        """The state after `data`, or None when the output could no longer match."""
        if state == DONE:
            return None if data else state
        dstate, pending = state
        for i, c in enumerate(data):
            nxt = text_byte(self.regex, dstate, pending, c, False)
            if nxt is None:
                return None
            dstate, pending = nxt
            if not pending and self.regex.is_final(dstate):
                return DONE if i == len(data) - 1 else None
        return dstate, pending


class RegexGrammar(TextGrammar):
    """The whole output matches `pattern` (vLLM's guided_regex)."""

    def __init__(self, pattern: str) -> None:
        try:
            regex = compile_pattern(pattern, False, False)
        except RegexError as exc:
            raise RegexError(f"{exc}: {pattern[:80]!r}") from None
        super().__init__(regex)

"""A pattern beside minLength/maxLength: a regex_dfa.Regex whose texts are also held to a character count.

JSON Schema reads both keywords on one string (pydantic writes them together from `Field(pattern=...,
max_length=...)`). LengthRegex pairs the pattern's DFA state with the characters written so far and keeps
regex_dfa.Regex's interface (start, step, accepts, can_step, is_final, classes, matches), so the string
reader (regex_grammar.text_byte) and the class-trie masks (regex_vocab.py) take it unchanged.

The promise a Regex keeps, that every state it reaches can still end in a match, must hold with the count
too: from "ab" under `^(ab)+$` with maxLength 3 no match can follow. So each NFA state carries the lengths
of the texts that lead from it to a match, as the bits of an int (bit L: some text of L characters), up to
the count's cap; a character is taken only when the state it leads to has a length left inside
[minLength - count, maxLength - count]. Without maxLength the top bit stands for "minLength or more".
Computing the lengths is bounded (MAX_LENGTH_WORK), and so is the memo of a DFA state's lengths. A token mask
(json_vocab.py) filters the pattern's own class-trie walk from the DFA state by `fits` at each token's end,
so a new count costs no new walk.
"""

from __future__ import annotations

import functools

from lorafleet.worker.regex_dfa import Regex, _overlaps
from lorafleet.worker.regex_parse import RegexError

# The lengths' propagation, counted in steps of one 64-bit word of the ints it ors, each or costing about 16
# more (a loop under a long maxLength adds one bit at a time to ints as long as the cap): past it the schema
# is refused (about 0.1 s of a core).
MAX_LENGTH_WORK = 10_000_000
_MAX_LENS_MEMO = 100_000  # NFA states held by the keys of the lengths' memo, then it starts over


class NoText(RegexError):
    """No text of the length matches the pattern (a schema may still take other types there)."""

    work = 0


class LengthRegex:
    """`regex` (a compiled pattern) with its texts' characters between `min_len` and `max_len` (None: any).
    A state is (the pattern's DFA state, characters so far, capped where the count stops mattering)."""

    def __init__(self, regex: Regex, min_len: int, max_len: int | None) -> None:
        self.regex, self.min_len, self.max_len = regex, min_len, max_len
        self.pattern = regex.pattern
        self.key = f"{regex.key}:len:{min_len}:{max_len}"
        self.cap = max_len if max_len is not None else min_len
        self.work = 0  # what computing the lengths cost (MAX_LENGTH_WORK's units)
        self._lens = self._nfa_lengths()
        self._memo: dict[frozenset, int] = {}
        self._memo_size = 0
        self.start = (regex.start, 0)
        if not self._live(regex.start, 0):
            error = NoText(f"the pattern matches no text of {_describe(min_len, max_len)}")
            error.work = self.work  # what finding that out cost (a schema's budget counts it)
            raise error

    def _nfa_lengths(self) -> list[int]:
        """Per NFA state, the bits of the text lengths (up to the cap) that lead from it to the final state:
        propagated backwards along the edges until nothing changes (each change adds a bit)."""
        regex = self.regex
        n = len(regex._edges)
        back: list[list[tuple[int, bool]]] = [[] for _ in range(n)]
        for s in range(n):
            if s not in regex._live:
                continue
            for _, t in regex._edges[s]:
                back[t].append((s, True))
            for t in regex._eps[s]:
                back[t].append((s, False))
        lens = [0] * n
        lens[regex.final] = 1
        todo, cost = [regex.final], 17 + (self.cap >> 6)
        while todo:
            t = todo.pop()
            self.work += cost * len(back[t])
            if self.work > MAX_LENGTH_WORK:
                raise RegexError(f"the pattern beside a length of up to {self.cap} characters costs too much to hold; "
                                 "shorten the length or the pattern")
            for s, reads in back[t]:
                add = self._shift(lens[t]) if reads else lens[t]
                if add & ~lens[s]:
                    lens[s] |= add
                    todo.append(s)
        return lens

    def _shift(self, bits: int) -> int:
        """The lengths one character longer, kept within the cap (without maxLength the top bit saturates)."""
        bits <<= 1
        if bits >> self.cap + 1:
            top = 1 << self.cap
            bits = (bits & (top - 1)) | top if self.max_len is None else bits & ((top << 1) - 1)
        return bits

    def _window(self, count: int) -> int:
        """The bits of the lengths still allowed after `count` characters."""
        lo = max(0, self.min_len - count)
        hi = self.cap if self.max_len is None else self.max_len - count
        return 0 if hi < lo else ((1 << (hi + 1)) - 1) & ~((1 << lo) - 1)

    def _state_lens(self, dstate: frozenset) -> int:
        bits = self._memo.get(dstate)
        if bits is None:
            bits = 0
            for s in dstate:
                bits |= self._lens[s]
            self._memo_size += len(dstate)
            if self._memo_size > _MAX_LENS_MEMO:
                self._memo.clear()
                self._memo_size = len(dstate)
            self._memo[dstate] = bits
        return bits

    def _live(self, dstate: frozenset, count: int) -> bool:
        return bool(self._state_lens(dstate) & self._window(count))

    def step(self, state: tuple, ch: int) -> tuple | None:
        dstate, count = state
        if self.max_len is not None and count >= self.max_len:
            return None
        nxt = self.regex.step(dstate, ch)
        if nxt is None or not self._live(nxt, count + 1):
            return None
        return nxt, min(count + 1, self.cap)

    def fits(self, dstate: frozenset, count: int, chars: int) -> bool:
        """Whether `chars` more characters after `count`, reaching the pattern's `dstate`, keep a match inside
        the length (the states between are then live too: each ends through this one)."""
        return (self.max_len is None or count + chars <= self.max_len) and self._live(dstate, count + chars)

    def accepts(self, state: tuple) -> bool:
        return state[1] >= self.min_len and self.regex.accepts(state[0])

    def can_step(self, state: tuple, lo: int, hi: int) -> bool:
        """Whether some character in [lo, hi] leads to a state that can still match within the length (an edge's
        target alone carries lengths its DFA state has too)."""
        dstate, count = state
        if self.max_len is not None and count >= self.max_len:
            return False
        window, edges = self._window(count + 1), self.regex._edges
        return any(_overlaps(chars, lo, hi) and self._lens[t] & window for s in dstate for chars, t in edges[s])

    def is_final(self, state: tuple) -> bool:
        """Whether the text matches and no character may follow."""
        return self.accepts(state) and not self.can_step(state, 0, 0x10FFFF)

    def classes(self):
        return self.regex.classes()

    def cuts(self, state: tuple) -> set[int]:
        return self.regex.cuts(state[0])

    matches = Regex.matches  # it reads only start, step and accepts


def _describe(min_len: int, max_len: int | None) -> str:
    if max_len is None:
        return f"at least {min_len} characters"
    return f"{min_len} to {max_len} characters" if min_len else f"at most {max_len} characters"


@functools.lru_cache(maxsize=32)
def length_regex(regex: Regex, min_len: int, max_len: int | None) -> LengthRegex:
    """LengthRegex(regex, min_len, max_len), made once for schemas that repeat a property (`regex` comes from
    regex_grammar.compile_pattern's cache, so one pattern text is one object)."""
    return LengthRegex(regex, min_len, max_len)

"""Parsing a regular expression (regex_dfa.py compiles it) into a tree, and the character sets it is made of.

The syntax is the ECMAScript subset described in regex_dfa.py. Sets of characters are sorted, disjoint,
inclusive code point ranges (Ranges). The parser's tree: ("set", ranges) | ("cat", [...]) | ("alt", [...]) |
("rep", tree, lo, hi or None); `top()` gives the top-level alternatives with their anchors.
"""

from __future__ import annotations

MAX_REPEAT = 1000  # a counted repeat's bound (an empty group repeated makes no state, yet costs its count)
MAX_GROUPS = 64  # nesting of groups (the parser recurses)
MAX_PATTERN = 4096  # characters of a pattern
MAX_CHAR = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)
Ranges = tuple[tuple[int, int], ...]  # sorted, disjoint, inclusive code point ranges
_DIGITS = frozenset("0123456789")
_HEX = frozenset("0123456789abcdefABCDEF")


class RegexError(ValueError):
    """A pattern this server cannot hold text to; the message says why and where."""


def norm(ranges) -> Ranges:
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((lo, hi) for lo, hi in out)


def negate(r: Ranges) -> Ranges:
    out, nxt = [], 0
    for lo, hi in r:
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CHAR:
        out.append((nxt, MAX_CHAR))
    return tuple(out)


def intersect(a: Ranges, b: Ranges) -> Ranges:
    return negate(norm(negate(a) + negate(b)))


ANY: Ranges = ((0, MAX_CHAR),)
DIGIT: Ranges = ((0x30, 0x39),)
WORD: Ranges = norm([(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)])
SPACE: Ranges = norm([(0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029),
                       (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF)])
DOT: Ranges = negate(norm([(0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029)]))  # no line terminator
CLASSES = {"d": DIGIT, "D": negate(DIGIT), "w": WORD, "W": negate(WORD), "s": SPACE, "S": negate(SPACE)}
SIMPLE_ESCAPES = {"n": 0x0A, "t": 0x09, "r": 0x0D, "f": 0x0C, "v": 0x0B, "0": 0x00}
# What a JSON string can hold as one character of its text: anything but a surrogate (a control character is
# written as a short escape or \\u00XX; the grammar's reader decides which it takes).
TEXT: Ranges = negate((SURROGATES,))


class Parser:
    """Recursive descent to a tree: ("set", ranges) | ("cat", [..]) | ("alt", [..]) | ("rep", node, lo, hi|None)."""

    def __init__(self, pattern: str) -> None:
        self.p, self.i, self.depth = pattern, 0, 0

    def error(self, what: str) -> RegexError:
        return RegexError(f"{what} at position {self.i} of the pattern")

    def peek(self) -> str | None:
        return self.p[self.i] if self.i < len(self.p) else None

    def take(self) -> str:
        c = self.p[self.i]
        self.i += 1
        return c

    def top(self) -> list[tuple[bool, object, bool]]:
        """The top-level alternatives: (anchored at the start, tree, anchored at the end)."""
        branches = []
        while True:
            start = self.peek() == "^"
            if start:
                self.i += 1
            tree = self.seq(top=True)
            end = self.peek() == "$"
            if end:
                self.i += 1
            branches.append((start, tree, end))
            if self.peek() is None:
                return branches
            if self.take() != "|":
                raise self.error("an unmatched ')'" if self.p[self.i - 1] == ")" else "'$' before the end")

    def alt(self):
        parts = [self.seq()]
        while self.peek() == "|":
            self.i += 1
            parts.append(self.seq())
        return parts[0] if len(parts) == 1 else ("alt", parts)

    def seq(self, top: bool = False):
        items = []
        while (c := self.peek()) is not None and c not in "|)":
            if c == "$" and top and (self.i + 1 == len(self.p) or self.p[self.i + 1] == "|"):
                break
            items.append(self.quantified(self.atom()))
        return ("cat", items)

    def atom(self):
        c = self.take()
        if c == "(":
            self.depth += 1
            if self.depth > MAX_GROUPS:
                raise self.error(f"groups nested deeper than {MAX_GROUPS}")
            if self.p.startswith("?:", self.i):
                self.i += 2
            elif self.p.startswith("?<", self.i) and not self.p.startswith(("?<=", "?<!"), self.i):
                close = self.p.find(">", self.i)
                if close < 0:
                    raise self.error("an unterminated group name")
                self.i = close + 1
            elif self.peek() == "?":
                raise self.error("lookaround and other (?...) groups are not supported")
            tree = self.alt()
            if self.peek() != ")":
                raise self.error("a missing ')'")
            self.i += 1
            self.depth -= 1
            return tree
        if c == "[":
            return ("set", self.klass())
        if c == ".":
            return ("set", DOT)
        if c == "\\":
            return ("set", self.escape(in_class=False))
        if c in "^$":
            raise self.error(f"'{c}' inside the pattern (only at the ends of it or of its alternatives)")
        if c in "*+?":
            raise self.error(f"'{c}' with nothing to repeat")
        if c == "{" and self._bound() is not None:
            raise self.error("a quantifier with nothing to repeat")
        return ("set", ((ord(c), ord(c)),))

    def _bound(self) -> tuple[int, int | None, int] | None:
        """A {n}, {n,} or {n,m} at self.i (just past its '{'): (n, m, index past it), None if it is not one."""
        j, p = self.i, self.p
        k = j
        while k < len(p) and p[k] in _DIGITS:  # ASCII only: str.isdigit takes '²'
            k += 1
        if k == j:
            return None
        lo = int(p[j:k])
        hi: int | None = lo
        if k < len(p) and p[k] == ",":
            k += 1
            m = k
            while k < len(p) and p[k] in _DIGITS:
                k += 1
            hi = int(p[m:k]) if k > m else None
        if k >= len(p) or p[k] != "}":
            return None
        if max(lo, hi or 0) > MAX_REPEAT:
            self.i = j
            raise self.error(f"a counted repeat above {MAX_REPEAT}")
        return lo, hi, k + 1

    def quantified(self, tree):
        """`tree` with the quantifier that follows it, if one does. One only, as ECMAScript (and Python) take
        them: `a**`, `x{3}{2}` are "nothing to repeat" errors, not repeats of repeats."""
        bound = self._quantifier()
        if bound is None:
            return tree
        if self.peek() == "?":  # lazy: the same texts
            self.i += 1
        at = self.i
        if self._quantifier() is not None:
            self.i = at
            raise self.error("nothing to repeat (a quantifier right after another)")
        return ("rep", tree, *bound)

    def _quantifier(self) -> tuple[int, int | None] | None:
        """(lo, hi) of a quantifier at the position, read past; None where none is (a '{' that opens no bound is
        a literal, ECMAScript's annex B reading)."""
        c = self.peek()
        if c is None or c not in "*+?{":
            return None
        self.i += 1
        if c != "{":
            return {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        bound = self._bound()
        if bound is None:
            self.i -= 1
            return None
        lo, hi, self.i = bound
        if hi is not None and hi < lo:
            raise self.error(f"a quantifier {{{lo},{hi}}} out of order")
        return lo, hi

    def klass(self) -> Ranges:
        negated = self.peek() == "^"
        if negated:
            self.i += 1
        ranges: list[tuple[int, int]] = []
        while True:  # ECMAScript: "[]" takes nothing, "[^]" anything
            c = self.peek()
            if c is None:
                raise self.error("an unterminated character class")
            if c == "]":
                self.i += 1
                break
            lo = self.class_atom()
            if self.peek() == "-" and self.i + 1 < len(self.p) and self.p[self.i + 1] != "]":
                self.i += 1
                hi = self.class_atom()
                if len(lo) != 1 or len(hi) != 1 or lo[0][0] != lo[0][1] or hi[0][0] != hi[0][1]:
                    raise self.error("a range between classes")
                if hi[0][0] < lo[0][0]:
                    raise self.error("a character range out of order")
                ranges.append((lo[0][0], hi[0][0]))
            else:
                ranges.extend(lo)
        r = norm(ranges)
        return negate(r) if negated else r

    def class_atom(self) -> Ranges:
        c = self.take()
        if c == "\\":
            return self.escape(in_class=True)
        return ((ord(c), ord(c)),)

    def escape(self, in_class: bool) -> Ranges:
        if self.peek() is None:
            raise self.error("a pattern ending in '\\'")
        c = self.take()
        if c in CLASSES:
            return CLASSES[c]
        if c in SIMPLE_ESCAPES:
            return ((SIMPLE_ESCAPES[c],) * 2,)
        if c == "b" and in_class:
            return ((8, 8),)
        if c in "xu":
            code = self._hex(c)
            return ((code, code),)
        if c.isalnum():
            raise self.error(f"the escape '\\{c}' is not supported (backreferences, word boundaries and "
                             "Unicode properties cannot be held while sampling)")
        return ((ord(c), ord(c)),)

    def _hex(self, kind: str) -> int:
        if kind == "u" and self.peek() == "{":
            close = self.p.find("}", self.i)
            digits = self.p[self.i + 1:close] if close > 0 else ""
            self.i = close + 1
        else:
            n = 2 if kind == "x" else 4
            digits = self.p[self.i:self.i + n]
            self.i += n
            if len(digits) != n:
                digits = ""
        if not digits or not set(digits) <= _HEX:
            raise self.error(f"a malformed '\\{kind}' escape")
        code = int(digits, 16)
        if code > MAX_CHAR:
            raise self.error("a code point above U+10FFFF")
        return code

"""A regular expression as a lazily built DFA over characters: JSON Schema's `pattern` (regex_grammar.py's
string reader) and vLLM's `guided_regex` (regex_grammar.RegexGrammar).

The syntax is the ECMAScript subset schemas and guided decoding use: literals, `.`, classes (`[a-z]`,
`[^"]`, `\\d \\w \\s` and their negations, inside classes too), groups (`(...)`, `(?:...)`, `(?<name>...)`),
`|`, the quantifiers `* + ? {n} {n,} {n,m}` (lazy forms read alike: the set of texts is the same), escapes
(`\\n \\t \\r \\f \\v \\0 \\xHH \\uHHHH \\u{H...}` and escaped punctuation), and `^`/`$` at the ends of the
pattern or of its top-level alternatives. Backreferences, lookaround, `\\b` and the like are refused: a
sampler can only hold text to a regular language.

`search=True` is JSON Schema's reading (the pattern may match anywhere: an end without its anchor takes any
text there); otherwise the whole text must match (vLLM, outlines). Only characters the output can write are
kept (`writable`): where no written character can take an edge, the edge is dropped, and states from which
no accepting one can be reached are pruned, so every state the DFA reaches can still end in a match. DFA
states (frozensets of NFA states) and their transitions are memoized, both bounded.

A pattern comes from a request, so what it may cost is bounded: its length, counted repeats (an empty group
repeated makes no state, yet costs its count), the tree's size with repeats unrolled, group nesting, the NFA's
states, and the NFA states a DFA state holds while sampling (MAX_OPEN: every step costs that many; past it the
request fails, as its state would stall every step of the batch).
"""

from __future__ import annotations

import bisect
import hashlib
from array import array

MAX_NFA_STATES = 2048  # a pattern's NFA: bounds what a request can make the worker build ({1000} repeats)
MAX_REPEAT = 1000  # a counted repeat's bound (an empty group repeated makes no state, yet costs its count)
MAX_BUILD = 100_000  # parts of the tree built, counted repeats unrolled
MAX_GROUPS = 64  # nesting of groups (the parser recurses)
MAX_OPEN = 128  # NFA states a DFA state may hold while sampling: each step costs its size
MAX_MEMO = 100_000  # NFA states held by the memoized steps, in all, then the memo starts over
MAX_PATTERN = 4096  # characters of a pattern
MAX_TRANSITIONS = 65536  # memoized (state, character) steps, then the memo starts over
MAX_CHAR = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)
Ranges = tuple[tuple[int, int], ...]  # sorted, disjoint, inclusive code point ranges


_DIGITS = frozenset("0123456789")
_HEX = frozenset("0123456789abcdefABCDEF")
_MISSING = object()


class RegexError(ValueError):
    """A pattern this server cannot hold text to; the message says why and where."""


def _norm(ranges) -> Ranges:
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((lo, hi) for lo, hi in out)


def _negate(r: Ranges) -> Ranges:
    out, nxt = [], 0
    for lo, hi in r:
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CHAR:
        out.append((nxt, MAX_CHAR))
    return tuple(out)


def _intersect(a: Ranges, b: Ranges) -> Ranges:
    return _negate(_norm(_negate(a) + _negate(b)))


ANY: Ranges = ((0, MAX_CHAR),)
DIGIT: Ranges = ((0x30, 0x39),)
WORD: Ranges = _norm([(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)])
SPACE: Ranges = _norm([(0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029),
                       (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF)])
DOT: Ranges = _negate(_norm([(0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029)]))  # no line terminator
CLASSES = {"d": DIGIT, "D": _negate(DIGIT), "w": WORD, "W": _negate(WORD), "s": SPACE, "S": _negate(SPACE)}
SIMPLE_ESCAPES = {"n": 0x0A, "t": 0x09, "r": 0x0D, "f": 0x0C, "v": 0x0B, "0": 0x00}
# What a JSON string can hold as one character of its text: anything but a surrogate (a control character is
# written as a short escape or \\u00XX; the grammar's reader decides which it takes).
TEXT: Ranges = _negate((SURROGATES,))


class _Parser:
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
        while (c := self.peek()) is not None and c in "*+?{":
            if c == "{":
                self.i += 1
                bound = self._bound()
                if bound is None:
                    self.i -= 1
                    return tree  # a literal '{' follows (ECMAScript's annex B reading)
                lo, hi, self.i = bound
                if hi is not None and hi < lo:
                    raise self.error(f"a quantifier {{{lo},{hi}}} out of order")
            else:
                self.i += 1
                lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            if self.peek() == "?":  # lazy: the same texts
                self.i += 1
            tree = ("rep", tree, lo, hi)
        return tree

    def klass(self) -> Ranges:
        negate = self.peek() == "^"
        if negate:
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
        r = _norm(ranges)
        return _negate(r) if negate else r

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


class Regex:
    """A compiled pattern: `start` is the initial state (a frozenset of NFA states), `step(state, ch)` the next
    (None: no match can go on), `accepts(state)` whether the text so far matches, `can_step(state, lo, hi)`
    whether some character of [lo, hi] can be taken."""

    def __init__(self, pattern: str, search: bool = False, writable: Ranges = TEXT) -> None:
        if not isinstance(pattern, str) or len(pattern) > MAX_PATTERN:
            raise RegexError(f"a pattern must be a string of at most {MAX_PATTERN} characters")
        self.pattern = pattern
        self.key = "regex:" + ("search:" if search else "") + hashlib.sha256(pattern.encode("utf-8", "surrogatepass")).hexdigest()
        self._writable = writable
        self._edges: list[list[tuple[Ranges, int]]] = []  # per NFA state: (characters, target)
        self._built = 0
        self._eps: list[list[int]] = []
        branches = _Parser(pattern).top()
        start, self.final = self._state(), self._state()
        for anchored_start, tree, anchored_end in branches:
            a = self._state()
            self._eps[start].append(a)
            if search and not anchored_start:
                self._edges[a].append((writable, a))
            b = self._build(tree, a)
            if search and not anchored_end:
                self._edges[b].append((writable, b))
            self._eps[b].append(self.final)
        self._trim()
        self.start = self._closure({start})
        if not self.start:
            raise RegexError("the pattern matches no text that can be written")
        self._steps: dict[tuple[frozenset, int], frozenset | None] = {}
        self._memo_size = 0

    def _state(self) -> int:
        if len(self._edges) >= MAX_NFA_STATES:
            raise RegexError(f"the pattern is too large (over {MAX_NFA_STATES} states; large counted repeats)")
        self._edges.append([])
        self._eps.append([])
        return len(self._edges) - 1

    def _build(self, tree, at: int) -> int:
        self._built += 1
        if self._built > MAX_BUILD:
            raise RegexError(f"the pattern is too large (over {MAX_BUILD} parts with its repeats unrolled)")
        kind = tree[0]
        if kind == "set":
            chars = _intersect(tree[1], self._writable)
            end = self._state()
            if chars:
                self._edges[at].append((chars, end))
            return end
        if kind == "cat":
            for item in tree[1]:
                at = self._build(item, at)
            return at
        if kind == "alt":
            end = self._state()
            for part in tree[1]:
                self._eps[self._build(part, at)].append(end)
            return end
        _, inner, lo, hi = tree
        for _ in range(lo):
            at = self._build(inner, at)
        if hi is None:  # a loop: inner from `at` back to `at`
            loop = self._state()
            self._eps[at].append(loop)
            self._eps[self._build(inner, loop)].append(loop)
            return loop
        end = self._state()
        for _ in range(hi - lo):  # each optional copy may be skipped to the end
            self._eps[at].append(end)
            at = self._build(inner, at)
        self._eps[at].append(end)
        return end

    def _trim(self) -> None:
        """Keep the NFA states from which the final state can be reached (every state reached can still match)."""
        back: list[list[int]] = [[] for _ in self._edges]
        for s, edges in enumerate(self._edges):
            for _, t in edges:
                back[t].append(s)
            for t in self._eps[s]:
                back[t].append(s)
        live, todo = {self.final}, [self.final]
        while todo:
            for s in back[todo.pop()]:
                if s not in live:
                    live.add(s)
                    todo.append(s)
        self._live = live

    def _closure(self, states) -> frozenset:
        seen, todo = set(), [s for s in states if s in self._live]
        while todo:
            s = todo.pop()
            if s in seen:
                continue
            seen.add(s)
            todo.extend(t for t in self._eps[s] if t in self._live and t not in seen)
        return frozenset(seen)

    def accepts(self, state: frozenset) -> bool:
        return self.final in state

    def step(self, state: frozenset, ch: int) -> frozenset | None:
        """The state after character `ch` (None: no match goes on); RegexError when it would hold more than
        MAX_OPEN NFA states (a long counted repeat after a wildcard: every step would cost that much)."""
        key = (state, ch)
        nxt = self._steps.get(key, _MISSING)  # one lookup: another thread may clear the memo
        if nxt is not _MISSING:
            return nxt
        targets = [t for s in state for chars, t in self._edges[s] if _contains(chars, ch)]
        nxt = self._closure(targets) or None
        if nxt is not None and len(nxt) > MAX_OPEN:
            raise RegexError(f"the pattern keeps over {MAX_OPEN} positions open at once (a long counted repeat "
                             "after a wildcard?): anchor it or shorten the repeat")
        self._memo_size += len(nxt or ())
        if len(self._steps) >= MAX_TRANSITIONS or self._memo_size > MAX_MEMO:
            self._steps.clear()
            self._memo_size = 0
        self._steps[key] = nxt
        return nxt

    def classes(self) -> tuple[array, list[int], list[int], list[int]]:
        """The characters the NFA's edges cannot tell apart, as classes: (class of each BMP code point, starts of
        the astral intervals, their classes, a representative of each class). Characters of one class step
        alike from every state, so a vocabulary's tokens can be read as class sequences (regex_vocab.py, which
        keeps what it needs). One sweep over the ranges' ends: each interval's signature is the set of edge
        sets open over it."""
        sets = list({chars for edges in self._edges for chars, _ in edges})
        events: dict[int, int] = {0: 0, MAX_CHAR + 1: 0}  # code point -> bits of the sets opening minus closing there
        for i, r in enumerate(sets):
            for lo, hi in r:
                events[lo] = events.get(lo, 0) + (1 << i)
                events[hi + 1] = events.get(hi + 1, 0) - (1 << i)
        cuts = sorted(events)
        ids: dict[int, int] = {}
        bmp, starts, astral, reps = array("I", bytes(4 * 0x10000)), [], [], []
        sig = 0
        for lo, nxt in zip(cuts, cuts[1:], strict=False):
            sig += events[lo]  # the ranges of one set are disjoint: its bit opens and closes in turn
            cls = ids.setdefault(sig, len(ids))
            if cls == len(reps):
                reps.append(lo)
            if lo < 0x10000:
                bmp[lo:min(nxt, 0x10000)] = array("I", [cls]) * (min(nxt, 0x10000) - lo)
            if nxt > 0x10000:
                starts.append(max(lo, 0x10000))
                astral.append(cls)
        return bmp, starts, astral, reps

    def matches(self, text: str) -> bool:
        """Whether `text` is one the pattern takes (an enum value beside it)."""
        state: frozenset | None = self.start
        for ch in text:
            state = self.step(state, ord(ch))
            if state is None:
                return False
        return self.accepts(state)

    def can_step(self, state: frozenset, lo: int, hi: int) -> bool:
        """Whether some character in [lo, hi] has a transition (the first bytes of a character so far)."""
        return any(_overlaps(chars, lo, hi) and t in self._live for s in state for chars, t in self._edges[s])

    def is_final(self, state: frozenset) -> bool:
        """Whether the text matches and no character may follow."""
        return self.final in state and not any(t in self._live for s in state for _, t in self._edges[s])


def _contains(r: Ranges, ch: int) -> bool:
    i = bisect.bisect_right(r, (ch, MAX_CHAR + 1)) - 1
    return i >= 0 and r[i][0] <= ch <= r[i][1]


def _overlaps(r: Ranges, lo: int, hi: int) -> bool:
    i = bisect.bisect_right(r, (hi, MAX_CHAR + 1)) - 1
    return i >= 0 and r[i][1] >= lo

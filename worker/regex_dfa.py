"""A regular expression as a lazily built DFA over characters: JSON Schema's `pattern` (regex_grammar.py's
string reader) and vLLM's `guided_regex` (regex_grammar.RegexGrammar).

The syntax (parsed in regex_parse.py) is the ECMAScript subset schemas and guided decoding use: literals, `.`, classes (`[a-z]`,
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

from lorafleet.worker.regex_parse import MAX_CHAR, MAX_PATTERN, TEXT, Parser, Ranges, RegexError, intersect

MAX_NFA_STATES = 2048  # a pattern's NFA: bounds what a request can make the worker build ({1000} repeats)
MAX_BUILD = 100_000  # parts of the tree built, counted repeats unrolled
MAX_OPEN = 128  # NFA states a DFA state may hold while sampling: each step costs its size
MAX_MEMO = 100_000  # NFA states held by the memoized steps, in all, then the memo starts over
MAX_TRANSITIONS = 65536  # memoized (state, character) steps, then the memo starts over
_MISSING = object()


class Regex:
    """A compiled pattern: `start` is the initial state (a frozenset of NFA states), `step(state, ch)` the next
    (None: no match can go on), `accepts(state)` whether the text so far matches, `can_step(state, lo, hi)`
    whether some character of [lo, hi] can be taken."""

    def __init__(self, pattern: str | tuple[str, ...], search: bool = False, writable: Ranges = TEXT) -> None:
        """`pattern`: one pattern, or a tuple of them whose union it takes (an object's patternProperties)."""
        patterns = pattern if isinstance(pattern, tuple) else (pattern,)
        if not patterns or not all(isinstance(p, str) for p in patterns) or sum(map(len, patterns)) > MAX_PATTERN:
            raise RegexError(f"a pattern must be a string of at most {MAX_PATTERN} characters")
        self.pattern = pattern
        text = pattern if isinstance(pattern, str) else "union:" + "\0".join(patterns)
        self.key = "regex:" + ("search:" if search else "") + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
        self._writable = writable
        self._edges: list[list[tuple[Ranges, int]]] = []  # per NFA state: (characters, target)
        self._built = 0
        self._eps: list[list[int]] = []
        branches = [branch for p in patterns for branch in Parser(p).top()]
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
            chars = intersect(tree[1], self._writable)
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

    def cuts(self, state: frozenset) -> set[int]:
        """Where the characters the live edges of `state` take begin and end (one past): between two adjacent
        cuts every character steps alike from `state`."""
        return {x for s in state for chars, t in self._edges[s] if t in self._live for lo, hi in chars
                for x in (lo, hi + 1)}

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

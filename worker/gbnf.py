"""Text held to a context-free grammar in GBNF, the EBNF dialect of llama.cpp and of vLLM's `guided_grammar`
(xgrammar): GbnfGrammar, behind RegexGrammar's interface (regex_grammar.TextGrammar), so the byte reader,
the class-trie token masks (regex_vocab.py) and stop handling are the regular expressions'.

    root   ::= "SELECT " column " FROM " table   # a comment
    column ::= [a-z_]+ | "*"
    table  ::= ("users" | "orders") ws?
    ws     ::= [ \\t\\n]{1,4}

Rules are `name ::= expression`; an expression is alternatives (`|`) of sequences of string literals (with
`\\n \\t \\r \\\\ \\" \\xHH \\uHHHH \\UHHHHHHHH` escapes), character classes (`[a-z]`, `[^"\\\\]`), `.` (any
character), rule names and groups, each with `* + ?` or `{m}`, `{m,}`, `{m,n}`. Whitespace and comments
(`#` to the end of the line) separate items; a rule ends where the next `name ::=` begins. The output must
be a whole `root`. Lark grammars (`start: ...`) are refused with a 400 naming the syntax.

The machine (GrammarMachine) is a recursive transition network: each rule an NFA (regex_dfa's construction)
whose edges may call another rule. A state is a graph-structured stack: one top per NFA state where the
text may be, each with the set of return links below it (a link: the NFA state to return to and its own
links), closed over empty moves, calls and returns, so readings that share a future are kept once and an
unambiguous grammar with common prefixes (`expr ::= term "+" expr | term`) costs each character a
polynomial closure, not a stack per reading. A call that is the last thing its rule does adds no link,
so right recursion (`list ::= item ("," list)?`) stays flat. What a request may cost is bounded: the
grammar's size (regex_dfa's bounds on states and parts), left recursion is refused when it compiles (it
would never consume a character), links are at most MAX_DEPTH deep, one character's closure visits at most
MAX_CLOSURE (state, link) pairs, the step memo holds a bounded amount, and a machine interns at most
MAX_LINKS links (equal links are one object, so states compare in their own size). Rules that can derive no text
are dropped and every NFA state kept can reach its rule's end, so every state reached can still end in a
whole `root`.
"""

from __future__ import annotations

import functools
import hashlib
import itertools

from lorafleet.worker.gbnf_parse import GbnfParser
from lorafleet.worker.regex_dfa import Regex, _contains, _overlaps
from lorafleet.worker.regex_grammar import TextGrammar
from lorafleet.worker.regex_parse import TEXT, RegexError

MAX_GRAMMAR = 16384  # characters of a grammar
MAX_DEPTH = 256  # return links below a top: nesting the output may reach
MAX_CLOSURE = 20_000  # (NFA state, link) pairs one character's closure may visit
MAX_LINKS = 50_000  # links a machine interns (for the requests that share its grammar); past it, a new machine
BOTTOM = (-1, frozenset(), 0)  # the link below the root: returning to it ends the output
ACCEPT = (-1, frozenset())  # the top of a state whose root has ended
_MISSING = object()
_MACHINES = itertools.count()


class GrammarMachine(Regex):
    """A GBNF grammar as a Regex-like machine over characters (start, step, accepts, can_step, is_final,
    classes, matches): its states are frozensets of stacks (tuples of NFA states, the innermost last); the
    empty stack means the whole root was read."""

    def __init__(self, text: str) -> None:
        if not isinstance(text, str) or len(text) > MAX_GRAMMAR:
            raise RegexError(f"a grammar must be a string of at most {MAX_GRAMMAR} characters")
        self.pattern = text
        # One key per machine: its states hold its own interned links, never compared with another machine's.
        self.key = f"gbnf:{hashlib.sha256(text.encode('utf-8', 'surrogatepass')).hexdigest()}:{next(_MACHINES)}"
        self._links: dict[tuple, tuple] = {}  # (return state, links below) -> the one link (_frozen)
        self._writable, self._built = TEXT, 0
        self._edges, self._eps, self._calls = [], [], []
        rules = GbnfParser(text).rules()
        if "root" not in rules:
            raise RegexError("the grammar has no 'root' rule (the whole output is a root)")
        self._rules = rules
        self._starts = {name: self._state() for name in rules}
        finals = {name: self._state() for name in rules}
        self._final_rule = {f: name for name, f in finals.items()}
        for name, tree in rules.items():
            self._eps[self._build(tree, self._starts[name])].append(finals[name])
        self._trim()
        self._check_left_recursion()
        self._tails: dict[int, bool] = {}
        self._steps = {}
        self._memo_size = 0
        root = (self._starts["root"], {BOTTOM})
        self.start = self._close([root]) if "root" in self._productive else frozenset()
        if not self.start:
            raise RegexError("the grammar's root derives no text that can be written")

    def _state(self) -> int:
        s = super()._state()
        self._calls.append([])
        return s

    def _build(self, tree, at: int) -> int:
        if tree[0] != "ref":
            return super()._build(tree, at)
        if tree[1] not in self._rules:
            raise RegexError(f"the rule {tree[1]!r} is used but not defined")
        end = self._state()
        self._calls[at].append((tree[1], end))
        return end

    def _trim(self) -> None:
        """The rules that derive some text and the NFA states that can reach their rule's end (through calls
        of such rules), to a fixpoint."""
        back: list[list[tuple[int, str | None]]] = [[] for _ in self._edges]
        for s in range(len(self._edges)):
            for _, t in self._edges[s]:
                back[t].append((s, None))
            for t in self._eps[s]:
                back[t].append((s, None))
            for rule, t in self._calls[s]:
                back[t].append((s, rule))
        productive: set[str] = set()
        while True:
            live, todo = set(self._final_rule), list(self._final_rule)
            while todo:
                for s, rule in back[todo.pop()]:
                    if s not in live and (rule is None or rule in productive):
                        live.add(s)
                        todo.append(s)
            now = {name for name, start in self._starts.items() if start in live}
            if now == productive:
                break
            productive = now
        self._live, self._productive = live, productive

    def _moves(self, s: int):
        """(empty moves, calls) from NFA state s that stay live."""
        eps = [t for t in self._eps[s] if t in self._live]
        calls = [(r, t) for r, t in self._calls[s] if r in self._productive and t in self._live]
        return eps, calls

    def _check_left_recursion(self) -> None:
        """Refuse a rule that can call itself before reading a character (closing over it would never end)."""
        nullable: set[str] = set()
        changed = True
        while changed:  # a rule that can end having read nothing
            changed = False
            for name in self._productive - nullable:
                if self._final_of(name) in self._empty_reach(self._starts[name], nullable, None):
                    nullable.add(name)
                    changed = True
        left = {name: set() for name in self._productive}
        for name in self._productive:
            self._empty_reach(self._starts[name], nullable, left[name])
        state: dict[str, int] = {}

        def visit(name: str, path: list[str]) -> None:
            state[name] = 1
            for callee in sorted(left[name]):
                if state.get(callee) == 1:
                    cycle = " -> ".join([*path[path.index(callee):], callee]) if callee in path else callee
                    raise RegexError(f"the grammar is left-recursive ({cycle} before any character); write the "
                                     "repetition with * or + instead")
                if callee not in state:
                    visit(callee, [*path, callee])
            state[name] = 2

        for name in sorted(self._productive):
            if name not in state:
                visit(name, [name])

    def _final_of(self, name: str) -> int:
        return next(f for f, r in self._final_rule.items() if r == name)

    def _empty_reach(self, start: int, nullable: set[str], called: set[str] | None) -> set[int]:
        """NFA states reached from `start` reading nothing (through calls of nullable rules); the rules called
        on the way go into `called`."""
        seen, todo = {start}, [start]
        while todo:
            eps, calls = self._moves(todo.pop())
            nxt = list(eps)
            for rule, ret in calls:
                if called is not None:
                    called.add(rule)
                if rule in nullable:
                    nxt.append(ret)
            for t in nxt:
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        return seen

    def _is_tail(self, ret: int) -> bool:
        """Whether nothing is left after a call returning to `ret`: its rule ends there reading nothing and
        calling nothing (the call then pushes no return point)."""
        tail = self._tails.get(ret)
        if tail is None:
            reach = self._empty_reach(ret, set(), None)
            tail = self._tails[ret] = any(s in self._final_rule for s in reach) and not any(
                self._calls[s] or any(t in self._live for _, t in self._edges[s]) for s in reach)
        return tail

    def _close(self, items) -> frozenset:
        """The state holding `items` ((NFA state, its return links)) closed over empty moves, calls and
        returns: one top per NFA state that reads a character, with the union of the links that reach it
        (a graph-structured stack: readings that share a future share it), and ACCEPT where the root ended.
        A call made in this closure returns through one link per return state, whose links below grow as
        more readings reach the call (a link already returned through returns the newcomers too)."""
        acc: dict[int, set] = {}
        made: dict[int, _Link] = {}  # return state -> the link this closure's calls return through
        todo, work, accepted = list(items), 0, False
        while todo:
            s, links = todo.pop()
            have = acc.setdefault(s, set())
            new = links - have
            if not new:
                continue
            have |= new
            work += len(new)
            if work > MAX_CLOSURE:
                raise RegexError(f"the grammar keeps over {MAX_CLOSURE} ways to go on open after one character; "
                                 "make its rules differ earlier")
            eps, calls = self._moves(s)
            todo.extend((t, new) for t in eps)
            for rule, ret in calls:
                if self._is_tail(ret):
                    todo.append((self._starts[rule], new))
                    continue
                link = made.get(ret)
                if link is None:
                    link = made[ret] = _Link(ret)
                    todo.append((self._starts[rule], {link}))
                added = new - link.below
                link.below |= added
                if link.returned and added:
                    todo.append((ret, added))
            if s in self._final_rule:
                for link in new:
                    if link is BOTTOM:
                        accepted = True
                    elif isinstance(link, _Link):
                        link.returned = True
                        todo.append((link.ret, set(link.below)))
                    else:
                        todo.append((link[0], link[1]))
        frozen: dict[int, tuple] = {}
        tops = {(s, frozenset(_frozen(link, frozen, self._links) for link in links)) for s, links in acc.items()
                if any(t in self._live for _, t in self._edges[s])}
        if accepted:
            tops.add(ACCEPT)
        self._memo_size += work
        return frozenset(tops)

    def step(self, state: frozenset, ch: int) -> frozenset | None:
        key = (state, ch)
        nxt = self._steps.get(key, _MISSING)
        if nxt is not _MISSING:
            return nxt
        moved = [(t, set(links)) for s, links in state if s >= 0
                 for chars, t in self._edges[s] if t in self._live and _contains(chars, ch)]
        nxt = self._close(moved) or None
        if len(self._steps) >= 65536 or self._memo_size > 200_000:
            self._steps.clear()
            self._memo_size = 0
        self._steps[key] = nxt
        return nxt

    def accepts(self, state: frozenset) -> bool:
        return ACCEPT in state

    def can_step(self, state: frozenset, lo: int, hi: int) -> bool:
        return any(_overlaps(chars, lo, hi) and t in self._live
                   for s, _ in state if s >= 0 for chars, t in self._edges[s])

    def is_final(self, state: frozenset) -> bool:
        return state == frozenset({ACCEPT})


class _Link:
    """A return link made while closing one state: where to return, and the links below it (growing)."""

    __slots__ = ("ret", "below", "returned")

    def __init__(self, ret: int) -> None:
        self.ret, self.below, self.returned = ret, set(), False


def _frozen(link, frozen: dict[int, tuple], interned: dict[tuple, tuple]) -> tuple:
    """A link as the immutable (return state, links below, depth) a state holds: a _Link frozen once, after
    its closure, its links below first (a closure's links only point to its own earlier calls, or below).
    Links are interned per machine, so equal links are one object and states compare in their own size, not
    by walking every path below them (which grows exponentially with nesting where paths merge)."""
    if not isinstance(link, _Link):
        return link
    done = frozen.get(id(link))
    if done is _MISSING:  # a link below itself: a call that returns to itself reading nothing
        raise RegexError("the grammar returns to a call before reading a character (left recursion)")
    if done is None:
        frozen[id(link)] = _MISSING
        below = frozenset(_frozen(b, frozen, interned) for b in link.below)
        depth = 1 + max(b[2] for b in below)
        if depth > MAX_DEPTH:
            raise RegexError(f"the output nests the grammar's rules deeper than {MAX_DEPTH}")
        done = frozen[id(link)] = interned.setdefault((link.ret, below), (link.ret, below, depth))
        if len(interned) > MAX_LINKS:
            compile_grammar.cache_clear()  # later requests start a fresh machine (their own key and links)
            raise RegexError(f"the output made the grammar keep over {MAX_LINKS} return links")
    return done


@functools.lru_cache(maxsize=16)
def compile_grammar(text: str) -> GrammarMachine:
    """A grammar's machine (RegexError when it cannot be held), compiled once per text: requests that send
    the same grammar share it, its step memo and the vocabulary's masks."""
    try:
        return GrammarMachine(text)
    except RecursionError:  # e.g. a chain of hundreds of rules, or thousands of stacked repetitions
        raise RegexError("the grammar nests too deeply to compile (chained rules or stacked repetitions)") from None


class GbnfGrammar(TextGrammar):
    """The whole output is a `root` of a GBNF grammar (vLLM's guided_grammar)."""

    def __init__(self, text: str) -> None:
        super().__init__(compile_grammar(text))

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
whose edges may call another rule. A state is a set of stacks of NFA states (the return points, then where
the text is), closed over empty moves, calls and returns; a call that is the last thing its rule does
pushes no return point, so right recursion (`list ::= item ("," list)?`) keeps a flat stack. What a request
may cost is bounded: the grammar's size (regex_dfa's bounds on states and parts), left recursion is
refused when it compiles (it would never consume a character), stacks are at most MAX_DEPTH deep and a
state holds at most MAX_STACKS of them (an ambiguous grammar fails its own request). Rules that can derive
no text are dropped and every NFA state kept can reach its rule's end, so every state reached can still
end in a whole `root`.
"""

from __future__ import annotations

import hashlib

from lorafleet.worker.regex_dfa import Regex, _contains, _overlaps
from lorafleet.worker.regex_grammar import TextGrammar
from lorafleet.worker.regex_parse import ANY, MAX_GROUPS, TEXT, Parser, RegexError

MAX_GRAMMAR = 16384  # characters of a grammar
MAX_DEPTH = 256  # a stack's frames: nesting the output may reach
MAX_STACKS = 64  # stacks a state may hold (the readings of an ambiguous grammar)
_NAME = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
_MISSING = object()


class GbnfParser(Parser):
    """GBNF text to {rule name: tree}, the tree as regex_parse's with ("ref", name) for a rule name."""

    def error(self, what: str) -> RegexError:
        line = self.p.count("\n", 0, self.i) + 1
        return RegexError(f"{what} at line {line}, position {self.i} of the grammar")

    def rules(self) -> dict[str, object]:
        rules: dict[str, object] = {}
        self.ws()
        while self.peek() is not None:
            name = self.name()
            self.ws()
            if not self.p.startswith("::=", self.i):
                if self.p.startswith(":", self.i):
                    raise self.error("a Lark rule ('name: ...'); this server takes GBNF ('name ::= ...')")
                raise self.error(f"'::=' expected after the rule name {name!r}")
            self.i += 3
            if name in rules:
                raise self.error(f"the rule {name!r} defined twice")
            rules[name] = self.alt()
        return rules

    def ws(self) -> None:
        while (c := self.peek()) is not None and (c in " \t\r\n" or c == "#"):
            if c == "#":
                end = self.p.find("\n", self.i)
                self.i = len(self.p) if end < 0 else end
            else:
                self.i += 1

    def name(self) -> str:
        j = self.i
        while self.peek() is not None and self.peek() in _NAME:
            self.i += 1
        if j == self.i:
            raise self.error(f"a rule name expected (got {self.peek()!r})" if self.peek() else "a rule name expected")
        return self.p[j:self.i]

    def _rule_starts(self) -> bool:
        """Whether a `name ::=` (the next rule) begins at self.i."""
        j = self.i
        while j < len(self.p) and self.p[j] in _NAME:
            j += 1
        while j < len(self.p) and self.p[j] in " \t\r\n":
            j += 1
        return j > self.i and self.p.startswith("::=", j)

    def alt(self):
        parts = [self.seq()]
        while self.peek() == "|":
            self.i += 1
            parts.append(self.seq())
        return parts[0] if len(parts) == 1 else ("alt", parts)

    def seq(self, top: bool = False):
        items = []
        self.ws()
        while (c := self.peek()) is not None and c not in "|)" and not self._rule_starts():
            items.append(self.quantified(self.atom()))
            self.ws()
        return ("cat", items)

    def quantified(self, tree):
        self.ws()
        return super().quantified(tree)

    def atom(self):
        c = self.peek()
        if c == '"':
            self.i += 1
            chars = []
            while (c := self.peek()) != '"':
                if c is None:
                    raise self.error("an unterminated string")
                chars.append(("set", self.escape(False) if self.take() == "\\" else ((ord(c), ord(c)),)))
            self.i += 1
            return ("cat", chars)
        if c == "[":
            self.i += 1
            return ("set", self.klass())
        if c == ".":
            self.i += 1
            return ("set", ANY)
        if c == "(":
            self.i += 1
            self.depth += 1
            if self.depth > MAX_GROUPS:
                raise self.error(f"groups nested deeper than {MAX_GROUPS}")
            tree = self.alt()
            self.ws()
            if self.peek() != ")":
                raise self.error("a missing ')'")
            self.i += 1
            self.depth -= 1
            return tree
        if c is not None and c in _NAME:
            return ("ref", self.name())
        raise self.error(f"an unexpected {c!r}")

    def escape(self, in_class: bool):
        if self.peek() == "U":
            self.i += 1
            digits = self.p[self.i:self.i + 8]
            self.i += 8
            try:
                code = int(digits, 16) if len(digits) == 8 else -1
            except ValueError:
                code = -1
            if not 0 <= code <= 0x10FFFF:
                raise self.error("a malformed '\\U' escape")
            return ((code, code),)
        if self.peek() is not None and self.peek() in "dDwWsS":
            raise self.error(f"the escape '\\{self.peek()}' is not GBNF (use a character class)")
        return super().escape(in_class)


class GrammarMachine(Regex):
    """A GBNF grammar as a Regex-like machine over characters (start, step, accepts, can_step, is_final,
    classes, matches): its states are frozensets of stacks (tuples of NFA states, the innermost last); the
    empty stack means the whole root was read."""

    def __init__(self, text: str) -> None:
        if not isinstance(text, str) or len(text) > MAX_GRAMMAR:
            raise RegexError(f"a grammar must be a string of at most {MAX_GRAMMAR} characters")
        self.pattern = text
        self.key = "gbnf:" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
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
        self.start = self._close([(self._starts["root"],)]) if "root" in self._productive else frozenset()
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

    def _close(self, stacks) -> frozenset:
        out, seen, todo = set(), set(), list(stacks)
        while todo:
            st = todo.pop()
            if st in seen:
                continue
            seen.add(st)
            if not st:
                out.add(st)
                continue
            if len(st) > MAX_DEPTH:
                raise RegexError(f"the output nests the grammar's rules deeper than {MAX_DEPTH}")
            s, below = st[-1], st[:-1]
            if any(t in self._live for _, t in self._edges[s]):
                out.add(st)
            eps, calls = self._moves(s)
            todo.extend(below + (t,) for t in eps)
            for rule, ret in calls:
                todo.append((below if self._is_tail(ret) else below + (ret,)) + (self._starts[rule],))
            if s in self._final_rule:
                todo.append(below)
        if len(out) > MAX_STACKS:
            raise RegexError(f"more than {MAX_STACKS} readings of the output fit the grammar at once (an ambiguous "
                             "grammar); make its alternatives differ early")
        return frozenset(out)

    def step(self, state: frozenset, ch: int) -> frozenset | None:
        key = (state, ch)
        nxt = self._steps.get(key, _MISSING)
        if nxt is not _MISSING:
            return nxt
        moved = [st[:-1] + (t,) for st in state if st
                 for chars, t in self._edges[st[-1]] if t in self._live and _contains(chars, ch)]
        nxt = self._close(moved) or None
        self._memo_size += len(nxt or ())
        if len(self._steps) >= 65536 or self._memo_size > 100_000:
            self._steps.clear()
            self._memo_size = 0
        self._steps[key] = nxt
        return nxt

    def accepts(self, state: frozenset) -> bool:
        return () in state

    def can_step(self, state: frozenset, lo: int, hi: int) -> bool:
        return any(_overlaps(chars, lo, hi) and t in self._live
                   for st in state if st for chars, t in self._edges[st[-1]])

    def is_final(self, state: frozenset) -> bool:
        return state == frozenset({()})


class GbnfGrammar(TextGrammar):
    """The whole output is a `root` of a GBNF grammar (vLLM's guided_grammar)."""

    def __init__(self, text: str) -> None:
        super().__init__(GrammarMachine(text))

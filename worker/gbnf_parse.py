"""GBNF text parsed into rules (gbnf.py compiles them): regex_parse.Parser's trees, with ("ref", name) for a
rule name; whitespace and `#` comments between items; a rule ends where the next `name ::=` begins."""

from __future__ import annotations

from lorafleet.worker.regex_parse import ANY, MAX_GROUPS, Parser, RegexError

_NAME = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
_HEX = frozenset("0123456789abcdefABCDEF")


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

    def seq(self, top: bool = False):
        items = []
        self.ws()
        while (c := self.peek()) is not None and c not in "|)" and not self._rule_starts():
            items.append(self.quantified(self.atom()))
            self.ws()
        return ("cat", items)

    def quantified(self, tree):
        """As llama.cpp reads a sequence: quantifiers may follow one another, whitespace between (`"a"{2}*` is a
        repeat of a repeat), where a regex (ECMAScript) refuses a second one."""
        self.ws()
        while (bound := self._quantifier()) is not None:
            tree = ("rep", tree, *bound)
            self.ws()
        return tree

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
            code = int(digits, 16) if len(digits) == 8 and set(digits) <= _HEX else -1
            if not 0 <= code <= 0x10FFFF:
                raise self.error("a malformed '\\U' escape")
            return ((code, code),)
        if (c := self.peek()) is not None and c.isalnum() and c not in "nrtfv0xu":
            raise self.error(f"the escape '\\{c}' is not GBNF (escapes: \\n \\r \\t \\xHH \\uHHHH \\UHHHHHHHH and "
                             "punctuation)")
        return super().escape(in_class)

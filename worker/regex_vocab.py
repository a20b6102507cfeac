"""A vocabulary's tokens as a trie of a regex's character classes (regex_dfa.Regex.classes), for JsonVocab's
masks of regex states: a guided_regex or a schema's pattern.

Scanning every token at every new state would cost a few hundred milliseconds on a 49k vocabulary where the
pattern takes most text, in the engine's step. Tokens whose characters fall in the same classes step alike
from every state, so the tokens that are whole text (complete UTF-8; inside a JSON string, plain content
with no quote, backslash or control byte) are put once per regex in a trie keyed by class, and a mask walks
it from the state, pruning at the first class the state cannot take: the work is the trie's live part, not
the vocabulary. The other tokens (a partial UTF-8 character, an escape, a closing quote) are few and are
scanned as before.
"""

from __future__ import annotations

import bisect
import time

import torch

from lorafleet.worker.regex_dfa import Regex, RegexError

MAX_MASK_SECONDS = 0.5  # one mask's walk: past it the request fails (its pattern would stall every step)


class ClassTrie:
    def __init__(self, regex: Regex, tokens: list[tuple[int, str]]) -> None:
        """`tokens`: (token id, its text) of the tokens the trie holds."""
        bmp, starts, astral, self.reps = regex.classes()
        children: list[dict[int, int]] = [{}]
        ends: list[list[int]] = [[]]
        for token_id, text in tokens:
            node = 0
            for ch in text:
                o = ord(ch)
                cls = bmp[o] if o < 0x10000 else astral[bisect.bisect_right(starts, o) - 1]
                kids = children[node]
                nxt = kids.get(cls)
                if nxt is None:
                    nxt = kids[cls] = len(children)
                    children.append({})
                    ends.append([])
                node = nxt
            ends[node].append(token_id)
        self._children = children
        self._ends = [torch.tensor(e, dtype=torch.int64) if e else None for e in ends]

    def valid(self, regex: Regex, dstate: frozenset, may_complete: bool = True) -> list[torch.Tensor]:
        """The ids of the trie's tokens that `dstate` may read whole (with may_complete False, none after which
        the text is final: regex_dfa.Regex.is_final), as tensors to index a mask with."""
        return [ids for state, _, ids in self.ends(regex, dstate) if may_complete or not regex.is_final(state)]

    def ends(self, regex: Regex, dstate: frozenset) -> list[tuple[frozenset, int, torch.Tensor]]:
        """(the state after, their characters, ids) of the trie's tokens that `dstate` may read whole, grouped
        by trie node (regex_length.LengthRegex checks the count at the end only)."""
        out, stack, reps = [], [(0, dstate, 0)], self.reps
        deadline, walked = time.thread_time() + MAX_MASK_SECONDS, 0
        while stack:
            node, state, depth = stack.pop()
            walked += 1
            if walked % 32 == 0 and time.thread_time() > deadline:  # a node may cost a grammar closure
                raise RegexError(f"holding the output to this pattern costs over {MAX_MASK_SECONDS:g} s of a step "
                                 "(many positions open at once?): anchor or simplify it")
            for cls, child in self._children[node].items():
                nxt = regex.step(state, reps[cls])
                if nxt is None:
                    continue
                if (ids := self._ends[child]) is not None:
                    out.append((nxt, depth + 1, ids))
                stack.append((child, nxt, depth + 1))
        return out

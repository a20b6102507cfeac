"""ChoiceGrammar: the output is exactly one of a list of strings (vLLM's `guided_choice`).

The grammar JsonGuide holds a row to, in the interface of json_constraint.JSON_OBJECT and
json_schema_grammar.SchemaGrammar: the state is the output's bytes so far (a prefix of some choice), or
DONE once they are a whole choice that no other choice extends. The text is the choice as written, not a
JSON string. A choice that is a prefix of another (`"yes"` and `"yes!"`) is refused: EOS may end a
row only once its value is complete, so the shorter one could never be chosen.
"""

from __future__ import annotations

import hashlib
import json
import threading
from bisect import bisect_left

DONE = "done"
MAX_CHOICES = 1024
MAX_CHOICE_BYTES = 1 << 16  # all choices together


class ChoiceError(ValueError):
    """A list of choices the grammar cannot hold the output to; the message says why."""


class ChoiceGrammar:
    def __init__(self, choices: list[str]) -> None:
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise ChoiceError("must be a non-empty list of non-empty strings")
        if len(choices) > MAX_CHOICES:
            raise ChoiceError(f"takes at most {MAX_CHOICES} choices (got {len(choices)})")
        try:
            encoded = sorted({c.encode() for c in choices})
        except UnicodeEncodeError as exc:
            raise ChoiceError(f"a choice is not text ({exc})") from None
        if sum(map(len, encoded)) > MAX_CHOICE_BYTES:
            raise ChoiceError(f"takes at most {MAX_CHOICE_BYTES} bytes of choices in all")
        for shorter, longer in zip(encoded, encoded[1:], strict=False):
            if longer.startswith(shorter):
                raise ChoiceError(f"{json.dumps(shorter.decode())} is the start of {json.dumps(longer.decode())}: the "
                                  "shorter could never be chosen (the output may end only once it is whole)")
        self.choices = tuple(encoded)  # sorted: a prefix's choices are a run found by bisection
        self.key = "choice:" + hashlib.sha256(json.dumps([c.decode() for c in encoded]).encode()).hexdigest()
        self.start = b""
        self._spelled: tuple[set[bytes], str | None] | None = None  # (vocabulary, unspellable's answer)
        self._spelling_lock = threading.Lock()
        self.pads = False  # no whitespace after a choice (ignore_eos, min_tokens): the text is the choice exactly

    def unspellable(self, token_bytes: set[bytes], longest: int) -> str | None:
        """The first choice no sequence of these tokens' bytes writes exactly (a vocabulary without a token for
        every byte), else None: such a row would otherwise take a prefix and then find no way on. Worked out
        once per vocabulary (the `n` rows of a request share the grammar), up to bytes x longest token steps."""
        with self._spelling_lock:
            if self._spelled is None or self._spelled[0] is not token_bytes:
                self._spelled = (token_bytes, self._unspellable(token_bytes, longest))
            return self._spelled[1]

    def _unspellable(self, token_bytes: set[bytes], longest: int) -> str | None:
        for choice in self.choices:
            reach = [True] + [False] * len(choice)  # reach[i]: choice[:i] is a sequence of tokens
            for i in range(len(choice)):
                if reach[i]:
                    for j in range(i + 1, min(len(choice), i + longest) + 1):
                        reach[j] = reach[j] or choice[i:j] in token_bytes
            if not reach[-1]:
                return choice.decode()
        return None

    @staticmethod
    def is_complete(state) -> bool:
        return state == DONE

    @staticmethod
    def may_stop(state) -> bool:
        return False  # only a whole choice ends (is_complete)

    @staticmethod
    def regex_reading(state) -> None:
        return None

    @staticmethod
    def is_in_string(state) -> bool:
        return False

    @staticmethod
    def ws_uniform(state) -> bool:
        return False  # whitespace is part of a choice's text

    def advance(self, state, data: bytes):
        """The state after `data`, or None when the output would no longer be the start of a choice."""
        if state == DONE:
            return None if data else state
        text = state + data
        at = bisect_left(self.choices, text)
        if at == len(self.choices) or not self.choices[at].startswith(text):
            return None
        return DONE if self.choices[at] == text else text  # no choice extends another: whole means done

"""JsonGuide: JSON mode (`response_format: {"type": "json_object"}`) for the sampler's constrained rows.

A constrained sequence's output is a prefix of one JSON object. Its stop tokens (EOS and its
stop_token_ids, EOS even with ignore_eos) may be drawn only once the object is complete, and then
nothing else may; while it has fewer than min_tokens - 1 tokens, no token may complete the object (it
could not end there). Each sequence's validator state is kept on it with the number of output tokens it
covers and advanced by the tokens gained since, so a recomputed (preempted) sequence, which keeps its
output tokens, finds it as it left it.

The sampler draws as usual and keeps the token when the row accepts it; otherwise it draws again among
the row's mask (sampler.py), which is exactly the distribution restricted to the valid tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from lorafleet.worker.json_constraint import START, JsonState, advance, is_complete
from lorafleet.worker.json_vocab import JsonVocab, json_vocab
from lorafleet.worker.sequence import Sequence
from lorafleet.worker.tokenizer import Tokenizer


class JsonModeError(RuntimeError):
    """A JSON-mode sequence cannot go on (its request fails; the others are not affected)."""


class JsonGuide:
    def __init__(self, build_vocab: Callable[[], JsonVocab], eos_token_ids: Iterable[int] = ()) -> None:
        self._build_vocab = build_vocab  # built at the first JSON-mode step: a scan of the whole vocabulary
        self._vocab: JsonVocab | None = None
        self.eos_token_ids = frozenset(eos_token_ids)

    @classmethod
    def of(cls, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: Iterable[int],
           device: torch.device | str) -> JsonGuide | None:
        """The guide of a model's `vocab_size` logits; None without a tokenizer (no token bytes)."""
        if tokenizer is None:
            return None
        return cls(lambda: json_vocab(tokenizer, vocab_size, device), eos_token_ids)

    @property
    def vocab(self) -> JsonVocab:
        if self._vocab is None:
            self._vocab = self._build_vocab()
        return self._vocab

    def stop_ids(self, seq: Sequence) -> frozenset[int]:
        return self.eos_token_ids | frozenset(seq.params.stop_token_ids)

    def state(self, seq: Sequence) -> JsonState:
        """The validator's state after the sequence's output tokens."""
        output = seq.output_token_ids
        num_done, state = seq.json_state or (0, START)
        if num_done > len(output):  # never expected (outputs only grow): start over
            num_done, state = 0, START
        stops = self.stop_ids(seq)
        for token_id in output[num_done:]:
            if token_id in stops and is_complete(state):
                continue  # a stop token that did not end the request (ignore_eos)
            data = self.vocab.token_bytes(token_id) if token_id not in stops else b""
            nxt = advance(state, data) if data else None
            if nxt is None:
                raise JsonModeError(f"JSON mode: output token {token_id} does not continue the JSON object")
            state = nxt
        seq.json_state = (len(output), state)
        return state

    @staticmethod
    def may_complete(seq: Sequence) -> bool:
        """Whether the next token may complete the object: a stop token could follow within min_tokens."""
        return len(seq.output_token_ids) + 1 >= seq.params.min_tokens

    def accepts(self, seq: Sequence, token_id: int) -> bool:
        state = self.state(seq)
        if token_id in self.stop_ids(seq):
            return is_complete(state)
        return self.vocab.accepts(state, token_id, self.may_complete(seq))

    def invalid(self, seq: Sequence, device: torch.device) -> torch.Tensor:
        """bool [V] on `device`, True where the sequence may NOT draw its next token (JsonModeError when it may
        draw none). The vocabulary's cached mask itself unless a stop token id is also a text token."""
        state = self.state(seq)
        vocab = self.vocab
        stops = sorted(t for t in self.stop_ids(seq) if 0 <= t < vocab.vocab_size)
        if is_complete(state):
            if not stops:
                raise JsonModeError("JSON mode: the object is complete but no stop token may end the request")
            invalid = torch.ones(vocab.vocab_size, dtype=torch.bool, device=device)
            invalid[torch.tensor(stops, device=device)] = False
            return invalid
        invalid, num_valid = vocab.mask(state, self.may_complete(seq))
        text_stops = [t for t in stops if vocab.token_bytes(t)]  # stop ids are never content, even text tokens
        if text_stops:
            invalid = invalid.clone()
            invalid[torch.tensor(text_stops, device=invalid.device)] = True
        if num_valid <= len(text_stops) and not bool((~invalid).any()):
            raise JsonModeError("JSON mode: no token of the vocabulary continues the JSON object")
        return invalid.to(device)

"""`logit_bias` (OpenAI's): a JSON object mapping token ids, as strings, to a bias in [-100, 100].

Checked here so that the protocol and the request builder refuse what the sampler cannot apply; the
sampler adds the biases to the raw logits (see sampler.py). The token ids' upper bound is the model's
vocabulary, known only once the request reaches a model (`out_of_vocab`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

MAX_ENTRIES = 1024  # entries per request
MAX_BIAS = 100.0


class LogitBiasError(ValueError):
    """A malformed `logit_bias`; `code` is the OpenAI error code to answer with."""

    def __init__(self, message: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.code = code


def parse_logit_bias(v: Any) -> dict[int, float] | None:
    """{token id: bias}; None when the field is unset or empty."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise LogitBiasError("'logit_bias' must be an object mapping token ids to biases", "invalid_type")
    if len(v) > MAX_ENTRIES:
        raise LogitBiasError(f"'logit_bias' takes at most {MAX_ENTRIES} entries (got {len(v)})")
    out: dict[int, float] = {}
    for key, bias in v.items():
        # A token id has at most 10 digits (int() of thousands of digits raises, and takes quadratic time).
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10):
            raise LogitBiasError(f"'logit_bias' keys must be token ids, as strings of digits (got {key!r})")
        token_id = int(key)
        if token_id in out:
            raise LogitBiasError(f"'logit_bias' names token id {token_id} twice")
        if not isinstance(bias, int | float) or isinstance(bias, bool):
            raise LogitBiasError(f"'logit_bias' values must be numbers (got {bias!r} for {key})", "invalid_type")
        if not (-MAX_BIAS <= bias <= MAX_BIAS and math.isfinite(bias)):  # a huge int: no float conversion
            raise LogitBiasError(f"'logit_bias' values must be in [-100, 100] (got {bias!r} for {key})")
        out[token_id] = float(bias)
    return out or None


def out_of_vocab(token_ids: Iterable[int] | None, vocab_size: int) -> list[int]:
    """The token ids outside the vocabulary [0, vocab_size), sorted: of a `logit_bias` (its keys) or of
    `stop_token_ids`."""
    return sorted({t for t in token_ids or () if not 0 <= t < vocab_size})

"""CompletionJob: one HTTP inference request, resolved and tokenized, and the shapes of its answer.

A request becomes `len(prompts) * n` choices, each one engine request with its own SamplingParams
(choice i of a seeded request uses seed + i, so n samples differ yet repeat). The response shapes
follow OpenAI's: `text_completion` / `chat.completion` / `chat.completion.chunk`, `usage`, and
logprobs in the completions (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`) or chat
(`content: [{token, logprob, bytes, top_logprobs}]`) form.
"""

from __future__ import annotations

import codecs
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lorafleet.worker.logit_bias import out_of_vocab
from lorafleet.worker.openai_protocol import APIError, SamplingOptions
from lorafleet.worker.sampling_params import SamplingParams
from lorafleet.worker.sequence import TokenLogprob
from lorafleet.worker.tenants import Tenant
from lorafleet.worker.token_bytes import token_bytes


@dataclass(slots=True)
class CompletionJob:
    """One HTTP inference request, resolved and tokenized, ready for the engine."""

    endpoint: str  # "completions" | "chat"
    request_id: str
    model: str  # what the response's `model` says: name@version or the base model
    adapter: str | None  # engine key
    prompt_ids: list[list[int]]
    options: SamplingOptions
    tenant: Tenant  # the caller: errors name only adapters it may use
    params: list[SamplingParams] = field(default_factory=list)  # per choice
    choice_prompt: list[int] = field(default_factory=list)  # choice index -> prompt index
    # Resolves `model` again when the version chosen on arrival was replaced before the engine took the
    # request (a directive push between the two); None when the caller pinned `name@version`.
    re_resolve: Callable[[], str | None] | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    arrived: float = field(default_factory=time.monotonic)

    @property
    def num_choices(self) -> int:
        return len(self.params)

    def add_choices(self, max_model_len: int, vocab_size: int | None = None) -> None:
        """One SamplingParams per (prompt, n); refuses prompts that do not fit the context, `min_tokens` beyond
        what the context leaves, and `logit_bias` or `stop_token_ids` token ids outside the vocabulary (as vLLM
        does), with a 400."""
        o = self.options
        for param, token_ids in (("logit_bias", o.logit_bias), ("stop_token_ids", o.stop_token_ids)):
            bad = out_of_vocab(token_ids, vocab_size) if vocab_size is not None else []
            if bad:
                raise APIError(400, f"'{param}' names token ids outside the vocabulary (0..{vocab_size - 1}): "
                                    f"{', '.join(map(str, bad[:5]))}", code="invalid_value", param=param)
        for p, ids in enumerate(self.prompt_ids):
            if len(ids) >= max_model_len:
                raise APIError(400, f"This model's maximum context length is {max_model_len} tokens; the prompt "
                                    f"has {len(ids)} tokens. Shorten the prompt.", code="context_length_exceeded",
                               param="messages" if self.endpoint == "chat" else "prompt")
            max_tokens = o.max_tokens if o.max_tokens is not None else max_model_len - len(ids)
            if len(ids) + max_tokens > max_model_len:
                raise APIError(400, f"This model's maximum context length is {max_model_len} tokens; you requested "
                                    f"{len(ids) + max_tokens} ({len(ids)} in the prompt, {max_tokens} to generate). "
                                    f"Lower {o.max_tokens_param} or shorten the prompt.",
                               code="context_length_exceeded", param=o.max_tokens_param)
            if o.min_tokens > max_tokens:  # max_tokens unset: the context left after this prompt bounds it
                raise APIError(400, f"'min_tokens' ({o.min_tokens}) is more than the {max_tokens} tokens this "
                                    f"prompt leaves of the model's context ({max_model_len} tokens)",
                               code="invalid_value", param="min_tokens")
            for j in range(o.n):
                seed = None if o.seed is None else o.seed + j  # n choices with one seed must still differ
                self.params.append(SamplingParams(
                    max_tokens=max_tokens, temperature=o.temperature, top_p=o.top_p, top_k=o.top_k, seed=seed,
                    stop=list(o.stop), logprobs=o.logprobs, ignore_eos=o.ignore_eos,
                    presence_penalty=o.presence_penalty, frequency_penalty=o.frequency_penalty,
                    repetition_penalty=o.repetition_penalty, logit_bias=o.logit_bias, min_p=o.min_p,
                    stop_token_ids=list(o.stop_token_ids), include_stop_str_in_output=o.include_stop_str_in_output,
                    min_tokens=o.min_tokens, skip_special_tokens=o.skip_special_tokens))
                self.choice_prompt.append(p)

    def usage(self, completion_tokens: int) -> dict[str, int]:
        prompt_tokens = sum(len(self.prompt_ids[p]) for p in sorted(set(self.choice_prompt)))
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def choice(self, tokenizer, index: int, text: str, lps: list[TokenLogprob] | None, finish_reason: str | None,
               *, delta: bool, first: bool = False,
               offsets: TextOffsets | None = None) -> dict[str, Any]:
        """One entry of `choices`: a whole choice, or a streamed delta (`first`: the choice's first chunk;
        `offsets`: the choice's TextOffsets, kept over all its chunks)."""
        if self.endpoint == "completions":
            offsets = offsets if offsets is not None else TextOffsets()
            return {"index": index, "text": text, "logprobs": completion_logprobs(tokenizer, lps, offsets),
                    "finish_reason": finish_reason}
        if delta:
            message = ({"role": "assistant"} if first else {}) | ({"content": text} if text or first else {})
            return {"index": index, "delta": message, "logprobs": chat_logprobs(tokenizer, lps),
                    "finish_reason": finish_reason}
        return {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": chat_logprobs(tokenizer, lps), "finish_reason": finish_reason}

    def envelope(self, choices: list[dict[str, Any]], *, chunk: bool) -> dict[str, Any]:
        kind = {"completions": "text_completion", "chat": "chat.completion.chunk" if chunk else "chat.completion"}
        return {"id": self.request_id, "object": kind[self.endpoint], "created": self.created, "model": self.model,
                "choices": choices, "system_fingerprint": None}


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False) if tokenizer is not None else str(token_id)


def raw_bytes(tokenizer, token_id: int) -> bytes:
    """The bytes the token stands for: part of a UTF-8 character for a byte-fallback token, where its
    text is U+FFFD."""
    return token_bytes(tokenizer)(token_id) if tokenizer is not None else str(token_id).encode()


class TextOffsets:
    """Where each token's text starts in its choice's text, in characters, counted from the tokens'
    bytes over all the choice's chunks (one instance per choice): a token that continues a character
    begun by an earlier token is at that character. Running example, "é!" as tokens [c3] [a9] [21]:
    0, 0, 1, whether sent in one chunk or streamed as [c3] | [a9] [21]. Counting the tokens, not the
    text sent so far, keeps offsets right while text is held back (a possible stop string). Bytes that
    are not valid UTF-8 count as U+FFFD, as they do in the text."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._num_chars = 0  # characters the tokens so far decode to (a partial character not yet)

    def __call__(self, pieces: list[bytes]) -> list[int]:
        offsets = []
        for piece in pieces:
            offsets.append(self._num_chars)
            self._num_chars += len(self._decoder.decode(piece))
        return offsets


def completion_logprobs(tokenizer, lps: list[TokenLogprob] | None,
                        offsets: TextOffsets) -> dict[str, Any] | None:
    if lps is None:
        return None

    def top(lp: TokenLogprob) -> dict[str, float]:
        entries = {token_text(tokenizer, t): v for t, v in lp.top}
        # As OpenAI and vLLM: the sampled token is always there, so up to `logprobs` + 1 entries.
        entries.setdefault(token_text(tokenizer, lp.token_id), lp.logprob)
        return entries

    return {
        "tokens": [token_text(tokenizer, lp.token_id) for lp in lps],
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [top(lp) for lp in lps],
        "text_offset": offsets([raw_bytes(tokenizer, lp.token_id) for lp in lps]),
    }


def chat_logprobs(tokenizer, lps: list[TokenLogprob] | None) -> dict[str, Any] | None:
    if lps is None:
        return None

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(raw_bytes(tokenizer, token_id))}

    return {"content": [entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in lps]}

"""CompletionJob: one HTTP inference request, resolved and tokenized, and the shapes of its answer.

A request becomes `len(prompts) * n` choices, each one engine request with its own SamplingParams
(choice i of a seeded request uses seed + i, so n samples differ yet repeat). The response shapes
follow OpenAI's: `text_completion` / `chat.completion` / `chat.completion.chunk`, `usage`, and
logprobs in the completions (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`) or chat
(`content: [{token, logprob, bytes, top_logprobs}]`) form.

`echo` (completions, OpenAI's legacy semantics): a choice's text is the prompt's text (a string prompt as
sent, token ids decoded with special tokens) followed by the completion; streamed, the prompt's text is
in the choice's first chunk. With `max_tokens` 0 the prompt is only scored (as OpenAI's legacy API and
vLLM do): the engine generates one token that the answer leaves out (no text, no logprobs, no completion
tokens in `usage`, finish_reason "length"). With `logprobs`, the prompt's tokens come first, the first
of them with null `token_logprobs` and `top_logprobs` (as OpenAI and vLLM answer), and `text_offset`
counts through the echoed text (a BOS token's "<s>" or SentencePiece's leading space, which a string
prompt as sent lacks, at 0). Special tokens the text skips take no room in `text_offset`. vLLM's
`prompt_logprobs` answers, per prompt token, None for the first, then `{token_id: {logprob, rank,
decoded_token}}` for the prompt token and the k most likely: in each choice (completions) or beside the
choices (chat), as vLLM places it.
"""

from __future__ import annotations

import codecs
import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lorafleet.worker.logit_bias import out_of_vocab
from lorafleet.worker.openai_protocol import APIError, SamplingOptions
from lorafleet.worker.request_output import RequestOutput
from lorafleet.worker.sampling_params import SamplingParams
from lorafleet.worker.sequence import TokenLogprob
from lorafleet.worker.tenants import Tenant
from lorafleet.worker.token_bytes import token_bytes
from lorafleet.worker.tool_calls import ToolCalls

# Logprob entries one answer may hold (about 75 bytes of JSON each, several times that while it is built): far
# above any single choice's (20 top logprobs over 16k tokens: 344,064), and a bound on n x prompt_logprobs.
MAX_LOGPROB_ENTRIES = 500_000


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
    # Told the engine key the job moves to (worker/job_outputs.py): the request holds that version's metric
    # series too, until it has counted on it (worker/retired_series.py).
    on_move: Callable[[str | None], None] | None = None
    prompts: list[str | list[int]] | None = None  # completions: the prompts as sent (what `echo` repeats)
    failed_over: str | None = None  # the engine key it moved off because that version failed to load
    score_only: bool = False  # echo with max_tokens 0: the one token generated is left out of the answer
    tool_calls: ToolCalls | None = None  # chat with tools (not tool_choice "none"): the output read for calls
    answer_id: str | None = None  # the answer's `id` where the caller named it (else request_id)
    prompt_tokens_details: bool = False  # --enable-prompt-tokens-details: the whole answer's usage says cached_tokens
    prompt_entries: int = 0  # logprob entries of the whole answer's prompts (echo, prompt_logprobs)
    generated_entries: int = 0  # and of its tokens generated so far
    created: int = field(default_factory=lambda: int(time.time()))
    arrived: float = field(default_factory=time.monotonic)

    @property
    def num_choices(self) -> int:
        return len(self.params)

    def length_param(self, prompt_alone: bool) -> str:
        """The field a context-length error names: the prompt's (`prompt_alone`: too long by itself), or the
        max_tokens field the caller sent (or its default)."""
        if prompt_alone:
            return "messages" if self.endpoint == "chat" else "prompt"
        return self.options.max_tokens_param

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
        # echo with logprobs needs the prompt's logprobs too: the engine computes the larger k of the two
        echo_k = max(o.prompt_logprobs or 0, o.logprobs) if o.echo and o.logprobs is not None else None
        prompt_k = o.prompt_logprobs if echo_k is None else echo_k
        entries = prompts_entries = 0  # logprob entries the answer will hold (each with its token's text), below
        for p, ids in enumerate(self.prompt_ids):
            if len(ids) >= max_model_len:
                raise APIError(400, f"This model's maximum context length is {max_model_len} tokens; the prompt "
                                    f"has {len(ids)} tokens. Shorten the prompt.", code="context_length_exceeded",
                               param=self.length_param(True))
            left = max_model_len - len(ids)  # unset: the model's default (at least min_tokens) within the context
            max_tokens = o.max_tokens if o.max_tokens is not None else min(left, max(o.default_max_tokens or left,
                                                                                      o.min_tokens))
            self.score_only = max_tokens == 0
            max_tokens = max(max_tokens, 1)  # scored only: the prompt's logprobs come with one token's step
            if len(ids) + max_tokens > max_model_len:
                raise APIError(400, f"This model's maximum context length is {max_model_len} tokens; you requested "
                                    f"{len(ids) + max_tokens} ({len(ids)} in the prompt, {max_tokens} to generate). "
                                    f"Lower {o.max_tokens_param} or shorten the prompt.",
                               code="context_length_exceeded", param=self.length_param(False))
            if o.min_tokens > max_tokens:  # max_tokens unset: the context left after this prompt bounds it
                raise APIError(400, f"'min_tokens' ({o.min_tokens}) is more than the {max_tokens} tokens this "
                                    f"prompt leaves of the model's context ({max_model_len} tokens)",
                               code="invalid_value", param="min_tokens")
            per_prompt = len(ids) * ((o.logprobs + 1 if echo_k is not None else 0)  # echo's, and prompt_logprobs
                                     + (o.prompt_logprobs + 1 if o.prompt_logprobs is not None else 0))
            # Generated tokens as asked; unset, counted as they come (`count_generated`): most answers are short.
            generated = max_tokens if o.max_tokens is not None else 0
            prompts_entries += per_prompt if self.endpoint == "chat" else o.n * per_prompt
            entries += o.n * generated * (o.logprobs + 1) if o.logprobs is not None else 0
            # A stream is sent as it comes, a few tokens' logprobs a chunk; but each choice's first chunk holds
            # its prompt's (echo) whole: those are bounded alike.
            self.check_logprob_entries(prompts_entries if o.stream else prompts_entries + entries)
            self.prompt_entries = prompts_entries
            for j in range(o.n):
                seed = None if o.seed is None else o.seed + j  # n choices with one seed must still differ
                if self.params:  # checked once (its logit_bias may hold thousands of entries): the others copy it
                    params = copy.copy(self.params[0])
                    params.max_tokens, params.seed = max_tokens, seed
                else:
                    params = SamplingParams(
                        max_tokens=max_tokens, temperature=o.temperature, top_p=o.top_p, top_k=o.top_k, seed=seed,
                        stop=list(o.stop), logprobs=o.logprobs, ignore_eos=o.ignore_eos,
                        presence_penalty=o.presence_penalty, frequency_penalty=o.frequency_penalty,
                        repetition_penalty=o.repetition_penalty, logit_bias=o.logit_bias, min_p=o.min_p,
                        stop_token_ids=list(o.stop_token_ids), include_stop_str_in_output=o.include_stop_str_in_output,
                        min_tokens=o.min_tokens, skip_special_tokens=o.skip_special_tokens, prompt_logprobs=prompt_k,
                        json_object=o.json_object, grammar=o.grammar, max_tokens_to_fit=o.max_tokens is None,
                        cache_salt=o.cache_salt)
                self.params.append(params)
                self.choice_prompt.append(p)

    def count_generated(self, num_tokens: int) -> None:
        """A whole answer's logprobs of `num_tokens` more generated tokens: past MAX_LOGPROB_ENTRIES, a 400 that
        stops the generation there (an unset max_tokens was not counted up front), not once it is done."""
        o = self.options
        if o.logprobs is not None and not o.stream:
            self.generated_entries += num_tokens * (o.logprobs + 1)
            self.check_logprob_entries(self.prompt_entries + self.generated_entries)

    def check_logprob_entries(self, entries: int) -> None:
        """A 400 when an answer (a stream: its prompts' logprobs) would hold more than MAX_LOGPROB_ENTRIES logprob
        entries: a request of a few KB must not build one of gigabytes (n x prompt_logprobs over a long prompt)."""
        if entries > MAX_LOGPROB_ENTRIES:
            raise APIError(400, f"the answer would hold {entries} logprob entries (n x tokens x (top logprobs + 1), "
                                f"prompt and completion), over the {MAX_LOGPROB_ENTRIES} one answer may hold; lower "
                                f"'n', the number of logprobs or the tokens they cover, or stream it",
                           code="invalid_value", param="n" if self.options.n > 1 else "logprobs")

    def usage(self, completion_tokens: int, cached: dict[int, int] | None = None,
              choice: int | None = None) -> dict[str, Any]:
        """The request's usage, or with `choice` that choice's: its prompt and its tokens (a stream's
        continuous_usage_stats, as vLLM counts them). `cached`: per choice, the prompt tokens its admission found
        in the prefix cache, which the whole answer's usage reports with --enable-prompt-tokens-details (OpenAI's
        prompt_tokens_details.cached_tokens; a prompt's choices count the least any found)."""
        completion_tokens = 0 if self.score_only else completion_tokens
        prompts = sorted(set(self.choice_prompt)) if choice is None else [self.choice_prompt[choice]]
        prompt_tokens = sum(len(self.prompt_ids[p]) for p in prompts)
        usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                 "total_tokens": prompt_tokens + completion_tokens}
        if self.prompt_tokens_details and choice is None and cached is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": sum(
                min(cached.get(i, 0) for i, q in enumerate(self.choice_prompt) if q == p) for p in prompts)}
        return usage

    def echo_text(self, tokenizer, p: int) -> str:
        """The text `echo` repeats for prompt `p`: a string prompt as sent, token ids decoded."""
        prompt = self.prompts[p] if self.prompts is not None else self.prompt_ids[p]
        if isinstance(prompt, str):
            return prompt
        return tokenizer.decode(prompt, skip_special_tokens=False) if tokenizer is not None else ""

    def choice(self, tokenizer, index: int, text: str, lps: list[TokenLogprob] | None, finish_reason: str | None,
               *, delta: bool, first: bool = False, offsets: TextOffsets | None = None,
               prompt_lps: list[TokenLogprob | None] | None = None, stop_reason: str | int | None = None) -> dict[str, Any]:
        """One entry of `choices`: a whole choice, or a streamed delta (`first`: the choice's first chunk;
        `offsets`: the choice's TextOffsets, kept over all its chunks; `prompt_lps`: the output's prompt
        logprobs, for `echo` and `prompt_logprobs`; `stop_reason`: vLLM's, the stop string or token id that
        ended it, null for EOS, length or before the end)."""
        if self.endpoint == "completions":
            if self.score_only:
                text, lps = "", [] if lps is not None else None
                finish_reason, stop_reason = finish_reason and "length", None
            offsets = offsets if offsets is not None else TextOffsets()
            p = self.choice_prompt[index]
            echo = self.options.echo and (first or not delta)
            echo_text = self.echo_text(tokenizer, p) if echo else ""
            prompt = (self.prompt_ids[p], prompt_lps, echo_text) if echo else None
            choice = {"index": index, "text": echo_text + text,
                      "logprobs": completion_logprobs(tokenizer, lps, offsets, prompt, self.options.logprobs,
                                                      self.options.skip_special_tokens),
                      "finish_reason": finish_reason, "stop_reason": stop_reason}
            if self.options.prompt_logprobs is not None and not delta:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(tokenizer, prompt_lps, self.options.prompt_logprobs)
            return choice
        if delta:
            calls: list[dict[str, Any]] = []
            if self.tool_calls is not None:  # called once per chunk: it holds back what may be a call
                text, calls, finish_reason = self.tool_calls.delta(index, text, finish_reason)
            # a first chunk names its role and content, null beside calls (as a whole message's, and OpenAI's)
            content = text or (None if calls else "")
            message = ({"role": "assistant"} if first else {}) | ({"content": content} if text or first else {})
            return {"index": index, "delta": message | ({"tool_calls": calls} if calls else {}),
                    "logprobs": chat_logprobs(tokenizer, lps), "finish_reason": finish_reason, "stop_reason": stop_reason}
        message = {"role": "assistant", "content": text}
        if self.tool_calls is not None:
            message, finish_reason = self.tool_calls.message(text, finish_reason)
        return {"index": index, "message": message, "logprobs": chat_logprobs(tokenizer, lps),
                "finish_reason": finish_reason, "stop_reason": stop_reason}

    def response(self, tokenizer, final: dict[int, RequestOutput]) -> dict[str, Any]:
        """The whole answer (not streamed) from each choice's finished output."""
        choices = [self.choice(tokenizer, i, final[i].text, final[i].logprobs, final[i].finish_reason, delta=False,
                               prompt_lps=final[i].prompt_logprobs, stop_reason=final[i].stop_reason)
                   for i in range(self.num_choices)]
        body = self.envelope(choices, chunk=False)
        if self.endpoint == "chat" and self.options.prompt_logprobs is not None:  # one prompt: beside the choices
            body["prompt_logprobs"] = vllm_prompt_logprobs(tokenizer, final[0].prompt_logprobs,
                                                           self.options.prompt_logprobs)
        body["usage"] = self.usage(sum(len(o.token_ids) for o in final.values()),
                                   {i: o.num_cached_tokens for i, o in final.items()})
        return body

    def stream_chunk(self, tokenizer, i: int, out: RequestOutput, *, first: bool, offsets: TextOffsets,
                     completion_tokens: int) -> dict[str, Any]:
        """The SSE chunk of choice `i`'s output `out`, with `usage` where include_usage asks for it (as OpenAI:
        every chunk has the field, null but the last; vLLM's continuous_usage_stats: choice `i`'s counts so far,
        `completion_tokens` its tokens)."""
        choice = self.choice(tokenizer, i, out.new_text, out.new_logprobs, out.finish_reason if out.finished else None,
                             delta=True, first=first, offsets=offsets, prompt_lps=out.prompt_logprobs,
                             stop_reason=out.stop_reason if out.finished else None)
        chunk = self.envelope([choice], chunk=True)
        if self.options.include_usage:
            chunk["usage"] = self.usage(completion_tokens, choice=i) if self.options.continuous_usage else None
        return chunk

    def envelope(self, choices: list[dict[str, Any]], *, chunk: bool) -> dict[str, Any]:
        kind = {"completions": "text_completion", "chat": "chat.completion.chunk" if chunk else "chat.completion"}
        return {"id": self.answer_id or self.request_id, "object": kind[self.endpoint], "created": self.created,
                "model": self.model, "choices": choices, "system_fingerprint": None}


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False) if tokenizer is not None else str(token_id)


def raw_bytes(tokenizer, token_id: int) -> bytes:
    """The bytes the token stands for: part of a UTF-8 character for a byte-fallback token, where its
    text is U+FFFD."""
    return token_bytes(tokenizer)(token_id) if tokenizer is not None else str(token_id).encode()


def _num_ended(state: tuple[bytes, int], byte: bytes) -> int:
    """How many characters a UTF-8 decoder in `state` writes for its held-back bytes once `byte` follows
    them: all it writes then, but the last when that one holds `byte` (nothing is held back after it)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    decoder.setstate(state)
    num_chars = len(decoder.decode(byte))
    return num_chars - (num_chars > 0 and not decoder.getstate()[0])


class TextOffsets:
    """Where each token's text starts in its choice's text, in characters: the number of characters the
    bytes before the token decode to (vLLM's "length of the text before the token", counted in the text
    returned), over all the choice's chunks (one instance per choice). A token that continues a character
    begun by an earlier token is at that character. Running examples: "é!" as [c3] [a9] [21] is at 0, 0, 1,
    whether sent in one chunk or streamed as [c3] | [a9] [21]; U+FFFD "AB" as [c3] [41] [42] is at 0, 1, 2:
    "A" cannot continue c3, so c3 is a U+FFFD of its own, before "A" (the decoder holds c3 back and writes
    that U+FFFD only once "A" arrives). Counting the tokens, not the text sent so far, keeps offsets right
    while text is held back (a possible stop string). Bytes that are not valid UTF-8 count as U+FFFD, as
    they do in the text."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._num_chars = 0  # characters the tokens so far decode to (held-back bytes not yet)

    def __call__(self, pieces: list[bytes]) -> list[int]:
        offsets = []
        for i, piece in enumerate(pieces):
            state = self._decoder.getstate()
            ended = 0  # held-back bytes that turn out to be U+FFFD before this token
            if state[0]:  # the next byte decides; a token without bytes looks past itself, within this chunk
                ended = _num_ended(state, next((p[:1] for p in pieces[i:] if p), b""))
            offsets.append(self._num_chars + ended)
            self._num_chars += len(self._decoder.decode(piece))
        return offsets

    def echo(self, pieces: list[bytes], text: str) -> list[int]:
        """Offsets of an echoed prompt's tokens in `text`, the prompt as the choice repeats it; the tokens
        that follow count from its end. The prompt tokens' bytes may spell more than `text` at its start (a
        BOS token's "<s>", SentencePiece's leading space): their offsets are aligned on the end of `text`."""
        prompt = TextOffsets()
        offsets = prompt(pieces)
        num_chars = prompt._num_chars + len(prompt._decoder.decode(b"", final=True))
        self._decoder.reset()
        self._num_chars = len(text)
        return [min(max(o - (num_chars - len(text)), 0), len(text)) for o in offsets]


def completion_logprobs(tokenizer, lps: list[TokenLogprob] | None, offsets: TextOffsets,
                        prompt: tuple[list[int], list[TokenLogprob | None] | None, str] | None = None,
                        k: int | None = None, skip_special_tokens: bool = False) -> dict[str, Any] | None:
    """`prompt`: (token ids, logprobs, text) of an echoed prompt, its tokens first (the first prompt token, and
    any without logprobs, with null token_logprobs and top_logprobs); `k`: top entries of a prompt token;
    `skip_special_tokens`: special tokens are not in the text, so take no room in `text_offset`."""
    if lps is None:
        return None
    skipped = token_bytes(tokenizer).special_ids if skip_special_tokens and tokenizer is not None else ()
    pieces = [b"" if lp.token_id in skipped else raw_bytes(tokenizer, lp.token_id) for lp in lps]

    def top(lp: TokenLogprob, most: int | None = None) -> dict[str, float]:
        # Tokens whose texts are equal (byte tokens that each read U+FFFD) share a key: it holds the sampled
        # token's own logprob where it is that token's text (as token_logprobs says), else the likeliest's.
        sampled = token_text(tokenizer, lp.token_id)
        entries: dict[str, float] = {}
        for t, v in lp.top[:most]:
            text = token_text(tokenizer, t)
            entries.setdefault(text, lp.logprob if text == sampled else v)
        # As OpenAI and vLLM: the sampled token is always there, so up to `logprobs` + 1 entries.
        entries.setdefault(sampled, lp.logprob)
        return entries

    ids, prompt_lps, prompt_text = prompt if prompt is not None else ([], [], "")
    text_offset = offsets.echo([raw_bytes(tokenizer, t) for t in ids], prompt_text) if prompt is not None else []
    prompt_lps = list(prompt_lps or [])[: len(ids)]
    prompt_lps += [None] * (len(ids) - len(prompt_lps))
    return {
        "tokens": [token_text(tokenizer, t) for t in ids] + [token_text(tokenizer, lp.token_id) for lp in lps],
        "token_logprobs": [None if lp is None else lp.logprob for lp in prompt_lps] + [lp.logprob for lp in lps],
        "top_logprobs": [None if lp is None else top(lp, k) for lp in prompt_lps] + [top(lp) for lp in lps],
        "text_offset": text_offset + offsets(pieces),
    }


def vllm_prompt_logprobs(tokenizer, lps: list[TokenLogprob | None] | None, k: int) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}},
    the prompt token first, then the k most likely (ranks 1..k)."""
    if lps is None:
        return None

    def entry(token_id: int, logprob: float, rank: int | None) -> dict[str, Any]:
        return {"logprob": logprob, "rank": rank, "decoded_token": token_text(tokenizer, token_id)}

    out: list[dict | None] = []
    for lp in lps:
        if lp is None:
            out.append(None)
            continue
        entries = {lp.token_id: entry(lp.token_id, lp.logprob, lp.rank)}
        for rank, (t, v) in enumerate(lp.top[:k], 1):
            entries.setdefault(t, entry(t, v, rank))
        out.append(entries)
    return out


def chat_logprobs(tokenizer, lps: list[TokenLogprob] | None) -> dict[str, Any] | None:
    if lps is None:
        return None

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(raw_bytes(tokenizer, token_id))}

    return {"content": [entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in lps]}

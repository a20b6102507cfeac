"""KVRoom: whether a request can ever get the KV pages of all its tokens in the unified page pool.

KV blocks and adapter weights share one page pool (page_pool.py), and `max_model_len` is at most what
the whole of it holds: it leaves no room for adapters, whose pages depend on their rank and target modules
(a worst case reserved for all would cut the base model's context by far more than most adapters take).
While a request runs, two kinds of pages are never its KV cache's: its own adapter's (held
for as long as it runs) and pinned adapters' (placed as soon as there is room, never evicted). Every other
page comes back sooner or later (other requests finish or are preempted, idle adapters are evicted): a
request short of those waits, or others are preempted for it. A request whose prompt and max_tokens need
more than the pool less those pages would run into that wall however long it waited or was retried, so it
is refused with the limit it has, as a prompt past max_model_len is (a 400, never a retryable 503). Its
last token is sampled, never cached: prompt + max_tokens may exceed the cache by one token.

Running example (16-token pages, a pool of 8, adapter `shout` of 3 pages, nothing pinned): max_model_len
is 128; a `shout` request has 5 pages, 80 cached tokens, so prompt + max_tokens up to 81: a 10-token prompt
with max_tokens 71 is served, with max_tokens 118 refused. A base-model request may have all 8 pages.
`/v1/models` advertises those limits, per adapter (81 for `shout`, once its size is known) and for the base model.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from lorafleet.worker.engine_errors import ContextLengthError
from lorafleet.worker.sequence import Sequence


class HeldPages(Protocol):
    """The part of the AdapterPool KVRoom reads: (pages of adapter `key`, pages of pinned adapters)."""

    def kv_held_pages(self, key: str | None) -> tuple[int, int]: ...


class KVRoom:
    def __init__(self, adapters: HeldPages, *, num_pages: int, block_size: int, max_model_len: int) -> None:
        self.adapters = adapters
        self.num_pages = num_pages
        self.block_size = block_size
        self.max_model_len = max_model_len

    def limit(self, keys: Iterable[str | None]) -> int:
        """The most tokens (prompt and max_tokens) a request for any of `keys` (engine keys; None: the base model)
        may have now, as `refusal` holds it to: what /v1/models and /tokenize advertise as max_model_len."""
        return min(self._limit(max(0, self.num_pages - sum(self.adapters.kv_held_pages(k)))) for k in keys)

    def _limit(self, room: int) -> int:
        return min(self.max_model_len, room * self.block_size + 1)

    def refusal(self, seq: Sequence) -> ContextLengthError | None:
        """Why `seq` can never get the KV pages of all its tokens (prompt and max_tokens, within
        max_model_len); None if it can. An adapter whose size is not known yet (not loaded) counts as no
        pages: the scheduler asks again once it holds the adapter. A max_tokens the caller did not give
        (`max_tokens_to_fit`: the context left after the prompt) is lowered to fit instead, as long as
        one token (and min_tokens) still does."""
        wanted = min(seq.num_prompt_tokens + seq.params.max_tokens, self.max_model_len)
        own, pinned = self.adapters.kv_held_pages(seq.adapter)
        seq.kv_room_checked = seq.adapter is None or own > 0
        room = max(0, self.num_pages - own - pinned)
        limit = self._limit(room)
        if wanted <= limit:
            return None
        if seq.params.max_tokens_to_fit and limit - seq.num_prompt_tokens >= max(1, seq.params.min_tokens):
            seq.params.max_tokens = limit - seq.num_prompt_tokens
            return None
        held = " and ".join(([f"its adapter {seq.adapter} takes {own}"] if own else [])
                            + ([f"pinned adapters take {pinned}"] if pinned else []))
        what = (f"This request's maximum context length is {limit} tokens" if room
                else "This request cannot run")
        prompt_alone = seq.num_prompt_tokens >= limit  # not even one token to generate fits after it
        min_tokens = not prompt_alone and seq.params.max_tokens_to_fit  # it alone keeps the lowered one out
        if prompt_alone:
            asked = f"the prompt has {seq.num_prompt_tokens} tokens. Shorten the prompt"
        elif min_tokens:
            asked = (f"min_tokens asks for {seq.num_prompt_tokens + seq.params.min_tokens} tokens "
                     f"({seq.num_prompt_tokens} in the prompt, {seq.params.min_tokens} to generate at least). "
                     f"Lower min_tokens, shorten the prompt")
        else:
            asked = (f"you requested {wanted} tokens ({seq.num_prompt_tokens} in the prompt, "
                     f"{wanted - seq.num_prompt_tokens} to generate). Lower max_tokens, shorten the prompt")
        return ContextLengthError(
            f"{what}: of the {self.num_pages} pages ({self.block_size} tokens each) its KV cache shares "
            f"with adapters, {held}, leaving {room}; {asked}{', unpin adapters' if pinned else ''} or give "
            "the worker a larger pool (--num-pages, --pool-bytes or --pool-memory-fraction).",
            prompt_alone=prompt_alone, min_tokens=min_tokens)

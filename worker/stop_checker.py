"""StopChecker: after each new token, the sequence's text, whether it is done, and how much of its
text is final (safe to stream).

Text is the decode of all generated tokens (special tokens skipped unless the request keeps them; a
final stop token, EOS or one of stop_token_ids, is not text unless include_stop_str_in_output, as in
vLLM), grown incrementally by the Detokenizer. A stop string ends the request with the text cut before
it (or after it when asked); each is searched only where it could newly appear: from
`len(previous text) - len(that stop string) + 1`. Before the sequence has min_tokens tokens, neither stop
tokens nor stop strings end it (vLLM's; the sampler keeps stop tokens from being drawn meanwhile).
"""

from __future__ import annotations

from lorafleet.worker.detokenizer import Detokenizer
from lorafleet.worker.sequence import Sequence
from lorafleet.worker.tokenizer import Tokenizer


class StopChecker:
    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: list[int], max_model_len: int) -> None:
        self.detokenizer = Detokenizer(tokenizer) if tokenizer is not None else None
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len

    def check(self, seq: Sequence) -> None:
        """Update seq.text and set seq.finish_reason ("stop" | "length") when the last token ends it."""
        params = seq.params
        token = seq.output_token_ids[-1]
        checked = len(seq.output_token_ids) >= params.min_tokens  # vLLM: no stop checks before min_tokens
        eos = not params.ignore_eos and (token in self.eos_token_ids or token in seq.adapter_eos)
        stop_token = checked and (eos or token in params.stop_token_ids)
        keep = not stop_token or params.include_stop_str_in_output  # vLLM keeps the stop token's text when asked
        end = len(seq.output_token_ids) if keep else len(seq.output_token_ids) - 1
        if stop_token:
            seq.finish_reason = "stop"
            seq.stop_reason = None if eos else token  # vLLM's: EOS is no stop reason, a stop_token_ids token is
        elif len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
        if self.detokenizer is None:
            return
        prev = len(seq.text)
        if seq.finish_reason is None:
            self.detokenizer.append(seq, end)
        else:  # the last text, held back so far when it ended inside a character: search it too
            self.detokenizer.flush(seq, end)
        if checked:
            _stop_at_string(seq, prev)

    def ended(self, seq: Sequence) -> Sequence:
        """`seq`, ended by the scheduler rather than by a check here (by length: a pin landed, or the KV cache
        could not take it further), with the text the detokenizer held back added, as an end by max_tokens
        adds it."""
        if seq.finish_reason == "length" and self.detokenizer is not None:
            prev = len(seq.text)
            self.detokenizer.flush(seq, len(seq.output_token_ids))
            if len(seq.output_token_ids) >= seq.params.min_tokens:
                _stop_at_string(seq, prev)  # the text added may hold a stop string, as at a check
        return seq

    @staticmethod
    def final_text_len(seq: Sequence, emitted: int) -> int:
        """Characters of seq.text that can be streamed: all once finished; otherwise hold back anything that
        may still turn out to be the start of a stop string (the detokenizer holds back a partial UTF-8
        character itself: a U+FFFD in seq.text is final)."""
        text = seq.text
        if seq.is_finished:
            return len(text)
        final = len(text)
        if seq.params.stop:
            final = min(final, len(text) - max(len(s) for s in seq.params.stop) + 1)
        return max(emitted, final)


def _stop_at_string(seq: Sequence, prev: int) -> None:
    """End `seq` at the first of its stop strings that text added after `prev` characters completes."""
    params = seq.params
    if params.stop:
        # Each string from where an occurrence of it could end in the new text: a window sized by the longest
        # string found a shorter one completed earlier (before min_tokens, when stop strings are not searched).
        hits = [(i, s) for s in params.stop if (i := seq.text.find(s, max(0, prev - len(s) + 1))) >= 0]
        if hits:
            i, s = min(hits)
            seq.text = seq.text[: i + len(s) if params.include_stop_str_in_output else i]
            seq.finish_reason, seq.stop_reason = "stop", s

"""Detokenizer: a sequence's output text, grown by a few tokens per step instead of re-decoding all.

Two offsets into the output ids: text for tokens before `read` is final; `prefix` starts a short
window of already-final tokens decoded again for context (tokenizers drop or merge characters at a
decode's start, e.g. SentencePiece's leading space, so a window must not start at the new token).
New text = decode(window + new) minus decode(window). A token that ends inside a UTF-8 character
decodes to U+FFFD; its text waits until the character is complete. Running example, "é" as two byte
tokens [c3, a9]: after c3 the window decodes to "\ufffd" (nothing appended); after a9 to "é".
While the window starts at the first output token, the last prompt tokens are its context (as vLLM):
SentencePiece decoders strip the space of a decode's first token, so "▁Paris" after the prompt "The
capital is" must read " Paris", not "Paris". Special tokens are skipped unless the request's
`skip_special_tokens` is false (then they read as their text, "</s>", the context's too).
"""

from __future__ import annotations

import codecs

from lorafleet.worker.sequence import Sequence
from lorafleet.worker.token_bytes import TokenBytes, token_bytes
from lorafleet.worker.tokenizer import Tokenizer

NUM_PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded before the first output tokens (vLLM's offset)


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._token_bytes: TokenBytes | None | bool = None  # False: none can be read

    def append(self, seq: Sequence, end: int) -> None:
        """Extend seq.text with the text of seq.output_token_ids[:end] that is complete."""
        prefix_text, new_text = self._window(seq, end)
        if new_text.endswith("\ufffd"):
            # Only a character that later bytes may still complete waits: bytes that can never be UTF-8 (a
            # run of continuation bytes) are final U+FFFDs now, else the window would grow, decoded again
            # in full at every step, and nothing would stream until the run ended.
            end = self._complete_up_to(seq, end)
            if end <= seq.detok_read:
                return
            prefix_text, new_text = self._window(seq, end)
        if len(new_text) > len(prefix_text):
            seq.text += new_text[len(prefix_text):]
            seq.detok_prefix, seq.detok_read = seq.detok_read, end

    def _complete_up_to(self, seq: Sequence, end: int) -> int:
        """The last token boundary at or before `end` where no UTF-8 character is left incomplete (the
        tokens read so far decode to whole characters and final U+FFFDs); `seq.detok_read` where none is,
        or where the bytes cannot be known."""
        table = self._table()
        # A SentencePiece byte-fallback decoder turns each byte of an invalid run into U+FFFD, not each
        # maximal invalid part as UTF-8 does: a cut inside a run would read otherwise than one decode.
        if table is None or table.byte_fallback:
            return seq.detok_read
        skipped = table.special_ids if seq.params.skip_special_tokens else ()
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        last = seq.detok_read
        for i, token in enumerate(seq.output_token_ids[seq.detok_read:end], seq.detok_read + 1):
            piece = b"" if token in skipped else table.exact(token)
            if piece is None:
                break  # a token whose bytes are not known: wait, as for any partial character
            decoder.decode(piece)
            if not decoder.getstate()[0]:
                last = i
        return last

    def _table(self) -> TokenBytes | None:
        if self._token_bytes is None:
            try:
                self._token_bytes = token_bytes(self.tokenizer)
            except Exception:  # no tokenizer.json to read the table from
                self._token_bytes = False
        return self._token_bytes or None

    def flush(self, seq: Sequence, end: int) -> None:
        """At the end: add what is left, an incomplete character rendered as U+FFFD like a full decode."""
        prefix_text, new_text = self._window(seq, end)
        seq.text += new_text[len(prefix_text):]
        seq.detok_prefix = seq.detok_read = end

    def _window(self, seq: Sequence, end: int) -> tuple[str, str]:
        ids = seq.output_token_ids
        skip = seq.params.skip_special_tokens
        decode = lambda token_ids: self.tokenizer.decode(token_ids, skip_special_tokens=skip)
        context: list[int] = []
        if seq.detok_prefix == 0:
            context = seq.prompt_token_ids[-NUM_PROMPT_CONTEXT_TOKENS:]
            if decode(context).endswith("\ufffd"):  # the prompt ends inside a character: no context
                context = []
        prefix_ids = context + ids[seq.detok_prefix : seq.detok_read]
        return decode(prefix_ids), decode(context + ids[seq.detok_prefix : end])

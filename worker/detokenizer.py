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

SentencePiece byte fallback (Llama 2, Mistral) reads a run of "<0xNN>" tokens as one: its text where
the whole run is UTF-8, else one U+FFFD per byte. Such tokenizers take `_advance_byte_runs`: text is
committed at token boundaries where the run so far is whole characters; once the rest of a run can no
longer be UTF-8 (a byte no character continues, or the run ends inside a character), each of its bytes
is a U+FFFD at once, counted without decoding. A run that turns invalid after whole characters keeps
their text (one decode would read those bytes as U+FFFDs too: streamed text is never taken back).
Their prompt context ends at the prompt's last text token: a byte run after it would join the output's
first run (and reads as U+FFFDs where the five tokens cut it inside a character). A prompt that ends in
byte tokens is followed as a plain letter is (the context only keeps the first output space).
"""

from __future__ import annotations

import codecs

from lorafleet.worker.sequence import Sequence
from lorafleet.worker.token_bytes import TokenBytes, token_bytes
from lorafleet.worker.tokenizer import Tokenizer

NUM_PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded before the first output tokens (vLLM's offset)
_CONTEXT_SEARCH = 64  # byte fallback: prompt tokens looked through for the last text token
_ABSENT_SEARCH = 4096  # and, before those, tokens the decode leaves out (skipped special ones) looked through


def _settled(pending: bytes, piece: bytes) -> bool:
    """Whether `pending` (an incomplete UTF-8 character) decodes the same, as U+FFFDs, with `piece` after it as
    on its own: no byte of `piece` continues it."""
    joined, apart = (codecs.getincrementaldecoder("utf-8")(errors="replace") for _ in range(2))
    together = joined.decode(pending + piece)
    return together == pending.decode("utf-8", errors="replace") + apart.decode(piece) \
        and joined.getstate()[0] == apart.getstate()[0]


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._token_bytes: TokenBytes | None | bool = None  # False: none can be read
        self._letter: list[int] | None = None

    def append(self, seq: Sequence, end: int) -> None:
        """Extend seq.text with the text of seq.output_token_ids[:end] that is complete."""
        table = self._table()
        seen, seq.detok_seen = seq.detok_seen, end
        if table is not None and seen < end and all(map(self._absent(seq, table), seq.output_token_ids[seen:end])):
            return  # only tokens the decode leaves out since the last call: nothing changes (a long run of them
            # kept the window growing, decoded again at every step)
        if table is not None and table.byte_fallback:
            return self._advance_byte_runs(seq, end, table, final=False)
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
        if table is None:
            return seq.detok_read
        absent = self._absent(seq, table)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        last = seq.detok_read
        for i, token in enumerate(seq.output_token_ids[seq.detok_read:end], seq.detok_read + 1):
            piece = b"" if absent(token) else table.exact(token)  # the decode leaves it out: no bytes
            if piece is None:
                break  # a token whose bytes are not known: wait, as for any partial character
            before = decoder.getstate()[0]
            decoder.decode(piece)
            if not decoder.getstate()[0]:
                last = i
            elif before and _settled(before, piece):
                # The bytes left open before this token are U+FFFDs whatever follows (a run of lead bytes, each
                # leaving the next open): final at the boundary before it, so the window stays short.
                last = max(last, i - 1)
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
        table = self._table()
        if table is not None and table.byte_fallback:
            return self._advance_byte_runs(seq, end, table, final=True)
        prefix_text, new_text = self._window(seq, end)
        seq.text += new_text[len(prefix_text):]
        seq.detok_prefix = seq.detok_read = end

    def _window(self, seq: Sequence, end: int) -> tuple[str, str]:
        ids = seq.output_token_ids
        skip = seq.params.skip_special_tokens
        decode = lambda token_ids: self.tokenizer.decode(token_ids, skip_special_tokens=skip)
        context: list[int] = []
        table = self._table()
        if seq.detok_prefix == 0 and table is not None and table.byte_fallback:
            # The last prompt tokens up to its last text token: a byte run there would join the output's first
            # (and read as U+FFFDs where cut inside a character), and the context is only for the first space.
            # A prompt ending in bytes is followed as one plain letter would be; one the decode leaves all out, by nothing.
            prompt, absent = seq.prompt_token_ids, self._absent(seq, table)
            last = len(prompt) - 1
            while last >= max(0, len(prompt) - _ABSENT_SEARCH) and absent(prompt[last]):
                last -= 1
            tail, floor = last, max(0, last + 1 - _CONTEXT_SEARCH)  # tail: the last token the decode keeps
            while last >= floor and (absent(prompt[last]) or table.fallback_byte(prompt[last]) is not None):
                last -= 1
            if last >= floor and last == tail:  # a text token
                context = prompt[max(0, last + 1 - NUM_PROMPT_CONTEXT_TOKENS): last + 1]
            elif tail >= 0:
                context = self._plain_letter(table)
        elif seq.detok_prefix == 0:
            context = seq.prompt_token_ids[-NUM_PROMPT_CONTEXT_TOKENS:]
            if decode(context).endswith("\ufffd"):  # the prompt ends inside a character: no context
                context = []
        prefix_ids = context + ids[seq.detok_prefix : seq.detok_read]
        return decode(prefix_ids), decode(context + ids[seq.detok_prefix : end])

    def _plain_letter(self, table: TokenBytes) -> list[int]:
        """One token spelling an ASCII letter alone (no "▁", not special), a context that reads as itself; [] with none."""
        if self._letter is None:
            letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
            ids = ((c, self.tokenizer.token_to_id(c)) for c in letters)
            self._letter = next(([i] for c, i in ids if i is not None and i not in table.special_ids
                                 and self.tokenizer.decode([i], skip_special_tokens=True) == c), [])
        return self._letter

    def _absent(self, seq: Sequence, table: TokenBytes):
        """Whether the decode leaves a token out: a special one it skips, or an id the vocabulary lacks."""
        skipped = table.special_ids if seq.params.skip_special_tokens else frozenset()
        return lambda token: token in skipped or self.tokenizer.id_to_token(token) is None

    def _advance_byte_runs(self, seq: Sequence, end: int, table: TokenBytes, *, final: bool) -> None:
        """append / flush for a byte-fallback tokenizer (see the module's docstring). seq.detok_invalid_run:
        the byte run open at seq.detok_read can no longer be UTF-8; then the window's prefix is the run's
        last byte token, which decodes alone to one character as it does in any later window."""
        ids, absent = seq.output_token_ids, self._absent(seq, table)  # tokens the decode leaves out end no run
        while seq.detok_read < end:
            read = seq.detok_read
            if seq.detok_invalid_run:  # each byte of the run a U+FFFD, up to a token that ends the run
                j, count = read, 0
                while j < end and ((gone := absent(ids[j])) or table.fallback_byte(ids[j]) is not None):
                    if not gone:
                        count, seq.detok_prefix = count + 1, j
                    j += 1
                seq.text += "\ufffd" * count
                seq.detok_read, seq.detok_invalid_run = j, j == end
                continue
            decoder, commit, broken, run_start = codecs.getincrementaldecoder("utf-8")(), read, False, None
            for j in range(read, end):
                if absent(ids[j]):
                    pass
                elif (byte := table.fallback_byte(ids[j])) is None:  # a text token ends the run
                    if decoder.getstate()[0]:
                        broken = True  # inside a character
                        break
                    decoder.reset()
                    run_start = None
                else:
                    run_start = j if run_start is None else run_start
                    try:
                        decoder.decode(bytes([byte]))
                    except UnicodeDecodeError:
                        broken = True
                        break
                if not decoder.getstate()[0]:
                    commit = j + 1
            if commit > read:
                prefix_text, new_text = self._window(seq, commit)
                if len(new_text) > len(prefix_text):
                    seq.text += new_text[len(prefix_text):]
                    seq.detok_prefix, seq.detok_read = read, commit
                else:  # no text (a first space the decoder strips): the window keeps its start, and bytes of
                    # a run still open stay unread (should the run break, they are U+FFFDs as well)
                    seq.detok_read = commit if run_start is None or run_start >= commit else max(read, run_start)
            if not (broken or (final and commit < end)):  # the rest waits for the bytes that complete it
                return
            seq.detok_invalid_run = True  # the run's bytes from `commit` on are U+FFFDs

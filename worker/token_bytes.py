"""TokenBytes: the raw bytes each vocabulary token stands for (logprobs' `bytes`, text offsets).

`decode([id])` cannot give them: a token holding part of a UTF-8 character (emoji or CJK split into
byte tokens) decodes to U+FFFD. tokenizer.json's decoder says how its tokens spell bytes:

* ByteLevel (GPT-2, Llama 3, SmolLM): every character of the token stands for one byte through
  GPT-2's byte-to-unicode table ("Ġ" is 0x20, "ðŁĺĬ" is the emoji's four bytes);
* ByteFallback (SentencePiece BPE: Llama 2, Mistral): "<0xF0>" is the byte 0xF0, any other token is
  UTF-8 text with "▁" for a space.

Added (special) tokens are their UTF-8 content. With any other decoder, or a token the table does not
cover, the UTF-8 of `decode([id])` is the best there is.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache

from lorafleet.worker.token_floor import gpt2_byte_decoder as _gpt2_byte_decoder
from lorafleet.worker.tokenizer import Tokenizer

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _decoder_types(spec: dict | None) -> set[str]:
    if not spec:
        return set()
    return {spec.get("type", "")} | {t for d in spec.get("decoders") or [] for t in _decoder_types(d)}


class TokenBytes:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        spec = json.loads(tokenizer.path.read_text())
        self._added = {t["id"]: t["content"].encode() for t in spec.get("added_tokens", [])}
        self.special_ids = frozenset(t["id"] for t in spec.get("added_tokens", []) if t.get("special"))
        types = _decoder_types(spec.get("decoder"))
        self._byte_level = _gpt2_byte_decoder() if "ByteLevel" in types else None
        self._byte_fallback = "ByteFallback" in types

    def __call__(self, token_id: int) -> bytes:
        exact = self.exact(token_id)
        return exact if exact is not None else self.tokenizer.decode([token_id], skip_special_tokens=False).encode()

    def exact(self, token_id: int) -> bytes | None:
        """The token's bytes as its decoder spells them; None where only `decode([id])` can say (which
        reads a partial character as U+FFFD)."""
        if token_id in self._added:
            content = self._added[token_id].decode()
            if self._byte_fallback and (byte := _BYTE_TOKEN.fullmatch(content)):
                return bytes([int(byte.group(1), 16)])  # the decoder reads its text as the byte
            if self._byte_level is not None and all(c in self._byte_level for c in content):
                return bytes(self._byte_level[c] for c in content)  # the ByteLevel decoder maps it so too
            return self._added[token_id]
        piece = self.tokenizer.id_to_token(token_id)
        if piece is not None and self._byte_level is not None and all(c in self._byte_level for c in piece):
            return bytes(self._byte_level[c] for c in piece)
        if piece is not None and self._byte_fallback:
            byte = _BYTE_TOKEN.fullmatch(piece)
            return bytes([int(byte.group(1), 16)]) if byte else piece.replace("▁", " ").encode()
        return None

    @property
    def byte_fallback(self) -> bool:
        return self._byte_fallback

    def fallback_byte(self, token_id: int) -> int | None:
        """With a ByteFallback decoder, the byte a "<0xNN>" token stands for (an added token spelled so
        too: the decoder reads the token's text); None for any other token."""
        if not self._byte_fallback:
            return None
        byte = _BYTE_TOKEN.fullmatch(self.tokenizer.id_to_token(token_id) or "")
        return int(byte.group(1), 16) if byte else None


@lru_cache(maxsize=8)
def token_bytes(tokenizer: Tokenizer) -> TokenBytes:
    """The tokenizer's TokenBytes, read from its tokenizer.json once."""
    return TokenBytes(tokenizer)

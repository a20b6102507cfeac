"""The pieces of a SentencePiece `tokenizer.model`, in id order, read from its protobuf without the sentencepiece
library (sentencepiece_pieces).

A slow tokenizer's save_pretrained (LlamaTokenizer, not its Fast twin) writes `tokenizer.model` and
tokenizer_config.json and no tokenizer.json: the vocabulary of such an adapter folder is in that file alone. Its
ModelProto (sentencepiece_model.proto) holds the pieces as field 1, repeated, each a SentencePiece message whose
field 1 is the piece's text; a piece's id is its place in that list. Other fields (scores, types, the trainer's
and normalizer's specs) are skipped by their wire type. The file is a tenant's: it is read in vocab_digest's
child process, and anything that is not such a protobuf is refused as malformed, quoting nothing of it.
"""

from __future__ import annotations

from collections.abc import Iterator

MAX_PIECES = 1 << 17  # pieces a tokenizer.model may hold (Llama 2 and Mistral: 32,000 to 32,768)


class PiecesMalformed(ValueError):
    """Not a SentencePiece model: the reason, in words that quote nothing of the file."""


def sentencepiece_pieces(data: bytes) -> dict[str, int]:
    """piece -> id of the SentencePiece ModelProto `data` (the last id of a piece listed twice)."""
    pieces: dict[str, int] = {}
    count = 0
    for field, wire, value in _fields(data):
        if field != 1:
            continue
        if wire != 2:
            raise PiecesMalformed("its pieces are not messages")
        text = next((v for f, w, v in _fields(value) if f == 1 and w == 2), None)
        if text is None:
            raise PiecesMalformed(f"piece {count} has no text")
        try:
            pieces[bytes(text).decode("utf-8")] = count  # a piece listed twice: its last id, as transformers' converter
        except UnicodeDecodeError:
            raise PiecesMalformed(f"piece {count} is not UTF-8 text") from None
        count += 1
        if count > MAX_PIECES:
            raise PiecesMalformed(f"it holds more than {MAX_PIECES} pieces")
    if not count:
        raise PiecesMalformed("it holds no pieces")
    return pieces


def _varint(data: memoryview, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data) or shift > 63:
            raise PiecesMalformed("a number runs past its end")
        byte = data[at]
        value, at, shift = value | (byte & 0x7F) << shift, at + 1, shift + 7
        if not byte & 0x80:
            return value, at


def _fields(data: bytes | memoryview) -> Iterator[tuple[int, int, memoryview | int]]:
    """(field number, wire type, value) of each field of one protobuf message: a varint's number, a fixed
    field's or a length-delimited one's bytes."""
    data, at = memoryview(data), 0
    while at < len(data):
        key, at = _varint(data, at)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, at = _varint(data, at)
        elif wire in (1, 2, 5):
            size = 8 if wire == 1 else 4 if wire == 5 else None
            if size is None:
                size, at = _varint(data, at)
            if at + size > len(data):
                raise PiecesMalformed("a field runs past its end")
            value, at = data[at:at + size], at + size
        else:
            raise PiecesMalformed(f"a field of wire type {wire}, which a SentencePiece model does not use")
        if field == 0:
            raise PiecesMalformed("a field numbered 0")
        yield field, wire, value

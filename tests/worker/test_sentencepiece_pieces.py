"""A SentencePiece tokenizer.model's pieces, read from its protobuf (worker/sentencepiece_pieces.py): an adapter
folder whose vocabulary is that file alone (a slow tokenizer's save) is checked against the base's, piece by id."""

from __future__ import annotations

import functools

import pytest
import torch

from lorafleet.worker.peft_adapter import AdapterError, load_peft_adapter
from lorafleet.worker.sentencepiece_pieces import PiecesMalformed, sentencepiece_pieces
from tests.lora_factory import protobuf_field, sentencepiece_model
from tests.worker.test_peft_adapter import VOCAB, _bpe_tokenizer, make_adapter, model_config  # noqa: F401


def test_the_pieces_are_read_in_id_order_whatever_else_the_model_holds():
    pieces = ["<unk>", "<s>", "</s>", "▁the", "▁café", "<0x0A>", "東京"]
    assert sentencepiece_pieces(sentencepiece_model(pieces)) == {p: i for i, p in enumerate(pieces)}
    # A repeat keeps its last id, as transformers' converter builds the vocabulary of tokenizer.json.
    assert sentencepiece_pieces(sentencepiece_model(["a", "b", "a"])) == {"a": 2, "b": 1}


@pytest.mark.parametrize(("data", "why"), [
    (b"", "no pieces"),
    (b"\x0a\x00sentencepiece", "piece 0 has no text"),
    (protobuf_field(1, protobuf_field(1, b"\xff\xfe")), "not UTF-8"),
    (protobuf_field(1, b"\x0a\x10ab"), "runs past its end"),
    (b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", "runs past its end"),
    (b"\x08\x01", "not messages"),  # a varint field 1: pieces are messages
    (b"\x0b", "wire type 3"),
    (b"\x02\x00", "numbered 0"),
    (b"\x80", "runs past its end"),
], ids=["empty", "piece-without-text", "not-utf8", "truncated-field", "huge-length", "varint-pieces", "group",
        "field-0", "truncated-key"])
def test_what_is_not_a_sentencepiece_model_is_refused_saying_why(data, why):
    with pytest.raises(PiecesMalformed, match=why):
        sentencepiece_pieces(data)


def test_a_folder_whose_vocabulary_is_a_tokenizer_model_is_checked_piece_by_id(tmp_path, model_config):  # noqa: F811
    """A slow tokenizer's save (tokenizer.model and tokenizer_config.json, no tokenizer.json) of another vocabulary
    was served on the base's ids unchecked: its tokenizer.model was neither read nor staged. The base's own
    pieces at their own ids are accepted; other pieces, or the same under other ids, are refused (or, with
    strictness 'warn', served with the warning); a file that is no SentencePiece model cannot be compared."""
    base = _bpe_tokenizer(VOCAB)
    make_adapter(tmp_path / "x", r=4, lora_alpha=8, target_modules=["q_proj"])
    model = tmp_path / "x" / "tokenizer.model"
    load = functools.partial(load_peft_adapter, tmp_path / "x", model_config, dtype=torch.float32,
                             base_token_id=base.token_to_id)
    own = sorted(VOCAB, key=VOCAB.get)
    model.write_bytes(sentencepiece_model(own))
    load()
    model.write_bytes(sentencepiece_model(own[:3]))  # a prefix of the base's: the same ids
    load()
    for other, shown in ((["▁the", "▁of", "▁and"], "'▁and', '▁of', '▁the'"), ([*own[1:], own[0]], "'a', 'abc'")):
        model.write_bytes(sentencepiece_model(other))
        with pytest.raises(AdapterError, match="tokenizer files add tokens the served base model does not have"):
            load()
        if other[0] == "▁the":
            with pytest.raises(AdapterError, match=shown):
                load()
        load(strict_base="warn")
    model.write_bytes(b"\x0a\x05\x0a\x10abc")
    with pytest.raises(AdapterError, match="tokenizer.model: not a SentencePiece model .*cannot be compared"):
        load()


def test_tokenizer_model_is_staged_with_the_other_tokenizer_files():
    from lorafleet.worker.sources import STAGED_FILES

    assert "tokenizer.model" in STAGED_FILES

"""worker/vocab_digest.py parses each content of a tokenizer.json once: adapters shipping their base's very
file (or one seen before) are checked without parsing it again, with the interpreter lock held, at every load."""

from __future__ import annotations

import json
import shutil
from collections import OrderedDict

import pytest

from lorafleet.worker import vocab_digest as vd
from tests.worker.test_peft_adapter import VOCAB, _bpe_tokenizer


@pytest.fixture
def parsed(monkeypatch) -> list[str]:
    """What was parsed, in order, with nothing known beforehand."""
    seen: list[str] = []
    real_vocab = vd._from_tokenizer_json
    monkeypatch.setattr(vd, "_KNOWN", OrderedDict())
    monkeypatch.setattr(vd, "_from_tokenizer_json", lambda raw: seen.append("vocab") or real_vocab(raw))
    for name in ("_probe", "_probe_isolated"):  # in this process (the base's file) or in a child (an adapter's)
        monkeypatch.setattr(vd, name, lambda file, content, real=getattr(vd, name): seen.append("probe")
                            or real(file, content))
    return seen


def test_a_tokenizer_json_is_parsed_once_per_content(tmp_path, parsed, monkeypatch):
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    base.mkdir()
    adapter.mkdir()
    _bpe_tokenizer(VOCAB).save(str(base / "tokenizer.json"))
    digest, encodings = vd.vocab_digest(base), vd.probe_encodings(base)
    assert parsed == ["vocab", "probe"]

    def mismatch():
        return vd.tokenizer_mismatch(adapter, digest, None, None, encodings)

    shutil.copy(base / "tokenizer.json", adapter / "tokenizer.json")  # the base's very file
    assert mismatch() is None and mismatch() is None and parsed == ["vocab", "probe"]
    (adapter / "tokenizer.json").write_text(json.dumps(json.loads((base / "tokenizer.json").read_text()), indent=1))
    assert mismatch() is None and mismatch() is None  # the same tokenizer in other bytes: parsed once
    assert parsed == ["vocab", "probe"] * 2
    swapped = {**VOCAB, "a": 1, "b": 0}
    _bpe_tokenizer(swapped).save(str(adapter / "tokenizer.json"))
    for _ in range(2):  # refused each time, from what is known after the first
        assert "vocabulary differs" in mismatch()
    assert parsed == ["vocab", "probe"] * 2 + ["vocab"]  # a vocabulary that differs needs no probes
    (adapter / "tokenizer.json").write_text("{not json")
    for _ in range(2):  # a bad file is reported at every load: failures are not kept
        assert "not a readable tokenizer file" in mismatch()
    assert parsed == ["vocab", "probe"] * 2 + ["vocab"]  # it failed before any interpretation
    probes = vd.probe_encodings(base)
    probes[0].append(-1)  # the caller's own lists: what is kept does not change
    assert vd.probe_encodings(base) == encodings


def test_what_is_known_is_bounded(tmp_path, parsed, monkeypatch):
    monkeypatch.setattr(vd, "KNOWN_FILES", 2)
    digests = []
    for i in range(3):
        folder = tmp_path / f"t{i}"
        folder.mkdir()
        _bpe_tokenizer({**VOCAB, f"x{i}": 6}).save(str(folder / "tokenizer.json"))
        digests.append(vd.vocab_digest(folder))
    assert len(vd._KNOWN) == 2 and len(set(digests)) == 3
    assert vd.vocab_digest(tmp_path / "t0") == digests[0]  # the oldest was let go: parsed again
    assert parsed == ["vocab"] * 4

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
    def isolated(path, files, real=vd._digest_isolated):  # an adapter's, in a child: counted where it parsed
        digest = real(path, files)
        seen.append("vocab")
        return digest

    monkeypatch.setattr(vd, "_digest_isolated", isolated)
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


def test_an_adapters_vocabulary_files_are_parsed_in_a_child_process(tmp_path, monkeypatch):
    """vocab.json, merges.txt, added tokens (up to --max-adapter-file-bytes each) of a tenant's folder are parsed
    with the interpreter lock of a process of their own: four 64 MiB files held every stream for seconds, at every
    push. The digest, and a malformed file's error naming it, are the same as in this process."""
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    for folder in (base, adapter):
        folder.mkdir()
        (folder / "vocab.json").write_text(json.dumps({"a": 0, "b": 1, "ab": 2}))
        (folder / "merges.txt").write_text("#version: 0.2\na b\n")
    (adapter / "added_tokens.json").write_text(json.dumps({"<x>": 3}))
    here, base_digest = vd.vocab_digest(adapter), vd.vocab_digest(base)  # this process's own reading
    monkeypatch.setattr(vd, "_KNOWN", OrderedDict())

    def not_here(*_):
        raise AssertionError("an adapter's tokenizer files were parsed in the worker's process")

    monkeypatch.setattr(vd, "_digest_of", not_here)
    assert vd.vocab_digest(adapter, isolated=True) == here != base_digest
    (adapter / "vocab.json").write_text('{"a": 0, "b": "one"}')
    with pytest.raises(vd.TokenizerFileError, match=r"adapter/vocab.json: not a readable tokenizer file \(vocabulary "
                                                    r"entries must map strings to integer ids \(1 do not\)\)"):
        vd.vocab_digest(adapter, isolated=True)


def test_the_childs_other_errors_name_the_folder_and_only_their_type(tmp_path, monkeypatch):
    """A file the child fails on otherwise than as a malformed tokenizer file (a lone surrogate its digest cannot
    encode) is refused naming the folder and the error's type, never the error's message (it may quote the file)."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "vocab.json").write_text('{"a": 0, "\\ud800": 1}')
    with pytest.raises(vd.TokenizerFileError, match=r"adapter: not a readable tokenizer file \(UnicodeEncodeError\)"):
        vd.vocab_digest(adapter, isolated=True)


def test_the_tokens_a_folder_without_a_vocabulary_adds_are_read_in_a_child_process(tmp_path, monkeypatch):
    """tokenizer_config.json and added_tokens.json of a folder without a whole vocabulary are parsed in a child
    too: the tokens they add are compared with the base's as before, and past MAX_DECLARED_TOKENS refused."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "tokenizer_config.json").write_text(json.dumps(
        {"additional_special_tokens": ["<s>"], "added_tokens_decoder": {"1": {"content": "</s>"}}}))
    (adapter / "added_tokens.json").write_text(json.dumps({"<new>": 7}))
    base = {"<s>": 0, "</s>": 1}.get

    def not_here(*_):
        raise AssertionError("an adapter's tokenizer files were parsed in the worker's process")

    monkeypatch.setitem(vd._FILE_READERS, "declared", not_here)  # this process's table: the child has its own
    monkeypatch.setattr(vd, "_declared_of", not_here)
    monkeypatch.setattr(vd, "_KNOWN", OrderedDict())
    children = []
    monkeypatch.setattr(vd, "_isolated", lambda *a, real=vd._isolated: children.append(a[0]) or real(*a))
    assert "add tokens the served base model does not have" in vd.tokenizer_mismatch(adapter, None, base, None)
    assert "'<new>'" in vd.tokenizer_mismatch(adapter, None, base, None)
    assert children == ["declared"]  # the same files again: not parsed again
    (adapter / "added_tokens.json").unlink()
    assert vd.tokenizer_mismatch(adapter, None, base, None) is None
    many = {f"<t{i}>": i for i in range(vd.MAX_DECLARED_TOKENS + 1)}
    (adapter / "added_tokens.json").write_text(json.dumps(many))
    assert "more than the 65536 a folder without a whole vocabulary may add" in vd.tokenizer_mismatch(
        adapter, None, base, None)
    (adapter / "added_tokens.json").write_text(json.dumps({"\U0001f642" * 200: 5}))  # 2.4 KB of answer, escaped
    monkeypatch.setattr(vd, "MAX_ANSWER_BYTES", 1000)  # what the worker parses back is bounded in bytes too
    assert "its tokenizer files declare more than 1000 bytes of tokens" in vd.tokenizer_mismatch(
        adapter, None, base, None)

"""The identity of a tokenizer: a digest of its vocabulary and merges, whatever files carry them.
An adapter that ships another tokenizer than the base's would decode to garbage; this is the check."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def _vocab_and_merges_from_dir(path: Path) -> tuple[dict[str, int], list[str]] | None:
    tok_json = path / "tokenizer.json"
    if tok_json.is_file():
        raw = json.loads(tok_json.read_text(encoding="utf-8"))
        model = raw.get("model") or {}
        vocab = dict(model.get("vocab") or {}) if isinstance(model.get("vocab"), dict) else {
            piece[0]: i for i, piece in enumerate(model.get("vocab") or [])  # Unigram: [[piece, score], ...]
        }
        merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
        for tok in raw.get("added_tokens") or []:
            vocab[tok["content"]] = tok["id"]
        return vocab, merges
    vocab_json = path / "vocab.json"
    if vocab_json.is_file():
        vocab = json.loads(vocab_json.read_text(encoding="utf-8"))
        merges_txt = path / "merges.txt"
        merges = []
        if merges_txt.is_file():
            merges = [ln for ln in merges_txt.read_text(encoding="utf-8").splitlines()
                      if ln and not ln.startswith("#version")]
        added = path / "added_tokens.json"
        if added.is_file():
            vocab.update(json.loads(added.read_text(encoding="utf-8")))
        cfg = path / "tokenizer_config.json"
        if cfg.is_file():
            for idx, tok in (json.loads(cfg.read_text(encoding="utf-8")).get("added_tokens_decoder") or {}).items():
                vocab[tok["content"]] = int(idx)
        return vocab, merges
    return None


def vocab_digest(path: str | Path) -> str | None:
    """Digest of a tokenizer's vocabulary (token -> id, added tokens included) and BPE merges.

    `path` is a model/adapter dir or a tokenizer.json; None when it holds no tokenizer files we can
    read. Equal digests mean the same text becomes the same ids, whatever file format carried them.
    """
    path = Path(path)
    if path.is_file():
        path = path.parent
    found = _vocab_and_merges_from_dir(path)
    if found is None:
        return None
    vocab, merges = found
    h = hashlib.sha256()
    h.update(json.dumps(sorted(vocab.items(), key=lambda kv: (kv[1], kv[0])), ensure_ascii=False).encode())
    h.update(b"\0merges\0")
    h.update("\n".join(merges).encode())
    return h.hexdigest()

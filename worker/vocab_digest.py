"""The identity of a tokenizer: a digest of its vocabulary and merges, whatever files carry them.
An adapter that ships another tokenizer than the base's would decode to garbage; this is the check."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from lorafleet.worker.file_limits import FileLimitError, read_limited

T = TypeVar("T")
# The files a tokenizer is read from: tokenizer.json, else vocab.json (+ merges.txt, added tokens).
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "added_tokens.json", "tokenizer_config.json")


class TokenizerFileError(ValueError):
    """A tokenizer file that cannot be read as one (not JSON, not UTF-8, unexpected structure); the
    message names the file."""


def _parse(file: Path, interpret: Callable[[Any], T], max_bytes: int | None) -> T:
    """`interpret(json of file)`; any malformation becomes a TokenizerFileError naming the file. A file
    over `max_bytes` (None: no limit) or not a regular file raises FileLimitError, unread."""
    try:
        raw = json.loads(read_limited(file, max_bytes).decode("utf-8"))
        if not isinstance(raw, dict):
            raise TypeError(f"expected a JSON object, found a JSON {type(raw).__name__}")
        return interpret(raw)
    except FileLimitError:
        raise
    except (OSError, ValueError, RecursionError, KeyError, IndexError, TypeError, AttributeError) as exc:
        # ValueError covers JSONDecodeError and UnicodeDecodeError.
        raise TokenizerFileError(f"{file}: not a readable tokenizer file ({type(exc).__name__}: {exc})") from exc


def _from_tokenizer_json(raw: dict) -> tuple[dict[str, int], list[str]]:
    model = raw.get("model") or {}
    vocab = dict(model.get("vocab") or {}) if isinstance(model.get("vocab"), dict) else {
        piece[0]: i for i, piece in enumerate(model.get("vocab") or [])  # Unigram: [[piece, score], ...]
    }
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    for tok in raw.get("added_tokens") or []:
        vocab[tok["content"]] = tok["id"]
    return _checked(vocab), merges


def _added_tokens_decoder(raw: dict) -> dict[str, int]:
    return _checked({tok["content"]: int(idx) for idx, tok in (raw.get("added_tokens_decoder") or {}).items()})


def _checked(vocab: dict) -> dict[str, int]:
    """token -> id with string tokens and integer ids (the digest sorts by them)."""
    bad = [(t, i) for t, i in vocab.items() if not isinstance(t, str) or not isinstance(i, int) or isinstance(i, bool)]
    if bad:
        raise TypeError(f"vocabulary entries must map strings to integer ids, got {bad[:3]}")
    return vocab


def _vocab_and_merges_from_dir(path: Path, max_bytes: int | None) -> tuple[dict[str, int], list[str]] | None:
    tok_json = path / "tokenizer.json"
    if tok_json.is_file():
        return _parse(tok_json, _from_tokenizer_json, max_bytes)
    vocab_json = path / "vocab.json"
    if vocab_json.is_file():
        vocab = _parse(vocab_json, _checked, max_bytes)
        merges_txt = path / "merges.txt"
        merges = []
        if merges_txt.is_file():
            try:
                text = read_limited(merges_txt, max_bytes).decode("utf-8")
            except FileLimitError:
                raise
            except (OSError, ValueError) as exc:
                raise TokenizerFileError(f"{merges_txt}: not a readable merges file ({exc})") from exc
            merges = [ln for ln in text.splitlines() if ln and not ln.startswith("#version")]
        added = path / "added_tokens.json"
        if added.is_file():
            vocab.update(_parse(added, _checked, max_bytes))
        cfg = path / "tokenizer_config.json"
        if cfg.is_file():
            vocab.update(_parse(cfg, _added_tokens_decoder, max_bytes))
        return vocab, merges
    return None


def vocab_digest(path: str | Path, max_file_bytes: int | None = None) -> str | None:
    """Digest of a tokenizer's vocabulary (token -> id, added tokens included) and BPE merges.

    `path` is a model/adapter dir or a tokenizer.json; None when it holds no tokenizer files.
    Equal digests mean the same text becomes the same ids, whatever file format carried them.
    Raises TokenizerFileError (naming the file) when a tokenizer file is malformed, and FileLimitError,
    before reading it, when one is over `max_file_bytes` (None: no size limit) or not a regular file.
    """
    path = Path(path)
    if path.is_file():
        path = path.parent
    found = _vocab_and_merges_from_dir(path, max_file_bytes)
    if found is None:
        return None
    vocab, merges = found
    h = hashlib.sha256()
    h.update(json.dumps(sorted(vocab.items(), key=lambda kv: (kv[1], kv[0])), ensure_ascii=False).encode())
    h.update(b"\0merges\0")
    h.update("\n".join(merges).encode())
    return h.hexdigest()

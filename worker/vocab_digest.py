"""The identity of a tokenizer: a digest of its vocabulary and merges, whatever files carry them.
An adapter that ships another tokenizer than the base's would decode to garbage; this is the check."""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from lorafleet.worker.engine_errors import is_failure
from lorafleet.worker.file_limits import FileLimitError, read_limited
from lorafleet.worker.sentencepiece_pieces import PiecesMalformed, sentencepiece_pieces
from lorafleet.worker.tenant_folders import opened_path
from lorafleet.worker.tokenizer_children import FILES_CHILD, PROBE_CHILD

T = TypeVar("T")
# Texts whose ids tell apart two tokenizers of one vocabulary (their normalizer, pre-tokenizer or model flags
# differ): case, repeated and trailing spaces, tabs and newlines, composed and combining accents, CJK, emoji,
# digits, contractions, markup, unusual spaces. None starts with a space: a Llama-2 tokenizer saved again by
# a later transformers handles a leading space otherwise, and its adapters are the base's all the same.
PROBE_TEXTS = ("Hi", "hello World", "HELLO  there\tyou\n\nnew line ", "naïve café, nai\u0308ve", "東京タワー 🙂",
               "1234567 + 3.14 = x", "don't I'll", '<p>x</p> {"k": [1, 2]}', "a\u00a0b\u2003c ")
# An adapter's tokenizer.json is run in a process of its own, limited to these (its normalizer and pre-tokenizer
# are the tenant's regexes: run here, one that backtracks held the interpreter lock for a minute, every stream stalled).
PROBE_CPU_S = 20  # of CPU time: past it the child is killed (SIGXCPU)
PROBE_TIMEOUT_S = 120.0  # of wall-clock time (a busy node: CPU time is the bound that counts)
MAX_ANSWER_BYTES = 4 << 20  # of a child's answer (as JSON), which the worker parses back
MAX_DECLARED_TOKENS = 1 << 16  # added tokens a folder without a whole vocabulary may declare (Llama-3: 256)
DIGEST_BYTES_PER_CPU_S = 4 << 20  # a vocabulary's digest gets PROBE_CPU_S, and a second more per 4 MiB of files
PROBE_MEMORY_BYTES = 4 << 30
PROBE_IDS_PER_BYTE = 8  # a tokenizer giving more ids than this per byte of the probes is refused, its output unread
# The files a tokenizer is read from: tokenizer.json, else vocab.json (+ merges.txt, added tokens), else a
# SentencePiece tokenizer.model's pieces with the tokens tokenizer_config.json and added_tokens.json add.
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "added_tokens.json", "tokenizer_config.json",
                   "tokenizer.model")


class TokenizerFileError(ValueError):
    """A tokenizer file that cannot be read as one (not JSON, not UTF-8, unexpected structure); the
    message names the file."""


class _Malformed(TypeError):
    """A malformation this module describes itself, in words that quote nothing of the file."""


_KNOWN: OrderedDict[tuple[str, bytes], Any] = OrderedDict()  # (what, sha256 of a file) -> what it gave
_KNOWN_LOCK = threading.Lock()
KNOWN_FILES = 64


def _once_per_content(what: str, content: bytes, compute: Callable[[], T]) -> T:
    """`compute()`, once for each content of a tokenizer.json (the last KNOWN_FILES kept). Adapters mostly ship
    their base's very file, parsed here once, for the base, instead of at every load with the interpreter lock
    held (0.1 s for a 2 MB file, stalling every other tenant's streams; Llama-3's is 9 MB). Hashing lets go of
    the lock. Failures are not kept: each load of a bad file reports it."""
    key = (what, hashlib.sha256(content).digest())
    with _KNOWN_LOCK:
        if key in _KNOWN:
            _KNOWN.move_to_end(key)
            return _KNOWN[key]
    value = compute()
    with _KNOWN_LOCK:
        _KNOWN[key] = value
        while len(_KNOWN) > KNOWN_FILES:
            _KNOWN.popitem(last=False)
    return value


def _read(file: Path, max_bytes: int | None, opened: Callable[[Path, int], None] | None = None) -> bytes:
    """The bytes of `file`; FileLimitError for a file over `max_bytes` (None: no limit) or not a regular file,
    unread, and TokenizerFileError naming the file when it cannot be read. `opened`: as file_limits.read_chunks."""
    try:
        return read_limited(file, max_bytes, opened=opened)
    except FileLimitError:
        raise
    except OSError as exc:
        raise TokenizerFileError(f"{file}: not a readable tokenizer file ({type(exc).__name__})") from exc


def _parse(file: Path, interpret: Callable[[Any], T], max_bytes: int | None, content: bytes | None = None,
           opened: Callable[[Path, int], None] | None = None) -> T:
    """`interpret(json of file)` (of `content` if given: the file's bytes); any malformation becomes a
    TokenizerFileError naming the file. A file over `max_bytes` (None: no limit) or not a regular file raises
    FileLimitError, unread."""
    try:
        raw = json.loads((_read(file, max_bytes, opened) if content is None else content).decode("utf-8"))
        if not isinstance(raw, dict):
            raise _Malformed(f"expected a JSON object, found a JSON {type(raw).__name__}")
        return interpret(raw)
    except (FileLimitError, TokenizerFileError):
        raise
    except (OSError, ValueError, RecursionError, KeyError, IndexError, TypeError, AttributeError) as exc:
        # ValueError covers JSONDecodeError and UnicodeDecodeError.
        # Never the file's content: an adapter folder's file may be a link to one the tenant must not read.
        detail = (str(exc) if isinstance(exc, _Malformed)  # our own words
                  else f"{type(exc).__name__}: {exc}" if isinstance(exc, json.JSONDecodeError)  # a position only
                  else type(exc).__name__)
        raise TokenizerFileError(f"{file}: not a readable tokenizer file ({detail})") from exc


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
        raise _Malformed(f"vocabulary entries must map strings to integer ids ({len(bad)} do not)")
    return vocab


def _tokenizer_files(path: Path, max_bytes: int | None) -> dict[str, bytes] | None:
    """The bytes of the files a folder's vocabulary is read from: tokenizer.json, else vocab.json with merges.txt,
    added_tokens.json and tokenizer_config.json where present; None with neither."""
    names = ("tokenizer.json",) if (path / "tokenizer.json").is_file() else \
        ("vocab.json", "merges.txt", "added_tokens.json", "tokenizer_config.json")
    if not (path / names[0]).is_file():
        return None
    return {name: _read(path / name, max_bytes) for name in names if (path / name).is_file()}


def _digest_of(path: Path, files: dict[str, bytes]) -> str:
    """`_digest` of the vocabulary and merges in `files` (as `_tokenizer_files` gives them, read from `path`)."""
    if "tokenizer.json" in files:
        return _digest(*_parse(path / "tokenizer.json", _from_tokenizer_json, None, files["tokenizer.json"]))
    vocab = _parse(path / "vocab.json", _checked, None, files["vocab.json"])
    merges = []
    if "merges.txt" in files:
        try:
            text = files["merges.txt"].decode("utf-8")
        except ValueError as exc:
            raise TokenizerFileError(f"{path / 'merges.txt'}: not a readable merges file ({type(exc).__name__})") from exc
        merges = [ln for ln in text.splitlines() if ln and not ln.startswith("#version")]
    if "added_tokens.json" in files:
        vocab.update(_parse(path / "added_tokens.json", _checked, None, files["added_tokens.json"]))
    if "tokenizer_config.json" in files:
        vocab.update(_parse(path / "tokenizer_config.json", _added_tokens_decoder, None, files["tokenizer_config.json"]))
    return _digest(vocab, merges)


def vocab_digest(path: str | Path, max_file_bytes: int | None = None, *, isolated: bool = False) -> str | None:
    """Digest of a tokenizer's vocabulary (token -> id, added tokens included) and BPE merges.

    `path` is a model/adapter dir or a tokenizer.json; None when it holds no tokenizer files.
    Equal digests mean the same text becomes the same ids, whatever file format carried them.
    Raises TokenizerFileError (naming the file) when a tokenizer file is malformed, and FileLimitError,
    before reading it, when one is over `max_file_bytes` (None: no size limit) or not a regular file.
    `isolated` (an adapter's files): parsed in a child process (_digest_isolated), not in this one; files with
    the bytes of ones digested before (the base's own, mostly) are not parsed again.
    """
    path = Path(path)
    if path.is_file():
        path = path.parent
    files = _tokenizer_files(path, max_file_bytes)
    if files is None:
        return None
    return _once_per_content("vocab", _files_key(files), lambda: (_digest_isolated if isolated else _digest_of)(path, files))


def _files_key(files: dict[str, bytes]) -> bytes:
    """What `_once_per_content` knows files by: each one's name and bytes."""
    return b"".join(hashlib.sha256(name.encode() + b"\0" + data).digest() for name, data in sorted(files.items()))


def _digest(vocab: dict[str, int], merges: list[str]) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(sorted(vocab.items(), key=lambda kv: (kv[1], kv[0])), ensure_ascii=False).encode())
    h.update(b"\0merges\0")
    h.update("\n".join(merges).encode())
    return h.hexdigest()


def probe_encodings(path: str | Path, max_file_bytes: int | None = None, *, isolated: bool = True
                    ) -> list[list[int]] | None:
    """The ids the tokenizer.json of `path` (a folder or the file) gives each of PROBE_TEXTS (no special tokens,
    padding or truncation); None when there is no tokenizer.json. Equal vocabularies may still
    turn text into other ids (another normalizer or pre-tokenizer, `add_prefix_space`, `byte_fallback`): these
    tell them apart. `isolated` (an adapter's file): built and run in a child process limited to PROBE_CPU_S
    and PROBE_MEMORY_BYTES, not in this one; a file with the bytes of one probed before is not run again.
    Raises TokenizerFileError for a file `tokenizers` cannot build or that runs past those limits, FileLimitError
    as above."""
    path = Path(path)
    file = path if path.is_file() else path / "tokenizer.json"
    if not file.is_file():
        return None
    content = _read(file, max_file_bytes)
    encodings = _once_per_content("probes", content, lambda: (_probe_isolated if isolated else _probe)(file, content))
    return [list(ids) for ids in encodings]  # the caller's own lists, not the ones kept


def _probe(file: Path, content: bytes) -> list[list[int]]:
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_str(content.decode("utf-8"))
        tokenizer.no_padding()  # a training script's padding or truncation, saved with the file, change no id
        tokenizer.no_truncation()
        # Special tokens left out: a post-processor adding BOS/EOS (add_eos_token while training) frames the
        # ids, it does not change them; the served base's own framing is what serving uses.
        return [tokenizer.encode(text, add_special_tokens=False).ids for text in PROBE_TEXTS]
    except BaseException as exc:  # noqa: BLE001 - tokenizers raises bare Exceptions for files it cannot build
        # ...and a Rust panic as pyo3's PanicException, a BaseException: a file's regex that backtracks past the
        # regex engine's limit is one. It is the file's fault, not the end of the thread that loads it.
        if not is_failure(exc):
            raise
        raise _unreadable(file, type(exc).__name__) from None


def _run_child(code: str, args: list[str], stdin: bytes, ran_out: str, what: Path, cpu_s: float = 0.0
               ) -> subprocess.CompletedProcess:
    """`code` in a child process (`python -I -c`), its CPU time (`cpu_s`, else PROBE_CPU_S) and memory bounded:
    past them, a TokenizerFileError saying `ran_out`. Killed by the OOM killer (first in line), or still running
    past PROBE_TIMEOUT_S (or three times `cpu_s`) of wall-clock time, a busy node rather than the files: OSError
    EAGAIN, to try again."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1"}
    cpu_s = math.ceil(cpu_s or PROBE_CPU_S)
    code = code.replace("CPU_S", str(cpu_s), 1).replace("MEMORY_BYTES", str(PROBE_MEMORY_BYTES), 1)
    try:
        done = subprocess.run([sys.executable, "-I", "-c", code, *args], input=stdin, cwd="/", capture_output=True,
                              timeout=max(PROBE_TIMEOUT_S, 3 * cpu_s), env=env, check=False)
    except subprocess.TimeoutExpired:
        raise OSError(errno.EAGAIN, f"{what}: the tokenizer check ran past its wall-clock limit (a busy node?); it "
                                    f"is tried again") from None
    if done.returncode == -signal.SIGXCPU:
        raise TokenizerFileError(ran_out)
    if done.returncode == -signal.SIGKILL:  # the OOM killer (it is first in line), not the file's fault for sure
        raise OSError(errno.EAGAIN, f"{what}: the tokenizer check was killed (memory short?); it is tried again")
    return done


def _digest_isolated(path: Path, files: dict[str, bytes]) -> str:
    """`_digest_of` in a child process: a tenant's tokenizer files (up to --max-adapter-file-bytes each) are parsed
    with the interpreter lock of a process of their own, not the worker's (four 64 MiB files held every stream
    for seconds, at every push), within the probe's limits."""
    digest = _isolated("digest", path, files)
    if not isinstance(digest, str):
        raise TokenizerFileError(f"{path}: its tokenizer files could not be read (an unexpected answer)")
    return digest


def _isolated(reader: str, path: Path, files: dict[str, bytes]) -> Any:
    """`_FILE_READERS[reader](path, files)`, computed in a child process (FILES_CHILD) with a CPU budget growing
    with the files' bytes; its TokenizerFileError raised here."""
    code = FILES_CHILD.format(package=str(Path(__file__).parent), most=MAX_ANSWER_BYTES)
    sizes = json.dumps([[name, len(data)] for name, data in files.items()])
    cpu_s = PROBE_CPU_S + sum(map(len, files.values())) / DIGEST_BYTES_PER_CPU_S  # four dense 64 MiB files: 25 s
    done = _run_child(code, [str(path), sizes, reader], b"".join(files.values()), f"{path}: its tokenizer files "
                      f"took more than {math.ceil(cpu_s)} s to read", path, cpu_s)
    try:
        answer = json.loads(done.stdout) if done.returncode == 0 else None
    except ValueError:
        answer = None
    if isinstance(answer, dict) and isinstance(answer.get("error"), str):
        raise TokenizerFileError(answer["error"])
    if not (isinstance(answer, dict) and "value" in answer):
        # Never its stderr: a parser's message may quote the file, maybe a link to one the tenant must not read.
        raise TokenizerFileError(f"{path}: its tokenizer files could not be read (exit status {done.returncode})")
    return answer["value"]


def _probe_isolated(file: Path, content: bytes) -> list[list[int]]:
    """`_probe` in a child process: a tenant's tokenizer never runs in the worker's, and what it gives back
    is bounded (PROBE_IDS_PER_BYTE), so it cannot fill the worker's memory either."""
    most = PROBE_IDS_PER_BYTE * sum(len(t.encode()) for t in PROBE_TEXTS)
    ran_out = (f"{file}: its tokenizer ran more than {PROBE_CPU_S} s to encode {len(PROBE_TEXTS)} short texts (a "
               f"normalizer or pre-tokenizer that backtracks?)")
    done = _run_child(PROBE_CHILD.replace("{most}", str(most)), [json.dumps(PROBE_TEXTS)], content, ran_out, file)
    if done.returncode == 3:
        raise _unreadable(file, f"it turns the probe texts into more than {most} ids")
    try:
        encodings = json.loads(done.stdout) if done.returncode == 0 else None
    except ValueError:
        encodings = None
    if not (isinstance(encodings, list) and len(encodings) == len(PROBE_TEXTS)
            and all(isinstance(ids, list) and all(type(i) is int for i in ids) for ids in encodings)):
        # Never its stderr: the library's message may quote the file, maybe a link to one the tenant must not read.
        raise _unreadable(file, f"it failed to build or encode, exit status {done.returncode}")
    return encodings


def _unreadable(file: Path, detail: str) -> TokenizerFileError:
    return TokenizerFileError(f"{file}: not a readable tokenizer file ({detail}); check that it loads with the "
                              f"tokenizers library")


def _declared_added_tokens(path: Path, max_bytes: int | None, foreign: list[Path]) -> dict[str, int | None]:
    """The tokens a folder without a whole vocabulary (no tokenizer.json, no vocab.json) declares: a SentencePiece
    tokenizer.model's pieces by their ids, added_tokens.json and tokenizer_config.json's added_tokens_decoder with
    theirs, its additional_special_tokens by name (None: any id): what a slow tokenizer's save_pretrained writes.
    `foreign` gets each file read that did not lie in the folder itself as it was opened (a link elsewhere, or
    swapped for one after the source was checked, or the folder itself; a hard link): its tokens are never quoted
    (`tokenizer_mismatch`). Read here, parsed in a child process (`_isolated`), as a whole vocabulary is."""
    # The folder as named, its links not followed: the source's check resolved it, and a folder (or one above it)
    # swapped for a link since leads its files elsewhere, where they count as foreign.
    home = Path(os.path.abspath(path))

    def opened(file: Path, fd: int) -> None:  # a hard link too: its other names may be anywhere
        if opened_path(fd, file) != home / file.name or os.fstat(fd).st_nlink > 1:
            foreign.append(file)

    files = {name: _read(path / name, max_bytes, opened) for name in ("tokenizer.model", "tokenizer_config.json",
                                                                      "added_tokens.json") if (path / name).is_file()}
    declared = _once_per_content("declared", _files_key(files), lambda: _isolated("declared", path, files)) if files else {}
    if not (isinstance(declared, dict) and all(i is None or type(i) is int for i in declared.values())):
        raise TokenizerFileError(f"{path}: its tokenizer files could not be read (an unexpected answer)")
    return dict(declared)  # the caller's own, not the one kept


def _declared_of(path: Path, files: dict[str, bytes]) -> dict[str, int | None]:
    """The tokens `files` (tokenizer.model, tokenizer_config.json, added_tokens.json: their bytes) declare; at most
    MAX_DECLARED_TOKENS besides the pieces (the worker reads the child's answer back)."""
    def special_and_decoder(raw: dict) -> dict[str, int | None]:
        extra = raw.get("additional_special_tokens") or []
        names = [t["content"] if isinstance(t, dict) else t for t in extra]
        if not all(isinstance(n, str) for n in names):
            raise _Malformed("additional_special_tokens must name tokens (strings, or objects with 'content')")
        return {**dict.fromkeys(names), **_added_tokens_decoder(raw)}

    declared: dict[str, int | None] = {}
    for name, interpret in (("tokenizer_config.json", special_and_decoder), ("added_tokens.json", _checked)):
        if name in files:
            declared.update(_parse(path / name, interpret, None, files[name]))
    if len(declared) > MAX_DECLARED_TOKENS:
        raise TokenizerFileError(f"{path}: its tokenizer files add {len(declared)} tokens, more than the "
                                 f"{MAX_DECLARED_TOKENS} a folder without a whole vocabulary may add")
    try:
        pieces = sentencepiece_pieces(files["tokenizer.model"]) if "tokenizer.model" in files else {}
    except PiecesMalformed as exc:
        raise TokenizerFileError(f"{path / 'tokenizer.model'}: not a SentencePiece model ({exc})") from None
    return {**pieces, **declared}


_FILE_READERS = {"digest": _digest_of, "declared": _declared_of}  # what _isolated may run in its child


def tokenizer_mismatch(path: Path, base_digest: str | None, base_token_id: Callable[[str], int | None] | None,
                       max_bytes: int | None, base_encodings: list[list[int]] | None = None) -> str | None:
    """Why the tokenizer files of the adapter folder `path` do not match the served base's, or None. A whole
    vocabulary (tokenizer.json, vocab.json) is compared by digest with `base_digest`, and a tokenizer.json's
    `probe_encodings` with `base_encodings` (the base's); without a whole vocabulary, each token the folder
    adds must be the base's token of that id (`base_token_id`). None for any skips that check.
    Raises FileLimitError for a file over `max_bytes` or not a regular file."""
    try:
        theirs = vocab_digest(path, max_bytes, isolated=True)
        foreign: list[Path] = []
        declared = _declared_added_tokens(path, max_bytes, foreign) if theirs is None and base_token_id else {}
        probe = theirs is not None and base_encodings is not None and theirs == (base_digest or theirs)
        encoded = probe_encodings(path, max_bytes) if probe else None  # another vocabulary is refused as it is
    except TokenizerFileError as exc:
        return (f"{exc}; the adapter's vocabulary cannot be compared with the served base model's. Fix or remove "
                f"the tokenizer files, or load with strictness 'warn'/'off'")
    if base_digest and theirs and theirs != base_digest:
        return (f"{path}: the adapter ships a tokenizer whose vocabulary differs from the served base model's; "
                f"its outputs would be decoded with the wrong ids. Serve it on the base it was trained with, or "
                f"remove the tokenizer files if they are in fact the same")
    if encoded is not None and encoded != base_encodings:
        text, ours, other = next(t for t in zip(PROBE_TEXTS, base_encodings, encoded, strict=True) if t[1] != t[2])
        def shown(ids: list[int]) -> str:
            return f"{ids[:12]}" if len(ids) <= 12 else f"{str(ids[:12])[:-1]}, ... ({len(ids)} ids)]"
        return (f"{path}: the adapter ships a tokenizer with the served base model's vocabulary that turns text into "
                f"other ids (its normalizer or pre-tokenizer differ: {text!r} is {shown(other)} for it, "
                f"{shown(ours)} for the base); it was trained on ids this server would not produce. Serve it on the "
                f"base it was trained with, or remove the tokenizer files if the base's are the ones it was "
                f"trained with")
    new = sorted(token for token, i in declared.items() if (ours := base_token_id(token)) is None
                 or (i is not None and ours != i))
    if new:
        shown = ", ".join(repr(t) for t in new[:5]) + (f" and {len(new) - 5} more" if len(new) > 5 else "")
        if foreign:  # a file read elsewhere than in the folder may be anyone's: nothing of it is quoted
            shown = (f"{len(new)} of them, not quoted as {', '.join(str(f) for f in foreign)} lay outside the "
                     f"adapter's folder when read (a link)")
        return (f"{path}: the adapter's tokenizer files add tokens the served base model does not have (or has under "
                f"other ids): {shown}; the adapter was trained on ids this server would never produce or read. "
                f"Serve it on the base it was trained with, or remove the tokenizer files if they are in fact "
                f"the base's")
    return None


"""PEFT's matching rules for adapter_config.json: which modules an adapter targets, and the rank,
alpha and scale of each (rank_pattern / alpha_pattern / rsLoRA), as PEFT itself applies them.

The adapter's own patterns (target_modules, exclude_modules, the pattern keys) are matched with the
`regex` engine under a time limit and without holding the interpreter lock: a pattern that backtracks
for ever (`(.*.*)*!`) refuses its adapter, where Python's `re` would stall the whole worker. One load's
matches share a budget too (`pattern_budget`, PATTERN_BUDGET_S): thousands of pattern keys that each stay
just under the per-match limit, tried against every module, would hold the worker's admin lock (every other
tenant's push and load) for hours; their compiles count against it as well, and one pattern is at most
MAX_PATTERN_CHARS long (Python's `re`, which PEFT compiles with, is slow to compile some patterns), also with
its counted repeats written out (`written_out_size`): the `regex` engine writes `(?:a{3000}){3000}` out in full
as it compiles it, 2.6 GB and seconds with the interpreter lock held. The compiled patterns are not left in the
`regex` module's own cache (500 of them, each up to a megabyte): a load holds its own, and `_find` keeps a few.
The two engines read a few patterns otherwise (`[0-9[:digit:]]`, `x{e<=1}`): those are refused (`dialect_difference`),
so that every pattern served selects and scales the modules PEFT's `re` does."""

from __future__ import annotations

import contextlib
import functools
import math
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import regex

from lorafleet.kernels.lora_layout import PROJS

try:  # Python 3.11+
    from re import _constants as _re_constants
    from re import _parser as _re_parser
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as _re_constants  # type: ignore[no-redef]
    import sre_parse as _re_parser  # type: ignore[no-redef]

MATCH_SECONDS = 0.2  # one match of an adapter's pattern against a module name (real ones take microseconds)
PATTERN_BUDGET_S = 5.0  # all the matches of one load (a real config's take milliseconds)
_budget = threading.local()  # .deadline: time.monotonic() by which this thread's load must be done matching


@contextlib.contextmanager
def pattern_budget(seconds: float | None = None) -> Iterator[None]:
    """The matches made on this thread inside share `seconds` (PATTERN_BUDGET_S; an enclosing budget stands)."""
    if getattr(_budget, "deadline", None) is not None:
        yield
        return
    _budget.deadline = time.monotonic() + (PATTERN_BUDGET_S if seconds is None else seconds)
    try:
        yield
    finally:
        _budget.deadline = None


def budgeted(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` run inside one `pattern_budget`."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with pattern_budget():
            return fn(*args, **kwargs)
    return run


def _left() -> float:
    """Seconds left of this thread's budget (no budget: no end)."""
    deadline = getattr(_budget, "deadline", None)
    return math.inf if deadline is None else deadline - time.monotonic()


def check_budget() -> None:
    """Refuse the adapter once its load's budget is spent (compiles count too: PEFT's `re` takes about 0.3 s a
    kilobyte for a case-insensitive class over most of Unicode)."""
    if _left() <= 0:
        raise _over_budget()


def _over_budget() -> Exception:
    from lorafleet.worker.peft_config import CONFIG_FILE, AdapterError

    return AdapterError(f"compiling and matching its patterns (target_modules, exclude_modules, layers_pattern, "
                        f"rank_pattern, alpha_pattern) against the model's modules takes over {PATTERN_BUDGET_S} s in "
                        f"all; use fewer or simpler ones in {CONFIG_FILE}")


def _timed(match: Callable[[float], regex.Match | None], pattern: str, module_name: str, field: str) -> Any:
    """`match(timeout)` of the adapter's `pattern` against `module_name`, within MATCH_SECONDS and the budget."""
    from lorafleet.worker.peft_config import CONFIG_FILE, AdapterError

    check_budget()
    timeout = min(MATCH_SECONDS, _left())
    try:
        return match(max(0.0, timeout))
    except TimeoutError:
        if timeout < MATCH_SECONDS:  # it ran into the load's budget, not its own limit
            raise _over_budget() from None
        raise AdapterError(f"{field}: the regex {pattern!r} takes over {MATCH_SECONDS} s to match the module name "
                           f"{module_name!r} (it backtracks without end); simplify it in {CONFIG_FILE}") from None


@functools.lru_cache(maxsize=16)
def _compiled(pattern: str) -> regex.Pattern:
    """An adapter's pattern (checked by peft_config._compile), compiled once for the modules it is matched against;
    the last few kept here, not in the regex module's cache of 500."""
    return regex.compile(pattern, cache_pattern=False)


def _find(pattern: str, module_name: str, field: str, *, full: bool) -> regex.Match | None:
    compiled = _compiled(pattern)
    find = compiled.fullmatch if full else compiled.match
    return _timed(lambda timeout: find(module_name, timeout=timeout, concurrent=True), pattern, module_name, field)


def _match(pattern: str, module_name: str, field: str, *, full: bool) -> bool:
    return _find(pattern, module_name, field, full=full) is not None


MAX_PATTERN_KEYS = 4096  # of rank_pattern or alpha_pattern (one per module of a 70B model is 560)
MAX_PATTERN_CHARS = 8192  # of one pattern: every module of an 8B model spelled out in one regex is about as long
_REPEATS = {_re_constants.MAX_REPEAT, _re_constants.MIN_REPEAT, getattr(_re_constants, "POSSESSIVE_REPEAT", None)}


def written_out_size(pattern: str, most: int = MAX_PATTERN_CHARS) -> int:
    """About how many items `pattern` has with each counted repeat written out (`x{3}`: xxx; the upper count where
    there is one, else the lower), as the `regex` engine writes them while it compiles; counting stops past
    `most`. Raises re.error for a pattern Python's `re` cannot parse (PEFT could not use it either)."""

    def size(items: Any) -> int:
        total = 0
        for op, arg in items:
            if op in _REPEATS:
                low, high, item = arg
                total += max(1, low if high == _re_constants.MAXREPEAT else high) * size(item)
            else:
                total += 1 + sum(size(sub) for sub in _parts(arg))
            if total > most:
                return total
        return total

    return size(_re_parser.parse(pattern))


_REPEAT = re.compile(r"\{(?:\d+(?:,\d*)?|,\d*)\}")  # what Python's `re` reads as a counted repeat
_VERBOSE = re.compile(r"\(\?[a-zA-Z-]*x")  # the verbose flag, global or scoped: comments and spaces read otherwise


def dialect_difference(pattern: str) -> str | None:
    """Why `pattern` may match otherwise under the `regex` engine than under Python's `re`, PEFT's (None: it
    cannot). `[0-9[:digit:]]`: a POSIX class inside a set to one, a set then `]` to the other; `x{e<=1}`: fuzzy
    matching to one, literal text to the other; the verbose flag (whose comments either may read as syntax).
    A plain scan, without `re`'s warnings (their filters are the process's, and loads run on several threads)."""
    if _VERBOSE.search(pattern):
        return "the verbose flag (?x)"
    i, in_set = 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":  # an escaped character; `\N{name}` one named
            named = pattern.find("}", i) if pattern.startswith("N{", i + 1) else -1
            i = named + 1 if named >= 0 else i + 2
            continue
        if in_set:
            if c == "[" and pattern[i + 1:i + 2] in (":", "=", "."):
                return f"a POSIX class ({pattern[i:i + 2]}...) inside a set"
            in_set = c != "]"
        elif c == "[":
            in_set, i = True, i + 1 + pattern.startswith("^", i + 1)
            i += pattern.startswith("]", i)  # a set's first `]` is one of its characters
            continue
        elif pattern.startswith("(?#", i):  # a comment, to its first unescaped `)`
            i += 3
            while i < len(pattern) and pattern[i] != ")":
                i += 2 if pattern[i] == "\\" else 1
            i += 1
            continue
        elif c == "{" and not _REPEAT.match(pattern, i):
            return "a literal '{', which the regex engine may read as a fuzzy-match constraint; write \\{"
        i += 1
    return None


def _parts(arg: Any) -> Iterator[Any]:
    """The sub-patterns inside one parsed item's argument (a group's, a branch's, a look-around's)."""
    if isinstance(arg, _re_parser.SubPattern):
        yield arg
    elif isinstance(arg, tuple | list):
        for a in arg:
            yield from _parts(a)


def compiled_keys(pattern: dict, field: str) -> list[tuple[str, regex.Pattern]]:
    """Each key of `pattern` (rank_pattern / alpha_pattern, checked by peft_config.refuse_unsupported: at most
    MAX_PATTERN_KEYS valid regexes) with its end-of-name regex, compiled once for a load: the regex module's
    own cache holds 500, so a larger dict was compiled again for every module, with the interpreter lock
    held."""
    compiled = []
    for key in pattern:
        check_budget()
        compiled.append((key, regex.compile(rf"(.*\.)?({key})$", cache_pattern=False)))
    return compiled


def pattern_key(pattern_keys: list[tuple[str, regex.Pattern]], module_name: str) -> str | None:
    """PEFT's `get_pattern_key`: the first key (of `compiled_keys`) that matches the end of the module name."""
    for key, compiled in pattern_keys:
        if _timed(lambda timeout, c=compiled: c.match(module_name, timeout=timeout, concurrent=True), key,
                  module_name, "rank_pattern / alpha_pattern") is not None:
            return key
    return None


def layer_regex(pattern: str) -> str:
    """PEFT's regex for the layer index after a `layers_pattern` segment: the first such index, the segment at the
    name's start or after a dot (`model.layers` names Llama's own; the pattern grouped: an alternation in it stays
    inside the segment)."""
    return rf"(?:^|.*?\.)(?:{pattern})\.(?P<layer_index>\d+)\."


def _layer_selected(config: dict, module_name: str) -> bool:
    layers = config.get("layers_to_transform")
    if layers is None or layers == []:
        return True
    patterns = config.get("layers_pattern")
    if not patterns:  # PEFT's default: the number after any segment
        match = re.match(r".*?\.[^.]*\.(?P<layer_index>\d+)\.", module_name)
    else:  # the number after a segment the pattern names (PEFT tries each of a list in turn)
        patterns = [patterns] if isinstance(patterns, str) else patterns
        found = (_find(layer_regex(p), module_name, "layers_pattern", full=False) for p in patterns)
        match = next((m for m in found if m is not None), None)
    if match is None or match["layer_index"] is None:  # a pattern that closes the group: a branch without it
        return False
    idx = int(match["layer_index"])
    return idx == layers if isinstance(layers, int) else idx in layers


def is_targeted(config: dict, module_name: str) -> bool:
    """PEFT's `check_target_module_exists` for the options a LoRA adapter of ours can carry."""
    exclude = config.get("exclude_modules")
    if exclude:
        if isinstance(exclude, str):
            if _match(exclude, module_name, "exclude_modules", full=True):
                return False
        elif module_name in exclude or any(module_name.endswith(f".{e}") for e in exclude):
            return False
    targets = config.get("target_modules")
    if targets is None:
        return False
    if isinstance(targets, str):
        if targets.lower() == "all-linear":  # every Linear but the output layer
            return module_name.rsplit(".", 1)[-1] in PROJS
        return _match(targets, module_name, "target_modules", full=True)
    if module_name in targets:
        return True
    found = any(module_name.endswith(f".{t}") for t in targets)
    return found and _layer_selected(config, module_name)


def module_rank_alpha(config: dict, module_name: str,
                      keys: tuple[list[tuple[str, regex.Pattern]], list[tuple[str, regex.Pattern]]] | None = None
                      ) -> tuple[float, float]:
    """The rank and alpha of `module_name`. `keys`: `compiled_keys` of rank_pattern and alpha_pattern, when
    the caller asks for many modules (else compiled for this call)."""
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    if keys is None:
        keys = compiled_keys(rank_pattern, "rank_pattern"), compiled_keys(alpha_pattern, "alpha_pattern")
    r_key = pattern_key(keys[0], module_name)
    a_key = pattern_key(keys[1], module_name)
    r = rank_pattern[r_key] if r_key is not None else config.get("r", 8)
    alpha = alpha_pattern[a_key] if a_key is not None else config.get("lora_alpha", 8)
    return r, alpha


def lora_scale(config: dict, r: float, alpha: float) -> float:
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r

"""The model's own sampling defaults, from its generation_config.json, for requests that leave them unset.

As vLLM does by default (`--generation-config auto`): a model published with, say, `temperature: 0.6,
top_p: 0.9` samples that way unless the request says otherwise. Only the keys present in the file count
(transformers' own defaults, such as top_k 50, do not); `do_sample` is not read, as vLLM does not.
`repetition_penalty` and `min_p` are defaults like the others. `max_new_tokens` is the `max_tokens` of a chat
request that sets none, still bounded by the context its prompt leaves (vLLM's `get_max_tokens`: the smallest of
the context left and the request's max_tokens, or this default when it sends none); completions keep their
default of 16, as vLLM's do, and a max_tokens the request sends is never lowered to it.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Range:
    """The values a request may ask for (openai_sampling.py parses them by it), so a model's default may be."""

    lo: float
    hi: float | None = None  # None: any finite number
    lo_open: bool = False
    whole: bool = False  # an integer

    def __contains__(self, value: object) -> bool:
        if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
            return False
        if self.whole and not float(value).is_integer():
            return False
        return (value > self.lo if self.lo_open else value >= self.lo) and (self.hi is None or value <= self.hi)


RANGES = {"temperature": Range(0.0, 2.0), "top_p": Range(0.0, 1.0, lo_open=True), "top_k": Range(0, whole=True),
          "repetition_penalty": Range(0.0, lo_open=True), "min_p": Range(0.0, 1.0)}
MAX_NEW_TOKENS = Range(1, whole=True)  # what generation_config.json's max_new_tokens may be, to count


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """What a request that does not set them samples with (OpenAI's defaults unless the model says)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    max_tokens: int | None = None  # chat: max_new_tokens (None: the context left after the prompt)

    def __post_init__(self) -> None:
        if any(getattr(self, name) not in allowed for name, allowed in RANGES.items()) or (
                self.max_tokens is not None and self.max_tokens not in MAX_NEW_TOKENS):
            raise ValueError(f"sampling defaults out of range: {self}")


def read_sampling_defaults(model_dir: Path) -> SamplingDefaults:
    """The defaults `model_dir/generation_config.json` sets (OpenAI's where it sets none, or no such file)."""
    path = model_dir / "generation_config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, NotADirectoryError):  # no file, or --model is not a directory (refused later)
        return SamplingDefaults()
    except (OSError, ValueError) as exc:
        log.warning("%s cannot be read (%s): OpenAI's sampling defaults apply", path, exc)
        return SamplingDefaults()
    if not isinstance(data, dict):
        log.warning("%s is not a JSON object: OpenAI's sampling defaults apply", path)
        return SamplingDefaults()
    found = {}
    for key, allowed in RANGES.items():
        value = data.get(key)
        if value is None:
            continue
        if value not in allowed:
            log.warning("%s: %s=%r is outside what requests may ask for; not applied", path, key, value)
            continue
        found[key] = int(value) if allowed.whole else float(value)
    max_new_tokens = data.get("max_new_tokens")
    if max_new_tokens in MAX_NEW_TOKENS:
        found["max_tokens"] = int(max_new_tokens)
    elif max_new_tokens is not None:
        log.warning("%s: max_new_tokens=%r is not a whole number >= 1; not applied", path, max_new_tokens)
    defaults = SamplingDefaults(**found)
    if found:
        log.info("sampling defaults from %s for requests that leave them unset: %s", path,
                 ", ".join(f"{k}={v}" for k, v in found.items()))
    return defaults

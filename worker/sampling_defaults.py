"""The model's own sampling defaults, from its generation_config.json, for requests that leave them unset.

As vLLM does by default (`--generation-config auto`): a model published with, say, `temperature: 0.6,
top_p: 0.9` samples that way unless the request says otherwise. Only the keys present in the file count
(transformers' own defaults, such as top_k 50, do not); `do_sample` is not read, as vLLM does not.
`repetition_penalty` and `min_p` are defaults like the others.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """What a request that does not set them samples with (OpenAI's defaults unless the model says)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off

    def __post_init__(self) -> None:
        if not (0.0 <= self.temperature <= 2.0 and 0.0 < self.top_p <= 1.0 and self.top_k >= 0
                and 0.0 < self.repetition_penalty < math.inf and 0.0 <= self.min_p <= 1.0):
            raise ValueError(f"sampling defaults out of range: {self}")


def read_sampling_defaults(model_dir: Path) -> SamplingDefaults:
    """The defaults `model_dir/generation_config.json` sets (OpenAI's where it sets none, or no such file)."""
    path = model_dir / "generation_config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return SamplingDefaults()
    except (OSError, ValueError) as exc:
        log.warning("%s cannot be read (%s): OpenAI's sampling defaults apply", path, exc)
        return SamplingDefaults()
    if not isinstance(data, dict):
        log.warning("%s is not a JSON object: OpenAI's sampling defaults apply", path)
        return SamplingDefaults()
    found = {}
    for key, kind, ok in (("temperature", float, lambda v: 0.0 <= v <= 2.0), ("top_p", float, lambda v: 0.0 < v <= 1.0),
                          ("top_k", int, lambda v: v >= 0),
                          ("repetition_penalty", float, lambda v: v > 0.0),
                          ("min_p", float, lambda v: 0.0 <= v <= 1.0)):  # fmt: skip
        value = data.get(key)
        if value is None:
            continue
        valid = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        if kind is int:
            valid = valid and float(value).is_integer()
        if not valid or not ok(value):
            log.warning("%s: %s=%r is outside what requests may ask for; not applied", path, key, value)
            continue
        found[key] = kind(value)
    defaults = SamplingDefaults(**found)
    if found:
        log.info("sampling defaults from %s for requests that leave them unset: %s", path,
                 ", ".join(f"{k}={v}" for k, v in found.items()))
    return defaults

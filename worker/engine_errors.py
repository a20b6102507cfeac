"""The engine's request errors, apart so that the scheduler can raise them without importing the engine."""

from __future__ import annotations


class EngineError(ValueError):
    """A request the engine cannot serve (bad prompt, unknown adapter, too long); the message says why."""


class UnknownAdapterError(EngineError):
    """The request names an adapter (version) that is not registered, e.g. one replaced meanwhile."""


class ContextLengthError(EngineError):
    """Prompt and max_tokens ask for more context than the engine can ever give the request: more than
    max_model_len, or than the KV pages its adapter and pinned adapters leave of the pool (kv_room.py).
    `prompt_alone`: the prompt itself is too long, whatever max_tokens (the error names the prompt);
    `min_tokens`: max_tokens was not given (lowered to fit) but the min_tokens asked do not fit (names those)."""

    def __init__(self, message: str, *, prompt_alone: bool = False, min_tokens: bool = False) -> None:
        super().__init__(message)
        self.prompt_alone = prompt_alone
        self.min_tokens = min_tokens


class CapacityError(RuntimeError):
    """A request got no room for max_stuck_steps steps with nothing running; what holds it (adapters being
    copied or replaced) may let go later. One that never fits fails with a ContextLengthError instead."""


def is_failure(exc: BaseException) -> bool:
    """An Exception, or a Rust library's panic (`tokenizers`, `safetensors`) raised through pyo3 as PanicException:
    a BaseException, not an Exception, that one malformed file can cause and that must fail only that file's use.
    Not an interrupt, an exit or a cancellation, which go on up."""
    return isinstance(exc, Exception) or type(exc).__name__ == "PanicException"

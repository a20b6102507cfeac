"""The engine's request errors, apart so that the scheduler can raise them without importing the engine."""

from __future__ import annotations


class EngineError(ValueError):
    """A request the engine cannot serve (bad prompt, unknown adapter, too long); the message says why."""


class UnknownAdapterError(EngineError):
    """The request names an adapter (version) that is not registered, e.g. one replaced meanwhile."""

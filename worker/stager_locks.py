"""KeyLocks: one asyncio lock per cache key, kept only while someone holds or waits on it, so that the
stager does not keep a lock for every adapter it ever staged."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class KeyLocks:
    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}  # key -> (lock, [holders and waiters])

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        """Hold `key`'s lock. The lock is counted before the first await and dropped when its count comes
        back to zero: whoever comes later either shares it with the others or is alone with a new one."""
        lock, users = self._locks.setdefault(key, (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if users[0] == 0:
                del self._locks[key]

    def __len__(self) -> int:
        return len(self._locks)

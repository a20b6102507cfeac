"""LocalReads: the stager's checks of local adapter folders (their files stat'ed, read and hashed), each on a
thread of its own. A folder on a mount that stopped answering holds only its own thread, never the threads
S3 stages, state reports or other folders' checks use; a check asked for again while one of the same folder
is running waits on that one, whatever digest it expects (a push repeated while the mount hangs starts no
second thread);
a waiter gives up after its time limit, the thread ending whenever the read returns (a daemon thread: it
does not keep the process from exiting)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from lorafleet.worker.tenant_folders import NO_FOLDERS, TenantFolders

T = TypeVar("T")


class LocalReads(Generic[T]):
    def __init__(self, read: Callable[[str, TenantFolders], T]) -> None:
        self._read = read
        self._flights: dict[tuple[str, TenantFolders], asyncio.Future] = {}

    def __len__(self) -> int:
        return len(self._flights)

    async def read(self, uri: str, timeout: float, folders: TenantFolders = NO_FOLDERS) -> T:
        """`read(uri, folders)`'s result (`folders`: the tenant's folders it must resolve in, see
        worker/tenant_folders.py), or TimeoutError naming the folder after `timeout` seconds. A read that has
        returned has left the map before its waiters resume: a waiter reading again joins a later read only."""
        key = (uri, folders)
        flight = self._flights.get(key)
        if flight is None:
            loop = asyncio.get_running_loop()
            flight = loop.create_future()
            threading.Thread(target=self._run, args=(loop, flight, key), name="stager-local-read",
                             daemon=True).start()
            self._flights[key] = flight
            flight.add_done_callback(functools.partial(forget_flight, self._flights, key))
        try:
            return await asyncio.wait_for(asyncio.shield(flight), timeout)
        except TimeoutError:
            raise TimeoutError(f"{uri}: reading the folder took over {timeout:g} s (a hung mount?)") from None

    def _run(self, loop: asyncio.AbstractEventLoop, flight: asyncio.Future, key: tuple[str, TenantFolders]) -> None:
        try:
            outcome = (self._read(*key), None)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiters
            outcome = (None, exc)
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits any more
            loop.call_soon_threadsafe(_settle, flight, *outcome)


def _settle(flight: asyncio.Future, result, exc: BaseException | None) -> None:
    if flight.done():
        return
    if exc is not None:
        flight.set_exception(exc)
    else:
        flight.set_result(result)


def forget_flight(flights: dict, key, flight: asyncio.Future) -> None:
    """A flight shared by its waiters has landed: it leaves `flights` (unless a later one took its key), and
    its exception counts as retrieved (every waiter may have gone)."""
    if flights.get(key) is flight:
        del flights[key]
    if not flight.cancelled():
        flight.exception()

"""A push in progress at the stager, and what it forwards to the engine.

A push reaches the engine in two steps (worker/stager.py): at once, with every version that needs no store
call, download or hashing (the copy already forwarded for that same source, or a cached copy of its sha256),
so that an edit that only changes weights, flags or the adapter set (a kill switch: a canary's weight turned
to 0, a canary or an adapter removed) is not held up by another adapter's download; then, every
FORWARD_EVERY_S while it stages (`stage_concurrency` versions at once), the versions staged since; then once its versions
are staged, if that changes what the engine has. Until then an adapter whose
new version is still being staged keeps what was forwarded for it, exactly as when the version cannot be
staged (`keep_stable`). A stager that has forwarded nothing yet first asks the engine what it holds (the
push an earlier stager sent it, or nothing: `EngineLink.adopt`) and takes that as forwarded; when the engine
cannot tell (it serves what no push gave it), the first step is left out and the push answered once staged.
A newer push takes over at once from one staging.

Running example: forwarded {sql: v1 + canary v2 at 20 %, chat: c1}; push {sql: v3 (not cached), chat: c1 +
canary c2 at 0 %, c2 cached}: at once {sql: v1 without its canary, chat: c1 + c2 at 0 %}; once v3 is in,
{sql: v3, chat: c1 + c2 at 0 %}.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from lorafleet.worker.directives import AdapterDirective, DesiredState, ReportedState, VersionRef
from lorafleet.worker.openai_protocol import APIError
from lorafleet.worker.push_gate import delivered_here, mark_delivered
from lorafleet.worker.staged_copy import Staged, has_origin
from lorafleet.worker.stager_engine import EngineStarting, refused_for_good
from lorafleet.worker.stager_plan import forwardable, version_refs
from lorafleet.worker.staging_errors import staging_error

if TYPE_CHECKING:
    from lorafleet.worker.stager import Stager
    from lorafleet.worker.stager_seed import SeedReport

log = logging.getLogger("lorafleet.stager")
Key = tuple[str, str]  # (adapter name, version)
FORWARD_EVERY_S = 2.0  # while a push stages, how often the versions staged since are forwarded
RETRY_FIRST_S, RETRY_LAST_S = 2.0, 60.0  # a starting engine's push that failed to reach it: tried again after


class StalePush(APIError):
    """409 to a push older than the one applied; answered with the current `report` and the reason."""

    def __init__(self, report: ReportedState) -> None:
        super().__init__(409, report.error or "stale generation", code="stale_generation")
        self.report = report


@dataclass(slots=True)
class Push:
    """One push: what its staging found so far. A newer push replaces the stager's view of it (its own
    errors and pending versions); what an older one still finds is written to its own objects only."""

    desired: DesiredState
    errors: dict[Key, str]  # its versions' staging failures (the previous push's until tried again)
    pending: dict[Key, str]  # versions not forwarded as the push says yet (-> their URI): to be staged, or staged since
    staged: dict[Key, Staged] = field(default_factory=dict)  # what its staging staged
    forwarded: bool = False  # the engine was sent this push already (its first step)
    at_once: bool = False  # its first step reached the engine (else a respond-async push is answered once staged)
    starting: bool = False  # its engine was starting (its model loading): answered at once, forwarded once it is up
    superseded: asyncio.Event = field(default_factory=asyncio.Event)  # set once a newer push begins


async def apply_push(stager: Stager, desired: DesiredState, *, seed: SeedReport | None = None,
                     begun: asyncio.Event | None = None) -> ReportedState:
    """Stager.apply: forward at once what needs no download (then set `begun`; when that step is left out, once
    the push ends), stage, forward the rest."""
    begun = begun or asyncio.Event()
    try:
        push = await _begin(stager, desired, seed)
        if push is None:  # the generation applied already
            return await stager.state()
        if push.at_once or push.starting:
            begun.set()
        await _stage(stager, push)
        return await _finish(stager, push)
    finally:
        begun.set()


async def _begin(stager: Stager, desired: DesiredState, seed: SeedReport | None) -> Push | None:
    async with stager.apply_lock:
        if seed is not None and stager.desired is not None and stager.seed_report is None:
            return None  # a push from elsewhere came while the seed pass staged: it rules (stager_seed.py)
        if desired.generation < stager.generation:
            state = await stager.state()
            state.error = f"generation {desired.generation} is older than the applied {stager.generation}; ignored"
            raise StalePush(state)
        if desired.generation == stager.generation and stager.desired is not None and stager.unsent != desired.generation:
            return None
        starting = stager.engine is not None and not stager.engine.known and await _adopt(stager) == "starting"
        now = {(a.name, ref.version): s for a in desired.adapters for ref in (a.stable, a.canary)
               if ref is not None and (s := ready_now(stager, a, ref)) is not None}
        uris = {(name, ref.version): ref.uri for name, ref in version_refs(desired)}
        errors = dict(seed.adapter_errors) if seed else {}
        errors |= {key: message for key, message in stager.errors.items() if key in uris}  # until tried again
        push = Push(desired, errors, {key: uri for key, uri in uris.items() if key not in now}, starting=starting)
        forwarded, staged = forwardable(desired, now, stager.forwarded, stager.staged)
        stager.holds.hold_replaced(stager.staged, staged)
        stager.forwarded, stager.errors, stager.staged, stager.pending = forwarded, errors, staged, push.pending
        stager.desired, stager.generation, stager.seed_report = desired, desired.generation, seed
        stager.superseded.set()  # the push staging until now stops waiting for its download
        stager.superseded = push.superseded
        try:
            push.at_once = await _forward(stager, push, forwarded, first=True)
        except BaseException:
            push.pending.clear()  # the push failed (the engine refused it): nothing of it is being staged
            raise
        return push


async def adopt_at_start(stager: Stager, timeout_s: float = 5.0) -> None:
    """A stager started beside an engine that runs (the sidecar restarted) takes what the engine holds as
    forwarded before it serves: the copies the engine was given are then held in the cache from the start, not
    only from the first push, while the seed or the engine's own stage requests download and trim. An engine
    that does not answer within `timeout_s` (starting: it holds nothing yet) is asked again at the first push."""
    if stager.engine is None:
        return
    async with stager.apply_lock:
        if stager.desired is None and not stager.engine.known:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(_adopt(stager), timeout_s)


async def _adopt(stager: Stager) -> str:
    """Take what the engine holds as forwarded, when it can tell (a stager that forwarded nothing yet): "known";
    else "starting" (its model loading), "serving" (adapters no push of a stager gave it: it serves already) or
    "unknown" (unreachable, or an engine without the route)."""
    try:
        state = await stager.engine.adopt()
    except EngineStarting as exc:
        log.info("%s: the push reaches it once it is up", exc)
        return "starting"
    except Exception as exc:  # as if it could not tell
        log.info("what the engine holds is not known (%s): the push reaches it once staged", exc)
        return "unknown"
    if state is None:
        log.info("the engine serves adapters no push of a stager gave it: the push reaches it once staged")
        stager.delivered = True  # it serves already: a pod made ready by what it serves stays so
        return "serving"
    stager.forwarded = state.by_name()
    stager.staged = {(a.name, ref.version): Staged(Path(ref.uri), ref.sha256, Path(ref.uri).parent == stager.cache.root)
                     for a in state.adapters for ref in (a.stable, a.canary) if ref is not None}  # fmt: skip
    # An earlier sidecar's whole push reached it (a generation alone may be a first push's part: still staging)
    stager.delivered = stager.delivered or (stager.engine.generation > 0 and delivered_here(stager.cache.root))
    return "known"


def ready_now(stager: Stager, a: AdapterDirective, ref: VersionRef) -> Staged | None:
    """The copy of `ref` that needs no store call, download or hashing: the one forwarded for this version to
    the same owner if it is of the same source (a cached copy of this URI's own bytes, of its sha256 when it
    has one; for a local folder the same one as in the last push), or a checked cached copy of its sha256
    that this URI's objects hashed to (from an allowed location)."""
    served, copy = stager.forwarded.get(a.name), stager.staged.get((a.name, ref.version))
    if served is not None and copy is not None and ref.version in served.versions and served.tenant == a.tenant:
        if stager.sources.is_s3(ref.uri):  # a cached copy of this URI's own bytes (its last, or one it held)
            own = stager.last_copy(ref.uri) == copy.path.name or (
                ref.sha256 is not None and has_origin(copy.path, ref.uri))
            same = copy.path.parent == stager.cache.root and ref.sha256 in (None, copy.sha256) and own
        else:
            last = stager.desired.by_name().get(a.name) if stager.desired is not None else None
            same = last is not None and ref in (last.stable, last.canary)
        if same:
            return copy
    if ref.sha256 is None or not stager.sources.is_s3(ref.uri) or ref.sha256 in stager.cache.unverified:
        return None
    try:
        stager.sources.check_s3(ref.uri)
    except Exception:  # refused when it is staged, with its reason
        return None
    # Protected before it is looked up (worker/disk_cache.py): a download thread's trim may run before the copy
    # is among the served ones.
    stager.holds.lease(ref.sha256)
    path = stager.copy_for(ref.sha256, ref.uri)  # another URI's copy: staged (downloaded and hashed) first
    return Staged(path, ref.sha256, cached=True) if path is not None else None


async def _stage(stager: Stager, push: Push) -> None:
    """Stage the push's versions, up to `stage_concurrency` at once, started in the push's order: the store's
    rules (worker/stager_store.py) hold per push. One push stages at a time; one that a newer push replaced
    stops at once, without waiting for the versions it is staging: those stages go on by themselves (a download
    in progress completes for whoever wants its copy, the newer push included), and the newer push does not
    wait behind them."""
    async with stager.staging_lock:
        # Until its copies are served (_finish) or a newer push stages: from the start, the copies it knows of
        # (a version's sha256, a URI's last copy), else an earlier version's download could trim them away.
        known = ((ref.sha256 or "").lower() or stager.last_copy(ref.uri) for _, ref in version_refs(push.desired))
        stager.holds.pushing = pushing = {k for k in known if k}
        push_start = time.monotonic()
        superseded = asyncio.ensure_future(push.superseded.wait())
        done = asyncio.Event()
        progressive = push.at_once or push.starting
        forwarder = asyncio.ensure_future(_forward_while_staging(stager, push, done)) if progressive else None
        todo = _staging_order(stager, push)[::-1]  # popped from the end
        running: dict[asyncio.Future, tuple[str, VersionRef]] = {}
        try:
            while (todo or running) and not push.superseded.is_set():
                while todo and len(running) < stager.config.stage_concurrency:
                    name, ref = todo.pop()
                    running[asyncio.ensure_future(stager.stage(ref.uri, ref.sha256, held=pushing, push_start=push_start,
                                                               folders=ref.folders))] = (name, ref)
                finished, _ = await asyncio.wait({*running, superseded}, return_when=asyncio.FIRST_COMPLETED)
                for staging in finished - {superseded}:
                    _note_staged(push, *running.pop(staging), staging, stager.staged)
        except BaseException:  # cancelled: the stager stops
            for staging in running:
                staging.cancel()
            if forwarder is not None:
                forwarder.cancel()
            raise
        finally:
            for staging in running:  # replaced by a newer push: they go on by themselves
                staging.add_done_callback(_retrieved)
            superseded.cancel()
            done.set()
            if forwarder is not None and not forwarder.done():
                await forwarder  # one forward at most: the push's own comes next (_finish)


def _staging_order(stager: Stager, push: Push) -> list[tuple[str, VersionRef]]:
    """The push's versions in its order, but those with a copy of their URI cached (a listing to check it is
    current, no download) first, and those whose staging failed last time (a download that timed out) last: one
    slow or broken adapter's retry, push after push, held up every version after it, other tenants' new ones too."""
    failed = set(push.errors)
    return sorted(version_refs(push.desired), key=lambda nr: ((nr[0], nr[1].version) in failed,
                                                               stager.last_copy(nr[1].uri) is None))


async def _forward_while_staging(stager: Stager, push: Push, done: asyncio.Event) -> None:
    """Every FORWARD_EVERY_S while the push stages, the versions staged since go to the engine: one staged
    early is served without waiting for the push's other downloads (another tenant's big adapter on a slow
    link). Only for a push whose first step reached the engine (it knows what the engine holds), or whose engine
    was starting: once it is up, what it holds is read and what is staged by then goes at once."""
    sent = 0
    if not push.at_once:
        if not await stager.engine.wait_started(done, stager.config.engine_start_wait_s):
            return  # staged before the engine was up: the push's own forward (_finish) waits for it
        async with stager.apply_lock:
            if stager.generation != push.desired.generation:
                return
            if not stager.engine.known:  # just started: it holds nothing, and this push's copies stay as they are
                with contextlib.suppress(Exception):
                    await stager.engine.adopt()
                if not stager.engine.holds(DesiredState(0)):
                    return  # it holds something after all: the push's own forward replaces it
        sent = -1  # what is staged by now goes at once
    while not done.is_set():
        if sent >= 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(done.wait(), FORWARD_EVERY_S)
        if done.is_set() or len(push.staged) == sent:
            continue
        sent = len(push.staged)
        async with stager.apply_lock:
            if stager.generation != push.desired.generation:
                return  # a newer push took over: it forwards its own
            forwarded, staged = forwardable(push.desired, push.staged, stager.forwarded, stager.staged)
            stager.holds.hold_replaced(stager.staged, staged)
            stager.forwarded, stager.staged = forwarded, staged
            try:
                await _forward(stager, push, forwarded, first=False)
            except Exception as exc:  # the push's own forward, once staged, tries again
                log.warning("forwarding the versions staged so far failed: %s", exc)


def _note_staged(push: Push, name: str, ref: VersionRef, staging: asyncio.Future, served: dict[Key, Staged]) -> None:
    """What staging `name`@`ref.version` gave: its copy, or its error. Files of another digest than the copy the
    engine serves for that version (`served`: re-uploaded under the same version) keep that copy, with an error:
    the engine fixes a version's weights while it holds it, and would refuse the version."""
    key = (name, ref.version)
    try:
        copy = staging.result()
    except Exception as exc:
        push.errors[key] = staging_error(exc, ref.uri).message
        push.pending.pop(key, None)
        log.warning("staging %s@%s failed: %s", name, ref.version, push.errors[key])
        return
    old = served.get(key)
    if old is None or None in (old.sha256, copy.sha256) or old.sha256 == copy.sha256:
        push.staged[key] = copy
        push.errors.pop(key, None)
        return
    push.staged[key] = old
    push.errors[key] = (f"{ref.uri} changed (its files hash to {copy.sha256[:12]}, the version served has "
                        f"{old.sha256[:12]}) though the version did not: a version's weights are fixed once served; "
                        f"publish the new files as a new version (this one keeps its weights)")
    log.warning("staging %s@%s: %s", name, ref.version, push.errors[key])


def _retrieved(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # nobody waits for it any more


async def _finish(stager: Stager, push: Push) -> ReportedState:
    """Forward what the push staged, unless a newer push took over (it forwards its own). The report and the
    cache's trim come after, without the lock: a hung engine report or a slow disk does not hold up the next
    push (its report may then be the newer push's, as when one took over). An engine still starting (its model
    loading) is waited for first, up to `engine_start_wait_s`, unless a newer push takes over meanwhile: a new
    pod's first push stages while its model loads and reaches the engine once it is up. Such a push (answered
    before it was applied) tries again, RETRY_FIRST_S then twice as long each time, when its forward fails before
    any push reached the engine, unless the engine refused it for good (a 4xx: a wrong token): nobody else
    would, as the operator sees a push it accepted."""
    delay = RETRY_FIRST_S
    while True:
        if stager.engine is not None and not stager.engine.known:  # one that took a forward has started
            await stager.engine.wait_started(push.superseded, stager.config.engine_start_wait_s)
        try:
            superseded = await _forward_staged(stager, push)
            break
        except Exception as exc:
            if stager.delivered or not push.starting or refused_for_good(exc) or push.superseded.is_set() \
                    or stager.generation != push.desired.generation:
                raise
            log.warning("push %d did not reach the engine (%s): trying again in %.0f s", push.desired.generation,
                        exc, delay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(push.superseded.wait(), delay)
            delay = min(2 * delay, RETRY_LAST_S)
    report = await stager.state()  # also lets go of the replaced versions the engine no longer holds
    if not superseded:
        await asyncio.to_thread(stager.cache.trim, stager.protected)
        stager.forget_uris()
    return report


async def _forward_staged(stager: Stager, push: Push) -> bool:
    """`_finish`'s forward; True: a newer push took over (nothing sent)."""
    async with stager.apply_lock:
        if stager.generation != push.desired.generation:
            return True
        forwarded, staged = forwardable(push.desired, push.staged, stager.forwarded, stager.staged)
        stager.holds.hold_replaced(stager.staged, staged)
        stager.forwarded, stager.staged, stager.holds.pushing = forwarded, staged, set()
        try:
            await _forward(stager, push, forwarded, first=False)
        finally:
            push.pending.clear()
        stager.delivered = True
        mark_delivered(stager.cache.root)
        return False


async def _forward(stager: Stager, push: Push, forwarded: dict[str, AdapterDirective], *, first: bool) -> bool:
    """Send the engine the push with `forwarded` as its adapters (the pool-wide settings go through as pushed).
    At once: unless it holds that already, or nothing was forwarded since the stager started (what the engine
    holds is not known: the push's staged set goes). Then: if that changes what it holds, and at least once
    per push (an engine that restarted holds nothing). False: nothing was sent, as what the engine holds is not
    known."""
    if stager.engine is None:
        return True
    state = replace(push.desired, adapters=list(forwarded.values()))
    if first and not stager.engine.known:
        # Its first step left out, the push is answered once staged, even with `Prefer: respond-async`: answered
        # at once, it would be reported as not applied (0) until staged, and the operator would push it again every
        # pass, each push taking over from the one staging, none reaching the engine before every download is in.
        # Answered once staged, the operator's push waits for it (up to its push timeout), once per stager start.
        return False
    if stager.engine.holds(state) and (first or push.forwarded):
        stager.engine.carries(push.desired.generation)
        stager.unsent = None
        return True
    try:
        await stager.engine.forward(state)
    except BaseException as exc:
        stager.unsent = push.desired.generation  # sent again with its generation, it is applied, not a no-op
        stager.unsent_why = str(exc) if isinstance(exc, Exception) else ""
        raise
    stager.unsent = None
    push.forwarded = True
    return True

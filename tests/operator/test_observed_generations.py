"""No status write lowers an object's status.observedGeneration: a pass's status is of the spec it read when it
began, and a newer generation's may have been written meanwhile."""

from __future__ import annotations

import asyncio
import logging
from itertools import pairwise

from lorafleet.operator.observed_generations import ObservedGenerations, object_key

from .test_handlers import (  # noqa: F401  (fixtures)
    NS,
    POOL,
    POOLS,
    adapter_body,
    cluster,
    create,
    eventually,
    patch,
    pod_body,
    running_operator,
    sidecars,
)


def pool_status(emulator) -> dict:
    return emulator.objects[POOLS, NS, "main"].get("status") or {}


def lowered(emulator) -> list[int]:
    """The pool's status.observedGeneration over its history, when it ever went back."""
    seen = [(v.get("status") or {}).get("observedGeneration") for v in emulator.objects[POOLS, NS, "main", :]]
    seen = [g for g in seen if g is not None]
    return seen if any(b < a for a, b in pairwise(seen)) else []


async def test_a_timer_pass_begun_before_an_edit_does_not_lower_the_observed_generation(cluster, sidecars,  # noqa: F811
                                                                                         caplog):
    """The pool's timer pass read its spec (generation 1) and waits for a slow sidecar; meanwhile the spec is
    edited to an invalid one (generation 2), whose status the update handler writes at once (there is no pass to
    run). The timer's pass, ending after, wrote its status of generation 1 over it: observedGeneration went back
    to 1 and Ready to True until the next tick."""
    caplog.set_level(logging.INFO, logger="lorafleet")
    emulator, url = cluster
    stager = sidecars[0]
    async with running_operator(url, request_timeout=30.0):  # a state read waits for the test, not a timeout
        await create(emulator, "pods", pod_body("worker-0", stager.port))
        await create(emulator, "lorapools", POOL)
        await eventually(lambda: pool_status(emulator)["readyWorkers"] == 1, "the pool's worker counted")
        # Its creation handled (a handler's pass held up too would hold up the edit's handler behind it).
        num_reads = stager.reads
        await eventually(lambda: stager.reads >= num_reads + 3, "timer passes since")
        stager.stall_reads = asyncio.Event()
        num_reads = stager.reads
        try:
            await eventually(lambda: stager.reads > num_reads, "a timer pass waiting for the sidecar's state")
            await patch(emulator, "lorapools", "main", {"metadata": {"generation": 2}, "spec": {"eviction": "fifo"}})
            await eventually(lambda: pool_status(emulator)["observedGeneration"] == 2, "the invalid spec's status")
        finally:
            stager.stall_reads.set()
        await eventually(lambda: lowered(emulator) or "not written over that of generation 2" in caplog.text, "the timer pass's status")
        assert lowered(emulator) == []
        ready = next(c for c in pool_status(emulator)["conditions"] if c["type"] == "Ready")
        assert (pool_status(emulator)["observedGeneration"], ready["reason"]) == (2, "InvalidSpec")


def test_a_status_of_an_older_generation_keeps_only_what_it_says_of_the_pods():
    observed = ObservedGenerations()
    key = object_key("lorapools", POOL)
    fresh = {"observedGeneration": 2, "readyWorkers": 1, "pushedPods": [], "pushing": []}
    assert observed.admit(key, fresh, {"observedGeneration": 1}) == fresh
    stale = {"observedGeneration": 1, "readyWorkers": 2, "pushedPods": [{"name": "w", "uid": "u"}], "pushing": ["w"]}
    assert observed.admit(key, stale, {}) == {"pushedPods": [{"name": "w", "uid": "u"}], "pushing": ["w"]}
    assert observed.admit(object_key("loraadapters", POOL), stale, {"observedGeneration": 3}) == {
        "pushedPods": [{"name": "w", "uid": "u"}], "pushing": ["w"]}  # the status as it is (another leader wrote it)
    assert observed.admit(key, fresh, {}) == fresh  # the same generation again
    observed.forget(key)  # deleted: one re-created under its name (another uid) starts again
    assert observed.admit(key, stale, {}) == stale


def test_a_pass_ending_after_its_object_is_gone_leaves_nothing_remembered():
    observed = ObservedGenerations(gone_kept=2)
    keys = [object_key("lorapools", {"metadata": {"namespace": "t", "name": "p", "uid": f"u{i}"}}) for i in range(3)]
    status = {"observedGeneration": 4, "readyWorkers": 1}
    for key in keys:
        assert observed.admit(key, status, {}) == status
    assert len(observed) == 3
    for key in keys:
        observed.forget(key)
    assert len(observed) == 0
    assert observed.admit(keys[2], status, {}) == status  # the pass that read the spec before the delete ends
    assert len(observed) == 0
    assert observed.admit(keys[0], status, {}) == status  # the oldest gone key is no longer kept: remembered again
    assert len(observed) == 1


async def test_a_pool_s_status_names_its_pods_pushing_while_its_spec_is_invalid(cluster, sidecars):  # noqa: F811
    """An invalid spec runs no pass, but a push made before the edit may still be in flight: status.pushing says
    so as it is, and no longer once the pod has answered (written from the last pass, it stayed as it was)."""
    emulator, url = cluster
    stager = sidecars[0]
    stager.stall = asyncio.Event()  # a push is applied, and answered once this is set
    try:
        async with running_operator(url):
            await create(emulator, "pods", pod_body("worker-0", stager.port))
            await create(emulator, "lorapools", POOL)
            await create(emulator, "loraadapters", adapter_body("sql"))
            await eventually(lambda: pool_status(emulator)["pushing"] == ["worker-0"], "the push in flight named")
            await patch(emulator, "lorapools", "main", {"metadata": {"generation": 2}, "spec": {"eviction": "fifo"}})
            await eventually(lambda: pool_status(emulator)["observedGeneration"] == 2, "the invalid spec's status")
            stager.stall.set()
            await eventually(lambda: pool_status(emulator)["pushing"] == [], "the answer seen by a timer's tick")
            assert pool_status(emulator)["observedGeneration"] == 2
    finally:
        stager.stall.set()

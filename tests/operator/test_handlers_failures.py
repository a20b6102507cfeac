"""The operator in-process (kopf + kmock + fake sidecars) when specs go bad or objects go away."""

from __future__ import annotations

import asyncio
import copy
import logging

import pytest

from .test_handlers import (  # noqa: F401  (fixtures)
    ADAPTERS,
    NS,
    POOL,
    POOLS,
    adapter_body,
    api,
    cluster,
    create,
    delete,
    eventually,
    gone,
    holds,
    operator,
    patch,
    pod_body,
    running_operator,
    sidecars,
    status,
)


async def start_pool(emulator, stagers) -> None:
    for i, s in enumerate(stagers):
        await create(emulator, "pods", pod_body(f"worker-{i}", s.port))
    await create(emulator, "lorapools", POOL)


def pool_gone(emulator, name: str = "main") -> bool:
    try:
        return emulator.objects[POOLS, NS, name].deleted
    except KeyError:
        return True


def conditions(st: dict) -> dict[str, str]:
    return {c["type"]: c["status"] for c in st["conditions"]}


async def test_a_bad_edit_keeps_the_serving_version(operator, sidecars):  # noqa: F811
    emulator = operator
    await start_pool(emulator, sidecars)
    await create(emulator, "loraadapters", adapter_body("sql"))
    await eventually(lambda: status(emulator, "sql")["phase"] == "Ready", "sql Ready")

    # Refused by reconcile (an older CRD let it through): a canary without a source.
    await patch(emulator, "loraadapters", "sql", {"metadata": {"generation": 2},
                                                  "spec": {"canary": {"version": "v2", "weight": 10}}})
    st = await eventually(lambda: status(emulator, "sql")["phase"] == "Failed" and status(emulator, "sql"), "Failed")
    assert st["message"].startswith("spec.canary.source:") and st["observedGeneration"] == 2
    assert all(holds(s, "sql") == {"v1"} for s in sidecars)  # the pass that said Failed pushed nothing else
    assert st["stableVersion"] == "v1" and st["ready"] == "2/2"

    # Unparsable: the same, with conditions and observedGeneration.
    await patch(emulator, "loraadapters", "sql", {"metadata": {"generation": 3},
                                                  "spec": {"canary": None, "source": {"uri": "http://x/a"}}})
    st = await eventually(lambda: status(emulator, "sql")["observedGeneration"] == 3 and status(emulator, "sql"),
                          "generation 3 observed")
    assert st["phase"] == "Failed" and st["message"].startswith("spec.source.uri:")
    assert conditions(st)["Ready"] == "False" and conditions(st)["Validated"] == "False"
    assert all(holds(s, "sql") == {"v1"} for s in sidecars)

    # Fixed: the new version rolls out.
    await patch(emulator, "loraadapters", "sql", {"metadata": {"generation": 4},
                                                  "spec": {"version": "v2", "source": {"uri": "s3://adapters/sql/v2/"}}})
    await eventually(lambda: status(emulator, "sql")["phase"] == "Ready"
                     and status(emulator, "sql")["stableVersion"] == "v2", "v2 Ready")
    assert all(holds(s, "sql") == {"v2"} for s in sidecars)


async def test_deleting_the_pool_then_a_pinned_adapter_leaves_nothing_on_the_workers(operator, sidecars):  # noqa: F811
    emulator = operator
    await start_pool(emulator, sidecars)
    await create(emulator, "loraadapters", adapter_body("sql", warm="all", pinned=True))
    await eventually(lambda: status(emulator, "sql")["phase"] == "Ready", "sql Ready")
    await delete(emulator, "lorapools", "main")
    # The pool's finalizer empties its workers before the pool goes.
    await eventually(lambda: pool_gone(emulator), "pool gone")
    assert all(s.state().adapters == [] for s in sidecars)
    await eventually(lambda: status(emulator, "sql")["phase"] == "Degraded", "sql Degraded")
    await delete(emulator, "loraadapters", "sql")
    await eventually(lambda: gone(emulator, "sql"), "sql gone")
    assert all(s.state().adapters == [] for s in sidecars)


async def test_a_malformed_adapter_fails_alone_and_an_unparsable_one_can_be_deleted(operator, sidecars):  # noqa: F811
    emulator = operator
    await start_pool(emulator, sidecars)
    await create(emulator, "loraadapters", adapter_body("bad", source={"uri": "s3://adapters/bad/v1/",
                                                                       "sha256": "ABCDEF"}))
    await create(emulator, "loraadapters", adapter_body("good"))
    await eventually(lambda: status(emulator, "good")["phase"] == "Ready", "good Ready")
    st = await eventually(lambda: status(emulator, "bad")["phase"] == "Failed" and status(emulator, "bad"),
                          "bad Failed")
    assert st["message"].startswith("spec.source.sha256:")
    await delete(emulator, "loraadapters", "bad")
    await eventually(lambda: gone(emulator, "bad"), "bad deleted")
    assert status(emulator, "good")["phase"] == "Ready"


async def test_an_invalid_pool_status_is_written_once(operator):  # noqa: F811
    emulator = operator
    body = copy.deepcopy(POOL)
    body["metadata"]["generation"] = 4
    body["spec"]["workerSelector"] = {"matchLabels": {}}  # past an older CRD
    await create(emulator, "lorapools", body)
    await eventually(lambda: emulator.objects[POOLS, NS, "main"]["status"], "status written")
    # The create handler and the drift timer's first tick both start from an empty status: one may stamp
    # the condition a second later than the other (however late a loaded machine runs that tick). What must not
    # happen is a rewrite after that: over ten drift ticks (interval 0.3 s) across three second boundaries,
    # at most those two stamps are seen.
    seen = []
    for _ in range(64):
        st = emulator.objects[POOLS, NS, "main"]["status"]
        [cond] = st["conditions"]
        if not seen or seen[-1] != cond:
            seen.append(cond)
        await asyncio.sleep(0.05)
    assert st["observedGeneration"] == 4
    assert cond["reason"] == "InvalidSpec" and cond["message"].startswith("spec.workerSelector")
    assert len(seen) <= 2, seen


async def test_a_version_that_failed_to_stage_is_retried(operator, sidecars):  # noqa: F811
    emulator = operator
    sidecars[0].unavailable.add(("sql", "v1"))  # e.g. the upload had not finished when the push came
    await start_pool(emulator, sidecars)
    await create(emulator, "loraadapters", adapter_body("sql"))
    st = await eventually(lambda: status(emulator, "sql")["phase"] == "Degraded" and status(emulator, "sql"),
                          "the failure shown")
    assert "worker-0: sql@v1: NoSuchKey" in st["message"]
    num_pushes = len(sidecars[0].pushes)
    sidecars[0].unavailable.clear()  # the object store has it now: only a re-push makes the stager try again
    await eventually(lambda: status(emulator, "sql")["phase"] == "Ready", "Ready after a retry")
    assert len(sidecars[0].pushes) > num_pushes


def pool_ready(emulator, name: str) -> dict:
    return next(c for c in emulator.objects[POOLS, NS, name]["status"]["conditions"] if c["type"] == "Ready")


async def test_an_invalid_pool_keeps_its_workers_from_a_later_pool(operator, sidecars):  # noqa: F811
    emulator = operator
    for i, s in enumerate(sidecars):
        await create(emulator, "pods", pod_body(f"worker-{i}", s.port))
    alpha = copy.deepcopy(POOL)
    alpha["metadata"]["name"] = "alpha"  # sorts before "main", and selects the same pods
    alpha["spec"]["eviction"] = "fifo"  # past an older CRD
    await create(emulator, "lorapools", alpha)
    held = await eventually(lambda: "still holds worker-0, worker-1" in pool_ready(emulator, "alpha")["message"]
                            and pool_ready(emulator, "alpha"), "alpha reports its claim")
    assert held["reason"] == "InvalidSpec" and held["message"].startswith("spec.eviction:")

    await create(emulator, "lorapools", POOL)
    await create(emulator, "loraadapters", adapter_body("sql"))
    ready = await eventually(lambda: "owned by LoRAPool 'alpha'" in pool_ready(emulator, "main")["message"]
                             and pool_ready(emulator, "main"), "main reports the conflict")
    assert ready["status"] == "False" and "worker-1 (owned by LoRAPool 'alpha')" in ready["message"]
    await eventually(lambda: status(emulator, "sql")["phase"] == "Pending", "sql has no worker")
    assert all(s.pushes == [] for s in sidecars)

    # Once "alpha" goes, "main" is the first pool by name that selects them.
    await delete(emulator, "lorapools", "alpha")
    await eventually(lambda: status(emulator, "sql")["phase"] == "Ready", "main serves sql")
    assert all(holds(s, "sql") == {"v1"} for s in sidecars)


async def test_a_re_created_worker_pod_gets_a_fresh_push(operator, sidecars):  # noqa: F811
    emulator = operator
    await start_pool(emulator, sidecars)
    await create(emulator, "loraadapters", adapter_body("sql"))
    await eventually(lambda: status(emulator, "sql")["phase"] == "Ready", "sql Ready")
    num_pushes = len(sidecars[1].pushes)
    await api(emulator, "DELETE", f"/api/v1/namespaces/{NS}/pods/worker-1", {})
    # The same name and sidecar (which still reports what the pod that is gone was pushed), another pod.
    again = pod_body("worker-1", sidecars[1].port)
    again["metadata"]["uid"] = "uid-worker-1-again"
    await create(emulator, "pods", again)
    await eventually(lambda: len(sidecars[1].pushes) > num_pushes, "a fresh push to the new worker-1")


async def test_deleting_a_pool_whose_spec_turned_invalid_empties_its_workers(operator, sidecars):  # noqa: F811
    emulator = operator
    await start_pool(emulator, sidecars)
    await create(emulator, "loraadapters", adapter_body("sql", warm="all", pinned=True))
    await eventually(lambda: status(emulator, "sql")["phase"] == "Ready", "sql Ready")
    await patch(emulator, "lorapools", "main", {"metadata": {"generation": 2}, "spec": {"eviction": "fifo"}})
    await eventually(lambda: pool_ready(emulator, "main")["reason"] == "InvalidSpec", "the bad spec seen")
    assert all(holds(s, "sql") == {"v1"} for s in sidecars)  # an invalid pool leaves its workers as they are
    # Its workerSelector is valid: the finalizer drains the pods it selects, as for a valid pool.
    await delete(emulator, "lorapools", "main")
    await eventually(lambda: pool_gone(emulator), "pool gone")
    assert all(s.state().adapters == [] for s in sidecars)


async def test_a_pool_deleted_with_an_invalid_selector_after_a_restart_empties_the_pods_it_pushed_to(
        cluster, sidecars, caplog):  # noqa: F811
    """Its workerSelector went bad while no operator ran: the new one knows neither what it selected nor what it
    pushed, but its status.pushedPods names its workers, and its finalizer empties them. A pool that names no
    pod ("spare", which never pushed to one) goes at once, and the operator says its workers are unknown."""
    caplog.set_level(logging.WARNING, logger="kopf.objects")
    emulator, url = cluster
    spare = copy.deepcopy(POOL)
    spare["metadata"]["name"] = "spare"
    spare["spec"]["workerSelector"] = {"matchLabels": {"slot": "none"}}
    async with running_operator(url):
        await start_pool(emulator, sidecars)
        await create(emulator, "lorapools", spare)
        await create(emulator, "loraadapters", adapter_body("sql", warm="all", pinned=True))
        await eventually(lambda: len(emulator.objects[POOLS, NS, "main"]["status"]["pushedPods"]) == 2
                         and emulator.objects[POOLS, NS, "spare"]["status"]["pushedPods"] == [], "pushedPods written")
    lost = {"metadata": {"generation": 2}, "spec": {"workerSelector": {"matchLabels": {"tier": 7}}}}
    for name in ("main", "spare"):
        await patch(emulator, "lorapools", name, lost)
    async with running_operator(url):
        await eventually(lambda: pool_ready(emulator, "main")["reason"] == "InvalidSpec", "the bad spec seen")
        assert all(holds(s, "sql") == {"v1"} for s in sidecars)
        await delete(emulator, "lorapools", "main")
        await eventually(lambda: pool_gone(emulator), "pool gone")
        assert all(s.state().adapters == [] for s in sidecars)
        await delete(emulator, "lorapools", "spare")
        await eventually(lambda: pool_gone(emulator, "spare"), "spare gone")
    assert any("no pod it pushed to is known" in r.getMessage() for r in caplog.records)


async def test_a_pod_the_pool_stops_selecting_is_emptied(operator, sidecars):  # noqa: F811
    """The pool's workerSelector narrows to worker-1: worker-0, which no pool selects now, gets an empty push
    (its pinned adapter included), and a deleted adapter's finalizer waits until it reports nothing."""
    emulator = operator
    for i, s in enumerate(sidecars):
        pod = pod_body(f"worker-{i}", s.port)
        pod["metadata"]["labels"]["slot"] = str(i)
        await create(emulator, "pods", pod)
    await create(emulator, "lorapools", POOL)
    await create(emulator, "loraadapters", adapter_body("sql", warm="all", pinned=True))
    await create(emulator, "loraadapters", adapter_body("chat", warm="all"))
    await eventually(lambda: status(emulator, "sql")["phase"] == "Ready"
                     and status(emulator, "chat")["phase"] == "Ready", "both Ready")

    await patch(emulator, "lorapools", "main", {"metadata": {"generation": 2},
                                                "spec": {"workerSelector": {"matchLabels": {"slot": "1"}}}})
    await delete(emulator, "loraadapters", "chat")
    await eventually(lambda: sidecars[0].pushes[-1].adapters == [] and sidecars[0].state().adapters == [],
                     "worker-0 told to hold nothing")
    await eventually(lambda: gone(emulator, "chat"), "chat deleted")
    assert all(holds(s, "chat") == set() for s in sidecars)
    st = await eventually(lambda: status(emulator, "sql")["ready"] == "1/1" and status(emulator, "sql"),
                          "sql served by worker-1 alone")
    assert st["phase"] == "Ready" and [i["pod"] for i in st["instances"]] == ["worker-1"]
    assert holds(sidecars[1], "sql") == {"v1"} and sidecars[0].state().adapters == []


@pytest.mark.parametrize("pool_invalid", [False, True])
async def test_a_canary_rollback_reaches_the_workers_of_a_pool_whose_spec_is_invalid(
        operator, sidecars, pool_invalid):  # noqa: F811
    """A typo in the pool (spec.eviction) must not keep a canary being rolled back (weight 0) serving at 50 %:
    the pool's pods, told nothing else while its spec is invalid, take the cut, as they would with the pool
    valid."""
    emulator = operator
    await start_pool(emulator, sidecars)
    canary = {"version": "v2", "source": {"uri": "s3://adapters/sql/v2/"}, "weight": 50}
    await create(emulator, "loraadapters", adapter_body("sql", canary=canary))

    def weights() -> set[int]:
        return {d.canary_weight for s in sidecars if s.applied for d in s.applied.adapters if d.name == "sql"}

    await eventually(lambda: all(s.applied for s in sidecars) and weights() == {50}, "canary at 50 % everywhere")
    if pool_invalid:
        await patch(emulator, "lorapools", "main", {"metadata": {"generation": 2}, "spec": {"eviction": "fifo"}})
        await eventually(lambda: pool_ready(emulator, "main")["reason"] == "InvalidSpec", "the bad pool spec seen")

    await patch(emulator, "loraadapters", "sql", {"metadata": {"generation": 2}, "spec": {"canary": {"weight": 0}}})
    await eventually(lambda: weights() == {0}, "the rollback applied on every worker")
    assert all(holds(s, "sql") == {"v1", "v2"} for s in sidecars)  # the versions as they were


@pytest.mark.parametrize("edit", ["promoted", "removed"])
async def test_status_canary_bytes_go_with_the_canary(operator, sidecars, edit):  # noqa: F811
    """status.canaryBytes (the canary's size, remembered for the tenant quota) is removed once the spec has no
    canary (promoted, or removed): it would otherwise stand for ever beside a spec without one."""
    emulator = operator
    await start_pool(emulator, sidecars)
    canary = {"version": "v2", "source": {"uri": "s3://adapters/sql/v2/"}, "weight": 20}
    await create(emulator, "loraadapters", adapter_body("sql", canary=canary))
    await eventually(lambda: status(emulator, "sql").get("canaryBytes", {}).get("version") == "v2",
                     "status.canaryBytes written")
    change = ({"version": "v2", "source": {"uri": "s3://adapters/sql/v2/"}, "canary": None} if edit == "promoted"
              else {"canary": None})
    await patch(emulator, "loraadapters", "sql", {"metadata": {"generation": 2}, "spec": change})
    stable = "v2" if edit == "promoted" else "v1"
    st = await eventually(lambda: status(emulator, "sql")["observedGeneration"] == 2
                          and status(emulator, "sql")["phase"] == "Ready"
                          and status(emulator, "sql")["stableVersion"] == stable
                          and status(emulator, "sql").get("canaryVersion") is None and status(emulator, "sql"),
                          "the edit applied")
    assert "canaryBytes" not in st, st


async def test_an_invalid_pool_s_status_keeps_no_counts_of_its_last_valid_spec(operator, sidecars):  # noqa: F811
    """readyWorkers, adapters and kvUsage are counted by a valid pool's passes: once its spec turns invalid they
    are removed, not left as the last valid pass counted them for as long as the spec stays invalid; a fixed
    spec counts them again."""
    emulator = operator
    await start_pool(emulator, sidecars)
    await create(emulator, "loraadapters", adapter_body("sql"))
    counted = ("readyWorkers", "adapters", "kvUsage")

    def pool_status() -> dict:
        return emulator.objects[POOLS, NS, "main"]["status"]

    await eventually(lambda: pool_status()["readyWorkers"] == 2 and pool_status()["adapters"] == 1, "counted")
    await patch(emulator, "lorapools", "main", {"metadata": {"generation": 2}, "spec": {"eviction": "fifo"}})
    st = await eventually(lambda: pool_ready(emulator, "main")["reason"] == "InvalidSpec" and pool_status(),
                          "the bad pool spec seen")
    assert not set(counted) & st.keys(), st
    await patch(emulator, "lorapools", "main", {"metadata": {"generation": 3}, "spec": {"eviction": "lru"}})
    await eventually(lambda: pool_status()["observedGeneration"] == 3 and pool_status()["readyWorkers"] == 2
                     and pool_status()["adapters"] == 1 and "kvUsage" in pool_status(), "counted again")

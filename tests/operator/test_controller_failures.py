"""One pass of PoolController when things go wrong: sidecars that stop answering while an adapter or the pool
is deleted, or that refuse the adapter set."""

from __future__ import annotations

import contextlib

import pytest

from lorafleet.operator.controller import QUIET_GRACE_S, PoolController
from lorafleet.operator.workers import Refused, StagerClient
from lorafleet.worker import stager_http
from lorafleet.worker.stager_config import StagerConfig
from lorafleet.worker.stager_http import create_app

from .fake_stager import FakeStager
from .local_http import start_app
from .test_controller import KEY
from .test_handlers import POOL, TOKEN, adapter_body, pod_body

DELETED = "2026-01-01T00:00:00Z"


def deleted(body: dict) -> dict:
    return {**body, "metadata": {**body["metadata"], "deletionTimestamp": DELETED}}


@pytest.fixture()
async def sidecars():
    async with FakeStager(TOKEN) as first, FakeStager(TOKEN) as second:
        yield first, second


async def test_a_finalizer_waits_for_a_pod_whose_sidecar_does_not_answer(sidecars):
    """worker-1's sidecar stops answering (the pod stays Ready) while an adapter, then the pool, is deleted:
    it may still serve them, so neither finalizer may go until it answers and is emptied. A pod whose last
    accepted push already left the adapter out is not waited for."""
    stager, silent = sidecars
    controller = PoolController(StagerClient(token=TOKEN, timeout=2.0))
    pods = [pod_body("worker-0", stager.port), pod_body("worker-1", silent.port)]
    sql, chat = adapter_body("sql", warm="all"), adapter_body("chat", warm="all")
    try:
        await controller.run(KEY, pools=[POOL], adapters=[sql, chat], pods=pods)
        assert all({d.name for d in s.applied.adapters} == {"sql", "chat"} for s in sidecars)
        await silent.stop()
        inputs = {"pools": [POOL], "adapters": [sql, deleted(chat)], "pods": pods}
        plan = await controller.run(KEY, **inputs)
        assert plan.unloading == {"chat": ["worker-0", "worker-1"]} and plan.silent == ["worker-1"]
        plan = await controller.run(KEY, **inputs)
        assert plan.unloading == {"chat": ["worker-1"]}  # worker-0 unloaded it; worker-1 may still serve it
        await silent.start()  # the same pod answers again (on another port: its address changed)
        pods[1] = pod_body("worker-1", silent.port)
        silent.applied = stager.pushes[0]  # what it held when it stopped answering
        plan = await controller.run(KEY, **inputs)
        assert plan.unloading == {"chat": ["worker-1"]} and [d.name for d in silent.applied.adapters] == ["sql"]
        assert (await controller.run(KEY, **inputs)).unloading == {"chat": []}

        await silent.stop()  # known to hold sql only: a deleting chat does not wait for it
        assert (await controller.run(KEY, **inputs)).unloading == {"chat": []}
        plan = await controller.run(KEY, pools=[deleted(POOL)], adapters=[sql], pods=pods)
        assert plan.draining == ["worker-0", "worker-1"] and plan.silent == ["worker-1"]
        plan = await controller.run(KEY, pools=[deleted(POOL)], adapters=[sql], pods=pods)
        assert plan.draining == ["worker-1"] and stager.applied.adapters == []
    finally:
        await controller.client.close()


class RefusingClient(StagerClient):
    """Refuses the next ``refusals`` pushes without sending them (a sidecar answering 503 while it restarts)."""

    def __init__(self, refusals: int, **kw) -> None:
        super().__init__(**kw)
        self.refusals = refusals

    async def push(self, worker, desired):
        if self.refusals:
            self.refusals -= 1
            return Refused(503, "restarting")
        return await super().push(worker, desired)


async def test_an_adapter_deleted_while_the_pool_spec_is_invalid_survives_a_refused_push(sidecars):
    """An invalid pool's pod is told what it last accepted less the deleting adapter; a push it refuses is
    told again on the next pass (not taken as a pod whose set is unknown, which only a fixed spec unblocks)."""
    stager, _ = sidecars
    pods = [pod_body("worker-0", stager.port)]
    sql, chat = adapter_body("sql"), adapter_body("chat")
    invalid = {**POOL, "spec": {**POOL["spec"], "eviction": "fifo"}}
    controller = PoolController(RefusingClient(0, token=TOKEN, timeout=2.0))
    try:
        await controller.run(KEY, pools=[POOL], adapters=[sql, chat], pods=pods)
        controller.client.refusals = 1
        plan = await controller.run(KEY, pools=[invalid], adapters=[sql, deleted(chat)], pods=pods)
        assert set(plan.pushes) == {"worker-0"} and {d.name for d in stager.applied.adapters} == {"sql", "chat"}
        plan = await controller.run(KEY, pools=[invalid], adapters=[sql, deleted(chat)], pods=pods)
        assert set(plan.pushes) == {"worker-0"} and plan.unreachable == []
        assert [d.name for d in stager.applied.adapters] == ["sql"]
        plan = await controller.run(KEY, pools=[invalid], adapters=[sql, deleted(chat)], pods=pods)
        assert plan.pushes == {} and plan.unloading == {"chat": []}
    finally:
        await controller.client.close()


async def test_a_replica_leading_again_re_pushes_what_another_operator_changed(sidecars):
    """Replica A pushes, stands by while B leads and pushes an edit, then leads again after the edit was
    reverted: A's memory matches the reverted spec, but the pod applied B's later generation, so what it
    holds is not what A remembers. The edit here is the tenant: no report shows it."""
    stager, _ = sidecars
    pods = [pod_body("worker-0", stager.port)]
    first = PoolController(StagerClient(token=TOKEN, timeout=2.0))
    second = PoolController(StagerClient(token=TOKEN, timeout=2.0))
    try:
        await first.run(KEY, pools=[POOL], adapters=[adapter_body("sql")], pods=pods)
        await second.run(KEY, pools=[POOL], adapters=[adapter_body("sql", tenant="globex")], pods=pods)
        assert stager.applied.by_name()["sql"].tenant == "globex"
        plan = await first.run(KEY, pools=[POOL], adapters=[adapter_body("sql")], pods=pods)
        assert set(plan.pushes) == {"worker-0"} and stager.applied.by_name()["sql"].tenant == "acme"
        assert (await first.run(KEY, pools=[POOL], adapters=[adapter_body("sql")], pods=pods)).pushes == {}
    finally:
        await first.client.close()
        await second.client.close()


async def test_another_pool_whose_spec_has_a_malformed_block_is_only_an_invalid_pool(sidecars):
    """"alpha" (past an older CRD: tenantQuota is not an object) is an invalid pool holding the pods it selects;
    it does not break "main"'s pass."""
    stager, _ = sidecars
    alpha = {**POOL, "metadata": {**POOL["metadata"], "name": "alpha"},
             "spec": {**POOL["spec"], "workerSelector": {"matchLabels": {"gpu": "h200"}}, "tenantQuota": 3}}
    controller = PoolController(StagerClient(token=TOKEN, timeout=2.0))
    try:
        plan = await controller.run(KEY, pools=[POOL], adapters=[adapter_body("sql")],
                                    pods=[pod_body("worker-0", stager.port)], other_pools=[alpha])
        assert set(plan.pushes) == {"worker-0"} and [d.name for d in stager.applied.adapters] == ["sql"]
    finally:
        await controller.client.close()


@contextlib.asynccontextmanager
async def real_stager(tmp_path):
    """The worker's stager sidecar itself (no engine, no reachable store), served for the block: its port."""
    config = StagerConfig(stager_token=TOKEN, stager_cache_dir=str(tmp_path / "cache"), s3_allow=["adapters/"],
                          s3_endpoint="127.0.0.1:9", s3_secure=False, store_check_timeout_s=0.2)
    runner, port = await start_app(create_app(config))
    try:
        yield port
    finally:
        await runner.cleanup()


async def test_a_sidecar_refusing_the_adapter_set_makes_the_pool_not_ready_naming_why(tmp_path, monkeypatch):
    """A pool grown past what its sidecars take in one push (413) was pushed again every pass and refused
    every time, while its Ready condition said True: only the operator's log told."""
    controller = PoolController(StagerClient(token=TOKEN, timeout=5.0))
    inputs = {"pools": [POOL], "adapters": [adapter_body("sql")]}
    try:
        monkeypatch.setattr(stager_http, "MAX_STATE_BYTES", 64)
        async with real_stager(tmp_path / "small") as port:
            plan = await controller.run(KEY, **inputs, pods=[pod_body("worker-0", port)])
            ready = plan.pool_status["conditions"][0]
            assert (ready["type"], ready["status"], ready["reason"]) == ("Ready", "False", "PushRefused")
            assert ready["message"].endswith("the sidecar of worker-0 refused its adapter set (HTTP 413: request "
                                             "body over 64 bytes, the most a desired state may take; split the "
                                             "pool's adapters over more pools)")
            assert set((await controller.run(KEY, **inputs, pods=[pod_body("worker-0", port)])).pushes) == {
                "worker-0"}  # told again every pass
        monkeypatch.undo()
        async with real_stager(tmp_path / "large") as port:
            plan = await controller.run(KEY, **inputs, pods=[pod_body("worker-0", port)])
            assert set(plan.pushes) == {"worker-0"}
            assert plan.pool_status["conditions"][0]["reason"] != "PushRefused"
    finally:
        await controller.client.close()


async def test_a_sidecar_silent_for_less_than_the_grace_keeps_its_warm_copies(sidecars):
    """A missed state read (a timeout) must not move that pod's warm copies to the others and back: its last
    answer stands in for QUIET_GRACE_S, after which they are placed on the pods that answer."""
    first, second = sidecars
    clock = [1000.0]
    controller = PoolController(StagerClient(token=TOKEN, timeout=2.0), clock=lambda: clock[0])
    pods = [pod_body("worker-0", first.port), pod_body("worker-1", second.port)]
    inputs = {"pools": [POOL], "adapters": [adapter_body("sql", warm=1), adapter_body("chat", warm=1)], "pods": pods}
    try:
        steady = (await controller.run(KEY, **inputs)).placement
        assert sorted(pods for pods in steady.values()) == [["worker-0"], ["worker-1"]]
        await second.stop()
        clock[0] += QUIET_GRACE_S - 1
        plan = await controller.run(KEY, **inputs)
        assert plan.silent == ["worker-1"] and plan.placement == steady and plan.pushes == {}
        clock[0] += 1
        plan = await controller.run(KEY, **inputs)
        assert plan.placement == {"sql": ["worker-0"], "chat": ["worker-0"]} and set(plan.pushes) == {"worker-0"}
    finally:
        await controller.client.close()


class ScriptedPushes(StagerClient):
    """States read from the real sidecar; each push answered by the next outcome of the pod's script."""

    def __init__(self, scripts: dict[str, list], **kw) -> None:
        super().__init__(**kw)
        self.scripts = scripts

    async def push(self, worker, desired):
        return self.scripts[worker.url].pop(0)


async def test_a_refusal_stands_until_the_pod_accepts_or_reads_a_set_and_is_the_pool_s_own(sidecars):
    """Ready says PushRefused while the pod's last answer to a push was a refusal: a push left unanswered does
    not flip it back, a 409 (the set was read, only its generation was stale) or an accepted push ends it, and
    another pool's pod of the same name (another namespace) changes nothing."""
    stager, _ = sidecars
    url = f"http://127.0.0.1:{stager.port}"
    other_ns = {**POOL, "metadata": {**POOL["metadata"], "namespace": "other"}}
    other_pod = pod_body("worker-0", stager.port)
    other_pod["metadata"]["namespace"] = "other"
    client = ScriptedPushes({url: [Refused(413, "too big"), True, None, Refused(409, "stale"), True]},
                            token=TOKEN, timeout=2.0)
    controller = PoolController(client)

    def reason(plan):
        return plan.pool_status["conditions"][0]["reason"]

    try:
        adapters, pods = [adapter_body("sql")], [pod_body("worker-0", stager.port)]
        assert reason(await controller.run(KEY, pools=[POOL], adapters=adapters, pods=pods)) == "PushRefused"
        plan = await controller.run(("other", "main"), pools=[other_ns], adapters=[], pods=[other_pod])
        assert reason(plan) != "PushRefused"  # accepted there
        assert reason(await controller.run(KEY, pools=[POOL], adapters=adapters, pods=pods)) == "PushRefused"
        assert reason(await controller.run(KEY, pools=[POOL], adapters=adapters, pods=pods)) == "Workers"
    finally:
        await controller.client.close()

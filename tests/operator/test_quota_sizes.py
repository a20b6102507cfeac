"""A version refused over the tenant's byte quota once staged stays out after the workers dropped it: its size is
remembered (status.refusedBytes, status.canaryBytes, and the controller's memory until the status is read back),
so it is not admitted, pushed and downloaded again every other pass."""

from __future__ import annotations

import copy

from lorafleet.operator.controller import PoolController
from lorafleet.operator.crd_models import parse_adapter
from lorafleet.operator.reconcile import reconcile_pool
from lorafleet.operator.workers import StagerClient
from lorafleet.worker.directives import AdapterState, ReportedState

from .fake_stager import ADAPTER_BYTES, FakeStager
from .test_handlers import NS, POOL, TOKEN, adapter_body, pod_body
from .test_reconcile import MB, NOW, converge, pool, workers
from .test_reconcile_failures import body


def holds(plan, name: str) -> bool:
    return any(name in desired.by_name() for desired in plan.desired.values())


def report_sizes(ws, plan, sizes: dict[tuple[str, str], int]) -> None:
    """Each worker applied its desired state and reports (name, version) at the sizes given."""
    for w in ws:
        w.last_pushed = plan.desired[w.pod]
        w.reported = ReportedState(generation_applied=w.last_pushed.generation, adapters=[
            AdapterState(name, version, "disk", bytes=size) for (name, version), size in sizes.items()])


def test_a_new_adapter_refused_once_staged_stays_out_until_its_version_or_the_quota_changes():
    ws = workers(1)
    q = pool(tenantQuota={"maxBytes": 6 * MB})
    a = parse_adapter(body("a", warm=0, status={"bytes": 4 * MB}))
    converge(q, [a], ws, bytes_of={"a": 4 * MB})
    # b's size is not known yet: admitted, pushed, staged at 4 MiB, then refused (8 MiB > 6 MiB).
    b = parse_adapter(body("b", warm=0, created="2026-01-01T00:00:01Z"))
    plan = reconcile_pool(q, [a, b], ws, now=NOW)
    assert holds(plan, "b")
    report_sizes(ws, plan, {("a", "v1"): 4 * MB, ("b", "v1"): 4 * MB})
    plan = reconcile_pool(q, [a, b], ws, now=NOW)
    st = plan.adapter_statuses["b"]
    assert not holds(plan, "b") and st["phase"] == "Failed" and st["message"].startswith("spec.tenant:")
    assert st["refusedBytes"] == {"version": "v1", "bytes": 4 * MB}

    # The workers dropped b: its status keeps it out (before, it came back Loading and was downloaded again).
    report_sizes(ws, plan, {("a", "v1"): 4 * MB})
    b = parse_adapter(body("b", warm=0, created="2026-01-01T00:00:01Z", status=st))
    plan = reconcile_pool(q, [a, b], ws, now=NOW)
    assert not holds(plan, "b") and plan.pushes == {} and plan.adapter_statuses["b"]["phase"] == "Failed"
    # Another version is another size: tried again. So is the same one under a larger quota.
    other = parse_adapter(body("b", version="v2", warm=0, created="2026-01-01T00:00:01Z", status=st))
    assert holds(reconcile_pool(q, [a, other], ws, now=NOW), "b")
    assert holds(reconcile_pool(pool(tenantQuota={"maxBytes": 8 * MB}), [a, b], ws, now=NOW), "b")


def test_an_edit_that_grows_past_the_quota_stays_refused_after_the_workers_dropped_it():
    """The last valid spec keeps serving; the edit's version, its size known, is not pushed again."""
    ws = workers(1)
    q = pool(tenantQuota={"maxBytes": 3 * MB})
    plan = converge(q, [parse_adapter(body(warm=0))], ws)
    st = plan.adapter_statuses["a"]
    edit = parse_adapter(body(version="v2", warm=0, generation=4, status=st))
    plan = reconcile_pool(q, [edit], ws, now=NOW)
    assert plan.desired["w0"].by_name()["a"].stable.version == "v2"  # its size not known until staged
    report_sizes(ws, plan, {("a", "v2"): 5 * MB})
    plan = reconcile_pool(q, [edit], ws, now=NOW)
    assert plan.desired["w0"].by_name()["a"].stable.version == "v1"
    st = {**st, **plan.adapter_statuses["a"]}  # a merge patch: lastValidSpec stays
    assert st["phase"] == "Failed" and st["refusedBytes"] == {"version": "v2", "bytes": 5 * MB}
    report_sizes(ws, plan, {("a", "v1"): MB})
    plan = reconcile_pool(q, [parse_adapter(body(version="v2", warm=0, generation=4, status=st))], ws, now=NOW)
    assert plan.desired["w0"].by_name()["a"].stable.version == "v1" and plan.pushes == {}
    assert plan.adapter_statuses["a"]["phase"] == "Failed"


async def test_a_pass_reading_the_adapter_before_its_refusal_came_back_does_not_push_it_again():
    """The operator's indexes lag behind its status writes: a pass may read the refused adapter with the status
    from before the refusal. The sizes the workers reported are remembered meanwhile."""
    pool_body = copy.deepcopy(POOL)
    pool_body["spec"]["tenantQuota"] = {"maxBytes": ADAPTER_BYTES + ADAPTER_BYTES // 2}
    first = adapter_body("a", warm=0)
    first["status"] = {"bytes": ADAPTER_BYTES}
    late = adapter_body("b", warm=0)
    late["metadata"]["creationTimestamp"] = "2999-01-01T00:00:00Z"  # after a: the one refused
    async with FakeStager(TOKEN) as stager:
        controller = PoolController(StagerClient(token=TOKEN, timeout=2.0))
        inputs = {"pools": [pool_body], "adapters": [first, late], "pods": [pod_body("worker-0", stager.port)]}
        try:
            await controller.run(KEY, **inputs)  # b's size not known yet: pushed
            assert "b" in stager.applied.by_name()
            plan = await controller.run(KEY, **inputs)  # staged at ADAPTER_BYTES: over the quota, withdrawn
            assert "b" not in stager.applied.by_name() and plan.adapter_statuses["b"]["phase"] == "Failed"
            num_pushes = len(stager.pushes)
            for _ in range(2):  # the same bodies, b's status still empty
                plan = await controller.run(KEY, **inputs)
                assert plan.pushes == {} and plan.adapter_statuses["b"]["phase"] == "Failed"
            assert len(stager.pushes) == num_pushes
        finally:
            await controller.client.close()


KEY = (NS, "main")


def _served(plan) -> str | None:
    desired = plan.desired["w0"].by_name().get("a")
    return desired.stable.version if desired is not None else None


def test_an_edit_that_grows_past_the_quota_falls_back_with_each_status_written_back():
    """As kopf writes each pass's status (a merge patch) and the next pass reads it: the edit, admitted while its
    size is unknown, does not become the last valid spec, so once staged over the quota v1 serves again
    (before, v2 had replaced v1 as the last valid spec, and the adapter was dropped altogether)."""
    ws, q = workers(1), pool(tenantQuota={"maxBytes": 3 * MB})
    plan = converge(q, [parse_adapter(body(warm=0))], ws, bytes_of={"a": MB})
    status = dict(plan.adapter_statuses["a"])
    assert status["bytesVersion"] == "v1" and status["bytes"] == MB

    def edit():
        return parse_adapter(body(version="v2", warm=0, generation=4, status=status))

    plan = reconcile_pool(q, [edit()], ws, now=NOW)
    status |= plan.adapter_statuses["a"]
    assert _served(plan) == "v2" and '"version":"v1"' in status["lastValidSpec"]  # v2's size unknown yet
    report_sizes(ws, plan, {("a", "v2"): 5 * MB})
    for _ in range(2):
        plan = reconcile_pool(q, [edit()], ws, now=NOW)
        status |= plan.adapter_statuses["a"]
        assert _served(plan) == "v1" and status["phase"] == "Failed", status["message"]
        report_sizes(ws, plan, {("a", "v1"): MB})
    # An edit that fits becomes the last valid spec once its size is known.
    fits = parse_adapter(body(version="v3", warm=0, generation=5, status=status))
    plan = reconcile_pool(q, [fits], ws, now=NOW)
    report_sizes(ws, plan, {("a", "v3"): 2 * MB})
    plan = reconcile_pool(q, [fits], ws, now=NOW)
    assert _served(plan) == "v3" and '"version":"v3"' in plan.adapter_statuses["a"]["lastValidSpec"]


def test_a_smaller_version_after_a_quota_refusal_is_counted_at_its_own_size():
    """v1 (5 MiB) is refused once the quota drops to 3 MiB; the tenant ships v2 at 1 MiB: it is admitted and
    served (before, status.bytes, v1's size, was counted for v2 for ever)."""
    ws = workers(1)
    plan = converge(pool(tenantQuota={"maxBytes": 8 * MB}), [parse_adapter(body(warm=0))], ws, bytes_of={"a": 5 * MB})
    status = dict(plan.adapter_statuses["a"])
    small = pool(tenantQuota={"maxBytes": 3 * MB})
    plan = reconcile_pool(small, [parse_adapter(body(warm=0, status=status))], ws, now=NOW)
    status |= plan.adapter_statuses["a"]
    assert _served(plan) is None and status["phase"] == "Failed"
    report_sizes(ws, plan, {})
    for _ in range(2):
        plan = reconcile_pool(small, [parse_adapter(body(version="v2", warm=0, generation=5, status=status))], ws,
                              now=NOW)
        status |= plan.adapter_statuses["a"]
        assert _served(plan) == "v2", status["message"]
        report_sizes(ws, plan, {("a", "v2"): MB})
    assert status["bytes"] == MB and status["bytesVersion"] == "v2"


def test_the_canary_s_size_leaves_the_status_with_the_canary():
    """status.canaryBytes is removed (None, in a merge patch) once the spec has no canary (promoted, or removed);
    an edit refused for a typo keeps it, as the canary may come back with the spec fixed."""
    canary = {"version": "v2", "source": {"uri": "s3://adapters/a/v2/"}, "weight": 20}
    ws = workers(2)
    st = converge(pool(), [parse_adapter(body(canary=canary))], ws).adapter_statuses["a"]
    assert st["canaryBytes"] == {"version": "v2", "bytes": MB}
    typo = parse_adapter(body(status=copy.deepcopy(st), generation=4, canary=canary,
                              source={"uri": "s3://adapters/a/v1/", "sha256": "ABC"}))
    assert reconcile_pool(pool(), [typo], ws, now=NOW).adapter_statuses["a"]["canaryBytes"] == st["canaryBytes"]
    for spec in ({"version": "v2"}, {}):  # promoted, removed
        edited = parse_adapter(body(status=copy.deepcopy(st), generation=4, **spec))
        assert reconcile_pool(pool(), [edited], ws, now=NOW).adapter_statuses["a"]["canaryBytes"] is None

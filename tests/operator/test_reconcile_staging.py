"""Versions a worker's stager reports with ``staging`` (a download in progress, answered before it ends): on
their way, neither drift nor registered, nor a failure to re-push while staged again; a canary the worker
claims to have applied yet does not report is lost, as a stable version is."""

from __future__ import annotations

import pytest

from lorafleet.operator.reconcile import reconcile_pool
from lorafleet.worker.directives import AdapterState, ReportedState

from .test_reconcile import NOW, adapter, converge, pool, workers

CANARY = {"version": "v2", "source": {"uri": "s3://adapters/a/v2/"}, "weight": 20}


@pytest.mark.parametrize("warm", [0, 1])
def test_a_canary_claimed_applied_and_not_reported_is_pushed_again_unless_it_is_staging(warm):
    """The worker reports the push's generation (a stager restarted between a push's two steps, say) with a's
    stable version and without its canary: pushed again. Reported as still staging: it is on its way."""
    ws = workers(1)
    converge(pool(), [adapter("a", warm=warm)], ws)
    spec = adapter("a", warm=warm, canary=CANARY)
    pushed = ws[0].last_pushed = reconcile_pool(pool(), [spec], ws, now=NOW).pushes["w0"]
    for canary, again in ((None, True), (AdapterState("a", "v2", "none", staging=True), False)):
        ws[0].reported = ReportedState(generation_applied=pushed.generation, adapters=[
            AdapterState("a", "v1", "gpu" if warm else "disk"), *([canary] if canary else [])])
        plan = reconcile_pool(pool(), [spec], ws, now=NOW)
        assert ("w0" in plan.pushes) is again
        assert plan.adapter_statuses["a"]["phase"] == "Loading"


def test_a_version_still_downloading_is_not_registered():
    """A new on-demand adapter (warm: 0) whose only version its stager is still downloading is Loading, not
    Ready, its message saying how far the download is; Ready once it is staged."""
    ws = workers(1)
    spec = adapter("a")
    pushed = ws[0].last_pushed = reconcile_pool(pool(), [spec], ws, now=NOW).pushes["w0"]
    ws[0].reported = ReportedState(generation_applied=pushed.generation, adapters=[
        AdapterState("a", "v1", "none", staging=True)])
    plan = reconcile_pool(pool(), [spec], ws, now=NOW)
    st = plan.adapter_statuses["a"]
    assert (st["phase"], st["ready"], st["stableVersion"]) == ("Loading", "0/1", None), st
    assert "registered on 0/1 workers" in st["message"] and "w0" not in plan.pushes
    # How far the download is, once the stager says (its bytes so far, and the total when known).
    for done, total, shown in ((3 << 20, 12 << 20, "downloading on w0 v1 3.0/12.0 MiB"),
                               (1 << 19, 0, "downloading on w0 v1 0.5 MiB")):
        ws[0].reported.adapters = [AdapterState("a", "v1", "none", staging=True, bytes=total, bytes_done=done)]
        st = reconcile_pool(pool(), [spec], ws, now=NOW).adapter_statuses["a"]
        assert st["phase"] == "Loading" and shown in st["message"], st["message"]
    ws[0].reported.adapters = [AdapterState("a", "v1", "disk")]
    assert reconcile_pool(pool(), [spec], ws, now=NOW).adapter_statuses["a"]["phase"] == "Ready"


def test_a_failed_version_being_staged_again_is_not_pushed_again_until_its_retry_ends():
    """A version that failed is reported, once its retry began, with ``staging`` and its last error: a re-push
    now would supersede the retry. The worker stays failing (the retry backoff goes on) and the adapter Degraded,
    its message saying the version is being staged again; once the retry failed too, it is pushed again."""
    ws = workers(1)
    converge(pool(), [adapter("a")], ws)
    pushed = ws[0].last_pushed
    error = "s3://adapters/a/v1/: object store unavailable"
    for staging, again in ((True, False), (False, True)):
        ws[0].reported = ReportedState(generation_applied=pushed.generation, adapters=[
            AdapterState("a", "v1", "none", error=error, staging=staging)])
        plan = reconcile_pool(pool(), [adapter("a")], ws, now=NOW)
        assert ("w0" in plan.pushes) is again and plan.failing == ["w0"]
        st = plan.adapter_statuses["a"]
        assert st["phase"] == "Degraded" and error in st["message"], st
        assert ("being staged again" in st["message"]) is staging


def test_a_download_s_size_counts_for_the_quota_and_a_few_pods_are_named():
    """A version being staged reports its download's total (`bytes`, its objects' size once listed): the tenant
    byte quota counts it, so a version over the quota is refused while it downloads, not once every pod has it.
    The status names three pods' downloads, then how many more."""
    ws = workers(5)
    spec = adapter("a")
    roomy, tight = pool(tenantQuota={"maxBytes": "100Mi"}), pool(tenantQuota={"maxBytes": "10Mi"})
    pushes = reconcile_pool(roomy, [spec], ws, now=NOW).pushes
    for w in ws:
        w.last_pushed = pushes[w.pod]
        w.reported = ReportedState(generation_applied=pushes[w.pod].generation, adapters=[
            AdapterState("a", "v1", "none", staging=True, bytes=64 << 20, bytes_done=1 << 20)])
    refused = reconcile_pool(tight, [spec], ws, now=NOW)
    assert refused.adapter_statuses["a"]["phase"] == "Failed"
    assert "spec.tenantQuota.maxBytes (10485760 bytes; 67108864" in refused.adapter_statuses["a"]["message"]
    assert refused.adapter_statuses["a"]["refusedBytes"] == {"version": "v1", "bytes": 64 << 20}
    assert all(d.adapters == [] for d in refused.desired.values())
    st = reconcile_pool(roomy, [spec], ws, now=NOW).adapter_statuses["a"]
    assert st["phase"] == "Loading", st["message"]
    assert "downloading on w0 v1 1.0/64.0 MiB, w1 v1 1.0/64.0 MiB, w2 v1 1.0/64.0 MiB and 2 more" in st["message"]

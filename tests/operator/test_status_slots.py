"""A warm worker whose GPU adapter slots are all held by pinned adapters can never make the adapter resident:
its status is Degraded, naming the worker, its slots and what to change, instead of Loading for ever; an
on-demand worker in that state refuses the adapter's requests (503): Degraded too, not Ready. A worker that
does not report `num_pinned_slots` (an older one) leaves the status as it was."""

from __future__ import annotations

import dataclasses

import pytest

from lorafleet.operator.reconcile import reconcile_pool
from lorafleet.worker.directives import AdapterState, ReportedState

from .test_reconcile import NOW, adapter, converge, pool, workers

CANARY = {"version": "v2", "source": {"uri": "s3://adapters/a/v2/"}, "weight": 10}


def stuck(ws, pod: str, version: str, num_pinned_slots: int | None) -> None:
    """Worker ``pod`` holds ``version`` in CPU memory only, with ``num_pinned_slots`` as it reports it."""
    w = next(w for w in ws if w.pod == pod)
    w.reported = ReportedState(w.reported.generation_applied, [
        dataclasses.replace(s, tier="cpu", num_pinned_slots=num_pinned_slots) if s.version == version else s
        for s in w.reported.adapters])


@pytest.mark.parametrize("version", ["v1", "v2"])  # the stable version, the canary a warm worker prefetches
def test_a_warm_worker_with_every_slot_pinned_makes_the_adapter_degraded(version):
    ws = workers(2)
    spec = [adapter("a", warm=2, canary=CANARY)]
    assert converge(pool(), spec, ws).adapter_statuses["a"]["phase"] == "Ready"
    stuck(ws, "w1", version, 4)
    st = reconcile_pool(pool(), spec, ws, now=NOW).adapter_statuses["a"]
    assert st["phase"] == "Degraded"
    assert st["message"] == (f"warm worker w1: all 4 of its GPU adapter slots (--max-loras) are held by pinned "
                             f"adapters, so a@{version} cannot become GPU-resident there; raise --max-loras of the "
                             "pool's workers, or unpin an adapter there (spec.pinned: false on its LoRAAdapter)")
    ready = next(c for c in st["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "Degraded")


def test_a_worker_that_does_not_report_pinned_slots_is_loading_as_before():
    ws = workers(2)
    spec = [adapter("a", warm=2)]
    converge(pool(), spec, ws)
    stuck(ws, "w1", "v1", None)
    st = reconcile_pool(pool(), spec, ws, now=NOW).adapter_statuses["a"]
    assert st["phase"] == "Loading" and "GPU-resident on 1/2 warm workers" in st["message"]


def on_demand_status(tier: str) -> tuple[str, dict]:
    """(the pod not warm for `a` (warm: 1), `a`'s status) when that pod reports a@v1 at `tier` with every GPU
    slot pinned."""
    ws = workers(2)
    spec = [adapter("a", warm=1)]
    plan = converge(pool(), spec, ws)
    cold = next(p for p in ("w0", "w1") if p not in plan.placement["a"])
    w = next(w for w in ws if w.pod == cold)
    w.reported = ReportedState(w.reported.generation_applied, [AdapterState("a", "v1", tier, num_pinned_slots=4)])
    return cold, reconcile_pool(pool(), spec, ws, now=NOW).adapter_statuses["a"]


def test_pinned_slots_of_an_on_demand_worker_make_the_adapter_degraded():
    """w1 is not warm for `a` (warm: 1), yet it serves `a` on demand: with every slot pinned there, each
    request routed to it fails to load (503). It was Ready."""
    cold, st = on_demand_status("disk")
    assert st["phase"] == "Degraded"
    assert st["message"].startswith(f"worker {cold}: all 4 of its GPU adapter slots (--max-loras) are held by pinned "
                                    "adapters, so its requests for a@v1 are refused (503); raise --max-loras")


def test_an_on_demand_worker_holding_the_adapter_on_gpu_leaves_it_ready():
    """Every slot pinned, one of them by `a` itself (a GPU-resident copy serves): nothing is refused."""
    assert on_demand_status("gpu")[1]["phase"] == "Ready"

"""The workers a pool's pinned adapters need (the autoscaler's floor), as the reconcile counts them: the room
placement gives each pinned copy (GPU adapter slots, bytes, a canary with it, warm copies)."""

from __future__ import annotations

import pytest

from lorafleet.operator.pinned_need import NO_PINNED, PinnedNeed
from lorafleet.operator.reconcile import reconcile_pool

from .test_reconcile import MB, NOW, adapter, pool, workers

SCALING = {"target": "workers", "prometheusURL": "http://prometheus:9090", "maxReplicas": 6}
CANARY = {"version": "v2", "source": {"uri": "s3://adapters/a/v2/"}, "weight": 20}


def need(ads, ws, **spec) -> PinnedNeed | None:
    return reconcile_pool(pool(**{"scaling": SCALING, **spec}), ads, ws, now=NOW).pinned


@pytest.mark.parametrize(("num_pinned", "slots", "num_workers"), [(3, 1, 3), (3, 2, 2), (4, 2, 2), (5, 2, 3)])
def test_pinned_adapters_need_their_slots_over_the_workers_slots(num_pinned, slots, num_workers):
    ads = [adapter(f"p{i}", pinned=True) for i in range(num_pinned)] + [adapter("cold", warm=1)]
    assert need(ads, workers(4, pool_slots=slots)) == PinnedNeed(num_pinned, num_workers)


def test_a_canary_takes_a_slot_and_warm_copies_one_per_worker():
    # A pinned copy pins its canary too: two slots. With 2 slots per worker: a alone fills one worker.
    assert need([adapter("a", pinned=True, canary=CANARY), adapter("b", pinned=True)],
                workers(2, pool_slots=2)) == PinnedNeed(2, 2)
    # warm: 2 asks for two copies once there are two workers: 1 slot each, b fits only beside them on a third.
    assert need([adapter("a", pinned=True, warm=2), adapter("b", pinned=True)],
                workers(3, pool_slots=1)) == PinnedNeed(2, 3)


def test_bytes_count_as_placement_counts_them():
    ads = [adapter(n, pinned=True, status={"bytes": 60 * MB}) for n in ("a", "b", "c")]
    assert need(ads, workers(2), adapterMemory={"gpuBytes": "128Mi"}) == PinnedNeed(3, 2)
    assert need(ads, workers(2, pool_bytes=64 * MB)) == PinnedNeed(3, 3)  # the worker's own report
    # More than maxReplicas plus the workers there are (some may run in other Deployments): not counted further.
    one = {**SCALING, "maxReplicas": 1}
    assert need(ads, workers(2, pool_bytes=64 * MB), scaling=one) == PinnedNeed(3, 3)
    four = [*ads, adapter("d", pinned=True, status={"bytes": 60 * MB})]
    assert need(four, workers(2, pool_bytes=64 * MB), scaling=one) == PinnedNeed(4, None)


def test_the_smallest_worker_sets_the_room_and_what_fits_nowhere_is_left_out():
    ws = workers(3, pool_slots=4)
    ws[1].reported.pool_slots = 1
    assert need([adapter(f"p{i}", pinned=True) for i in range(3)], ws) == PinnedNeed(3, 3)
    # Too large for any worker: no number of workers holds it (its status says so), so it adds none.
    ads = [adapter("huge", pinned=True, status={"bytes": 200 * MB}), adapter("a", pinned=True)]
    assert need(ads, workers(2), adapterMemory={"gpuBytes": "100Mi"}) == PinnedNeed(2, 1)


def test_unknown_without_workers_and_none_without_pins_or_scaling():
    assert need([adapter("a", pinned=True)], []) is None
    assert need([adapter("a", warm="all")], []) == NO_PINNED
    assert reconcile_pool(pool(), [adapter("a", pinned=True)], workers(2, pool_slots=1), now=NOW).pinned is None


def test_pins_no_count_of_workers_holds_set_no_floor():
    """Two pinned adapters warm on every worker, one GPU slot each: no number of workers holds both, so the floor
    would only hold the pool at maxReplicas for nothing (it did, and told the user to raise maxReplicas)."""
    from lorafleet.operator.autoscaler import ScalingSpec, pinned_floor

    ads = [adapter(n, pinned=True, warm="all") for n in ("a", "b")]
    got = need(ads, workers(2, pool_slots=1))
    assert got is not None and got.num_workers is None and not got.held
    spec = ScalingSpec.parse({**SCALING, "maxReplicas": 8})
    wanted, why = pinned_floor(spec, 2, 2, got)
    assert wanted == 2 and "cannot all stay GPU-resident on any number of workers" in why
    # Pins that more workers than maxReplicas would hold: still held there.
    more = need([adapter(f"p{i}", pinned=True) for i in range(12)], workers(2, pool_slots=1),
                scaling={**SCALING, "maxReplicas": 3})
    assert more.num_workers is None and more.held and pinned_floor(ScalingSpec.parse({**SCALING, "maxReplicas": 3}),
                                                                   1, 2, more)[0] == 3


def models_placed(monkeypatch) -> list[int]:
    """The sizes of the model pools pinned_need places copies on, as it does (one entry per placement)."""
    from lorafleet.operator import pinned_need

    modelled, place_warm = [], pinned_need.place_warm

    def counting(ads, model, **kwargs):
        modelled.append(len(model))
        return place_warm(ads, model, **kwargs)

    monkeypatch.setattr(pinned_need, "place_warm", counting)
    return modelled


def test_the_count_models_no_more_workers_than_copies_can_use(monkeypatch):
    """At the largest maxReplicas, a pass models no more workers than the pinned copies can take (one each, and
    one for copies on every worker), and finds the same count (before, each pass placed the copies on a model
    of maxReplicas workers several times: seconds of the event loop at 100,000)."""
    modelled = models_placed(monkeypatch)
    big = {**SCALING, "maxReplicas": 1000}
    ads = [adapter("a", pinned=True, warm=2), adapter("b", pinned=True), adapter("c", pinned=True, warm="all")]
    assert need(ads, workers(3, pool_slots=2), scaling=big) == need(ads, workers(3, pool_slots=2)) == PinnedNeed(3, 3)
    assert modelled and max(modelled) <= 1 + 2 + 1


@pytest.mark.parametrize("case", ["a thousand pins", "more on every worker than a worker holds"])
def test_a_large_count_is_found_without_modelling_every_count_up_to_max_replicas(monkeypatch, case):
    """A thousand pinned adapters at maxReplicas 1000: each pass bisected over models of up to 1001 workers
    placing every pin (about 9 s of the operator's event loop, which every pool and the liveness probe share).
    The count starts from its lower bound (the pins' slots and bytes over a worker's room), where identical
    model workers mostly hold them: one model of that size. Copies on every worker that no worker holds
    together are seen on one model worker, not on models of four times maxReplicas."""
    modelled = models_placed(monkeypatch)
    big = {**SCALING, "maxReplicas": 1000}
    ads = [adapter(f"p{i:04d}", pinned=True) for i in range(1000)]
    if case == "a thousand pins":
        assert need(ads, workers(4, pool_slots=8), scaling=big) == PinnedNeed(1000, 125)
        assert sum(modelled) <= 1 + 125
    else:
        ads = [adapter(f"all{i}", pinned=True, warm="all") for i in range(9)] + ads[:500]
        got = need(ads, workers(4, pool_slots=8), scaling=big)
        assert got is not None and got.num_workers is None and not got.held
        assert max(modelled) == 1

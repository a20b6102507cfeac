"""Admission: the worker-wide capacity and the optional per-tenant cap, and the flag that sets the cap."""

from __future__ import annotations

import pytest

from lorafleet.worker.admission import QUEUE_FULL, TENANT_QUEUE_FULL, Admission
from lorafleet.worker.cli import config_from_args
from lorafleet.worker.worker_config import WorkerConfig


def held(admission: Admission) -> tuple[int, dict[str, int]]:
    return admission.num_admitted, dict(admission.num_admitted_by_tenant)


def test_without_a_per_tenant_cap_one_tenant_may_fill_the_worker():
    admission = Admission(4)
    assert admission.admit(4, "acme")
    assert not admission.admit(1, "globex")
    assert admission.refusal(1, "globex") == QUEUE_FULL
    assert held(admission) == (4, {"acme": 4}) and admission.num_refused == 1


def test_a_tenant_at_its_cap_is_refused_while_another_is_admitted():
    admission = Admission(8, max_per_tenant=3)
    assert admission.admit(2, "acme")
    assert not admission.admit(2, "acme")  # 4 > 3: refused, nothing taken
    assert admission.refusal(2, "acme") == TENANT_QUEUE_FULL
    assert held(admission) == (2, {"acme": 2}) and admission.num_refused == 1
    assert admission.admit(3, "globex")
    assert admission.admit(1, "acme")  # exactly at the cap
    assert held(admission) == (6, {"acme": 3, "globex": 3})


def test_the_worker_capacity_still_binds_below_the_tenant_caps():
    admission = Admission(4, max_per_tenant=3)
    assert admission.admit(3, "acme") and admission.admit(1, "globex")
    assert admission.refusal(1, "globex") == QUEUE_FULL  # globex holds 1 of its 3, the worker is full
    assert not admission.admit(1, "globex")
    assert admission.refusal(1, "acme") == TENANT_QUEUE_FULL  # both full: the tenant's own cap is named


def test_release_gives_back_both_counts_and_forgets_idle_tenants():
    admission = Admission(8, max_per_tenant=2)
    for i in range(1000):  # many tenants come and go: the table holds only those in flight
        tenant = f"tenant-{i}"
        assert admission.admit(2, tenant)
        assert admission.admit(1, "steady")
        admission.release(1, tenant)
        assert held(admission) == (2, {tenant: 1, "steady": 1})
        admission.release(1, tenant)
        admission.release(1, "steady")
        assert held(admission) == (0, {})
    assert admission.admit(2, "acme") and not admission.admit(1, "acme")
    admission.release(2, "acme")
    assert admission.admit(2, "acme")  # the released share is available again


@pytest.mark.parametrize(
    ("num_seqs", "tenant"), [(1, "globex"), (3, "acme")], ids=["other-tenant", "too-many"]
)
def test_releasing_what_a_tenant_does_not_hold_is_refused(num_seqs, tenant):
    admission = Admission(4)
    admission.admit(2, "acme")
    with pytest.raises(ValueError, match="releasing"):
        admission.release(num_seqs, tenant)
    assert held(admission) == (2, {"acme": 2})


@pytest.mark.parametrize(
    ("capacity", "max_per_tenant", "needle"), [(0, 0, "capacity"), (4, -1, "max_per_tenant")]
)
def test_bad_limits_are_refused(capacity, max_per_tenant, needle):
    with pytest.raises(ValueError, match=needle):
        Admission(capacity, max_per_tenant)


def test_zero_sequences_are_refused():
    admission = Admission(4, max_per_tenant=2)
    for verb in (admission.admit, admission.release):
        with pytest.raises(ValueError, match="num_seqs must be >= 1"):
            verb(0, "acme")
    assert held(admission) == (0, {})


@pytest.mark.parametrize(("capacity", "max_per_tenant", "largest"), [(8, 0, 8), (8, 3, 3), (4, 10, 4)])
def test_the_largest_request_that_can_ever_be_admitted(capacity, max_per_tenant, largest):
    admission = Admission(capacity, max_per_tenant)
    assert admission.max_seqs_per_request() == largest
    assert admission.can_admit(largest, "acme") and not admission.can_admit(largest + 1, "acme")


@pytest.mark.parametrize(("max_per_tenant", "cap"), [(0, 6), (3, 3), (7, 6)])
def test_with_several_tenants_one_leaves_a_quarter_of_the_sequences_to_the_others(max_per_tenant, cap):
    """Capacity 8: with several tenants one holds at most 6 sequences (or its lower cap); alone it may hold all."""
    admission = Admission(8, max_per_tenant=max_per_tenant)
    assert admission.max_seqs_per_request(shared=True) == cap and admission.never_fits(cap + 1, shared=True)
    assert admission.admit(cap, "acme", shared=True) and not admission.admit(1, "acme", shared=True)
    assert admission.refusal(1, "acme", shared=True) == TENANT_QUEUE_FULL
    assert admission.enter_intake("acme", shared=True) == TENANT_QUEUE_FULL  # nor its requests' bodies
    assert admission.admit(min(cap, 8 - cap), "globex", shared=True)
    alone = Admission(8, max_per_tenant=max_per_tenant)
    assert alone.admit(max_per_tenant or 8, "dev")


def test_the_per_tenant_cap_is_a_flag_and_an_environment_variable():
    assert config_from_args(WorkerConfig, [], env={}).max_sequences_per_tenant == 0  # default: no cap
    env = {"LORAFLEET_MAX_SEQUENCES_PER_TENANT": "5"}
    assert config_from_args(WorkerConfig, [], env=env).max_sequences_per_tenant == 5
    assert (
        config_from_args(WorkerConfig, ["--max-sequences-per-tenant", "3"], env=env).max_sequences_per_tenant
        == 3
    )
    with pytest.raises(ValueError, match="max_sequences_per_tenant must be >= 0"):
        WorkerConfig(max_sequences_per_tenant=-1)


def test_intake_places_are_bounded_and_given_back():
    admission = Admission(4, max_intake=2)
    assert admission.enter_intake() is None and admission.enter_intake() is None
    assert admission.enter_intake() == "intake_full" and admission.num_in_intake == 2 and admission.num_refused == 1
    admission.leave_intake()
    assert admission.enter_intake() is None
    for _ in range(2):
        admission.leave_intake()
    with pytest.raises(ValueError, match="leaving intake"):
        admission.leave_intake()
    unbounded = Admission(4)  # 0: no limit
    assert all(unbounded.enter_intake() is None for _ in range(100))
    with pytest.raises(ValueError, match="max_intake"):
        Admission(4, max_intake=-1)


def test_a_tenant_s_requests_in_intake_count_against_its_cap():
    """One tenant cannot hold every intake place (bodies sent slowly) and lock the others out: with the
    per-tenant cap its requests being read count with its sequences admitted; the others read on."""
    admission = Admission(16, max_per_tenant=2, max_intake=8)
    assert admission.enter_intake("acme") is None and admission.enter_intake("acme") is None
    assert admission.enter_intake("acme") == "tenant_queue_full" and admission.num_in_intake == 2
    assert admission.enter_intake("globex") is None and admission.tenant_load("globex") == 1
    admission.leave_intake("acme")
    assert admission.admit(1, "acme") and admission.enter_intake("acme") == "tenant_queue_full"  # 1 admitted, 1 read
    admission.leave_intake("acme")
    admission.leave_intake("globex")
    assert admission.num_in_intake_by_tenant == {} and admission.tenant_load("acme") == 1
    assert admission.admit(1, "acme") and admission.enter_intake("acme") == "tenant_queue_full"  # its cap, admitted
    assert admission.enter_intake("acme", sequences=False) is None  # /tokenize needs no sequence: intake alone counts
    assert admission.enter_intake("acme", sequences=False) is None
    assert admission.enter_intake("acme", sequences=False) == "tenant_queue_full"


@pytest.mark.parametrize("max_per_tenant", [0, 16])
def test_with_several_tenants_one_leaves_a_quarter_of_the_intake_places_to_the_others(max_per_tenant):
    """Intake 8 and no sequence cap, or one at or above it: acme's eight slow bodies took every place and the
    others got 429 intake_full for as long as acme kept reconnecting. With several tenants it holds at most six;
    alone (one tenant, or development mode) it may use them all."""
    admission = Admission(64, max_per_tenant=max_per_tenant, max_intake=8)
    enter = [admission.enter_intake("acme", shared=True) for _ in range(7)]
    assert enter == [None] * 6 + ["tenant_intake_full"]
    assert admission.intake_refusal("acme", shared=True) == "tenant_intake_full"  # asked, nothing taken
    assert admission.enter_intake("globex", shared=True) is None and admission.enter_intake("initech", shared=True) is None
    assert admission.enter_intake("globex", shared=True) == "intake_full"
    for tenant in ("acme", "globex", "initech"):
        admission.leave_intake(tenant)
    assert admission.enter_intake("acme", shared=True) is None
    alone = Admission(64, max_intake=8)
    assert [alone.enter_intake("dev") for _ in range(9)] == [None] * 8 + ["intake_full"]

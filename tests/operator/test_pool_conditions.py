"""A pool's two condition writers (the reconcile's Ready, the autoscaler's Scaling) each merge into a view of
the status that may predate the other's last patch (kopf's, updated by watch events): settled against what
was last written, neither writes the other's condition back as it was before."""

from __future__ import annotations

from lorafleet.operator.pool_conditions import PoolConditions
from lorafleet.operator.status_patches import merge_conditions

KEY = ("ns", "pool")


def cond(ctype: str, message: str) -> dict:
    return {"type": ctype, "status": "True", "reason": "R", "message": message}


def reconcile(memo: PoolConditions, view: dict, message: str) -> list[dict]:
    wanted = merge_conditions(view, {"conditions": [cond("Ready", message)]})
    return memo.settle(KEY, wanted, lambda t: t != "Scaling")["conditions"]


def autoscale(memo: PoolConditions, view: dict, message: str | None) -> list[dict]:
    if message is None:  # spec.scaling removed: the condition is dropped
        wanted = merge_conditions(view, {}, drop=["Scaling"])
    else:
        wanted = merge_conditions(view, {"conditions": [cond("Scaling", message)]})
    return memo.settle(KEY, wanted, lambda t: t == "Scaling")["conditions"]


def test_neither_writer_puts_back_the_others_condition_from_a_stale_view():
    memo = PoolConditions()
    stale = {"conditions": [cond("Ready", "r1"), cond("Scaling", "s1")]}
    assert reconcile(memo, stale, "r2") == [cond("Ready", "r2"), cond("Scaling", "s1")]
    # The autoscaler's view has not seen r2 yet: its patch keeps r2, not r1.
    assert autoscale(memo, stale, "s2") == [cond("Ready", "r2"), cond("Scaling", "s2")]
    # Nor does a reconcile whose view has not seen s2 write s1 back.
    assert reconcile(memo, stale, "r3") == [cond("Ready", "r3"), cond("Scaling", "s2")]
    # A dropped Scaling is not brought back by a view that still has it.
    assert autoscale(memo, stale, None) == [cond("Ready", "r3")]
    assert reconcile(memo, stale, "r4") == [cond("Ready", "r4")]


def test_a_fresh_operator_starts_from_the_view_and_forgets_deleted_pools():
    memo = PoolConditions()
    view = {"conditions": [cond("Scaling", "s1"), cond("Ready", "r1")]}
    assert reconcile(memo, view, "r2") == [cond("Scaling", "s1"), cond("Ready", "r2")]  # order kept
    memo.retain(set())
    assert autoscale(memo, {"conditions": [cond("Ready", "r9")]}, "s2") == [cond("Ready", "r9"), cond("Scaling", "s2")]

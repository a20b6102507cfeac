"""A ready worker silent past the quiet grace is not counted in an adapter's status (a dead pod must not hold it
for ever), but the message says so: Ready no longer claims every worker sends users to the spec's split."""

from __future__ import annotations

from lorafleet.operator.reconcile import WorkerReport, reconcile_pool

from .test_reconcile import NOW, adapter, converge, pool, workers


def test_a_worker_silent_past_the_grace_is_named_as_not_counted():
    p, a = pool(), adapter("sql", warm=1)
    ws = workers(3)
    converge(p, [a], ws)
    st = reconcile_pool(p, [a], ws, now=NOW).adapter_statuses["sql"]
    assert st["phase"] == "Ready" and "not counted" not in st["message"]
    # w2 stops answering; its last answer is past the quiet grace (none stands in).
    silent = [ws[0], ws[1], WorkerReport("w2", None, ws[2].last_pushed)]
    st = reconcile_pool(p, [a], silent, now=NOW).adapter_statuses["sql"]
    assert st["phase"] == "Ready"  # not held back for ever by a dead pod
    assert st["message"].endswith("; 1 ready worker not counted: no answer from the sidecar of w2 (what it "
                                  "serves, and how it splits users, is not known)")
    # Within the grace its last answer stands in: counted as it said, nothing left out.
    quiet = [ws[0], ws[1], WorkerReport("w2", None, ws[2].last_pushed, last_answer=ws[2].reported)]
    assert "not counted" not in reconcile_pool(p, [a], quiet, now=NOW).adapter_statuses["sql"]["message"]

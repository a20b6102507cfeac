"""A push (ServedAdapters.apply, on an executor thread) against a request's load failure that the HTTP
task records meanwhile (mark_failed, on the event loop) on the table the push is about to replace:
what served_fallback.replay_failures carries over to the new table, and what it must not."""

from __future__ import annotations

import inspect
import sys

from lorafleet.worker.served_adapters import ServedAdapters
from lorafleet.worker.tenants import Tenant
from tests.worker.test_served_adapters import SQL, state
from tests.worker.test_served_fallback import SwitchingHost

C1 = SQL | {"canary": {"version": "c1", "uri": "/c/sql/c1"}, "canary_weight": 50}


def test_a_stale_failure_recorded_after_the_retry_is_not_replayed():
    """c1 failed (table of push 1), push 2 retries it; a second request's stale failure of the same load is
    recorded on the old table only after push 2 registered c1 again. `seen` holds c1: not replayed."""
    host, served = SwitchingHost(), ServedAdapters("base")
    served.apply(state(1, C1), host)
    served.mark_failed("sql@c1", "c1: truncated")  # first request's failure, before the push
    register = host.register_adapter

    def then_stale_failure(name, source, **kw):
        key = register(name, source, **kw)
        if kw.get("version") == "c1":  # the retry is registered; the HTTP task records the old failure again
            served.mark_failed("sql@c1", "c1: truncated (second request)")
        return key

    host.register_adapter = then_stale_failure
    served.apply(state(2, C1), host)
    assert host.calls.count(("register", "sql@c1", False)) == 2  # retried
    assert "c1" not in served.get("sql").errors and served.get("sql").split.canary == "c1"


def _line_of(func, text: str) -> int:
    lines, start = inspect.getsourcelines(func)
    return start + next(i for i, line in enumerate(lines) if text in line)


def test_a_failure_recorded_while_the_push_decides_on_the_version_is_retried_or_replayed_never_both():
    """The HTTP task (event-loop thread) records c1's failure while the push thread decides on c1, just
    before `keep`. When the push read old.errors twice, the first read (seen: no) and the second (keep: no,
    so c1 registered again) disagreed, and the retry was marked failed. A thread switch there is modelled
    with a line trace on _register."""
    host, served = SwitchingHost(), ServedAdapters("base")
    served.apply(state(1, C1), host)
    code = ServedAdapters._register.__code__
    target = _line_of(ServedAdapters._register, "keep = (old is not None")
    fired = []

    def local(frame, event, arg):
        if event == "line" and frame.f_lineno == target and frame.f_locals.get("version") == "c1" and not fired:
            fired.append(True)
            served.mark_failed("sql@c1", "c1: truncated")  # the other thread's write, at this bytecode boundary
        return local

    def global_(frame, event, arg):
        return local if frame.f_code is code else None

    host.calls.clear()
    sys.settrace(global_)
    try:
        served.apply(state(2, C1), host)
    finally:
        sys.settrace(None)
    assert fired
    retried = ("register", "sql@c1", False) in host.calls
    failed = "c1" in served.get("sql").errors
    # Either the push kept c1 (then the failure is replayed) or it retried it (then it is not): never both.
    assert not (retried and failed), f"retried={retried} and replayed: {served.get('sql').errors}"


def test_a_quota_failure_of_the_old_owner_is_not_replayed_onto_the_new_owner():
    """sql moves from acme to globex (kept: the push calls set_adapter_tenant). A request's load that failed on
    acme's GPU byte quota (non-retryable) is recorded by the HTTP task on the table still published, after the
    push handled sql@v1 and before it published: the replay marks the version failed for globex."""
    host, served = SwitchingHost(), ServedAdapters("base")
    served.apply(state(1, SQL), host)
    set_tenant = host.set_adapter_tenant

    def quota_failure_meanwhile(key, tenant):
        set_tenant(key, tenant)
        served.mark_failed(key, "needs 200 bytes, above tenant 'acme''s GPU quota of 100 bytes")

    host.set_adapter_tenant = quota_failure_meanwhile
    served.apply(state(2, SQL | {"tenant": "globex"}), host)
    assert ("tenant", "sql@v1", "globex") in host.calls
    assert served.get("sql").tenant == "globex"
    assert "v1" not in served.get("sql").errors, served.get("sql").errors
    assert served.resolve("sql", Tenant("globex"), None) == "sql@v1"

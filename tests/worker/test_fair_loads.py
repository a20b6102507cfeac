"""Loader threads are shared between tenants by turns, requests before warm-ups (worker/fair_executor.py):
one tenant's burst of cold loads never queues another tenant's request behind all of it."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

from lorafleet.worker.fair_executor import FairExecutor
from tests.lora_factory import random_weights
from tests.worker.test_adapter_pool import _acquire_within, make_pool


def _gated_pool(keys: dict[str, str], spare: int = 0):
    """A pool with one loader thread (and `spare` more); every read waits for the gate, then notes its key
    in `order`."""
    pool = make_pool(max_slots=8, num_load_threads=1, spare_load_threads=spare)
    gate, order = threading.Event(), []

    def loader(key: str, seed: int):
        def read():
            gate.wait(10)
            order.append(key)
            return random_weights(seed)
        return read

    for seed, (key, tenant) in enumerate(keys.items()):
        pool.add(key, loader=loader(key, seed), tenant=tenant)
    return pool, gate, order


def _read_order(owners: dict[str, str], askers: dict[str, str | None]) -> list[str]:
    """The order in which one loader thread reads `owners`' adapters (key -> owner) asked for at once, in
    order, by requests of `askers` (key -> the asking tenant)."""
    pool, gate, order = _gated_pool(owners)
    try:
        for key in owners:
            assert pool.acquire(key, waiter=key, tenant=askers[key]) is None
        gate.set()
        for key in owners:
            assert _acquire_within(pool, key, key, 10.0) is not None
        pool.check()
        return order
    finally:
        gate.set()
        pool.close()


def test_a_tenants_cold_load_waits_for_one_load_of_a_busy_tenant_not_all():
    """Tenant A asks for five cold adapters at once; tenant B for one just after. With first come, first
    served loader threads, B's request waited for all five of A's reads."""
    owners = {f"a{i}@1": "A" for i in range(5)} | {"b@1": "B"}
    order = _read_order(owners, dict.fromkeys(owners))  # requests of no known tenant: by owner
    assert order == ["a0@1", "b@1", "a1@1", "a2@1", "a3@1", "a4@1"], order


def test_adapters_one_owner_lends_to_many_tenants_are_read_in_turns_per_asking_tenant():
    """The --adapters folder's adapters (and those a keys file's patterns grant) are all owned by "default":
    grouped by owner, tenant A's five cold loads queued tenant B's one behind all of them."""
    owners = {f"a{i}@1": "default" for i in range(5)} | {"b@1": "default"}
    order = _read_order(owners, {key: key[0].upper() for key in owners})
    assert order == ["a0@1", "b@1", "a1@1", "a2@1", "a3@1", "a4@1"], order


def test_a_request_goes_before_warm_ups_and_a_queued_warm_up_asked_for_moves_up():
    """Warm-ups (prefetch: a directive's warm or pinned versions, a new pool's first push) wait behind the
    loads requests wait for; a warm-up still queued that a request asks for becomes one of those."""
    keys = {f"w{i}@1": "A" for i in range(4)} | {"r@1": "B"}
    pool, gate, order = _gated_pool(keys)
    try:
        for i in range(4):
            pool.prefetch(f"w{i}@1")
        assert pool.acquire("r@1", waiter="r") is None
        assert pool.acquire("w3@1", waiter="x") is None  # queued as a warm-up: a request waits for it now
        gate.set()
        for key in keys:
            pool.load(key, timeout=10)
        assert order == ["w0@1", "r@1", "w3@1", "w1@1", "w2@1"], order
        pool.check()
    finally:
        gate.set()
        pool.close()


def test_the_executor_runs_at_most_its_threads_and_skips_cancelled_jobs():
    ex = FairExecutor(2, thread_name_prefix="test-load")
    gate, running, most = threading.Event(), [0], [0]
    lock = threading.Lock()

    def job(i: int):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        gate.wait(10)
        with lock:
            running[0] -= 1
        if i == 3:
            raise ValueError("bad file")
        return i

    futures = [ex.submit(f"t{i % 3}", lambda i=i: job(i), urgent=i % 2 == 0) for i in range(8)]
    assert ex.queued() == 6
    assert futures[7].cancel()
    deadline = time.monotonic() + 10
    while running[0] < 2 and time.monotonic() < deadline:  # both threads take a job (a readiness poll)
        time.sleep(0.001)
    gate.set()
    results = [f.exception(10) or f.result() if not f.cancelled() else "cancelled" for f in futures]
    assert most[0] == 2 and isinstance(results[3], ValueError)
    assert [r for i, r in enumerate(results) if i != 3] == [0, 1, 2, 4, 5, 6, "cancelled"]
    queued = ex.submit("t", lambda: gate.wait(10))
    ex.shutdown(wait=True)
    assert queued.done()


def test_a_thread_whose_initializer_fails_fails_its_jobs_and_blocks_no_other():
    """A loader thread whose initializer fails broke the pool: a load stayed running for ever (its place
    taken, so every later load queued for ever and no time limit ever started), and failing it from the
    pool's own callback could deadlock with the adapter pool's lock. Each job now fails with the error, on
    the loader thread, outside the executor's lock, and the jobs queued behind it still run."""
    calls = []

    def flaky_init() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("no CPU threads")

    ex = FairExecutor(1, initializer=flaky_init)
    gate, held = threading.Event(), []
    try:
        futures = [ex.submit("t", lambda: gate.wait(10) and "ran") for _ in range(3)]
        futures[0].add_done_callback(lambda f: held.append(ex._lock.locked()))
        gate.set()
        assert isinstance(futures[0].exception(10), RuntimeError)
        assert [f.result(10) for f in futures[1:]] == ["ran", "ran"]  # the initializer ran again, and passed
        assert held == [False] and ex._running == 0 and ex.queued() == 0
    finally:
        gate.set()
        ex.shutdown(wait=True)


def test_promoting_is_cheap_and_only_moves_queued_warm_ups():
    ex = FairExecutor(1, thread_name_prefix="test-load")
    gate = threading.Event()
    try:
        ex.submit("busy", lambda: gate.wait(10))
        warm = [ex.submit(f"t{i % 50}", lambda: "warm", urgent=False) for i in range(2000)]
        urgent = ex.submit("r", lambda: "asked")
        ex.promote(urgent)  # already urgent: nothing
        ex.promote(warm[-1])
        assert not ex._queued_background.get(warm[-1]) and len(ex._queued_background) == 1999
        gate.set()
        assert warm[-1].result(10) == "warm" and urgent.result(10) == "asked"
    finally:
        gate.set()
        ex.shutdown(wait=True)


def test_warm_ups_get_a_share_of_the_threads_under_a_stream_of_request_loads():
    """Warm-ups waited while any load a request waited for was queued: a steady stream of cold loads kept a
    pinned version off the GPU for good. One job in BACKGROUND_EVERY goes to a warm-up while both wait."""
    from lorafleet.worker.fair_executor import BACKGROUND_EVERY

    ex = FairExecutor(1, thread_name_prefix="test-load")
    gate, order = threading.Event(), []
    try:
        ex.submit("busy", lambda: gate.wait(10))
        warm = ex.submit("pinned", lambda: order.append("warm"), urgent=False)
        asked = [ex.submit(f"t{i}", lambda i=i: order.append(i)) for i in range(3 * BACKGROUND_EVERY)]
        gate.set()
        warm.result(10)
        [f.result(10) for f in asked]
        assert order.index("warm") < BACKGROUND_EVERY, order
    finally:
        gate.set()
        ex.shutdown(wait=True)


def test_a_tenants_load_runs_beside_another_tenants_slow_reads_on_a_spare_thread():
    """Tenant A's reads hang (a stalled mount) on every loader thread; tenant B's request for an adapter that
    must be read again waited for one of them to end (up to the 300 s time limit). A load a request waits for,
    of a tenant with none running, now starts at once on a spare thread: B's adapter arrives while A's reads
    still hang; A's third load, and a fourth tenant's beyond the spares, wait for a thread as before."""
    keys = {"a0@1": "A", "a1@1": "A", "a2@1": "A", "b@1": "B", "c@1": "C", "d@1": "D"}
    pool, gate, order = _gated_pool(keys, spare=2)
    a_gate = threading.Event()
    for seed, key in enumerate(("a0@1", "a1@1", "a2@1")):
        def read(key=key, seed=seed):
            a_gate.wait(10)
            order.append(key)
            return random_weights(seed)
        pool._entries[key].loader = read
    gate.set()  # B's, C's and D's reads return at once: only A's hang
    try:
        for key in ("a0@1", "a1@1", "a2@1"):
            assert pool.acquire(key, waiter=key) is None
        assert pool.acquire("b@1", waiter="b") is None and pool.acquire("c@1", waiter="c") is None
        assert _acquire_within(pool, "b@1", "b", 5.0) is not None  # on a spare thread, A's reads still hanging
        assert _acquire_within(pool, "c@1", "c", 5.0) is not None
        assert order == ["b@1", "c@1"] or order == ["c@1", "b@1"], order
        a_gate.set()
        for key in ("a0@1", "a1@1", "a2@1"):
            assert _acquire_within(pool, key, key, 10.0) is not None
        pool.check()
    finally:
        a_gate.set()
        pool.close()


def test_spare_threads_go_only_to_requests_of_tenants_with_none_running_and_are_bounded():
    ex = FairExecutor(1, spare_threads=2, thread_name_prefix="test-load")
    gate, started = threading.Event(), []
    lock = threading.Lock()

    def job(name: str):
        with lock:
            started.append(name)
        gate.wait(10)
        return name

    try:
        futures = {name: ex.submit(group, lambda name=name: job(name), urgent=urgent) for name, group, urgent in (
            ("a0", "A", True), ("a1", "A", True), ("w", "W", False), ("b0", "B", True), ("b1", "B", True),
            ("c0", "C", True), ("d0", "D", True))}
        deadline = time.monotonic() + 5
        while len(started) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        with lock:  # the thread, then one spare each for B and C; not A's second, B's second, a warm-up or D
            assert sorted(started) == ["a0", "b0", "c0"], started
        assert ex.queued() == 4
        gate.set()
        assert {name: f.result(10) for name, f in futures.items()} == {name: name for name in futures}
    finally:
        gate.set()
        ex.shutdown(wait=True)


def _gated(ex: FairExecutor, group: str, *, urgent: bool = True):
    """(gate, started, future): a job of `group` that notes its start, then waits for its gate."""
    gate, started = threading.Event(), threading.Event()
    future = ex.submit(group, lambda: started.set() or gate.wait(10), urgent=urgent)
    return gate, started, future


def test_jobs_on_spare_threads_keep_no_warm_up_from_its_share_of_the_threads():
    """Jobs on spares counted against the threads: while requests of other tenants kept them busy, only the
    spare lane (requests only) ever started a job, and a warm-up waited for good."""
    ex = FairExecutor(1, spare_threads=2, thread_name_prefix="test-load")
    a0, b0, c0 = _gated(ex, "A"), _gated(ex, "B"), _gated(ex, "C")  # the thread, then both spares
    try:
        assert all(job[1].wait(5) for job in (a0, b0, c0))
        a1 = _gated(ex, "A")
        warm = ex.submit("pinned", lambda: "warm", urgent=False)
        a0[0].set()  # the thread is free; B and C still hold both spares
        assert a1[1].wait(5)
        a1[0].set()
        assert warm.result(5) == "warm"
    finally:
        for job in (a0, b0, c0):
            job[0].set()
        ex.shutdown(wait=True)


def test_a_busy_tenants_next_load_gets_the_thread_by_turns_though_spares_are_busy():
    """A's read hangs on one thread; B's next load took the other thread's turn on a spare each time, so A's
    next load (no spare: A has a read running) waited for as long as other tenants kept loading."""
    ex = FairExecutor(2, spare_threads=4, thread_name_prefix="test-load")
    a0, b0, c0 = _gated(ex, "A"), _gated(ex, "B"), _gated(ex, "C")  # both threads, then a spare for C
    try:
        assert all(job[1].wait(5) for job in (a0, b0, c0))
        a1, b1 = _gated(ex, "A"), _gated(ex, "B")
        b0[0].set()  # A's turn is the oldest: A's next load takes the thread (B's, none of B's running, a spare)
        assert a1[1].wait(5) and b1[1].wait(5)
    finally:
        for job in (a0, b0, c0, a1, b1):
            job[0].set()
        ex.shutdown(wait=True)


def test_a_load_hung_for_good_holds_neither_shutdown_nor_the_process_exit():
    """A read hung on a dead mount: the engine's close (shutdown without waiting) returns, and the process
    exits on its stop (loader threads are daemons, not joined at exit as ThreadPoolExecutor's are)."""
    code = (
        "import threading\n"
        "from lorafleet.worker.fair_executor import FairExecutor\n"
        "ex = FairExecutor(1, spare_threads=1)\n"
        "started = threading.Event()\n"
        "ex.submit('acme', lambda: (started.set(), threading.Event().wait()))\n"
        "assert started.wait(10)\n"
        "ex.shutdown(wait=False)\n"
        "print('closed', flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "closed\n", done.stderr


def test_an_idle_thread_holds_nothing_of_its_last_job():
    """A loader thread waiting for its next job keeps no reference to the last one's result (an adapter
    image in the CPU tier's host memory, which would stay out of it and of the tier's budget)."""
    import gc
    import weakref

    class Result:
        pass

    executor = FairExecutor(1)
    try:
        future = executor.submit("t", Result)
        ref = weakref.ref(future.result(timeout=10))
        deadline = time.monotonic() + 10
        del future
        while ref() is not None and time.monotonic() < deadline:  # the thread may still be finishing the job
            gc.collect()
            time.sleep(0.01)
        assert ref() is None
    finally:
        executor.shutdown(wait=True)


def _slots_pool(max_slots: int, owners: dict[str, str]):
    from tests.worker.test_adapter_pool import make_pool

    pool = make_pool(max_slots=max_slots)
    for seed, (key, tenant) in enumerate(owners.items()):
        pool.add(key, random_weights(seed), tenant=tenant)
    return pool


def _take(pool, key: str, tenant: str) -> int:
    """`key`'s slot for a request of `tenant`, once it is on the GPU."""
    pool.acquire(key, waiter=key, tenant=tenant)
    pool.wait_idle()
    slot = pool.acquire(key, waiter=key, tenant=tenant)
    assert slot is not None
    return slot


def _waits_then_gets(pool, key: str, tenant: str, freed: int, by: str) -> None:
    """`key` waits for a slot until `by`'s request frees slot `freed`, then gets it."""
    assert pool.acquire(key, waiter=key, tenant=tenant) is None
    pool.release(freed, tenant=by)
    pool.wait_idle()
    assert pool.acquire(key, waiter=key, tenant=tenant) is not None
    pool.check()


def test_a_freed_gpu_slot_goes_to_the_tenant_holding_the_fewest_not_the_first_asked_for():
    """Tenant B holds both slots and waits for two more of its adapters; tenant A then asks for one. Each slot
    B's requests free went to B's next adapter (the order adapters were asked for), so A's request waited out
    B's whole burst (13-20 s for a first token). A freed slot goes to the tenant with the fewest slots in use:
    A's adapter takes the first, and B's take their turns after."""
    from tests.worker.test_adapter_pool import make_pool

    pool = make_pool(max_slots=2)
    for seed, (key, tenant) in enumerate({"b0@1": "B", "b1@1": "B", "b2@1": "B", "b3@1": "B", "a@1": "A"}.items()):
        pool.add(key, random_weights(seed), tenant=tenant)
    try:
        held = {key: pool.acquire(key, waiter=key, tenant="B") for key in ("b0@1", "b1@1")}
        pool.wait_idle()
        held = {key: slot if slot is not None else pool.acquire(key, waiter=key, tenant="B") for key, slot in held.items()}
        assert None not in held.values()
        for key, tenant in (("b2@1", "B"), ("b3@1", "B"), ("a@1", "A")):  # B's asked for first
            assert pool.acquire(key, waiter=key, tenant=tenant) is None
        pool.wait_idle()
        pool.release(held.pop("b0@1"))
        pool.wait_idle()
        assert pool.acquire("a@1", waiter="a@1", tenant="A") is not None
        assert pool.acquire("b2@1", waiter="b2@1", tenant="B") is None  # B keeps its slot, the other is A's
        pool.release(held.pop("b1@1"))
        pool.wait_idle()
        assert pool.acquire("b2@1", waiter="b2@1", tenant="B") is not None  # then B's, in the order it asked
        assert pool.acquire("b3@1", waiter="b3@1", tenant="B") is None
        pool.check()
    finally:
        pool.close()


def test_a_tenants_pinned_adapters_no_request_uses_do_not_put_its_requests_last():
    """Tenant A pins three adapters and its request waits for a fourth; tenant B uses the fourth slot and waits
    for more. Counted as busy, the pins put A behind B at every slot B freed, for as long as they stayed pinned."""
    pool = _slots_pool(4, {"p0@1": "A", "p1@1": "A", "p2@1": "A", "a@1": "A", "b0@1": "B", "b1@1": "B"})
    try:
        for key in ("p0@1", "p1@1", "p2@1"):
            pool.pin(key)
        b0 = _take(pool, "b0@1", "B")
        assert pool.acquire("a@1", waiter="a@1", tenant="A") is None  # asked for first
        assert pool.acquire("b1@1", waiter="b1@1", tenant="B") is None
        _waits_then_gets(pool, "a@1", "A", b0, "B")
    finally:
        pool.close()


def test_a_slot_goes_to_an_adapter_a_request_waits_for_before_a_pin_none_uses():
    """A request of tenant A (using a slot already) waits; then tenant C pins an adapter. C, holding none, took the
    slot B freed before A's request: a pin is not a request, as a warm-up is not."""
    pool = _slots_pool(2, {"a0@1": "A", "b@1": "B", "a@1": "A", "c@1": "C"})
    try:
        _take(pool, "a0@1", "A")
        b = _take(pool, "b@1", "B")
        assert pool.acquire("a@1", waiter="a@1", tenant="A") is None
        pool.pin("c@1")  # wanted on the GPU, by no request
        _waits_then_gets(pool, "a@1", "A", b, "B")
    finally:
        pool.close()


def test_an_adapter_lent_to_many_counts_for_the_tenants_using_it_not_the_one_that_read_it():
    """B's request read the shared adapter; A's requests use it and a0 now, B's none. Counted for the tenant whose
    read brought it in, B seemed to hold a slot and A one, and A's adapter (asked for first) took the slot B freed."""
    pool = _slots_pool(3, {"shared@1": "default", "a0@1": "A", "a1@1": "A", "b0@1": "B", "b1@1": "B"})
    try:
        pool.release(_take(pool, "shared@1", "B"), tenant="B")
        _take(pool, "shared@1", "A"), _take(pool, "a0@1", "A")
        b0 = _take(pool, "b0@1", "B")
        assert pool.acquire("a1@1", waiter="a1@1", tenant="A") is None
        _waits_then_gets(pool, "b1@1", "B", b0, "B")  # A holds two slots, B none
        assert pool.acquire("a1@1", waiter="a1@1", tenant="A") is None
    finally:
        pool.close()

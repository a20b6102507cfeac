"""Scheduler: budgets, chunked prefill, preemption by recompute, adapter-aware admission."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lorafleet.worker.block_manager import BlockManager
from lorafleet.worker.page_pool import PagePool, PagePoolConfig
from lorafleet.worker.sampling_params import SamplingParams
from lorafleet.worker.scheduler import Scheduler
from lorafleet.worker.sequence import Sequence, SequenceStatus

BS = 4


class FakeAdapterPool:
    """acquire answers a slot only for resident keys; counts references."""

    def __init__(self, resident=()):
        self.resident = {k: i for i, k in enumerate(resident)}
        self.refs: dict[int, int] = {}
        self.asked: list[str] = []
        self.abandoned: list[tuple[str, object]] = []
        self.broken: set[str] = set()

    def acquire(self, key, waiter=None, *, count=True, tenant=None):
        self.asked.append(key)
        if key in self.broken:
            raise RuntimeError(f"adapter {key}: load failed")
        slot = self.resident.get(key)
        if slot is not None:
            self.refs[slot] = self.refs.get(slot, 0) + 1
        return slot

    def release(self, slot, *, detach=None, tenant=None):
        self.refs[slot] -= 1

    def abandon(self, key, waiter, *, detach=False):
        self.abandoned.append((key, waiter))

    def entry(self, key):  # every key is a registered version no push replaced
        return SimpleNamespace(key=key, replaced=False, pinned=False, tenant="default", image=None)


def _sched(num_pages=64, adapter_pool=None, **kw):
    pool = PagePool(PagePoolConfig(num_pages=num_pages, page_elems=8))
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("max_num_batched_tokens", 64)
    sched = Scheduler(BlockManager(pool, BS), adapter_pool=adapter_pool, **kw)
    sched.min_stuck_s = 0.0  # these steps are the test's own: count steps alone
    return sched, pool


def _seq(n, adapter=None, max_tokens=100):
    return Sequence(f"r{n}", list(range(n)), SamplingParams(max_tokens=max_tokens), adapter=adapter)


def _run_step(sched):
    """What the engine does after the forward: advance the cache, append a token for samplers."""
    batch = sched.schedule()
    for seq, n in batch.scheduled:
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.output_token_ids.append(1)
    return batch


def test_prefill_and_decode_share_a_step_decodes_first():
    sched, _ = _sched()
    a = _seq(5)
    sched.add(a)
    _run_step(sched)
    b = _seq(7)
    sched.add(b)
    batch = _run_step(sched)
    assert batch.decodes == [a] and batch.prefills == [(b, 7)]
    assert [s for s, _ in batch.scheduled] == [a, b]


def test_token_and_sequence_budgets():
    sched, _ = _sched(max_num_batched_tokens=10, max_num_seqs=2, enable_chunked_prefill=False)
    seqs = [_seq(4), _seq(4), _seq(4)]
    for s in seqs:
        sched.add(s)
    batch = _run_step(sched)
    assert batch.num_tokens <= 10 and batch.num_seqs == 2 and sched.num_waiting == 1
    batch = _run_step(sched)
    assert batch.num_seqs == 2  # max_num_seqs holds the third back while two run


def test_chunked_prefill_splits_a_long_prompt():
    sched, _ = _sched(max_num_batched_tokens=8)
    long = _seq(21)
    sched.add(long)
    chunks = []
    while not long.output_token_ids:
        batch = _run_step(sched)
        chunks.append(batch.num_tokens)
    assert chunks == [8, 8, 5]
    assert long.num_computed_tokens == 21 and len(long.block_table) == 6


def test_without_chunking_a_prompt_over_the_remaining_budget_waits():
    sched, _ = _sched(max_num_batched_tokens=8, enable_chunked_prefill=False)
    a, b = _seq(5), _seq(6)
    sched.add(a)
    sched.add(b)
    assert _run_step(sched).prefills == [(a, 5)]  # b does not fit the 3 tokens left: it waits whole
    assert _run_step(sched).scheduled == [(a, 1), (b, 6)]


def test_without_chunking_a_prompt_over_the_whole_budget_is_chunked_not_stuck():
    # No step ever has room for 9 tokens: waiting for one would hang the request forever.
    sched, _ = _sched(max_num_batched_tokens=8, enable_chunked_prefill=False)
    seq = _seq(9)
    sched.add(seq)
    assert [_run_step(sched).num_tokens for _ in range(3)] == [8, 1, 1]
    assert seq.num_computed_tokens == 10 and len(seq.output_token_ids) == 2


def test_without_chunking_a_prompt_chunked_once_is_chunked_to_its_end_beside_decodes():
    """13 tokens never fit a step of 8: the first chunk takes what two decodes leave (6). The rest (7) fits a
    step, but not beside the decodes: waiting for a step with room for all of it would wait until they end."""
    sched, _ = _sched(max_num_batched_tokens=8, enable_chunked_prefill=False)
    old = [_seq(2), _seq(3)]
    for seq in old:
        sched.add(seq)
    _run_step(sched)
    long = _seq(13)
    sched.add(long)
    steps = [_run_step(sched) for _ in range(3)]
    assert [dict((s.request_id, n) for s, n in b.scheduled)[long.request_id] for b in steps] == [6, 6, 1]
    assert len(long.output_token_ids) == 1 and all(len(seq.output_token_ids) == 4 for seq in old)


def test_a_preempted_sequence_grown_past_the_budget_is_recomputed_without_chunking():
    sched, pool = _sched(num_pages=4, max_num_batched_tokens=8, enable_chunked_prefill=False)
    old, young = _seq(6), _seq(2)
    sched.add(old)
    sched.add(young)
    preempted = []
    while not preempted:
        preempted = _run_step(sched).preempted
    assert preempted == [young] and young.num_tokens <= 8
    for _ in range(8):  # young's recompute waits while old runs, and old grows past 8 tokens
        _run_step(sched)
    sched.finish(old, "length")
    young.output_token_ids += [1] * (9 - young.num_tokens)  # regrown past the step budget
    steps = [_run_step(sched) for _ in range(2)]
    assert [b.num_tokens for b in steps] == [8, 1] and young.status is SequenceStatus.RUNNING
    sched.finish(young, "length")
    assert pool.num_used("kv") == 0


def test_every_decode_of_a_step_samples():
    """A one-token chunk of an unfinished prefill is a prefill: decodes are what a decode-only step
    (CUDA graphs) samples for every row."""
    sched, _ = _sched(max_num_batched_tokens=3)
    a, b = _seq(2), _seq(2)
    sched.add(a)
    sched.add(b)
    batch = _run_step(sched)
    assert batch.decodes == [] and batch.prefills == [(a, 2), (b, 1)]  # b's chunk samples nothing
    batch = _run_step(sched)
    assert batch.decodes == [a, b] and all(s.num_uncomputed_tokens == 1 for s in batch.decodes)


def test_preemption_frees_the_youngest_and_recomputes_it_later():
    # 6 pages of 4 tokens. Two sequences of 8 tokens take 4 pages; decoding needs more.
    sched, pool = _sched(num_pages=5)
    old, young = _seq(8), _seq(8)
    sched.add(old)
    sched.add(young)
    _run_step(sched)
    assert pool.num_used("kv") == 4
    preempted = []
    for _ in range(8):
        batch = _run_step(sched)
        preempted += batch.preempted
        if preempted:
            break
    assert preempted == [young]
    assert young.status is SequenceStatus.WAITING and young.block_table == [] and young.num_computed_tokens == 0
    assert young.num_preemptions == 1 and next(iter(sched.waiting)) is young
    assert young.output_token_ids  # generated tokens are kept and recomputed with the prompt
    sched.finish(old, "length")
    num_tokens = young.num_tokens
    batch = _run_step(sched)
    assert batch.prefills == [(young, num_tokens)]


def test_finish_frees_pages_at_once():
    sched, pool = _sched()
    seqs = [_seq(n) for n in (3, 9, 4)]
    for s in seqs:
        sched.add(s)
    _run_step(sched)
    assert pool.num_used("kv") > 0
    for s in seqs:
        sched.finish(s, "stop")
    assert pool.num_used("kv") == 0 and not sched.has_unfinished()
    pool.check()


def test_sequence_waits_for_its_adapter_while_others_run():
    adapters = FakeAdapterPool(resident=["a@1"])
    sched, _ = _sched(adapter_pool=adapters)
    cold, hot, base = _seq(3, "b@1"), _seq(4, "a@1"), _seq(5)
    for s in (cold, hot, base):
        sched.add(s)
    batch = _run_step(sched)
    assert [s for s, _ in batch.scheduled] == [hot, base]
    assert list(sched.waiting) == [cold] and cold.adapter_slot is None
    adapters.resident["b@1"] = 1  # the load finished
    batch = _run_step(sched)
    assert cold in [s for s, _ in batch.scheduled] and cold.adapter_slot == 1
    for s in (cold, hot, base):
        sched.finish(s, "stop")
    assert all(n == 0 for n in adapters.refs.values())


def test_preempted_sequence_keeps_its_adapter_reference():
    adapters = FakeAdapterPool(resident=["a@1"])
    sched, _ = _sched(num_pages=5, adapter_pool=adapters)
    old, young = _seq(8), _seq(8, "a@1")
    sched.add(old)
    sched.add(young)
    while not young.num_preemptions:
        _run_step(sched)
    assert young.adapter_slot == 0 and adapters.refs[0] == 1
    asked = len(adapters.asked)
    sched.finish(old, "stop")
    _run_step(sched)
    assert len(adapters.asked) == asked  # re-admitted on the reference it kept
    sched.finish(young, "stop")
    assert adapters.refs[0] == 0


def test_abort_while_waiting_for_an_adapter_abandons_the_load():
    adapters = FakeAdapterPool()
    sched, _ = _sched(adapter_pool=adapters)
    seq = _seq(3, "b@1")
    sched.add(seq)
    _run_step(sched)
    sched.finish(seq, "abort")
    assert adapters.abandoned == [("b@1", seq.seq_id)] and not sched.has_unfinished()


def test_failed_adapter_load_fails_only_its_requests():
    adapters = FakeAdapterPool(resident=["a@1"])
    adapters.broken.add("bad@1")
    sched, _ = _sched(adapter_pool=adapters)
    bad, good = _seq(3, "bad@1"), _seq(4, "a@1")
    sched.add(bad)
    sched.add(good)
    batch = _run_step(sched)
    assert [s for s, _ in batch.scheduled] == [good]
    assert sched.failed == [bad] and bad.finish_reason == "error" and "load failed" in bad.error


def test_max_loras_per_batch_bounds_distinct_adapters_then_lets_the_starved_in():
    keys = [f"x{i}@1" for i in range(4)]
    adapters = FakeAdapterPool(resident=keys)
    sched, _ = _sched(adapter_pool=adapters, max_loras_per_batch=2, max_adapter_wait_steps=3)
    seqs = [_seq(3 + i, k, max_tokens=100) for i, k in enumerate(keys)]
    for s in seqs:
        sched.add(s)
    batch = _run_step(sched)
    assert batch.adapters() == {"x0@1", "x1@1"}
    for _ in range(2):
        assert _run_step(sched).adapters() == {"x0@1", "x1@1"}
    # After max_adapter_wait_steps skipped steps the others are admitted despite the bound.
    batch = _run_step(sched)
    assert batch.adapters() == set(keys)


def test_a_starved_sequence_preempted_after_its_wait_does_not_wait_the_bound_again():
    """The wait bound is paid once: a sequence let in past max_loras_per_batch, then preempted, keeps its
    skipped steps and goes back in at once, not after another max_adapter_wait_steps steps."""
    adapters = FakeAdapterPool(resident=["x0@1", "x1@1"])
    sched, _ = _sched(adapter_pool=adapters, max_loras_per_batch=1, max_adapter_wait_steps=3)
    busy, late = _seq(3, "x0@1", max_tokens=100), _seq(4, "x1@1", max_tokens=100)
    sched.add(busy)
    sched.add(late)
    steps = 0
    while late not in sched.running:
        _run_step(sched)
        steps += 1
    assert steps == 4  # skipped three steps, then let in beside x0
    from lorafleet.worker.scheduled_batch import ScheduledBatch

    sched._preempt(late, ScheduledBatch())  # pages ran short: back to the head of its queue
    assert late not in sched.running and _run_step(sched).adapters() == {"x0@1", "x1@1"}


def test_mixed_workload_leaves_no_page_behind():
    sched, pool = _sched(num_pages=5, max_num_batched_tokens=7)
    seqs = [_seq(n, max_tokens=m) for n, m in ((3, 5), (11, 2), (6, 9), (2, 4), (9, 3))]
    for s in seqs:
        sched.add(s)
    for _ in range(200):
        if not sched.has_unfinished():
            break
        _run_step(sched)
        for s in list(sched.running):
            if len(s.output_token_ids) >= s.params.max_tokens:
                sched.finish(s, "length")
        pool.check()
    assert not sched.has_unfinished() and pool.num_used("kv") == 0 and sched.num_preemptions > 0


def test_idle_adapter_pages_are_reclaimed_before_preempting():
    sched, pool = _sched(num_pages=5)
    idle = pool.allocate(2, ("adapter", "idle@1"))
    calls = []

    def reclaim(num_pages):
        calls.append(num_pages)
        if not pool.pages_of(("adapter", "idle@1")):
            return 0
        pool.free(idle)
        return len(idle)

    sched.reclaim_pages = reclaim
    a, b = _seq(8), _seq(8)
    sched.add(a)
    sched.add(b)
    batch = _run_step(sched)
    assert [s for s, _ in batch.scheduled] == [a, b] and calls  # b got the idle adapter's pages
    while a.num_computed_tokens < 12:
        assert not _run_step(sched).preempted or not pool.pages_of(("adapter", "idle@1"))
    assert pool.pages_of(("adapter", "idle@1")) == []


def test_a_request_that_can_never_fit_fails_instead_of_blocking_the_queue():
    sched, pool = _sched(num_pages=3)
    pool.allocate(2, ("adapter", "pinned@1"))  # pages nobody gives back
    big, small = _seq(9), _seq(3)
    sched.add(big)
    sched.add(small)
    steps = 0
    while not sched.failed:
        batch = _run_step(sched)
        steps += 1
        assert steps <= sched.max_stuck_steps + 1
    assert sched.failed == [big] and "KV pages" in big.error and big.finish_reason == "error"
    assert [s for s, _ in batch.scheduled] == [small]


def _stream_of_new_tenants(sched, big, steps):
    """Each step a tenant with nothing running or queued sends a short request (3 tokens to generate), and
    `big` is queued once three are running; the step at which `big` is admitted, or None."""
    for step in range(steps):
        sched.add(Sequence(f"small{step}", [1, 2], SamplingParams(max_tokens=3), tenant=f"b{step}"))
        if step == 3:
            sched.add(big)
        batch = _run_step(sched)
        for seq, _ in batch.scheduled:
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                sched.finish(seq, "length")
        if any(seq is big for seq, _ in batch.scheduled):
            return step
    return None


@pytest.mark.parametrize("older_head", [False, True])
def test_a_stream_of_other_tenants_requests_does_not_hold_a_large_prompt_back_for_ever(older_head):
    """Tenant a runs one request, so tenants running none rank ahead of it, and their short requests took
    the pages running requests gave back before its large prompt's turn, step after step. Passed over for
    pages max_adapter_wait_steps times, it keeps its place (also behind an older head of its own that
    waits for its adapter): the others wait behind it until it fits."""
    pool = PagePool(PagePoolConfig(num_pages=4, page_elems=8))
    sched = Scheduler(BlockManager(pool, 256), max_num_seqs=8, max_num_batched_tokens=1024, enable_chunked_prefill=False,
                      adapter_pool=FakeAdapterPool(resident=()))
    runner = Sequence("runner", [1], SamplingParams(max_tokens=1000), tenant="a")  # one page as long as the test
    sched.add(runner)
    _run_step(sched)
    if older_head:
        sched.add(Sequence("lora", [1], SamplingParams(max_tokens=1), tenant="a", adapter="x@1"))  # never resident
    big = Sequence("big", list(range(300)), SamplingParams(max_tokens=1), tenant="a")  # two pages
    admitted_at = _stream_of_new_tenants(sched, big, 4 * sched.max_adapter_wait_steps)
    assert admitted_at is not None and admitted_at <= sched.max_adapter_wait_steps + 4
    assert not sched.failed and runner.status is SequenceStatus.RUNNING


class SizedAdapters(FakeAdapterPool):
    """No adapter is resident; each takes `num_pages` GPU pages once placed."""

    def __init__(self, num_pages):
        super().__init__(resident=())
        self.num_pages = num_pages

    def entry(self, key):
        return SimpleNamespace(image=SimpleNamespace(num_pages=self.num_pages), pinned=False)


def _adapter_waits_for_room(pool, adapter_pages, reclaim=None):
    """A scheduler over `pool` (512-token pages, no chunked prefill) where tenant a runs one request (one
    page throughout) and x@1, `adapter_pages` pages, has waited past max_adapter_wait_steps (4) for a slot:
    its pages are kept free from then on."""
    sched = Scheduler(BlockManager(pool, 512), max_num_seqs=8, max_num_batched_tokens=8192, enable_chunked_prefill=False,
                      adapter_pool=SizedAdapters(adapter_pages), max_adapter_wait_steps=4,
                      adapter_state=lambda key: "room", reclaim_pages=reclaim)
    sched.add(Sequence("runner", [1], SamplingParams(max_tokens=10_000), tenant="a"))
    _run_step(sched)
    sched.add(Sequence("x", [1, 2], SamplingParams(max_tokens=2), tenant="t1", adapter="x@1"))  # never gets a slot
    for _ in range(6):
        _run_step(sched)
    return sched


def test_a_head_short_of_pages_is_counted_also_while_pages_are_kept_for_an_adapter():
    """An adapter waiting for a slot keeps a page free for as long as it waits; a long prompt that does not
    fit even with that page was not counted meanwhile, and newcomers held it back all that time."""
    sched = _adapter_waits_for_room(PagePool(PagePoolConfig(num_pages=6, page_elems=8)), adapter_pages=1)
    big = Sequence("big", list(range(4 * 512)), SamplingParams(max_tokens=1), tenant="a")  # 4 of the 5 free pages
    assert _stream_of_new_tenants(sched, big, 100) is not None


def test_counting_a_head_short_of_pages_evicts_no_idle_adapter():
    """Whether a head held back while pages are kept for an adapter is short anyway is looked at without
    reclaiming: the look evicted an idle adapter for a head it then did not admit."""
    pool = PagePool(PagePoolConfig(num_pages=8, page_elems=8))
    idle = pool.allocate(2, ("adapter", "idle@1"))
    evicted = []

    def reclaim(n):  # as the adapter pool's: all of what is asked, or nothing
        if len(idle) < n or evicted:
            return 0
        pool.free(idle)
        evicted.append(n)
        return len(idle)

    pool.set_reclaimer("adapter", reclaim)
    sched = _adapter_waits_for_room(pool, adapter_pages=2, reclaim=reclaim)
    sched.add(Sequence("big", list(range(6 * 512)), SamplingParams(max_tokens=1), tenant="a"))  # 6: 5 free, 2 idle
    for _ in range(3):
        _run_step(sched)
    assert not evicted and pool.pages_of(("adapter", "idle@1"))


def test_tenants_that_just_arrived_do_not_take_every_seat_from_one_that_waits():
    """A tenant with nothing running or queued ranked as never served, ahead of every other: tenants sending
    one request at a time took every seat as it came free, and a served tenant's queued request never ran."""
    sched, _ = _sched(max_num_seqs=3)
    for tenant in ("c", "d"):
        sched.add(Sequence(f"pre-{tenant}", [1, 2], SamplingParams(max_tokens=3), tenant=tenant))
    sched.add(Sequence("first", [1], SamplingParams(max_tokens=1), tenant="a"))  # takes the last seat
    big = Sequence("big", list(range(3 * BS)), SamplingParams(max_tokens=1), tenant="a")
    sched.add(big)
    for step in range(40):
        sched.add(Sequence(f"small{step}", [1, 2], SamplingParams(max_tokens=3), tenant=f"b{step % 5}"))
        batch = _run_step(sched)
        for seq, _ in batch.scheduled:
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                sched.finish(seq, "length")
        if any(seq is big for seq, _ in batch.scheduled):
            break
    else:
        raise AssertionError("tenant a's second request never ran")


def test_a_head_held_back_by_pages_kept_for_an_adapter_is_not_counted_as_short_of_pages():
    """Pages kept free for a request starved for its adapter's room are not the head's to take: counting
    those steps ranked it first, ahead of the reservation, and it took the kept pages."""
    sched, pool = _sched(num_pages=9, adapter_pool=SizedAdapters(3), max_adapter_wait_steps=2,
                         adapter_state=lambda key: "room")
    long = Sequence("long", [1], SamplingParams(max_tokens=10_000), tenant="r")  # something runs
    sched.add(long)
    _run_step(sched)
    pool.allocate(3, ("adapter", "other@1"))  # 5 pages free
    sched.add(Sequence("x", [1, 2], SamplingParams(max_tokens=2), tenant="t1", adapter="x@1"))
    for _ in range(3):
        _run_step(sched)
    head = Sequence("h", list(range(3 * BS)), SamplingParams(max_tokens=2), tenant="t2")  # 3 pages: 3 must stay free
    sched.add(head)
    for _ in range(8):
        _run_step(sched)
        assert head.status is SequenceStatus.WAITING and pool.num_free >= 3


def test_the_wait_of_an_aborted_stuck_head_is_not_charged_to_the_next_request():
    """Nothing runs and the head waits for pages an adapter copy in flight holds; its client gives up. The
    next request, which fits once the copy is done, gets a wait of its own, not what was left of the
    aborted one's (it failed with CapacityError at its first step)."""
    sched, pool = _sched(num_pages=4)
    sched.max_stuck_steps = 5
    copying = pool.allocate(3, ("adapter", "copying@1"))  # not reclaimable until the copy is done
    gone = _seq(9)
    sched.add(gone)
    for _ in range(sched.max_stuck_steps):
        assert _run_step(sched).is_empty and not sched.failed
    sched.finish(gone, "abort")
    later = _seq(5)
    sched.add(later)
    assert _run_step(sched).is_empty and not sched.failed
    pool.free(copying)
    assert _run_step(sched).prefills == [(later, 5)]


def test_pages_taken_by_another_thread_between_check_and_allocate():
    """An adapter load on another thread may take the pages between can_allocate and allocate: the
    request waits for the next step instead of the step failing."""

    class RacyPool(PagePool):
        steal = True

        def allocate(self, num_pages, owner, *, used_elems=None):
            if owner[0] == "kv" and self.steal:
                self.steal = False
                super().allocate(self.num_free, ("adapter", "thief@1"))
            return super().allocate(num_pages, owner, used_elems=used_elems)

    pool = RacyPool(PagePoolConfig(num_pages=4, page_elems=8))
    sched = Scheduler(BlockManager(pool, BS), max_num_seqs=4, max_num_batched_tokens=64)
    seq = _seq(5)
    sched.add(seq)
    assert _run_step(sched).is_empty and list(sched.waiting) == [seq] and seq.block_table == []
    pool.free_owner(("adapter", "thief@1"))
    assert _run_step(sched).prefills == [(seq, 5)]


def test_fail_all_ends_running_and_waiting_sequences_and_frees_everything():
    """Shutdown after the grace: every sequence ends with the given error, its pages and adapter
    reference come back at once, and the failures stay pending until the engine reports them."""
    adapters = FakeAdapterPool(resident=["a@1"])
    sched, pool = _sched(adapter_pool=adapters, max_num_seqs=1)
    running, waiting, loading = _seq(5, "a@1"), _seq(3), _seq(4, "b@1")
    for s in (running, waiting, loading):
        sched.add(s)
    _run_step(sched)
    assert running.status is SequenceStatus.RUNNING and pool.num_used("kv") > 0
    exc = RuntimeError("the worker is shutting down")
    sched.fail_all(exc)
    assert sorted(s.request_id for s in sched.failed) == sorted(s.request_id for s in (running, waiting, loading))
    assert all(s.finish_reason == "error" and s.exception is exc and s.error == str(exc) for s in sched.failed)
    assert pool.num_used("kv") == 0 and adapters.refs[0] == 0
    assert sched.has_unfinished()  # until the engine reports the failures
    sched.failed.clear()
    assert not sched.has_unfinished() and sched.num_running == sched.num_waiting == 0


def test_a_stuck_head_makes_queued_requests_let_go_of_their_adapters():
    """Nothing runs and the head needs pages that adapter a holds, referenced by a queued request (as a
    preempted one keeps its reference): that request lets go of a, so a can be evicted for the head; it
    takes a again when its turn comes."""
    adapters = FakeAdapterPool(resident=["a@1"])
    sched, pool = _sched(num_pages=4, adapter_pool=adapters)
    sched.adapter_state = lambda key: "gpu" if key in adapters.resident else "load"
    a_pages = pool.allocate(2, ("adapter", "a@1"))

    def reclaim(num_pages):  # the adapter pool evicts only what nobody holds
        if adapters.refs.get(0) or "a@1" not in adapters.resident:
            return 0
        pool.free(a_pages)
        del adapters.resident["a@1"]
        return len(a_pages)

    sched.reclaim_pages = reclaim
    head, holder = _seq(9), _seq(3, "a@1")
    holder.adapter_slot = adapters.acquire("a@1")
    sched.add(head)
    sched.add(holder)
    assert _run_step(sched).is_empty  # 2 pages free, the head needs 3
    assert holder.adapter_slot is None and adapters.refs[0] == 0
    assert _run_step(sched).prefills == [(head, 9)] and list(sched.waiting) == [holder]
    sched.finish(head, "stop")
    adapters.resident["a@1"] = 0  # loaded again
    assert _run_step(sched).prefills == [(holder, 3)] and holder.adapter_slot == 0


def test_a_full_batch_looks_at_no_waiting_tenant(monkeypatch):
    """With every seat taken no waiting request can be admitted, but each step ranked every waiting tenant (sorting
    their adapters' heads): 1,000 waiting tenants added about 2 ms to every decode step of a full batch of 64."""
    sched, _ = _sched(num_pages=512, max_num_seqs=2, max_num_batched_tokens=64)
    for n in (3, 4):
        sched.add(_seq(n))
    _run_step(sched)
    assert len(sched.running) == 2
    for i in range(50):
        seq = _seq(5 + i)
        seq.tenant = f"t{i}"
        sched.add(seq)
    ranked = []
    real = sched.waiting.rank
    monkeypatch.setattr(sched.waiting, "rank", lambda t: ranked.append(t) or real(t))
    for _ in range(3):
        batch = _run_step(sched)
        assert {s.seq_id for s, _ in batch.scheduled} == {s.seq_id for s in sched.running}
    assert ranked == [] and len(sched.waiting.tenants()) == 50
    sched.finish(sched.running[0], "stop")  # a seat frees: the waiting tenants are looked at again
    _run_step(sched)
    assert ranked and len(sched.running) == 2

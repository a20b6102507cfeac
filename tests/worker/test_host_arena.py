"""HostArena: the CPU tier's images in pages of fixed-size slabs, given back once dropped, copied to the
device run by run, and the host memory it holds bounded by the pages its images hold."""

from __future__ import annotations

import gc
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from lorafleet.worker import host_arena
from lorafleet.worker.adapter_image import pack_adapter
from lorafleet.worker.host_arena import HostArena, HostPages
from lorafleet.worker.page_copier import PageCopier
from tests.lora_factory import TINY_DIMS, random_weights

PAGE_ELEMS = 1000
PAGE_BYTES = PAGE_ELEMS * 4


def small_arena(**kw) -> HostArena:
    """Slabs of 8 pages (32 KiB), no spare slabs unless asked."""
    return HostArena(PAGE_ELEMS, torch.float32, **{"slab_bytes": 8 * PAGE_BYTES, "spare_bytes": 0, **kw})


def test_slabs_are_a_power_of_two_of_bytes_holding_whole_pages():
    arena = HostArena(1000, torch.float32, slab_bytes=10_000)  # 4000-byte pages
    assert (arena.slab_bytes, arena.slab_pages) == (16384, 4)
    big = HostArena(3000, torch.bfloat16, slab_bytes=1024)  # a page larger than the slab asked
    assert (big.slab_bytes, big.slab_pages) == (8192, 1)
    assert HostArena(1000, torch.float32).slab_bytes == host_arena.SLAB_BYTES
    huge = HostArena(20 << 20, torch.bfloat16)  # 40 MiB pages (a 70B model's KV block of 128 tokens)
    assert (huge.slab_bytes, huge.slab_pages) == (1 << 30, 25)  # not 64 MiB holding one page and 24 MiB of tail


def test_loads_short_of_pages_at_once_add_slabs_for_one_shortfall_not_each():
    """Threads that find too few free pages at the same time do not each page-lock slabs for the same
    shortfall: one adds slabs, the others take its surplus."""
    import threading
    import time

    arena = small_arena(budget_bytes=1 << 20)
    new_slab = arena._new_slab

    def slow_slab():
        time.sleep(0.02)  # page-locking takes a while
        return new_slab()

    arena._new_slab = slow_slab
    start, held = threading.Barrier(10), []

    def load():
        start.wait()
        held.append(arena.allocate(1))

    threads = [threading.Thread(target=load) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(p.num_pages for p in held) == 10
    assert arena.reserved_bytes <= (10 // arena.slab_pages + 1) * arena.slab_bytes  # 2 slabs, not 10


def test_images_still_held_keep_their_pages_through_interpreter_exit(tmp_path):
    """At exit, the finalizers of images still held do not free their pages: a loader thread finishing a
    read then (they are daemon threads) never writes into an image someone still reads."""
    import subprocess
    import sys

    script = tmp_path / "exit.py"
    script.write_text(
        "import weakref, torch\n"
        "from lorafleet.worker.host_arena import HostArena\n"
        "arena = HostArena(1000, torch.float32, slab_bytes=32000, spare_bytes=1 << 20)\n"
        "def late():  # a finalizer older than the image's: at exit it runs after it (newest run first)\n"
        "    other = arena.allocate(1)\n"
        "    other.page(0).fill_(7.0)\n"
        "    print('held', float(keep.page(0)[0]))\n"
        "class Anchor:\n"
        "    pass\n"
        "anchor = Anchor()\n"
        "weakref.finalize(anchor, late)\n"
        "keep = arena.allocate(1)\n"
        "keep.page(0).fill_(1.0)\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "PYTHONPATH": ":".join(sys.path)})
    assert "held 1.0" in out.stdout, out.stdout + out.stderr


def test_pages_come_back_once_dropped_and_are_handed_out_again_zeroed():
    arena = small_arena()
    a = arena.allocate(5)
    for i in range(5):
        a.page(i).fill_(i + 1)
    assert arena.reserved_bytes == arena.slab_bytes and arena.used_bytes == 5 * PAGE_BYTES
    del a
    assert arena.used_bytes == 0 and arena.reserved_bytes == arena.slab_bytes  # kept for the next image
    arena.collect()
    assert arena.reserved_bytes == 0  # empty, beyond a budget of 0: given back
    arena.set_budget(10 * arena.slab_bytes)
    b = arena.allocate(6)
    c = arena.allocate(2)
    b.page(0).fill_(7)
    del b
    d = arena.allocate(6)  # b's pages again, in the slab it already holds
    assert arena.reserved_bytes == arena.slab_bytes
    assert not d.tensor().any() and not c.tensor().any()


def test_an_image_takes_free_pages_wherever_they_are():
    """Freed pages between live images are used, split over runs: no page waits for a neighbour."""
    arena = small_arena(budget_bytes=1 << 20)
    held = [arena.allocate(1) for _ in range(8)]  # one slab, page by page
    for i in (1, 3, 5):  # pages 1, 3 and 5 are free now (non-adjacent)
        held[i] = None
    image = arena.allocate(3)
    assert arena.reserved_bytes == arena.slab_bytes  # no new slab
    assert len(image.chunks) == 3 and image.num_pages == 3
    for i in range(3):
        image.page(i).fill_(10 + i)
    assert [int(image.page(i)[0]) for i in range(3)] == [10, 11, 12]
    assert [(off, piece.shape[0]) for off, piece in image.slices(0, 3)] == [(0, 1), (1, 1), (2, 1)]
    with pytest.raises(IndexError):
        image.page(3)
    more = arena.allocate(10)  # past the free pages: new slabs
    assert arena.reserved_bytes == 3 * arena.slab_bytes and more.num_pages == 10


def test_images_packed_into_reused_pages_hold_the_same_bytes_and_digest():
    """Pages handed out again are zeroed: an image's digest (its identity in the pool) never depends on
    what the memory held before, and its rows read back as packed."""
    arena = small_arena(budget_bytes=1 << 20)
    weights = random_weights(3, rank=8)
    own = pack_adapter(weights.modules, TINY_DIMS, page_elems=PAGE_ELEMS, max_rank=32, dtype=torch.float32)
    junk = [arena.allocate(3) for _ in range(6)]
    for pages in junk:
        for chunk in pages.chunks:
            chunk.fill_(float("nan"))
    for i in (0, 2, 4):  # scattered dirty pages
        junk[i] = None
    image = pack_adapter(weights.modules, TINY_DIMS, page_elems=PAGE_ELEMS, max_rank=32, dtype=torch.float32,
                         allocate=arena.allocate)
    assert len(image.pages.chunks) > 1
    assert image.digest == own.digest
    assert torch.equal(image.pages.tensor(), own.pages.tensor())


def test_a_copy_reads_an_image_split_over_chunks_into_the_right_pool_pages():
    arena = small_arena(budget_bytes=1 << 20)
    spacers = [arena.allocate(1) for _ in range(8)]
    for i in (0, 3, 6):  # free pages 0, 3 and 6 of the first slab
        spacers[i] = None
    image = arena.allocate(6)  # 3 single pages, then 3 of a new slab
    for i in range(6):
        image.page(i).fill_(i + 1)
    pool = torch.zeros(12, PAGE_ELEMS)
    page_ids = [9, 10, 2, 3, 4, 7]  # runs of the pool: 9-10, 2-4, 7
    with ThreadPoolExecutor(1) as executor:
        copier = PageCopier(pool, executor)
        handle = copier.start(image, page_ids)
        copier.seconds(handle)
    for i, pid in enumerate(page_ids):
        assert torch.all(pool[pid] == i + 1), pid
    assert pool[[0, 1, 5, 6, 8, 11]].abs().sum() == 0


def test_pages_a_copy_still_reads_stay_out_of_the_arena():
    arena = small_arena()
    image = arena.allocate(4)
    image.page(0).fill_(5)
    pool = torch.zeros(4, PAGE_ELEMS)
    with ThreadPoolExecutor(1) as executor:
        copier = PageCopier(pool, executor)
        handle = copier.start(image, [0, 1, 2, 3])
        del image
        gc.collect()
        arena.collect()
        assert arena.used_bytes == 4 * PAGE_BYTES  # the handle holds them
        copier.seconds(handle)
    del handle
    assert arena.used_bytes == 0
    assert torch.all(pool[0] == 5)


def test_a_dropped_image_in_a_reference_cycle_comes_back_at_the_next_call():
    """The pages of an image collected by the cycle collector (any thread, possibly inside the arena's own
    code) are only queued by its finalizer, and freed by the next call."""
    arena = small_arena(budget_bytes=1 << 20)
    cycle: list = [arena.allocate(3)]
    cycle.append(cycle)
    del cycle
    gc.collect()
    assert arena.used_bytes == 0
    assert arena.allocate(8).num_pages == 8 and arena.reserved_bytes == arena.slab_bytes


def test_host_memory_stays_within_the_most_pages_held_plus_one_slab():
    """Over a random churn of images of many sizes, the arena never holds more than the most pages its
    images held at once plus one slab, and at a budget it gives the rest back once images are dropped.
    torch's pinned allocator, by comparison, rounds each image up to a power of two."""
    rng = random.Random(5)
    arena = small_arena(budget_bytes=64 * PAGE_BYTES, spare_bytes=2 * 8 * PAGE_BYTES)
    live: list[HostPages] = []
    peak = 0
    for _ in range(600):
        if live and (rng.random() < 0.45 or sum(p.num_pages for p in live) > 80):
            live.pop(rng.randrange(len(live)))
        else:
            live.append(arena.allocate(rng.randint(1, 13)))
        used = sum(p.num_pages for p in live)
        assert arena.used_bytes == used * PAGE_BYTES
        peak = max(peak, used)
        assert arena.reserved_bytes // arena.slab_bytes * arena.slab_pages <= peak + arena.slab_pages
    live.clear()
    arena.collect()
    assert arena.used_bytes == 0 and arena.reserved_bytes <= 64 * PAGE_BYTES + 2 * arena.slab_bytes


def test_the_pool_packs_into_its_arena_and_reports_its_host_memory(monkeypatch):
    from prometheus_client import CollectorRegistry, generate_latest

    from lorafleet.worker.adapter_pool import AdapterPool, AdapterPoolConfig
    from lorafleet.worker.page_pool import PagePool, PagePoolConfig

    monkeypatch.setattr(host_arena, "SLAB_BYTES", 16 * PAGE_BYTES)
    pages = PagePool(PagePoolConfig(num_pages=128, page_elems=PAGE_ELEMS))
    pool = AdapterPool(pages, TINY_DIMS, AdapterPoolConfig(max_slots=2, max_rank=32, num_load_threads=1))
    try:
        pool.add("probe@1", random_weights(0))
        size = pool.entry("probe@1").image.nbytes
        pool.configure(cpu_budget_bytes=3 * size)
        for i in range(12):
            pool.add(f"c{i}@1", loader=lambda i=i: random_weights(i))
            pool.load(f"c{i}@1")  # through the GPU tier and its copies, two slots
            stats = pool.stats()
            assert stats["bytes"]["cpu"] <= 3 * size
            assert stats["host_bytes"]["used"] <= 4 * size  # the images, and one being read before the trim
        pool.check()
        stats = pool.stats()
        slab = pool._arena.slab_bytes
        assert stats["host_bytes"]["used"] == stats["bytes"]["cpu"]
        assert stats["host_bytes"]["reserved"] <= 3 * size + pool._arena.spare_bytes + slab
        registry = CollectorRegistry()
        for c in pool.metrics.collectors():
            registry.register(c)
        text = generate_latest(registry).decode()
        assert f'lorafleet_adapter_host_memory_bytes{{state="used"}} {float(stats["bytes"]["cpu"])}' in text
        assert pool._arena.figures() == stats["host_bytes"]
        pool.configure(cpu_budget_bytes=0)  # every idle image leaves, and the slabs beyond the spare with them
        host = pool.stats()["host_bytes"]
        assert host["used"] == 0 and 0 < host["reserved"] <= pool._arena.spare_bytes
    finally:
        pool.close()


def test_on_gpu_hosts_the_gauge_also_reports_all_page_locked_memory(monkeypatch):
    """Slabs given back stay page-locked in torch's pinned cache: `pinned` reports what the allocator holds."""
    from prometheus_client import CollectorRegistry, generate_latest

    from lorafleet.worker.adapter_metrics import AdapterMetrics

    monkeypatch.setattr(torch.cuda, "host_memory_stats", lambda: {"allocated_bytes.current": 3 << 30}, raising=False)
    metrics = AdapterMetrics()
    metrics.watch_arena(HostArena(PAGE_ELEMS, torch.float32, pin=True))
    registry = CollectorRegistry()
    registry.register(metrics.host_bytes)
    assert 'lorafleet_adapter_host_memory_bytes{state="pinned"} 3.221225472e+09' in generate_latest(registry).decode()
    cpu_only = AdapterMetrics()
    cpu_only.watch_arena(small_arena())
    registry = CollectorRegistry()
    registry.register(cpu_only.host_bytes)
    assert 'state="pinned"' not in generate_latest(registry).decode()

"""The adapter pool's invariants, checked by tests after every step of a churn (and usable in debugging):
every page is free xor owned once; adapter pages belong to registered adapters holding a slot; slots
are not leaked or shared; a slot is visible to kernels (rank > 0) only once its copy finished; only
resident adapters have references; tenant quotas hold; every name's current version exists.
"""

from __future__ import annotations

from lorafleet.worker.adapter_entry import AdapterEntry


def check_adapter_pool(*, page_pool, layout, entries: dict[str, AdapterEntry], slot_owner: dict[int, AdapterEntry],
                       free_slots: list[int], config, current: dict[str, str]) -> None:
    """Raise AssertionError naming the first broken invariant."""
    page_pool.check()
    owners = set(page_pool.owners("adapter"))
    seen_slots: set[int] = set()
    tenants: dict[str, list[AdapterEntry]] = {}
    ranks = layout.ranks.cpu()
    for e in entries.values():
        assert e.refcount >= 0, f"{e.key}: refcount {e.refcount}"
        assert e.refcount == 0 or e.resident, f"{e.key}: referenced but not resident"
        if e.on_gpu:
            assert e.slot not in seen_slots, f"slot {e.slot} held twice"
            seen_slots.add(e.slot)
            assert slot_owner.get(e.slot) is e, f"{e.key}: slot table disagrees"
            assert page_pool.pages_of(("adapter", e.key)) == e.page_ids, f"{e.key}: pages disagree"
            owners.discard(("adapter", e.key))
            tenants.setdefault(e.tenant, []).append(e)
        else:
            assert not e.page_ids and not e.resident, f"{e.key}: pages without a slot"
        if not e.resident and e.slot is not None:
            assert int(ranks[:, :, e.slot].abs().sum()) == 0, f"{e.key}: visible before its copy finished"
    assert not owners, f"adapter pages owned by unknown adapters: {owners}"
    assert seen_slots.isdisjoint(free_slots), "a slot is both free and held"
    assert len(seen_slots) + len(free_slots) == config.max_slots, "slots leaked"
    for slot in free_slots:
        assert int(ranks[:, :, slot].abs().sum()) == 0, f"free slot {slot} still visible to kernels"
    for tenant, held in tenants.items():
        quota = config.quota(tenant)
        assert quota.max_adapters is None or len(held) <= quota.max_adapters, f"{tenant}: over adapter quota"
        assert quota.max_bytes is None or sum(e.gpu_bytes for e in held) <= quota.max_bytes, \
            f"{tenant}: over byte quota"
    for name, key in current.items():
        assert key in entries and not entries[key].replaced, f"{name}: current {key} missing or replaced"
    for e in entries.values():  # a retirement waits only for requests that hold the version or will take it again
        assert e.retire_pending is None or e.refcount > 0 or e.detached, f"{e.key}: retirement left pending"

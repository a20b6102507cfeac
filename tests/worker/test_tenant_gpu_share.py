"""--max-loras-per-tenant / --max-lora-bytes-per-tenant: one tenant's GPU share of adapter slots and bytes
(the pool's TenantQuota, which no flag set: a tenant with many hot adapters could take every slot)."""

from __future__ import annotations

import threading
import time

import pytest

from lorafleet.worker.engine import Engine
from lorafleet.worker.engine_config import EngineConfig
from lorafleet.worker.sampling_params import SamplingParams
from tests.lora_factory import random_weights


def test_a_tenant_holds_at_most_its_share_of_slots_and_its_requests_still_finish(tiny_llama_dir, qv_adapters_dir):
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32", max_loras=4,
                                 max_loras_per_tenant=1))
    assert engine.adapter_pool.config.quota("acme").max_adapters == 1
    engine.register_adapter("alpha", qv_adapters_dir / "alpha", tenant="acme")
    engine.register_adapter("beta", qv_adapters_dir / "beta", tenant="acme")
    engine.register_adapter("gamma", qv_adapters_dir / "alpha", tenant="other")
    slots_per_step = []
    prepare = engine.runner.prepare

    def spy(batch):
        ctx, samplers = prepare(batch)
        slots = set() if ctx.lora is None else set(ctx.lora.seg_slots.tolist()) - {-1}
        slots_per_step.append({engine.adapter_pool.slot_key(s).split("@")[0] for s in slots})
        return ctx, samplers

    engine.runner.prepare = spy
    params = SamplingParams(max_tokens=4, temperature=0.0)
    prompts = [[1, 2, 3, 4]] * 3
    together = engine.generate(prompts, params, adapters=["alpha", "beta", "gamma"])
    alone = [engine.generate([p], params, adapters=[a])[0] for p, a in zip(prompts, ["alpha", "beta", "gamma"], strict=True)]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert not any({"alpha", "beta"} <= step for step in slots_per_step)  # never both of acme's at once
    assert any(len(step) == 2 for step in slots_per_step)  # the other tenant's ran beside acme's


def test_the_share_must_be_positive():
    with pytest.raises(ValueError, match="max_loras_per_tenant must be >= 1"):
        EngineConfig(max_loras_per_tenant=0)


def _one_slot_share(model_dir, adapters_dir, owner: str | None, other: str | None = None) -> Engine:
    """An engine whose tenants' share is one slot: alpha (on the GPU) and beta (in CPU memory) of `owner`
    ("default" when None), and, given `other`, its adapter gamma on the GPU too."""
    engine = Engine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_loras=4,
                                 max_loras_per_tenant=1, max_adapter_wait_steps=4))
    owned = {} if owner is None else {"tenant": owner}
    engine.register_adapter("alpha", adapters_dir / "alpha", **owned)
    engine.register_adapter("beta", adapters_dir / "beta", **owned)
    if other is not None:
        engine.register_adapter("gamma", adapters_dir / "alpha", tenant=other)
    pool = engine.adapter_pool
    pool.prefetch(pool.resolve("beta"), "cpu")
    for name in ("alpha", "gamma") if other is not None else ("alpha",):
        pool.load(pool.resolve(name))
    pool.wait_idle()
    return engine


def test_a_request_waiting_for_its_tenant_s_share_holds_no_other_tenant_back(tiny_llama_dir, qv_adapters_dir):
    """acme's share is full (alpha runs a long request) and its request for beta waits past
    --max-adapter-wait-steps: it was taken as starved for GPU room, and the scheduler held back every request
    needing a slot or a new reference to a busy adapter, other tenants' too, though only acme's own adapter
    leaving makes room for beta. Another tenant's short request finished after the long ones."""
    engine = _one_slot_share(tiny_llama_dir, qv_adapters_dir, "acme", other="other")
    pool = engine.adapter_pool
    long = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.add_request("a-long", [1, 2, 3], long, adapter="alpha", tenant="acme")
    for i in range(2):
        engine.add_request(f"g-long-{i}", [1, 2, 3], long, adapter="gamma", tenant="other")
    steps = 0

    def run(num_steps: int) -> dict[str, int]:
        nonlocal steps
        done = {}
        for _ in range(num_steps):
            steps += 1
            outputs = engine.step()
            done.update({out.request_id: steps for out in outputs if out.finished})
            if not engine.has_unfinished():
                break
            if not outputs:  # nothing ran: a copy to the device may be under way (the engine's loop waits too)
                pool.wait_idle(timeout=10)
        return done

    run(3)
    engine.add_request("b-short", [1, 2, 3], short, adapter="beta", tenant="acme")
    run(10)  # past max_adapter_wait_steps: b-short waits for acme's share
    assert pool.entry(pool.resolve("beta")).image is not None and pool.residency(pool.resolve("beta")) == "quota"
    engine.add_request("g-short", [1, 2, 3], short, adapter="gamma", tenant="other")
    start = steps
    done = run(300)
    try:
        assert done["g-short"] - start < 10, done  # not after the long requests (about 47 steps on)
        assert done["b-short"] > done["a-long"], done  # acme's own long request made the room
    finally:
        engine.close()


@pytest.mark.parametrize(("owner", "streamer", "caller"), [
    ("acme", "acme", "acme"),  # the owner's own stream
    (None, None, None),  # no tenants (dev mode): adapters are tenant "default", requests carry none
    ("shared", "bob", "acme"),  # shared adapters: another caller keeps the owner's share busy
], ids=["own_stream", "no_tenants", "another_caller"])
def test_a_stream_on_a_busy_adapter_does_not_starve_a_request_waiting_for_its_owner_s_share(
        tiny_llama_dir, qv_adapters_dir, owner, streamer, caller):
    """The owner's share (one slot) is alpha's, and requests for alpha overlap, step after step: a request
    for beta (same owner) waited for alpha to go idle, which every later alpha request kept from happening.
    Once it has waited --max-adapter-wait-steps, new requests for that owner's busy adapters wait behind it,
    whoever sends them."""
    engine = _one_slot_share(tiny_llama_dir, qv_adapters_dir, owner)
    pool = engine.adapter_pool
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request("a-0", [1, 2, 3], params, adapter="alpha", tenant=streamer)
    engine.step()
    engine.add_request("b", [1, 2, 3], params, adapter="beta", tenant=caller)
    done = {}
    try:
        for step in range(300):
            engine.add_request(f"a-{step + 1}", [1, 2, 3], params, adapter="alpha", tenant=streamer)
            outputs = engine.step()
            done.update({o.request_id: step for o in outputs if o.finished})
            if not outputs:
                pool.wait_idle(timeout=10)
            if "b" in done:
                break
        assert done.get("b", 300) < 30, f"b waited {len(done)} alpha requests out"
    finally:
        engine.close()


PROJS = ("q_proj", "v_proj")  # rank 32 on q/v of the tiny Llama: 28 pages of 512 elements; rank 2: 2 pages


def _small_pool_engine(model_dir) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", num_pages=48, block_size=4,
                               max_loras=4, max_loras_per_tenant=1, max_adapter_wait_steps=2))


def _run(engine: Engine, steps: int = 400, seconds: float = 3.0):
    """Step until nothing is left, for at least `steps` steps and `seconds` (past the scheduler's own give-up
    bounds: max_stuck_steps 100, min_stuck_s 1 s)."""
    outs, deadline, n = {}, time.monotonic() + seconds, 0
    while engine.has_unfinished() and (n < steps or time.monotonic() < deadline):
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
        engine.adapter_pool.wait_idle()
        n += 1
    return outs


@pytest.mark.parametrize("owner_has_idle_adapter", [False, True])
def test_a_request_that_a_later_pin_makes_unfittable_fails_also_when_its_owner_has_an_idle_adapter(
        tiny_llama_dir, owner_has_idle_adapter):
    """`big` (tenant T) is requested; before the scheduler reaches it, a push pins `other` (tenant U), after
    which `big` can never fit beside it (28 + 28 pages of 48). The request ends (never_fits), also when T has a
    small idle adapter on the GPU, which would give way to it first: that one made `big` wait for T's quota
    ("quota"), not for room, so the scheduler never asked never_fits, and the request waited for ever."""
    engine = _small_pool_engine(tiny_llama_dir)
    try:
        pool = engine.adapter_pool
        pool.add("big@1", random_weights(1, rank=32, projs=PROJS, name="big"), tenant="T")
        pool.add("small@1", random_weights(2, rank=2, projs=PROJS, name="small"), tenant="T")
        pool.add("other@1", random_weights(3, rank=32, projs=PROJS, name="other"), tenant="U")
        if owner_has_idle_adapter:
            pool.load("small@1")  # resident, idle: no request holds or waits for it
        engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
                           adapter="big", tenant="T")
        pool.pin("other@1")  # a push pins another tenant's adapter: big@1 can never fit beside it now
        pool.wait_idle()
        assert pool.entry("other@1").resident
        outs = _run(engine)
        assert "r" in outs, (f"request still waiting after 400 steps / 3 s; big@1 residency="
                             f"{pool.residency('big@1')!r}, small@1 tier={pool.entry('small@1').tier()}")
        assert outs["r"].finish_reason == "error"
    finally:
        engine.close()


def test_a_stuck_request_whose_adapter_then_waits_for_its_owners_quota_does_not_freeze_every_adapter_request(
        tiny_llama_dir):
    """One slot (--max-loras 1), one adapter per owner. `h` (owner V) is being copied to the GPU (a slow
    host-to-device copy: the copy thread held). Tenant A asks for `q`, tenant B for `p` (both owned by T; a
    push prefetched `p` first): both wait for the slot. With nothing running, A's request is the stuck one, and
    every other request whose adapter it has not taken yet is passed over while it is (B's too). The copy lands
    and `p` is placed for B's request, so `q` waits for T's quota, no longer for room. A's request stayed the
    stuck one although it no longer gave up room: B's request, the one that would free T's quota, was passed
    over for ever, and both waited for ever. Both finish."""
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32", num_pages=48,
                                 block_size=4, max_loras=1, max_loras_per_tenant=1, max_adapter_wait_steps=1))
    gate = threading.Event()
    try:
        pool = engine.adapter_pool
        for seed, (name, owner) in enumerate([("h", "V"), ("p", "T"), ("q", "T")]):
            pool.add(f"{name}@1", random_weights(seed, rank=2, projs=PROJS, name=name), tenant=owner)
        pool._copy_executor.submit(gate.wait, 30)  # the host-to-device copy thread is busy for now
        pool.prefetch("h@1")  # h takes the only slot; its copy is queued behind
        pool.prefetch("p@1")  # a push prefetches p (warm): wanted, waiting for the slot
        assert pool.entry("h@1").on_gpu and not pool.entry("h@1").resident
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        engine.add_request("x", [1, 2, 3], params, adapter="q", tenant="A")
        engine.add_request("y", [4, 5, 6], params, adapter="p", tenant="B")
        engine.step()  # both acquire: q and p wait for the slot
        engine.step()  # x has waited max_adapter_wait_steps with nothing running: the stuck one
        assert engine.scheduler._stuck_steps, "x did not become the stuck request"
        gate.set()  # the copy lands: room comes back
        pool.wait_idle()
        outs, deadline = {}, time.monotonic() + 3.0  # past the scheduler's min_stuck_s (1 s) and 100 steps
        steps = 0
        while engine.has_unfinished() and (time.monotonic() < deadline or steps < 300):
            outs.update((o.request_id, o) for o in engine.step() if o.finished)
            pool.wait_idle()
            steps += 1
        states = {k: pool.residency(k) for k in ("p@1", "q@1")}
        assert set(outs) == {"x", "y"}, (
            f"after {steps} steps: finished {sorted(outs)}; stuck={engine.scheduler._stuck_steps}; "
            f"residency={states}; p@1 waiters={pool.entry('p@1').waiters}")
    finally:
        gate.set()
        engine.close()

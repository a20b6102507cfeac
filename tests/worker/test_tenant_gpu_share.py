"""--max-loras-per-tenant / --max-lora-bytes-per-tenant: one tenant's GPU share of adapter slots and bytes
(the pool's TenantQuota, which no flag set: a tenant with many hot adapters could take every slot)."""

from __future__ import annotations

import pytest

from lorafleet.worker.engine import Engine
from lorafleet.worker.engine_config import EngineConfig
from lorafleet.worker.sampling_params import SamplingParams


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

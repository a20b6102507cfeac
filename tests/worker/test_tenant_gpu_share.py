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

"""Engine and adapter pool: a hot update that drops the version a queued request resolved before the
engine could load it."""

from __future__ import annotations

import threading

from lorafleet.worker import Engine, EngineConfig, SamplingParams
from lorafleet.worker.engine import UnknownAdapterError
from tests.lora_factory import random_weights

PROJS = ("q_proj", "v_proj")


def _engine(model_dir) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", num_pages=64, block_size=4))


def test_a_queued_request_whose_version_a_hot_update_dropped_mid_load_is_told_to_resolve_again(tiny_llama_dir):
    """m@1 is still being read for a queued request when m@2 replaces it: m@1 is dropped before the request
    was admitted. The request ends with UnknownAdapterError, on which the HTTP layer resolves the name once
    more and serves it with m@2 (nothing was generated yet), not with an internal error."""
    engine = _engine(tiny_llama_dir)
    try:
        gate = threading.Event()
        w1 = random_weights(1, rank=4, projs=PROJS)
        engine.adapter_pool.add("m@1", loader=lambda: gate.wait(30) and w1)
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        engine.add_request("r", [1, 2, 3], params, adapter="m")
        assert engine.step() == [] and engine.num_waiting == 1  # m@1's read is under way
        engine.adapter_pool.add("m@2", random_weights(2, rank=4, projs=PROJS))
        engine.adapter_pool.wait_idle()
        assert engine.adapter_pool.resolve("m") == "m@2"
        outs = engine.step()
        gate.set()
        assert [(o.request_id, o.finish_reason) for o in outs] == [("r", "error")]
        assert isinstance(outs[0].exception, UnknownAdapterError), repr(outs[0].exception)
        assert "m@1" in outs[0].error
        assert not engine.has_unfinished()
        engine.adapter_pool.check()
    finally:
        engine.close()

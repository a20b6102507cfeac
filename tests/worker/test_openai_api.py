"""In-process checks of the inference handlers (aiohttp test client, real engine, tiny model)."""

from __future__ import annotations

import pytest

from lorafleet.worker.engine_config import EngineConfig
from lorafleet.worker.served_adapters import ServedAdapters
from lorafleet.worker.server import create_app
from lorafleet.worker.worker_config import WorkerConfig
from tests.lora_factory import make_peft_adapter


@pytest.fixture
def adapters_dir(tiny_llama_dir, tmp_path):
    make_peft_adapter(tiny_llama_dir, tmp_path / "alpha", rank=4, seed=1, targets=["q_proj", "v_proj"])
    return tmp_path


async def test_a_version_replaced_between_arrival_and_admission_is_re_resolved(
        aiohttp_client, tiny_llama_dir, adapters_dir, monkeypatch):
    """A directive push may drop the version a request resolved on arrival before the engine takes the
    request. Such a request (it named the adapter, not a version) is resolved once more and served;
    a request that pinned `name@version` keeps its clear error."""
    config = WorkerConfig(engine=EngineConfig(model=str(tiny_llama_dir), adapters=str(adapters_dir),
                                              dtype="float32", max_model_len=128), served_model_name="tiny")
    real = ServedAdapters.resolve
    calls = []

    def resolve_to_a_dropped_version_first(self, model, tenant, user):
        calls.append(model)
        key = real(self, model, tenant, user)
        # Arrival and the first two re-resolutions still see the old table (the push has not swapped it yet).
        return f"{key.partition('@')[0]}@dropped" if key and len(calls) <= 3 else key

    monkeypatch.setattr(ServedAdapters, "resolve", resolve_to_a_dropped_version_first)
    client = await aiohttp_client(create_app(config))
    body = {"model": "alpha", "prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0, "n": 2}
    resp = await client.post("/v1/completions", json=body)
    data = await resp.json()
    assert resp.status == 200, data
    current = data["model"]  # the version that really served it
    assert current.startswith("alpha@") and not current.endswith("@dropped")
    assert len(data["choices"]) == 2 and calls == ["alpha"] * 4

    calls.clear()
    pinned = await client.post("/v1/completions", json=body | {"model": "alpha@nope"})
    assert pinned.status == 404  # a pinned version that does not exist is the caller's error

"""A version pushed again from another folder (same name@version and files, staged under a new cache key
when its URI moved) loads from the new folder from then on: the old one may be gone."""

from __future__ import annotations

import shutil

from lorafleet.worker import Engine, EngineConfig, SamplingParams
from lorafleet.worker.directives import DesiredState
from lorafleet.worker.engine_adapters import EngineAdapters
from lorafleet.worker.served_adapters import ServedAdapters
from tests.lora_factory import make_peft_adapter


def push(generation: int, uri: str) -> DesiredState:
    return DesiredState.from_dict({"generation": generation, "adapters": [
        {"name": "sql", "tenant": "acme", "stable": {"version": "v1", "uri": uri}}]})


def test_a_version_pushed_from_a_new_folder_reloads_from_there(tiny_llama_dir, tmp_path):
    old, new = tmp_path / "cache" / "u-old", tmp_path / "cache" / "u-new"
    make_peft_adapter(tiny_llama_dir, old, rank=4, seed=1, targets=["q_proj", "v_proj"])
    shutil.copytree(old, new)
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32", num_pages=64,
                                 block_size=4))
    host, served = EngineAdapters(engine), ServedAdapters("tiny")
    served.apply(push(1, str(old)), host)
    params = SamplingParams(max_tokens=3, temperature=0)
    first = engine.generate([[1, 2, 3]], params, adapters=["sql"])[0]
    served.apply(push(2, str(new)), host)
    shutil.rmtree(old)  # the stager's cache drops the copy no push names any more
    engine.adapter_pool.evict("sql@v1", "gpu")
    engine.adapter_pool.evict("sql@v1", "cpu")  # CPU tier pressure: the next use reads the folder again
    again = engine.generate([[1, 2, 3]], params, adapters=["sql"])[0]
    assert again.error is None, again.error
    assert again.token_ids == first.token_ids

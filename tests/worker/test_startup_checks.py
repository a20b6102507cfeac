"""What the worker does at start with settings or files it can only partly use: a broken adapter among
the local --adapters is logged and the others served, a model without tokenizer.json says that only
token ids work, and no adapter (start-up or pushed) can take the base model's name."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from lorafleet.worker.adapter_dir import AdapterDirError, register_adapter_dir
from lorafleet.worker.engine import Engine, EngineError
from lorafleet.worker.engine_config import EngineConfig
from lorafleet.worker.server import create_app
from lorafleet.worker.worker_config import WorkerConfig
from tests.worker.test_admin_pushes import ADMIN, admin_client


def adapters_with_a_broken_one(qv_adapters_dir: Path, root: Path) -> Path:
    """alpha and beta as made, gamma with truncated weights, notes/ without adapter_config.json."""
    for name in ("alpha", "beta"):  # by name: other tests may add folders to the shared fixture's
        shutil.copytree(qv_adapters_dir / name, root / name)
    shutil.copytree(qv_adapters_dir / "beta", root / "gamma")
    weights = root / "gamma" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    (root / "notes").mkdir()
    (root / "notes" / "README.txt").write_text("not an adapter")
    return root


async def test_a_broken_adapter_is_logged_and_the_others_are_served(aiohttp_client, tiny_llama_dir, qv_adapters_dir,
                                                                     tmp_path, caplog):
    adapters = adapters_with_a_broken_one(qv_adapters_dir, tmp_path / "adapters")
    config = WorkerConfig(engine=EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=128,
                                              adapters=str(adapters)), served_model_name="tiny")
    with caplog.at_level(logging.INFO):
        client = await aiohttp_client(create_app(config))
        resp = await client.get("/v1/models")
        assert resp.status == 200
        assert [m["id"] for m in (await resp.json())["data"]] == ["tiny", "alpha", "beta"]
        resp = await client.post("/v1/completions", json={"model": "beta", "prompt": "hi", "max_tokens": 2})
        assert resp.status == 200, await resp.text()
    text = caplog.text
    assert "adapter gamma not served:" in text and "adapter_model.safetensors" in text, text
    assert "notes skipped: no adapter_config.json" in text, text
    assert "not served" not in text.replace("adapter gamma not served", "").replace("not served (fix", ""), text


async def test_admin_state_reports_each_start_up_adapter_that_failed_to_load(aiohttp_client, tiny_llama_dir,
                                                                             qv_adapters_dir, tmp_path):
    """A broken folder under a local --adapters was only in the log: GET /admin/v1/state lists it now, as it
    lists a pushed version that failed (an `adapters` entry with its error: version `unstaged`, tier
    `none`), and every failed folder with its reason under `startup`, also one whose name no entry can
    carry. The good adapter is served; a push replaces the start-up set, and its report with it."""
    root = tmp_path / "adapters"
    shutil.copytree(qv_adapters_dir / "alpha", root / "alpha")
    shutil.copytree(qv_adapters_dir / "beta", root / "gamma")
    weights = root / "gamma" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    shutil.copytree(qv_adapters_dir / "beta", root / "my beta")  # loads, but no push or report could name it
    config = WorkerConfig(engine=EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=128,
                                              adapters=str(root)),
                          served_model_name="tiny", admin_token=ADMIN["Authorization"].split()[1],
                          adapter_roots=str(qv_adapters_dir))
    client = await aiohttp_client(create_app(config))

    resp = await client.get("/admin/v1/state", headers=ADMIN)
    body = await resp.json()
    assert resp.status == 200, body
    reported = {a["name"]: a for a in body["adapters"]}
    assert sorted(reported) == ["alpha", "gamma"], reported
    assert reported["alpha"]["error"] is None and reported["alpha"]["traffic_percent"] == 100, reported
    gamma = reported["gamma"]
    assert (gamma["version"], gamma["tier"], gamma["traffic_percent"]) == ("unstaged", "none", 0), gamma
    assert "adapter_model.safetensors" in gamma["error"] and "\n" not in gamma["error"], gamma
    errors = body["startup"]["errors"]
    assert body["startup"]["adapters"] == str(root) and sorted(errors) == ["gamma", "my beta"], body["startup"]
    assert errors["gamma"] == gamma["error"], errors
    assert "is no adapter name" in errors["my beta"] and "rename the folder" in errors["my beta"], errors

    models = {m["id"] for m in (await (await client.get("/v1/models")).json())["data"]}
    assert models == {"tiny", "alpha"}, models
    resp = await client.post("/v1/completions", json={"model": "alpha", "prompt": "hi", "max_tokens": 2})
    assert resp.status == 200, await resp.text()
    resp = await client.post("/v1/completions", json={"model": "gamma", "prompt": "hi", "max_tokens": 2})
    assert resp.status == 404, await resp.text()

    push = {"generation": 1, "adapters": [
        {"name": "beta", "tenant": "acme", "stable": {"version": "v1", "uri": str(qv_adapters_dir / "beta")}}]}
    resp = await client.put("/admin/v1/state", json=push, headers=ADMIN)
    body = await resp.json()
    assert resp.status == 200, body
    assert [(a["name"], a["error"]) for a in body["adapters"]] == [("beta", None)] and "startup" not in body, body


class _Refusing:
    def register_adapter(self, name: str, path) -> str:
        raise EngineError(f"{name} is broken")


def test_a_folder_where_no_adapter_loads_is_refused_naming_each(qv_adapters_dir):
    with pytest.raises(EngineError, match="no adapter under .* can be served .*alpha: alpha is broken; beta: beta"):
        register_adapter_dir(_Refusing(), qv_adapters_dir)


def test_a_model_without_tokenizer_warns_that_only_token_ids_work(tiny_llama_dir, tmp_path, caplog):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    (model / "tokenizer.json").unlink()
    with caplog.at_level(logging.WARNING):
        engine = Engine(EngineConfig(model=str(model), dtype="float32", max_model_len=64))
    assert engine.tokenizer is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("no tokenizer.json" in w and "token ids" in w for w in warnings), warnings


def test_served_model_name_of_a_start_up_adapter_is_refused(tiny_llama_dir, qv_adapters_dir):
    with pytest.raises(ValueError, match="--served-model-name beta is also the name of the adapter"):
        WorkerConfig(engine=EngineConfig(model=str(tiny_llama_dir), adapters=str(qv_adapters_dir)),
                     served_model_name="beta")


async def test_a_pushed_adapter_named_like_the_base_model_is_that_versions_error(aiohttp_client, tiny_llama_dir,
                                                                                 qv_adapters_dir):
    client = await admin_client(aiohttp_client, tiny_llama_dir, qv_adapters_dir)
    directives = [{"name": name, "tenant": "acme", "stable": {"version": "v1", "uri": str(qv_adapters_dir / folder)}}
                  for name, folder in (("tiny", "alpha"), ("beta", "beta"))]
    resp = await client.put("/admin/v1/state", json={"generation": 1, "adapters": directives}, headers=ADMIN)
    body = await resp.json()
    assert resp.status == 200, body
    reported = {a["name"]: a for a in body["adapters"]}
    assert "served model name" in (reported["tiny"]["error"] or ""), reported
    assert reported["beta"]["error"] is None, reported
    resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert resp.status == 200 and (await resp.json())["model"] == "tiny"  # still the base model


def _base_named(tiny_llama_dir, qv_adapters_dir, tmp_path, *, name_or_path: str | None = None):
    """The tiny model in a folder named as a mounted Llama-3-8B is, and an adapter that names its base by hub id."""
    import json

    model = tmp_path / "models" / "llama-3-8b"
    shutil.copytree(tiny_llama_dir, model)
    if name_or_path is not None:
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "_name_or_path": name_or_path}))
    root = tmp_path / "adapters"
    shutil.copytree(qv_adapters_dir / "alpha", root / "alpha")
    config = json.loads((root / "alpha" / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "meta-llama/Meta-Llama-3-8B"
    (root / "alpha" / "adapter_config.json").write_text(json.dumps(config))
    return model, root


def test_an_adapter_naming_its_base_by_another_name_loads_once_that_name_is_known(tiny_llama_dir, qv_adapters_dir,
                                                                                   tmp_path):
    """A base mounted as /models/llama-3-8b and adapters trained on meta-llama/Meta-Llama-3-8B: every adapter
    was refused, and the refusal named a strictness no flag sets. The base's `_name_or_path` and
    --base-model-aliases are names of it too; the refusal says so."""
    model, root = _base_named(tiny_llama_dir, qv_adapters_dir, tmp_path)
    with pytest.raises(AdapterDirError) as err:  # the folder's only adapter
        Engine(EngineConfig(model=str(model), dtype="float32", max_model_len=128, adapters=str(root)))
    why = str(err.value)
    assert "'meta-llama/Meta-Llama-3-8B', this server serves 'llama-3-8b'" in why, why
    assert "--base-model-aliases Meta-Llama-3-8B" in why and "--no-strict-base" in why, why
    for config in (EngineConfig(model=str(model), dtype="float32", max_model_len=128, adapters=str(root),
                                base_model_aliases=("meta-llama/Meta-Llama-3-8B",)),
                   EngineConfig(model=str(model), dtype="float32", max_model_len=128, adapters=str(root),
                                base_model_aliases=("Meta-Llama-3-8B",))):
        assert Engine(config).adapters() != [], config.base_model_aliases
    model, root = _base_named(tiny_llama_dir, qv_adapters_dir, tmp_path / "saved", name_or_path="meta-llama/Meta-Llama-3-8B")
    assert Engine(EngineConfig(model=str(model), dtype="float32", max_model_len=128, adapters=str(root))).adapters()


async def test_the_served_model_name_is_a_name_of_the_base_for_adapters(aiohttp_client, tiny_llama_dir,
                                                                       qv_adapters_dir, tmp_path):
    model, root = _base_named(tiny_llama_dir, qv_adapters_dir, tmp_path)
    config = WorkerConfig(engine=EngineConfig(model=str(model), dtype="float32", max_model_len=128, adapters=str(root)),
                          served_model_name="meta-llama/Meta-Llama-3-8B")
    client = await aiohttp_client(create_app(config))
    models = {m["id"] for m in (await (await client.get("/v1/models")).json())["data"]}
    assert "alpha" in models, models

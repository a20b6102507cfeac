"""The admin API in process, with the real engine: a push whose adapter path hangs (a stuck mount) leaves
health probes and served models answering; a directive's sha256 is checked against the files loaded; a
version unloaded and pushed again from other files serves the new ones; the last push is answered as sent; a
desired state is not held to the inference body limit."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from lorafleet.worker import admin_api
from lorafleet.worker.app_keys import ENGINE, HOST
from lorafleet.worker.directives import DesiredState
from lorafleet.worker.engine_config import EngineConfig
from lorafleet.worker.server import create_app
from lorafleet.worker.sources import Sources, adapter_digest
from lorafleet.worker.worker_config import WorkerConfig

ADMIN = {"Authorization": "Bearer admin-token-for-tests"}


async def admin_client(aiohttp_client, tiny_llama_dir, qv_adapters_dir, **worker):
    """A worker serving the tiny model as `tiny`, taking pushes of the test adapters with the ADMIN token."""
    config = WorkerConfig(engine=EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=128),
                          served_model_name="tiny", admin_token=ADMIN["Authorization"].split()[1],
                          adapter_roots=str(qv_adapters_dir), **worker)
    return await aiohttp_client(create_app(config))


@pytest.fixture
async def client(aiohttp_client, tiny_llama_dir, qv_adapters_dir):
    return await admin_client(aiohttp_client, tiny_llama_dir, qv_adapters_dir)


def directive(name: str, uri, *, tenant: str = "acme", sha256: str | None = None, warm: bool = False) -> dict:
    stable = {"version": "v1", "uri": str(uri)} | ({"sha256": sha256} if sha256 else {})
    return {"name": name, "tenant": tenant, "stable": stable, "warm": warm}


async def push(client, generation: int, *adapters: dict) -> dict:
    resp = await client.put("/admin/v1/state", json={"generation": generation, "adapters": list(adapters)},
                            headers=ADMIN)
    body = await resp.json()
    assert resp.status == 200, body
    return {(a["name"], a["version"]): a for a in body["adapters"]}


async def complete(client, model: str) -> tuple[int, dict]:
    resp = await client.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2})
    return resp.status, await resp.json()


@pytest.mark.parametrize("endpoint", ["state", "load_lora_adapter"])
async def test_a_hung_adapter_path_stalls_neither_health_probes_nor_served_models(client, qv_adapters_dir,
                                                                                  monkeypatch, endpoint):
    """Checking a pushed path resolves and lists it: on a hung network mount that blocks until the mount
    recovers. It runs off the event loop: /healthz, the base model and a resident adapter answer while it
    waits, and the push completes once the path answers."""
    await push(client, 1, directive("alpha", qv_adapters_dir / "alpha", warm=True))
    entered, release, stalled = threading.Event(), threading.Event(), []
    real = Sources.local_path

    def hung(self, uri, *folders):
        if "beta" in str(uri):
            entered.set()
            stalled.append(not release.wait(30))  # timed out: nothing else could run meanwhile
        return real(self, uri, *folders)

    monkeypatch.setattr(Sources, "local_path", hung)
    beta = qv_adapters_dir / "beta"
    if endpoint == "state":
        body = {"generation": 2, "adapters": [directive("alpha", qv_adapters_dir / "alpha", warm=True),
                                              directive("beta", beta)]}
        pending = asyncio.ensure_future(client.put("/admin/v1/state", json=body, headers=ADMIN))
    else:
        body = {"lora_name": "beta", "lora_path": str(beta)}
        pending = asyncio.ensure_future(client.post("/v1/load_lora_adapter", json=body, headers=ADMIN))
    try:
        assert await asyncio.to_thread(entered.wait, 30)
        assert (await client.get("/healthz")).status == 200
        for model in ("tiny", "alpha"):
            status, answer = await complete(client, model)
            assert status == 200, answer
        assert not pending.done()  # still waiting for the mount
    finally:
        release.set()
    resp = await pending
    assert resp.status == 200, await resp.text()
    assert stalled == [False]
    status, answer = await complete(client, "beta")
    assert status == 200, answer


async def test_a_pushed_sha256_the_files_do_not_have_is_that_versions_error(client, qv_adapters_dir):
    """The stager checks a directive's sha256 when it downloads; a local path pushed straight to the worker
    is checked by the engine, on the bytes it loads. A mismatch is that version's error (503 for its
    requests, never served); the right digest serves it."""
    alpha = qv_adapters_dir / "alpha"
    real, wrong = adapter_digest(alpha), adapter_digest(qv_adapters_dir / "beta")
    reported = await push(client, 1, directive("alpha", alpha, sha256=wrong))
    error = reported[("alpha", "v1")]["error"]
    assert error and "sha256 mismatch" in error and wrong in error and real in error, error
    status, answer = await complete(client, "alpha")
    assert status == 503 and answer["error"]["code"] == "adapter_load_failed", answer
    assert "sha256 mismatch" in answer["error"]["message"]
    listed = await (await client.get("/v1/models")).json()  # not offered to routers: it can only answer 503
    assert "alpha" not in [m["id"] for m in listed["data"]]

    reported = await push(client, 2, directive("alpha", alpha, sha256=real))
    assert reported[("alpha", "v1")]["error"] is None
    listed = await (await client.get("/v1/models")).json()
    assert [m["versions"] for m in listed["data"] if m["id"] == "alpha"] == [["v1"]]
    status, answer = await complete(client, "alpha")
    assert status == 200, answer


async def test_a_version_unloaded_and_pushed_again_from_other_files_serves_them(client, qv_adapters_dir):
    """Generation 1 serves sql@v1 from alpha's files (acme), generation 2 removes it: its GPU pages and
    slot are freed at once. Generation 3 pushes sql@v1 again, for globex, from beta's files: a new
    version, with globex as its owner and beta's weights, not a 503 'registered with different weights'."""
    pool = client.app[ENGINE].engine.adapter_pool
    await push(client, 1, directive("sql", qv_adapters_dir / "alpha", warm=True))
    await asyncio.to_thread(pool.wait_idle)
    assert pool.entry("sql@v1").resident
    status, answer = await complete(client, "sql")
    assert status == 200, answer

    await push(client, 2)
    assert pool.stats()["resident"]["gpu"] == 0 and pool.page_pool.num_used("adapter") == 0

    beta = qv_adapters_dir / "beta"
    reported = await push(client, 3, directive("sql", beta, tenant="globex"), directive("ref", beta, tenant="globex"))
    assert reported[("sql", "v1")]["error"] is None
    status, answer = await complete(client, "sql")
    assert status == 200, answer
    entry = pool.entry("sql@v1")
    assert entry.tenant == "globex" and entry.digest == pool.entry("ref@v1").digest


async def test_the_last_push_is_answered_as_sent_while_the_engine_serves_it(client, qv_adapters_dir):
    """GET /admin/v1/directives (what a restarted stager adopts): the last push as sent, while what is served is
    that push's; nothing pushed yet, an empty table; a vLLM load or unload since, not known (null)."""
    resp = await client.get("/admin/v1/directives")
    assert resp.status == 401
    body = await (await client.get("/admin/v1/directives", headers=ADMIN)).json()
    assert body == {"generation_applied": 0, "directives": None, "served": []}
    sent = {"generation": 7, "adapters": [directive("alpha", qv_adapters_dir / "alpha")], "eviction": "lfu"}
    assert (await client.put("/admin/v1/state", json=sent, headers=ADMIN)).status == 200
    body = await (await client.get("/admin/v1/directives", headers=ADMIN)).json()
    assert body["generation_applied"] == 7 and body["served"] == ["alpha"]
    assert DesiredState.from_dict(body["directives"]) == DesiredState.from_dict(sent)
    refused = [client.put("/admin/v1/state", json=sent | {"generation": 6}, headers=ADMIN),  # stale
               client.put("/admin/v1/state", json={"generation": 9, "adapters": [directive("x", "file://x")]},
                          headers=ADMIN),  # a malformed (relative) source
               client.post("/v1/load_lora_adapter", json={"lora_name": "alpha", "lora_path": str(qv_adapters_dir / "beta")},
                           headers=ADMIN)]  # loaded already
    assert [(await r).status for r in refused] == [409, 400, 400]  # refused, nothing changed: still the push's
    body = await (await client.get("/admin/v1/directives", headers=ADMIN)).json()
    assert DesiredState.from_dict(body["directives"]) == DesiredState.from_dict(sent)
    resp = await client.post("/v1/load_lora_adapter", json={"lora_name": "beta", "lora_path": str(qv_adapters_dir / "beta")},
                             headers=ADMIN)
    assert resp.status == 200, await resp.text()
    body = await (await client.get("/admin/v1/directives", headers=ADMIN)).json()
    assert body["directives"] is None and body["served"] == ["alpha", "beta"]
    await push(client, 8, directive("alpha", qv_adapters_dir / "alpha"))
    assert (await (await client.get("/admin/v1/directives", headers=ADMIN)).json())["served"] == ["alpha"]
    assert (await client.post("/v1/unload_lora_adapter", json={"lora_name": "alpha"}, headers=ADMIN)).status == 200
    assert (await (await client.get("/admin/v1/directives", headers=ADMIN)).json())["directives"] is None


async def test_an_unload_in_progress_is_not_answered_as_the_last_push(client, qv_adapters_dir):
    """While a vLLM unload runs (the table already without alpha, the engine's unregister still going on), the
    last push was answered with alpha in it and alpha no longer served: a stager starting then took alpha as
    held by the engine."""
    sent = {"generation": 7, "adapters": [directive(n, qv_adapters_dir / n) for n in ("alpha", "beta")]}
    assert (await client.put("/admin/v1/state", json=sent, headers=ADMIN)).status == 200
    host = client.server.app[HOST]
    entered, release, real = threading.Event(), threading.Event(), host.unregister_adapter

    def slow_unregister(name):  # the engine thread holds the pool's lock for a moment, say
        entered.set()
        release.wait(30)
        return real(name)

    host.unregister_adapter = slow_unregister
    pending = asyncio.ensure_future(client.post("/v1/unload_lora_adapter", json={"lora_name": "alpha"}, headers=ADMIN))
    try:
        assert await asyncio.to_thread(entered.wait, 30)
        body = await (await client.get("/admin/v1/directives", headers=ADMIN)).json()
        assert body["directives"] is None, body
    finally:
        release.set()
    assert (await pending).status == 200


async def test_a_desired_state_is_held_to_its_own_limit_not_to_the_inference_body_limit(
        aiohttp_client, tiny_llama_dir, qv_adapters_dir, monkeypatch):
    """A worker whose --max-body-bytes guards it against huge prompts still takes its pool's whole set."""
    client = await admin_client(aiohttp_client, tiny_llama_dir, qv_adapters_dir, max_body_bytes=4096)
    body = json.dumps({"generation": 1, "adapters": [directive("alpha", qv_adapters_dir / "alpha")]}) + " " * 8192
    json_headers = {**ADMIN, "Content-Type": "application/json"}
    resp = await client.put("/admin/v1/state", data=body, headers=json_headers)
    assert resp.status == 200, await resp.text()
    assert (await client.post("/v1/completions", data=body, headers=json_headers)).status == 413
    monkeypatch.setattr(admin_api, "MAX_STATE_BYTES", 8192)
    resp = await client.put("/admin/v1/state", data=body, headers=json_headers)
    assert resp.status == 413
    assert (await resp.json())["error"]["message"] == "desired state over 8192 bytes, the most the engine reads"


async def test_a_replaced_version_a_request_will_take_again_stays_in_the_report(client, qv_adapters_dir):
    """A request ran on x@v1 when a push replaced it, then gave it back to take it again (the scheduler's let-go):
    x@v1 is kept for it and may leave the GPU and the CPU tier, to be read again from its files. The report (what
    the stager keeps files for) left it out, its copy could be trimmed, and the request failed mid-stream."""
    pool = client.app[ENGINE].engine.adapter_pool
    await push(client, 1, directive("x", qv_adapters_dir / "alpha"))
    pool.load("x@v1")
    slot = pool.acquire("x@v1", "running")
    moved = directive("x", qv_adapters_dir / "beta")
    moved["stable"]["version"] = "v2"
    await push(client, 2, moved)
    pool.load("x@v2")
    pool.release(slot, detach="running")
    report = await push(client, 3, moved)
    assert ("x", "v1") in report and report[("x", "v1")]["traffic_percent"] == 0, report
    pool.acquire("x@v1", "running")  # it took it again, and finished on it
    pool.release(pool.entry("x@v1").slot)
    assert ("x", "v1") not in await push(client, 4, moved)


async def test_a_push_naming_a_serving_version_with_other_files_keeps_the_registered_weights_serving(
        client, qv_adapters_dir):
    """sql@v1 serves alpha's weights; a push names sql@v1 from beta's (other weights under the same version): the
    change is refused, reported as v1's error, and sql@v1 keeps answering with alpha's weights (it was marked
    failed and every request for it answered 503, the engine still holding alpha's). A push back to alpha's
    files clears the error; one naming a folder that does not exist is refused the same way."""
    pool = client.app[ENGINE].engine.adapter_pool
    await push(client, 1, directive("sql", qv_adapters_dir / "alpha", warm=True))
    await asyncio.to_thread(pool.wait_idle)
    digest = pool.entry("sql@v1").digest
    greedy = {"model": "sql", "prompt": "hi", "max_tokens": 4, "temperature": 0, "logprobs": 1}
    before = await (await client.post("/v1/completions", json=greedy)).json()
    for generation, uri in ((2, qv_adapters_dir / "beta"), (3, qv_adapters_dir / "gone")):
        reported = await push(client, generation, directive("sql", uri))
        error = reported[("sql", "v1")]["error"]
        assert error and error.startswith(f"not served from {uri}, kept from {qv_adapters_dir / 'alpha'}: "), error
        resp = await client.post("/v1/completions", json=greedy)
        after = await resp.json()
        assert resp.status == 200, after
        assert after["choices"][0]["text"] == before["choices"][0]["text"] and pool.entry("sql@v1").digest == digest
        assert after["choices"][0]["logprobs"]["token_logprobs"] == before["choices"][0]["logprobs"]["token_logprobs"]
    reported = await push(client, 4, directive("sql", qv_adapters_dir / "alpha"))
    assert reported[("sql", "v1")]["error"] is None


async def test_load_inplace_replaces_a_names_weights_and_requests_move_to_them(client, qv_adapters_dir):
    """vLLM's load_inplace (trainers swapping a LoRA under one name): the name's new weights become its new
    version, the one its requests resolve to; the old version is retired once the new one has loaded. Without
    load_inplace a second load of the name is refused; the same weights again change nothing."""
    def load(source: str, **extra):
        return client.post("/v1/load_lora_adapter", headers=ADMIN,
                           json={"lora_name": "trained", "lora_path": str(qv_adapters_dir / source), **extra})

    assert (await load("alpha")).status == 200
    status, first = await complete(client, "trained")
    assert status == 200
    assert (await load("beta")).status == 400  # loaded already
    resp = await load("beta", load_inplace=True)
    assert resp.status == 200, await resp.text()
    alpha, beta = (adapter_digest(qv_adapters_dir / n)[:12] for n in ("alpha", "beta"))
    assert f"trained@{beta}" in await resp.text()
    status, second = await complete(client, "trained")
    assert status == 200 and (first["model"], second["model"]) == (f"trained@{alpha}", f"trained@{beta}")
    engine = client.server.app[ENGINE].engine
    assert [k for k in engine.adapters() if k.startswith("trained@")] == [f"trained@{beta}"]  # the old one retired
    models = await (await client.get("/v1/models")).json()
    assert [m["id"] for m in models["data"] if m["id"].startswith("trained")] == ["trained"]
    assert (await load("beta", load_inplace=True)).status == 200  # the same weights: the same version
    assert [k for k in engine.adapters() if k.startswith("trained@")] == [f"trained@{beta}"]


@pytest.mark.parametrize("shape", ["folder", "weights"])
async def test_a_local_source_missing_at_the_check_is_refused_not_read_by_path_later(client, qv_adapters_dir, tmp_path,
                                                                                   monkeypatch, shape):
    """A folder in the roots missing at the check (or missing its weights) was registered with no digest and
    read by path later: a link to another adapter, out of the roots, made in between (here right after the
    check) was loaded and served under the admin's name. Now it is refused at the check, 404, and nothing is
    registered."""
    import shutil

    from lorafleet.worker.app_keys import ADAPTERS

    outside = shutil.copytree(qv_adapters_dir / "beta", tmp_path / "outside")
    folder = qv_adapters_dir / f"race-{shape}"
    if shape == "weights":
        shutil.copytree(qv_adapters_dir / "alpha", folder)
        (folder / "adapter_model.safetensors").unlink()
    served, calls = client.app[ADAPTERS], []
    real = served.load

    def swap_then_load(*args, **kw):
        calls.append(args)
        if shape == "folder":
            folder.symlink_to(outside, target_is_directory=True)
        else:
            (folder / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
        return real(*args, **kw)

    monkeypatch.setattr(served, "load", swap_then_load)
    try:
        resp = await client.post("/v1/load_lora_adapter", headers=ADMIN,
                                 json={"lora_name": f"race-{shape}", "lora_path": str(folder)})
        body = await resp.json()
        assert resp.status == 404 and body["error"]["code"] == "missing", body
        assert calls == [] and not any(k.startswith(f"race-{shape}@") for k in client.app[ENGINE].engine.adapters())
    finally:
        if folder.is_symlink():
            folder.unlink()
        shutil.rmtree(folder, ignore_errors=True)


async def test_the_workers_check_takes_the_engines_file_limit(aiohttp_client, tiny_llama_dir, qv_adapters_dir):
    """The check of a local source held its files to the default limit, not --max-adapter-file-bytes: a file
    between the two failed the check (and, passed on unhashed, was read by path later) or was hashed where the
    engine refuses it. Now a weights file over the engine's limit is refused at the check, 413."""
    config = WorkerConfig(engine=EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=128,
                                              max_adapter_file_bytes=1024),
                          served_model_name="tiny", admin_token=ADMIN["Authorization"].split()[1],
                          adapter_roots=str(qv_adapters_dir))
    client = await aiohttp_client(create_app(config))
    resp = await client.post("/v1/load_lora_adapter", headers=ADMIN,
                             json={"lora_name": "big", "lora_path": str(qv_adapters_dir / "alpha")})
    body = await resp.json()
    assert resp.status == 413 and body["error"]["code"] == "too_large", body


async def test_a_push_checks_a_local_source_in_its_tenants_folders(client, qv_adapters_dir):
    """The worker checked a pushed folder against the roots only, where the stager checks its tenant's folders
    too: a file of acme's folder linked into globex's (inside the roots) passed, and the loader read it. Now the
    push's folders hold at the worker as well: that version is refused, the others go on."""
    import shutil

    tenants = qv_adapters_dir / "tenants"
    theirs = shutil.copytree(qv_adapters_dir / "beta", tenants / "globex" / "private")
    ours = shutil.copytree(qv_adapters_dir / "alpha", tenants / "acme" / "x")
    (ours / "tokenizer_config.json").symlink_to(theirs / "adapter_config.json")
    try:
        linked = directive("linked", ours, sha256=adapter_digest(ours))
        linked["stable"] |= {"within": [f"{tenants}/acme/"], "without": [f"{tenants}/"]}
        report = await push(client, 1, linked, directive("plain", qv_adapters_dir / "beta"))
        error = report[("linked", "v1")]["error"]
        assert error and "outside its tenant's folders" in error and "not_allowed" in error, error
        assert report[("plain", "v1")]["error"] is None
    finally:
        shutil.rmtree(tenants)


@pytest.mark.parametrize("gone", ["removed", "linked_out"])
async def test_a_served_version_whose_folder_went_away_keeps_serving_on_later_pushes(client, qv_adapters_dir, tmp_path,
                                                                                    gone):
    """A folder refused at the check is that version's failure only where the push would register it: a version
    served from that path keeps serving the weights the engine holds (held to their digest when read), with no
    error where the folder is gone, and the refusal said where it now leads out of the roots. Refusing it at every
    later push failed a serving version with 503 because its tenant removed an old folder."""
    import shutil

    folder = shutil.copytree(qv_adapters_dir / "alpha", qv_adapters_dir / f"served-{gone}")
    served = directive("gl", folder, sha256=adapter_digest(folder))
    try:
        assert (await push(client, 1, served))[("gl", "v1")]["error"] is None
        shutil.rmtree(folder)
        if gone == "linked_out":
            folder.symlink_to(shutil.copytree(qv_adapters_dir / "beta", tmp_path / "outside"), target_is_directory=True)
        report = await push(client, 2, served, directive("plain", qv_adapters_dir / "beta"))
        error = report[("gl", "v1")]["error"]
        if gone == "removed":
            assert error is None, report
        else:  # the path now leads elsewhere: not read there, and said so, the weights held still serving
            assert error.startswith(f"not served from {tmp_path / 'outside'}, kept from {folder}: "), error
        assert report[("plain", "v1")]["error"] is None, report
        status, answer = await complete(client, "gl")
        assert status == 200, answer
        # A new version from the same folder is refused, as it would be read there.
        moved = directive("gl", folder, sha256=adapter_digest(qv_adapters_dir / "beta"))
        moved["stable"]["version"] = "v2"
        report = await push(client, 3, moved)
        assert report[("gl", "v2")]["error"], report
    finally:
        if folder.is_symlink():
            folder.unlink()
        shutil.rmtree(folder, ignore_errors=True)


async def test_a_pushed_adapter_named_as_the_base_model_is_that_versions_error(client, qv_adapters_dir):
    """A request for the base model's name reaches the base model, so an adapter pushed under it could never be
    called: that version is refused (as load_lora_adapter and --adapters refuse the name), the base model serves
    on, and the push's other adapters load."""
    reported = await push(client, 1, directive("tiny", qv_adapters_dir / "alpha"),
                          directive("alpha", qv_adapters_dir / "alpha"))
    error = reported[("tiny", "v1")]["error"]
    assert error and "is the served model name of the base model" in error, error
    assert reported[("alpha", "v1")]["error"] is None
    status, answer = await complete(client, "tiny")
    assert status == 200 and answer["model"] == "tiny", answer
    listed = await (await client.get("/v1/models")).json()
    assert sorted(m["id"] for m in listed["data"]) == ["alpha", "tiny"]

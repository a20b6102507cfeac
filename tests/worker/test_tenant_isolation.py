"""Tenant isolation over HTTP (a worker on 127.0.0.1, tiny model, real PEFT adapters): a keys file never
opens the worker, keys that are not UTF-8 are refused, errors name no adapter of another tenant (nor tell
that it exists), and a stable version demoted to canary keeps serving its share."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from lorafleet.worker.app_keys import ENGINE, HOST
from lorafleet.worker.engine_config import EngineConfig
from lorafleet.worker.served_adapters import ServedAdapters
from lorafleet.worker.server import create_app
from lorafleet.worker.worker_config import WorkerConfig
from tests.openai_clients import close_openai_clients, openai_client  # noqa: F401 (the fixture closes them)

openai = pytest.importorskip("openai")  # installed with the test extras; absent on a bare GPU machine
AsyncOpenAI = openai.AsyncOpenAI

ADMIN = "admin-token-for-tests"
KEY_ACME, KEY_GLOBEX = "sk-acme-test", "sk-globex-test"
TENANTS = {"acme": {"keys": [KEY_ACME], "adapters": []}, "globex": {"keys": [KEY_GLOBEX], "adapters": []}}


def worker_config(tiny_llama_dir, qv_adapters_dir, tmp_path, tenants: dict | None = TENANTS, **engine) -> WorkerConfig:
    keys = None
    if tenants is not None:
        keys = tmp_path / "keys.json"
        keys.write_text(json.dumps({"tenants": tenants}))
    return WorkerConfig(engine=EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=128, **engine),
                        served_model_name="tiny", api_keys_file=keys and str(keys), admin_token=ADMIN,
                        adapter_roots=str(qv_adapters_dir))


def directive(name: str, tenant: str, version: str, uri: Path, **extra) -> dict:
    return {"name": name, "tenant": tenant, "stable": {"version": version, "uri": str(uri)}, **extra}


async def push(client, generation: int, *adapters: dict) -> dict:
    resp = await client.put("/admin/v1/state", json={"generation": generation, "adapters": list(adapters)},
                            headers={"Authorization": f"Bearer {ADMIN}"})
    body = await resp.json()
    assert resp.status == 200 and not any(a["error"] for a in body["adapters"]), body
    return body


def api_of(client, key: str) -> AsyncOpenAI:
    return openai_client(str(client.make_url("/v1")), key)


@pytest.mark.parametrize("tenants", [{}, {"acme": {"keys": [], "adapters": ["*"]}}], ids=["no-tenants", "no-keys"])
async def test_a_keys_file_without_keys_refuses_every_caller(aiohttp_client, tiny_llama_dir, qv_adapters_dir, tmp_path,
                                                             tenants):
    """A keys file whose tenants hold no key (all revoked, or not provisioned yet) must not turn the
    worker into development mode, where every caller may use every adapter."""
    client = await aiohttp_client(create_app(worker_config(tiny_llama_dir, qv_adapters_dir, tmp_path, tenants)))
    await push(client, 1, directive("alpha", "acme", "v1", qv_adapters_dir / "alpha"))
    api = api_of(client, "sk-anything")
    for model in ("alpha", "tiny"):
        with pytest.raises(openai.AuthenticationError):
            await api.completions.create(model=model, prompt="x", max_tokens=1)
        resp = await client.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 1})
        assert resp.status == 401 and (await resp.json())["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        await api.models.list()
    assert (await client.get("/v1/models")).status == 401


async def raw_bearer_request(port: int, method: str, path: str, token: bytes) -> tuple[bytes, bytes]:
    """(status line and headers, body) of a request whose bearer token is raw bytes (not UTF-8 perhaps)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Length: 0\r\n"
                 "Authorization: Bearer ".encode() + token + b"\r\n\r\n")
    await writer.drain()
    response = await reader.read()
    writer.close()
    await writer.wait_closed()
    head, _, body = response.partition(b"\r\n\r\n")
    return head, body


async def test_an_authorization_header_that_is_not_utf8_is_refused(aiohttp_client, tiny_llama_dir, qv_adapters_dir,
                                                                   tmp_path):
    client = await aiohttp_client(create_app(worker_config(tiny_llama_dir, qv_adapters_dir, tmp_path)))
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/admin/v1/state")):
        head, body = await raw_bearer_request(client.server.port, method, path, b"sk-\xff\xfe")
        assert head.startswith(b"HTTP/1.1 401"), (path, head)
        assert json.loads(body)["error"]["type"] == "authentication_error"


async def test_a_request_refused_for_pinned_slots_names_no_other_tenants_adapter(aiohttp_client, tiny_llama_dir,
                                                                                 qv_adapters_dir, tmp_path):
    """--max-loras 1 and acme's pinned adapter: globex's request cannot get a slot. Its 503 says why,
    the first time and every time after, without telling globex the name of acme's adapter."""
    client = await aiohttp_client(create_app(worker_config(tiny_llama_dir, qv_adapters_dir, tmp_path, max_loras=1)))
    await push(client, 1, directive("acme-secret", "acme", "v1", qv_adapters_dir / "alpha", pinned=True),
               directive("beta", "globex", "v1", qv_adapters_dir / "beta"))
    globex = api_of(client, KEY_GLOBEX)
    for _ in range(2):
        with pytest.raises(openai.APIStatusError) as err:
            await globex.completions.create(model="beta", prompt="hi", max_tokens=2)
        assert err.value.status_code == 503 and err.value.code == "adapter_load_failed"
        assert "pinned" in err.value.message and "acme-secret" not in err.value.message, err.value.message
    acme = await api_of(client, KEY_ACME).completions.create(model="acme-secret", prompt="hi", max_tokens=2)
    assert acme.model == "acme-secret@v1"


async def test_a_pinned_version_dropped_after_arrival_is_404_naming_no_other_adapter(
        aiohttp_client, tiny_llama_dir, qv_adapters_dir, tmp_path, monkeypatch):
    """A push may unregister the version a request pinned (`name@version`) after the request resolved
    it and before the engine takes it. The answer is a 404 about that version, not the engine's list of
    every adapter registered on the worker (other tenants' included)."""
    app = create_app(worker_config(tiny_llama_dir, qv_adapters_dir, tmp_path))
    client = await aiohttp_client(app)
    await push(client, 1, directive("alpha", "acme", "v1", qv_adapters_dir / "alpha"),
               directive("globex-secret", "globex", "g1", qv_adapters_dir / "beta"))
    real = ServedAdapters.resolve

    def resolve_then_a_push_unloads_it(self, model, tenant, user):
        key = real(self, model, tenant, user)
        app[HOST].unregister_adapter(key.partition("@")[0])  # the push lands between arrival and admission
        return key

    monkeypatch.setattr(ServedAdapters, "resolve", resolve_then_a_push_unloads_it)
    with pytest.raises(openai.NotFoundError) as err:
        await api_of(client, KEY_ACME).completions.create(model="alpha@v1", prompt="x", max_tokens=1)
    assert err.value.code == "model_not_found" and "alpha@v1" in err.value.message
    assert "globex" not in err.value.message, err.value.message


async def test_another_tenants_adapter_is_answered_as_one_that_does_not_exist(aiohttp_client, tiny_llama_dir,
                                                                           qv_adapters_dir, tmp_path):
    """acme probing for globex's adapter (by name, or name@version) gets the very answer a name that
    exists nowhere gets: no status, code or wording tells it that globex has such an adapter."""
    client = await aiohttp_client(create_app(worker_config(tiny_llama_dir, qv_adapters_dir, tmp_path)))
    await push(client, 1, directive("globex-secret", "globex", "g1", qv_adapters_dir / "beta"))

    async def answer(model: str) -> tuple[int, dict]:
        resp = await client.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 1},
                                 headers={"Authorization": f"Bearer {KEY_ACME}"})
        body = await resp.json()
        body["error"]["message"] = body["error"]["message"].replace(model, "<model>")
        return resp.status, body

    for model in ("globex-secret", "globex-secret@g1"):
        assert await answer(model) == await answer(model.replace("globex-secret", "globex-nothing")), model
        assert (await answer(model))[0] == 404
    resp = await client.post("/v1/completions", json={"model": "globex-secret", "prompt": "x", "max_tokens": 1},
                             headers={"Authorization": f"Bearer {KEY_GLOBEX}"})
    assert resp.status == 200, await resp.text()


async def test_models_retrieve_finds_ones_own_models_and_not_another_tenants(aiohttp_client, tiny_llama_dir,
                                                                              qv_adapters_dir, tmp_path):
    """`client.models.retrieve(id)` (GET /v1/models/{id}) answers the entry /v1/models lists; another
    tenant's adapter gets the very 404 a name that exists nowhere gets."""
    client = await aiohttp_client(create_app(worker_config(tiny_llama_dir, qv_adapters_dir, tmp_path)))
    await push(client, 1, directive("globex-secret", "globex", "g1", qv_adapters_dir / "beta"))
    globex, acme = api_of(client, KEY_GLOBEX), api_of(client, KEY_ACME)
    listed = {m.id: m for m in (await globex.models.list()).data}
    got = await globex.models.retrieve("globex-secret")
    assert got.id == "globex-secret" and got.model_dump() == listed["globex-secret"].model_dump()
    assert (await globex.models.retrieve("tiny")).id == "tiny"
    # The `model` an answer names (name@version) is found too, as the name's entry.
    by_version = await globex.models.retrieve("globex-secret@g1")
    assert by_version.id == "globex-secret@g1" and by_version.model_dump() == listed["globex-secret"].model_dump() | {
        "id": "globex-secret@g1"}
    with pytest.raises(openai.NotFoundError):
        await globex.models.retrieve("globex-secret@g2")
    answers = []
    for model in ("globex-secret", "globex-nothing", "globex-secret@g1"):
        with pytest.raises(openai.NotFoundError) as err:
            await acme.models.retrieve(model)
        answers.append((err.value.code, err.value.message.replace(model, "<model>")))
    assert answers[0] == answers[1] == answers[2] and answers[0][0] == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        await api_of(client, "sk-nobody").models.retrieve("tiny")


async def test_a_stable_version_kept_as_the_canary_serves_its_share(aiohttp_client, tiny_llama_dir, qv_adapters_dir,
                                                                    tmp_path):
    """Rolling out v2 while v1 (the stable until now) stays as the canary: the switch to v2 must not
    retire v1, which still serves its weight of users and requests pinning it."""
    client = await aiohttp_client(create_app(worker_config(tiny_llama_dir, qv_adapters_dir, tmp_path)))
    acme = api_of(client, KEY_ACME)
    v1, v2 = {"version": "v1", "uri": str(qv_adapters_dir / "alpha")}, {"version": "v2", "uri": str(qv_adapters_dir / "beta")}
    await push(client, 1, {"name": "alpha", "tenant": "acme", "stable": v1})
    assert (await acme.completions.create(model="alpha", prompt="x", max_tokens=1)).model == "alpha@v1"

    for generation, (stable, canary) in enumerate([(v2, v1), (v1, v2)], start=2):  # then back again
        await push(client, generation, {"name": "alpha", "tenant": "acme", "stable": stable, "canary": canary,
                                        "canary_weight": 100})
        canary_key, stable_key = f"alpha@{canary['version']}", f"alpha@{stable['version']}"
        for model, served in (("alpha", canary_key), (canary_key, canary_key), (stable_key, stable_key)):
            resp = await acme.completions.create(model=model, prompt="x", max_tokens=1, user="u-1")
            assert resp.model == served, (generation, model)


async def test_the_engine_learns_whose_request_it_is_for_fair_seats(aiohttp_client, tiny_llama_dir, qv_adapters_dir,
                                                                     tmp_path, monkeypatch):
    """The scheduler shares seats across tenants (worker/waiting_queue.py): each engine request carries the
    caller's tenant; in development mode (one open tenant) none, so seats are shared by adapter instead."""
    seen = []
    for tenants, key, want in ((TENANTS, KEY_GLOBEX, "globex"), (None, "sk-anything", None)):
        app = create_app(worker_config(tiny_llama_dir, qv_adapters_dir, tmp_path, tenants))
        client = await aiohttp_client(app)
        engine = app[ENGINE].engine
        real = engine.add_request

        def add_request(*args, real=real, **kwargs):
            seen.append(kwargs.get("tenant"))
            return real(*args, **kwargs)

        monkeypatch.setattr(engine, "add_request", add_request)
        resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "n": 2},
                                 headers={"Authorization": f"Bearer {key}"})
        assert resp.status == 200, await resp.text()
        assert seen[-2:] == [want, want]


async def test_a_name_given_to_another_tenant_never_serves_the_old_owners_weights(aiohttp_client, tiny_llama_dir,
                                                                                   qv_adapters_dir, tmp_path):
    """`sql` was acme's (v1); a push gives the name to globex with globex's own v2. While v2 waits for a GPU
    slot (one acme request still holds v1's), and when v2 cannot be registered at all, globex is never
    answered by acme's v1: not as the fallback of a failed rollout, nor when it names `sql@v1` itself."""
    app = create_app(worker_config(tiny_llama_dir, qv_adapters_dir, tmp_path, max_loras=1))
    client = await aiohttp_client(app)
    await push(client, 1, directive("sql", "acme", "v1", qv_adapters_dir / "alpha"))
    acme, globex = api_of(client, KEY_ACME), api_of(client, KEY_GLOBEX)
    assert (await acme.completions.create(model="sql", prompt="x", max_tokens=1)).model == "sql@v1"
    pool = app[ENGINE].engine.adapter_pool
    running = pool.acquire("sql@v1")  # an acme request still running on v1: v2 cannot take the one slot yet
    assert running is not None
    await push(client, 2, directive("sql", "globex", "v2", qv_adapters_dir / "beta"))
    with pytest.raises(openai.NotFoundError):
        await globex.completions.create(model="sql@v1", prompt="x", max_tokens=1)
    pool.release(running)
    assert (await globex.completions.create(model="sql", prompt="x", max_tokens=1)).model == "sql@v2"

    await push(client, 3, directive("sql", "acme", "v1", qv_adapters_dir / "alpha"))
    assert (await acme.completions.create(model="sql", prompt="x", max_tokens=1)).model == "sql@v1"
    resp = await client.put("/admin/v1/state", headers={"Authorization": f"Bearer {ADMIN}"}, json={
        "generation": 4, "adapters": [directive("sql", "globex", "v3", qv_adapters_dir / "no-such-folder")]})
    report = (await resp.json())["adapters"]
    assert resp.status == 200 and [(a["version"], bool(a["error"])) for a in report] == [("v3", True)], report
    with pytest.raises(openai.APIStatusError) as refused:
        await globex.completions.create(model="sql", prompt="x", max_tokens=1)
    assert refused.value.status_code == 503 and "sql@v1" not in str(refused.value)


async def test_a_pattern_grants_only_adapters_nobody_owns(aiohttp_client, tiny_llama_dir, qv_adapters_dir, tmp_path):
    """acme's keys-file pattern `acme-*` covers `acme-shared`, which no tenant owns, and `acme-seeded`, whose
    owner is `default` (as the s3:// --adapters seed pushes them), but not `acme-tuned`, whose directive names
    globex: naming an adapter into another tenant's pattern must not hand it over."""
    tenants = {"acme": {"keys": [KEY_ACME], "adapters": ["acme-*"]}, "globex": {"keys": [KEY_GLOBEX], "adapters": []}}
    client = await aiohttp_client(create_app(worker_config(tiny_llama_dir, qv_adapters_dir, tmp_path, tenants)))
    await push(client, 1, directive("acme-tuned", "globex", "v1", qv_adapters_dir / "alpha"),
               directive("acme-seeded", "default", "v1", qv_adapters_dir / "beta"))
    resp = await client.post("/v1/load_lora_adapter", headers={"Authorization": f"Bearer {ADMIN}"},
                             json={"lora_name": "acme-shared", "lora_path": str(qv_adapters_dir / "beta")})
    assert resp.status == 200, await resp.text()
    acme, globex = api_of(client, KEY_ACME), api_of(client, KEY_GLOBEX)
    assert {m.id for m in (await acme.models.list()).data} == {"tiny", "acme-shared", "acme-seeded"}
    with pytest.raises(openai.NotFoundError) as refused:
        await acme.completions.create(model="acme-tuned", prompt="x", max_tokens=1)
    assert "globex" not in str(refused.value)
    assert (await acme.completions.create(model="acme-shared", prompt="x", max_tokens=1)).model.startswith("acme-shared@")
    assert (await globex.completions.create(model="acme-tuned", prompt="x", max_tokens=1)).model == "acme-tuned@v1"
    assert (await acme.completions.create(model="acme-seeded", prompt="x", max_tokens=1)).model == "acme-seeded@v1"
    assert {m.id for m in (await globex.models.list()).data} == {"tiny", "acme-tuned"}


async def test_keys_rotate_over_http_and_a_hung_keys_mount_stalls_no_request(aiohttp_client, tiny_llama_dir,
                                                                             qv_adapters_dir, tmp_path, monkeypatch):
    """Every request looked at the keys file (os.stat, and a read when it changed) on the event loop: a hung
    Secret mount stalled the whole server. Keys are checked in memory; a thread looks at the file every
    second, so a rotated key works and a revoked one stops without a restart."""
    import threading
    import time

    from lorafleet.worker import tenants as tenants_module

    client = await aiohttp_client(create_app(worker_config(tiny_llama_dir, qv_adapters_dir, tmp_path)))
    models = "/v1/models"
    assert (await client.get(models, headers={"Authorization": f"Bearer {KEY_ACME}"})).status == 200
    rotated = tmp_path / "keys.json.new"
    rotated.write_text(json.dumps({"tenants": {**TENANTS, "acme": {"keys": ["sk-acme-rotated"], "adapters": []}}}))
    rotated.replace(tmp_path / "keys.json")
    deadline = time.monotonic() + 10
    while (await client.get(models, headers={"Authorization": "Bearer sk-acme-rotated"})).status != 200:
        assert time.monotonic() < deadline, "the rotated key never took effect"
        await asyncio.sleep(0.05)
    assert (await client.get(models, headers={"Authorization": f"Bearer {KEY_ACME}"})).status == 401

    hung, looked = threading.Event(), threading.Event()
    real_stamp = tenants_module._stamp

    def hung_stamp(path):
        looked.set()
        hung.wait(30)
        return real_stamp(path)

    monkeypatch.setattr(tenants_module, "_stamp", hung_stamp)
    try:
        assert await asyncio.get_running_loop().run_in_executor(None, looked.wait, 10)  # the watch is stuck on it
        started = time.monotonic()
        for _ in range(3):
            assert (await client.get(models, headers={"Authorization": f"Bearer {KEY_GLOBEX}"})).status == 200
        assert time.monotonic() - started < 20  # not waiting for the mount (it holds for 30 s a look)
    finally:
        hung.set()

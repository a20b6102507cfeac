"""A new pod's first push (stager_http.readyz, stager_push._finish): it stages while the engine's model loads,
reaches the engine once that is up, and only then does the sidecar's `/readyz` let the pod into its Service,
so that no request for one of its pool's adapters is answered 404 while they stage. Against an engine admin API
stand-in that answers as a starting engine does (503 `not_ready`), or is not listening yet."""

from __future__ import annotations

import asyncio
import dataclasses
import socket

import pytest
from aiohttp import web

from lorafleet.worker.stager_config import StagerConfig
from lorafleet.worker.stager_http import STAGER, create_app
from lorafleet.worker.stager_push import RETRY_FIRST_S
from tests.worker.engine_admin_stub import HANG_S, EngineAdminStub, until
from tests.worker.test_stager_bounds import TOKEN, FakeStore, config
from tests.worker.test_stager_engine import adapter, push

AUTH = {"Authorization": f"Bearer {TOKEN}"}


class StartingEngine(EngineAdminStub):
    """Answers every admin call 503 `not_ready`, as the engine's admin API does while its model loads, until
    `started` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.started = asyncio.Event()
        self.asked_while_starting = 0

    def _starting(self) -> web.Response | None:
        if self.started.is_set():
            return None
        self.asked_while_starting += 1
        return web.json_response({"error": {"message": "the worker is starting", "type": "service_unavailable",
                                            "code": "not_ready"}}, status=503)

    async def put_state(self, request: web.Request) -> web.Response:
        return self._starting() or await super().put_state(request)

    async def get_state(self, request: web.Request) -> web.Response:
        return self._starting() or await super().get_state(request)

    async def get_directives(self, request: web.Request) -> web.Response:
        return self._starting() or await super().get_directives(request)

    def app(self) -> web.Application:
        app = web.Application()
        app.add_routes([web.put("/admin/v1/state", self.put_state), web.get("/admin/v1/state", self.get_state),
                        web.get("/admin/v1/directives", self.get_directives)])
        return app


async def _sidecar(aiohttp_client, tmp_path, monkeypatch, engine_url: str, **settings):
    app = create_app(dataclasses.replace(config(tmp_path), engine_url=engine_url, ready_after_push=True, **settings))
    client = await aiohttp_client(app)
    store = FakeStore(app[STAGER], monkeypatch)
    return client, store


async def _ready(client) -> tuple[int, dict]:
    resp = await client.get("/readyz")
    return resp.status, await resp.json()


async def test_a_new_pod_s_push_stages_while_the_model_loads_and_the_pod_is_ready_once_it_reached_the_engine(
        aiohttp_server, aiohttp_client, tmp_path, monkeypatch):
    """The operator's push (respond-async) comes while the engine answers 503 `not_ready`: it is answered at once
    (accepted, nothing applied), the versions are downloaded meanwhile, and the push reaches the engine once it is
    up instead of failing. Until then the sidecar's /readyz is 503 `awaiting_push` and its report says so; after,
    200, for good."""
    engine = StartingEngine()
    server = await aiohttp_server(engine.app())
    client, store = await _sidecar(aiohttp_client, tmp_path, monkeypatch, str(server.make_url("")))
    status, body = await _ready(client)
    assert status == 503 and body["status"] == "awaiting_push" and body["error"]["code"] == "awaiting_push"
    state = await (await client.get("/v1/state", headers=AUTH)).json()
    assert state["awaiting_push"] is True and "engine starting" in state["error"]

    desired = push(7, adapter("a", "v1", warm=True), adapter("b", "v1"))
    resp = await asyncio.wait_for(client.put("/v1/directives", data=desired.to_json(),
                                             headers={**AUTH, "Prefer": "respond-async"}), HANG_S)
    assert resp.status == 202, await resp.text()
    assert (await resp.json())["awaiting_push"] is True
    await until(lambda: len(store.calls) == 2)  # both downloaded while the model loads
    await until(lambda: engine.asked_while_starting >= 3)  # the push polls; it did not fail
    assert engine.pushes == [] and (await _ready(client))[0] == 503
    state = await (await client.get("/v1/state", headers=AUTH)).json()
    assert sorted(a["name"] for a in state["adapters"]) == ["a", "b"] and state["generation_applied"] == 0

    engine.started.set()
    await until(lambda: client.app[STAGER].delivered)
    report = await (await client.get("/v1/state", headers=AUTH)).json()
    assert report["generation_applied"] == 7 and report["awaiting_push"] is False
    assert sorted(a["name"] for a in engine.pushes[-1]["adapters"]) == ["a", "b"]
    assert all(ref["uri"].startswith("/") for a in engine.pushes[-1]["adapters"] for ref in [a["stable"]])
    assert await _ready(client) == (200, {"status": "ready"})

    engine.started.clear()  # an engine that restarts later: the pod stays ready (the engine's own probe says so)
    assert await _ready(client) == (200, {"status": "ready"})


async def test_what_is_staged_reaches_the_engine_as_soon_as_it_is_up(aiohttp_server, aiohttp_client, tmp_path,
                                                                      monkeypatch):
    """a is staged, b still downloading when the engine comes up: a reaches it then (served without waiting for
    b), and the pod turns ready only once b is in too."""
    engine = StartingEngine()
    server = await aiohttp_server(engine.app())
    client, store = await _sidecar(aiohttp_client, tmp_path, monkeypatch, str(server.make_url("")))
    store.hold = True
    resp = await client.put("/v1/directives", data=push(7, adapter("a", "v1"), adapter("b", "v1")).to_json(),
                            headers={**AUTH, "Prefer": "respond-async"})
    assert resp.status == 202
    await until(lambda: len(store.calls) == 1)
    store.calls[0][1].set()  # a is in; b's download is held
    await until(lambda: len(store.calls) == 2)
    engine.started.set()
    await until(lambda: engine.pushes and [a["name"] for a in engine.pushes[-1]["adapters"]] == ["a"])
    assert (await _ready(client))[0] == 503
    store.calls[1][1].set()
    await until(lambda: client.app[STAGER].delivered)
    assert [a["name"] for a in engine.pushes[-1]["adapters"]] == ["a", "b"] and (await _ready(client))[0] == 200


async def test_an_engine_not_listening_yet_is_waited_for(aiohttp_server, aiohttp_client, tmp_path, monkeypatch):
    """The engine's port refuses connections (its process not listening yet): the push waits for it too. The port
    stays bound (not listening: connections are refused) until the engine listens on that very socket, so no
    other test can take it meanwhile."""
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    runner = None
    try:
        client, store = await _sidecar(aiohttp_client, tmp_path, monkeypatch, f"http://127.0.0.1:{port}")
        resp = await client.put("/v1/directives", data=push(3, adapter("a", "v1")).to_json(),
                                headers={**AUTH, "Prefer": "respond-async"})
        assert resp.status == 202
        await until(lambda: len(store.calls) == 1)
        await asyncio.sleep(1.2)  # two polls at least, each refused: a failing push would have ended by now
        assert not client.app[STAGER].delivered and client.app[STAGER].pending
        engine = StartingEngine()
        engine.started.set()
        runner = web.AppRunner(engine.app())
        await runner.setup()
        await web.SockSite(runner, probe).start()
        await until(lambda: client.app[STAGER].delivered)
        assert [a["name"] for a in engine.pushes[-1]["adapters"]] == ["a"]
        assert (await _ready(client))[0] == 200
    finally:
        if runner is not None:
            await runner.cleanup()
        probe.close()


async def test_a_push_that_fails_to_reach_its_engine_is_tried_again_by_the_sidecar(aiohttp_server, aiohttp_client,
                                                                                   tmp_path, monkeypatch):
    """Past --engine-start-wait-s the forward is tried and fails (the engine still loading); the operator, told
    the push was accepted and seeing every version listed, sends no other: the sidecar tries again by itself,
    and the pod turns ready once the engine takes it."""
    engine = StartingEngine()
    server = await aiohttp_server(engine.app())
    client, _ = await _sidecar(aiohttp_client, tmp_path, monkeypatch, str(server.make_url("")),
                               engine_start_wait_s=0.3)
    resp = await client.put("/v1/directives", data=push(3, adapter("a", "v1")).to_json(),
                            headers={**AUTH, "Prefer": "respond-async"})
    assert resp.status == 202
    await asyncio.sleep(1.0)  # the wait has run out: its forward failed
    assert (await _ready(client))[0] == 503 and engine.pushes == []
    engine.started.set()
    await until(lambda: client.app[STAGER].delivered)
    assert [a["name"] for a in engine.pushes[-1]["adapters"]] == ["a"] and (await _ready(client))[0] == 200


async def test_a_stager_restarted_beside_a_serving_engine_is_ready_at_once(aiohttp_server, aiohttp_client, tmp_path,
                                                                           monkeypatch):
    """Its engine applied an earlier sidecar's whole push (in this pod: the mark in the cache folder names it):
    the sidecar that restarts beside it is ready at once, with no push needed. A pod whose cache folder is kept
    on the node (hostPath) is another pod: its sidecar waits for its own push."""
    engine = StartingEngine()
    engine.started.set()
    server = await aiohttp_server(engine.app())
    client, _ = await _sidecar(aiohttp_client, tmp_path, monkeypatch, str(server.make_url("")))
    resp = await client.put("/v1/directives", data=push(12, adapter("a", "v1")).to_json(), headers=AUTH)
    assert resp.status == 200 and await _ready(client) == (200, {"status": "ready"})
    client.app[STAGER].cancel_pushes()  # its container restarts: the engine and the cache folder stay
    client, _ = await _sidecar(aiohttp_client, tmp_path, monkeypatch, str(server.make_url("")))
    assert await _ready(client) == (200, {"status": "ready"})
    assert (await (await client.get("/v1/state", headers=AUTH)).json())["awaiting_push"] is False
    monkeypatch.setenv("HOSTNAME", "worker-next-pod")
    client, _ = await _sidecar(aiohttp_client, tmp_path, monkeypatch, str(server.make_url("")))
    assert (await _ready(client))[0] == 503


async def test_a_stager_restarted_while_its_first_push_staged_waits_for_a_whole_push(aiohttp_server, aiohttp_client,
                                                                                     tmp_path, monkeypatch):
    """The first push's staged part reached the engine (a generation), b still downloads, and the sidecar restarts:
    the new one does not take that generation for a delivered push (the pod would enter its Service answering 404
    for b); it is ready once a push reached the engine whole."""
    engine = StartingEngine()
    engine.started.set()
    server = await aiohttp_server(engine.app())
    cfg = dataclasses.replace(config(tmp_path), engine_url=str(server.make_url("")), ready_after_push=True)
    client = await aiohttp_client(create_app(cfg))
    store = FakeStore(client.app[STAGER], monkeypatch, hold=True)
    first = push(7, adapter("a", "v1"), adapter("b", "v1"))
    resp = await client.put("/v1/directives", data=first.to_json(), headers={**AUTH, "Prefer": "respond-async"})
    assert resp.status == 202
    await until(lambda: len(store.calls) >= 1)
    store.calls[0][1].set()  # one is in, the other's download held
    await until(lambda: bool(engine.pushes) and len(engine.pushes[-1]["adapters"]) == 1)
    client.app[STAGER].cancel_pushes()  # the sidecar's container restarts
    for _, release in store.calls:
        release.set()
    client = await aiohttp_client(create_app(cfg))
    FakeStore(client.app[STAGER], monkeypatch)
    status, body = await _ready(client)
    assert (status, body["status"]) == (503, "awaiting_push")
    assert (await (await client.get("/v1/state", headers=AUTH)).json())["awaiting_push"] is True
    resp = await client.put("/v1/directives", data=push(8, adapter("a", "v1"), adapter("b", "v1")).to_json(),
                            headers=AUTH)
    assert resp.status == 200 and len(engine.pushes[-1]["adapters"]) == 2
    assert await _ready(client) == (200, {"status": "ready"})


async def test_readiness_without_a_push_after_the_limit_and_without_the_gate(aiohttp_server, aiohttp_client,
                                                                             tmp_path, monkeypatch):
    """--ready-without-push-s: ready anyway once it passed (the base model serves); no --ready-after-push: ready
    as soon as it listens. Neither needs the token, as a kubelet probe has none."""
    engine = StartingEngine()
    engine.started.set()
    url = str((await aiohttp_server(engine.app())).make_url(""))
    client, _ = await _sidecar(aiohttp_client, tmp_path, monkeypatch, url, ready_without_push_s=0.0)
    assert await _ready(client) == (200, {"status": "ready", "adapters": "none pushed yet"})
    plain = await aiohttp_client(create_app(dataclasses.replace(config(tmp_path / "other"), engine_url=url)))
    assert await _ready(plain) == (200, {"status": "ready"})


def test_the_readiness_settings_are_checked():
    with pytest.raises(ValueError, match="ready_without_push_s"):
        StagerConfig(stager_token=TOKEN, ready_without_push_s=-1.0)


@pytest.mark.parametrize(("status", "retried"), [(500, True), (401, False)])
async def test_an_engine_error_is_tried_again_and_a_refusal_is_not(aiohttp_server, aiohttp_client, tmp_path,
                                                                   monkeypatch, status, retried):
    """The forwards of a starting engine's push meet a 500 (an engine error that may pass): the push's own is
    tried again and delivered. A 401 (a wrong admin token) is a refusal no retry changes: not sent again."""
    engine = StartingEngine()
    engine.started.set()
    put = engine.put_state
    puts = []

    async def failing_once(request):
        puts.append(request)
        if len(puts) <= 2 or not retried:  # the staged set's forward and the push's own fail; a refusal stays one
            return web.json_response({"error": {"message": "no", "code": "x"}}, status=status)
        return await put(request)

    engine.put_state = failing_once
    server = await aiohttp_server(engine.app())
    client, _ = await _sidecar(aiohttp_client, tmp_path, monkeypatch, str(server.make_url("")))
    client.app[STAGER].engine.known = False  # as for an engine found starting: the push is one of those
    monkeypatch.setattr("lorafleet.worker.stager_push._adopt", _starting_adopt)
    resp = await client.put("/v1/directives", data=push(3, adapter("a", "v1")).to_json(),
                            headers={**AUTH, "Prefer": "respond-async"})
    assert resp.status == 202
    if retried:
        await until(lambda: client.app[STAGER].delivered)
    else:  # the staged set's forward and the push's own, each refused; no retry after them
        await asyncio.sleep(RETRY_FIRST_S + 1)
        assert len(puts) <= 2 and not client.app[STAGER].delivered
    # The report says why the push is not applied (the operator puts it in the pool's and adapters' status).
    error = (await (await client.get("/v1/state", headers=AUTH)).json())["error"]
    if retried:
        assert error is None
    else:
        assert error.startswith("push 3 did not reach the engine: engine refused") and "401" in error, error


async def _starting_adopt(stager) -> str:
    return "starting"


async def test_an_engine_restarted_beside_its_sidecar_is_handed_its_adapters_again(aiohttp_server, aiohttp_client,
                                                                                  tmp_path, monkeypatch):
    """The engine container restarts (it holds nothing, generation 0) while the sidecar runs on: the sidecar
    forwards what it last forwarded, from its local copies, without waiting for the operator."""
    import lorafleet.worker.stager_watch as stager_watch

    monkeypatch.setattr(stager_watch, "WATCH_EVERY_S", 0.1)
    engine = StartingEngine()
    engine.started.set()
    server = await aiohttp_server(engine.app())
    client, store = await _sidecar(aiohttp_client, tmp_path, monkeypatch, str(server.make_url("")))
    resp = await client.put("/v1/directives", data=push(5, adapter("a", "v1"), adapter("b", "v1")).to_json(),
                            headers=AUTH)
    assert resp.status == 200 and client.app[STAGER].delivered
    downloads = len(store.calls)
    engine.pushes.clear()  # restarted: nothing applied
    await until(lambda: engine.pushes)
    assert sorted(a["name"] for a in engine.pushes[-1]["adapters"]) == ["a", "b"] and len(store.calls) == downloads
    report = await (await client.get("/v1/state", headers=AUTH)).json()
    assert report["generation_applied"] == 5  # the push it carries out, as the operator pushed it

    # The sidecar restarts (it takes what the engine holds as forwarded), then the engine does, before any push:
    # the new sidecar hands it what it found the engine holding.
    restarted, _ = await _sidecar(aiohttp_client, tmp_path, monkeypatch, str(server.make_url("")))
    assert restarted.app[STAGER].delivered and restarted.app[STAGER].desired is None
    await client.close()
    held = engine.pushes[-1]["adapters"]
    engine.pushes.clear()
    await until(lambda: engine.pushes)
    assert engine.pushes[-1]["adapters"] == held

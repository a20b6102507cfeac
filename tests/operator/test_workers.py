"""Worker discovery (label selectors, readiness, the sidecar's port) and the sidecar client."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from lorafleet.operator.ownership import invalid_pool_claim, own_pods, pool_claims
from lorafleet.operator.workers import (
    MAX_REASON_BYTES,
    Refused,
    StagerClient,
    Worker,
    discover_workers,
    pod_is_ready,
    selector_matches,
)
from lorafleet.worker.directives import AdapterDirective, DesiredState, ReportedState, VersionRef

from .fake_stager import FakeStager
from .local_http import serving


@pytest.mark.parametrize(("selector", "labels", "expected"), [
    ({"matchLabels": {"app": "w"}}, {"app": "w", "x": "1"}, True),
    ({"matchLabels": {"app": "w"}}, {"app": "v"}, False),
    ({"matchExpressions": [{"key": "tier", "operator": "In", "values": ["gpu", "a100"]}]}, {"tier": "gpu"}, True),
    ({"matchExpressions": [{"key": "tier", "operator": "In", "values": ["gpu"]}]}, {}, False),
    ({"matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["cpu"]}]}, {}, True),
    ({"matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["cpu"]}]}, {"tier": "cpu"}, False),
    ({"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}, {"gpu": ""}, True),
    ({"matchExpressions": [{"key": "gpu", "operator": "DoesNotExist"}]}, {"gpu": ""}, False),
    ({"matchLabels": {"app": "w"}, "matchExpressions": [{"key": "gpu", "operator": "Exists"}]}, {"app": "w"}, False),
])
def test_selector_matches(selector, labels, expected):
    assert selector_matches(selector, labels) is expected


def pod(name, *, labels=None, phase="Running", ready="True", ip="10.0.0.1", deleting=False, stager_port=None):
    ports = [{"name": "stager", "containerPort": stager_port}] if stager_port else []
    meta = {"name": name, "labels": labels if labels is not None else {"app": "w"}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 8000}]},
                                                      {"ports": ports}]},
            "status": {"phase": phase, "podIP": ip, "conditions": [{"type": "Ready", "status": ready}]}}


def test_discovery_takes_ready_selected_pods_only():
    pods = [pod("b", stager_port=9001), pod("a"), pod("not-ready", ready="False"), pod("pending", phase="Pending"),
            pod("no-ip", ip=None), pod("terminating", deleting=True), pod("other", labels={"app": "x"})]
    assert not pod_is_ready(pods[2]) and pod_is_ready(pods[0])
    workers = discover_workers(pods, {"matchLabels": {"app": "w"}}, default_port=8001)
    assert workers == [Worker("a", "http://10.0.0.1:8001"), Worker("b", "http://10.0.0.1:9001")]


@pytest.mark.parametrize(("ip", "url"), [("10.0.0.1", "http://10.0.0.1:8001"),
                                         ("fd00:10:244::7", "http://[fd00:10:244::7]:8001"),
                                         ("::1", "http://[::1]:8001")])
def test_discovery_brackets_ipv6_pod_ips(ip, url):
    assert discover_workers([pod("a", ip=ip)], {"matchLabels": {"app": "w"}}, default_port=8001) == [Worker("a", url)]


@pytest.fixture()
async def sidecar():
    async with FakeStager("sidecar-token-123456") as s:
        yield s


async def test_client_push_read_and_stale_generation(sidecar):
    client = StagerClient(token="sidecar-token-123456", timeout=2.0)
    worker = Worker("w", f"http://127.0.0.1:{sidecar.port}")
    desired = DesiredState(5, [AdapterDirective("a", "t", VersionRef("v1", "s3://b/a/v1/"), warm=True)])
    try:
        assert await client.push(worker, desired) is True
        state = await client.fetch_state(worker)
        assert state.generation_applied == 5 and state.find("a", "v1").tier == "gpu"
        # A stale generation is refused (409): an answer, unlike a sidecar that does not answer.
        refused = await client.push(worker, DesiredState(4, []))
        assert isinstance(refused, Refused) and refused.stale and not refused
        assert sidecar.refused == 1
        # A sidecar that is gone: no state, no answer to a push, no exception.
        await sidecar.stop()
        assert await client.fetch_state(worker) is None
        assert await client.push(worker, desired) is None
    finally:
        await client.close()


def pool_body(name, labels, **spec):
    return {"metadata": {"name": name},
            "spec": {"baseModel": "m", "workerSelector": {"matchLabels": labels}, **spec}}


def names(pods):
    return [p["metadata"]["name"] for p in pods]


TWO_PODS = [pod("both", labels={"app": "w", "gpu": "h200"}), pod("mine", labels={"app": "w"})]


def test_a_pod_matched_by_two_pools_belongs_to_the_first_by_name():
    own, shared = own_pods("zeta", {"matchLabels": {"app": "w"}}, TWO_PODS, pool_claims([pool_body("alpha", {"gpu": "h200"})]))
    assert names(own) == ["mine"] and shared == {"both": "alpha"}
    # The first pool by name keeps it.
    own, shared = own_pods("alpha", {"matchLabels": {"gpu": "h200"}}, TWO_PODS, pool_claims([pool_body("zeta", {"app": "w"})]))
    assert names(own) == ["both"] and shared == {}


@pytest.mark.parametrize("bad_spec", [{"eviction": "fifo"}, {"baseModel": ""}, {"stagerPort": 0}])
def test_an_invalid_pool_keeps_its_place_in_the_order_by_name(bad_spec):
    """An invalid spec pushes nothing, yet a later pool does not take its pods over; both report it."""
    alpha = pool_body("alpha", {"gpu": "h200"}, **bad_spec)
    own, shared = own_pods("zeta", {"matchLabels": {"app": "w"}}, TWO_PODS, pool_claims([alpha]))
    assert names(own) == ["mine"] and shared == {"both": "alpha"}
    assert invalid_pool_claim(alpha, TWO_PODS, [pool_body("zeta", {"app": "w"})]) == (["both"], {})
    # An invalid pool after a valid one by name: the valid one keeps the pod, the invalid one reports it.
    zeta = pool_body("zeta", {"app": "w"}, **bad_spec)
    assert invalid_pool_claim(zeta, TWO_PODS, [pool_body("alpha", {"gpu": "h200"})]) == (["mine"], {"both": "alpha"})


def test_an_invalid_selector_claims_nothing_and_a_deleting_pool_claims_nothing():
    unknown = pool_body("alpha", {}, eviction="fifo")  # which pods it meant is unknown
    assert invalid_pool_claim(unknown, TWO_PODS, []) == ([], {})
    own, shared = own_pods("zeta", {"matchLabels": {"app": "w"}}, TWO_PODS, pool_claims([unknown]))
    assert names(own) == ["both", "mine"] and shared == {}
    deleting = pool_body("alpha", {"gpu": "h200"}, eviction="fifo")
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    own, shared = own_pods("zeta", {"matchLabels": {"app": "w"}}, TWO_PODS, pool_claims([deleting]))
    assert names(own) == ["both", "mine"] and shared == {}


@pytest.mark.parametrize(("others", "handed_over"), [
    ([pool_body("zeta", {"gpu": "h200"})], {"both": "zeta"}),  # a valid pool pushes its own set over it
    ([pool_body("alpha", {"gpu": "h200"}, eviction="fifo")], {"both": "alpha"}),  # it held the pod already
    ([pool_body("zeta", {"gpu": "h200"}, eviction="fifo")], {}),  # pushes nothing: the deleting pool empties it
    # The pool that owns it next is invalid and never held it: emptied, though a valid one comes after.
    ([pool_body("zeta", {"gpu": "h200"}), pool_body("nu", {"gpu": "h200"}, eviction="fifo")], {}),
    ([pool_body("omega", {"gpu": "h200"}), pool_body("zeta", {"gpu": "h200"}, eviction="fifo")], {"both": "omega"}),
])
def test_a_deleting_pool_empties_what_no_pool_takes_over(others, handed_over):
    own, shared = own_pods("main", {"matchLabels": {"app": "w"}}, TWO_PODS, pool_claims(others), draining=True)
    assert shared == handed_over and sorted(names(own) + list(shared)) == ["both", "mine"]


async def test_a_refusal_whose_body_is_not_text_is_a_refusal():
    """A sidecar (or whatever answers at its address) refusing a push with bytes that are not UTF-8: the push
    is refused, as any other, rather than raising out of the pass that pushes to every pod."""
    async def refuse(_: web.Request) -> web.Response:
        return web.Response(status=503, body=b"\xff\xfe busy", content_type="text/plain")

    refused = await _push_to(refuse)
    assert isinstance(refused, Refused) and (refused.status, refused.reason) == (503, "\ufffd\ufffd busy")


async def test_a_push_asks_to_be_answered_before_downloads_and_takes_202_as_accepted():
    """The sidecar answers 202 once what needs no download is applied, its downloads going on: the pool's
    lock is not held through one adapter's download, so its next edit (a kill switch) goes out at once."""
    seen: list[str] = []

    async def accept(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Prefer", ""))
        return web.json_response({"generation_applied": 1, "adapters": [
            {"name": "a", "version": "v2", "tier": "none", "staging": True}]}, status=202)

    assert await _push_to(accept) is True
    assert seen == ["respond-async"]


async def test_a_sidecar_that_redirects_gets_no_token_elsewhere_and_counts_as_not_answering():
    """Whatever answers at a pod's address redirecting the state read or the push (to another server, or
    its own path): the redirect is not followed, so the token goes nowhere else, and the pod has not answered
    (the read) or refused (the push)."""
    seen: list[tuple[str, str]] = []

    async def elsewhere(request: web.Request) -> web.Response:
        seen.append((request.path, request.headers.get("Authorization", "")))
        return web.Response(text=ReportedState(generation_applied=3).to_json())

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPTemporaryRedirect(f"/elsewhere{request.path}")

    app = web.Application()
    app.router.add_get("/v1/state", redirect)
    app.router.add_put("/v1/directives", redirect)
    app.router.add_route("*", "/elsewhere/{rest:.*}", elsewhere)
    client = StagerClient(token="t" * 16, timeout=2.0)
    try:
        async with serving(app) as url:
            state = await client.fetch_state(Worker("w0", url))
            pushed = await client.push(Worker("w0", url), DesiredState(1, []))
    finally:
        await client.close()
    assert state is None and isinstance(pushed, Refused) and pushed.status == 307
    assert seen == []


@pytest.mark.parametrize("chunked", [False, True])
async def test_a_state_report_over_the_limit_is_not_read_whole(chunked, caplog):
    """A report larger than the client reads (said in Content-Length, or streamed without one) counts as no
    answer, with a warning naming the limit; one within it is read."""
    big = ReportedState(generation_applied=5, error="x" * 4096).to_json().encode()

    async def state(request: web.Request) -> web.StreamResponse:
        if not chunked:
            return web.Response(body=big, content_type="application/json")
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for i in range(0, len(big), 1024):
            await resp.write(big[i:i + 1024])
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/v1/state", state)
    small, roomy = StagerClient(token="t", timeout=2.0, max_report_bytes=2048), StagerClient(token="t", timeout=2.0)
    try:
        async with serving(app) as url:
            assert await small.fetch_state(Worker("w0", url)) is None
            assert (await roomy.fetch_state(Worker("w0", url))).generation_applied == 5
    finally:
        await small.close()
        await roomy.close()
    assert "answered over 2048 bytes, the most the operator reads" in caplog.text


async def test_a_refusal_over_the_limit_is_a_refusal_not_read_whole():
    """A push refused with a body of megabytes: refused, its reason saying so, the body not read into memory."""
    async def refuse(_: web.Request) -> web.Response:
        return web.Response(status=413, body=b"x" * (MAX_REASON_BYTES + 1), content_type="text/plain")

    refused = await _push_to(refuse)
    assert isinstance(refused, Refused) and refused.status == 413
    assert refused.reason == f"(an answer over {MAX_REASON_BYTES} bytes)"


async def _push_to(handler) -> bool | None:
    """StagerClient.push of an empty state to a sidecar whose PUT /v1/directives is `handler`."""
    app = web.Application()
    app.router.add_put("/v1/directives", handler)
    client = StagerClient(token="t", timeout=2.0)
    try:
        async with serving(app) as url:
            return await client.push(Worker("w0", url), DesiredState(1, []))
    finally:
        await client.close()


async def test_pods_that_answer_late_leave_the_others_reads_alone():
    """120 sidecars that do not answer in time (a partitioned node; pushes answered only once staged) and 5 that
    do, read in one pass: the 5 are read. aiohttp's default cap of 100 connections made every read past it wait
    for one, a wait counted against its timeout, so no pod at all was read."""
    from lorafleet.worker.directives import ReportedState

    release = asyncio.Event()

    async def late(request):
        await release.wait()
        return web.Response(text="{}")

    async def prompt(request):
        return web.Response(text=ReportedState(generation_applied=3).to_json())

    apps = []
    for handler in (late, prompt):
        app = web.Application()
        app.router.add_get("/v1/state", handler)
        apps.append(app)
    # 4 s: room for 125 connections on a loaded machine; every late read waits it out, so without the fix the
    # 5 wait as long for a connection and fail as well
    client = StagerClient(token="t" * 16, timeout=4.0)
    async with serving(apps[0]) as late_url, serving(apps[1]) as prompt_url:
        try:
            workers = [Worker(f"late-{i}", late_url) for i in range(120)] + [Worker(f"ok-{i}", prompt_url) for i in range(5)]
            states = await client.fetch_states(workers)
            assert states[:120] == [None] * 120
            assert [s.generation_applied if s else None for s in states[120:]] == [3] * 5
        finally:
            release.set()
            await client.close()

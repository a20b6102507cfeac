"""An evicted adapter is read again from its cached copy: a read or allocation that fails once is answered 503
with Retry-After, and the next request loads it, instead of the version being marked failed until a new push."""

from __future__ import annotations

import errno

import pytest

import lorafleet.worker.adapter_loading as adapter_loading
import lorafleet.worker.peft_config as peft_config
from lorafleet.worker.app_keys import ENGINE
from lorafleet.worker.engine_config import EngineConfig
from lorafleet.worker.server import create_app
from lorafleet.worker.worker_config import WorkerConfig

ADMIN = "admin-token-for-tests"


def _once(real, exc: BaseException, times: int = 1):
    """`real`, failing its first `times` calls with `exc`."""
    calls: list[int] = []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) <= times:
            raise exc
        return real(*args, **kwargs)

    return flaky


async def _evicted_alpha(aiohttp_client, tiny_llama_dir, qv_adapters_dir):
    """A worker serving alpha@v1, which answered once and was then evicted from the GPU and the CPU tier (as
    GPU and CPU-budget pressure would): (client, a completion's (status, body, headers))."""
    engine = EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=128)
    config = WorkerConfig(engine=engine, served_model_name="tiny", admin_token=ADMIN,
                          adapter_roots=str(qv_adapters_dir))
    app = create_app(config)
    client = await aiohttp_client(app)
    body = {"generation": 1, "adapters": [{"name": "alpha", "tenant": "acme",
                                           "stable": {"version": "v1", "uri": str(qv_adapters_dir / "alpha")}}]}
    resp = await client.put("/admin/v1/state", json=body, headers={"Authorization": f"Bearer {ADMIN}"})
    assert resp.status == 200, await resp.text()

    async def complete():
        resp = await client.post("/v1/completions", json={"model": "alpha", "prompt": "x", "max_tokens": 2})
        return resp.status, await resp.json(), resp.headers

    assert (await complete())[0] == 200
    pool = app[ENGINE].engine.adapter_pool
    pool.evict("alpha@v1", "gpu")
    pool.evict("alpha@v1", "cpu")
    return complete


# What fails once on the reload, and whether it may pass by itself (retryable).
FAULTS = {
    "read": (peft_config, "read_limited", OSError(errno.EIO, "Input/output error"), True),  # the disk hiccups
    "pack": (adapter_loading, "pack_adapter", RuntimeError("cudaHostAlloc: out of memory"), True),  # memory short
    "missing": (peft_config, "read_limited", FileNotFoundError(errno.ENOENT, "No such file"), False),
    "pack-bug": (adapter_loading, "pack_adapter", RuntimeError("index out of range"), False),
}


@pytest.mark.parametrize("fault", list(FAULTS))
async def test_a_reload_that_fails_once_is_retried_only_if_it_may_pass(fault, aiohttp_client, tiny_llama_dir,
                                                                      qv_adapters_dir, monkeypatch):
    """A fault that may pass answers 503 with Retry-After and the next request loads the adapter; one that
    cannot (a file gone, a packing failure that is not short memory) fails the version, with no Retry-After."""
    complete = await _evicted_alpha(aiohttp_client, tiny_llama_dir, qv_adapters_dir)
    module, name, exc, may_pass = FAULTS[fault]
    # Twice: the read ahead as the request arrives (which fails no one), then the read the request asks for.
    monkeypatch.setattr(module, name, _once(getattr(module, name), exc, times=2))
    status, answer, headers = await complete()
    assert status == 503 and answer["error"]["code"] == "adapter_load_failed", answer
    assert ("Retry-After" in headers) == may_pass and headers.get("x-should-retry") == (None if may_pass else "false")
    if may_pass:
        status, answer, _ = await complete()  # the fault has passed: loaded again, served
        assert status == 200, answer

"""worker/job_outputs.py: a job that named no version moves once to the version its name falls back to when
its own cannot load, and only before any of its choices produced an output; against an engine stand-in."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from lorafleet.worker.adapter_entry import AdapterLoadError
from lorafleet.worker.completion_job import CompletionJob
from lorafleet.worker.job_outputs import merged_outputs
from lorafleet.worker.openai_protocol import SamplingOptions
from lorafleet.worker.served_adapters import ServedAdapters
from tests.worker.test_served_adapters import ACME, SQL, state
from tests.worker.test_served_fallback import SQL_V2, SwitchingHost


class StandInEngine:
    """Generates one output per request, but on the versions in `failing`, whose load fails; `hold` keeps
    the choices after the first from starting until the first one has an output, and the first one running
    (it had its version loaded before the load failed for the others)."""

    def __init__(self, failing: set[str], *, retryable: bool = False, hold: bool = False) -> None:
        self.failing, self.retryable, self.hold = failing, retryable, hold
        self.calls: list[tuple[str, str]] = []  # (request id, adapter)
        self.first_out = asyncio.Event()

    async def generate(self, request_id, prompt, params, adapter, tenant=None):
        self.calls.append((request_id, adapter))
        await asyncio.sleep(0)  # as the engine: every choice is submitted before the load ends
        if self.hold and not request_id.endswith("-0"):
            await self.first_out.wait()
        if adapter in self.failing and not (self.hold and request_id.endswith("-0")):
            raise AdapterLoadError(adapter, "adapter_model.safetensors: truncated", retryable=self.retryable)
        yield f"{adapter} {request_id}"
        self.first_out.set()
        if self.hold:
            await asyncio.Event().wait()  # runs on until the job is closed


def rollout() -> ServedAdapters:
    """sql: stable v2 registered, not loaded yet; v1, which it replaces, is the fallback."""
    served = ServedAdapters("base")
    host = SwitchingHost()
    served.apply(state(1, SQL), host)
    served.apply(state(2, SQL_V2), host)
    return served


def job_for(served: ServedAdapters, model: str, n: int = 2) -> CompletionJob:
    key = served.resolve(model, ACME, None)
    job = CompletionJob("completions", "cmpl-1", key, key, [[1, 2]], SamplingOptions(n=n), tenant=ACME)
    if "@" not in model:
        job.re_resolve = lambda: served.resolve(model, ACME, None)
    job.add_choices(64)
    return job


async def outputs(engine, job: CompletionJob, served: ServedAdapters) -> list:
    async with contextlib.aclosing(merged_outputs(engine, job, served)) as merged:
        return [out async for _, out in merged]


async def test_a_bare_name_whose_version_cannot_load_moves_to_the_fallback():
    served = rollout()
    job = job_for(served, "sql")
    engine = StandInEngine({"sql@v2"})
    assert sorted(await outputs(engine, job, served)) == ["sql@v1 cmpl-1-0r", "sql@v1 cmpl-1-1r"]
    assert job.adapter == job.model == "sql@v1" and job.re_resolve is None
    assert served.resolve("sql", ACME, None) == "sql@v1"  # later requests go there at once


async def test_the_move_happens_once_when_the_fallback_fails_too():
    served = rollout()
    job = job_for(served, "sql")
    engine = StandInEngine({"sql@v1", "sql@v2"})
    with pytest.raises(AdapterLoadError) as exc:
        await outputs(engine, job, served)
    assert exc.value.key == "sql@v1"
    assert sorted(engine.calls) == [("cmpl-1-0", "sql@v2"), ("cmpl-1-0r", "sql@v1"),
                                    ("cmpl-1-1", "sql@v2"), ("cmpl-1-1r", "sql@v1")]


@pytest.mark.parametrize("case", ["pinned", "retryable", "no_fallback"])
async def test_no_move_without_a_version_to_move_to(case):
    served = rollout()
    if case == "no_fallback":  # v2 was a canary promoted: nothing to fall back to
        served = ServedAdapters("base")
        host = SwitchingHost()
        served.apply(state(1, SQL | {"canary": {"version": "v2", "uri": "/c/sql/v2"}, "canary_weight": 50}), host)
        served.apply(state(2, SQL_V2), host)
    job = job_for(served, "sql@v2" if case == "pinned" else "sql")
    engine = StandInEngine({"sql@v2"}, retryable=case == "retryable")
    with pytest.raises(AdapterLoadError):
        await outputs(engine, job, served)
    assert all(adapter == "sql@v2" for _, adapter in engine.calls) and job.adapter == "sql@v2"


async def test_no_move_once_a_choice_produced_an_output():
    """One answer never mixes versions, and a stream that sent its first chunk is never restarted."""
    served = rollout()
    job = job_for(served, "sql")
    engine = StandInEngine({"sql@v2"}, hold=True)  # choice 0 runs on v2, then choice 1's load of it fails
    merged = merged_outputs(engine, job, served)
    async with contextlib.aclosing(merged):
        assert await anext(merged) == (0, "sql@v2 cmpl-1-0")
        with pytest.raises(AdapterLoadError):
            await anext(merged)
    assert job.adapter == "sql@v2" and not any(rid.endswith("r") for rid, _ in engine.calls)

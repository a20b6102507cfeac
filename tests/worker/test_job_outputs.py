"""worker/job_outputs.py: a job that named no version moves once to the version its name falls back to when
its own cannot load, or to the one serving now when its own went, and only before any of its choices
produced an output; against engine stand-ins."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from lorafleet.worker.adapter_entry import AdapterLoadError
from lorafleet.worker.completion_job import CompletionJob
from lorafleet.worker.engine import UnknownAdapterError
from lorafleet.worker.job_outputs import merged_outputs
from lorafleet.worker.openai_protocol import APIError, SamplingOptions
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


async def test_a_job_that_moves_tells_the_version_it_moves_to_once():
    """Its request holds that version's metric series until it has counted on it (worker/retired_series.py):
    one move, one hold, however many of its choices found that their version cannot load."""
    served = rollout()
    job = job_for(served, "sql", n=3)
    moves: list[str | None] = []
    job.on_move = moves.append
    await outputs(StandInEngine({"sql@v2"}), job, served)
    assert moves == ["sql@v1"] and job.adapter == "sql@v1"


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


class GoneEngine:
    """The engine after the versions in `gone` were dropped (replaced or unloaded): a request on one fails
    with UnknownAdapterError. Choice 0 runs on the job's first version (it held it: it started before the
    version went); the others start only once choice 0 has an output (`late`) or at once."""

    def __init__(self, gone: set[str], *, late: bool = True) -> None:
        self.gone, self.late = gone, late
        self.calls: list[tuple[str, str]] = []
        self.first_out = asyncio.Event()
        self.moved = asyncio.Event()  # choice 0 waits for it before its output, when not `late`

    async def generate(self, request_id, prompt, params, adapter, tenant=None):
        self.calls.append((request_id, adapter))
        await asyncio.sleep(0)
        if request_id.endswith("-0"):
            if not self.late:  # its output comes after another choice moved the job
                await self.moved.wait()
        else:
            if self.late:
                await self.first_out.wait()
            if adapter in self.gone:
                raise UnknownAdapterError(f"adapter {adapter!r} is not registered")
            self.moved.set()
        yield f"{adapter} {request_id}"
        self.first_out.set()


def replaced() -> tuple[ServedAdapters, CompletionJob]:
    """A job that resolved `sql` to v1 on arrival; a push made v2 stable since."""
    served = ServedAdapters("base")
    served.apply(state(1, SQL), SwitchingHost())
    job = job_for(served, "sql")
    served.apply(state(2, SQL_V2), SwitchingHost())
    return served, job


def unloaded() -> tuple[ServedAdapters, CompletionJob]:
    """A job on sql@v1 whose name is unloaded once it arrived: re-resolving it is a 404."""
    served = ServedAdapters("base")
    served.apply(state(1, SQL), SwitchingHost())
    job = job_for(served, "sql")
    served.apply(state(2), SwitchingHost())
    return served, job


async def test_a_later_choice_whose_version_went_fails_the_answer_once_a_choice_has_output():
    """Choice 0 ran on v1; v1 was replaced (v2 serves now) before choice 1 started: choice 1 does not run
    on v2 (the answer would mix versions), the job's version went is the answer."""
    served, job = replaced()
    engine = GoneEngine({"sql@v1"})
    merged = merged_outputs(engine, job, served)
    async with contextlib.aclosing(merged):
        assert await anext(merged) == (0, "sql@v1 cmpl-1-0")
        with pytest.raises(UnknownAdapterError):
            await anext(merged)
    assert job.adapter == job.model == "sql@v1" and engine.calls == [("cmpl-1-0", "sql@v1"), ("cmpl-1-1", "sql@v1")]


async def test_a_version_gone_with_its_name_keeps_its_own_failure():
    """Nothing to re-resolve to (the name was unloaded): the answer is the version's going (the caller's
    404 `model_not_found`, retry), not the name's lookup failing half-way through the request."""
    served, job = unloaded()
    engine = GoneEngine({"sql@v1"}, late=False)
    engine.moved.set()
    with pytest.raises(UnknownAdapterError):
        await outputs(engine, job, served)
    assert job.adapter == "sql@v1"


async def test_a_choice_that_started_on_the_old_version_runs_again_on_the_new_one():
    """Choice 1 found v1 gone before any output and moved the job to v2; choice 0, which had started on
    v1 meanwhile, has its v1 output dropped and runs again on v2: every output comes from v2."""
    served, job = replaced()
    engine = GoneEngine({"sql@v1"}, late=False)
    assert sorted(await outputs(engine, job, served)) == ["sql@v2 cmpl-1-0r", "sql@v2 cmpl-1-1r"]
    assert job.adapter == job.model == "sql@v2"
    assert sorted(engine.calls) == [("cmpl-1-0", "sql@v1"), ("cmpl-1-0r", "sql@v2"),
                                    ("cmpl-1-1", "sql@v1"), ("cmpl-1-1r", "sql@v2")]


async def test_a_canary_user_whose_canary_cannot_load_for_now_is_served_by_the_stable_version():
    """A retryable failure (e.g. every slot held by pinned adapters) leaves the split as it is, but the canary's
    user is answered by the stable version rather than a 503 the stable version would not give."""
    served, host = ServedAdapters("base"), SwitchingHost()
    served.apply(state(1, SQL | {"canary": {"version": "v2", "uri": "/c/sql/v2"}, "canary_weight": 100}), host)
    job = job_for(served, "sql")
    assert job.adapter == "sql@v2"
    engine = StandInEngine({"sql@v2"}, retryable=True)
    assert sorted(await outputs(engine, job, served)) == ["sql@v1 cmpl-1-0r", "sql@v1 cmpl-1-1r"]
    assert (job.adapter, job.failed_over) == ("sql@v1", "sql@v2")
    assert served.resolve("sql", ACME, None) == "sql@v2"  # still the canary: the failure may pass
    # A pinned request for the canary gets the failure.
    pinned = job_for(served, "sql@v2")
    with pytest.raises(AdapterLoadError):
        await outputs(StandInEngine({"sql@v2"}, retryable=True), pinned, served)


async def test_no_move_to_the_stable_version_of_a_name_that_changed_owner_meanwhile():
    served, host = ServedAdapters("base"), SwitchingHost()
    canary = {"canary": {"version": "v2", "uri": "/c/sql/v2"}, "canary_weight": 100}
    served.apply(state(1, SQL | canary), host)
    job = job_for(served, "sql")
    served.apply(state(2, SQL | canary | {"tenant": "globex"}), host)  # now globex's
    with pytest.raises(AdapterLoadError):
        await outputs(StandInEngine({"sql@v2"}, retryable=True), job, served)
    assert job.adapter == "sql@v2"


async def test_a_client_that_stops_reading_holds_one_output_per_choice_not_one_per_step():
    """Each engine step's output copies all generated so far: queued one per step for a stream whose client
    stopped reading, they grew with the square of the output length. Outputs not taken yet are one."""
    from lorafleet.worker.request_output import RequestOutput
    from lorafleet.worker.sequence import TokenLogprob

    done = asyncio.Event()

    class Steps:
        async def generate(self, request_id, prompt, params, adapter, tenant=None):
            for k in range(200):
                yield RequestOutput(request_id, [1, 2], [k], f"<{k}>", [TokenLogprob(k, -1.0, [])], list(range(k + 1)),
                                    "".join(f"<{j}>" for j in range(k + 1)), finished=k == 199,
                                    finish_reason="length" if k == 199 else None)
                await asyncio.sleep(0)
            done.set()

    served = rollout()
    job = job_for(served, "sql@v1", n=1)
    got = []
    async with contextlib.aclosing(merged_outputs(Steps(), job, served)) as merged:
        async for _, out in merged:
            got.append(out)
            if len(got) == 1:
                await done.wait()  # the client stops reading while the engine generates the rest
    assert len(got) == 2
    first, rest = got
    assert first.new_token_ids == [0] and rest.new_token_ids == list(range(1, 200))
    assert rest.new_text == "".join(f"<{k}>" for k in range(1, 200)) and rest.text == first.text + rest.new_text
    assert [lp.token_id for lp in rest.new_logprobs] == list(range(1, 200))
    assert rest.finished and rest.finish_reason == "length" and rest.token_ids == list(range(200))


class Endless:
    """One output per request, then generates on until it is closed, which `closed` records."""

    def __init__(self) -> None:
        self.closed: list[str] = []
        self.all_closed = asyncio.Event()
        self.num_requests = 0

    async def generate(self, request_id, prompt, params, adapter, tenant=None):
        self.num_requests += 1
        try:
            yield f"{adapter} {request_id}"
            await asyncio.Event().wait()
        finally:
            self.closed.append(request_id)
            if len(self.closed) == self.num_requests:
                self.all_closed.set()


async def test_the_time_limit_aborts_every_choice_even_while_the_caller_does_not_read():
    """Past `limit_s` every choice is closed (in the engine: aborted) at once, though the caller stopped
    reading after the first output; its next read gets the outputs made in time, then the 504."""
    served, engine = rollout(), Endless()
    job = job_for(served, "sql@v1", n=3)
    async with contextlib.aclosing(merged_outputs(engine, job, served, limit_s=0.5)) as merged:
        got = [await anext(merged)]
        await asyncio.wait_for(engine.all_closed.wait(), 10)  # the caller reads nothing meanwhile
        assert sorted(engine.closed) == ["cmpl-1-0", "cmpl-1-1", "cmpl-1-2"]
        with pytest.raises(APIError) as exc:
            async for item in merged:
                got.append(item)
    assert sorted(i for i, _ in got) == [0, 1, 2]  # each choice's output from before the limit
    assert (exc.value.status, exc.value.code) == (504, "deadline_exceeded")
    assert "within 0.5 s" in exc.value.message and "--request-timeout-s" in exc.value.message


async def test_a_job_that_ended_in_time_is_answered_though_read_after_its_limit(caplog):
    """Its last output came within the limit: nothing is aborted or logged when the limit passes."""
    served = rollout()
    job = job_for(served, "sql@v1", n=2)
    engine = StandInEngine(set())
    async with contextlib.aclosing(merged_outputs(engine, job, served, limit_s=0.5)) as merged:
        got = [await anext(merged)]
        while time.monotonic() < job.arrived + 0.5:  # the limit passes while the caller does not read
            await asyncio.sleep(0.01)
        await asyncio.sleep(0)  # the limit's timer runs
        got += [item async for item in merged]
    assert sorted(i for i, _ in got) == [0, 1]
    assert "--request-timeout-s" not in caplog.text

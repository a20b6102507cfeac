"""Engine.generate: run prompts to completion together, offline (no AsyncEngine)."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from lorafleet.worker.engine_errors import EngineError
from lorafleet.worker.request_output import RequestOutput
from lorafleet.worker.sampling_params import SamplingParams

if TYPE_CHECKING:
    from lorafleet.worker.engine import Engine

Prompt = str | list[int]


def generate(engine: Engine, prompts: Seq[Prompt] | Prompt, sampling_params: SamplingParams | Seq[SamplingParams] | None,
             adapters: Seq[str | None] | None) -> list[RequestOutput]:
    """One finished RequestOutput per prompt, in order; the prompts' requests aborted if anything fails."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    n = len(prompts)
    params = sampling_params if isinstance(sampling_params, Seq) else [sampling_params or SamplingParams()] * n
    adapters = list(adapters) if adapters is not None else [None] * n
    if len(params) != n or len(adapters) != n:
        raise EngineError(f"{n} prompts but {len(params)} sampling params and {len(adapters)} adapters")
    ids: list[str] = []
    try:
        for p, sp, a in zip(prompts, params, adapters, strict=True):
            ids.append(engine.add_request(None, p, sp, adapter=a))
    except Exception:
        for i in ids:
            engine.abort(i)
        raise
    results: dict[str, RequestOutput] = {}
    wanted = set(ids)  # not requests added meanwhile by add_request
    try:
        while len(results) < n:
            for out in engine.step():
                if out.finished and out.request_id in wanted:
                    results[out.request_id] = out
            if engine.last_batch_size == 0 and len(results) < n:
                engine.adapter_pool.wait_idle()  # nothing runnable: only adapter loads can unblock us
    finally:  # interrupted (or a step raised): its requests must not hold pages for no one
        for i in ids:
            engine.abort(i)
    return [results[i] for i in ids]

"""OpenAI-compatible inference: `/v1/completions`, `/v1/chat/completions`, `/v1/models` (and
`/v1/models/{id}`); vLLM's `/tokenize` and `/detokenize` are openai_tokenize.py's.

One HTTP request becomes `len(prompts) * n` engine requests ("choices"), all on the same adapter
version, resolved on arrival (one naming no version moves once, before any output, if the engine
dropped that version or it cannot load: worker/job_outputs.py). Their outputs are merged as they
come. Streaming (SSE) starts with the first output, so a request that fails before producing
anything (adapter failed to load, bad prompt) still gets a proper status code; one that fails after (its
version went, the engine failed) ends with an in-band error event and no `[DONE]`, and counts in /metrics
with that error's status, not as a completion. Leaving early for any reason (client gone, error, shutdown,
--request-timeout-s: a 504) cancels the engine iterators, which aborts the requests: KV pages and the
adapter reference are released at once.

Every response says which adapter version served it: `model` is `name@version` (or the base
model's name), and the `X-Lorafleet-Adapter` header repeats it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import jinja2
from aiohttp import web

from lorafleet.worker.adapter_entry import AdapterLoadError
from lorafleet.worker.app_keys import (
    ADAPTERS,
    ADMISSION,
    CONFIG,
    ENGINE,
    HOST,
    METRICS,
    STATUS,
)
from lorafleet.worker.choice_timer import ChoiceTimer, request_labels
from lorafleet.worker.completion_job import CompletionJob, TextOffsets
from lorafleet.worker.engine import EngineError, ShutdownError, UnknownAdapterError
from lorafleet.worker.engine_errors import ContextLengthError
from lorafleet.worker.intake import (
    authenticate,
    check_room,
    expect_room,
    intake_place,
    read_json,
    ready_engine,
    refused,
    several_tenants,
)
from lorafleet.worker.job_outputs import merged_outputs
from lorafleet.worker.json_schema_grammar import GrammarError
from lorafleet.worker.metrics import UNRESOLVED_LABEL
from lorafleet.worker.openai_protocol import (
    APIError,
    parse_chat_request,
    parse_completion_request,
)
from lorafleet.worker.openai_tokenize import chat_prompt_ids, model_limit, tokenize_routes
from lorafleet.worker.regex_parse import RegexError
from lorafleet.worker.request_output import RequestOutput
from lorafleet.worker.scheduler import CapacityError
from lorafleet.worker.served_adapters import VersionUnavailable
from lorafleet.worker.served_fallback import listed_versions, versions_still_served
from lorafleet.worker.state_json import reply
from lorafleet.worker.stream_writes import sent_in_time, written_or_cut
from lorafleet.worker.tenants import Tenant
from lorafleet.worker.tokenizer import PromptTooLong, TokenizerError
from lorafleet.worker.tool_calls import ToolCalls

log = logging.getLogger("lorafleet.worker")

ADAPTER_HEADER = "X-Lorafleet-Adapter"


def openai_routes() -> list[web.RouteDef]:
    return [
        web.post("/v1/completions", completions, expect_handler=expect_room),
        web.post("/v1/chat/completions", chat_completions, expect_handler=expect_room),
        web.get("/v1/models", list_models),
        web.get("/v1/models/{model:.+}", retrieve_model),
        *tokenize_routes(),
    ]


# ---- request intake ---------------------------------------------------------------------------------
async def _prepare(request: web.Request, endpoint: str,
                   resolved: Callable[[str | None], None] = lambda key: None) -> CompletionJob:
    """The request as a CompletionJob, or an APIError. `resolved` is told the engine key the model resolved
    to (None: the base model) as soon as it is known, so a refusal after that (a bad prompt, a context too
    long) is counted on it; and the key the job moves to, if it does (worker/job_outputs.py)."""
    app = request.app
    engine = ready_engine(app)
    tenant = authenticate(request)
    check_room(app, tenant.name)  # a full worker reads no body: 429 at once
    async with intake_place(app, tenant.name) as place:  # body read, parse, tokenization: a bounded number at once
        parse = parse_chat_request if endpoint == "chat" else parse_completion_request
        parsed = await read_json(request, lambda body: parse(body, engine.sampling_defaults), place)
        parsed.model = parsed.model or app[ADAPTERS].base_model  # left out: the base model, as vLLM
        try:
            adapter = app[ADAPTERS].resolve(parsed.model, tenant, parsed.options.user)
        except VersionUnavailable as exc:  # counted on the version that failed, not as unresolved
            resolved(exc.key)
            raise
        resolved(adapter)
        num_seqs = len(getattr(parsed, "prompts", None) or [None]) * parsed.options.n  # chat: one prompt
        if (never := app[ADMISSION].never_fits(num_seqs, several_tenants(app))) is not None:  # before any tokenizing
            raise APIError(400, never, code="invalid_value", param="n" if parsed.options.n > 1 else "prompt")

        def tokenize() -> list[list[int]]:
            limit = engine.max_model_len  # past it by length alone: a text refused untokenized (token_floor.py)
            if endpoint == "chat":
                return [chat_prompt_ids(app, parsed, limit)]
            return [p if isinstance(p, list) and len(p) >= limit else  # ids unchecked (the job refuses them)
                    engine.encode(p, add_special_tokens=parsed.add_special_tokens, limit=limit) for p in parsed.prompts]

        tools = parsed.tools if endpoint == "chat" else None  # its tools and tool_choice (tool_request.py)
        tool_calls = ToolCalls.of(tools, engine.tokenizer, app[CONFIG].tool_call_parser)  # 400: no tools in template
        param = "messages" if endpoint == "chat" else "prompt"
        try:
            prompt_ids = await place.run(tokenize)
        except PromptTooLong as exc:
            raise APIError(400, str(exc), code="context_length_exceeded", param=param) from None
        except (EngineError, TokenizerError) as exc:
            raise APIError(400, str(exc), code="invalid_prompt", param=param) from None
        except jinja2.TemplateError as exc:  # the chat template refuses (roles out of order) or fails (a TypeError)
            raise APIError(400, f"the chat template refused these messages: {exc}", code="invalid_messages",
                           param="messages") from None
    prefix = "chatcmpl" if endpoint == "chat" else "cmpl"
    job = CompletionJob(endpoint, f"{prefix}-{uuid.uuid4().hex}", adapter or app[ADAPTERS].base_model, adapter,
                        prompt_ids, parsed.options, tenant=tenant, prompts=getattr(parsed, "prompts", None),
                        tool_calls=tool_calls, prompt_tokens_details=app[CONFIG].enable_prompt_tokens_details)
    if parsed.options.request_id is not None:  # vLLM's: the answer is named by the caller's id
        job.answer_id = f"{prefix}-{parsed.options.request_id}"
    if adapter is not None and "@" not in parsed.model:
        job.re_resolve = lambda: app[ADAPTERS].resolve(parsed.model, tenant, parsed.options.user)
        job.on_move = resolved  # the version it moves to is counted on too
    job.add_choices(engine.max_model_len, engine.model_config.vocab_size)
    return job


# ---- running a job ------------------------------------------------------------------------------------
def _engine_error(exc: BaseException, job: CompletionJob, request: web.Request) -> APIError:
    """The engine's failure as the caller's error; it names no adapter the caller may not use."""
    adapters = request.app[ADAPTERS]
    if isinstance(exc, UnknownAdapterError):  # its message lists every registered adapter
        return APIError(404, f"adapter {job.model} is no longer served by this worker: it was replaced or unloaded "
                             "after this request arrived; retry (GET /v1/models lists the ones you may use)",
                        code="model_not_found", param="model")
    if isinstance(exc, AdapterLoadError):
        if not exc.retryable:  # later requests are answered at once, until a push registers it again
            adapters.mark_failed(exc.key, exc.reason)
        return APIError(503, f"adapter {exc.key} failed to load: {adapters.redact(exc.reason, job.tenant)}",
                        type="service_unavailable", code="adapter_load_failed", param="model",
                        # a version that cannot load by itself: the official clients would retry the 503 twice
                        headers={"Retry-After": "5"} if exc.retryable else {"x-should-retry": "false"})
    message = adapters.redact(str(exc), job.tenant)
    if isinstance(exc, ContextLengthError):  # its adapter and pinned ones leave too little of the pool
        param = "min_tokens" if exc.min_tokens else job.length_param(exc.prompt_alone)
        return APIError(400, message, code="context_length_exceeded", param=param)
    if isinstance(exc, EngineError):
        return APIError(400, message, code="invalid_request")
    if isinstance(exc, GrammarError | RegexError):  # past a grammar's or pattern's run-time bounds: the request's
        return APIError(400, message, code="invalid_request", param=getattr(exc, "param", job.options.grammar_param))
    if isinstance(exc, ShutdownError):
        return APIError(503, message, type="service_unavailable", code="shutting_down", headers={"Retry-After": "1"})
    if isinstance(exc, CapacityError):  # the pool is held (pinned or busy adapters): not the request's fault
        return APIError(503, message, type="service_unavailable", code="no_capacity", headers={"Retry-After": "5"})
    return APIError(500, f"the engine failed on this request: {message}", type="server_error", code="engine_error")


def _admit(app: web.Application, job: CompletionJob, tenant: str) -> None:
    """Take admission room for the job's sequences, or raise 429 (one that never fits was refused before)."""
    admission, shared = app[ADMISSION], several_tenants(app)
    if admission.admit(job.num_choices, tenant, shared):
        return
    # nothing changed since admit: the same answer
    raise refused(app, admission.refusal(job.num_choices, tenant, shared), tenant, job.num_choices)


async def _serve(request: web.Request, endpoint: str) -> web.StreamResponse:
    app = request.app
    metrics = app[METRICS]
    status = 500
    job: CompletionJob | None = None
    resolved: list[tuple[str | None, bool]] = []  # engine keys it holds (the one resolved, then one moved to)

    def hold(key: str | None) -> None:  # its series stay, even if a push retires it, until this request counts
        resolved.append((key, metrics.acquire(*request_labels(key), endpoint)))

    try:
        job = await _prepare(request, endpoint, hold)
        admission, tenant = app[ADMISSION], job.tenant.name
        _admit(app, job, tenant)  # raises, having taken nothing, or took room released just below
        try:
            timer = ChoiceTimer(metrics, job, lambda key: any(rolling for k, rolling in resolved if k == key))
            adapter, version = timer.labels
            metrics.observe_prompt_tokens(adapter, sum(len(job.prompt_ids[p]) for p in job.choice_prompt),
                                          version=version)
            outputs = merged_outputs(app[ENGINE], job, app[ADAPTERS], limit_s=app[CONFIG].request_timeout_s)
            failure: APIError | None = None  # what ended a stream after its headers went
            if job.options.stream:
                response, failure = await _stream(request, job, outputs, timer)
            else:
                response = await _collect(request, job, outputs, timer)
            if failure is None:  # a stream that failed half-way is no completion: its latency is not one
                timer.done()
        finally:
            admission.release(job.num_choices, tenant)
        # A stream that failed after its 200 went counts as what it was answered in-band (5xx for the
        # canary's comparison with stable: README, "Canary rollouts").
        status = failure.status if failure is not None else response.status
        return response
    except APIError as err:
        status = err.status
        raise
    except web.HTTPException as exc:  # aiohttp's own refusals (a body over --max-body-bytes: 413)
        status = exc.status
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        status = 499  # client closed the request (a ConnectionResetError: before its body had arrived)
        raise
    finally:
        if job is not None:
            adapter, version = request_labels(job.adapter)
        elif resolved:  # refused after the model was resolved (a bad prompt, a context too long)
            adapter, version = request_labels(resolved[0][0])
        else:  # refused before the model was resolved (bad body, auth, unknown adapter)
            adapter, version = UNRESOLVED_LABEL, ""
        metrics.observe_request(adapter=adapter, version=version, endpoint=endpoint, status=status)
        if job is not None and job.failed_over is not None:  # the version it moved off failed to load: 503 there
            failed, failed_version = request_labels(job.failed_over)
            metrics.observe_request(adapter=failed, version=failed_version, endpoint=endpoint, status=503)
        if adapter is not None and version:  # the series of versions no longer served go
            served = app[ADAPTERS].get(adapter)
            # A version retired before this request first counted on it had no series then: retired here.
            metrics.retain_versions(adapter, versions_still_served(served, version))
        for key, rolling in resolved:  # counted: a retired version's grace starts now
            metrics.release(*request_labels(key), rolling)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "completions")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "chat")


def _tokenizer(request: web.Request):
    return request.app[ENGINE].engine.tokenizer


async def _collect(request: web.Request, job: CompletionJob, outputs: AsyncIterator[tuple[int, RequestOutput]], timer: ChoiceTimer) -> web.Response:
    final: dict[int, RequestOutput] = {}
    async with contextlib.aclosing(outputs):
        try:
            async for i, out in outputs:
                timer.tokens(i, len(out.new_token_ids), out.scheduled_at)
                job.count_generated(len(out.new_token_ids))
                if out.finished:
                    final[i] = out
        except (APIError, asyncio.CancelledError):
            raise
        except Exception as exc:
            raise _engine_error(exc, job, request) from None
    tokenizer, o = _tokenizer(request), job.options
    if o.logprobs is None and o.prompt_logprobs is None:
        response = web.json_response(job.response(tokenizer, final), headers={ADAPTER_HEADER: job.model})
    else:  # up to MAX_LOGPROB_ENTRIES decoded tokens, built and encoded off the event loop (tens of MB)
        response = await reply(lambda: job.response(tokenizer, final))
        response.headers[ADAPTER_HEADER] = job.model
    return await sent_in_time(request, response, request.app[CONFIG].stream_write_timeout_s, job.request_id)


def _encoded(payload: dict[str, Any]) -> str:
    """An SSE event's data: `payload` as compact JSON."""
    return json.dumps(payload, separators=(",", ":"))


async def _stream(request: web.Request, job: CompletionJob, outputs: AsyncIterator[tuple[int, RequestOutput]],
                  timer: ChoiceTimer) -> tuple[web.StreamResponse, APIError | None]:
    """The SSE answer, and None, or the APIError that ended it after its headers went (sent in-band as the
    stream's last event, with no [DONE]). A failure before the first output is raised (its own status);
    the client leaving is a CancelledError."""
    tokenizer = _tokenizer(request)
    response: web.StreamResponse | None = None
    started: set[int] = set()
    offsets = [TextOffsets() for _ in range(job.num_choices)]  # text_offset over each choice's chunks
    choice_tokens: dict[int, int] = {}  # each choice's tokens so far
    choice_cached: dict[int, int] = {}  # each choice's prompt tokens found in the prefix cache

    async def send(payload: dict[str, Any] | str | None) -> None:
        """One event (None: the end of the body), within --stream-write-timeout-s."""
        data = payload if isinstance(payload, str | None) else _encoded(payload)
        event = b"" if data is None else f"data: {data}\n\n".encode()
        write = response.write_eof() if data is None else response.write(event)
        await written_or_cut(write, request, request.app[CONFIG].stream_write_timeout_s, job.request_id, len(event))

    async with contextlib.aclosing(outputs):
        try:
            async for i, out in outputs:
                if response is None:  # headers go out with the first output: earlier errors keep their status
                    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                           "Cache-Control": "no-cache", ADAPTER_HEADER: job.model})
                    await response.prepare(request)
                timer.tokens(i, len(out.new_token_ids), out.scheduled_at)
                choice_tokens[i] = choice_tokens.get(i, 0) + len(out.new_token_ids)
                choice_cached[i] = out.num_cached_tokens
                first = i not in started
                started.add(i)
                if out.new_text or out.new_token_ids or first or out.finished:
                    build = functools.partial(job.stream_chunk, tokenizer, i, out, first=first, offsets=offsets[i],
                                              completion_tokens=choice_tokens[i])
                    if first and out.prompt_logprobs and job.options.echo:  # the prompt's logprobs: off the loop
                        await send(await asyncio.to_thread(lambda b=build: _encoded(b())))
                    elif not _empty_delta(chunk := build()):
                        await send(chunk)
        except asyncio.CancelledError:
            raise
        except ConnectionError:
            raise asyncio.CancelledError from None  # the client left: stop, the iterators abort
        except Exception as exc:  # an APIError (the job's version went) or the engine's failure
            failure = exc if isinstance(exc, APIError) else _engine_error(exc, job, request)
            if response is None:
                raise failure from None
        else:
            failure = None
    # Leaving `outputs` aborted what still ran. With the headers gone, a failure can only go in-band: a
    # second response from error_middleware would be written inside this one's chunked body.
    if response is None:  # nothing came back at all
        raise APIError(500, "the engine produced no output", type="server_error", code="engine_error")
    try:
        if failure is not None:
            await send(failure.body())  # the stream's last event: no [DONE] after a failure
        else:
            if job.options.include_usage:
                usage_chunk = job.envelope([], chunk=True)
                usage_chunk["usage"] = job.usage(sum(choice_tokens.values()), choice_cached)
                await send(usage_chunk)
            await send("[DONE]")
        await send(None)
    except ConnectionError:
        raise asyncio.CancelledError from None  # the client left before the end
    return response, failure


def _empty_delta(chunk: dict[str, Any]) -> bool:
    """A chat chunk that says nothing (text held back: a stop string or a tool call it may begin, part of a
    character): not sent, as vLLM sends none."""
    choice = chunk["choices"][0]
    return (choice.get("delta") == {} and choice["logprobs"] is None and choice["finish_reason"] is None
            and not chunk.get("usage"))


async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": _models(request, authenticate(request))})


async def retrieve_model(request: web.Request) -> web.Response:
    """One entry of /v1/models by its id (the client's `models.retrieve`), or by `name@version` (the `model`
    of an answer) for a version the name has; 404 for a name the caller may not see, as for one that does
    not exist."""
    model = request.match_info["model"]
    name, _, version = model.partition("@")
    for entry in _models(request, authenticate(request)):
        if entry["id"] == model:
            return web.json_response(entry)
        if version and entry["id"] == name and version in entry.get("versions", ()):  # the id answers carry
            return web.json_response(entry | {"id": model})
    raise APIError(404, f"The model `{model}` does not exist on this worker (GET /v1/models lists the ones you "
                        "may use)", code="model_not_found", param="model")


def _models(request: web.Request, tenant: Tenant) -> list[dict[str, Any]]:
    """The model objects this caller may use: the base model (unless its tenant may not call it), then
    its adapters with their versions and canary split."""
    app = request.app
    if ENGINE not in app:
        raise APIError(503, "the worker is starting", type="service_unavailable", code="not_ready",
                       headers={"Retry-After": "1"})
    adapters = app[ADAPTERS]
    created = int(app[STATUS].started_at)
    engine, data = app[ENGINE].engine, []  # max_model_len: prompt + completion tokens (vLLM's field), less what adapters hold of the KV cache
    if tenant.may_use(None):
        data.append({"id": adapters.base_model, "object": "model", "created": created, "owned_by": "lorafleet",
                     "root": adapters.base_model, "parent": None, "max_model_len": model_limit(engine, None)})
    for a in adapters.visible_to(tenant):  # versions: less a fallback the engine retired (served_fallback.py)
        if a.split.stable in a.errors:  # every request for the name is answered 503, saying why: not one to route to
            continue
        data.append({"id": a.name, "object": "model", "created": created, "owned_by": a.tenant or "lorafleet",
                     "root": a.name, "parent": adapters.base_model, "max_model_len": model_limit(engine, a),
                     "versions": [v for v in listed_versions(a, app.get(HOST)) if v not in a.errors],
                     "stable": a.split.stable, "canary": a.split.canary, "canary_weight": a.split.canary_weight})
    return data

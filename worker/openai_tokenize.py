"""vLLM's `/tokenize` and `/detokenize`: the token ids a prompt or a chat becomes on this worker, and back.

`POST /tokenize` takes a completion's prompt (`{"model", "prompt", "add_special_tokens": true}`) or a chat
(`{"model", "messages", ...}` with the chat fields /v1/chat/completions takes: add_generation_prompt,
continue_final_message, add_special_tokens, chat_template_kwargs, tools) and answers `{"count",
"max_model_len", "tokens", "token_strs"}` (`token_strs` with `return_token_strs: true`, else null). A chat is
rendered and encoded as a chat completion's prompt is (chat_prompt_ids), so `count` is what that request's
prompt holds. `POST /detokenize` takes `{"model", "tokens": [...]}` and answers `{"prompt"}` (special tokens
written, as vLLM does).

Both need the caller's key, and `model` (left out: the base model, as vLLM) must be one the caller may call
(the base model or an adapter of theirs: the same 404 as elsewhere for another tenant's); adapters share the
base model's tokenizer, so the answer does not depend on which. Both hold an intake place while they work,
as a completion does (intake.py), and tokenize in the default executor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jinja2
from aiohttp import web

from lorafleet.worker.app_keys import ADAPTERS, CONFIG, ENGINE
from lorafleet.worker.engine import EngineError
from lorafleet.worker.intake import authenticate, intake_place, read_json, ready_engine
from lorafleet.worker.openai_fields import APIError, Fields, bad_request, check_text, is_id_list
from lorafleet.worker.openai_protocol import ChatRequest, parse_chat_request
from lorafleet.worker.served_adapters import ServedAdapter, VersionUnavailable
from lorafleet.worker.state_json import reply
from lorafleet.worker.tenants import Tenant
from lorafleet.worker.tokenizer import TokenizerError
from lorafleet.worker.tool_calls import ToolCalls

# A chat's fields that shape its prompt; a /tokenize body with `messages` takes these (and return_token_strs).
CHAT_PROMPT_FIELDS = ("model", "messages", "add_generation_prompt", "continue_final_message", "add_special_tokens",
                      "chat_template_kwargs", "tools", "tool_choice")


def tokenize_routes() -> list[web.RouteDef]:
    return [web.post("/tokenize", tokenize), web.post("/detokenize", detokenize)]


def chat_prompt_ids(app: web.Application, parsed: ChatRequest, limit: int | None = None) -> list[int]:
    """A chat request's prompt ids (run it in the executor): rendered by the chat template, with its tools.
    Raises EngineError without a tokenizer, TokenizerError or jinja2.TemplateError for messages refused, and
    PromptTooLong for a chat whose rendered length alone shows it has at least `limit` tokens."""
    engine = app[ENGINE].engine
    if engine.tokenizer is None:
        raise EngineError("this model has no tokenizer; use /v1/completions with token ids")
    tools = parsed.tools.tools if parsed.tools is not None else None
    return engine.tokenizer.encode_chat(parsed.template_messages(), parsed.template, tools=tools,
                                        control_tokens_in_content=app[CONFIG].chat_control_tokens_in_content,
                                        limit=limit)


async def tokenize(request: web.Request) -> web.Response:
    app, tenant = request.app, authenticate(request)
    engine = ready_engine(app)
    async with intake_place(app, tenant.name, sequences=False) as place:  # a large body is parsed in the executor, as
        chat, strs, model, work = await read_json(request, lambda body: _tokenize_request(app, body), place)
        _check_model(app, model, tenant)
        try:
            ids, token_strs = await place.run(lambda: _with_strs(engine, work(), strs))  # its tokenization is
        except (EngineError, TokenizerError) as exc:
            raise APIError(400, str(exc), code="invalid_prompt", param="messages" if chat else "prompt") from None
        except jinja2.TemplateError as exc:
            raise APIError(400, f"the chat template refused these messages: {exc}", code="invalid_messages",
                           param="messages") from None
    # Encoded off the loop: a 4 MB prompt's ids and strings are tens of MB of JSON (0.5 s of the loop).
    adapter, _, version = (model or "").partition("@")  # `name@version` names one version
    limit = model_limit(engine, app[ADAPTERS].get(adapter) if adapter else None, version)
    return await reply(lambda: {"count": len(ids), "max_model_len": limit, "tokens": ids, "token_strs": token_strs})


def model_limit(engine, served: ServedAdapter | None, version: str = "") -> int:
    """max_model_len as a request for `served` (None: the base model) has it now, less its adapter's pages and
    pinned adapters' (kv_room.KVRoom.limit): `version`'s, or the smaller of its stable and canary versions'."""
    if served is None:
        return engine.kv_room.limit([None])
    versions = [version] if version else [v for v in (served.split.stable, served.split.canary) if v]
    return engine.kv_room.limit([f"{served.name}@{v}" for v in versions])


def _tokenize_request(app: web.Application, body: Any) -> tuple[bool, bool, str, Callable[[], list[int]]]:
    """(a chat, return_token_strs, model, what computes the ids) of a /tokenize body (a 400 for a bad one)."""
    engine = app[ENGINE].engine
    chat = isinstance(body, dict) and "messages" in body
    f = Fields(body, "tokenize")
    strs = f.flag("return_token_strs", False)
    if chat:
        f.seen.update(CHAT_PROMPT_FIELDS)
        f.refuse_unknown()
        parsed = parse_chat_request({k: v for k, v in body.items() if k in CHAT_PROMPT_FIELDS}, engine.sampling_defaults)
        ToolCalls.of(parsed.tools, engine.tokenizer, app[CONFIG].tool_call_parser)  # 400: a template without tools
        return True, strs, parsed.model, lambda: chat_prompt_ids(app, parsed)
    model, prompt = f.string("model"), f.get("prompt")
    if not isinstance(prompt, str):
        raise bad_request("'prompt' must be a string (or send 'messages' for a chat)", "prompt",
                          "missing_required_parameter" if prompt is None else "invalid_type")
    check_text(prompt, "prompt")
    special = f.flag("add_special_tokens", True)
    f.refuse_unknown()
    return False, strs, model, lambda: _encode(engine, prompt, special)


def _with_strs(engine, ids: list[int], strs: bool) -> tuple[list[int], list[str | None] | None]:
    return ids, [engine.tokenizer.id_to_token(i) for i in ids] if strs else None


async def detokenize(request: web.Request) -> web.Response:
    app, tenant = request.app, authenticate(request)
    engine = ready_engine(app)
    async with intake_place(app, tenant.name, sequences=False) as place:
        f = Fields(await read_json(request, place=place), "detokenize")
        model, tokens = f.string("model"), f.get("tokens")
        f.refuse_unknown()
        if not is_id_list(tokens):
            raise bad_request("'tokens' must be a list of token ids", "tokens",
                              "missing_required_parameter" if tokens is None else "invalid_type")
        vocab = engine.model_config.vocab_size
        if tokens and (min(tokens) < 0 or max(tokens) >= vocab) and (bad := [t for t in tokens if not 0 <= t < vocab][:5]):
            raise bad_request(f"token ids {bad} are outside the vocabulary (0..{vocab - 1})", "tokens")
        _check_model(app, model, tenant)
        if engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer", code="invalid_value", param="tokens")
        text = await place.run(lambda: engine.tokenizer.decode(tokens, skip_special_tokens=False))
    return web.json_response({"prompt": text})


def _check_model(app: web.Application, model: str | None, tenant: Tenant) -> None:
    """404/403 as a completion naming `model` (left out: the base model) would get; a version that failed to
    load still tokenizes."""
    if model is not None and not model:
        raise bad_request("'model' must name the base model or an adapter (see GET /v1/models)", "model")
    with contextlib.suppress(VersionUnavailable):
        app[ADAPTERS].resolve(model or app[ADAPTERS].base_model, tenant, None)


def _encode(engine, prompt: str, add_special_tokens: bool) -> list[int]:
    if engine.tokenizer is None:
        raise EngineError("this model directory has no tokenizer.json: it cannot tokenize text")
    return engine.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

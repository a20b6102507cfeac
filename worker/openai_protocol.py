"""OpenAI request bodies parsed and validated into small dataclasses, and OpenAI-shaped errors.

Parsing is strict where it matters: wrong types, out-of-range values and unknown top-level fields
are refused with a 400 that names the field (as OpenAI does: "Unrecognized request argument");
options we cannot honour (`echo`, `best_of > 1`, tool calls, also in a chat's history) are refused
rather than silently ignored. Tokenization happens later, in openai_api.py, and the context-length
check in completion_job.py.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Any

from lorafleet.worker.directives import DirectiveError
from lorafleet.worker.directives import _name as directive_name
from lorafleet.worker.logit_bias import LogitBiasError, parse_logit_bias
from lorafleet.worker.sampling_defaults import SamplingDefaults

MAX_N = 16
MAX_STOP = 4
MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_TOP_LOGPROBS = 20
MAX_PROMPTS = 16
CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")


class APIError(Exception):
    """An error answered to the client as `{"error": {"message", "type", "code", "param"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, code=code, param=param)


@dataclass(slots=True)
class SamplingOptions:
    """The per-request options shared by both endpoints, before the engine's SamplingParams."""

    max_tokens: int | None = None  # None: up to the end of the context
    max_tokens_param: str = "max_tokens"  # the field that set it: errors name what the caller sent
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off (vLLM's -1 is accepted as off too)
    n: int = 1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # number of top alternatives per token; None = no logprobs
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    user: str | None = None
    ignore_eos: bool = False  # vLLM extension: generate max_tokens even past end-of-sequence (benchmarks)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM extension (transformers' semantics); unset: the model's default
    logit_bias: dict[int, float] | None = None  # token id -> bias; the ids' vocabulary check: completion_job.py
    min_p: float = 0.0  # vLLM extension; unset: the model's default


@dataclass(slots=True)
class CompletionRequest:
    model: str
    prompts: list[str | list[int]]  # one or more; each a string or token ids
    options: SamplingOptions


@dataclass(slots=True)
class ChatMessage:
    role: str
    content: str
    name: str | None = None


@dataclass(slots=True)
class ChatRequest:
    model: str
    messages: list[ChatMessage]
    options: SamplingOptions


def parse_json(raw: bytes | str) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:  # e.g. '[' * 50000: deeper than the parser's recursion limit
        raise APIError(400, "request body is not valid JSON: nested too deeply", code="invalid_json") from None


def _text(v: str, param: str) -> str:
    """`v`, refused when it is not valid Unicode: JSON may carry an unpaired surrogate (`"\\ud800"`),
    which neither the tokenizer nor UTF-8 can encode."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(f"'{param}' is not valid Unicode: it holds an unpaired surrogate (U+{ord(v[exc.start]):04X}); "
                          "send characters beyond U+FFFF as UTF-8 or as a surrogate pair", param,
                          "invalid_unicode") from None
    return v


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


class _Fields:
    """Typed access to a request object's fields; every getter records the field as known."""

    def __init__(self, body: Any, what: str) -> None:
        if not isinstance(body, dict):
            raise bad_request(f"the {what} request body must be a JSON object", code="invalid_type")
        self.body = body
        self.seen: set[str] = set()

    def get(self, name: str) -> Any:
        self.seen.add(name)
        return self.body.get(name)

    def integer(self, name: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
        v = self.get(name)
        if v is None:
            return default
        if not _is_int(v):
            raise bad_request(f"'{name}' must be an integer (got {json.dumps(v)})", name, "invalid_type")
        if v < lo or (hi is not None and v > hi):
            bound = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
            raise bad_request(f"'{name}' must be {bound} (got {v})", name)
        return v

    def number(self, name: str, default: float, lo: float, hi: float | None, *, lo_open: bool = False) -> float:
        """hi None: any finite number above lo."""
        v = self.get(name)
        if v is None:
            return default
        if not _is_number(v):
            raise bad_request(f"'{name}' must be a number (got {json.dumps(v)})", name, "invalid_type")
        top = sys.float_info.max if hi is None else hi
        if v != v or v > top or v < lo or (lo_open and v == lo):
            bound = f"in ({lo}, {hi}]" if lo_open else f"in [{lo}, {hi}]"
            bound = f"a finite number {'>' if lo_open else '>='} {lo}" if hi is None else bound
            raise bad_request(f"'{name}' must be {bound} (got {v})", name)
        return float(v)

    def flag(self, name: str, default: bool) -> bool:
        v = self.get(name)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise bad_request(f"'{name}' must be true or false (got {json.dumps(v)})", name, "invalid_type")
        return v

    def string(self, name: str, *, required: bool = False) -> str | None:
        v = self.get(name)
        if v is None:
            if required:
                raise bad_request(f"'{name}' is required", name, "missing_required_parameter")
            return None
        if not isinstance(v, str):
            raise bad_request(f"'{name}' must be a string (got {json.dumps(v)})", name, "invalid_type")
        return _text(v, name)

    def neutral(self, name: str, neutral: Any, why: str) -> None:
        """Accept a field only at its no-op value; anything else would be silently wrong."""
        v = self.get(name)
        if v is not None and v != neutral:
            raise bad_request(f"'{name}' is not supported by this server ({why})", name, "unsupported_parameter")

    def refuse_unknown(self) -> None:
        unknown = sorted(set(self.body) - self.seen)
        if unknown:
            raise bad_request(f"Unrecognized request argument supplied: {', '.join(unknown)}", unknown[0],
                              "unrecognized_argument")


def _model(f: _Fields) -> str:
    model = f.string("model", required=True)
    if not model:
        raise bad_request("'model' must name the base model or an adapter (see GET /v1/models)", "model")
    return model


def _stop(f: _Fields) -> list[str]:
    v = f.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request("'stop' must be a string or a list of strings", "stop", "invalid_type")
    if len(stops) > MAX_STOP:
        raise bad_request(f"'stop' takes at most {MAX_STOP} sequences (got {len(stops)})", "stop")
    if any(s == "" for s in stops):
        raise bad_request("'stop' sequences must not be empty", "stop")
    return [_text(s, "stop") for s in stops]


def _common(f: _Fields, max_tokens_names: tuple[str, ...], default_max_tokens: int | None,
            defaults: SamplingDefaults) -> SamplingOptions:
    max_tokens, max_tokens_param = default_max_tokens, max_tokens_names[0]
    for name in max_tokens_names:  # the later name wins (chat: max_completion_tokens over max_tokens)
        value = f.integer(name, None, 1)
        if value is not None:
            max_tokens, max_tokens_param = value, name
    stream = f.flag("stream", False)
    stream_options = f.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not isinstance(stream_options, dict) or set(stream_options) - {"include_usage"}:
            raise bad_request("'stream_options' must be an object with only 'include_usage'", "stream_options")
        if not stream:
            raise bad_request("'stream_options' is only allowed with 'stream': true", "stream_options")
        include_usage = stream_options.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise bad_request("'stream_options.include_usage' must be true or false", "stream_options")
    try:
        logit_bias = parse_logit_bias(f.get("logit_bias"))
    except LogitBiasError as exc:
        raise bad_request(str(exc), "logit_bias", exc.code) from None
    return SamplingOptions(
        max_tokens=max_tokens,
        max_tokens_param=max_tokens_param,
        temperature=f.number("temperature", defaults.temperature, 0.0, 2.0),
        top_p=f.number("top_p", defaults.top_p, 0.0, 1.0, lo_open=True),
        top_k=max(0, f.integer("top_k", defaults.top_k, -1, 1 << 20)),
        n=f.integer("n", 1, 1, MAX_N),
        seed=f.integer("seed", None, -(2**63), 2**63 - 1),
        stop=_stop(f),
        stream=stream,
        include_usage=include_usage,
        user=f.string("user"),
        ignore_eos=f.flag("ignore_eos", False),
        presence_penalty=f.number("presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=f.number("frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=f.number("repetition_penalty", defaults.repetition_penalty, 0.0, None, lo_open=True),
        logit_bias=logit_bias,
        min_p=f.number("min_p", defaults.min_p, 0.0, 1.0),
    )


def _prompts(v: Any) -> list[str | list[int]]:
    """`prompt`: a string, token ids, or a list of either; never empty."""
    if isinstance(v, str):
        prompts: list[Any] = [v]
    elif isinstance(v, list) and v and all(_is_int(t) for t in v):
        prompts = [v]
    elif isinstance(v, list) and v:
        prompts = v
    elif v is None:
        raise bad_request("'prompt' is required", "prompt", "missing_required_parameter")
    else:
        raise bad_request("'prompt' must be a non-empty string, a list of token ids, or a list of those",
                          "prompt", "invalid_type")
    if len(prompts) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request (got {len(prompts)})", "prompt")
    for p in prompts:
        if isinstance(p, str):
            if not p:
                raise bad_request("'prompt' must not be empty", "prompt", "empty_prompt")
            _text(p, "prompt")
        elif isinstance(p, list) and all(_is_int(t) for t in p):
            if not p:
                raise bad_request("'prompt' must not be empty", "prompt", "empty_prompt")
            if any(t < 0 for t in p):
                raise bad_request("'prompt' token ids must be >= 0", "prompt")
        else:
            raise bad_request("each prompt must be a string or a list of token ids", "prompt", "invalid_type")
    return prompts


def parse_completion_request(body: Any, defaults: SamplingDefaults = SamplingDefaults()) -> CompletionRequest:
    """``defaults``: what an unset temperature, top_p or top_k means (the model's, sampling_defaults.py)."""
    f = _Fields(body, "completions")
    model = _model(f)
    prompts = _prompts(f.get("prompt"))
    options = _common(f, ("max_tokens",), 16, defaults)
    options.logprobs = f.integer("logprobs", None, 0, MAX_COMPLETION_LOGPROBS)
    f.neutral("echo", False, "echo is not implemented")
    f.neutral("best_of", 1, "best_of is not implemented; use n")
    f.neutral("suffix", "", "suffix (insertion) is not implemented")
    f.refuse_unknown()
    return CompletionRequest(model, prompts, options)


def _content(v: Any, where: str) -> str:
    if isinstance(v, str):
        return _text(v, "messages")
    if isinstance(v, list):
        parts = []
        for part in v:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"{where}: only text content parts are supported", "messages", "invalid_type")
            parts.append(part["text"])
        return _text("\n".join(parts), "messages")  # as vLLM renders text parts for a string template
    if v is None:
        return ""
    raise bad_request(f"{where}: 'content' must be a string or a list of text parts", "messages", "invalid_type")


def parse_chat_request(body: Any, defaults: SamplingDefaults = SamplingDefaults()) -> ChatRequest:
    """``defaults``: as for ``parse_completion_request``."""
    f = _Fields(body, "chat completions")
    model = _model(f)
    raw = f.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("'messages' must be a non-empty list of messages", "messages",
                          "missing_required_parameter" if raw is None else "invalid_type")
    messages = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object with 'role' and 'content'", "messages", "invalid_type")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(CHAT_ROLES)} (got {json.dumps(role)})",
                              "messages")
        name = m.get("name")
        if name is not None and not isinstance(name, str):
            raise bad_request(f"{where}.name must be a string", "messages", "invalid_type")
        if name is not None:
            _text(name, "messages")
        for key in ("tool_calls", "function_call"):  # empty: what a response without calls carries back
            if m.get(key):
                raise bad_request(f"{where}.{key}: tool calling is not implemented, and the chat template "
                                  "would be rendered without these calls", "messages", "unsupported_parameter")
        messages.append(ChatMessage(role, _content(m.get("content"), where), name))
    if not any(m.content for m in messages):
        raise bad_request("'messages' must contain some text", "messages", "empty_prompt")
    options = _common(f, ("max_tokens", "max_completion_tokens"), None, defaults)
    if f.flag("logprobs", False):
        options.logprobs = f.integer("top_logprobs", 0, 0, MAX_CHAT_TOP_LOGPROBS)
    elif f.get("top_logprobs") is not None:
        raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    f.neutral("tools", [], "tool calling is not implemented")
    f.neutral("tool_choice", "none", "tool calling is not implemented")
    f.neutral("response_format", {"type": "text"}, "structured output is not implemented")
    f.refuse_unknown()
    return ChatRequest(model, messages, options)


def parse_load_adapter_request(body: Any) -> tuple[str, str]:
    """vLLM's `POST /v1/load_lora_adapter {"lora_name", "lora_path"}`."""
    f = _Fields(body, "load_lora_adapter")
    name = f.string("lora_name", required=True)
    path = f.string("lora_path", required=True)
    f.refuse_unknown()
    if not name or not path:
        raise bad_request("'lora_name' and 'lora_path' must not be empty", "lora_name")
    try:  # the directive schema's rule: the name must fit a state report (GET /admin/v1/state)
        directive_name(name, "lora_name")
    except DirectiveError as exc:
        raise bad_request(str(exc), "lora_name") from None
    return name, path


def parse_unload_adapter_request(body: Any) -> str:
    """vLLM's `POST /v1/unload_lora_adapter {"lora_name"}` (`lora_int_id` accepted and ignored)."""
    f = _Fields(body, "unload_lora_adapter")
    name = f.string("lora_name", required=True)
    f.get("lora_int_id")
    f.refuse_unknown()
    if not name:
        raise bad_request("'lora_name' must not be empty", "lora_name")
    return name

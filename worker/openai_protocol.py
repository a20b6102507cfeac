"""OpenAI request bodies parsed and validated into small dataclasses, and OpenAI-shaped errors.

Parsing is strict where it matters: wrong types, out-of-range values and unknown top-level fields
are refused with a 400 that names the field (as OpenAI does: "Unrecognized request argument");
options we cannot honour (`best_of` above `n`, `suffix`, chat's `echo`, legacy `functions` and `function_call`,
`reasoning_effort`, non-text `modalities`, vLLM's `documents`) are refused rather than silently ignored;
documented fields that do not change the output (`store`, `metadata`, `service_tier`, ...) are type-checked
and ignored. vLLM's chat fields `add_generation_prompt`, `continue_final_message`, `chat_template_kwargs` and
`add_special_tokens` are taken with vLLM's meaning (chat_template.py). Tokenization happens later, in
openai_api.py, and the context-length check in completion_job.py. The typed field access and the error shape
live in openai_fields.py, the sampling options both endpoints share in openai_sampling.py, the tool fields
(`tools`, `tool_choice`, a history's `tool_calls`) in tool_request.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from lorafleet.worker.chat_template import ChatTemplateOptions, is_reserved
from lorafleet.worker.directives import DirectiveError
from lorafleet.worker.directives import _name as directive_name
from lorafleet.worker.json_constraint import JsonObjectGrammar
from lorafleet.worker.openai_fields import (
    APIError,
    Fields,
    bad_request,
    check_strings,
    check_text,
    is_id_list,
    parse_json,
)
from lorafleet.worker.openai_sampling import SamplingOptions, parse_sampling_options
from lorafleet.worker.sampling_defaults import SamplingDefaults
from lorafleet.worker.sampling_params import MAX_LOGPROBS
from lorafleet.worker.tool_request import ToolRequest, message_tool_calls, parse_tool_request

__all__ = [  # APIError, bad_request, parse_json (openai_fields.py) and SamplingOptions are re-exported
    "APIError", "ChatMessage", "ChatRequest", "CompletionRequest", "SamplingOptions", "bad_request",
    "parse_chat_request", "parse_completion_request", "parse_json", "parse_load_adapter_request",
    "parse_unload_adapter_request",
]

MAX_COMPLETION_LOGPROBS = MAX_LOGPROBS  # vLLM's max_logprobs (OpenAI's legacy API stops at 5)
MAX_CHAT_TOP_LOGPROBS = MAX_LOGPROBS
MAX_PROMPTS = 1024  # a batch of an evaluation harness (lm-evaluation-harness sends its batch_size as one list)
CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")


@dataclass(slots=True)
class CompletionRequest:
    model: str | None  # None: left out, the base model
    prompts: list[str | list[int]]  # one or more; each a string or token ids
    options: SamplingOptions
    add_special_tokens: bool = True  # vLLM's: false leaves out the tokenizer's BOS (a prompt rendered with its own)


@dataclass(slots=True)
class ChatMessage:
    role: str
    content: str
    name: str | None = None
    tool_call_id: str | None = None  # a tool message's: which call it answers
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls, arguments as objects (tool_request.py)


@dataclass(slots=True)
class ChatRequest:
    model: str | None  # None: left out, the base model
    messages: list[ChatMessage]
    options: SamplingOptions
    template: ChatTemplateOptions  # vLLM's chat template fields
    tools: ToolRequest | None = None  # tools, tool_choice; None: no tools sent

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as the chat template sees them: role and content, name, tool_call_id and tool_calls
        where sent (templates test `'tool_calls' in message`: the key is there only with calls)."""
        return [{"role": m.role, "content": m.content}
                | {k: v for k, v in (("name", m.name), ("tool_call_id", m.tool_call_id), ("tool_calls", m.tool_calls))
                   if v is not None}
                for m in self.messages]


def _model(f: Fields) -> str | None:
    """The model named; None where left out (the base model, as vLLM serves its one model then)."""
    model = f.string("model")
    if model is not None and not model:
        raise bad_request("'model' must name the base model or an adapter (see GET /v1/models)", "model")
    return model


def _prompts(v: Any) -> list[str | list[int]]:
    """`prompt`: a string, token ids, or a list of either; never empty."""
    ids = bool(v) and is_id_list(v)  # one prompt of token ids: checked once, here
    if isinstance(v, str):
        prompts: list[Any] = [v]
    elif ids:
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
            check_text(p, "prompt")
        elif ids or is_id_list(p):
            if not p:
                raise bad_request("'prompt' must not be empty", "prompt", "empty_prompt")
            if min(p) < 0:
                raise bad_request("'prompt' token ids must be >= 0", "prompt")
        else:
            raise bad_request("each prompt must be a string or a list of token ids", "prompt", "invalid_type")
    return prompts


def parse_completion_request(body: Any, defaults: SamplingDefaults = SamplingDefaults()) -> CompletionRequest:
    """``defaults``: what an unset temperature, top_p or top_k means (the model's, sampling_defaults.py)."""
    f = Fields(body, "completions")
    model = _model(f)
    prompts = _prompts(f.get("prompt"))
    echo = f.flag("echo", False)  # with max_tokens 0: the prompt scored, nothing generated (OpenAI's legacy API)
    # OpenAI's 16 when left out; an explicit null (the openai client's max_tokens=None): up to the end of the
    # context, as vLLM reads it
    unbounded = "max_tokens" in f.body and f.body["max_tokens"] is None
    options = parse_sampling_options(f, ("max_tokens",), None if unbounded else 16, defaults,
                                     least_max_tokens=0 if echo else 1)
    options.logprobs = f.integer("logprobs", None, 0, MAX_COMPLETION_LOGPROBS)
    options.echo = echo
    # 1, the default some clients send with any n, or n: n choices, as asked; more to pick from is not implemented
    best_of = f.integer("best_of", None, 1, None)
    if best_of is not None and 1 < best_of < options.n:  # OpenAI's and vLLM's rule (1: the default some clients send)
        raise bad_request(f"'best_of' ({best_of}) must be greater than or equal to 'n' ({options.n})", "best_of")
    if best_of not in (None, 1):
        f.neutral("best_of", options.n, "best_of above n is not implemented; use n")
    f.neutral("suffix", "", "suffix (insertion) is not implemented")
    add_special_tokens = f.flag("add_special_tokens", True)
    f.refuse_unknown()
    return CompletionRequest(model, prompts, options, add_special_tokens)


def _content(v: Any, where: str) -> str:
    if isinstance(v, str):
        return check_text(v, "messages")
    if isinstance(v, list):
        parts = []
        for part in v:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("text", "refusal"):  # an assistant's refusal in the history is its text
                raise bad_request(f"{where}: only text (and refusal) content parts are supported", "messages",
                                  "invalid_type")
            if not isinstance(part.get(kind), str):
                raise bad_request(f"{where}: a {kind} part needs '{kind}', a string", "messages", "invalid_type")
            parts.append(part[kind])
        return check_text("\n".join(parts), "messages")  # as vLLM renders text parts for a string template
    if v is None:
        return ""
    raise bad_request(f"{where}: 'content' must be a string or a list of text parts", "messages", "invalid_type")


def parse_chat_request(body: Any, defaults: SamplingDefaults = SamplingDefaults()) -> ChatRequest:
    """``defaults``: as for ``parse_completion_request``."""
    f = Fields(body, "chat completions")
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
        if m.get("content") is None and role != "assistant":  # only an assistant's turn (its tool calls) may lack it
            raise bad_request(f"{where}: a {role} message needs 'content' (a string or a list of text parts)",
                              "messages", "missing_required_parameter")
        name, tool_call_id = (_message_string(m, key, where) for key in ("name", "tool_call_id"))
        content = m.get("content")
        if content is None and role == "assistant" and m.get("refusal") is not None:  # as OpenAI's history has it
            if not isinstance(m["refusal"], str):
                raise bad_request(f"{where}.refusal must be a string", "messages", "invalid_type")
            content = m["refusal"]
        messages.append(ChatMessage(role, _content(content, where), name, tool_call_id, message_tool_calls(m, where)))
    options = parse_sampling_options(f, ("max_tokens", "max_completion_tokens"), None, defaults)
    options.default_max_tokens = defaults.max_tokens
    if f.flag("logprobs", False):
        options.logprobs = f.integer("top_logprobs", 0, 0, MAX_CHAT_TOP_LOGPROBS)
    elif f.get("top_logprobs") is not None:
        raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    f.neutral("echo", False, "chat's echo (repeating the last message) is not implemented; /v1/completions "
                             "takes echo, and prompt_logprobs works on both")
    tools = parse_tool_request(f)
    if tools is not None and tools.choice in ("named", "required"):  # the arguments, or the calls (tool_request.py)
        if options.grammar is not None and not isinstance(options.grammar, JsonObjectGrammar):  # JSON mode: replaced
            raise bad_request(f"'{options.grammar_param}' cannot be combined with 'tool_choice' {json.dumps(tools.choice)}: "
                              "the output is then held to the tool calls' schema", options.grammar_param)
        options.json_object, options.grammar, options.grammar_param = True, tools.output_grammar, "tools"
    if tools is not None and tools.choice != "none" and f.get("skip_special_tokens") is None:
        options.skip_special_tokens = False  # vLLM's: <tool_call> may be a special token; the parser needs it
    _chat_extras(f)
    template = _template_options(f)
    f.refuse_unknown()
    return ChatRequest(model, messages, options, template, tools)


def _message_string(m: dict, key: str, where: str) -> str | None:
    v = m.get(key)
    if v is not None and not isinstance(v, str):
        raise bad_request(f"{where}.{key} must be a string", "messages", "invalid_type")
    return None if v is None else check_text(v, "messages")


def _template_options(f: Fields) -> ChatTemplateOptions:
    """vLLM's chat template fields. add_generation_prompt defaults to true, or to false with
    continue_final_message (vLLM refuses the pair, so a client sends both; either way no new turn is opened)."""
    continue_final = f.flag("continue_final_message", False)
    add_generation_prompt = f.flag("add_generation_prompt", not continue_final)
    if continue_final and add_generation_prompt:
        raise bad_request("'continue_final_message' and 'add_generation_prompt' cannot both be true: the one "
                          "continues the last message, the other starts a new assistant turn",
                          "continue_final_message")
    kwargs = f.get("chat_template_kwargs")
    if not isinstance(kwargs, dict | None):
        raise bad_request("'chat_template_kwargs' must be an object of template variables", "chat_template_kwargs",
                          "invalid_type")
    kwargs = kwargs or {}
    reserved = sorted(k for k in kwargs if is_reserved(k))
    if reserved:
        raise bad_request(f"'chat_template_kwargs' must not set {', '.join(reserved)}: the worker passes the chat "
                          "template its messages, options (use the request's own fields) and special tokens",
                          "chat_template_kwargs")
    check_strings(kwargs, "chat_template_kwargs")
    return ChatTemplateOptions(add_generation_prompt, continue_final, kwargs, f.flag("add_special_tokens", False))


def _chat_extras(f: Fields) -> None:
    """OpenAI's chat fields beyond sampling: those that change nothing the model generates are type-checked
    and ignored; those whose effect would be silently lost are accepted only at their no-op value."""
    f.flag("store", False)  # nothing is stored here for later retrieval
    f.string_map("metadata")  # tags of a stored completion
    for name in ("service_tier", "prompt_cache_key", "safety_identifier"):  # billing, cache routing, abuse reports
        f.string(name)
    if not isinstance(f.get("prediction"), dict | None):  # predicted output: only a speed-up, the same text
        raise bad_request("'prediction' must be an object", "prediction", "invalid_type")
    f.neutral("functions", [], "the legacy function calling is not implemented; send 'tools'")
    f.neutral("function_call", "none", "the legacy function calling is not implemented; send 'tool_choice'")
    f.neutral("modalities", ["text"], "only text output; send [\"text\"] or leave it out")
    f.neutral("audio", None, "only text output")
    f.neutral("web_search_options", None, "web search is not implemented")
    f.neutral("verbosity", None, "the model's verbosity cannot be set; ask for it in the prompt")
    # Refused, not ignored (vLLM only hands it to the chat template): OpenAI answers a 400 too for a model
    # without a reasoning mode, and accepting "high" would pretend to honour it. "none" is what happens.
    f.neutral("reasoning_effort", "none", "the model has no reasoning mode to set; send \"none\" or leave it out")


def parse_load_adapter_request(body: Any) -> tuple[str, str, bool]:
    """vLLM's `POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace"?}`."""
    f = Fields(body, "load_lora_adapter")
    name = f.string("lora_name", required=True)
    path = f.string("lora_path", required=True)
    inplace = f.flag("load_inplace", False)
    f.refuse_unknown()
    if not name or not path:
        raise bad_request("'lora_name' and 'lora_path' must not be empty", "lora_name")
    try:  # the directive schema's rule: the name must fit a state report (GET /admin/v1/state)
        directive_name(name, "lora_name")
    except DirectiveError as exc:
        raise bad_request(str(exc), "lora_name") from None
    return name, path, inplace


def parse_unload_adapter_request(body: Any) -> str:
    """vLLM's `POST /v1/unload_lora_adapter {"lora_name"}` (`lora_int_id` accepted and ignored)."""
    f = Fields(body, "unload_lora_adapter")
    name = f.string("lora_name", required=True)
    f.get("lora_int_id")
    f.refuse_unknown()
    if not name:
        raise bad_request("'lora_name' must not be empty", "lora_name")
    return name

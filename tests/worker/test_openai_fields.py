"""Documented OpenAI request fields: those that change nothing here are type-checked and ignored; those
whose effect would be silently lost are a 400 that says so, not an "Unrecognized request argument"."""

from __future__ import annotations

import pytest

from lorafleet.worker.openai_protocol import APIError, parse_chat_request, parse_completion_request

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}
STREAM = {"stream": True}

INERT_CHAT_FIELDS = [
    {"store": True}, {"store": False},
    {"metadata": {"team": "search", "run": "42"}}, {"metadata": {}},
    {"service_tier": "auto"}, {"service_tier": "flex"},
    {"prompt_cache_key": "user-7-session"},  # safety_identifier names the user: test_openai_protocol.py
    {"parallel_tool_calls": False}, {"parallel_tool_calls": True},
    {"functions": []}, {"function_call": "none"},
    {"modalities": ["text"]}, {"reasoning_effort": "none"},
    {"prediction": {"type": "content", "content": "hello"}},
    {"audio": None, "web_search_options": None, "verbosity": None, "reasoning_effort": None},
]


@pytest.mark.parametrize("extra", INERT_CHAT_FIELDS)
def test_chat_accepts_fields_that_do_not_change_the_output(extra):
    r = parse_chat_request(CHAT | extra)
    assert r.options == parse_chat_request(CHAT).options


@pytest.mark.parametrize("parse, base", [(parse_chat_request, CHAT), (parse_completion_request, COMPLETION)])
@pytest.mark.parametrize("stream_options", [
    {"include_obfuscation": False}, {"include_obfuscation": True},
    {"include_usage": True, "include_obfuscation": False}, {"continuous_usage_stats": False},
    {"include_usage": None}, {"continuous_usage_stats": True}, {"continuous_usage_stats": True, "include_usage": None},
])
def test_stream_options_that_do_not_change_the_output(parse, base, stream_options):
    """Only usage: asked, or left out beside continuous_usage_stats (vLLM's default is on; OpenAI's off)."""
    o = parse(base | STREAM | {"stream_options": stream_options}).options
    asked = stream_options.get("include_usage", stream_options.get("continuous_usage_stats"))
    assert o.include_usage is bool(asked) and o.continuous_usage is bool(asked and stream_options.get("continuous_usage_stats"))


REFUSED_CHAT_FIELDS = [  # (extra fields, param, code, words of the message)
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions", "unsupported_parameter", "function calling"),
    ({"function_call": "auto"}, "function_call", "unsupported_parameter", "function calling"),
    ({"function_call": {"name": "f"}}, "function_call", "unsupported_parameter", "function calling"),
    ({"modalities": ["text", "audio"]}, "modalities", "unsupported_parameter", "only text output"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio", "unsupported_parameter", "only text output"),
    ({"reasoning_effort": "high"}, "reasoning_effort", "unsupported_parameter", "no reasoning mode"),
    ({"web_search_options": {}}, "web_search_options", "unsupported_parameter", "web search"),
    ({"verbosity": "low"}, "verbosity", "unsupported_parameter", "verbosity"),
    # wrong types stay a 400 naming the field
    ({"store": "yes"}, "store", "invalid_type", "true or false"),
    ({"parallel_tool_calls": 1}, "parallel_tool_calls", "invalid_type", "true or false"),
    ({"metadata": {"n": 1}}, "metadata", "invalid_type", "values are strings"),
    ({"metadata": ["a"]}, "metadata", "invalid_type", "values are strings"),
    ({"service_tier": 3}, "service_tier", "invalid_type", "must be a string"),
    ({"prompt_cache_key": {}}, "prompt_cache_key", "invalid_type", "must be a string"),
    ({"safety_identifier": 7}, "safety_identifier", "invalid_type", "must be a string"),
    ({"prediction": "hello"}, "prediction", "invalid_type", "must be an object"),
    ({"metadata": {"k": "\ud800"}}, "metadata", "invalid_unicode", "not valid Unicode"),
]


@pytest.mark.parametrize(("extra", "param", "code", "words"), REFUSED_CHAT_FIELDS)
def test_chat_refuses_fields_whose_effect_would_be_lost(extra, param, code, words):
    with pytest.raises(APIError) as exc:
        parse_chat_request(CHAT | extra)
    err = exc.value
    assert (err.status, err.param, err.code) == (400, param, code)
    assert words in err.message and "Unrecognized" not in err.message


@pytest.mark.parametrize("parse, base", [(parse_chat_request, CHAT), (parse_completion_request, COMPLETION)])
@pytest.mark.parametrize(("stream_options", "code", "words"), [
    ({"include_obfuscation": "no"}, "invalid_type", "'stream_options.include_obfuscation' must be true or false"),
    ({"include_usage": 1}, "invalid_type", "'stream_options.include_usage' must be true or false"),
    ({"bogus": True}, "invalid_value", "takes only include_usage, include_obfuscation, continuous_usage_stats"),
    ("yes", "invalid_type", "'stream_options' must be an object"),
])
def test_stream_options_refused_name_the_key(parse, base, stream_options, code, words):
    with pytest.raises(APIError) as exc:
        parse(base | STREAM | {"stream_options": stream_options})
    err = exc.value
    assert (err.status, err.param, err.code) == (400, "stream_options", code) and words in err.message


def test_completions_suffix_is_refused_clearly():
    """OpenAI's completions `suffix` (insertion) would be silently dropped: a 400 that names it; empty is a no-op."""
    assert parse_completion_request(COMPLETION | {"suffix": ""}).prompts == ["hi"]
    with pytest.raises(APIError) as exc:
        parse_completion_request(COMPLETION | {"suffix": "</code>"})
    assert (exc.value.param, exc.value.code) == ("suffix", "unsupported_parameter")
    assert "suffix" in exc.value.message and "not supported" in exc.value.message


VLLM_NO_OPS = {  # vLLM's own fields, at the values clients written for it send by default
    "use_beam_search": False, "length_penalty": 1.0, "early_stopping": False, "priority": 0,
    "truncate_prompt_tokens": None, "allowed_token_ids": None, "bad_words": [], "return_tokens_as_token_ids": False,
    "detokenize": True, "include_reasoning": True, "unknown_but_null": None,
}


@pytest.mark.parametrize("parse, base", [(parse_chat_request, CHAT), (parse_completion_request, COMPLETION)])
def test_vllms_fields_at_their_no_op_values_change_nothing(parse, base):
    """A client written for vLLM sends its fields whatever they are set to: at their no-op values they are
    accepted and change nothing (a field sent as null is as one left out)."""
    assert parse(base | VLLM_NO_OPS).options == parse(base).options


@pytest.mark.parametrize("parse, base", [(parse_chat_request, CHAT), (parse_completion_request, COMPLETION)])
@pytest.mark.parametrize(("extra", "param", "code", "words"), [
    ({"use_beam_search": True}, "use_beam_search", "unsupported_parameter", "beam search"),
    ({"length_penalty": 0.5}, "length_penalty", "unsupported_parameter", "beam search"),
    ({"priority": 3}, "priority", "unsupported_parameter", "arrival"),
    ({"truncate_prompt_tokens": 100}, "truncate_prompt_tokens", "unsupported_parameter", "never cut"),
    ({"allowed_token_ids": [1, 2]}, "allowed_token_ids", "unsupported_parameter", "logit_bias"),
    ({"bad_words": ["x"]}, "bad_words", "unsupported_parameter", "logit_bias"),
    ({"return_tokens_as_token_ids": True}, "return_tokens_as_token_ids", "unsupported_parameter", "text"),
    ({"detokenize": False}, "detokenize", "unsupported_parameter", "always text"),
    ({"cache_salt": 5}, "cache_salt", "invalid_type", "must be a string"),
    ({"cache_salt": " "}, "cache_salt", "invalid_value", "non-empty string"),
    ({"request_id": ""}, "request_id", "invalid_value", "1 to 256 characters"),
    ({"request_id": 7}, "request_id", "invalid_type", "must be a string"),
    ({"bogus": 0}, "bogus", "unrecognized_argument", "Unrecognized request argument supplied: bogus"),
])
def test_vllms_fields_whose_effect_would_be_lost_are_refused(parse, base, extra, param, code, words):
    with pytest.raises(APIError) as exc:
        parse(base | extra)
    err = exc.value
    assert (err.status, err.param, err.code) == (400, param, code) and words in err.message, err.message


def test_a_request_id_names_the_answer():
    assert parse_completion_request(COMPLETION | {"request_id": "batch-7/req-1"}).options.request_id == "batch-7/req-1"

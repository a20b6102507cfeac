"""worker/openai_protocol.py: request bodies -> dataclasses, or a 400 that names the field."""

from __future__ import annotations

import pytest

from lorafleet.worker.chat_template import ChatTemplateOptions
from lorafleet.worker.openai_protocol import (
    APIError,
    parse_chat_request,
    parse_completion_request,
    parse_json,
    parse_load_adapter_request,
    parse_unload_adapter_request,
)


def test_completion_defaults_and_all_options():
    r = parse_completion_request({"model": "sql", "prompt": "hi"})
    assert r.model == "sql" and r.prompts == ["hi"]
    assert (r.options.max_tokens, r.options.n, r.options.temperature, r.options.logprobs) == (16, 1, 1.0, None)
    r = parse_completion_request({
        "model": "sql@v2", "prompt": [[1, 2], "x"], "max_tokens": 5, "temperature": 0, "top_p": 0.5, "n": 3,
        "seed": 7, "stop": "END", "logprobs": 2, "stream": True, "stream_options": {"include_usage": True},
        "user": "alice", "presence_penalty": 0, "echo": False, "best_of": 1, "top_k": 40,
    })
    assert r.options.top_k == 40
    # Whole-number floats are integers (vLLM's parser takes them; clients that build bodies with floats send them)
    o = parse_completion_request({"model": "m", "prompt": "x", "max_tokens": 3.0, "seed": 1.0, "n": 2.0}).options
    assert (o.max_tokens, o.seed, o.n) == (3, 1, 2) and type(o.max_tokens) is int
    # best_of equal to n asks for nothing more than n (OpenAI's and LoRAX's reading): it was refused
    assert parse_completion_request({"model": "m", "prompt": "x", "n": 2, "best_of": 2}).options.n == 2
    assert parse_completion_request({"model": "m", "prompt": "x", "ignore_eos": True}).options.ignore_eos
    assert parse_completion_request({"model": "m", "prompt": "x", "top_k": -1}).options.top_k == 0
    o = r.options
    assert r.prompts == [[1, 2], "x"]
    assert (o.max_tokens, o.temperature, o.top_p, o.n, o.seed, o.stop, o.logprobs, o.stream, o.include_usage,
            o.user) == (5, 0.0, 0.5, 3, 7, ["END"], 2, True, True, "alice")
    assert parse_completion_request({"model": "m", "prompt": [5, 6]}).prompts == [[5, 6]]


def test_an_evaluation_harness_batch_is_within_the_limits():
    """lm-evaluation-harness sends its batch as one list of prompts, many `until` stop strings and up to 20
    logprobs (vLLM's limit): OpenAI's tighter limits (16 prompts, 4 stops, 5 logprobs) refused each of them."""
    r = parse_completion_request({"model": "m", "prompt": [f"q{i}" for i in range(64)], "logprobs": 20,
                                  "stop": [f"\n{i}" for i in range(12)], "n": 2})
    assert (len(r.prompts), r.options.logprobs, len(r.options.stop)) == (64, 20, 12)
    with pytest.raises(APIError, match="at most 1024 prompts"):
        parse_completion_request({"model": "m", "prompt": ["x"] * 1025})


def test_chat_messages_and_logprobs():
    r = parse_chat_request({
        "model": "m", "messages": [{"role": "system", "content": "be brief"},
                                   {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_completion_tokens": 9, "logprobs": True, "top_logprobs": 3,
    })
    assert [(m.role, m.content) for m in r.messages] == [("system", "be brief"), ("user", "hi")]
    assert r.options.max_tokens == 9 and r.options.logprobs == 3
    assert parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}]}).options.max_tokens is None
    # completions: 16 left out (OpenAI's), an explicit null up to the end of the context (vLLM's; the openai
    # client's max_tokens=None)
    assert parse_completion_request({"model": "m", "prompt": "x"}).options.max_tokens == 16
    assert parse_completion_request({"model": "m", "prompt": "x", "max_tokens": None}).options.max_tokens is None
    assert parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}],
                               "logprobs": True}).options.logprobs == 0
    o = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 20,
                            "echo": False}).options
    assert (o.prompt_logprobs, o.echo) == (20, False)


def test_safety_identifier_names_the_user_as_user_does():
    """OpenAI's successor of `user`: a client that moved to it keeps its canary bucket (user wins if both)."""
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    assert parse_chat_request(chat | {"safety_identifier": "alice"}).options.user == "alice"
    assert parse_chat_request(chat | {"safety_identifier": "alice", "user": "bob"}).options.user == "bob"
    assert parse_completion_request({"model": "m", "prompt": "x", "safety_identifier": "alice"}).options.user == "alice"
    both = {"model": "m", "prompt": "x", "safety_identifier": "alice", "user": "bob"}  # was refused as unknown
    assert parse_completion_request(both).options.user == "bob"
    for parse, body in ((parse_chat_request, chat), (parse_completion_request, {"model": "m", "prompt": "x"})):
        with pytest.raises(APIError) as exc:
            parse(body | {"safety_identifier": 7, "user": "bob"})
        assert (exc.value.param, exc.value.code) == ("safety_identifier", "invalid_type")


def test_completion_echo_and_prompt_logprobs():
    o = parse_completion_request({"model": "m", "prompt": [1, 2], "echo": True, "logprobs": 1, "max_tokens": 1}).options
    assert (o.echo, o.logprobs, o.prompt_logprobs) == (True, 1, None)
    o = parse_completion_request({"model": "m", "prompt": "x", "prompt_logprobs": 0}).options
    assert (o.echo, o.prompt_logprobs) == (False, 0)


BAD_COMPLETIONS = [
    ([], "JSON object", "invalid_type"),
    ({"model": 3, "prompt": "x"}, "'model' must be a string", "invalid_type"),
    ({"model": "", "prompt": "x"}, "GET /v1/models", "invalid_value"),
    ({"model": "m"}, "'prompt' is required", "missing_required_parameter"),
    ({"model": "m", "prompt": ""}, "must not be empty", "empty_prompt"),
    ({"model": "m", "prompt": []}, "non-empty", "invalid_type"),
    ({"model": "m", "prompt": [[]]}, "must not be empty", "empty_prompt"),
    ({"model": "m", "prompt": [-1]}, ">= 0", "invalid_value"),
    ({"model": "m", "prompt": [1.5]}, "string or a list", "invalid_type"),
    ({"model": "m", "prompt": "x", "max_tokens": 0}, "'max_tokens' must be >= 1", "invalid_value"),
    ({"model": "m", "prompt": "x", "max_tokens": "5"}, "must be an integer", "invalid_type"),
    ({"model": "m", "prompt": "x", "max_tokens": True}, "must be an integer", "invalid_type"),
    ({"model": "m", "prompt": "x", "temperature": 3}, "'temperature' must be in", "invalid_value"),
    ({"model": "m", "prompt": "x", "top_p": 0}, "'top_p' must be in", "invalid_value"),
    ({"model": "m", "prompt": "x", "n": 0}, "'n' must be between", "invalid_value"),
    ({"model": "m", "prompt": "x", "stop": ["a", ""]}, "must not be empty", "invalid_value"),
    ({"model": "m", "prompt": "x", "stop": [1]}, "'stop' must be", "invalid_type"),
    ({"model": "m", "prompt": "x", "stop": [str(i) for i in range(65)]}, "at most 64", "invalid_value"),
    ({"model": "m", "prompt": "x", "stop": ["a" * 4000, "b" * 97]}, "at most 4096 characters", "invalid_value"),
    ({"model": "m", "prompt": "x", "logprobs": 21}, "'logprobs' must be between", "invalid_value"),
    ({"model": "m", "prompt": "x", "stream": "yes"}, "true or false", "invalid_type"),
    ({"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}, "only allowed", "invalid_value"),
    ({"model": "m", "prompt": "x", "echo": "yes"}, "'echo' must be true or false", "invalid_type"),
    ({"model": "m", "prompt": "x", "prompt_logprobs": 21}, "'prompt_logprobs' must be between 0 and 20",
     "invalid_value"),
    ({"model": "m", "prompt": "x", "prompt_logprobs": -1}, "'prompt_logprobs' must be between", "invalid_value"),
    ({"model": "m", "prompt": "x", "prompt_logprobs": 1, "stream": True}, "not available with 'stream'",
     "invalid_value"),
    ({"model": "m", "prompt": "x", "best_of": 2}, "not supported", "unsupported_parameter"),
    ({"model": "m", "prompt": "x", "best_of": 3, "n": 2}, "not supported", "unsupported_parameter"),
    ({"model": "m", "prompt": "x", "best_of": 2, "n": 3}, "'best_of' (2) must be greater than or equal to 'n' (3)",
     "invalid_value"),
    ({"model": "m", "prompt": "x", "best_of": 0}, "'best_of' must be >= 1", "invalid_value"),
    ({"model": "m", "prompt": "x", "best_of": "2"}, "'best_of' must be an integer", "invalid_type"),
    ({"model": "m", "prompt": "x", "frequency_penalty": 2.5}, "'frequency_penalty' must be in [-2.0, 2.0]",
     "invalid_value"),
    ({"model": "m", "prompt": "x", "presence_penalty": -3}, "'presence_penalty' must be in [-2.0, 2.0]",
     "invalid_value"),
    ({"model": "m", "prompt": "x", "presence_penalty": "1"}, "'presence_penalty' must be a number", "invalid_type"),
    ({"model": "m", "prompt": "x", "repetition_penalty": 0}, "'repetition_penalty' must be a finite number > 0",
     "invalid_value"),
    ({"model": "m", "prompt": "x", "repetition_penalty": -1.2}, "'repetition_penalty' must be", "invalid_value"),
    ({"model": "m", "prompt": "x", "repetition_penalty": float("inf")}, "'repetition_penalty' must be",
     "invalid_value"),
    ({"model": "m", "prompt": "x", "repetition_penalty": True}, "must be a number", "invalid_type"),
    ({"model": "m", "prompt": "x", "bogus": 1}, "Unrecognized request argument supplied: bogus",
     "unrecognized_argument"),
]


@pytest.mark.parametrize(("body", "needle", "code"), BAD_COMPLETIONS)
def test_bad_completion_bodies_are_400_naming_the_problem(body, needle, code):
    with pytest.raises(APIError) as exc:
        parse_completion_request(body)
    err = exc.value
    assert err.status == 400 and needle in err.message and err.code == code
    if "penalty" in needle:
        assert err.param == needle.split("'")[1]
    assert set(err.body()["error"]) == {"message", "type", "code", "param"}


@pytest.mark.parametrize("parse", [parse_completion_request, parse_chat_request])
def test_penalties_are_accepted_within_range(parse):
    base = {"model": "m", "prompt": "x"} if parse is parse_completion_request else {
        "model": "m", "messages": [{"role": "user", "content": "x"}]}
    o = parse(base).options
    assert (o.presence_penalty, o.frequency_penalty, o.repetition_penalty) == (0.0, 0.0, 1.0)
    o = parse(base | {"presence_penalty": -2, "frequency_penalty": 2, "repetition_penalty": 1.3}).options
    assert (o.presence_penalty, o.frequency_penalty, o.repetition_penalty) == (-2.0, 2.0, 1.3)
    assert isinstance(o.presence_penalty, float) and isinstance(o.frequency_penalty, float)
    o = parse(base | {"presence_penalty": 0.5, "frequency_penalty": -0.25, "repetition_penalty": 3}).options
    assert (o.presence_penalty, o.frequency_penalty, o.repetition_penalty) == (0.5, -0.25, 3.0)  # vLLM: only > 0


@pytest.mark.parametrize("parse", [parse_completion_request, parse_chat_request])
def test_logit_bias_and_min_p_are_parsed(parse):
    base = {"model": "m", "prompt": "x"} if parse is parse_completion_request else {
        "model": "m", "messages": [{"role": "user", "content": "x"}]}
    o = parse(base).options
    assert (o.logit_bias, o.min_p) == (None, 0.0)
    o = parse(base | {"logit_bias": {"50256": -100, "7": 100, "0": 2.5}, "min_p": 0.1}).options
    assert o.logit_bias == {50256: -100.0, 7: 100.0, 0: 2.5} and o.min_p == 0.1
    assert all(isinstance(v, float) for v in o.logit_bias.values())
    assert parse(base | {"logit_bias": {}, "min_p": 1}).options.logit_bias is None
    assert parse(base | {"logit_bias": None}).options.logit_bias is None
    assert len(parse(base | {"logit_bias": {str(i): 1 for i in range(1024)}}).options.logit_bias) == 1024


@pytest.mark.parametrize("logit_bias", [{"1" * 5000: 1}, {"12345678901": 1}, {"5": 10**400}, {"5": -(10**30)}])
def test_logit_bias_of_huge_numbers_is_a_400_naming_it(logit_bias):
    """A key of thousands of digits (int() refuses past 4300, after quadratic time) or a value too large for
    a float once raised past the 400 and ended as a 500 with a traceback in the log."""
    with pytest.raises(APIError) as exc:
        parse_completion_request({"model": "m", "prompt": "x", "logit_bias": logit_bias})
    assert (exc.value.status, exc.value.param) == (400, "logit_bias"), exc.value.message


@pytest.mark.parametrize("parse", [parse_completion_request, parse_chat_request])
def test_vllm_stop_and_min_tokens_extensions_are_parsed(parse):
    base = {"model": "m", "prompt": "x"} if parse is parse_completion_request else {
        "model": "m", "messages": [{"role": "user", "content": "x"}]}
    o = parse(base).options
    assert (o.stop_token_ids, o.include_stop_str_in_output, o.min_tokens, o.skip_special_tokens) == ([], False, 0, True)
    o = parse(base | {"stop_token_ids": [2, 0, 2], "include_stop_str_in_output": True, "min_tokens": 16,
                      "skip_special_tokens": False, "spaces_between_special_tokens": True}).options
    assert (o.stop_token_ids, o.include_stop_str_in_output, o.min_tokens, o.skip_special_tokens) == (
        [2, 0, 2], True, 16, False)
    o = parse(base | {"stop_token_ids": list(range(64)), "min_tokens": 0, "max_tokens": 1}).options
    assert len(o.stop_token_ids) == 64 and o.min_tokens == 0
    assert parse(base | {"stop_token_ids": None, "min_tokens": None}).options.stop_token_ids == []
    assert parse(base | {"max_tokens": 3, "min_tokens": 3}).options.min_tokens == 3


def test_min_tokens_is_bounded_by_the_max_tokens_the_caller_sent():
    """Completions: max_tokens defaults to 16 (OpenAI's, vLLM's); chat: unset, the context bounds it
    (checked against the prompt in completion_job.py); the error names the field that was sent."""
    with pytest.raises(APIError) as exc:
        parse_completion_request({"model": "m", "prompt": "x", "min_tokens": 17})
    assert exc.value.param == "min_tokens" and "'max_tokens' (16)" in exc.value.message
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    assert parse_chat_request(chat | {"min_tokens": 500}).options.min_tokens == 500
    with pytest.raises(APIError) as exc:
        parse_chat_request(chat | {"min_tokens": 9, "max_completion_tokens": 8})
    assert exc.value.param == "min_tokens" and "'max_completion_tokens' (8)" in exc.value.message


BAD_SAMPLING_FIELDS = [
    ({"logit_bias": [1, 2]}, "logit_bias", "must be an object", "invalid_type"),
    ({"logit_bias": "50256"}, "logit_bias", "must be an object", "invalid_type"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids", "invalid_value"),
    ({"logit_bias": {"-1": 1}}, "logit_bias", "token ids", "invalid_value"),
    ({"logit_bias": {"1.5": 1}}, "logit_bias", "token ids", "invalid_value"),
    ({"logit_bias": {" 12": 1}}, "logit_bias", "token ids", "invalid_value"),
    ({"logit_bias": {"12": 1, "012": 2}}, "logit_bias", "twice", "invalid_value"),
    ({"logit_bias": {"12": 100.5}}, "logit_bias", "[-100, 100]", "invalid_value"),
    ({"logit_bias": {"12": -101}}, "logit_bias", "[-100, 100]", "invalid_value"),
    ({"logit_bias": {"12": float("nan")}}, "logit_bias", "[-100, 100]", "invalid_value"),
    ({"logit_bias": {"12": float("inf")}}, "logit_bias", "[-100, 100]", "invalid_value"),
    ({"logit_bias": {"12": "5"}}, "logit_bias", "must be numbers", "invalid_type"),
    ({"logit_bias": {"12": True}}, "logit_bias", "must be numbers", "invalid_type"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "at most 1024", "invalid_value"),
    ({"min_p": 1.5}, "min_p", "'min_p' must be in [0.0, 1.0]", "invalid_value"),
    ({"min_p": -0.1}, "min_p", "'min_p' must be in", "invalid_value"),
    ({"min_p": "0.1"}, "min_p", "'min_p' must be a number", "invalid_type"),
    ({"stop_token_ids": 5}, "stop_token_ids", "must be a list of token ids", "invalid_type"),
    ({"stop_token_ids": [1, "2"]}, "stop_token_ids", "must be a list of token ids", "invalid_type"),
    ({"stop_token_ids": [True]}, "stop_token_ids", "must be a list of token ids", "invalid_type"),
    ({"stop_token_ids": [1.0]}, "stop_token_ids", "must be a list of token ids", "invalid_type"),
    ({"stop_token_ids": [3, -1]}, "stop_token_ids", ">= 0", "invalid_value"),
    ({"stop_token_ids": list(range(65))}, "stop_token_ids", "at most 64", "invalid_value"),
    ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output", "true or false", "invalid_type"),
    ({"min_tokens": -1}, "min_tokens", "'min_tokens' must be >= 0", "invalid_value"),
    ({"min_tokens": 2.5}, "min_tokens", "must be an integer", "invalid_type"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens", "'min_tokens' (5) must not exceed 'max_tokens' (4)",
     "invalid_value"),
    ({"skip_special_tokens": 0}, "skip_special_tokens", "true or false", "invalid_type"),
    ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens", "not supported",
     "unsupported_parameter"),
]


@pytest.mark.parametrize("parse", [parse_completion_request, parse_chat_request])
@pytest.mark.parametrize(("extra", "param", "needle", "code"), BAD_SAMPLING_FIELDS)
def test_bad_logit_bias_or_min_p_is_400_naming_the_field(parse, extra, param, needle, code):
    base = {"model": "m", "prompt": "x"} if parse is parse_completion_request else {
        "model": "m", "messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(APIError) as exc:
        parse(base | extra)
    err = exc.value
    assert (err.status, err.param, err.code) == (400, param, code) and needle in err.message


BAD_CHATS = [
    ({"model": "m"}, "'messages'"),
    ({"model": "m", "messages": []}, "non-empty"),
    ({"model": "m", "messages": ["hi"]}, "messages[0] must be an object"),
    ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "'content' must be"),
    ({"model": "m", "messages": [{"role": "user"}]}, "a user message needs 'content'"),  # a misspelt "contents"
    ({"model": "m", "messages": [{"role": "system", "content": None}]}, "a system message needs 'content'"),
    ({"model": "m", "messages": [{"role": "tool", "tool_call_id": "c"}]}, "a tool message needs 'content'"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "text"}]}]}, "a text part needs 'text', a string"),
    ({"model": "m", "messages": [{"role": "assistant", "content": [{"type": "refusal", "text": "no"}]}]},
     "a refusal part needs 'refusal', a string"),
    ({"model": "m", "messages": [{"role": "assistant", "content": None, "refusal": 5}]}, "messages[0].refusal must be"),
    ({"model": "m", "messages": [{"role": "tool", "content": "x", "tool_call_id": 5}]},
     "messages[0].tool_call_id must be a string"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "documents": [{"text": "d"}]},
     "Unrecognized request argument supplied: documents"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "needs 'logprobs'"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     "tools[0] must be an object like"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "echo": True}, "chat's echo"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 21}, "'prompt_logprobs'"),
]


def test_an_assistant_s_refusal_in_the_history_is_its_text():
    """OpenAI's history gives a refused turn as `refusal` beside a null content, or as a refusal content part;
    both are what the assistant said (its turn was rendered empty)."""
    for turn in ({"role": "assistant", "content": None, "refusal": "I cannot help"},
                 {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot help"}]}):
        request = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "a"}, turn,
                                                                 {"role": "user", "content": "ok"}]})
        assert [m.content for m in request.messages] == ["a", "I cannot help", "ok"]


@pytest.mark.parametrize(("body", "needle"), BAD_CHATS)
def test_bad_chat_bodies_are_400(body, needle):
    with pytest.raises(APIError) as exc:
        parse_chat_request(body)
    assert exc.value.status == 400 and needle in exc.value.message


def test_malformed_json_is_400():
    with pytest.raises(APIError) as exc:
        parse_json(b"{not json")
    assert exc.value.status == 400 and exc.value.code == "invalid_json"
    with pytest.raises(APIError):
        parse_json(b"\xff\xfe")


def test_vllm_adapter_admin_bodies():
    assert parse_load_adapter_request({"lora_name": "a", "lora_path": "/p"}) == ("a", "/p", False)
    assert parse_load_adapter_request({"lora_name": "a", "lora_path": "/p", "load_inplace": True}) == ("a", "/p", True)
    assert parse_unload_adapter_request({"lora_name": "a", "lora_int_id": 3}) == "a"
    for bad in [{"lora_name": "a"}, {"lora_name": "", "lora_path": "/p"}, {"lora_name": "a", "lora_path": "/p", "x": 1}]:
        with pytest.raises(APIError):
            parse_load_adapter_request(bad)


def test_deeply_nested_json_is_400_not_a_crash():
    for raw in (b"[" * 50000 + b"]" * 50000, '{"a":' * 50000 + "1" + "}" * 50000):
        with pytest.raises(APIError) as exc:
            parse_json(raw)
        assert exc.value.status == 400 and exc.value.code == "invalid_json" and "nested too deeply" in exc.value.message


@pytest.mark.parametrize("name", ["a b", "sql\u00e9", "-leading-dash", "a@v1", "a/b", "tab\tname", "x" * 254])
def test_load_adapter_names_follow_the_directive_schema(name):
    """A name the state report cannot carry would make GET /admin/v1/state fail later."""
    with pytest.raises(APIError) as exc:
        parse_load_adapter_request({"lora_name": name, "lora_path": "/p"})
    assert exc.value.status == 400 and exc.value.param == "lora_name"
    assert "letters, digits, '.', '_' or '-'" in exc.value.message
    assert parse_load_adapter_request({"lora_name": "sql-v1.2_b", "lora_path": "/p"}) == ("sql-v1.2_b", "/p", False)


def test_chat_text_parts_are_joined_by_newlines_as_vllm_does():
    """vLLM renders a content list of text parts as the parts joined by "\\n": the same request must not
    become another prompt here (joined without a separator, "Translate:bonjour" tokenizes differently)."""
    parts = [{"type": "text", "text": "Translate:"}, {"type": "text", "text": "bonjour"}]
    r = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": parts}]})
    assert r.messages[0].content == "Translate:\nbonjour"


def test_chat_history_with_a_legacy_function_call_is_refused_not_dropped():
    """The legacy `function_call` of an assistant turn would be rendered without the call (a different prompt
    than the caller sent), so it is refused; an empty `tool_calls` (what a response without calls carries back
    into the history) is accepted. Tool calls themselves: tests/worker/test_tool_request.py."""
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "function_call": {"name": "lookup", "arguments": "{}"}}]
    with pytest.raises(APIError) as exc:
        parse_chat_request({"model": "m", "messages": messages})
    err = exc.value
    assert (err.status, err.param, err.code) == (400, "messages", "unsupported_parameter")
    assert "messages[1].function_call" in err.message and "send 'tool_calls'" in err.message
    empty = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok", "tool_calls": [],
                                                  "function_call": None}]
    assert [m.content for m in parse_chat_request({"model": "m", "messages": empty}).messages] == ["hi", "ok"]


def test_a_chat_of_empty_messages_is_accepted_as_vllm_does():
    """The rendered prompt holds the template's own text; a prompt that is really empty is the engine's to refuse."""
    r = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": ""},
                                                       {"role": "assistant", "content": None}]})
    assert [m.content for m in r.messages] == ["", ""]


def test_message_fields_the_template_sees():
    """Role and content, and name and tool_call_id where sent (an empty name too, as transformers passes it)."""
    messages = [{"role": "user", "content": "hi", "name": ""},
                {"role": "tool", "content": "42", "tool_call_id": "call_1", "name": None}]
    r = parse_chat_request({"model": "m", "messages": messages})
    assert r.template_messages() == [{"role": "user", "content": "hi", "name": ""},
                                     {"role": "tool", "content": "42", "tool_call_id": "call_1"}]


def test_vllm_chat_template_fields_are_taken_with_vllms_meaning():
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    assert parse_chat_request(body).template == ChatTemplateOptions(True, False, {}, False)
    t = parse_chat_request(body | {"add_generation_prompt": False, "add_special_tokens": True,
                                   "chat_template_kwargs": {"enable_thinking": False, "n": [{"a": "é"}]}}).template
    assert t == ChatTemplateOptions(False, False, {"enable_thinking": False, "n": [{"a": "é"}]}, True)
    for extra in ({"continue_final_message": True}, {"continue_final_message": True, "add_generation_prompt": False}):
        t = parse_chat_request(body | extra).template  # unset, add_generation_prompt gives way
        assert (t.add_generation_prompt, t.continue_final_message) == (False, True)


@pytest.mark.parametrize(("extra", "param", "needle"), [
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message", "cannot both be true"),
    ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs", "must be an object"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "must not set messages"),
    ({"chat_template_kwargs": {"add_generation_prompt": False, "bos_token": ""}}, "chat_template_kwargs",
     "must not set add_generation_prompt, bos_token"),
    ({"chat_template_kwargs": {"raise_exception": 1, "tokenize": True}}, "chat_template_kwargs",
     "must not set raise_exception, tokenize"),
    ({"chat_template_kwargs": {"x": "\ud800"}}, "chat_template_kwargs", "not valid Unicode"),
    ({"chat_template_kwargs": {"x": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["deep"]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}},
     "chat_template_kwargs", "nested deeper than 32"),
    ({"add_special_tokens": "yes"}, "add_special_tokens", "must be true or false"),
])
def test_bad_chat_template_fields_are_400_naming_them(extra, param, needle):
    with pytest.raises(APIError) as exc:
        parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}], **extra})
    assert (exc.value.status, exc.value.param) == (400, param) and needle in exc.value.message

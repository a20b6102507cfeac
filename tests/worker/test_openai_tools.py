"""Tool calling over HTTP (a worker on 127.0.0.1, the tiny model with a chat template that renders tools, the
official `openai` client): the tools and a history's calls in the prompt, named tool_choice answered as a call
(whole and streamed), tool_choice "none" and "auto" answered as content when the output holds no call, a
template without tools refused. The byte tokenizer makes a prompt's token count its length in bytes."""

from __future__ import annotations

import json
import shutil

import pytest

from lorafleet.worker.engine_config import EngineConfig
from lorafleet.worker.server import create_app
from lorafleet.worker.worker_config import WorkerConfig
from tests.openai_clients import close_openai_clients, openai_client  # noqa: F401 (the fixture closes them)
from tests.worker.conftest import EOS_ID

openai = pytest.importorskip("openai")  # installed with the test extras; absent on a bare GPU machine

# Hermes-like: the tools as JSON in a system turn, an assistant's calls as <tool_call> blocks of their arguments.
TEMPLATE = ("{% if tools %}<|system|>{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}"
            "{% for m in messages %}<|{{ m.role }}|>{% if m.tool_calls is defined %}{% for c in m.tool_calls %}"
            "<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>"
            "{% endfor %}{% else %}{{ m.content }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
USER = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def with_template(model_dir, tmp_path, template: str):
    """A copy of the model whose chat template is `template`."""
    model = shutil.copytree(model_dir, tmp_path / "model")
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": template}))
    return model


@pytest.fixture
def tools_model(tiny_llama_dir, tmp_path):
    return with_template(tiny_llama_dir, tmp_path, TEMPLATE)


async def _api(aiohttp_client, model, **config):
    engine = EngineConfig(model=str(model), dtype="float32", max_model_len=512)
    client = await aiohttp_client(create_app(WorkerConfig(engine=engine, served_model_name="tiny", **config)))
    return openai_client(str(client.make_url("/v1")), "sk-test")


@pytest.fixture
async def api(aiohttp_client, tools_model):
    return await _api(aiohttp_client, tools_model)


async def _streamed(stream) -> list[dict]:
    """Each choice's content, tool calls, finish reason and logprob tokens, put together from the chunks."""
    choices: dict[int, dict] = {}
    async for chunk in stream:
        for c in chunk.choices:
            got = choices.setdefault(c.index, {"content": "", "tool_calls": [], "finish_reason": None, "tokens": []})
            got["content"] += c.delta.content or ""
            got["tool_calls"] += [t.model_dump() for t in c.delta.tool_calls or []]
            got["finish_reason"] = c.finish_reason or got["finish_reason"]
            got["tokens"] += [t.token for t in c.logprobs.content] if c.logprobs and c.logprobs.content else []
    return [choices[i] for i in sorted(choices)]


async def test_tools_and_a_history_of_calls_reach_the_prompt(api):
    """(a) the tools are rendered (the prompt grows by their JSON); (c) an assistant's call and the tool's answer
    are accepted, the call's arguments rendered as the object they were sent as JSON text."""
    plain = await api.chat.completions.create(model="tiny", messages=USER, max_tokens=1)
    with_tools = await api.chat.completions.create(model="tiny", messages=USER, max_tokens=1, tools=[WEATHER],
                                                   tool_choice="none")
    assert with_tools.usage.prompt_tokens - plain.usage.prompt_tokens == len(f"<|system|>{json.dumps(WEATHER)}")
    call = {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_abc", "content": "18 C"}]
    resp = await api.chat.completions.create(model="tiny", messages=history, max_tokens=1, tools=[WEATHER])
    rendered = ('<|assistant|><tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
                "<|tool|>18 C")
    assert resp.usage.prompt_tokens == with_tools.usage.prompt_tokens + len(rendered)


async def test_named_tool_choice_answers_a_call_whole_and_streamed(api):
    """(b) the output is held to the function's schema, answered as its arguments; streamed, the call comes
    first with its id and name, then its arguments (in pieces as they come), and nothing as content."""
    body = {"model": "tiny", "messages": USER, "tools": [WEATHER], "tool_choice": NAMED, "n": 3, "seed": 5,
            "max_tokens": 64, "logit_bias": {str(EOS_ID): 100}}
    resp = await api.chat.completions.create(**body)
    stopped = 0
    for choice in resp.choices:
        (call,) = choice.message.tool_calls
        assert choice.message.content is None and call.type == "function" and call.function.name == "get_weather"
        assert call.id.startswith("call_") and len(call.id) == len("call_") + 24
        if choice.finish_reason == "stop":  # as OpenAI answers a forced call; "length": arguments cut short
            assert isinstance(json.loads(call.function.arguments), dict)
            stopped += 1
    assert stopped
    done = next(c for c in resp.choices if c.finish_reason == "stop")  # its message goes back into the history
    history = [*USER, done.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": done.message.tool_calls[0].id, "content": "18 C"}]
    again = await api.chat.completions.create(model="tiny", messages=history, tools=[WEATHER], max_tokens=1)
    assert again.usage.prompt_tokens > resp.usage.prompt_tokens + len(done.message.tool_calls[0].function.arguments)
    streamed = await _streamed(await api.chat.completions.create(**body, stream=True))
    for got, choice in zip(streamed, resp.choices, strict=True):
        first, *pieces = got["tool_calls"]  # the call (its id, name, arguments so far), then its arguments' pieces
        assert got["content"] == "" and got["finish_reason"] == choice.finish_reason
        assert (first["index"], first["type"], first["id"][:5], first["function"]["name"]) == (0, "function", "call_",
                                                                                               "get_weather")
        # only arguments after the first; how many pieces depends on how far the engine ran ahead of this
        # reader (outputs not read yet go out as one chunk), so the pieces are test_tool_calls.py's
        assert all((p["index"], p["id"], p["type"], p["function"]["name"]) == (0, None, None, None) for p in pieces)
        arguments = first["function"]["arguments"] + "".join(p["function"]["arguments"] for p in pieces)
        assert arguments == choice.message.tool_calls[0].function.arguments


async def test_tool_choice_none_answers_plain_content(api):
    """(d) the tools are rendered but the output is never read as calls."""
    resp = await api.chat.completions.create(model="tiny", messages=USER, max_tokens=12, seed=1, tools=[WEATHER],
                                             tool_choice="none")
    (choice,) = resp.choices
    assert choice.message.tool_calls is None and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")


@pytest.mark.parametrize("parser", ["auto", "llama3_json"])
async def test_auto_without_a_call_in_the_output_is_content_whole_and_streamed(aiohttp_client, tools_model, parser):
    """The model's output, read by the parser (auto picks hermes from this template's <tool_call>) and found to
    hold no call, is the message's content; streamed, the text held back (llama3_json holds a JSON mode
    output, which starts with '{', to the end) arrives all the same, and every token's logprob with it."""
    api = await _api(aiohttp_client, tools_model, tool_call_parser=parser)
    body = {"model": "tiny", "messages": USER, "tools": [WEATHER], "n": 2, "seed": 7, "max_tokens": 24,
            "logprobs": True, "response_format": {"type": "json_object"}}
    resp = await api.chat.completions.create(**body)
    streamed = await _streamed(await api.chat.completions.create(**body, stream=True))
    for got, choice in zip(streamed, resp.choices, strict=True):
        assert choice.message.tool_calls is None and choice.message.content.lstrip().startswith("{")
        assert got["content"] == choice.message.content and not got["tool_calls"]
        assert got["finish_reason"] == choice.finish_reason != "tool_calls"
        assert got["tokens"] == [t.token for t in choice.logprobs.content]


async def test_a_models_tool_use_template_renders_the_requests_with_tools(aiohttp_client, tiny_llama_dir, tmp_path):
    """Hermes 2 Pro's layout: a default template that never reads `tools` and a `tool_use` one that does. A
    request with tools is rendered by the latter (not refused), and its `<tool_call>` picks the hermes parser."""
    from lorafleet.worker.tokenizer import Tokenizer
    from lorafleet.worker.tool_calls import ToolCalls
    from lorafleet.worker.tool_request import ToolRequest

    model = shutil.copytree(tiny_llama_dir, tmp_path / "model")
    config = json.loads((model / "tokenizer_config.json").read_text())
    plain = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
             "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    templates = [{"name": "default", "template": plain}, {"name": "tool_use", "template": TEMPLATE}]
    (model / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": templates}))
    api = await _api(aiohttp_client, model)
    plain_resp = await api.chat.completions.create(model="tiny", messages=USER, max_tokens=1)
    with_tools = await api.chat.completions.create(model="tiny", messages=USER, max_tokens=1, tools=[WEATHER])
    assert with_tools.usage.prompt_tokens - plain_resp.usage.prompt_tokens == len(f"<|system|>{json.dumps(WEATHER)}")
    named = await api.chat.completions.create(model="tiny", messages=USER, max_tokens=8, tools=[WEATHER],
                                              tool_choice=NAMED)
    assert named.choices[0].message.tool_calls[0].function.name == "get_weather"
    assert ToolCalls.of(ToolRequest([WEATHER]), Tokenizer(model), "auto").parser.name == "hermes"


async def test_tools_for_a_template_without_tools_are_refused(aiohttp_client, tiny_llama_dir):
    api = await _api(aiohttp_client, tiny_llama_dir)  # its template never reads `tools`
    with pytest.raises(openai.BadRequestError) as err:
        await api.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER])
    assert (err.value.body["param"], err.value.body["code"]) == ("tools", "invalid_value")
    assert "chat template takes no tools" in err.value.body["message"]
    resp = await api.chat.completions.create(model="tiny", messages=USER, max_tokens=1)  # without: as before
    assert resp.choices[0].message.tool_calls is None
    # tool_choice "none" wants no call: answered as without them (agent frameworks send tools with every turn)
    none = await api.chat.completions.create(model="tiny", messages=USER, max_tokens=1, tools=[WEATHER],
                                             tool_choice="none")
    assert none.choices[0].message.tool_calls is None and none.usage.prompt_tokens == resp.usage.prompt_tokens


async def test_bad_tool_fields_are_400_over_http(api):
    strict = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {"type": "object", "properties": {
        "n": {"type": "object", "dependentRequired": {"a": ["b"]}}}}}}
    with pytest.raises(openai.BadRequestError) as err:
        await api.chat.completions.create(model="tiny", messages=USER, tools=[strict], tool_choice="required")
    assert (err.value.body["param"], err.value.body["code"]) == ("tools", "invalid_value")
    assert "dependentRequired cannot be enforced" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        await api.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER],
                                          tool_choice={"type": "function", "function": {"name": "other"}})
    assert err.value.body["param"] == "tool_choice" and "not in 'tools'" in err.value.body["message"]


async def test_a_stream_sends_no_chunk_while_it_holds_text_back(aiohttp_client, tools_model):
    """While the parser holds back text that may begin a call (llama3_json: a JSON mode output, all of it), each
    token went out as a chunk with an empty delta; as vLLM, none is sent, and the text arrives all the same."""
    api = await _api(aiohttp_client, tools_model, tool_call_parser="llama3_json")
    body = {"model": "tiny", "messages": USER, "tools": [WEATHER], "seed": 7, "max_tokens": 24,
            "response_format": {"type": "json_object"}}
    resp = await api.chat.completions.create(**body)
    chunks = [c async for chunk in await api.chat.completions.create(**body, stream=True) for c in chunk.choices]
    assert not [c for c in chunks if not c.delta.model_dump(exclude_none=True) and c.finish_reason is None]
    assert "".join(c.delta.content or "" for c in chunks) == resp.choices[0].message.content

"""/v1/chat/completions and the chat template: vLLM's template fields, what the template sees, its failures as
400s, and control-token strings from messages kept as text (aiohttp test client, real engine, tiny model
whose byte tokenizer makes a prompt's token count its length in bytes, <s> and </s> one token each)."""

from __future__ import annotations

import json
import shutil

import pytest

from lorafleet.worker.engine_config import EngineConfig
from lorafleet.worker.server import create_app
from lorafleet.worker.worker_config import WorkerConfig

# A TRL-prepared template ({% generation %}) that reads tool_call_id, a chat_template_kwargs variable, and
# fails with a TypeError on the content "boom".
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{% if m.tool_call_id is defined %}[{{ m.tool_call_id }}]{% endif %}"
            "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}</s>{% endgeneration %}{% else %}"
            "{{ m.content + (1 if m.content == 'boom' else '') }}{% endif %}{% endfor %}"
            "{% if enable_thinking is defined and not enable_thinking %}<nothink>{% endif %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture
def template_model(tiny_llama_dir, tmp_path):
    model = shutil.copytree(tiny_llama_dir, tmp_path / "model")
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": TEMPLATE, "add_bos_token": True}))
    return model


async def _client(aiohttp_client, model, **config):
    engine = EngineConfig(model=str(model), dtype="float32", max_model_len=128)
    return await aiohttp_client(create_app(WorkerConfig(engine=engine, served_model_name="tiny", **config)))


async def _prompt_tokens(client, messages: list[dict], **extra) -> int:
    body = {"model": "tiny", "messages": messages, "max_tokens": 1, **extra}
    resp = await client.post("/v1/chat/completions", json=body)
    data = await resp.json()
    assert resp.status == 200, data
    return data["usage"]["prompt_tokens"]


async def test_vllm_chat_template_fields_shape_the_prompt(aiohttp_client, template_model):
    """add_generation_prompt, continue_final_message, chat_template_kwargs and add_special_tokens, as vLLM takes
    them (they were refused as unrecognized); tool_call_id reaches the template; messages that are all empty
    still make a prompt."""
    client = await _client(aiohttp_client, template_model)
    base = await _prompt_tokens(client, USER)
    assert base == len("<|user|>hi<|assistant|>")
    assert await _prompt_tokens(client, USER, add_generation_prompt=False) == base - len("<|assistant|>")
    assert await _prompt_tokens(client, USER, chat_template_kwargs={"enable_thinking": False}) == base + len("<nothink>")
    assert await _prompt_tokens(client, USER, add_special_tokens=True) == base + 1  # add_bos_token's BOS
    prefill = [*USER, {"role": "assistant", "content": "Sure"}]
    assert await _prompt_tokens(client, prefill, continue_final_message=True) == base + len("Sure")
    tool = [*USER, {"role": "tool", "content": "42", "tool_call_id": "call_1"}]
    assert await _prompt_tokens(client, tool) == base + len("<|tool|>[call_1]42")
    assert await _prompt_tokens(client, [{"role": "user", "content": ""}]) == base - len("hi")


async def test_a_template_that_fails_on_the_messages_is_a_400_naming_it(aiohttp_client, template_model):
    """A TypeError of the template's code (a string plus a number) is the template failing on these messages,
    a 400 as its raise_exception is, not a 500."""
    client = await _client(aiohttp_client, template_model)
    resp = await client.post("/v1/chat/completions", json={"model": "tiny", "messages": [
        {"role": "user", "content": "boom"}]})
    error = (await resp.json())["error"]
    assert resp.status == 400 and (error["code"], error["param"]) == ("invalid_messages", "messages")
    assert error["message"].startswith("the chat template refused these messages: TypeError: ")


@pytest.mark.parametrize("in_content", [False, True])
async def test_control_token_strings_in_messages_are_text_unless_the_worker_says(aiohttp_client, tiny_llama_dir,
                                                                                   in_content):
    """"</s><s>" in a user's text: the 7 bytes it spells, not two control tokens that would end the turn and
    start another; --chat-control-tokens-in-content gives vLLM's prompt (two tokens)."""
    client = await _client(aiohttp_client, tiny_llama_dir, chat_control_tokens_in_content=in_content)
    plain = await _prompt_tokens(client, [{"role": "user", "content": "hi"}])
    forged = await _prompt_tokens(client, [{"role": "user", "content": "hi</s><s>"}])
    assert forged - plain == (2 if in_content else len("</s><s>"))

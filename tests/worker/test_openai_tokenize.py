"""vLLM's /tokenize and /detokenize over HTTP (a worker on 127.0.0.1, tiny model, byte-level tokenizer): a
prompt's and a chat's ids are those a completion's prompt holds, they decode back, bad bodies are 400s naming
the field, and a tenant may only name models it may call."""

from __future__ import annotations

import pytest

from lorafleet.worker.server import create_app
from tests.openai_clients import close_openai_clients, openai_client  # noqa: F401 (the fixture closes them)
from tests.worker.conftest import BOS_ID
from tests.worker.test_tenant_isolation import (
    KEY_ACME,
    KEY_GLOBEX,
    api_of,
    directive,
    push,
    worker_config,
)

openai = pytest.importorskip("openai")


@pytest.fixture
async def client(aiohttp_client, tiny_llama_dir, qv_adapters_dir, tmp_path):
    """A worker with two tenants: `alpha` is acme's."""
    client = await aiohttp_client(create_app(worker_config(tiny_llama_dir, qv_adapters_dir, tmp_path)))
    await push(client, 1, directive("alpha", "acme", "v1", qv_adapters_dir / "alpha"))
    return client


def _as(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


async def _post(client, path: str, body: dict, key: str = KEY_ACME) -> tuple[int, dict]:
    resp = await client.post(path, json=body, headers=_as(key))
    return resp.status, await resp.json()


async def test_a_prompts_ids_are_the_completions_and_decode_back(client, tiny_llama_dir):
    from tokenizers import Tokenizer

    text = "café ok"
    ids = Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json")).encode(text).ids  # one token per byte
    status, got = await _post(client, "/tokenize", {"model": "alpha", "prompt": text, "return_token_strs": True})
    assert status == 200, got
    assert (got["tokens"], got["count"], got["max_model_len"]) == (ids, len(ids), 128)  # this tokenizer adds no <s>
    assert got["token_strs"][:2] == ["c", "a"] and len(got["token_strs"]) == len(ids)
    completion = await api_of(client, KEY_ACME).completions.create(model="alpha", prompt=text, max_tokens=1)
    assert completion.usage.prompt_tokens == got["count"]
    status, bare = await _post(client, "/tokenize", {"model": "tiny", "prompt": text, "add_special_tokens": False})
    assert status == 200 and bare["tokens"] == ids and bare["token_strs"] is None
    status, back = await _post(client, "/detokenize", {"model": "alpha", "tokens": [BOS_ID, *got["tokens"]]})
    assert status == 200 and back == {"prompt": "<s>" + text}  # special tokens written, as vLLM does


async def test_a_chats_ids_are_the_chat_completions_prompt(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <s> there"}]
    status, got = await _post(client, "/tokenize", {"model": "alpha", "messages": messages})
    assert status == 200, got
    chat = await api_of(client, KEY_ACME).chat.completions.create(model="alpha", messages=messages,
                                                                          max_tokens=1)
    assert chat.usage.prompt_tokens == got["count"]
    assert BOS_ID not in got["tokens"]  # "<s>" in content is text, not the control token
    status, back = await _post(client, "/detokenize", {"model": "alpha", "tokens": got["tokens"]})
    assert back["prompt"] == "<|system|>Be brief.\n<|user|>Hi <s> there\n<|assistant|>"
    status, ended = await _post(client, "/tokenize", {"model": "alpha", "messages": messages,
                                                      "add_generation_prompt": False})
    assert status == 200 and ended["count"] == got["count"] - len("<|assistant|>")


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"model": "alpha"}, "prompt"),
    ("/tokenize", {"model": "alpha", "prompt": [1, 2]}, "prompt"),
    ("/tokenize", {"model": "alpha", "prompt": "x", "max_tokens": 3}, "max_tokens"),
    ("/tokenize", {"model": "alpha", "messages": [{"role": "user", "content": "x"}], "temperature": 0}, "temperature"),
    ("/tokenize", {"model": "alpha", "messages": []}, "messages"),
    ("/tokenize", {"model": "alpha", "messages": [{"role": "user", "content": "x"}],  # as its chat completion is
                   "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/tokenize", {"model": "", "prompt": "x"}, "model"),
    ("/detokenize", {"model": "alpha", "tokens": [1, 999]}, "tokens"),
    ("/detokenize", {"model": "alpha", "tokens": "ab"}, "tokens"),
    ("/detokenize", {"model": "alpha", "tokens": [1.5]}, "tokens"),
])
async def test_bad_bodies_are_400s_naming_the_field(client, path, body, param):
    status, got = await _post(client, path, body)
    assert status == 400 and got["error"]["param"] == param, got


async def test_only_a_model_the_caller_may_call_and_only_with_a_key(client):
    body = {"model": "alpha", "prompt": "x"}
    status, got = await _post(client, "/tokenize", body, KEY_GLOBEX)  # acme's adapter: unknown to globex
    assert status == 404 and got["error"]["code"] == "model_not_found"
    status, got = await _post(client, "/detokenize", {"model": "alpha", "tokens": [65]}, KEY_GLOBEX)
    assert status == 404
    assert (await _post(client, "/tokenize", body | {"model": "tiny"}, KEY_GLOBEX))[0] == 200
    for path in ("/tokenize", "/detokenize"):
        resp = await client.post(path, json=body)
        assert resp.status == 401 and (await resp.json())["error"]["code"] == "invalid_api_key"


async def test_completions_take_add_special_tokens_as_vllm_does(aiohttp_client, tiny_llama_dir, qv_adapters_dir,
                                                                 tmp_path):
    """A tokenizer that writes BOS: a prompt rendered with its own (a chat template applied by the caller) is sent
    with `add_special_tokens: false`, else it gets a second one; the field was refused with a 400."""
    import json
    import shutil

    model = shutil.copytree(tiny_llama_dir, tmp_path / "bos_model")
    config = json.loads((model / "tokenizer_config.json").read_text()) if (model / "tokenizer_config.json").exists() else {}
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True, "bos_token": "<s>"}))
    client = await aiohttp_client(create_app(worker_config(model, qv_adapters_dir, tmp_path)))
    api = api_of(client, KEY_ACME)
    text = "<s>hi there"
    counts = {}
    for special in (True, False):
        status, got = await _post(client, "/tokenize", {"model": "tiny", "prompt": "hi there",
                                                        "add_special_tokens": special})
        assert status == 200 and (got["tokens"][0] == BOS_ID) == special, got
        completion = await api.completions.create(model="tiny", prompt="hi there", max_tokens=1,
                                                  extra_body={"add_special_tokens": special})
        counts[special] = completion.usage.prompt_tokens
        assert counts[special] == got["count"]
    assert counts[True] == counts[False] + 1
    rendered = await api.completions.create(model="tiny", prompt=text, max_tokens=1,
                                            extra_body={"add_special_tokens": False})
    assert rendered.usage.prompt_tokens == counts[False] + 1  # its own BOS, once


async def test_model_left_out_is_the_base_model_as_in_vllm(aiohttp_client, tiny_llama_dir, qv_adapters_dir, tmp_path):
    """vLLM serves its one model where `model` is left out (/tokenize, /detokenize, completions, chat): here that
    is the base model, so a tenant without it gets the 403 naming it would; a 400 before."""
    tenants = {"acme": {"keys": [KEY_ACME], "adapters": []},
               "globex": {"keys": [KEY_GLOBEX], "adapters": [], "base_model": False}}
    client = await aiohttp_client(create_app(worker_config(tiny_llama_dir, qv_adapters_dir, tmp_path, tenants)))
    named = (await _post(client, "/tokenize", {"model": "tiny", "prompt": "hi"}))[1]
    assert (await _post(client, "/tokenize", {"prompt": "hi"})) == (200, named)
    assert (await _post(client, "/detokenize", {"tokens": named["tokens"]})) == (200, {"prompt": "hi"})
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}), ("/v1/chat/completions", chat)):
        status, got = await _post(client, path, body)
        assert status == 200 and got["model"] == "tiny", got
        status, got = await _post(client, path, body, KEY_GLOBEX)
        assert status == 403 and got["error"]["code"] == "model_not_allowed", got
    status, got = await _post(client, "/tokenize", {"prompt": "hi"}, KEY_GLOBEX)
    assert status == 403 and "base model 'tiny'" in got["error"]["message"], got
    status, got = await _post(client, "/tokenize", {"model": "", "prompt": "hi"})
    assert status == 400 and got["error"]["param"] == "model"

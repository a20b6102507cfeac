"""Bad input over HTTP (a worker on 127.0.0.1, tiny model): text that is not valid Unicode and adapter
paths no file system takes get a 400 naming the field, not a 500; a source whose tokenizer file links
out of the adapter roots is refused like any other link out of them, and one the worker cannot read (a
symlink loop, a folder it may not list) is a 4xx naming the file."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from lorafleet.worker.engine_config import EngineConfig
from lorafleet.worker.server import create_app
from lorafleet.worker.worker_config import WorkerConfig

ADMIN = {"Authorization": "Bearer admin-token-for-tests"}
LONE = "\ud800"  # JSON may escape it ("\ud800"); no tokenizer, hash or file system can encode it


@pytest.fixture
async def client(aiohttp_client, tiny_llama_dir, qv_adapters_dir):
    """A development-mode worker serving `alpha` with a canary at 50 % (the `user` picks the version)."""
    config = WorkerConfig(engine=EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=128),
                          served_model_name="tiny", admin_token="admin-token-for-tests",
                          adapter_roots=str(qv_adapters_dir))
    client = await aiohttp_client(create_app(config))
    push = {"generation": 1, "adapters": [{
        "name": "alpha", "tenant": "acme", "stable": {"version": "v1", "uri": str(qv_adapters_dir / "alpha")},
        "canary": {"version": "v2", "uri": str(qv_adapters_dir / "beta")}, "canary_weight": 50}]}
    resp = await client.put("/admin/v1/state", json=push, headers=ADMIN)
    assert resp.status == 200, await resp.text()
    return client


COMPLETION = {"model": "alpha", "prompt": "hi", "max_tokens": 2}
CHAT = {"model": "alpha", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
UNPAIRED = [
    ("prompt", "/v1/completions", COMPLETION | {"prompt": f"a{LONE}b"}, "prompt"),
    ("prompt list", "/v1/completions", COMPLETION | {"prompt": ["ok", LONE]}, "prompt"),
    ("user, canary split", "/v1/completions", COMPLETION | {"user": f"u{LONE}"}, "user"),
    ("stop", "/v1/completions", COMPLETION | {"stop": [LONE]}, "stop"),
    ("model", "/v1/completions", COMPLETION | {"model": f"alpha{LONE}"}, "model"),
    ("chat content", "/v1/chat/completions", CHAT | {"messages": [{"role": "user", "content": LONE}]}, "messages"),
    ("chat text part", "/v1/chat/completions",
     CHAT | {"messages": [{"role": "user", "content": [{"type": "text", "text": f"x{LONE}"}]}]}, "messages"),
    ("chat name", "/v1/chat/completions", CHAT | {"messages": [{"role": "user", "content": "hi", "name": LONE}]},
     "messages"),
]

SMILE = "\U0001F600"  # beyond the BMP: a surrogate pair when JSON-escaped, 4 bytes in UTF-8
GOOD = {"/v1/completions": COMPLETION | {"prompt": f"{SMILE} caf\u00e9", "user": SMILE, "stop": [SMILE]},
        "/v1/chat/completions": CHAT | {"messages": [{"role": "user", "content": SMILE}], "user": SMILE}}


@pytest.mark.parametrize(("path", "body", "param"), [c[1:] for c in UNPAIRED], ids=[c[0] for c in UNPAIRED])
async def test_unpaired_surrogates_are_a_400_naming_the_field(client, path, body, param):
    resp = await client.post(path, json=body)  # json.dumps escapes the surrogate: valid JSON, invalid text
    err = (await resp.json())["error"]
    assert resp.status == 400 and err["code"] == "invalid_unicode" and err["param"] == param, err
    for ensure_ascii in (True, False):
        ok = await client.post(path, data=json.dumps(GOOD[path], ensure_ascii=ensure_ascii).encode(),
                               headers={"Content-Type": "application/json"})
        assert ok.status == 200, await ok.text()


@pytest.mark.parametrize("bad", ["\x00", LONE], ids=["nul", "surrogate"])
async def test_admin_adapter_paths_no_file_system_takes_are_a_400(client, qv_adapters_dir, bad):
    path = f"{qv_adapters_dir / 'alpha'}{bad}"
    resp = await client.post("/v1/load_lora_adapter", json={"lora_name": "smuggled", "lora_path": path}, headers=ADMIN)
    assert resp.status == 400, await resp.text()
    for uri in (path, f"file://{path}"):
        push = {"generation": 2, "adapters": [{"name": "smuggled", "tenant": "acme",
                                               "stable": {"version": "v1", "uri": uri}}]}
        resp = await client.put("/admin/v1/state", json=push, headers=ADMIN)
        body = await resp.json()
        # A control character is refused with the directive itself (it would forge a line in the logs).
        assert resp.status == 400 and body["error"]["code"] == "invalid_directive", body
        assert "control characters" in body["error"]["message"], body
    state = await (await client.get("/admin/v1/state", headers=ADMIN)).json()
    assert state["generation_applied"] == 1 and {a["name"] for a in state["adapters"]} == {"alpha"}


async def test_a_tokenizer_file_linked_out_of_the_adapter_roots_is_refused(client, tiny_llama_dir, qv_adapters_dir,
                                                                           tmp_path, request):
    """The loader reads tokenizer files beside the adapter; one that is a symlink out of the roots
    would make the worker read a file no configured location holds."""
    outside = tmp_path / "outside-tokenizer.json"
    shutil.copy(tiny_llama_dir / "tokenizer.json", outside)
    linked = qv_adapters_dir / f"linked-{tmp_path.name}"
    shutil.copytree(qv_adapters_dir / "alpha", linked)
    request.addfinalizer(lambda: shutil.rmtree(linked))  # the adapters folder is shared by the session
    (linked / "tokenizer.json").symlink_to(outside)
    resp = await client.post("/v1/load_lora_adapter", json={"lora_name": "linked", "lora_path": str(linked)},
                             headers=ADMIN)
    body = await resp.json()
    assert resp.status == 403 and body["error"]["code"] == "source_not_allowed", body
    assert "tokenizer.json" in body["error"]["message"]
    await _refused_in_a_push(client, qv_adapters_dir, linked, "source_not_allowed", ["tokenizer.json"])


async def _refused_in_a_push(client, qv_adapters_dir, folder, code: str, named: list) -> None:
    """A push of tenant globex's adapter from `folder` beside acme's alpha: the push applies (one tenant's folder
    must not hold up every other tenant's adapters), alpha serves, and globex's version is reported failed,
    naming why; requests for it are answered so."""
    push = {"generation": 2, "adapters": [
        {"name": "alpha", "tenant": "acme", "stable": {"version": "v1", "uri": str(qv_adapters_dir / "alpha")}},
        {"name": "theirs", "tenant": "globex", "stable": {"version": "v1", "uri": str(folder)}}]}
    resp = await client.put("/admin/v1/state", json=push, headers=ADMIN)
    body = await resp.json()
    assert resp.status == 200 and body["generation_applied"] == 2, body
    error = {a["name"]: a["error"] for a in body["adapters"]}["theirs"]
    assert f"({code})" in error and any(str(f) in error for f in named), error
    resp = await client.post("/v1/completions", json=COMPLETION)
    assert resp.status == 200, await resp.text()
    resp = await client.post("/v1/completions", json=COMPLETION | {"model": "theirs"})
    assert resp.status == 503 and "failed to load" in (await resp.json())["error"]["message"]


@pytest.mark.parametrize(("how", "status", "code"), [
    ("weights_symlink_loop", 422, "symlink_loop"), ("tokenizer_symlink_loop", 422, "symlink_loop"),
    ("folder_symlink_loop", 422, "symlink_loop"),
    pytest.param("folder_mode_000", 403, "permission_denied", marks=pytest.mark.skipif(
        os.geteuid() == 0, reason="root lists a folder whatever its mode; the symlink loop cases cover read errors")),
])
async def test_an_adapter_folder_the_worker_cannot_read_is_a_4xx_naming_it(client, qv_adapters_dir, tmp_path, how,
                                                                           status, code):
    folder = qv_adapters_dir / f"unreadable-{tmp_path.name}"
    shutil.copytree(qv_adapters_dir / "alpha", folder)
    named = [folder]  # the answer names one of them
    if how == "weights_symlink_loop":
        named = [folder / "adapter_model.safetensors"]
        named[0].unlink()
        named[0].symlink_to(named[0].name)  # a link to itself
    elif how == "tokenizer_symlink_loop":
        named = [folder / "vocab.json", folder / "merges.txt"]
        named[0].symlink_to("merges.txt")
        named[1].symlink_to("vocab.json")
    elif how == "folder_symlink_loop":
        shutil.rmtree(folder)
        folder.symlink_to(folder.name)
    else:
        folder.chmod(0)
    try:
        resp = await client.post("/v1/load_lora_adapter", json={"lora_name": "unreadable", "lora_path": str(folder)},
                                 headers=ADMIN)
        err = (await resp.json())["error"]
        assert (resp.status, err["code"]) == (status, code), err
        assert any(f"{f}: " in err["message"] for f in named), err
        await _refused_in_a_push(client, qv_adapters_dir, folder, code, named)
    finally:
        if folder.is_symlink():
            folder.unlink()
        else:
            folder.chmod(0o755)
            shutil.rmtree(folder)
    state = await (await client.get("/admin/v1/state", headers=ADMIN)).json()
    assert state["generation_applied"] == 2 and {a["name"]: a["error"] is None for a in state["adapters"]} == {
        "alpha": True, "theirs": False}


async def test_documented_openai_fields_are_accepted_or_refused_by_name(client):
    """What an OpenAI client sends beside the prompt: fields that change nothing are answered, streamed too;
    one whose effect would be lost is a 400 naming it, not "Unrecognized request argument"."""
    inert = {"store": False, "metadata": {"team": "search"}, "service_tier": "auto", "prompt_cache_key": "k",
             "safety_identifier": "u7", "parallel_tool_calls": True, "functions": [], "function_call": "none",
             "modalities": ["text"], "user": "u7"}
    resp = await client.post("/v1/chat/completions", json=CHAT | inert)
    assert resp.status == 200, await resp.text()
    stream = {"stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False}}
    resp = await client.post("/v1/completions", json=COMPLETION | stream)
    assert resp.status == 200 and (await resp.text()).rstrip().endswith("data: [DONE]")
    for path, body, param in [
        ("/v1/chat/completions", CHAT | {"reasoning_effort": "high"}, "reasoning_effort"),
        ("/v1/completions", COMPLETION | {"suffix": "</code>"}, "suffix"),
    ]:
        resp = await client.post(path, json=body)
        err = (await resp.json())["error"]
        assert (resp.status, err["code"], err["param"]) == (400, "unsupported_parameter", param), err


async def test_token_ids_outside_the_vocabulary_are_a_400_naming_the_prompt(client):
    """The tiny model's vocabulary is 260 ids."""
    resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": [999, 1], "max_tokens": 1})
    err = (await resp.json())["error"]
    assert resp.status == 400 and (err["code"], err["param"]) == ("invalid_prompt", "prompt"), err

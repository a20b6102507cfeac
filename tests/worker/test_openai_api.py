"""In-process checks of the inference handlers (aiohttp test client, real engine, tiny model)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import threading

import pytest

from lorafleet.worker.app_keys import ADMISSION, ENGINE
from lorafleet.worker.engine_config import EngineConfig
from lorafleet.worker.served_adapters import ServedAdapters
from lorafleet.worker.server import create_app
from lorafleet.worker.worker_config import WorkerConfig
from tests.lora_factory import make_peft_adapter
from tests.openai_clients import close_openai_clients, openai_client  # noqa: F401 (the fixture closes them)


@pytest.fixture
def adapters_dir(tiny_llama_dir, tmp_path):
    make_peft_adapter(tiny_llama_dir, tmp_path / "alpha", rank=4, seed=1, targets=["q_proj", "v_proj"])
    return tmp_path


async def test_a_version_replaced_between_arrival_and_admission_is_re_resolved(
        aiohttp_client, tiny_llama_dir, adapters_dir, monkeypatch):
    """A directive push may drop the version a request resolved on arrival before the engine takes the
    request. Such a request (it named the adapter, not a version) is resolved once more and served;
    a request that pinned `name@version` keeps its clear error."""
    config = WorkerConfig(engine=EngineConfig(model=str(tiny_llama_dir), adapters=str(adapters_dir),
                                              dtype="float32", max_model_len=128), served_model_name="tiny")
    real = ServedAdapters.resolve
    calls = []

    def resolve_to_a_dropped_version_first(self, model, tenant, user):
        calls.append(model)
        key = real(self, model, tenant, user)
        # Arrival and the first two re-resolutions still see the old table (the push has not swapped it yet).
        return f"{key.partition('@')[0]}@dropped" if key and len(calls) <= 3 else key

    monkeypatch.setattr(ServedAdapters, "resolve", resolve_to_a_dropped_version_first)
    client = await aiohttp_client(create_app(config))
    body = {"model": "alpha", "prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0, "n": 2}
    resp = await client.post("/v1/completions", json=body)
    data = await resp.json()
    assert resp.status == 200, data
    current = data["model"]  # the version that really served it
    assert current.startswith("alpha@") and not current.endswith("@dropped")
    assert len(data["choices"]) == 2 and calls == ["alpha"] * 4

    calls.clear()
    pinned = await client.post("/v1/completions", json=body | {"model": "alpha@nope"})
    assert pinned.status == 404  # a pinned version that does not exist is the caller's error


@pytest.fixture
async def base_client(aiohttp_client, tiny_llama_dir):
    """A development-mode worker serving only the base model, `tiny`."""
    config = WorkerConfig(engine=EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=128),
                          served_model_name="tiny")
    return await aiohttp_client(create_app(config))


async def _complete(client, body: dict) -> list[dict]:
    """The choices of a completion; streamed, its chunks' choices in order."""
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200, await resp.text()
    if not body.get("stream"):
        return (await resp.json())["choices"]
    events = [line[6:] for line in (await resp.text()).split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [c for e in events[:-1] for c in json.loads(e)["choices"]]


@pytest.mark.parametrize("path, prefix", [("/v1/completions", "cmpl"), ("/v1/chat/completions", "chatcmpl")])
async def test_vllms_request_id_names_the_answer_and_may_repeat(base_client, path, prefix):
    """vLLM's `request_id`: the answer (each chunk of a stream) is named cmpl-/chatcmpl- and it; two requests in
    flight with the same one are both served (the engine's own ids stay unique)."""
    prompt = {"prompt": "hello"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    body = {"model": "tiny", "max_tokens": 4, "n": 2, "request_id": "batch-7/req-1", **prompt}
    whole, streamed = await asyncio.gather(base_client.post(path, json=body),
                                           base_client.post(path, json=body | {"stream": True}))
    assert whole.status == streamed.status == 200, await whole.text()
    assert (await whole.json())["id"] == f"{prefix}-batch-7/req-1"
    events = [line[6:] for line in (await streamed.text()).split("\n") if line.startswith("data: ")]
    assert {json.loads(e)["id"] for e in events[:-1]} == {f"{prefix}-batch-7/req-1"}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_with_include_usage_every_chunk_has_a_usage_field(base_client, path):
    """OpenAI's streams with stream_options.include_usage: every chunk carries `usage`, null but in the last
    chunk before [DONE] (no choices, the request's counts); typed clients of other languages rely on it."""
    prompt = {"prompt": "hello"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    resp = await base_client.post(path, json={"model": "tiny", "max_tokens": 4, "temperature": 0, "stream": True,
                                              "stream_options": {"include_usage": True}, **prompt})
    assert resp.status == 200, await resp.text()
    events = [line[6:] for line in (await resp.text()).split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    # At least one chunk before the usage chunk (a client read slowly gets the tokens merged into fewer chunks).
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1]) and len(chunks) >= 2
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_continuous_usage_stats_put_the_counts_so_far_in_every_chunk(base_client, path):
    """vLLM's stream_options.continuous_usage_stats (with include_usage): each chunk's usage is its choice's
    counts so far (its prompt, its tokens), growing by the tokens it carries; the last chunk has the totals.
    With n=2 the chunks counted both choices together before, which no per-choice meter can read."""
    chat = path == "/v1/chat/completions"
    prompt = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True} if chat else \
        {"prompt": "hello", "logprobs": 0}
    resp = await base_client.post(path, json={"model": "tiny", "max_tokens": 5, "n": 2, "temperature": 1, "seed": 3,
                                              "ignore_eos": True, "stream": True, **prompt,
                                              "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert resp.status == 200, await resp.text()
    events = [line[6:] for line in (await resp.text()).split("\n") if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events[:-1]]
    totals = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and totals["completion_tokens"] == 10
    for index in (0, 1):
        mine = [c for c in chunks[:-1] if c["choices"][0]["index"] == index]
        used = [c["usage"]["completion_tokens"] for c in mine]
        # A client read slowly gets tokens merged into fewer chunks: each chunk's count grows by what it carries.
        carried = [len((c["choices"][0].get("logprobs") or {}).get("content" if chat else "tokens") or [])
                   for c in mine]
        assert used == list(itertools.accumulate(carried)) and used[-1] == 5
    assert all(c["usage"]["prompt_tokens"] == totals["prompt_tokens"] for c in chunks)  # one prompt
    if not chat:  # two prompts: each choice's chunks count its own prompt
        resp = await base_client.post(path, json={"model": "tiny", "max_tokens": 2, "prompt": ["hi", "a b c d e f"],
                                                  "stream": True, "stream_options": {"include_usage": True,
                                                                                     "continuous_usage_stats": True}})
        events = [json.loads(line[6:]) for line in (await resp.text()).split("\n")
                  if line.startswith("data: {")]
        prompt_of = {c["choices"][0]["index"]: c["usage"]["prompt_tokens"] for c in events[:-1]}
        assert prompt_of[0] < prompt_of[1] and prompt_of[0] + prompt_of[1] == events[-1]["usage"]["prompt_tokens"]
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
               for c in chunks)
    for options, usage in (({"continuous_usage_stats": True}, True),  # include_usage left out: on (as vLLM)
                           ({"continuous_usage_stats": True, "include_usage": False}, False)):
        resp = await base_client.post(path, json={"model": "tiny", "max_tokens": 2, "stream": True, **prompt,
                                                  "stream_options": options})
        assert ('"usage":{' in (await resp.text()).split("\n")[0]) is usage, options


def _joined_logprobs(choices: list[dict]) -> dict[str, list]:
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    joined = {k: [v for c in choices for v in c["logprobs"][k]] for k in keys}
    return joined | {"text": "".join(c["text"] for c in choices)}


async def test_streamed_text_offsets_match_the_response_while_a_stop_string_holds_text(base_client):
    """A possible stop string holds the last characters back from the stream; each token's text_offset
    is still where its text starts in the choice's text, as in the response that is not streamed."""
    body = {"model": "tiny", "prompt": "hello world", "max_tokens": 16, "temperature": 0, "logprobs": 0}
    plain = _joined_logprobs(await _complete(base_client, body))
    for extra in ({"stop": ["\u2603\u2603\u2603\u2603\u2603"]}, {"stream": True},
                  {"stream": True, "stop": ["\u2603\u2603\u2603\u2603\u2603"]}):
        got = _joined_logprobs(await _complete(base_client, body | extra))
        assert got == plain, extra
    offsets = plain["text_offset"]
    assert offsets == sorted(offsets) and offsets[-1] < len(plain["text"])


async def test_completion_top_logprobs_hold_the_sampled_token(base_client):
    """OpenAI (and vLLM): `top_logprobs` always holds the sampled token: up to `logprobs` + 1 entries."""
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 16, "temperature": 1, "seed": 3, "logprobs": 1}
    for stream in (False, True):
        lps = _joined_logprobs(await _complete(base_client, body | {"stream": stream}))
        for token, top in zip(lps["tokens"], lps["top_logprobs"], strict=True):
            assert token in top and 1 <= len(top) <= 2, (token, top)  # two tokens may share a text ("\ufffd")
        assert any(len(top) == 2 for top in lps["top_logprobs"])  # sampled tokens outside the top 1 occurred


async def test_a_context_overflow_names_the_field_the_caller_sent(base_client):
    """Chat takes `max_completion_tokens` (OpenAI's current name) or `max_tokens`: a request too long for the
    context is refused naming the one the caller sent, so a client can tell which argument to lower."""
    from openai import BadRequestError

    client = openai_client(str(base_client.make_url("/v1")))
    messages = [{"role": "user", "content": "hi"}]
    for name in ("max_completion_tokens", "max_tokens"):
        with pytest.raises(BadRequestError) as exc:
            await client.chat.completions.create(model="tiny", messages=messages, **{name: 500})
        err = exc.value
        assert (err.code, err.param) == ("context_length_exceeded", name), err.body
        assert f"Lower {name}" in err.body["message"], err.body


async def test_usage_reports_the_prompt_tokens_found_in_the_prefix_cache(aiohttp_client, tiny_llama_dir, base_client):
    """With --enable-prompt-tokens-details (vLLM's; off by default, as there), OpenAI's
    usage.prompt_tokens_details.cached_tokens: the prompt tokens a request's admission found computed (whole
    blocks of 16), none for a prompt seen first; a prompt's `n` choices count once, as the least any of them
    found (a choice finds what its sibling computed); the streamed usage chunk says the same, per-choice chunks
    (continuous_usage_stats) leave it out, as vLLM's do; cache_salt keeps requests apart."""
    config = WorkerConfig(engine=EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=128),
                          served_model_name="tiny", enable_prompt_tokens_details=True)
    client = openai_client(str((await aiohttp_client(create_app(config))).make_url("/v1")))
    prompt = list(range(3, 43))  # 40 tokens: the first 32 (two whole blocks) are kept for the next request
    first = await client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0, n=2)
    assert (first.usage.prompt_tokens, first.usage.prompt_tokens_details.cached_tokens) == (40, 0)
    again = await client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 32
    assert [c.text for c in again.choices] == [first.choices[0].text]
    stream = await client.completions.create(
        model="tiny", prompt=prompt[:20] + [7] * 20, max_tokens=2, stream=True, temperature=0, n=2,
        stream_options={"include_usage": True, "continuous_usage_stats": True})
    usage = [chunk.usage async for chunk in stream if chunk.usage is not None]
    assert [u.prompt_tokens_details.cached_tokens for u in usage if u.prompt_tokens_details] == [16]  # the end's
    assert len(usage) > 1  # the per-choice chunks' usage, without details
    other = await client.completions.create(model="tiny", prompt=[9] + prompt[1:], max_tokens=2, temperature=0)
    assert other.usage.prompt_tokens_details.cached_tokens == 0  # its first block differs
    for expected in (0, 32):  # vLLM's cache_salt: shared only with requests of the same salt
        salted = await client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0,
                                                 extra_body={"cache_salt": "user-1"})
        assert salted.usage.prompt_tokens_details.cached_tokens == expected
    plain = openai_client(str(base_client.make_url("/v1")))  # without the flag: no details, as vLLM's default
    for _ in range(2):
        answer = await plain.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    assert answer.usage.prompt_tokens == 40 and answer.usage.prompt_tokens_details is None


# ---- per-tenant admission ----------------------------------------------------------------------------
KEY_ACME, KEY_GLOBEX = "sk-acme-test", "sk-globex-test"


@contextlib.asynccontextmanager
async def engine_held(app):
    """The engine thread waits until the block ends: requests admitted meanwhile stay admitted."""
    gate = threading.Event()
    app[ENGINE].call(lambda _engine: gate.wait(60))
    try:
        yield
    finally:
        gate.set()


async def until_admitted(admission, tenant: str, num_seqs: int) -> None:
    """Poll until `tenant` holds `num_seqs` admitted sequences (its requests went through admission)."""
    for _ in range(2000):
        if admission.num_admitted_by_tenant.get(tenant, 0) == num_seqs:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"{tenant} holds {admission.num_admitted_by_tenant.get(tenant, 0)}, not {num_seqs}")


async def _tenant_client(aiohttp_client, tiny_llama_dir, tmp_path, max_sequences_per_tenant: int, *, keys: bool,
                         **limits):
    keys_file = None
    if keys:
        keys_file = tmp_path / "keys.json"
        keys_file.write_text(json.dumps({"tenants": {"acme": {"keys": [KEY_ACME]}, "globex": {"keys": [KEY_GLOBEX]}}}))
    engine = EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=128,
                          max_num_seqs=limits.pop("max_num_seqs", 256))
    config = WorkerConfig(engine=engine, served_model_name="tiny", api_keys_file=keys_file and str(keys_file),
                          max_sequences_per_tenant=max_sequences_per_tenant, **limits)
    return await aiohttp_client(create_app(config))


def _complete_as(client, key: str | None, **extra):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": 0} | extra
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return asyncio.ensure_future(client.post("/v1/completions", json=body, headers=headers))


async def _assert_tenant_queue_full(pending, tenant: str, limit: int) -> None:
    """A refusal needs no engine step: it comes while the engine is held (an admitted request would not)."""
    resp = await asyncio.wait_for(pending, 30)
    err = (await resp.json())["error"]
    assert resp.status == 429 and int(resp.headers["Retry-After"]) >= 1, err
    assert (err["code"], err["type"]) == ("tenant_queue_full", "rate_limit_error")
    assert f"tenant {tenant}" in err["message"] and f"at most {limit}" in err["message"], err["message"]


async def test_a_tenant_over_its_share_gets_429_while_another_tenant_is_served(aiohttp_client, tiny_llama_dir,
                                                                              tmp_path):
    """--max-sequences-per-tenant 2 on a worker that holds far more: acme's 2 sequences in flight fill its
    share, its next request is refused at once, and globex is admitted and served meanwhile."""
    client = await _tenant_client(aiohttp_client, tiny_llama_dir, tmp_path, 2, keys=True)
    app = client.server.app
    admission = app[ADMISSION]
    too_big = await _complete_as(client, KEY_ACME, n=3)  # can never fit its share: retrying cannot help
    err = (await too_big.json())["error"]
    assert too_big.status == 400 and err["code"] == "invalid_value" and "at most 2 per tenant" in err["message"]

    async with engine_held(app):
        acme = [_complete_as(client, KEY_ACME), _complete_as(client, KEY_ACME)]
        await until_admitted(admission, "acme", 2)
        await _assert_tenant_queue_full(_complete_as(client, KEY_ACME), "acme", 2)
        globex = _complete_as(client, KEY_GLOBEX, n=2)
        await until_admitted(admission, "globex", 2)
    for resp in await asyncio.gather(*acme, globex):
        assert resp.status == 200, await resp.text()
    assert (admission.num_admitted, admission.num_admitted_by_tenant) == (0, {})  # each admit released once
    assert (await _complete_as(client, KEY_ACME, n=2)).status == 200  # acme's share is free again

    metrics = await (await client.get("/metrics")).text()
    assert 'lorafleet_requests_rejected_total{reason="tenant_queue_full"} 1.0' in metrics
    assert 'lorafleet_requests_rejected_total{reason="queue_full"} 0.0' in metrics  # at 0 from the start


async def test_without_a_cap_one_of_several_tenants_leaves_a_quarter_of_the_queue_to_the_others(
        aiohttp_client, tiny_llama_dir, tmp_path):
    """No --max-sequences-per-tenant (the default): two requests of one tenant, n=256 and n=64, filled a worker
    of 320 sequences and every other tenant got 429 queue_full until they ended. With several tenants, one holds
    at most three quarters of the queue: here 6 of 8."""
    client = await _tenant_client(aiohttp_client, tiny_llama_dir, tmp_path, 0, keys=True, max_num_seqs=4,
                                  max_queued_requests=4)
    app = client.server.app
    admission = app[ADMISSION]
    assert app[ENGINE].engine.scheduler.shared()  # and a quarter of the engine's seats (test_scheduler_fairness)
    too_big = await _complete_as(client, KEY_ACME, n=7)
    assert too_big.status == 400 and "at most 6 per tenant" in (await too_big.json())["error"]["message"]
    async with engine_held(app):
        acme = _complete_as(client, KEY_ACME, n=6)
        await until_admitted(admission, "acme", 6)
        await _assert_tenant_queue_full(_complete_as(client, KEY_ACME), "acme", 6)
        globex = _complete_as(client, KEY_GLOBEX, n=2)
        await until_admitted(admission, "globex", 2)
    for resp in await asyncio.gather(acme, globex):
        assert resp.status == 200, await resp.text()


async def test_without_api_keys_the_cap_binds_the_one_dev_tenant(aiohttp_client, tiny_llama_dir, tmp_path):
    """Development mode: every caller is tenant `dev`, so the per-tenant cap caps all callers together."""
    client = await _tenant_client(aiohttp_client, tiny_llama_dir, tmp_path, 1, keys=False)
    app = client.server.app
    async with engine_held(app):
        first = _complete_as(client, None)
        await until_admitted(app[ADMISSION], "dev", 1)
        await _assert_tenant_queue_full(_complete_as(client, "sk-anything"), "dev", 1)
    assert (await first).status == 200
    assert app[ADMISSION].num_admitted_by_tenant == {}


def _greedy_body(path: str, **fields) -> dict:
    """A greedy request to `tiny` on either endpoint, generating past EOS."""
    prompt = {"prompt": "hello"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    return {"model": "tiny", "temperature": 0, "ignore_eos": True, **prompt, **fields}


async def _text(client, path: str, body: dict) -> str:
    """The first choice's text (completions) or message content (chat) of a 200 answer."""
    resp = await client.post(path, json=body)
    assert resp.status == 200, await resp.text()
    choice = (await resp.json())["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_penalties_reach_the_engine_and_out_of_range_ones_are_400(base_client, path):
    body = _greedy_body(path, max_tokens=24)

    async def text(**extra) -> str:
        return await _text(base_client, path, body | extra)

    plain = await text()
    assert plain == await text(presence_penalty=0, frequency_penalty=0, repetition_penalty=1)
    penalized = {await text(frequency_penalty=2), await text(presence_penalty=2), await text(repetition_penalty=1.5)}
    assert plain not in penalized
    for field, value in (("presence_penalty", 2.5), ("frequency_penalty", -2.1), ("repetition_penalty", 0)):
        resp = await base_client.post(path, json=body | {field: value})
        assert resp.status == 400
        error = (await resp.json())["error"]
        assert error["param"] == field and field in error["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_logit_bias_and_min_p_reach_the_engine(base_client, tiny_llama_dir, path):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json"))
    texts = {i: tokenizer.decode([i], skip_special_tokens=False) for i in range(tokenizer.get_vocab_size())}
    body = _greedy_body(path, max_tokens=6)

    async def text(**extra) -> str:
        return await _text(base_client, path, body | extra)

    plain = await text()
    first = (await text(max_tokens=1))[:1]
    # Every token that reads as the greedy first character (byte tokens of one UTF-8 character all read U+FFFD).
    banned = {str(i): -100 for i, t in texts.items() if t and t[:1] == first}
    assert banned and (await text(logit_bias=banned))[:1] != first
    assert await text(logit_bias={str(i): 0 for i in range(8)}) == plain
    forced = str(tokenizer.token_to_id("a"))
    assert await text(logit_bias={forced: 100}) == "a" * 6
    assert await text(logit_bias={forced: 100}, temperature=1.5, seed=3) == "a" * 6
    # min_p 1 keeps only the most likely token: sampling then gives the greedy text.
    assert await text(temperature=1.5, seed=5, min_p=1.0) == plain
    vocab_size = base_client.app[ENGINE].engine.model_config.vocab_size
    assert await text(logit_bias={str(vocab_size - 1): -5})
    for extra in ({"logit_bias": {str(vocab_size): 5}}, {"logit_bias": {"a": 5}},
                  {"logit_bias": {"1": 101}}, {"min_p": 2}):
        resp = await base_client.post(path, json=body | extra)
        assert resp.status == 400, extra
        error = (await resp.json())["error"]
        field = next(iter(extra))
        assert error["param"] == field and field in error["message"]


async def _answer(client, path: str, body: dict, stop_reasons: list | None = None) -> tuple[list[str], list[str], int]:
    """Per choice its text and finish_reason, and the completion tokens, of a 200 answer, streamed or not; each
    choice's stop_reason appended to `stop_reasons` (streamed: null in every chunk but its last)."""
    stream = {"stream": True, "stream_options": {"include_usage": True}} if body.get("stream") else {}
    resp = await client.post(path, json=body | stream)
    assert resp.status == 200, await resp.text()
    if not stream:
        data = await resp.json()
        texts = [c["text"] if "text" in c else c["message"]["content"] for c in data["choices"]]
        if stop_reasons is not None:
            stop_reasons += [c["stop_reason"] for c in data["choices"]]
        return texts, [c["finish_reason"] for c in data["choices"]], data["usage"]["completion_tokens"]
    events = [line[6:] for line in (await resp.text()).split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts, reasons = {}, {}
    for c in (c for chunk in chunks for c in chunk["choices"]):
        piece = c["text"] if "text" in c else c["delta"].get("content", "")
        texts[c["index"]] = texts.get(c["index"], "") + piece
        reasons[c["index"]] = c["finish_reason"] or reasons.get(c["index"])
        assert c["finish_reason"] is not None or c["stop_reason"] is None
        if stop_reasons is not None and c["finish_reason"] is not None:
            stop_reasons.append(c["stop_reason"])
    return [texts[i] for i in sorted(texts)], [reasons[i] for i in sorted(texts)], chunks[-1]["usage"]["completion_tokens"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_vllm_min_tokens_stop_token_ids_and_stop_string_options(base_client, tiny_llama_dir, path, stream):
    from tests.worker.conftest import EOS_ID

    a = base_client.app[ENGINE].engine.tokenizer.token_to_id("a")
    body = _greedy_body(path, max_tokens=12, stream=stream)
    del body["ignore_eos"]
    eos_first, a_first = {str(EOS_ID): 100}, {str(a): 100}  # the greedy choice at every step

    async def answer(**extra) -> tuple[list[str], list[str], int]:
        return await _answer(base_client, path, body | extra)

    greedy = (await answer(ignore_eos=True, max_tokens=5))[0][0]
    assert await answer(logit_bias=eos_first) == ([""], ["stop"], 1)
    # min_tokens: EOS is held back for 5 tokens (the greedy ones), then it ends the request, not as text.
    assert await answer(logit_bias=eos_first, min_tokens=5) == ([greedy], ["stop"], 6)
    texts, reasons, tokens = await answer(logit_bias=eos_first, min_tokens=4, n=2, temperature=1, seed=2)
    assert reasons == ["stop", "stop"] and tokens == 2 * 5 and all(texts)
    # stop_token_ids: the first one ends the request, its text kept only with include_stop_str_in_output.
    assert await answer(logit_bias=a_first, stop_token_ids=[a]) == ([""], ["stop"], 1)
    assert await answer(logit_bias=a_first, stop_token_ids=[a], include_stop_str_in_output=True) == (["a"], ["stop"], 1)
    (text,), reasons, tokens = await answer(logit_bias=a_first, stop_token_ids=[a, EOS_ID], min_tokens=3)
    assert "a" not in text and (reasons, tokens) == (["stop"], 4)
    # Stop strings: searched only once min_tokens tokens are there (then in the text new since the last step).
    assert await answer(logit_bias=a_first, stop=["a"]) == ([""], ["stop"], 1)
    assert await answer(logit_bias=a_first, stop=["a"], include_stop_str_in_output=True) == (["a"], ["stop"], 1)
    assert await answer(logit_bias=a_first, stop=["aa"], min_tokens=3) == (["a"], ["stop"], 3)
    assert await answer(logit_bias=a_first, stop=["aa"], min_tokens=3, include_stop_str_in_output=True) == (
        ["aaa"], ["stop"], 3)
    # skip_special_tokens false: special tokens are text.
    assert await answer(logit_bias=eos_first, ignore_eos=True, max_tokens=3) == ([""], ["length"], 3)
    assert await answer(logit_bias=eos_first, ignore_eos=True, max_tokens=3, skip_special_tokens=False) == (
        ["</s></s></s>"], ["length"], 3)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_stop_reason_names_the_stop_string_or_token_that_ended_a_choice(base_client, path, stream):
    """vLLM's `stop_reason`: the stop string, or the stop_token_ids token, that ended the choice; null for EOS and
    for length. With several stop strings it is the only way to tell which one ended it (its text is cut)."""
    from tests.worker.conftest import EOS_ID

    a = base_client.app[ENGINE].engine.tokenizer.token_to_id("a")
    body = _greedy_body(path, max_tokens=6, stream=stream)
    del body["ignore_eos"]
    cases = [({"logit_bias": {str(EOS_ID): 100}}, None), ({"logit_bias": {str(a): 100}, "stop_token_ids": [a]}, a),
             ({"logit_bias": {str(a): 100}, "stop": ["b", "aa"]}, "aa"), ({"logit_bias": {str(a): 100}}, None)]
    for extra, expected in cases:
        got: list = []
        await _answer(base_client, path, body | extra | {"n": 2}, got)
        assert got == [expected] * 2, extra


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_stop_token_ids_outside_the_vocabulary_and_min_tokens_beyond_the_context_are_400(base_client, path):
    vocab_size = base_client.app[ENGINE].engine.model_config.vocab_size
    body = _greedy_body(path, max_tokens=4)
    assert (await base_client.post(path, json=body | {"stop_token_ids": [vocab_size - 1]})).status == 200
    bad = [({"stop_token_ids": [1, vocab_size]}, "stop_token_ids", f"0..{vocab_size - 1}"),
           ({"min_tokens": 5}, "min_tokens", "'max_tokens' (4)"),
           ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens", "not supported")]
    if path == "/v1/chat/completions":  # max_tokens unset: the context left after the prompt bounds min_tokens
        bad.append(({"max_tokens": None, "min_tokens": 128}, "min_tokens", "model's context (128 tokens)"))
    for extra, param, needle in bad:
        resp = await base_client.post(path, json=body | extra)
        error = (await resp.json())["error"]
        assert resp.status == 400 and error["param"] == param and needle in error["message"], (extra, error)


async def test_developer_messages_are_the_system_prompt_and_unknown_roles_a_400(base_client):
    """Recent OpenAI clients send the system prompt as role "developer": the model gets it as its template's
    system turn (the test model's template renders roles verbatim, so the prompt's length tells)."""
    usage = {}
    for role in ("developer", "system"):
        body = {"model": "tiny", "max_tokens": 1, "messages": [{"role": role, "content": "be brief"},
                                                                {"role": "user", "content": "hi"}]}
        resp = await base_client.post("/v1/chat/completions", json=body)
        assert resp.status == 200, await resp.text()
        usage[role] = (await resp.json())["usage"]["prompt_tokens"]
    assert usage["developer"] == usage["system"]
    resp = await base_client.post("/v1/chat/completions", json={"model": "tiny", "messages": [
        {"role": "robot", "content": "hi"}]})
    error = (await resp.json())["error"]
    assert resp.status == 400 and error["param"] == "messages"
    assert "messages[0].role must be one of system, user, assistant, developer, tool" in error["message"]


# ---- a job whose version goes while its later choices wait ---------------------------------------------
ADMIN = {"Authorization": "Bearer admintoken123456"}


@pytest.fixture
async def churn_client(aiohttp_client, tiny_llama_dir, tmp_path):
    """Adapter `alpha` (from ./alpha) on a worker running one sequence at a time; ./other is another
    adapter's folder, for loading `alpha` again as another version."""
    make_peft_adapter(tiny_llama_dir, tmp_path / "alpha", rank=4, seed=1, targets=["q_proj", "v_proj"])
    make_peft_adapter(tiny_llama_dir, tmp_path / "other", rank=4, seed=5, targets=["q_proj", "v_proj"])
    engine = EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=128, max_num_seqs=1)
    config = WorkerConfig(engine=engine, served_model_name="tiny", admin_token="admintoken123456",
                          adapter_roots=str(tmp_path))
    client = await aiohttp_client(create_app(config))
    resp = await client.post("/v1/load_lora_adapter", headers=ADMIN,
                             json={"lora_name": "alpha", "lora_path": str(tmp_path / "alpha")})
    assert resp.status == 200, await resp.text()
    client.adapters_root = tmp_path
    return client


def hold_later_choices(client, monkeypatch) -> asyncio.Event:
    """The job's choices after the first reach the engine only once the returned event is set (they wait
    in the queue behind it, as with --max-num-seqs 1, until the test changed the adapters)."""
    engine = client.app[ENGINE]
    go_on = asyncio.Event()
    real_generate = engine.generate

    async def held(request_id, prompt, params, adapter, tenant=None):
        if not request_id.endswith("-0"):
            await go_on.wait()
        async for out in real_generate(request_id, prompt, params, adapter, tenant=tenant):
            yield out

    monkeypatch.setattr(engine, "generate", held)
    return go_on


async def _events(resp) -> list[str]:
    return [line[6:] for line in (await asyncio.wait_for(resp.text(), 30)).split("\n") if line.startswith("data: ")]


@pytest.mark.parametrize("reload", [False, True], ids=["unloaded", "reloaded_as_another_version"])
async def test_a_stream_whose_version_goes_mid_way_ends_with_an_in_band_error(churn_client, monkeypatch, reload):
    """Choice 0 streamed on alpha's version; before choice 1 starts, alpha is unloaded (and maybe loaded again
    from another folder: another version). The stream, whose headers are gone, ends with one in-band error
    event and a proper end of the chunked body (no second HTTP response inside it, no hang), and choice 1
    never runs on another version than choice 0's: one answer never mixes versions."""
    go_on = hold_later_choices(churn_client, monkeypatch)
    body = {"model": "alpha", "prompt": "hi", "max_tokens": 8, "ignore_eos": True, "n": 2, "stream": True}
    resp = await churn_client.post("/v1/completions", json=body)
    assert resp.status == 200
    first = json.loads((await asyncio.wait_for(resp.content.readline(), 30))[6:])
    served = first["model"]
    assert served.startswith("alpha@") and resp.headers["X-Lorafleet-Adapter"] == served
    unload = await churn_client.post("/v1/unload_lora_adapter", headers=ADMIN, json={"lora_name": "alpha"})
    assert unload.status == 200, await unload.text()
    if reload:
        load = await churn_client.post("/v1/load_lora_adapter", headers=ADMIN, json={
            "lora_name": "alpha", "lora_path": str(churn_client.adapters_root / "other")})
        assert load.status == 200, await load.text()
    go_on.set()
    raw = await asyncio.wait_for(resp.content.read(), 30)  # the chunked body ends (no hang, no broken transfer)
    assert b"HTTP/1.1" not in raw
    events = [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]
    assert "[DONE]" not in events
    chunks = [json.loads(e) for e in events]
    error = chunks[-1]["error"]
    assert error["code"] == "model_not_found" and "no longer served" in error["message"], error
    # Choice 0's tokens before the error, if any: on a busy machine choice 1's refusal may come first (the
    # first event can go before any token, and a request not yet running holds no version).
    assert {c["model"] for c in chunks[:-1]} <= {served}
    assert {ch["index"] for c in chunks[:-1] for ch in c["choices"]} <= {0}
    # the connection still serves requests
    again = await churn_client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert again.status == 200, await again.text()


async def test_an_answer_whose_version_goes_mid_way_is_not_served_by_another_version(churn_client, monkeypatch):
    """Not streamed: choice 0 came from the old version, so choice 1 on the new one would mix them; the
    answer is the failure (404: retry), not a response that claims the new version."""
    go_on = hold_later_choices(churn_client, monkeypatch)
    engine = churn_client.app[ENGINE]
    first_done = asyncio.Event()
    real_generate = engine.generate

    async def noted(request_id, prompt, params, adapter, tenant=None):
        async for out in real_generate(request_id, prompt, params, adapter, tenant=tenant):
            yield out
            if out.finished and request_id.endswith("-0"):
                first_done.set()

    monkeypatch.setattr(engine, "generate", noted)
    body = {"model": "alpha", "prompt": "hi", "max_tokens": 8, "ignore_eos": True, "n": 2}
    request = asyncio.ensure_future(churn_client.post("/v1/completions", json=body))
    await asyncio.wait_for(first_done.wait(), 30)
    assert (await churn_client.post("/v1/unload_lora_adapter", headers=ADMIN, json={"lora_name": "alpha"})).status == 200
    load = await churn_client.post("/v1/load_lora_adapter", headers=ADMIN, json={
        "lora_name": "alpha", "lora_path": str(churn_client.adapters_root / "other")})
    assert load.status == 200, await load.text()
    go_on.set()
    resp = await asyncio.wait_for(request, 30)
    data = await resp.json()
    assert resp.status == 404 and data["error"]["code"] == "model_not_found", data


async def test_a_push_that_replaces_the_version_before_a_later_choice_starts_fails_the_stream(
        aiohttp_client, tiny_llama_dir, tmp_path, monkeypatch):
    """As an unload: a directive push makes v2 stable while choice 1 still waits; v1 is dropped once choice 0
    finished on it, and choice 1 does not run on v2: the stream ends with the in-band error."""
    make_peft_adapter(tiny_llama_dir, tmp_path / "alpha", rank=4, seed=1, targets=["q_proj", "v_proj"])
    make_peft_adapter(tiny_llama_dir, tmp_path / "other", rank=4, seed=5, targets=["q_proj", "v_proj"])
    config = WorkerConfig(engine=EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=128),
                          served_model_name="tiny", admin_token="admintoken123456", adapter_roots=str(tmp_path))
    client = await aiohttp_client(create_app(config))

    async def push(generation: int, version: str, folder: str) -> None:
        body = {"generation": generation, "adapters": [
            {"name": "alpha", "tenant": "acme", "stable": {"version": version, "uri": str(tmp_path / folder)}}]}
        resp = await client.put("/admin/v1/state", json=body, headers=ADMIN)
        assert resp.status == 200, await resp.text()

    await push(1, "v1", "alpha")
    go_on = hold_later_choices(client, monkeypatch)
    resp = await client.post("/v1/completions", json={"model": "alpha", "prompt": "hi", "max_tokens": 8,
                                                      "ignore_eos": True, "n": 2, "stream": True})
    assert resp.status == 200
    first = (await asyncio.wait_for(resp.content.readline(), 30)).decode()  # may hold all of choice 0 (a reader
    assert json.loads(first[6:])["model"] == "alpha@v1"  # behind the engine gets its outputs as one chunk)
    await push(2, "v2", "other")
    pool = client.app[ENGINE].engine.adapter_pool
    for _ in range(3000):  # v2 loads beside v1, then becomes current
        if pool.resolve("alpha") == "alpha@v2":
            break
        await asyncio.sleep(0.01)
    assert pool.resolve("alpha") == "alpha@v2"
    go_on.set()
    body = first + await asyncio.wait_for(resp.text(), 30)
    chunks = [json.loads(line[6:]) for line in body.split("\n") if line.startswith("data: ")]  # no [DONE]
    assert chunks[-1]["error"]["code"] == "model_not_found", chunks[-1]
    assert {c["model"] for c in chunks[:-1]} == {"alpha@v1"}
    assert {ch["index"] for c in chunks[:-1] for ch in c["choices"]} == {0}


async def test_a_request_that_can_never_be_admitted_names_what_the_caller_sent(aiohttp_client, tiny_llama_dir,
                                                                               tmp_path):
    """More sequences (prompts x n) than the worker ever admits is a 400 naming `prompt` when the caller sent a
    list of prompts and no n, `n` when it asked for several choices; the limit said is the tenant's share where
    that is the smaller. It is refused from its prompts and n alone: nothing is tokenized (a request of
    1,024 prompts x n 256 had every choice built on the event loop before it was refused)."""
    client = await _tenant_client(aiohttp_client, tiny_llama_dir, tmp_path, 3, keys=False)
    engine, tokenized = client.app[ENGINE].engine, []
    encode = engine.encode
    engine.encode = lambda prompt: tokenized.append(prompt) or encode(prompt)
    cases = [({"prompt": ["hi"] * 4}, "prompt"), ({"n": 4}, "n"), ({"prompt": ["hi"] * 2, "n": 2}, "n")]
    for extra, param in cases:
        resp = await _complete_as(client, None, **extra)
        err = (await resp.json())["error"]
        assert resp.status == 400 and err["param"] == param, (extra, err)
        assert "needs 4 sequences (prompts x n); the worker admits at most 3 per tenant at once" in err["message"]
    assert tokenized == []
    resp = await client.post("/v1/chat/completions", json={"model": "tiny", "n": 4,
                                                            "messages": [{"role": "user", "content": "hi"}]})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "n"

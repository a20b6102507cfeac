"""`echo` on /v1/completions (OpenAI's legacy semantics, what lm-evaluation-harness's `local-completions`
scores loglikelihoods with) and vLLM's `prompt_logprobs` on both endpoints, through the HTTP handlers
(aiohttp test client, real engine, tiny model)."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
import torch

from lorafleet.worker import Engine, EngineConfig, SamplingParams
from lorafleet.worker.app_keys import ENGINE, METRICS
from lorafleet.worker.openai_protocol import APIError
from lorafleet.worker.server import create_app
from lorafleet.worker.worker_config import WorkerConfig
from tests.openai_clients import close_openai_clients, openai_client  # noqa: F401 (the fixture closes them)
from tests.worker.conftest import EOS_ID

TOL = 1e-4


@pytest.fixture
async def client(aiohttp_client, tiny_llama_dir):
    config = WorkerConfig(engine=EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=128),
                          served_model_name="tiny")
    return await aiohttp_client(create_app(config))


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of the model's logits over `ids` [len, V]: row p predicts token p + 1."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


async def _choices(client, body: dict, path: str = "/v1/completions") -> list[dict]:
    """The choices of a completion; streamed, each choice's chunks joined into one (text and logprobs)."""
    resp = await client.post(path, json=body)
    assert resp.status == 200, await resp.text()
    if not body.get("stream"):
        return (await resp.json())["choices"]
    events = [line[6:] for line in (await resp.text()).split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    joined: dict[int, dict] = {}
    for c in (c for e in events[:-1] for c in json.loads(e)["choices"]):
        into = joined.setdefault(c["index"], {"index": c["index"], "text": "", "chunks": [], "logprobs": None})
        into["text"] += c["text"]
        into["chunks"].append(c["text"])
        into["finish_reason"] = c["finish_reason"]
        if c["logprobs"] is not None:
            lps = into["logprobs"] = into["logprobs"] or {k: [] for k in c["logprobs"]}
            for k, v in c["logprobs"].items():
                lps[k] += v
    return [joined[i] for i in sorted(joined)]


def _tokens(client, text: str) -> list[int]:
    return client.app[ENGINE].engine.tokenizer.encode(text)


@pytest.mark.parametrize("stream", [False, True])
async def test_echo_puts_the_prompt_before_each_choices_text(client, stream):
    ids = [int(t) for t in _tokens(client, "one two")]
    for prompt, prompt_text in (("hello world", "hello world"), (ids, "one two")):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0, "stream": stream}
        plain = await _choices(client, body)
        for n in (1, 2):
            echoed = await _choices(client, body | {"echo": True, "n": n})
            assert [c["text"] for c in echoed] == [prompt_text + plain[0]["text"]] * n
            assert all(c["finish_reason"] == plain[0]["finish_reason"] for c in echoed)
            if stream:  # the prompt's text comes first, in each choice's first chunk
                assert all(c["chunks"][0].startswith(prompt_text) for c in echoed)
    # Sampled, n=2, seeded: every choice echoes, each followed by its own completion.
    sampled = {"model": "tiny", "prompt": "hello", "max_tokens": 8, "temperature": 1, "seed": 5, "n": 2, "stream": stream}
    plain, echoed = await _choices(client, sampled), await _choices(client, sampled | {"echo": True})
    assert [c["text"] for c in echoed] == ["hello" + c["text"] for c in plain]


@pytest.mark.parametrize("stream", [False, True])
async def test_echo_with_logprobs_covers_the_prompt_tokens_first(client, hf_model, stream):
    prompt = "hello world"
    ids = _tokens(client, prompt)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 2, "stream": stream}
    plain = (await _choices(client, body))[0]
    (echoed,) = await _choices(client, body | {"echo": True})
    lps, gen = echoed["logprobs"], plain["logprobs"]
    n = len(ids)
    assert echoed["text"] == prompt + plain["text"]
    assert lps["tokens"] == list(prompt) + gen["tokens"]  # one byte token per character
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None  # as OpenAI and vLLM
    assert lps["token_logprobs"][n:] == gen["token_logprobs"] and lps["top_logprobs"][n:] == gen["top_logprobs"]
    ref = hf_logprobs(hf_model, ids)
    tokenizer = client.app[ENGINE].engine.tokenizer
    for pos in range(1, n):
        assert abs(lps["token_logprobs"][pos] - ref[pos - 1, ids[pos]].item()) < TOL
        top = lps["top_logprobs"][pos]
        assert lps["tokens"][pos] in top and 2 <= len(top) <= 3  # the top 2, and the prompt token
        for tok_id in ref[pos - 1].topk(2).indices.tolist():
            text = tokenizer.decode([tok_id])
            if text != "\ufffd":  # byte tokens of one UTF-8 character all read U+FFFD: keys collide
                assert abs(top[text] - ref[pos - 1, tok_id].item()) < TOL
    # text_offset counts through the echoed text: the prompt's characters, then the completion's.
    assert lps["text_offset"] == list(range(n)) + [n + o for o in gen["text_offset"]]
    # n=2: every choice echoes the prompt's tokens.
    for choice in await _choices(client, body | {"echo": True, "n": 2}):
        got = choice["logprobs"]
        assert (got["tokens"], got["text_offset"]) == (lps["tokens"], lps["text_offset"])
        assert got["token_logprobs"][0] is None and got["top_logprobs"][0] is None
        assert all(abs(a - b) < TOL for a, b in zip(got["token_logprobs"][1:], lps["token_logprobs"][1:], strict=True))


async def test_the_lm_eval_loglikelihood_request_scores_continuations(client, hf_model, tiny_llama_dir):
    """lm-evaluation-harness `local-completions`: token-id prompts of context + continuation, `max_tokens` 1,
    `echo`, `logprobs` 1; the continuation's loglikelihood is sum(token_logprobs[ctxlen:-1]) and it is greedy
    when each of those is the largest of its top_logprobs."""

    rng = random.Random(3)
    pairs = [([rng.randrange(256) for _ in range(c)], [rng.randrange(256) for _ in range(k)]) for c, k in
             ((5, 3), (12, 1), (1, 4))]
    ctx, greedy = [97, 98, 99], []  # a greedy continuation: the model's own argmax tokens
    for _ in range(3):
        greedy.append(int(hf_logprobs(hf_model, ctx + greedy)[-1].argmax()))
    pairs.append((ctx, greedy))
    openai = openai_client(str(client.make_url("/v1")))
    resp = await openai.completions.create(model="tiny", prompt=[c + k for c, k in pairs], max_tokens=1,
                                           temperature=0, logprobs=1, echo=True, seed=1234)
    assert len(resp.choices) == len(pairs)
    scorer = Engine(EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32", num_pages=64,
                                 block_size=4))
    greedy_flags = []
    for choice, (context, continuation) in zip(sorted(resp.choices, key=lambda c: c.index), pairs, strict=True):
        ids = context + continuation
        lp = choice.logprobs
        assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        ctxlen = len(context)
        scores = lp.token_logprobs[ctxlen:-1]
        is_greedy = all(s == max(top.values()) for s, top in zip(scores, lp.top_logprobs[ctxlen:-1], strict=True))
        ref = hf_logprobs(hf_model, ids)
        expected = sum(ref[p - 1, ids[p]].item() for p in range(ctxlen, len(ids)))
        assert abs(sum(scores) - expected) < 1e-3
        assert is_greedy == all(ref[p - 1].argmax().item() == ids[p] for p in range(ctxlen, len(ids)))
        greedy_flags.append(is_greedy)
        engine = scorer.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0]
        assert all(abs(a - b.logprob) < 1e-5 for a, b in zip(lp.token_logprobs[1:-1], engine.prompt_logprobs[1:],
                                                                strict=True))
    assert greedy_flags[-1]  # the model's own continuation is recognized as greedy
    # The same through extra_body: vLLM's prompt_logprobs.
    extra = await openai.completions.create(model="tiny", prompt=pairs[0][0] + pairs[0][1], max_tokens=1,
                                            temperature=0, extra_body={"prompt_logprobs": 0})
    got = extra.choices[0].model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(pairs[0][0] + pairs[0][1])


async def test_prompt_logprobs_as_vllm_returns_them_on_both_endpoints(client, hf_model):
    prompt = "hi there"
    ids = _tokens(client, prompt)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0, "prompt_logprobs": 2}
    resp = await client.post("/v1/completions", json=body | {"n": 2})
    data = await resp.json()
    assert resp.status == 200, data
    ref = hf_logprobs(hf_model, ids)
    for choice in data["choices"]:
        plps = choice["prompt_logprobs"]
        assert len(plps) == len(ids) and plps[0] is None
        for pos, entries in enumerate(plps[1:], 1):
            tok = str(ids[pos])
            assert tok in entries and 2 <= len(entries) <= 3
            assert abs(entries[tok]["logprob"] - ref[pos - 1, ids[pos]].item()) < TOL
            assert entries[tok]["decoded_token"] == prompt[pos]
            assert entries[tok]["rank"] == int((ref[pos - 1] >= ref[pos - 1, ids[pos]]).sum())
            top = ref[pos - 1].topk(2).indices.tolist()
            assert [entries[str(t)]["rank"] for t in top] == [1, 2]
        assert choice["logprobs"] is None and choice["text"]  # no echo: the completion's text only
    assert "prompt_logprobs" not in (await (await client.post("/v1/completions", json=body | {
        "prompt_logprobs": None})).json())["choices"][0]

    messages = [{"role": "user", "content": "hi"}]
    engine = client.app[ENGINE].engine
    chat_ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True),
                                       add_special_tokens=False)
    resp = await client.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 2,
                                                           "temperature": 0, "prompt_logprobs": 0})
    data = await resp.json()
    assert resp.status == 200, data
    plps = data["prompt_logprobs"]  # beside the choices, as vLLM's chat answers
    assert len(plps) == len(chat_ids) and plps[0] is None
    ref = hf_logprobs(hf_model, chat_ids)
    for pos, entries in enumerate(plps[1:], 1):
        assert list(entries) == [str(chat_ids[pos])]
        assert abs(entries[str(chat_ids[pos])]["logprob"] - ref[pos - 1, chat_ids[pos]].item()) < TOL


async def test_limits_are_400s_naming_the_field(client):
    completion = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert (await client.post("/v1/completions", json=completion | {"prompt_logprobs": 20, "echo": True,
                                                                    "logprobs": 20})).status == 200  # vLLM's
    bad = [("/v1/completions", completion | {"prompt_logprobs": 21}, "prompt_logprobs"),
           ("/v1/chat/completions", chat | {"prompt_logprobs": 21}, "prompt_logprobs"),
           ("/v1/completions", completion | {"echo": True, "logprobs": 21}, "logprobs"),
           ("/v1/completions", completion | {"echo": True, "max_tokens": -1}, "max_tokens"),
           ("/v1/completions", completion | {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
           ("/v1/chat/completions", chat | {"echo": True}, "echo")]
    for path, body, param in bad:
        resp = await client.post(path, json=body)
        error = (await resp.json())["error"]
        assert resp.status == 400 and error["param"] == param and param in error["message"], (body, error)


async def test_an_answer_s_logprob_entries_are_bounded(client):
    """n x prompt_logprobs: 256 choices of a 100-token prompt with 20 top logprobs each would be 537,600 entries,
    hundreds of MB built from a request of a few KB: a 400 naming `n`. Within the bound the answer is built off
    the event loop, and carries the adapter header as any answer does."""
    prompt = list(range(1, 101))
    resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1, "n": 256,
                                                      "prompt_logprobs": 20})
    error = (await resp.json())["error"]
    assert resp.status == 400 and error["param"] == "n" and "537600 logprob entries" in error["message"], error
    resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 4, "n": 2,
                                                      "prompt_logprobs": 5, "logprobs": 5, "echo": True})
    assert resp.status == 200 and resp.headers["x-lorafleet-adapter"] == "tiny", await resp.text()
    choices = (await resp.json())["choices"]
    assert len(choices) == 2 and all(len(c["prompt_logprobs"]) == 100 for c in choices)


@pytest.mark.parametrize("stream", [False, True])
async def test_echo_with_max_tokens_0_scores_the_prompt_and_generates_nothing(client, hf_model, stream):
    """OpenAI's legacy API and vLLM: the prompt and its logprobs, no completion (finish_reason "length",
    no completion tokens); the same prompt logprobs as with one token generated. Without echo, 0 is a 400."""
    body = {"model": "tiny", "prompt": "hello world", "temperature": 0, "logprobs": 2, "echo": True, "stream": stream}
    (one,) = await _choices(client, body | {"max_tokens": 1})
    (scored,) = await _choices(client, body | {"max_tokens": 0})
    n = len(_tokens(client, "hello world"))
    assert scored["text"] == "hello world" and scored["finish_reason"] == "length"
    assert scored["logprobs"]["tokens"] == one["logprobs"]["tokens"][:n] == list("hello world")
    assert scored["logprobs"]["token_logprobs"] == one["logprobs"]["token_logprobs"][:n]
    if not stream:
        metrics = client.app[METRICS].generation_tokens
        counted = lambda: sum(s.value for f in metrics.collect() for s in f.samples if s.name.endswith("_total"))  # noqa: E731
        before = counted()
        resp = await client.post("/v1/completions", json=body | {"max_tokens": 0, "n": 2})
        usage = (await resp.json())["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (n, 0)
        assert counted() == before  # nor in the metrics: the token generated to score is not the caller's
    resp = await client.post("/v1/completions", json=body | {"max_tokens": 0, "echo": False})
    err = (await resp.json())["error"]
    assert resp.status == 400 and err["param"] == "max_tokens", err


async def test_an_unset_max_tokens_is_bounded_as_the_answer_generates(client, monkeypatch):
    """Without max_tokens the answer's logprobs are counted as they come: a short answer is never refused for
    the tokens it might have taken (n=6 with 20 top logprobs counted 4096 tokens a choice up front: a 400 for an
    answer of a few thousand entries), and one that passes the bound stops there with the 400, its tokens
    not all generated first."""
    from lorafleet.worker import completion_job

    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 20,
            "n": 6, "temperature": 1, "seed": 1}
    monkeypatch.setattr(completion_job, "MAX_LOGPROB_ENTRIES", 6 * 21 * 20)  # 20 tokens a choice
    resp = await client.post("/v1/chat/completions", json=chat | {"logit_bias": {str(EOS_ID): 100}})  # ends at once
    assert resp.status == 200, await resp.text()
    assert [c["finish_reason"] for c in (await resp.json())["choices"]] == ["stop"] * 6
    metrics = client.app[METRICS].generation_tokens
    counted = lambda: sum(s.value for f in metrics.collect() for s in f.samples if s.name.endswith("_total"))  # noqa: E731
    before = counted()
    resp = await client.post("/v1/chat/completions", json=chat | {"ignore_eos": True})  # 128-token context
    error = (await resp.json())["error"]
    assert resp.status == 400 and error["param"] == "n" and "logprob entries" in error["message"], error
    assert counted() - before < 6 * 40  # stopped about 20 tokens a choice in, not at the context's end (~110)
    engine = client.app[ENGINE].engine
    for _ in range(500):  # the abort reaches the engine thread at its next step
        if not engine.has_unfinished():
            break
        await asyncio.sleep(0.01)
    assert engine.scheduler.num_running == 0 and not engine.has_unfinished()


@pytest.mark.parametrize("stream", [False, True])
def test_the_logprob_bound_leaves_ordinary_long_context_requests_alone(stream):
    """Chat with `top_logprobs` 20 and no max_tokens on a 128k-token model: its unset max_tokens is not counted
    up front (the answer is bounded as it generates), and a stream, sent as it comes, is never bounded."""
    from lorafleet.worker.completion_job import CompletionJob
    from lorafleet.worker.openai_protocol import parse_chat_request, parse_completion_request
    from lorafleet.worker.tenants import Tenant

    chat = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                               "top_logprobs": 20, "n": 4, "stream": stream})
    CompletionJob("chat", "r", "m", None, [list(range(50))], chat.options, Tenant("t")).add_choices(131072, 32000)
    wide = parse_completion_request({"model": "m", "prompt": "x", "n": 64, "prompt_logprobs": 20, "max_tokens": 1})
    job = CompletionJob("completions", "r", "m", None, [list(range(4000))], wide.options, Tenant("t"))
    with pytest.raises(APIError, match="logprob entries"):
        job.add_choices(131072, 32000)


def test_a_streams_echoed_prompt_logprobs_are_bounded_as_a_whole_answers():
    """Each choice's first chunk holds its prompt's logprobs whole (echo): n x prompt tokens x (logprobs + 1) is
    bounded for a stream as for a whole answer; a stream's generated logprobs are not (a few a chunk)."""
    from lorafleet.worker.completion_job import MAX_LOGPROB_ENTRIES, CompletionJob
    from lorafleet.worker.openai_protocol import parse_completion_request
    from lorafleet.worker.tenants import Tenant

    def job(prompt_len: int, **body) -> CompletionJob:
        request = parse_completion_request({"model": "m", "prompt": "x", "logprobs": 20, "stream": True} | body)
        return CompletionJob("completions", "r", "m", None, [list(range(prompt_len))], request.options, Tenant("t"))

    over = MAX_LOGPROB_ENTRIES // (64 * 21) + 1
    with pytest.raises(APIError, match="logprob entries") as err:
        job(over, echo=True, n=64, max_tokens=1).add_choices(131072, 32000)
    assert err.value.param == "n"
    job(over - 1, echo=True, n=64, max_tokens=1).add_choices(131072, 32000)
    job(over, n=64, max_tokens=1000).add_choices(131072, 32000)  # no echo: the logprobs come a few a chunk

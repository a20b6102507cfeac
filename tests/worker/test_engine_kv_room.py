"""A request whose prompt and max_tokens need more KV pages than its adapter and pinned adapters leave of
the unified pool is refused (ContextLengthError: a 400 without Retry-After), at admission or, when its
adapter's size is not known then, once the adapter is loaded; a shortfall that other requests or idle
adapters cause is waited out (kv_room.py)."""

from __future__ import annotations

import pytest

from lorafleet.worker import Engine, EngineConfig, SamplingParams
from lorafleet.worker.engine_errors import ContextLengthError
from tests.lora_factory import make_peft_adapter, random_weights

BS = 4
NUM_PAGES = 12  # 48 tokens: max_model_len is lowered to them
ADAPTER_PROJS = ("q_proj", "v_proj")  # at rank 4 on the tiny model: 4 pages of 4-token KV blocks
PROMPT = [5] * 10


def _engine(model_dir, **kw) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", block_size=BS,
                               num_pages=NUM_PAGES, **kw))


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def _run(engine: Engine, max_steps: int = 100) -> dict:
    """Step (adapter loads done between steps) until nothing is left: request id -> its finished output."""
    done = {}
    for _ in range(max_steps):
        done |= {o.request_id: o for o in engine.step() if o.finished}
        engine.adapter_pool.wait_idle()
        if not engine.has_unfinished():
            engine.page_pool.check()
            assert engine.page_pool.num_used("kv") == 0 and engine.requests == {}
            return done
    raise AssertionError(f"not done after {max_steps} steps: {list(engine.requests.values())}")


@pytest.fixture
def engine(tiny_llama_dir):
    engine = _engine(tiny_llama_dir)
    engine.adapter_pool.add("a@1", random_weights(1, rank=4, projs=ADAPTER_PROJS))
    assert engine.max_model_len == NUM_PAGES * BS and engine.adapter_pool.entry("a@1").image.num_pages == 4
    yield engine
    engine.close()


def test_an_adapter_request_beyond_what_its_adapter_leaves_is_refused_at_admission(engine):
    """a takes 4 of the 12 pages: its requests have 8 pages, 32 cached tokens, so prompt + max_tokens up to
    33; one token more is refused at once. Base-model requests have the whole pool, max_model_len."""
    with pytest.raises(ContextLengthError, match=r"maximum context length is 33 tokens: .* its adapter a@1 "
                                                 r"takes 4, leaving 8; you requested 34 tokens \(10 in the "
                                                 r"prompt, 24 to generate\)") as refused:
        engine.add_request("long", PROMPT, _params(24), adapter="a")
    assert "unpin" not in str(refused.value) and engine.requests == {} and not engine.has_unfinished()
    engine.add_request("fits", PROMPT, _params(23), adapter="a")
    engine.add_request("base", PROMPT, _params(NUM_PAGES * BS - len(PROMPT)))
    done = _run(engine)
    assert {rid: (o.finish_reason, len(o.token_ids)) for rid, o in done.items()} == {
        "fits": ("length", 23), "base": ("length", 38)}


def test_pinned_adapters_pages_count_against_every_request(engine):
    """p, pinned, holds 4 pages for good: a base-model request has 8 pages, a request for p too (its pages
    count once), one for a has 4."""
    engine.adapter_pool.add("p@1", random_weights(2, rank=4, projs=ADAPTER_PROJS), pinned=True)
    engine.adapter_pool.load("p@1")
    with pytest.raises(ContextLengthError, match=r"maximum context length is 33 tokens: .* pinned adapters "
                                                 r"take 4, leaving 8; .* unpin adapters"):
        engine.add_request("base", PROMPT, _params(24))
    with pytest.raises(ContextLengthError, match=r"its adapter p@1 takes 4, leaving 8"):
        engine.add_request("p", PROMPT, _params(24), adapter="p")
    with pytest.raises(ContextLengthError, match=r"is 17 tokens: .* a@1 takes 4 and pinned adapters take 4, "
                                                 r"leaving 4"):
        engine.add_request("a", PROMPT, _params(8), adapter="a")
    engine.add_request("base", PROMPT, _params(23))
    engine.add_request("p", PROMPT, _params(23), adapter="p")
    engine.add_request("a", PROMPT, _params(7), adapter="a")
    assert {rid: o.finish_reason for rid, o in _run(engine).items()} == dict.fromkeys(("base", "p", "a"), "length")


def test_a_max_tokens_the_caller_did_not_give_is_lowered_to_fit(engine):
    """max_tokens_to_fit (the API's max_tokens left out: the context after the prompt) is lowered to what a's
    pages leave, 33 - 10 tokens, at admission; and for c, whose size is known only once loaded, then. Too
    little room for min_tokens is still refused. Lowered for that request alone: b (base model, the whole
    pool), given the same params object, keeps its 38."""
    params = SamplingParams(max_tokens=NUM_PAGES * BS - len(PROMPT), temperature=0, ignore_eos=True,
                            max_tokens_to_fit=True)
    engine.add_request("a", PROMPT, params, adapter="a")
    engine.add_request("b", PROMPT, params)
    assert (engine.requests["a"].params.max_tokens, params.max_tokens) == (23, 38)
    weights = random_weights(4, rank=4, projs=ADAPTER_PROJS)
    engine.adapter_pool.add("c@1", loader=lambda: weights)
    engine.add_request("c", PROMPT, SamplingParams(max_tokens=38, temperature=0, ignore_eos=True,
                                                   max_tokens_to_fit=True), adapter="c")
    done = _run(engine)
    assert {rid: (o.finish_reason, len(o.token_ids)) for rid, o in done.items()} == {
        "a": ("length", 23), "b": ("length", 38), "c": ("length", 23)}
    with pytest.raises(ContextLengthError):
        engine.add_request("a2", PROMPT, SamplingParams(max_tokens=38, min_tokens=24, max_tokens_to_fit=True),
                           adapter="a")


def test_pages_other_requests_or_idle_adapters_hold_are_waited_for(engine):
    """A base-model request needing the whole pool is admitted while a's request runs (a and its KV cache
    hold pages, but give them back) and an idle adapter is resident: it runs once they are done."""
    engine.adapter_pool.add("idle@1", random_weights(3, rank=4, projs=ADAPTER_PROJS))
    engine.adapter_pool.load("idle@1")
    engine.add_request("a", PROMPT, _params(20), adapter="a")
    engine.step()
    engine.add_request("whole", PROMPT, _params(NUM_PAGES * BS - len(PROMPT)))
    done = _run(engine)
    assert {rid: (o.finish_reason, len(o.token_ids)) for rid, o in done.items()} == {
        "a": ("length", 20), "whole": ("length", 38)}


def test_an_adapter_of_unknown_size_is_refused_once_loaded_before_any_token(engine):
    """c is read by a loader on first use: its size is not known at admission, so its request waits for the
    load and is refused as soon as it holds c, with no token generated and no wait for the stuck bound."""
    weights = random_weights(4, rank=4, projs=ADAPTER_PROJS)
    engine.adapter_pool.add("c@1", loader=lambda: weights)
    engine.add_request("c", PROMPT, _params(30), adapter="c")
    done = _run(engine, max_steps=10)
    out = done["c"]
    assert out.finish_reason == "error" and isinstance(out.exception, ContextLengthError) and out.token_ids == []
    assert "its adapter c@1 takes 4, leaving 8" in out.error
    with pytest.raises(ContextLengthError):  # now known: refused at admission
        engine.add_request("c2", PROMPT, _params(30), adapter="c")


@pytest.mark.parametrize("min_tokens", [0, 30])
def test_a_pin_landing_after_admission_ends_the_request_by_length_with_its_output(engine, min_tokens):
    """A push pins p while a base-model request that needs the whole pool is queued: the request runs until
    it outgrows what p leaves (23 tokens), then ends by length with the tokens it wrote (its context shrank),
    at once: not an error that drops them, nor CapacityError after the stuck bound. Unless it has not written
    its min_tokens (30): that it cannot, and it fails with ContextLengthError."""
    engine.add_request("whole", PROMPT, SamplingParams(max_tokens=NUM_PAGES * BS - len(PROMPT), temperature=0,
                                                       ignore_eos=True, min_tokens=min_tokens))
    engine.adapter_pool.add("p@1", random_weights(2, rank=4, projs=ADAPTER_PROJS), pinned=True)
    engine.adapter_pool.load("p@1")
    done = _run(engine, max_steps=40)
    out = done["whole"]
    assert engine.scheduler.num_preemptions == 1
    if min_tokens:
        assert out.finish_reason == "error" and isinstance(out.exception, ContextLengthError)
        return
    assert out.finish_reason == "length" and out.error is None
    assert 0 < len(out.token_ids) < NUM_PAGES * BS - len(PROMPT)


def test_a_request_the_pin_ends_by_length_keeps_its_held_back_text(engine):
    """Its output is lead bytes ("é" cut after its first byte, each token one 0xC3 a logit_bias asks for): the
    detokenizer holds the last one back, and an end by the scheduler adds it as an end by max_tokens does (the
    text was '' with 23 tokens written: text and token ids disagreed)."""
    c3 = engine.tokenizer.encode("é", add_special_tokens=False)[0]
    params = SamplingParams(max_tokens=NUM_PAGES * BS - len(PROMPT), temperature=0, ignore_eos=True,
                            logit_bias={c3: 100})
    engine.add_request("whole", PROMPT, params)
    engine.adapter_pool.add("p@1", random_weights(2, rank=4, projs=ADAPTER_PROJS), pinned=True)
    engine.adapter_pool.load("p@1")
    out = _run(engine, max_steps=40)["whole"]
    assert out.finish_reason == "length" and out.token_ids == [c3] * len(out.token_ids)
    assert out.text == engine.tokenizer.decode(out.token_ids) == "\ufffd" * len(out.token_ids)


async def test_the_worker_answers_400_without_retry_after(aiohttp_client, tiny_llama_dir, tmp_path):
    """Over HTTP, streamed or not: a 400 naming the limit, no Retry-After (a retry cannot help); /v1/models and
    /tokenize give each model the max_model_len its requests may use whole: the base model the pool's, alpha the
    pool's less its own pages (they said the base model's for both, and a prompt cut to it was refused)."""
    from lorafleet.worker.server import create_app
    from lorafleet.worker.worker_config import WorkerConfig

    make_peft_adapter(tiny_llama_dir, tmp_path / "alpha", rank=4, seed=1, targets=list(ADAPTER_PROJS))
    engine = EngineConfig(model=str(tiny_llama_dir), dtype="float32", block_size=BS, num_pages=NUM_PAGES,
                          adapters=str(tmp_path))
    client = await aiohttp_client(create_app(WorkerConfig(engine=engine, served_model_name="tiny")))
    models = await (await client.get("/v1/models")).json()
    assert {m["id"]: m["max_model_len"] for m in models["data"]} == {"tiny": NUM_PAGES * BS, "alpha": 33}
    alpha_key = "alpha@" + next(m["stable"] for m in models["data"] if m["id"] == "alpha")  # one version named
    for model, limit in (("tiny", NUM_PAGES * BS), ("alpha", 33), (alpha_key, 33)):
        tokens = await (await client.post("/tokenize", json={"model": model, "prompt": "hello"})).json()
        assert tokens["max_model_len"] == limit, tokens
    exact = {"model": "alpha", "prompt": PROMPT, "max_tokens": 33 - len(PROMPT), "temperature": 0, "ignore_eos": True}
    resp = await client.post("/v1/completions", json=exact)  # the whole advertised length: served
    assert resp.status == 200 and (await resp.json())["usage"]["total_tokens"] == 33
    body = {"prompt": PROMPT, "max_tokens": NUM_PAGES * BS - len(PROMPT), "temperature": 0, "ignore_eos": True}
    for stream in (False, True):
        resp = await client.post("/v1/completions", json=body | {"model": "alpha", "stream": stream})
        error = (await resp.json())["error"]
        assert resp.status == 400 and "Retry-After" not in resp.headers, error
        assert "maximum context length is 33 tokens" in error["message"] and "alpha@" in error["message"]
        assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens", error
    resp = await client.post("/v1/completions", json=body | {"model": "tiny"})
    assert resp.status == 200 and (await resp.json())["choices"][0]["finish_reason"] == "length"
    # A prompt that alone is too long for what alpha leaves is the prompt's fault, not the max_tokens it never sent.
    resp = await client.post("/v1/completions", json={"model": "alpha", "prompt": [5] * 40, "max_tokens": 1})
    error = (await resp.json())["error"]
    assert resp.status == 400 and error["param"] == "prompt" and "the prompt has 40 tokens" in error["message"], error
    # A chat without max_tokens: the context left after the prompt, lowered to what alpha leaves (not refused
    # for a length the caller never asked for)
    chat = {"model": "alpha", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "ignore_eos": True}
    resp = await client.post("/v1/chat/completions", json=chat)
    out = await resp.json()
    assert resp.status == 200, out
    usage = out["usage"]
    assert out["choices"][0]["finish_reason"] == "length" and usage["prompt_tokens"] + usage["completion_tokens"] == 33
    # The same chat asking for at least 15 tokens (the context allows 24, alpha leaves 9): the min_tokens it sent.
    resp = await client.post("/v1/chat/completions", json=chat | {"min_tokens": 15})
    error = (await resp.json())["error"]
    assert resp.status == 400 and error["param"] == "min_tokens", error
    assert f"min_tokens asks for {usage['prompt_tokens'] + 15} tokens" in error["message"], error


def test_a_pinned_version_replacing_another_counts_once(engine):
    """p@1 is pinned and resident; a push adds p@2, pinned, which waits for pages a request holds: the name
    counts once (its larger version), so a base-model request that fits beside one of them is admitted and
    an unset max_tokens is not lowered for good."""
    engine.adapter_pool.add("p@1", random_weights(2, rank=4, projs=ADAPTER_PROJS), pinned=True)
    engine.adapter_pool.load("p@1")
    engine.add_request("busy", PROMPT, _params(23))
    for _ in range(19):
        engine.step()
    engine.adapter_pool.add("p@2", random_weights(3, rank=4, projs=ADAPTER_PROJS), pinned=True)
    assert not engine.adapter_pool.entry("p@2").on_gpu
    assert engine.adapter_pool.kv_held_pages(None) == (0, 4)
    engine.add_request("late", PROMPT, _params(23))
    fit = SamplingParams(max_tokens=NUM_PAGES * BS - len(PROMPT), temperature=0, ignore_eos=True, max_tokens_to_fit=True)
    engine.add_request("unset", PROMPT, fit)
    assert engine.requests["unset"].params.max_tokens == 23
    done = _run(engine, max_steps=200)
    assert {rid: o.finish_reason for rid, o in done.items()} == dict.fromkeys(("busy", "late", "unset"), "length")
    assert engine.adapter_pool.resolve("p") == "p@2"


def test_an_unset_max_tokens_lowered_below_what_was_generated_ends_by_length(engine):
    """A pin lands while a request without max_tokens runs on the whole pool: once it outgrows what p leaves
    it is preempted, and its max_tokens lowered to fit, no more than the tokens it has: it ends by length with
    what it has, not with an error after the stuck bound."""
    params = SamplingParams(max_tokens=NUM_PAGES * BS - len(PROMPT), temperature=0, ignore_eos=True,
                            max_tokens_to_fit=True)
    engine.add_request("whole", PROMPT, params)
    whole = engine.requests["whole"]
    for _ in range(5):
        engine.step()
    engine.adapter_pool.add("p@1", random_weights(2, rank=4, projs=ADAPTER_PROJS), pinned=True)
    engine.adapter_pool.load("p@1")
    out = _run(engine, max_steps=80)["whole"]
    assert out.finish_reason == "length" and out.error is None, out.error
    assert whole.params.max_tokens == 23 and len(out.token_ids) >= 23


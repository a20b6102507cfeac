"""Engine and adapter pool: a hot update replacing the version queued requests resolved before they could take
it (they keep it), or that a request gave back."""

from __future__ import annotations

import threading

import pytest

from lorafleet.worker import Engine, EngineConfig, SamplingParams
from lorafleet.worker.adapter_entry import AdapterNotFoundError
from lorafleet.worker.engine import UnknownAdapterError
from tests.lora_factory import random_weights

PROJS = ("q_proj", "v_proj")


def _engine(model_dir) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", num_pages=64, block_size=4))


def test_a_queued_request_keeps_the_version_it_resolved_though_a_hot_update_replaces_it_mid_load(tiny_llama_dir):
    """m@1 is still being read for a queued request when m@2 replaces it: m@1 stays registered for the request
    (held from its arrival), which runs on it once read, as a request keeps its version to the end (an n>1
    request's choices queued behind the others must not fail on a rollout); m@1 goes once it is done."""
    engine = _engine(tiny_llama_dir)
    try:
        gate = threading.Event()
        w1 = random_weights(1, rank=4, projs=PROJS)
        engine.adapter_pool.add("m@1", loader=lambda: gate.wait(30) and w1)
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        engine.add_request("r", [1, 2, 3], params, adapter="m")
        assert engine.step() == [] and engine.num_waiting == 1  # m@1's read is under way
        engine.adapter_pool.add("m@2", random_weights(2, rank=4, projs=PROJS))
        engine.adapter_pool.load("m@2")  # resident: current, while m@1's read still waits
        assert engine.adapter_pool.resolve("m") == "m@2"
        gate.set()
        outs = []
        for _ in range(100):
            outs += [o for o in engine.step() if o.finished]
            engine.adapter_pool.wait_idle()
            if not engine.has_unfinished():
                break
        assert [(o.request_id, o.finish_reason, o.adapter) for o in outs] == [("r", "length", "m@1")]
        assert engine.adapters() == ["m@2"]
        engine.adapter_pool.check()
    finally:
        engine.close()


def test_a_request_let_go_of_its_version_finishes_on_it_though_a_push_replaces_it(tiny_llama_dir):
    """When nothing runs and the head of the queue cannot get room, the other queued requests give their
    adapters back, so that idle adapters can give up their pages. A preempted request that had streamed tokens
    gave its version back too: a push replacing that version then dropped it, and the request ended with
    "not registered" mid-stream. Its version now waits for it (detached), and it finishes on it."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for num_pages in range(18, 34):
        engine = Engine(EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32", block_size=4,
                                     num_pages=num_pages, max_num_seqs=4, max_num_batched_tokens=64))
        try:
            engine.adapter_pool.add("x@1", random_weights(1, rank=4, projs=PROJS, name="x", version="1"))
            engine.adapter_pool.add("y@1", random_weights(2, rank=4, projs=PROJS, name="y", version="1"))
            engine.add_request("P1", list(range(10, 20)), params, adapter="x", tenant="A")
            engine.add_request("P2", list(range(30, 40)), params, adapter="y", tenant="B")
            outs, replaced = {}, None
            for _ in range(20000):
                outs.update((o.request_id, o) for o in engine.step() if o.finished)
                let_go = [s for s in engine.scheduler.waiting
                          if s.output_token_ids and s.adapter is not None and s.adapter_slot is None]
                if replaced is None and let_go:  # streamed tokens, and holds its version no more
                    seq = let_go[0]
                    name = seq.adapter.split("@")[0]
                    replaced = seq.request_id, seq.adapter
                    engine.adapter_pool.add(f"{name}@2", random_weights(99, rank=4, projs=PROJS, name=name,
                                                                        version="2"))
                    engine.adapter_pool.make_current(f"{name}@2")
                if not engine.has_unfinished():
                    break
            if replaced is None:
                continue  # the queue was never stuck at this size: the next one
            request_id, version = replaced
            assert outs[request_id].finish_reason == "length", outs[request_id].error
            assert outs[request_id].adapter == version and len(outs[request_id].token_ids) == 40
            assert {o.finish_reason for o in outs.values()} == {"length"}
            engine.page_pool.check()
            engine.adapter_pool.check()
            assert engine.adapter_pool.resolve(version.split("@")[0]).endswith("@2")
            with pytest.raises(AdapterNotFoundError):  # gone once its request was done with it
                engine.adapter_pool.resolve(version)
            return
        finally:
            engine.close()
    raise AssertionError("no pool size made a request with output let go of its adapter")


def test_requests_queued_behind_the_seats_finish_on_the_version_they_resolved_through_a_rollout(tiny_llama_dir):
    """One seat, three requests for x (x@1): x@2 goes live while two of them still wait for the seat (an n=3
    request's choices). They finish on x@1, which goes once the last is done; new requests get x@2."""
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32", num_pages=64,
                                 block_size=4, max_num_seqs=1))
    try:
        engine.adapter_pool.add("x@1", random_weights(1, rank=4, projs=PROJS, name="x", version="1"))
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        for i in range(3):
            engine.add_request(f"r{i}", [1, 2, 3 + i], params, adapter="x")
        outs = [o for _ in range(3) for o in engine.step() if o.finished]
        engine.adapter_pool.add("x@2", random_weights(2, rank=4, projs=PROJS, name="x", version="2"))
        engine.adapter_pool.load("x@2")
        engine.add_request("new", [1, 2, 9], params, adapter="x")
        while engine.has_unfinished():
            outs += [o for o in engine.step() if o.finished]
            engine.adapter_pool.wait_idle()
        assert sorted((o.request_id, o.finish_reason, o.adapter) for o in outs) == [
            ("new", "length", "x@2"), ("r0", "length", "x@1"), ("r1", "length", "x@1"), ("r2", "length", "x@1")]
        assert engine.adapters() == ["x@2"]
        engine.adapter_pool.check()
    finally:
        engine.close()


def test_a_replaced_version_goes_once_the_requests_before_the_push_are_done_and_let_go_keeps_the_hold(tiny_llama_dir):
    """A queued request keeps its version when the scheduler makes it give its adapter back (nothing runs, another
    is stuck), so a push then fails it no more than one still holding it; and a request naming the replaced
    version after the push (x@1) is refused at once: only those before the push keep it, and then it is gone."""
    from lorafleet.worker.sequence import Sequence

    engine = Engine(EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32", num_pages=64,
                                 block_size=4, max_num_seqs=1))
    try:
        pool = engine.adapter_pool
        pool.add("x@1", random_weights(1, rank=4, projs=PROJS, name="x", version="1"))
        pool.load("x@1")
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        engine.add_request("r0", [1, 2, 3], params, adapter="x")
        engine.add_request("r1", [1, 2, 4], params, adapter="x")
        engine.scheduler._let_go_of_adapters(but=Sequence("stuck", [1], SamplingParams()))
        pool.add("x@2", random_weights(2, rank=4, projs=PROJS, name="x", version="2"))
        pool.load("x@2")
        with pytest.raises(UnknownAdapterError):
            engine.add_request("late", [1, 2, 5], params, adapter="x@1")  # named after the push
        outs = []
        while engine.has_unfinished():
            outs += [o for o in engine.step() if o.finished]
            pool.wait_idle()
        assert sorted((o.request_id, o.finish_reason, o.adapter) for o in outs) == [
            ("r0", "length", "x@1"), ("r1", "length", "x@1")]
        assert engine.adapters() == ["x@2"] and [e.key for e in pool._entries.values()] == ["x@2"]
        with pytest.raises(UnknownAdapterError):
            engine.add_request("later", [1, 2, 6], params, adapter="x@1")
        pool.check()
    finally:
        engine.close()


def _generate(engine: Engine, requests: dict[str, tuple[list[int], str]], params: SamplingParams,
              on_step=lambda: None) -> dict[str, tuple[str, list[int]]]:
    for rid, (prompt, adapter) in requests.items():
        engine.add_request(rid, prompt, params, adapter=adapter, tenant=rid)
    outs = {}
    for _ in range(5000):
        outs.update((o.request_id, (o.finish_reason, list(o.token_ids))) for o in engine.step() if o.finished)
        engine.adapter_pool.wait_idle()  # loads and copies land between steps: the same schedule on every run
        on_step()
        if not engine.has_unfinished():
            return outs
    raise AssertionError(f"not done: {engine.requests}")


def test_a_running_request_whose_version_a_push_replaced_finishes_on_it_though_let_go_of(tiny_llama_dir):
    """Requests already generating on x@1 and y@1 when x@2 and y@2 replace them keep their versions. With a
    pool too small for both, one is preempted and then made to give its adapter back while the other is stuck
    (the scheduler's let-go): its replaced version may leave the GPU but stays registered for it alone, and it
    finishes on it with the tokens it gets undisturbed (it failed mid-stream, "not registered")."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    requests = {"P1": (list(range(10, 20)), "x"), "P2": (list(range(30, 40)), "y")}
    weights = {name: random_weights(seed, rank=4, projs=PROJS, name=name, version="1")
               for name, seed in (("x", 1), ("y", 2))}
    alone = _engine(tiny_llama_dir)
    try:
        for name, w in weights.items():
            alone.adapter_pool.add(f"{name}@1", w)
        expected = {rid: _generate(alone, {rid: req}, params)[rid] for rid, req in requests.items()}
    finally:
        alone.close()
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32", num_pages=18,
                                 block_size=4, max_num_seqs=4, max_num_batched_tokens=64))
    pushed, let_go = set(), set()

    def push_once_generating():
        for rid, (_, name) in requests.items():
            seq = engine.requests.get(rid)
            if seq is None or not seq.output_token_ids:
                continue
            if name not in pushed and seq.adapter_slot is not None:
                engine.adapter_pool.add(f"{name}@2", random_weights(99, rank=4, projs=PROJS, name=name, version="2"))
                engine.adapter_pool.make_current(f"{name}@2")
                pushed.add(name)
            elif name in pushed and seq.adapter_slot is None:
                let_go.add(rid)  # it gave its replaced version back with output streamed
                assert engine.adapters() == sorted(f"{n}@2" for n in pushed)  # ...which no new request names

    try:
        for name, w in weights.items():
            engine.adapter_pool.add(f"{name}@1", w)
        outs = _generate(engine, requests, params, on_step=push_once_generating)
        assert pushed == {"x", "y"} and let_go, "the pool was meant to make one request give its version back"
        assert outs == expected
        assert sorted(e.key for e in engine.adapter_pool._entries.values()) == ["x@2", "y@2"]
        engine.adapter_pool.check()
    finally:
        engine.close()


def test_queued_requests_whose_replaced_version_can_never_come_back_are_sent_to_the_current_one(tiny_llama_dir):
    """One slot (--max-loras 1), x@1 pinned with requests queued behind one seat; a push brings a pinned x@2,
    which takes x@1's slot as a pinned successor does. The queued requests keep x@1, which can never get a slot
    again: those with nothing generated fail as for an unknown version (UnknownAdapterError: the job resolves
    the name again and runs on x@2), not with a load error the client would get."""
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32", num_pages=64,
                                 block_size=4, max_num_seqs=1, max_loras=1))
    try:
        pool = engine.adapter_pool
        pool.add("x@1", random_weights(1, rank=4, projs=PROJS, name="x", version="1"), pinned=True)
        pool.load("x@1")
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        for i in range(3):
            engine.add_request(f"r{i}", [1, 2, 3 + i], params, adapter="x")
        outs = [o for _ in range(2) for o in engine.step() if o.finished]
        pool.add("x@2", random_weights(2, rank=4, projs=PROJS, name="x", version="2"), pinned=True)
        for _ in range(200):
            if not engine.has_unfinished():
                break
            outs += [o for o in engine.step() if o.finished]
            pool.wait_idle()
        by_id = {o.request_id: o for o in outs}
        assert by_id["r0"].finish_reason == "length" and by_id["r0"].adapter == "x@1"
        for rid in ("r1", "r2"):
            assert isinstance(by_id[rid].exception, UnknownAdapterError), by_id[rid].error
        engine.add_request("again", [1, 2, 4], params, adapter="x")  # what the job does: x@2 serves it
        while engine.has_unfinished():
            outs += [o for o in engine.step() if o.finished]
            pool.wait_idle()
        assert next(o for o in outs if o.request_id == "again").adapter == "x@2"
        assert sorted(e.key for e in pool._entries.values()) == ["x@2"]
        pool.check()
    finally:
        engine.close()


def test_a_version_gone_between_resolving_and_holding_it_is_an_unknown_adapter(tiny_llama_dir, monkeypatch):
    """A push on another thread may retire the version a request just resolved before the request holds it: the
    request is refused as for an unknown version (its job resolves the name again), not queued on a version
    that a let-go would then drop under it."""
    engine = _engine(tiny_llama_dir)
    try:
        pool = engine.adapter_pool
        pool.add("x@1", random_weights(1, rank=4, projs=PROJS, name="x", version="1"))
        real = pool.resolve

        def resolve_then_push(name):
            key = real(name)
            pool.add("x@2", random_weights(2, rank=4, projs=PROJS, name="x", version="2"))
            pool.make_current("x@2")
            return key

        monkeypatch.setattr(pool, "resolve", resolve_then_push)
        with pytest.raises(UnknownAdapterError):
            engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2), adapter="x")
        assert not engine.requests and sorted(pool._entries) == ["x@2"]
        pool.check()
    finally:
        engine.close()

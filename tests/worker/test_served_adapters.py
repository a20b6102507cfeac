"""worker/served_adapters.py: the HTTP layer's registry, against a recording stand-in of the engine
(the end-to-end behaviour with the real engine is in test_server.py)."""

from __future__ import annotations

import contextlib

import pytest

from lorafleet.worker.directives import DesiredState
from lorafleet.worker.openai_protocol import APIError
from lorafleet.worker.served_adapters import ServedAdapters
from lorafleet.worker.tenants import Tenant


class RecordingHost:
    def __init__(self, failing: set[str] = frozenset()) -> None:
        self.keys: dict[str, dict] = {}
        self.calls: list[tuple] = []
        self.failing = failing
        self.warm: dict[str, bool] = {}  # key -> the warm flag of the last push naming it

    def register_adapter(self, name, source, *, version=None, tenant=None, pinned=False, make_current=True,
                         sha256=None, keep_previous=None):
        self.calls.append(("register", f"{name}@{version}", make_current))
        if source in self.failing:
            raise ValueError(f"{source}: adapter_model.safetensors is corrupt")
        # Loaded, on the GPU; a test sets "tier" to "cpu" (only in memory), "disk" or "none" where it is not.
        self.keys[f"{name}@{version}"] = {"key": f"{name}@{version}", "name": name, "version": version,
                                         "tier": "gpu", "refcount": 0, "hits": 0, "bytes": 10, "pinned": pinned}
        return f"{name}@{version}"

    def make_adapter_current(self, key, *, if_resident=False, keep_previous=None):
        self.calls.append(("make_current", key))
        return True

    def unregister_adapter(self, name):
        self.calls.append(("unregister", name))
        self.keys = {k: v for k, v in self.keys.items() if v["name"] != name}

    def remove_adapter_version(self, key):
        self.calls.append(("remove", key))
        self.keys.pop(key)

    def set_adapter_pinned(self, key, pinned):
        self.keys[key]["pinned"] = pinned

    def set_adapter_priority(self, key, priority):
        self.keys[key]["priority"] = priority

    def set_adapter_tenant(self, key, tenant):
        self.calls.append(("tenant", key, tenant))
        self.keys[key]["tenant"] = tenant

    def set_adapter_warm(self, key, warm):
        self.warm[key] = warm

    def prefetch_adapter(self, key):
        self.calls.append(("prefetch", key))

    def describe_adapters(self):
        return list(self.keys.values())


def state(generation: int, *adapters: dict) -> DesiredState:
    return DesiredState.from_dict({"generation": generation, "adapters": list(adapters)})


SQL = {"name": "sql", "tenant": "acme", "stable": {"version": "v1", "uri": "/c/sql/v1"}, "warm": True}
SQL_CANARY = SQL | {"canary": {"version": "v2", "uri": "/c/sql/v2"}, "canary_weight": 50}
ACME, GLOBEX = Tenant("acme"), Tenant("globex", ("chat",))


def test_push_registers_resolves_and_reports():
    host, served = RecordingHost(), ServedAdapters("base")
    assert served.apply(state(1, SQL_CANARY), host)
    assert ("register", "sql@v1", True) in host.calls and ("register", "sql@v2", False) in host.calls
    assert ("prefetch", "sql@v1") in host.calls
    picks = {served.resolve("sql", ACME, f"u{i}") for i in range(40)}
    assert picks == {"sql@v1", "sql@v2"}
    assert served.resolve("sql@v2", ACME, None) == "sql@v2"
    assert served.resolve("base", ACME, None) is None
    report = served.report(host)
    assert report.generation_applied == 1 and {(a.name, a.version) for a in report.adapters} == {
        ("sql", "v1"), ("sql", "v2")}
    assert served.extras()["sql@v2"] == {"tenant": "acme", "traffic_percent": 50}


def test_generations_same_is_noop_older_is_409():
    host, served = RecordingHost(), ServedAdapters("base")
    served.apply(state(3, SQL), host)
    calls = len(host.calls)
    assert served.apply(state(3, SQL), host) is False and len(host.calls) == calls
    with pytest.raises(APIError) as exc:
        served.apply(state(2), host)
    assert exc.value.status == 409 and served.resolve("sql", ACME, None) == "sql@v1"


def test_resolution_errors_are_404_403_503():
    host, served = RecordingHost(failing={"/c/bad/v1"}), ServedAdapters("base")
    served.apply(state(1, SQL, {"name": "bad", "tenant": "acme", "stable": {"version": "v1", "uri": "/c/bad/v1"}}),
                 host)
    for model, tenant, status in [("nope", ACME, 404), ("sql@v9", ACME, 404), ("sql", GLOBEX, 404), ("sql@", ACME, 404),
                                  ("bad", ACME, 503), ("base", Tenant("t", base_model=False), 403)]:
        with pytest.raises(APIError) as exc:
            served.resolve(model, tenant, None)
        assert exc.value.status == status, model
        assert "/c/" not in exc.value.message  # the failed load's path is cut to its last part
    assert "corrupt" in served.report(host).adapters[0].error or "corrupt" in served.report(host).adapters[1].error
    served.mark_failed("sql@v1", "disk read failed")
    with pytest.raises(APIError, match="disk read failed"):
        served.resolve("sql", ACME, None)


def test_a_canary_that_fails_to_load_later_sends_its_users_back_to_stable():
    """A canary registered fine but whose load fails when traffic reaches it (the engine reports it, the
    request that hit it is answered 503): its share of users must go back to the stable version, not be
    answered 503 until the next push."""
    host, served = RecordingHost(), ServedAdapters("base")
    served.apply(state(1, SQL_CANARY), host)
    users = [f"u{i}" for i in range(40)]
    assert {served.resolve("sql", ACME, u) for u in users} == {"sql@v1", "sql@v2"}
    served.mark_failed("sql@v2", "adapter_model.safetensors: truncated")
    assert {served.resolve("sql", ACME, u) for u in users} == {"sql@v1"}
    with pytest.raises(APIError, match="truncated") as exc:  # pinning the failed version says why
        served.resolve("sql@v2", ACME, None)
    assert exc.value.status == 503
    assert served.extras()["sql@v1"]["traffic_percent"] == 100 and served.extras()["sql@v2"]["traffic_percent"] == 0
    assert {a.version: a.error for a in served.report(host).adapters}["v2"] == "adapter_model.safetensors: truncated"
    served.apply(state(2, SQL_CANARY), host)  # the retry loads it again: the split is back
    assert {served.resolve("sql", ACME, u) for u in users} == {"sql@v1", "sql@v2"}


@pytest.mark.parametrize("rollout", [
    SQL | {"stable": {"version": "v2", "uri": "/c/bad/v2"}},  # a new version
    SQL | {"stable": {"version": "v2", "uri": "/c/bad/v2"}, "canary": {"version": "v1", "uri": "/c/sql/v1"},
           "canary_weight": 10},  # a new version, the old one kept as the canary
])
def test_a_new_stable_version_that_fails_to_register_leaves_the_old_one_serving(rollout):
    """The engine keeps the current version until a registered new one replaces it: the served table must
    too, or a bad rollout answers every request 503 while the working version sits unused."""
    host, served = RecordingHost(failing={"/c/bad/v2"}), ServedAdapters("base")
    served.apply(state(1, SQL), host)
    served.apply(state(2, rollout), host)
    assert ("remove", "sql@v1") not in host.calls and "sql@v1" in host.keys
    assert {served.resolve("sql", ACME, f"u{i}") for i in range(40)} == {"sql@v1"}
    errors = {a.version: a.error for a in served.report(host).adapters}
    assert errors["v1"] is None and "corrupt" in errors["v2"]
    with pytest.raises(APIError) as exc:
        served.resolve("sql@v2", ACME, None)
    assert exc.value.status == 503
    served.apply(state(3, rollout), host)  # retried, still failing: still the old version
    assert served.resolve("sql", ACME, "u1") == "sql@v1"
    host.failing, calls = set(), len(host.calls)
    served.apply(state(4, rollout), host)  # it loads now: it becomes current, the old one goes or stays canary
    # registered as the current version (the engine switches once it is loaded), or switched now (v1 the canary)
    assert {("register", "sql@v2", True), ("make_current", "sql@v2")} & set(host.calls[calls:])
    assert served.resolve("sql", ACME, "u1") in ("sql@v2", "sql@v1")
    assert served.get("sql").split.stable == "v2" and not served.get("sql").errors


def test_a_new_adapter_that_fails_has_nothing_to_fall_back_to():
    host, served = RecordingHost(failing={"/c/sql/v1"}), ServedAdapters("base")
    served.apply(state(1, SQL), host)
    with pytest.raises(APIError) as exc:
        served.resolve("sql", ACME, None)
    assert exc.value.status == 503


@pytest.mark.parametrize("model", ["sql", "sql@v1", "sql@v9"])
def test_another_tenants_adapter_is_answered_as_one_that_does_not_exist(model):
    """An answer that differs between "exists, but not yours" and "does not exist" would let any tenant
    probe for the names (and versions) of the others' adapters."""
    host, served = RecordingHost(), ServedAdapters("base")
    served.apply(state(1, SQL), host)
    answers = []
    for probe in (model, model.replace("sql", "nope")):
        with pytest.raises(APIError) as exc:
            served.resolve(probe, GLOBEX, None)
        err = exc.value
        answers.append((err.status, err.type, err.code, err.param, err.message.replace(probe, "<model>")))
    assert answers[0] == answers[1] and answers[0][:3] == (404, "invalid_request_error", "model_not_found")


def test_a_push_replaces_the_set_and_retires_old_versions_after_publishing():
    host, served = RecordingHost(), ServedAdapters("base")
    served.apply(state(1, SQL_CANARY, {"name": "chat", "tenant": "globex",
                                       "stable": {"version": "c1", "uri": "/c/chat/c1"}}), host)
    promoted = SQL | {"stable": {"version": "v2", "uri": "/c/sql/v2"}}
    served.apply(state(2, promoted), host)
    assert ("remove", "sql@v1") in host.calls and ("unregister", "chat") in host.calls
    assert ("register", "sql@v2", True) not in host.calls  # v2 was already registered: kept, not reloaded
    assert ("make_current", "sql@v2") in host.calls  # ...and promoted, which retires v1
    assert ("make_current", "sql@v1") not in host.calls
    assert served.names() == ["sql"] and served.resolve("sql", ACME, "anyone") == "sql@v2"
    with pytest.raises(APIError):
        served.resolve("chat", GLOBEX, None)


def test_load_inplace_keeps_the_owner_and_refuses_a_name_with_a_canary():
    """load_inplace over a pushed adapter keeps its owner (the new version is charged to and served to the same
    tenant); over one serving a canary it is refused: which version the new weights replace would be a guess."""
    host, served = RecordingHost(), ServedAdapters("base")
    served.apply(state(1, SQL), host)
    served.load("sql", "/c/sql/v9", host, inplace=True)
    key = served.resolve("sql", ACME, None)
    assert served.get("sql").tenant == "acme" and host.warm[key]  # owner and warmth kept
    with pytest.raises(APIError) as exc:
        served.resolve("sql", GLOBEX, None)
    assert exc.value.status == 404
    served.apply(state(2, SQL_CANARY), host)
    with pytest.raises(APIError) as exc:
        served.load("sql", "/c/sql/v9", host, inplace=True)
    assert exc.value.status == 400 and "canary" in exc.value.message


def test_object_store_sources_must_be_staged_first():
    host, served = RecordingHost(), ServedAdapters("base")
    served.apply(state(1, SQL | {"stable": {"version": "v1", "uri": "s3://bucket/sql/v1/"}}), host)
    with pytest.raises(APIError) as exc:
        served.resolve("sql", ACME, None)
    assert exc.value.status == 503 and "not staged" in exc.value.message and not host.keys


def test_vllm_load_unload():
    host, served = RecordingHost(), ServedAdapters("base")
    assert served.load("x", "/p/x", host) == "x@None"
    with pytest.raises(APIError) as exc:
        served.load("x", "/p/x", host)
    assert exc.value.status == 400
    served.unload("x", host)
    with pytest.raises(APIError) as exc:
        served.unload("x", host)
    assert exc.value.status == 404
    with pytest.raises(APIError) as exc:  # not "already loaded; unload it first": unloading the base model is a 404
        served.load("base", "/p/x", host)
    assert exc.value.status == 400 and "served model name of the base model" in exc.value.message


class CrashingHost(RecordingHost):
    """A registration that fails with an unexpected exception type (a validator's bug, say)."""

    def register_adapter(self, name, source, **kw):
        if source == "/c/crash/v1":
            raise AttributeError("'list' object has no attribute 'get'")
        return super().register_adapter(name, source, **kw)


def test_one_failing_adapter_does_not_abort_the_push():
    host, served = CrashingHost(), ServedAdapters("base")
    crash = {"name": "crash", "tenant": "acme", "stable": {"version": "v1", "uri": "/c/crash/v1"}}
    assert served.apply(state(1, crash, SQL), host)
    assert served.generation == 1 and served.names() == ["crash", "sql"]
    assert served.resolve("sql", ACME, None) == "sql@v1"  # the valid adapter of the push is served
    with pytest.raises(APIError) as exc:
        served.resolve("crash", ACME, None)
    assert exc.value.status == 503 and "no attribute 'get'" in exc.value.message
    errors = {(a.name, a.version): a.error for a in served.report(host).adapters}
    assert errors[("sql", "v1")] is None and "no attribute 'get'" in errors[("crash", "v1")]


@pytest.mark.parametrize("uri", ["file://../outside/secret", "file://relative/dir", "/c/../../etc",
                                 "file:///c/x/../../y"])
def test_relative_and_dotdot_sources_are_never_registered(uri):
    """They would be read relative to the worker's working directory, past the adapter roots."""
    host, served = RecordingHost(), ServedAdapters("base")
    served.apply(state(1, SQL | {"stable": {"version": "v1", "uri": uri}}), host)
    assert not host.keys and "absolute path without '..'" in served.report(host).adapters[0].error
    for path in (uri, uri.removeprefix("file://")):
        with pytest.raises(APIError) as exc:
            served.load("x", path, host)
        assert exc.value.status == 400 and "absolute path without '..'" in exc.value.message and not host.keys


@contextlib.contextmanager
def _real_engine_with_good_and_bad(tiny_llama_dir, tmp_path):
    """A CPU engine, its adapter host, and two adapters: `good`, and `bad` whose tokenizer.json is no tokenizer."""
    from lorafleet.worker import Engine, EngineConfig
    from lorafleet.worker.engine_adapters import EngineAdapters
    from tests.lora_factory import make_peft_adapter

    good = make_peft_adapter(tiny_llama_dir, tmp_path / "good", rank=4, seed=1)
    bad = make_peft_adapter(tiny_llama_dir, tmp_path / "bad", rank=4, seed=2)
    (bad / "tokenizer.json").write_text("[]")  # valid JSON, not a tokenizer
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32"))
    try:
        yield engine, EngineAdapters(engine), good, bad
    finally:
        engine.close()


def test_a_bad_tokenizer_file_fails_only_its_adapter_with_the_real_engine(tiny_llama_dir, tmp_path):
    with _real_engine_with_good_and_bad(tiny_llama_dir, tmp_path) as (engine, host, good, bad):
        served = ServedAdapters("base")
        served.apply(state(1, {"name": "bad", "tenant": "t", "stable": {"version": "v1", "uri": str(bad)}},
                           {"name": "good", "tenant": "t", "stable": {"version": "v1", "uri": str(good)}}), host)
        assert served.generation == 1 and engine.adapters() == ["good@v1"]
        assert served.resolve("good", Tenant("t"), None) == "good@v1"
        with pytest.raises(APIError) as exc:
            served.resolve("bad", Tenant("t"), None)
        assert exc.value.status == 503 and "failed to load: bad/tokenizer.json: not a readable tokenizer file" in \
            exc.value.message  # the adapter's own folder and file: the folders above it are the worker's
        assert str(tmp_path) not in exc.value.message


def test_a_failed_rollout_keeps_the_real_engines_current_version(tiny_llama_dir, tmp_path):
    with _real_engine_with_good_and_bad(tiny_llama_dir, tmp_path) as (engine, host, good, bad):
        served = ServedAdapters("base")
        sql = {"name": "sql", "tenant": "t", "stable": {"version": "v1", "uri": str(good)}}
        served.apply(state(1, sql), host)
        served.apply(state(2, sql | {"stable": {"version": "v2", "uri": str(bad)}}), host)
        assert served.resolve("sql", Tenant("t"), None) == "sql@v1"
        assert engine.adapters() == ["sql@v1"] and engine.adapter_pool.resolve("sql") == "sql@v1"
        engine.adapter_pool.load("sql@v1")  # it still serves


@pytest.mark.parametrize("endpoint", ["load", "push"])
def test_a_weights_file_swapped_for_a_link_out_of_the_roots_after_its_check_is_never_loaded(
        tiny_llama_dir, tmp_path, monkeypatch, endpoint):
    """The admin endpoints check a local folder in the adapter roots, then the engine reads it: a file swapped
    between the two for a link out of the roots (another tenant's weights) would be loaded unchecked. The check
    hashes each file from a descriptor found in the roots, and the load must read those bytes: the swap is
    refused, and nothing is registered."""
    from aiohttp import web

    from lorafleet.worker import admin_api
    from lorafleet.worker.app_keys import ADAPTERS, HOST, SOURCES
    from lorafleet.worker.sources import Sources, SourcesConfig

    with _real_engine_with_good_and_bad(tiny_llama_dir, tmp_path / "roots") as (engine, host, good, other):
        outside = tmp_path / "outside"
        (other / "tokenizer.json").unlink()
        other.rename(outside)  # another adapter's weights, out of the roots
        sources = Sources(SourcesConfig(local_roots=[str(tmp_path / "roots")]))
        checked = sources.verify_local

        def check_then_swap(path, sha256, where, *args):
            digest = checked(path, sha256, where, *args)
            weights = path / "adapter_model.safetensors"
            weights.unlink()
            weights.symlink_to(outside / "adapter_model.safetensors")  # after the check, before the load
            return digest

        monkeypatch.setattr(sources, "verify_local", check_then_swap)
        app = web.Application()
        app[SOURCES], app[ADAPTERS], app[HOST] = sources, ServedAdapters("base"), host
        if endpoint == "load":
            with pytest.raises(APIError, match="sha256 mismatch") as exc:
                admin_api._load_adapter(app, "good", str(good))
            assert exc.value.status == 400
        else:
            push = state(1, {"name": "good", "tenant": "t", "stable": {"version": "v1", "uri": str(good)}})
            admin_api._apply_state(app, push)
            assert "sha256 mismatch" in app[ADAPTERS].report(host).adapters[0].error
        assert engine.adapters() == []

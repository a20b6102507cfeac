"""The operator -> stager -> engine desired-state schema: round trips and refusals that name the field."""

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lorafleet.worker.directives import (
    AdapterDirective,
    AdapterState,
    DesiredState,
    DirectiveError,
    ReportedState,
    VersionRef,
)

SHA = "a" * 64


def _directive(**kw) -> AdapterDirective:
    base = dict(name="sql", tenant="acme", stable=VersionRef("v2", "s3://adapters/sql/v2/", SHA))
    base.update(kw)
    return AdapterDirective(**base)


def test_desired_state_round_trip_with_canary():
    state = DesiredState(7, [_directive(canary=VersionRef("v3", "s3://adapters/sql/v3/"), canary_weight=20,
                                        warm=True, pinned=True, priority=5),
                             _directive(name="chat", tenant="beta")])
    back = DesiredState.from_json(state.to_json())
    assert back == state
    assert back.by_name()["sql"].versions == ("v2", "v3")
    local = DesiredState(8, [_directive(stable=VersionRef("v2", "/data/acme/sql/", SHA, ("/data/acme/", "file:///x/")))])
    assert DesiredState.from_json(local.to_json()) == local
    assert back.by_name()["chat"].versions == ("v2",)


names = st.from_regex(r"[a-z0-9][a-z0-9._-]{0,20}", fullmatch=True)


@settings(deadline=None)  # a loaded machine's stall is no failure
@given(gen=st.integers(0, 2**40), name=names, version=names, weight=st.integers(0, 100),
       warm=st.booleans(), pinned=st.booleans(), priority=st.integers(-100, 100))
def test_desired_state_round_trip_property(gen, name, version, weight, warm, pinned, priority):
    canary = VersionRef(version + "-c", "file:///x") if weight else None
    state = DesiredState(gen, [_directive(name=name, stable=VersionRef(version, "/cache/a"), canary=canary,
                                          canary_weight=weight, warm=warm, pinned=pinned, priority=priority)])
    assert DesiredState.from_json(state.to_json()) == state


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"generation": -1, "adapters": []}, "generation"),
        ({"generation": "3", "adapters": []}, "generation"),
        ({"generation": 1, "adapters": {}}, "adapters"),
        ({"generation": 1, "adapters": [{"name": "a", "tenant": "t",
                                         "stable": {"version": "v1", "uri": "http://x"}}]}, "stable.uri"),
        ({"generation": 1, "adapters": [{"name": "a", "tenant": "t",
                                         "stable": {"version": "v1", "uri": "s3://b/p", "sha256": "zz"}}]},
         "stable.sha256"),
        ({"generation": 1, "adapters": [{"name": "a", "tenant": "t", "stable": {"version": "v1", "uri": "/p"},
                                         "canary_weight": 20}]}, "canary_weight"),
        ({"generation": 1, "adapters": [{"name": "a", "tenant": "t", "stable": {"version": "v1", "uri": "/p"},
                                         "canary": {"version": "v2", "uri": "/q"}, "canary_weight": 101}]},
         "canary_weight"),
        ({"generation": 1, "adapters": [{"name": "a", "tenant": "t", "stable": {"version": "v1", "uri": "/p"},
                                         "canary": {"version": "v1", "uri": "/q"}}]}, "canary.version"),
        ({"generation": 1, "adapters": [{"name": "../etc", "tenant": "t",
                                         "stable": {"version": "v1", "uri": "/p"}}]}, "name"),
        # A trailing newline (`$` took it) or a control character would forge a line in the logs.
        ({"generation": 1, "adapters": [{"name": "a\n", "tenant": "t",
                                         "stable": {"version": "v1", "uri": "/p"}}]}, "name"),
        ({"generation": 1, "adapters": [{"name": "a", "tenant": "t",
                                         "stable": {"version": "v1\n", "uri": "/p"}}]}, "version"),
        ({"generation": 1, "adapters": [{"name": "a", "tenant": "t",
                                         "stable": {"version": "v1", "uri": "/p\nCRITICAL x"}}]}, "uri"),
        ({"generation": 1, "adapters": [{"name": "a", "tenant": "t", "stable": {
            "version": "v1", "uri": "/p", "sha256": "0" * 64 + "\n"}}]}, "sha256"),
        ({"generation": 1, "adapters": [{"name": "a", "tenant": "t", "stable": {"version": "v1", "uri": "/p"}},
                                        {"name": "a", "tenant": "t", "stable": {"version": "v2", "uri": "/p"}}]},
         "adapters"),
        ({"generation": 1, "adapters": [{"name": "a", "tenant": "t", "stable": {
            "version": "v1", "uri": "/p/a/", "within": "/p/"}}]}, "stable.within"),
        ({"generation": 1, "adapters": [{"name": "a", "tenant": "t", "stable": {
            "version": "v1", "uri": "/p/a/", "within": ["s3://p/"]}}]}, "stable.within"),
        ({"generation": 1, "adapters": [{"name": "a", "tenant": "t", "stable": {
            "version": "v1", "uri": "/p/a/", "within": ["/p"]}}]}, "stable.within"),
        ({"generation": 1, "adapters": [{"name": "a", "tenant": "t", "stable": {
            "version": "v1", "uri": "/p/a/", "within": [f"/p{i}/" for i in range(33)]}}]}, "stable.within"),
        ({"generation": 1, "adapters": [{"name": "a", "tenant": "t", "stable": {
            "version": "v1", "uri": "/p/a/", "within": ["/p/"], "without": "/p/"}}]}, "stable.without"),
        ({"generation": 1, "adapters": [{"name": "a", "tenant": "t", "stable": {
            "version": "v1", "uri": "/p/a/", "within": ["/p/"], "without": ["/p"]}}]}, "stable.without"),
    ],
)
def test_desired_state_refusals_name_the_field(payload, field):
    with pytest.raises(DirectiveError, match=field.replace(".", r"\.")):
        DesiredState.from_json(json.dumps(payload))


def test_messages_write_every_field_as_the_dataclass_holds_it():
    """to_dict is written by hand (dataclasses.asdict took seconds for a pool's 150,000 adapters): it must
    still carry every field, nested ones too, as asdict would."""
    state = DesiredState(7, [_directive(stable=VersionRef("v2", "/data/acme/sql/v2/", SHA, ("/data/acme/",),
                                                                           ("/data/acme/legacy/",)),
                                        canary=VersionRef("v3", "s3://adapters/sql/v3/"), canary_weight=20,
                                        warm=True, pinned=True, priority=5)], eviction="lfu", cpu_bytes=1 << 30)
    want = json.loads(json.dumps(dataclasses.asdict(state)))  # tuples as the lists JSON holds
    assert want["adapters"][0]["canary"].pop("within") == []  # empty: left out, as an older operator sends it
    assert want["adapters"][0]["canary"].pop("without") == []
    assert json.loads(json.dumps(state.to_dict())) == want
    assert "eviction" not in DesiredState(1, [_directive()]).to_dict()  # the worker's own: left out
    report = ReportedState(generation_applied=3, pool_bytes=1 << 20, pool_slots=4, error="stale",
                           adapters=[AdapterState("sql", "v2", "gpu", refcount=1, hits=9, bytes=4096, pinned=True,
                                                  error="x", traffic_percent=20, staging=True, num_pinned_slots=2,
                                                  bytes_done=1024)])
    assert report.to_dict() == dataclasses.asdict(report)
    # bytes_done only while a download is in progress: a pool's 100,000s of other versions carry no null
    assert "bytes_done" not in AdapterState("sql", "v2", "gpu").to_dict()


def test_desired_state_refuses_non_json():
    with pytest.raises(DirectiveError, match="not valid JSON"):
        DesiredState.from_json(b"{nope")


def test_reported_state_round_trip_and_lookup():
    rep = ReportedState(generation_applied=3, pool_bytes=1 << 20, pool_used_bytes=4096, kv_usage=0.25,
                        adapters=[AdapterState("sql", "v2", "gpu", refcount=1, hits=9, bytes=4096),
                                  AdapterState("sql", "v3", "disk", error="sha256 mismatch")])
    back = ReportedState.from_json(rep.to_json())
    assert back == rep
    assert back.find("sql", "v2").is_loaded
    assert not back.find("sql", "v3").is_loaded  # staged on disk only, and failed
    assert back.find("sql", "v9") is None


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"adapters": [{"name": "a", "version": "v1", "tier": "ssd"}]}, "tier"),
        ({"adapters": [{"name": "a", "version": "v1", "hits": -1}]}, "hits"),
        ({"kv_usage": 1.5}, "kv_usage"),
        ({"generation_applied": None}, "generation_applied"),
    ],
)
def test_reported_state_refusals_name_the_field(payload, field):
    with pytest.raises(DirectiveError, match=field):
        ReportedState.from_dict(payload)

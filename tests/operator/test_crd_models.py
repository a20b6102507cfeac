"""Parsing LoRAPool / LoRAAdapter bodies: quantities, defaults, refusals that name the field."""

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from lorafleet.operator.crd_models import AdapterSpec, PoolSpec, SpecError, parse_quantity
from lorafleet.operator.reconcile import _directive


@pytest.mark.parametrize(("value", "expected"), [(1024, 1024), ("512Mi", 512 << 20), ("16Gi", 16 << 30),
                                                 ("1G", 10**9), ("1.5Ki", 1536), ("100", 100), ("1e9", 10**9),
                                                 ("2Ei", 2 << 60), ("+5k", 5000), (".5", 1), ("100m", 1),
                                                 ("1E3", 1000), ("0", 0)])
def test_parse_quantity(value, expected):
    """Kubernetes quantity syntax; a fraction of a byte rounds up, as Quantity.Value() does."""
    assert parse_quantity(value, "f") == expected


@pytest.mark.parametrize("value", ["16 GB", "-1", "Gi", True, None, -5, "1e1.5", "1e19", 2**63, "1Gi\n"])
def test_parse_quantity_refuses(value):
    with pytest.raises(SpecError, match="^spec.x: "):
        parse_quantity(value, "spec.x")


def test_pool_parse():
    p = PoolSpec.parse({"metadata": {"name": "p", "namespace": "ns", "generation": 2},
                        "spec": {"baseModel": "m", "workerSelector": {"matchLabels": {"a": "b"}},
                                 "adapterMemory": {"gpuBytes": "1Gi"}, "tenantQuota": {"maxAdapters": 3,
                                                                                      "maxBytes": "2Gi"}}})
    assert (p.gpu_bytes, p.max_adapters_per_tenant, p.max_bytes_per_tenant, p.generation) == (1 << 30, 3, 2 << 30, 2)


@pytest.mark.parametrize(("spec", "field"), [
    ({"workerSelector": {"matchLabels": {"a": "b"}}}, "spec.baseModel"),
    ({"baseModel": "m", "workerSelector": {}}, "spec.workerSelector"),
    ({"baseModel": "m", "workerSelector": {"matchLabels": {}}}, "spec.workerSelector"),
    ({"baseModel": "m", "workerSelector": {"matchLabels": {}, "matchExpressions": [{"key": "a", "operator": "Exists"}]}},
     "spec.workerSelector.matchLabels"),
    ({"baseModel": "m", "workerSelector": {"matchExpressions": [{"key": "a", "operator": "Is"}]}},
     "spec.workerSelector.matchExpressions"),
    ({"baseModel": "m", "workerSelector": {"matchExpressions": [{"key": "a", "operator": "In"}]}},
     r"spec.workerSelector.matchExpressions\[0\].values"),
    ({"baseModel": "m", "workerSelector": {"matchExpressions": [{"key": "a", "operator": "Exists"},
                                                                {"key": "b", "operator": "NotIn", "values": []}]}},
     r"spec.workerSelector.matchExpressions\[1\].values"),
    ({"baseModel": "m", "workerSelector": {"matchExpressions": [{"key": "a", "operator": "Exists", "values": ["x"]}]}},
     r"spec.workerSelector.matchExpressions\[0\].values"),
    ({"baseModel": "m", "workerSelector": {"matchLabels": {"a": "b"}}, "stagerPort": "8001"}, "spec.stagerPort"),
    ({"baseModel": "m", "workerSelector": {"matchLabels": {"a": "b"}}, "eviction": "random"}, "spec.eviction"),
    ({"baseModel": "m", "workerSelector": {"matchLabels": {"a": "b"}}, "tenantQuota": {"maxAdapters": -1}},
     "spec.tenantQuota.maxAdapters"),
    ({"baseModel": "m", "workerSelector": {"matchLabels": {"a": "b"}}, "adapterMemory": {"gpuBytes": "lots"}},
     "spec.adapterMemory.gpuBytes"),
    ({"baseModel": "m", "workerSelector": {"matchLabels": {"a": "b"}}, "tenantQuota": 3}, "spec.tenantQuota"),
    ({"baseModel": "m", "workerSelector": {"matchLabels": {"a": "b"}}, "adapterMemory": "16Gi"},
     "spec.adapterMemory"),
])
def test_pool_refusals(spec, field):
    with pytest.raises(SpecError, match=f"^{field}:"):
        PoolSpec.parse({"metadata": {"name": "p"}, "spec": spec})


BASE = {"pool": "p", "tenant": "t", "baseModel": "m", "version": "v1", "source": {"uri": "s3://b/a/v1/"}}


@pytest.mark.parametrize(("patch", "field"), [
    ({"pool": None}, "spec.pool"),
    ({"source": {"uri": "http://example/a"}}, "spec.source.uri"),
    ({"source": None}, "spec.source.uri"),
    ({"warm": -1}, "spec.warm"),
    ({"warm": "most"}, "spec.warm"),
    ({"canary": {"version": "v2", "weight": 120, "source": {"uri": "/x"}}}, "spec.canary.weight"),
    ({"canary": {"weight": 10, "source": {"uri": "/x"}}}, "spec.canary.version"),
    ({"canary": {"version": "v2", "weight": 10, "source": {"uri": "ftp://x"}}}, "spec.canary.source.uri"),
    ({"source": {"uri": "/a", "sha256": "ABCDEF"}}, "spec.source.sha256"),
    ({"source": {"uri": "/a", "sha256": "A" * 64}}, "spec.source.sha256"),
    ({"canary": {"version": "v2", "weight": 10, "source": {"uri": "/x", "sha256": "0" * 63}}},
     "spec.canary.source.sha256"),
    ({"tenant": "a b"}, "spec.tenant"),
    ({"version": "-v1"}, "spec.version"),
    ({"canary": {"version": "v 2", "weight": 10, "source": {"uri": "/x"}}}, "spec.canary.version"),
    ({"priority": "high"}, "spec.priority"),
    ({"pinned": "false"}, "spec.pinned"),
    # A trailing newline: the CRDs' patterns (RE2, whole string) refuse it; so does parsing.
    ({"version": "v1\n"}, "spec.version"),
    ({"tenant": "t\n"}, "spec.tenant"),
    ({"source": {"uri": "s3://b/a/v1/\n"}}, "spec.source.uri"),
    ({"source": {"uri": "/a", "sha256": "0" * 64 + "\n"}}, "spec.source.sha256"),
])
def test_adapter_refusals(patch, field):
    with pytest.raises(SpecError, match=f"^{field.replace('.', '[.]')}:"):
        AdapterSpec.parse({"metadata": {"name": "a"}, "spec": {**BASE, **patch}})


def test_adapter_parse_canary_and_deletion():
    a = AdapterSpec.parse({"metadata": {"name": "a", "deletionTimestamp": "x"}, "status": {"bytes": 7},
                           "spec": {**BASE, "warm": "all", "canary": {"version": "v2", "weight": 20}}})
    assert a.deleting and a.warm == "all" and a.known_bytes == 7
    assert a.canary.version == "v2" and a.canary.source is None and a.canary.weight == 20


def test_adapter_metadata_name_must_be_a_directive_name():
    with pytest.raises(SpecError, match="^metadata.name:"):
        AdapterSpec.parse({"metadata": {"name": ""}, "spec": BASE})


text = st.one_of(st.text(max_size=70), st.sampled_from(["v1", "0" * 64, "a" * 64, "x.y-z_1", "/abs", "s3://b/k"]))


@settings(max_examples=300, deadline=None)
@example(tenant="0", version="0", sha=None, canary_version="00", weight=0, priority=0, uri="/")  # builds one
@given(tenant=text, version=text, sha=st.one_of(st.none(), text), canary_version=text,
       weight=st.one_of(st.integers(-5, 105), st.booleans()), priority=st.one_of(st.integers(), text),
       uri=text)
def test_whatever_parses_becomes_a_worker_directive(tenant, version, sha, canary_version, weight, priority, uri):
    """The parse step checks everything the directive builder does: no spec gets past it to fail later."""
    spec = {**BASE, "tenant": tenant, "version": version, "priority": priority,
            "source": {"uri": uri, **({"sha256": sha} if sha is not None else {})},
            "canary": {"version": canary_version, "weight": weight, "source": {"uri": "/c", "sha256": sha}}}
    try:
        a = AdapterSpec.parse({"metadata": {"name": "a"}, "spec": spec})
    except SpecError:
        return
    if a.canary.version != a.version:  # equal versions: refused by reconcile's checks, before any directive
        _directive(None, a, pod_warm=True)

"""Parsing LoRAPool / LoRAAdapter bodies: quantities, defaults, refusals that name the field."""

import pytest

from lorafleet.operator.crd_models import AdapterSpec, PoolSpec, SpecError, parse_quantity


@pytest.mark.parametrize(("value", "expected"), [(1024, 1024), ("512Mi", 512 << 20), ("16Gi", 16 << 30),
                                                 ("1G", 10**9), ("1.5Ki", 1536), ("100", 100)])
def test_parse_quantity(value, expected):
    assert parse_quantity(value, "f") == expected


@pytest.mark.parametrize("value", ["16 GB", "-1", "Gi", True, None, -5])
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
    ({"baseModel": "m", "workerSelector": {"matchLabels": {"a": "b"}}, "adapterMemory": {"gpuBytes": "lots"}},
     "spec.adapterMemory.gpuBytes"),
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
])
def test_adapter_refusals(patch, field):
    with pytest.raises(SpecError, match=f"^{field.replace('.', '[.]')}:"):
        AdapterSpec.parse({"metadata": {"name": "a"}, "spec": {**BASE, **patch}})


def test_adapter_parse_canary_and_deletion():
    a = AdapterSpec.parse({"metadata": {"name": "a", "deletionTimestamp": "x"}, "status": {"bytes": 7},
                           "spec": {**BASE, "warm": "all", "canary": {"version": "v2", "weight": 20}}})
    assert a.deleting and a.warm == "all" and a.known_bytes == 7
    assert a.canary.version == "v2" and a.canary.source is None and a.canary.weight == 20

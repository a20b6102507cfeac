"""CRDs (OpenAPI schema and CEL rules, evaluated here as the API server does) and the examples agree with
the operator's parsing."""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import pytest
import yaml

from lorafleet.operator.crd_models import (
    BOUNDED_QUANTITY_PATTERN,
    MAX_QUANTITY,
    AdapterSpec,
    PoolSpec,
    SpecError,
)

from .crd_validation import cel_rules, crd_schema, validate

ROOT = Path(__file__).resolve().parents[2]


def example_docs() -> list[dict]:
    return [d for p in sorted((ROOT / "examples" / "k8s").glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]


def test_examples_validate_and_parse():
    docs = example_docs()
    kinds = [d["kind"] for d in docs]
    assert kinds.count("LoRAPool") >= 1 and kinds.count("LoRAAdapter") >= 3
    assert any(d["spec"].get("canary") for d in docs if d["kind"] == "LoRAAdapter")
    for d in docs:
        validate(d, d["kind"].lower() + "s")
        (PoolSpec if d["kind"] == "LoRAPool" else AdapterSpec).parse(d)


@pytest.mark.parametrize(("kind", "path", "value"), [
    ("LoRAAdapter", ("spec", "canary", "weight"), 120),
    ("LoRAAdapter", ("spec", "canary", "weight"), -1),
    ("LoRAAdapter", ("spec", "source", "uri"), "http://example.com/adapter"),
    ("LoRAAdapter", ("spec", "source", "sha256"), "not-a-digest"),
    ("LoRAAdapter", ("spec", "source", "uri"), "s3://adapters/sql/v1\u00a0/"),  # no-break space
    ("LoRAAdapter", ("spec", "canary", "source", "uri"), "s3://adapters/sql/\nv2/"),
    ("LoRAPool", ("spec", "modelURI"), "/models/llama\t3"),
    ("LoRAAdapter", ("spec", "pool"), "Not_A_Name"),
    ("LoRAPool", ("spec", "adapterMemory", "gpuBytes"), "16 gigs"),
    ("LoRAPool", ("spec", "eviction"), "random"),
    ("LoRAPool", ("spec", "scaling", "kvHigh"), 1.5),
])
def test_crd_schema_refuses_bad_objects(kind, path, value):
    doc = next(d for d in example_docs() if d["kind"] == kind and (kind != "LoRAAdapter" or d["spec"].get("canary")))
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        validate(doc, kind.lower() + "s")


def test_crd_refuses_a_canary_without_source_or_equal_to_the_stable_version():
    doc = next(d for d in example_docs() if d["kind"] == "LoRAAdapter" and d["spec"].get("canary"))
    no_source = copy.deepcopy(doc)
    del no_source["spec"]["canary"]["source"]
    with pytest.raises(jsonschema.ValidationError, match="'source' is a required property"):
        validate(no_source, "loraadapters")
    same = copy.deepcopy(doc)
    same["spec"]["canary"]["version"] = same["spec"]["version"]
    with pytest.raises(jsonschema.ValidationError, match="spec.canary.version must differ from spec.version"):
        validate(same, "loraadapters")
    validate(doc, "loraadapters")
    assert crd_schema("loraadapters")["properties"]["status"]["properties"]["lastValidSpec"]["type"] == "string"


def test_every_cel_rule_compiles_and_is_exercised_here():
    rules = {plural: cel_rules(crd_schema(plural)) for plural in ("loraadapters", "lorapools")}
    assert rules == {
        "loraadapters": [(".spec", "!has(self.canary) || self.canary.version != self.version"),
                         (".spec.tenant", "self != 'default'"),
                         (".spec.warm", "type(self) == int ? self >= 0 : self == 'all'")],
        "lorapools": [(".spec.workerSelector", "has(self.matchLabels) || has(self.matchExpressions)"),
                      (".spec.workerSelector.matchExpressions[*]",
                       "self.operator in ['In', 'NotIn'] ? has(self.values) && size(self.values) > 0 "
                       ": !has(self.values) || size(self.values) == 0"),
                      (".spec.tenantSources[*]", "!self.matches('(^|/)[.][.](/|$)')"),
                      (".spec.scaling", "!has(self.minReplicas) || self.minReplicas <= self.maxReplicas"),
                      (".spec.scaling",
                       "(has(self.kvLow) ? self.kvLow : 0.3) < (has(self.kvHigh) ? self.kvHigh : 0.85)")],
    }


@pytest.mark.parametrize(("tenant", "ok"), [("acme", True), ("team.b-2", True), ("default", False), ("Default", True),
                                            ("", False), ("-x", False)])
def test_crd_and_parser_agree_on_the_tenant(tenant, ok):
    """"default" is reserved: the worker takes it for no tenant in particular, whose adapters the keys file's
    patterns grant to anyone (a LoRAAdapter naming it would be handed to every tenant whose pattern matches)."""
    doc = next(d for d in example_docs() if d["kind"] == "LoRAAdapter")
    doc["spec"]["tenant"] = tenant
    assert accepts(lambda: validate(doc, "loraadapters")) == ok == accepts(lambda: AdapterSpec.parse(doc))


@pytest.mark.parametrize(("warm", "ok"), [(0, True), (3, True), ("all", True), ("some", False), (-1, False)])
def test_crd_and_parser_agree_on_warm(warm, ok):
    doc = next(d for d in example_docs() if d["kind"] == "LoRAAdapter")
    doc["spec"]["warm"] = warm
    assert accepts(lambda: validate(doc, "loraadapters")) == ok == accepts(lambda: AdapterSpec.parse(doc))


@pytest.mark.parametrize(("expression", "ok"), [
    ({"operator": "In", "values": ["a"]}, True), ({"operator": "In"}, False), ({"operator": "NotIn", "values": []}, False),
    ({"operator": "Exists"}, True), ({"operator": "DoesNotExist", "values": []}, True),
    ({"operator": "Exists", "values": ["a"]}, False),
])
def test_crd_and_parser_agree_on_selector_expressions(expression, ok):
    """Kubernetes' own rules: In with no values would match no pod, NotIn with none every labelled one."""
    doc = next(d for d in example_docs() if d["kind"] == "LoRAPool")
    doc["spec"]["workerSelector"] = {"matchExpressions": [{"key": "app", **expression}]}
    assert accepts(lambda: validate(doc, "lorapools")) == ok == accepts(lambda: PoolSpec.parse(doc))


@pytest.mark.parametrize(("scaling", "ok"), [
    ({"minReplicas": 1, "maxReplicas": 4}, True), ({"minReplicas": 2, "maxReplicas": 2}, True),
    ({"minReplicas": 5, "maxReplicas": 4}, False), ({"minReplicas": 5}, True), ({"minReplicas": 9}, False),
    ({"kvLow": 0.3, "kvHigh": 0.8}, True), ({"kvLow": 0.8, "kvHigh": 0.8}, False), ({"kvLow": 0.9, "kvHigh": 0.2}, False),
    # Against the defaults (kvLow 0.3, kvHigh 0.85) when one is left out.
    ({"kvLow": 0.9}, False), ({"kvHigh": 0.2}, False), ({"kvLow": 0.5}, True), ({}, True),
])
def test_crd_and_parser_agree_on_scaling_bounds(scaling, ok):
    doc = next(d for d in example_docs() if d["kind"] == "LoRAPool")
    doc["spec"]["scaling"] = {**doc["spec"]["scaling"], **scaling}  # maxReplicas 8 unless set
    for key in {"minReplicas", "kvLow", "kvHigh"} - scaling.keys():
        doc["spec"]["scaling"].pop(key, None)
    assert accepts(lambda: validate(doc, "lorapools")) == ok == accepts(lambda: PoolSpec.parse(doc))


@pytest.mark.parametrize(("scaling", "ok"), [
    ({}, True), ({"target": None}, False), ({"prometheusURL": None}, False), ({"maxReplicas": None}, False),
    ({"target": "Workers"}, False), ({"target": "workers.v2"}, True), ({"target": "w" * 254}, False),
    ({"prometheusURL": "prometheus:9090"}, False), ({"prometheusURL": "https://prom.example/sub"}, True),
    # A user, a password or no host is the allowlist's to refuse (Scaling False), not an invalid pool.
    ({"prometheusURL": "http://user:pw@prom:9090"}, True), ({"prometheusURL": "http://prom:9090@169.254.169.254"}, True),
    ({"prometheusURL": "http://prom:9090/a@b"}, True), ({"prometheusURL": "http:///prom"}, True),
    # A block scalar's final line break, or a space: not a URL (the whole pool would be invalid otherwise).
    ({"prometheusURL": "http://prom:9090\n"}, False), ({"prometheusURL": "http://prom 9090"}, False),
    ({"maxReplicas": 0}, False), ({"minReplicas": 0}, True), ({"targetHitRate": 1.2}, False),
    ({"scaleDownStabilizationSeconds": -5}, False), ({"rateWindowSeconds": 300}, True), ({"rateWindowSeconds": 9}, False),
    ({"rateWindowSeconds": 86401}, False), ({"rateWindowSeconds": "2m"}, False),
    ({"waitingHigh": 2}, True), ({"waitingHigh": 0.5}, True), ({"waitingHigh": 0}, False),
    ({"waitingHigh": 0.05}, False), ({"waitingHigh": "2"}, False),
])
def test_crd_and_parser_agree_on_scaling_fields(scaling, ok):
    doc = next(d for d in example_docs() if d["kind"] == "LoRAPool")
    doc["spec"]["scaling"] = {k: v for k, v in {**doc["spec"]["scaling"], **scaling}.items() if v is not None}
    assert accepts(lambda: validate(doc, "lorapools")) == ok == accepts(lambda: PoolSpec.parse(doc))


@pytest.mark.parametrize(("name", "ok"), [("lorafleet-worker", True), ("workers.v2", True), ("Workers", False),
                                          ("w" * 254, False), (7, False), ("", False)])
def test_crd_and_parser_agree_on_the_worker_deployment(name, ok):
    doc = next(d for d in example_docs() if d["kind"] == "LoRAPool")
    doc["spec"]["workerDeployment"] = name
    assert accepts(lambda: validate(doc, "lorapools")) == ok == accepts(lambda: PoolSpec.parse(doc))


def accepts(check) -> bool:
    try:
        check()
    except (jsonschema.ValidationError, SpecError):
        return False
    return True


QUANTITIES = [0, 1024, -1, 2**62, "16Gi", "512Mi", "1e9", "1E3", "2Ei", "+1k", ".5", "1.", "100m", "5n", "1.5Ki",
              "-1", "-1Gi", "1e1.5", "16 GB", "Gi", "1KiB", "", "0x10", "1e-3",
              # Past int64, or close to it: refused by both, not a pool that goes InvalidSpec.
              MAX_QUANTITY, MAX_QUANTITY + 1, 99999999999999999999, "99999999999999999999", "1e19", "16Ei", "1e400",
              "8Ei", "7E", "1000Pi", "1e+019", "0000000000000000000001Ei", "6.99999999999999999999Ei", "999Pi",
              "999999999999999999", "1e-400", "1e0018", ".9999E"]


@pytest.mark.parametrize("value", QUANTITIES)
def test_crd_and_parser_agree_on_byte_quantities(value):
    doc = next(d for d in example_docs() if d["kind"] == "LoRAPool")
    doc["spec"]["adapterMemory"]["gpuBytes"] = value
    assert accepts(lambda: validate(doc, "lorapools")) == accepts(lambda: PoolSpec.parse(doc))


@pytest.mark.parametrize("value", ["1e19", "16Ei", "1e400", "99999999999999999999", 99999999999999999999])
@pytest.mark.parametrize("field", [("adapterMemory", "gpuBytes"), ("adapterMemory", "cpuBytes"),
                                   ("tenantQuota", "maxBytes")])
def test_crd_refuses_byte_quantities_past_int64(field, value):
    """Each would make the operator refuse the whole pool (InvalidSpec): the API server refuses it first."""
    doc = next(d for d in example_docs() if d["kind"] == "LoRAPool")
    doc["spec"][field[0]][field[1]] = value
    with pytest.raises(jsonschema.ValidationError):
        validate(doc, "lorapools")
    with pytest.raises(SpecError, match=f"^spec.{field[0]}.{field[1]}: .* (too large|more than)"):
        PoolSpec.parse(doc)


def test_every_quantity_the_crd_accepts_fits_int64():
    """The CRD's pattern is the parser's, and its largest value of every unit stays within int64."""
    schema = crd_schema("lorapools")["properties"]["spec"]["properties"]
    for node in (schema["adapterMemory"]["properties"]["gpuBytes"], schema["adapterMemory"]["properties"]["cpuBytes"],
                 schema["tenantQuota"]["properties"]["maxBytes"]):
        assert node["pattern"] == BOUNDED_QUANTITY_PATTERN and node["maximum"] == MAX_QUANTITY
    doc = next(d for d in example_docs() if d["kind"] == "LoRAPool")
    for value in ["9" * 18, "9" * 18 + ".9", "9" * 15 + ".9k", "9" * 15 + ".9Ki", "9" * 15 + "e3", "9" * 12 + "Mi",
                  "9" * 12 + "e6", "9" * 9 + "Gi", "9" * 9 + "e9", "9" * 6 + "Ti", "9" * 6 + "e12", "999.9Pi",
                  "999e15", "6.9E", "6.99999999999999999999Ei", "6e18", "6.9e+018"]:
        doc["spec"]["adapterMemory"]["gpuBytes"] = value
        validate(doc, "lorapools")
        assert 10**17 < PoolSpec.parse(doc).gpu_bytes <= MAX_QUANTITY, value


@pytest.mark.parametrize(("pool", "ok"), [
    ("main", True), ("main.v2", True), ("a" * 70, True), ("a" * 253, True), ("a.b-c.d", True),
    ("a" * 254, False), ("Main", False), ("main.", False), (".main", False), ("a..b", False), ("-a", False),
    ("a_b", False),
])
def test_an_adapter_can_name_every_valid_pool(pool, ok):
    """LoRAPool names are DNS-1123 subdomains (dots, up to 253): spec.pool takes every one, and only those."""
    doc = next(d for d in example_docs() if d["kind"] == "LoRAAdapter")
    doc["spec"]["pool"] = pool
    assert accepts(lambda: validate(doc, "loraadapters")) == ok
    if ok:
        assert AdapterSpec.parse(doc).pool == pool


@pytest.mark.parametrize("selector", [
    {"matchLabels": {}}, {"matchExpressions": []}, {"matchLabels": {}, "matchExpressions": []},
    {"matchLabels": {"a": "b"}}, {"matchExpressions": [{"key": "a", "operator": "Exists"}]},
    {"matchLabels": {}, "matchExpressions": [{"key": "a", "operator": "Exists"}]},
])
def test_crd_and_parser_agree_on_worker_selectors(selector):
    doc = next(d for d in example_docs() if d["kind"] == "LoRAPool")
    doc["spec"]["workerSelector"] = selector
    assert accepts(lambda: validate(doc, "lorapools")) == accepts(lambda: PoolSpec.parse(doc))

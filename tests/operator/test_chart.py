"""The Helm chart lints, renders, and every rendered built-in object validates against Kubernetes schemas;
env names match the processes' config fields."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from lorafleet.operator.crd_models import PoolSpec
from lorafleet.operator.operator_config import OperatorConfig
from lorafleet.operator.prometheus_allowlist import PrometheusAllowlist
from lorafleet.operator.workers import selector_matches
from lorafleet.worker.cli import build_parser

from .crd_validation import validate

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "lorafleet"
K8S_VERSION = "1.31.0"
CUSTOM_KINDS = {"LoRAPool", "ServiceMonitor", "PodMonitor", "KopfPeering", "ClusterKopfPeering"}

# The stager token an operator and workers in two releases share (refused without one).
SHARED = {"existingStagerTokenSecret": "stg"}

VALUE_SETS = {
    "defaults": {},
    "replicated-clusterwide": {
        "operator": {"replicas": 2, "watchNamespace": "*", "rankPodsForScaleDown": True},
        "metrics": {"serviceMonitor": {"enabled": True}},
        "pool": {"scaling": {"prometheusURL": "http://prometheus.monitoring:9090", "maxReplicas": 4},
                 "tenantSources": ["s3://adapters/{namespace}/{tenant}/"]},
        "secrets": {"apiKeys": {"tenants": {"acme": {"keys": ["sk-acme-1"], "adapters": ["sql"]}}}},
        "objectStore": {"endpoint": "minio.storage:9000", "accessKey": "a", "secretKey": "b", "secure": False},
        "worker": {"adapterCache": {"hostPath": "/var/lib/lorafleet/adapters"}, "model": "/models/llama",
                   "compileCache": {"hostPath": "/var/lib/lorafleet/triton"},
                   "extraVolumes": [{"name": "model", "persistentVolumeClaim": {"claimName": "llama"}}],
                   "extraVolumeMounts": [{"name": "model", "mountPath": "/models/llama", "readOnly": True}]},
    },
    "existing-secrets-other-namespace": {  # an operator for another namespace's pools: none of its own here
        "operator": {"watchNamespace": "tenants"}, "pool": {"create": False}, "worker": {"enabled": False},
        "secrets": {"existingAdminTokenSecret": "adm", "existingStagerTokenSecret": "stg",
                    "existingApiKeysSecret": "keys"},
        "objectStore": {"existingSecret": "s3"},
        "metrics": {"grafanaDashboard": {"enabled": False}},
    },
    # The workers are another release's: the two share one stager token.
    "operator-only": {"worker": {"enabled": False}, "secrets": SHARED},
}


def trial(values: dict) -> dict:
    """`values`, in development mode where they give no API keys and do not say (the chart refuses to render
    open workers otherwise: test_workers_without_api_keys_are_refused_outside_development_mode)."""
    secrets, worker = values.get("secrets", {}), values.get("worker", {})
    if secrets.get("apiKeys") or secrets.get("existingApiKeysSecret") or "developmentMode" in worker:
        return values
    return {**values, "worker": {**worker, "developmentMode": True}}


def render(values: dict, *, name: str = "demo", namespace: str = "fleet") -> list[dict]:
    manifests = helm.Chart.load(str(CHART)).render(trial(values), name=name, namespace=namespace, is_install=True)
    docs = []
    for path, text in sorted(manifests.items()):
        if path.endswith((".yaml", ".yml")):
            docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def notes(values: dict, *, name: str = "demo", namespace: str = "fleet") -> str:
    manifests = helm.Chart.load(str(CHART)).render(trial(values), name=name, namespace=namespace, is_install=True)
    return next(text for path, text in manifests.items() if path.endswith("/NOTES.txt"))


def find(docs: list[dict], kind: str, suffix: str = "") -> dict:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix)]
    assert len(matches) == 1, f"{kind} *{suffix}: {[d['metadata']['name'] for d in matches]}"
    return matches[0]


def env_names(container: dict) -> set[str]:
    return {e["name"] for e in container.get("env") or [] if e["name"].startswith("LORAFLEET_")}


def operator_prometheus(docs: list[dict]) -> PrometheusAllowlist:
    """The Prometheus servers the rendered operator may ask."""
    operator = find(docs, "Deployment", "-operator")["spec"]["template"]["spec"]["containers"][0]
    value = next(e["value"] for e in operator["env"] if e["name"] == "LORAFLEET_PROMETHEUS_URLS")
    return OperatorConfig(stager_token="s" * 16, prometheus_urls=tuple(filter(None, value.split(",")))).prometheus_urls


def config_env_names(cls) -> set[str]:
    parser = build_parser(cls, env={})
    text = " ".join(parser.format_help().split())  # argparse wraps lines at spaces
    return set(re.findall(r"env (LORAFLEET_[A-Z0-9_]+)", text))


def test_chart_lints_clean():
    report = helm.lint(str(CHART), strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_rendered_objects_validate(name):
    docs = render(VALUE_SETS[name])
    assert docs
    for doc in docs:
        if doc["kind"] in CUSTOM_KINDS:
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    for pool in (d for d in docs if d["kind"] == "LoRAPool"):
        validate(pool, "lorapools")
        assert list(PoolSpec.parse(pool).tenant_sources) == VALUE_SETS[name].get("pool", {}).get("tenantSources", [])


def test_crds_validate_and_ship_in_the_chart():
    for path in sorted((ROOT / "crds").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        # The chart installs the same CRDs (helm's crds/ folder: installable separately, never templated).
        assert (CHART / "crds" / path.name).read_text() == path.read_text(), f"{path.name} differs in the chart"
    adapters = yaml.safe_load((ROOT / "crds" / "lorafleet.dev_loraadapters.yaml").read_text())
    version = adapters["spec"]["versions"][0]
    assert "status" in version["subresources"]
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Pool", "Tenant", "Version", "Canary", "Weight", "Phase", "Ready", "Age"]


def test_worker_pod_engine_and_sidecar():
    docs = render({})
    pod = find(docs, "Deployment", "-worker")["spec"]["template"]
    engine, stager = pod["spec"]["containers"]
    assert engine["command"][-1] == "lorafleet.worker" and stager["command"][-1] == "lorafleet.worker.stager"
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert engine["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert engine["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert pod["spec"]["terminationGracePeriodSeconds"] >= 30 and engine["lifecycle"]["preStop"]
    assert {"name": "stager", "containerPort": 8001} in stager["ports"]
    cache = {m["mountPath"] for m in engine["volumeMounts"] if m["name"] == "adapter-cache"}
    assert cache == {m["mountPath"] for m in stager["volumeMounts"] if m["name"] == "adapter-cache"}
    # Object-store credentials live only in the sidecar.
    assert not any(n.startswith("LORAFLEET_S3") for n in env_names(engine))
    # The pool the chart creates selects exactly these pods, reaches only those the Deployment made, and the
    # Service routes to them.
    pool = find(docs, "LoRAPool")
    assert selector_matches(pool["spec"]["workerSelector"], pod["metadata"]["labels"])
    assert pool["spec"]["workerDeployment"] == find(docs, "Deployment", "-worker")["metadata"]["name"]
    assert selector_matches({"matchLabels": find(docs, "Service")["spec"]["selector"]}, pod["metadata"]["labels"])


def test_the_stager_sidecar_takes_extra_args_env_and_mounts():
    """Local adapter folders (localAdapterRoots, a volume mounted in both containers) and the stager's other
    settings (--download-timeout-s) reach the sidecar; the engine may read those folders' adapters where they are
    (the stager forwards their paths as they are), and gets none of the stager's settings."""
    values = {"worker": {"extraVolumes": [{"name": "adapters", "persistentVolumeClaim": {"claimName": "lora"}}],
                         "localAdapterRoots": ["/adapters"],
                         "stagerExtraArgs": ["--download-timeout-s", "900"],
                         "extraVolumeMounts": [{"name": "adapters", "mountPath": "/adapters", "readOnly": True}],
                         "stagerExtraVolumeMounts": [{"name": "adapters", "mountPath": "/adapters", "readOnly": True}]}}
    engine, stager = find(render(values), "Deployment", "-worker")["spec"]["template"]["spec"]["containers"]
    assert stager["args"] == ["--download-timeout-s", "900"]
    assert {"name": "LORAFLEET_LOCAL_ROOTS", "value": "/adapters"} in stager["env"]
    assert {"name": "adapters", "mountPath": "/adapters", "readOnly": True} in stager["volumeMounts"]
    assert "LORAFLEET_LOCAL_ROOTS" not in env_names(engine)
    roots = next(e["value"] for e in engine["env"] if e["name"] == "LORAFLEET_ADAPTER_ROOTS").split(",")
    assert roots == ["/var/cache/lorafleet/adapters", "/adapters"]
    assert {"name": "adapters", "mountPath": "/adapters", "readOnly": True} in engine["volumeMounts"]
    from lorafleet.worker.stager_config import StagerConfig

    assert {"LORAFLEET_LOCAL_ROOTS"} <= config_env_names(StagerConfig)
    from lorafleet.worker.cli import config_from_args

    env = {**{e["name"]: e["value"] for e in stager["env"] if "value" in e}, "LORAFLEET_STAGER_TOKEN": "t" * 20,
           "LORAFLEET_ADMIN_TOKEN": "a" * 20}  # the secrets'
    assert config_from_args(StagerConfig, stager["args"], env=env).download_timeout_s == 900


def test_env_names_are_config_fields():
    """Every LORAFLEET_* variable the chart sets is a field of that process's config dataclass."""
    docs = render(VALUE_SETS["replicated-clusterwide"])
    operator = find(docs, "Deployment", "-operator")["spec"]["template"]["spec"]["containers"][0]
    assert env_names(operator) <= config_env_names(OperatorConfig)
    assert {"LORAFLEET_INTERVAL", "LORAFLEET_SCALE_INTERVAL"} <= env_names(operator)
    engine, stager = find(docs, "Deployment", "-worker")["spec"]["template"]["spec"]["containers"]
    worker_config = pytest.importorskip("lorafleet.worker.worker_config")
    stager_mod = pytest.importorskip("lorafleet.worker.stager")
    assert env_names(engine) <= config_env_names(worker_config.WorkerConfig)
    assert env_names(stager) <= config_env_names(stager_mod.StagerConfig)
    assert int(next(e["value"] for e in stager["env"] if e["name"] == "LORAFLEET_STAGER_CACHE_BYTES")) > 0


@pytest.mark.parametrize(("values", "gated", "limit"), [
    ({}, True, 900.0),
    ({"worker": {"readyWithoutPushSeconds": None}}, True, None),
    ({"worker": {"readyWithoutPushSeconds": 0}}, True, 0.0),
    ({"worker": {"readyAfterPush": False}}, False, 900.0),
    ({"operator": {"enabled": False}, "secrets": SHARED}, False, 900.0),  # no operator of this release: ungated
    ({"operator": {"enabled": False}, "worker": {"readyAfterPush": True}, "secrets": SHARED}, True, 900.0),
])
def test_a_worker_pod_is_ready_once_its_first_push_reached_the_engine(values, gated, limit):
    """The sidecar's readiness probe asks /readyz, which the chart gates on the operator's first push (the
    operator pushes to starting pods: test_starting_pods.py), with a fallback for a pod no operator pushes to."""
    from lorafleet.worker.cli import config_from_args
    from lorafleet.worker.stager_config import StagerConfig

    worker = find(render(values), "Deployment", "-worker")
    assert worker["spec"]["progressDeadlineSeconds"] >= 600 + 900  # the startup probe's 10 minutes and the fallback
    stager = worker["spec"]["template"]["spec"]["containers"][1]
    assert stager["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "stager"}
    env = {**{e["name"]: e["value"] for e in stager["env"] if "value" in e}, "LORAFLEET_STAGER_TOKEN": "t" * 20}
    parsed = config_from_args(StagerConfig, stager["args"], env=env)
    assert (parsed.ready_after_push, parsed.ready_without_push_s) == (gated, limit)
    from lorafleet.worker.worker_config import WorkerConfig

    engine = worker["spec"]["template"]["spec"]["containers"][0]  # gated alike: a restarted engine waits too
    env = {e["name"]: e["value"] for e in engine["env"] if e["name"].startswith("LORAFLEET_READY")}
    parsed = config_from_args(WorkerConfig, [], env=env)
    assert (parsed.ready_after_push, parsed.ready_without_push_s) == (gated, limit)


@pytest.mark.parametrize(("cache", "limit"), [
    ({"sizeLimit": "200Gi", "sizeBytes": 190 << 30}, (200 << 30) * 98 // 100),  # follows sizeLimit
    ({}, (50 << 30) * 98 // 100),  # the default emptyDir's sizeLimit (50Gi), less room
    ({"sizeLimit": "50Gi", "sizeBytes": 53_000_000_000}, 53_000_000_000),  # never below the budget
    ({"sizeLimit": "500G"}, 500_000_000_000 * 98 // 100),
    ({"hostPath": "/var/lib/lorafleet", "sizeBytes": 300 << 30}, None),  # a node's disk: its own full-disk handling
    ({"limitBytes": 60 << 30, "sizeLimit": "64Gi"}, 60 << 30),
])
def test_the_stager_s_cache_limit_follows_the_volume(cache, limit):
    stager = find(render({"worker": {"adapterCache": cache}}), "Deployment", "-worker")["spec"]["template"]["spec"][
        "containers"][1]
    got = next((int(e["value"]) for e in stager["env"] if e["name"] == "LORAFLEET_STAGER_CACHE_LIMIT_BYTES"), None)
    assert got == limit


def test_operator_rbac_is_least_privilege():
    for name, values in VALUE_SETS.items():
        docs = render(values)
        roles = [d for d in docs if d["kind"] in ("Role", "ClusterRole")]
        assert len(roles) == 1, name
        rules = roles[0]["rules"]
        for rule in rules:
            assert "*" not in rule["verbs"] and "*" not in rule["resources"], name
            assert "secrets" not in rule["resources"], name
            assert not {"delete", "deletecollection", "update"} & set(rule["verbs"]), name
        pods = next(r for r in rules if "pods" in r["resources"])
        ranked = values.get("operator", {}).get("rankPodsForScaleDown", False)  # pod-deletion-cost annotations
        assert set(pods["verbs"]) == {"get", "list", "watch", *(["patch"] if ranked else [])}
        operator = find(docs, "Deployment", "-operator")["spec"]["template"]["spec"]["containers"][0]
        assert {e["name"]: e.get("value") for e in operator["env"]}["LORAFLEET_RANK_PODS"] == str(ranked).lower()
        # The autoscaler reads and patches the replicas of a pool's target Deployment through its scale
        # subresource, nothing else (patch on deployments could change the pod template).
        deployments = [r for r in rules if any(x.startswith("deployments") for x in r["resources"])]
        assert deployments == [{"apiGroups": ["apps"], "resources": ["deployments/scale"], "verbs": ["get", "patch"]}]
        # Which Deployment made a worker pod: read through its ReplicaSet.
        replicasets = [r for r in rules if "replicasets" in r["resources"]]
        assert replicasets == [{"apiGroups": ["apps"], "resources": ["replicasets"], "verbs": ["get", "list", "watch"]}]
        hpas = [r for r in rules if "horizontalpodautoscalers" in r["resources"]]
        assert hpas == [{"apiGroups": ["autoscaling"], "resources": ["horizontalpodautoscalers"], "verbs": ["list"]}]
        events = [r for r in rules if "events" in r["resources"]]
        assert events == [{"apiGroups": [""], "resources": ["events"], "verbs": ["create"]}]  # kopf: core v1 only
        replicated = values.get("operator", {}).get("replicas", 1) > 1
        assert any("kopf.dev" in r["apiGroups"] for r in rules) == replicated
        operator = find(docs, "Deployment", "-operator")["spec"]["template"]["spec"]["containers"][0]
        assert ("LORAFLEET_PEERING" in env_names(operator)) == replicated
        assert roles[0]["kind"] == ("ClusterRole" if values.get("operator", {}).get("watchNamespace") == "*"
                                    else "Role")


def test_optional_objects():
    kinds = {d["kind"] for d in render(VALUE_SETS["replicated-clusterwide"])}
    assert {"PodMonitor", "ClusterKopfPeering", "ConfigMap"} <= kinds
    kinds = {d["kind"] for d in render(VALUE_SETS["existing-secrets-other-namespace"])}
    assert not {"ServiceMonitor", "PodMonitor", "Secret", "ConfigMap"} & kinds
    kinds = {d["kind"] for d in render(VALUE_SETS["operator-only"])}
    assert "Service" not in kinds and "LoRAPool" not in kinds


@pytest.mark.parametrize("metrics_port", [8003, None])
def test_both_containers_metrics_are_scraped(metrics_port):
    """The worker's /metrics from the pods on its own port (worker.metricsPort: the Service, which tenants reach,
    does not carry it; null: through the Service), the stager sidecar's (object-store downloads: the cold
    start's slowest leg) from the pods, by the port names the worker Deployment gives its containers."""
    values = {**VALUE_SETS["replicated-clusterwide"]}
    values["worker"] = {**values.get("worker", {}), "metricsPort": metrics_port}
    docs = render(values)
    monitors = [d for d in docs if d["kind"] in ("ServiceMonitor", "PodMonitor")]
    endpoints = {(d["kind"], e["port"], e["path"]) for d in monitors
                 for e in d["spec"].get("endpoints", d["spec"].get("podMetricsEndpoints"))}
    engine = ("PodMonitor", "metrics", "/metrics") if metrics_port else ("ServiceMonitor", "http", "/metrics")
    assert endpoints == {engine, ("PodMonitor", "stager", "/metrics")}
    worker = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-worker"))
    template = worker["spec"]["template"]
    for pods in (d for d in monitors if d["kind"] == "PodMonitor"):
        assert pods["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    containers = {c["name"]: c for c in template["spec"]["containers"]}
    assert "stager" in {p["name"] for p in containers["stager"]["ports"]}
    ports = {p["name"]: p["containerPort"] for p in containers["engine"]["ports"]}
    assert ports == ({"http": 8000, "metrics": metrics_port} if metrics_port else {"http": 8000})
    assert template["metadata"]["annotations"]["prometheus.io/port"] == str(metrics_port or 8000)
    env = {e["name"]: e.get("value") for e in containers["engine"]["env"]}
    assert env.get("LORAFLEET_METRICS_PORT") == (str(metrics_port) if metrics_port else None)
    service = find(docs, "Service")
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]


def test_grafana_dashboard_plots_every_figure_the_troubleshooting_checklist_reads():
    """Hit rate, adapters per batch, load times (GPU and disk legs, and the object store's), page-pool
    occupancy and evictions: one panel each, so deleting one fails here."""
    dashboard = json.loads((CHART / "files" / "grafana-dashboard.json").read_text())
    exprs = [" ".join(t["expr"] for t in panel["targets"]) for panel in dashboard["panels"]]
    for needed in ('lorafleet_adapter_hits_total{tier="gpu"}', "lorafleet_adapters_per_batch_bucket",
                   "lorafleet_adapter_load_seconds_bucket", "lorafleet_stager_download_seconds_bucket",
                   "lorafleet_page_pool_adapter_pages", "lorafleet_page_pool_kv_pages",
                   "lorafleet_adapter_evictions_total", "lorafleet_stager_store_up"):
        assert any(needed in e for e in exprs), f"no dashboard panel reads {needed}"


def test_grafana_dashboard_formulas_read_what_their_panels_say():
    """The checklist's figures as formulas, not only names: the hit rate is hits over lookups (as the autoscaler's
    query), and each latency or count histogram is plotted at its median and 99th percentile."""
    dashboard = json.loads((CHART / "files" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    rate = r'sum\(rate\(lorafleet_adapter_{}_total\{{tier="gpu"\}}\[5m\]\)\)'
    hits, misses = rate.format("hits"), rate.format("misses")
    assert [e for e in exprs if "adapter_hits_total" in e] == [
        e for e in exprs if re.fullmatch(rf"{hits} / \({hits} \+ {misses}\)", e)] != []
    quantiles: dict[str, set[float]] = {}
    for e in exprs:
        for q, name in re.findall(r"histogram_quantile\(([\d.]+), sum\(rate\((\w+)_bucket", e):
            quantiles.setdefault(name, set()).add(float(q))
    for name in ("lorafleet_adapter_load_seconds", "lorafleet_adapters_per_batch", "lorafleet_adapter_wait_seconds",
                 "lorafleet_time_to_first_token_seconds", "lorafleet_stager_download_seconds"):
        assert {0.5, 0.99} <= quantiles.get(name, set()), f"{name}: quantiles {quantiles.get(name)}"


def test_grafana_dashboard_plots_every_adapter_metric_the_readme_says_it_plots():
    """README lists the adapter metrics and says the dashboard plots them: each one it names is on a panel."""
    readme = (ROOT / "README.md").read_text()
    listed = readme[readme.index("distinct adapters per engine"):readme.index("plots them. vLLM's names")]
    names = {re.sub(r"_(total|bucket)$", "", n) for n in re.findall(r"lorafleet_[a-z_]+", listed)}
    names |= {f"lorafleet_page_pool_{kind}_pages" for kind in ("kv", "adapter")} if "{kv,adapter}" in listed else set()
    dashboard = (CHART / "files" / "grafana-dashboard.json").read_text()
    assert len(names) >= 8
    for name in sorted(names - {"lorafleet_page_pool_"}):
        assert re.search(rf"\b{name}(_total|_bucket)?\b", dashboard), f"README names {name}; no dashboard panel reads it"


def test_grafana_dashboard_queries_exported_metrics():
    dashboard = json.loads((CHART / "files" / "grafana-dashboard.json").read_text())
    exported = "".join(p.read_text() for p in (ROOT / "worker").glob("*metrics*.py"))
    names = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            names |= set(re.findall(r"\b(lorafleet_[a-z_]+|vllm:[a-z_]+)", target["expr"]))
    assert names
    for name in names:
        base = re.sub(r"_(total|bucket|sum|count)$", "", name)
        assert f'"{base}"' in exported, f"dashboard queries {name}, which the worker does not export"


def test_standalone_operator_is_never_rolled_beside_its_successor():
    """Without peering two operator pods would both handle every pool and adapter: a rolling update (the
    default strategy) starts the new one before the old one stops, so a standalone operator is recreated."""
    for name, values in VALUE_SETS.items():
        docs = render(values)
        if not any(d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-operator") for d in docs):
            continue
        deployment = find(docs, "Deployment", "-operator")
        operator = deployment["spec"]["template"]["spec"]["containers"][0]
        if "LORAFLEET_PEERING" not in env_names(operator):
            assert deployment["spec"].get("strategy") == {"type": "Recreate"}, name


def test_worker_pods_mount_no_service_account_token():
    """The engine and the stager never call the Kubernetes API (nothing under worker/ imports a client), so
    the pods that run tenants' adapters carry no API token."""
    sources = "".join(path.read_text() for path in (ROOT / "worker").glob("*.py"))
    assert not re.search(r"^\s*(import|from) (kopf|kubernetes)\b", sources, re.MULTILINE)
    for name, values in VALUE_SETS.items():
        docs = render(values)
        if any(d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-worker") for d in docs):
            pod = find(docs, "Deployment", "-worker")["spec"]["template"]["spec"]
            assert pod.get("automountServiceAccountToken") is False, name


@pytest.mark.parametrize("grace", [30, 60, 300])
def test_worker_drain_ends_within_the_termination_grace(grace):
    """SIGTERM follows the preStop sleep; the engine then drains for --shutdown-grace-s and needs up to 3 s to
    end what is left. All of it must fit the pod's grace period (else the kubelet kills requests mid-stream),
    and a longer grace period must give requests longer to finish."""
    docs = render({"worker": {"terminationGracePeriodSeconds": grace}})
    pod = find(docs, "Deployment", "-worker")["spec"]["template"]["spec"]
    engine = pod["containers"][0]
    env = {e["name"]: e["value"] for e in engine["env"] if "value" in e}
    worker_config = pytest.importorskip("lorafleet.worker.worker_config")
    default = next(f.default for f in dataclasses.fields(worker_config.WorkerConfig) if f.name == "shutdown_grace_s")
    drain = getattr(build_parser(worker_config.WorkerConfig, env=env).parse_args([]), "shutdown_grace_s", default)
    pre_stop = engine["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] == grace
    assert pre_stop + drain + 3 <= grace
    assert drain >= grace - pre_stop - 5


@pytest.mark.parametrize(("field", "short"), [("stagerToken", 15), ("adminToken", 7)])
def test_tokens_the_processes_refuse_are_refused_by_the_chart(field, short):
    """A given token shorter than the stager (16) or the worker (8) accepts fails at install, not as a pod
    that crashes at start."""
    from lorafleet.worker.stager_config import StagerConfig

    with pytest.raises(ValueError):
        StagerConfig(stager_token="s" * 15)
    worker_config = pytest.importorskip("lorafleet.worker.worker_config")
    with pytest.raises(ValueError):
        worker_config.WorkerConfig(admin_token="a" * 7)
    with pytest.raises(helm.HelmValuesError):
        render({"secrets": {field: "t" * short}})
    secret = "admin-token" if field == "adminToken" else "stager-token"
    rendered = find(render({"secrets": {field: "t" * (short + 1)}}), "Secret", secret)
    assert rendered["data"]["token"]
    assert find(render({}), "Secret", secret)["data"]["token"]  # empty: generated


def test_adapter_cache_host_path_is_never_created_by_the_kubelet():
    """A hostPath the kubelet creates (DirectoryOrCreate) is root's with mode 0755, and fsGroup does not apply
    to hostPath volumes: the non-root stager could not stage a single adapter into it."""
    docs = render(VALUE_SETS["replicated-clusterwide"])
    pod = find(docs, "Deployment", "-worker")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    cache = next(v for v in pod["volumes"] if v["name"] == "adapter-cache")
    assert cache["hostPath"]["type"] == "Directory"


def test_triton_s_compile_cache_outlives_the_pod_on_a_node_local_directory():
    """Set, `worker.compileCache.hostPath` is where the engine's compiled kernels go (a new pod on the node skips
    the warm-up's compiles); unset, the pod's tmp volume as before."""
    def engine_and_volumes(values: dict) -> tuple[dict, dict]:
        pod = find(render(values), "Deployment", "-worker")["spec"]["template"]["spec"]
        return next(c for c in pod["containers"] if c["name"] == "engine"), {v["name"]: v for v in pod["volumes"]}

    engine, volumes = engine_and_volumes(VALUE_SETS["replicated-clusterwide"])
    env = {e["name"]: e.get("value") for e in engine["env"]}
    mounts = {m["name"]: m["mountPath"] for m in engine["volumeMounts"]}
    assert env["TRITON_CACHE_DIR"] == mounts["compile-cache"] == "/var/cache/lorafleet/triton"
    assert volumes["compile-cache"]["hostPath"] == {"path": "/var/lib/lorafleet/triton", "type": "Directory"}
    engine, volumes = engine_and_volumes({})
    assert {e["name"]: e.get("value") for e in engine["env"]}["TRITON_CACHE_DIR"] == "/tmp/triton-cache"
    assert "compile-cache" not in volumes


def _readme_install() -> tuple[str, str, dict]:
    """(release, namespace, values) of the README's `helm install` of this chart."""
    text = (ROOT / "README.md").read_text()
    command = re.search(r"^helm install .*?(?<!\\)$", text, re.MULTILINE | re.DOTALL)
    assert command, "the README installs the chart with helm install"
    words = command.group(0).replace("\\\n", " ").split()
    release, chart = words[2], words[3]
    assert (ROOT / chart).resolve() == CHART
    namespace = words[words.index("-n") + 1]
    values: dict = {}
    for i, word in enumerate(words):
        if word == "--set":
            expression = helm.parse_set_string(words[i + 1])
            merge = values
            while len(expression) == 1 and isinstance(next(iter(expression.values())), dict):
                key, expression = next(iter(expression.items()))
                merge = merge.setdefault(key, {})
            merge.update(expression)
    return release, namespace, values


def test_readme_quick_start_pool_owns_the_chart_workers():
    """The README installs the chart, then applies examples/k8s/: the example pool must be the only pool that
    selects the release's workers (of two, the first by name owns a worker, and the chart's own pool sorts
    first), live in the release's namespace and autoscale the release's worker Deployment."""
    release, namespace, values = _readme_install()
    docs = render(values, name=release, namespace=namespace)
    worker = find(docs, "Deployment", "-worker")["spec"]
    assert "replicas" not in worker  # the example pool's autoscaler sets them; helm upgrade must not reset them
    labels = worker["template"]["metadata"]["labels"]
    assert not [d for d in docs if d["kind"] == "LoRAPool" and selector_matches(d["spec"]["workerSelector"], labels)]
    examples = [d for path in sorted((ROOT / "examples" / "k8s").glob("*.yaml"))
                for d in yaml.safe_load_all(path.read_text()) if d]
    pools = [d for d in examples if d["kind"] == "LoRAPool"]
    assert pools
    deployments = {d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"}
    allowed = PrometheusAllowlist(operator_prometheus(docs))
    for pool in pools:
        assert pool["metadata"]["namespace"] == namespace
        assert selector_matches(pool["spec"]["workerSelector"], labels)
        assert pool["spec"]["stagerPort"] == values.get("worker", {}).get("stagerPort", 8001)
        assert pool["spec"]["scaling"]["target"] in deployments
        assert allowed.problem(pool["spec"]["scaling"]["prometheusURL"]) is None  # the operator may ask it
    names = {p["metadata"]["name"] for p in pools}
    for adapter in (d for d in examples if d["kind"] == "LoRAAdapter"):
        assert adapter["spec"]["pool"] in names and adapter["metadata"]["namespace"] == namespace


def test_workers_without_api_keys_are_refused_outside_development_mode():
    """Default values rendered workers with no keys file: every caller reaching the Service could use every
    tenant's adapters, and only a line in NOTES said so. The chart now refuses that unless
    worker.developmentMode says it is a trial; an operator-only release needs no keys."""
    chart = helm.Chart.load(str(CHART))
    with pytest.raises(Exception, match="no API keys .* set worker.developmentMode=true"):
        chart.render({}, name="demo", namespace="fleet", is_install=True)
    render({"worker": {"developmentMode": True}})
    render({"worker": {"developmentMode": False}, "secrets": {"existingApiKeysSecret": "keys"}})
    chart.render({"worker": {"enabled": False}, "secrets": SHARED}, name="demo", namespace="fleet", is_install=True)
    own = {"worker": {"extraArgs": ["--api-keys-file=/keys/keys.yaml"]}}  # keys of its own, on extraVolumes
    chart.render(own, name="demo", namespace="fleet", is_install=True)


def test_notes_match_the_release():
    """NOTES advise applying examples/k8s/ (which brings its own pool) only where the chart made no pool,
    warn when the workers run without API keys, and uninstall from the release's namespace."""
    text = notes({})
    assert "kubectl apply -f examples/k8s/" not in text
    assert "pool.create=false" in text
    assert "WARNING" in text and "development" in text
    assert "helm uninstall demo -n fleet" in text
    text = notes({"pool": {"create": False}, "secrets": {"existingApiKeysSecret": "keys"}})
    assert "kubectl apply -f examples/k8s/" in text and "demo-lorafleet-worker" in text
    assert "WARNING" not in text
    text = notes(VALUE_SETS["operator-only"])
    assert "Inference" not in text and "WARNING" not in text


def test_worker_replicas_are_left_to_the_autoscaler():
    """A helm upgrade must not reset the count the autoscaler set: spec.replicas is rendered only for a
    Deployment nothing the chart knows of autoscales, and never when worker.replicas is null."""
    assert find(render({}), "Deployment", "-worker")["spec"]["replicas"] == 2
    assert find(render({"worker": {"replicas": 0}}), "Deployment", "-worker")["spec"]["replicas"] == 0
    # null: a LoRAPool of the user's own (examples/k8s/pool.yaml) autoscales the Deployment.
    docs = render({"worker": {"replicas": None}, "pool": {"create": False}})
    assert "replicas" not in find(docs, "Deployment", "-worker")["spec"]
    # The chart's own pool autoscales its workers: the target is the worker Deployment unless set.
    scaling = {"prometheusURL": "http://prometheus.monitoring:9090", "maxReplicas": 8, "kvLow": 0.2}
    docs = render({"pool": {"scaling": scaling}})
    deployment, pool = find(docs, "Deployment", "-worker"), find(docs, "LoRAPool")
    assert "replicas" not in deployment["spec"]
    assert pool["spec"]["scaling"] == {**scaling, "target": deployment["metadata"]["name"]}
    validate(pool, "lorapools")
    assert PoolSpec.parse(pool).scaling.target == "demo-lorafleet-worker"
    assert find(render({"pool": {"scaling": {**scaling, "target": "other"}}}), "LoRAPool")["spec"]["scaling"][
        "target"] == "other"
    assert "scaling" not in find(render({}), "LoRAPool")["spec"]


def test_the_operator_asks_only_the_prometheus_servers_the_release_names():
    """operator.prometheusURLs (default: the README's Prometheus), plus the origin of the chart's own pool's
    prometheusURL; [] leaves autoscaling off."""
    assert operator_prometheus(render({})) == ("http://prometheus.monitoring:9090",)
    scaling = {"prometheusURL": "https://metrics.example:8443/prometheus", "maxReplicas": 4}
    assert operator_prometheus(render({"pool": {"scaling": scaling}})) == (
        "http://prometheus.monitoring:9090", "https://metrics.example:8443")
    assert operator_prometheus(render({"operator": {"prometheusURLs": []}})) == ()
    assert operator_prometheus(render({"operator": {"prometheusURLs": []}, "pool": {"create": False,
                                                                                   "scaling": scaling}})) == ()
    with pytest.raises(helm.HelmValuesError):
        render({"operator": {"prometheusURLs": ["http://user:pw@prometheus:9090"]}})


def test_workers_sharing_a_node_local_cache_never_share_a_node():
    """Two stagers on one hostPath cache delete each other's downloads in progress and trim each other's
    copies: with a hostPath cache the workers are kept on distinct nodes, unless worker.affinity says
    otherwise (then it is the user's)."""
    def affinity(values: dict) -> dict | None:
        return find(render(values), "Deployment", "-worker")["spec"]["template"]["spec"].get("affinity")

    assert affinity({}) is None  # an emptyDir per pod: nothing shared
    cached = {"worker": {"adapterCache": {"hostPath": "/var/lib/lorafleet/adapters"}}}
    term = affinity(cached)["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    pod_labels = find(render(cached), "Deployment", "-worker")["spec"]["template"]["metadata"]["labels"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"].items() <= pod_labels.items()
    # Each node runs its worker already: a surge pod could never be scheduled, and the rollout would stall.
    strategy = find(render(cached), "Deployment", "-worker")["spec"]["strategy"]["rollingUpdate"]
    assert (strategy["maxSurge"], strategy["maxUnavailable"]) == (0, 1)
    assert find(render({}), "Deployment", "-worker")["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 1
    own = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h200"]}]}]}}}
    assert affinity({"worker": {**cached["worker"], "affinity": own}}) == own


def test_a_node_drain_evicts_one_worker_at_a_time_and_streams_get_minutes_to_end():
    docs = render({})
    budget = find(docs, "PodDisruptionBudget", "-worker")
    pod = find(docs, "Deployment", "-worker")["spec"]["template"]
    assert budget["spec"]["maxUnavailable"] == 1
    assert budget["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert pod["spec"]["terminationGracePeriodSeconds"] >= 300
    assert not any(d["kind"] == "PodDisruptionBudget"
                   for d in render({"worker": {"podDisruptionBudget": {"enabled": False}}}))


def test_a_cache_limit_below_the_budget_is_refused_at_render():
    with pytest.raises(Exception, match="limitBytes must be at least sizeBytes"):
        render({"worker": {"adapterCache": {"limitBytes": 1 << 30, "sizeBytes": 2 << 30}}})


@pytest.mark.parametrize("cache", [{"sizeBytes": "45Gi"}, {"maxFileBytes": "4Gi"}, {"limitBytes": "60Gi"},
                                   {"sizeBytes": 0}, {"maxFileBytes": -1}])
def test_byte_sizes_with_a_unit_are_refused_at_render(cache):
    """sizeBytes, maxFileBytes and limitBytes are plain byte counts (sizeLimit beside them is a quantity): "45Gi"
    there rendered "0", and both containers exited 2 at start. The chart refuses such values at install."""
    with pytest.raises(helm.HelmValuesError, match="adapterCache"):
        render({"worker": {"adapterCache": cache}})
    render({"worker": {"adapterCache": {"sizeBytes": 45 << 30, "maxFileBytes": 4 << 30, "limitBytes": None}}})


@pytest.mark.parametrize("size_limit", ["51.5Gi", "5e10", "50GB", "500m"])
def test_a_size_limit_the_chart_cannot_read_is_refused_at_render(size_limit):
    """The stager's hard cache limit is 98% of the emptyDir's sizeLimit: a quantity the chart cannot read in bytes
    left the stager without a limit (the pod evicted once the cache passed sizeLimit). The chart says so instead,
    unless limitBytes gives the limit itself; a plain byte count is read as it is."""
    with pytest.raises(helm.HelmError, match=f"worker.adapterCache.sizeLimit {size_limit}"):
        render({"worker": {"adapterCache": {"sizeLimit": size_limit}}})
    stager = find(render({"worker": {"adapterCache": {"sizeLimit": size_limit, "limitBytes": 50 << 30}}}),
                  "Deployment", "-worker")["spec"]["template"]["spec"]["containers"][1]
    assert {"name": "LORAFLEET_STAGER_CACHE_LIMIT_BYTES", "value": str(50 << 30)} in stager["env"]
    stager = find(render({"worker": {"adapterCache": {"sizeLimit": 50 << 30}}}),
                  "Deployment", "-worker")["spec"]["template"]["spec"]["containers"][1]
    assert {"name": "LORAFLEET_STAGER_CACHE_LIMIT_BYTES", "value": str((50 << 30) * 98 // 100)} in stager["env"]


@pytest.mark.parametrize(("worker", "rolling"), [
    ({}, {"maxUnavailable": 0, "maxSurge": 1}),  # a surge pod: needs a free GPU beside the running workers
    ({"strategy": {"maxUnavailable": 1, "maxSurge": 0}}, {"maxUnavailable": 1, "maxSurge": 0}),
    ({"strategy": {"maxUnavailable": "25%", "maxSurge": 0}}, {"maxUnavailable": "25%", "maxSurge": 0}),
    ({"adapterCache": {"hostPath": "/var/lib/lorafleet/adapters"}}, {"maxUnavailable": 1, "maxSurge": 0}),
    ({"adapterCache": {"hostPath": "/var/lib/lorafleet/adapters"}, "strategy": {"maxUnavailable": 2, "maxSurge": 0}},
     {"maxUnavailable": 2, "maxSurge": 0}),
])
def test_a_rollout_on_a_full_gpu_pool_can_replace_pods_in_place(worker, rolling):
    """By default a rollout starts each new pod before its predecessor stops, which needs a GPU free beyond the
    running workers: on a full pool it hangs Pending. worker.strategy (the Deployment's rollingUpdate) can stop a
    pod first instead; null keeps the chart's choice."""
    docs = render({"worker": worker})
    strategy = find(docs, "Deployment", "-worker")["spec"]["strategy"]
    assert strategy == {"type": "RollingUpdate", "rollingUpdate": rolling}
    for doc in docs:
        if doc["kind"] not in CUSTOM_KINDS:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    with pytest.raises(helm.HelmValuesError):
        render({"worker": {"strategy": {"maxUnavailable": 1, "maxSurge": 0, "type": "Recreate"}}})


def _stager_token(docs: list[dict]) -> str:
    return find(docs, "Secret", "-stager-token")["data"]["token"]


@pytest.mark.parametrize("split", [
    {"operator": {"enabled": False}, "worker": {"readyAfterPush": True}},
    {"operator": {"enabled": False}},
    {"worker": {"enabled": False}, "pool": {"create": False}},
])
def test_an_operator_and_workers_in_two_releases_share_one_stager_token(split):
    """Each release generates a stager token of its own: the operator of one release got 401 on every push to the
    workers of another. A release with only one of the two must be given the token both share."""
    with pytest.raises(helm.HelmError, match="must share one stager token.*existingStagerTokenSecret"):
        render(split)
    shared = {**split, "secrets": {"existingStagerTokenSecret": "lorafleet-stager-token"}}
    assert not [d for d in render(shared) if d["kind"] == "Secret" and d["metadata"]["name"].endswith("-stager-token")]
    workers = render({"operator": {"enabled": False}, "secrets": {"stagerToken": "s" * 20}}, name="workers")
    operator = render({"worker": {"enabled": False}, "pool": {"create": False}, "secrets": {"stagerToken": "s" * 20}},
                      name="ctl")
    assert _stager_token(workers) == _stager_token(operator)
    render({})  # both in one release: the token it generates
    render({"operator": {"enabled": False}, "worker": {"enabled": False}})


def test_cpu_workers_request_no_gpu():
    """worker.device=cpu pods asked for a GPU they never use (and waited for one); the rest of worker.resources
    is kept."""
    resources = {"requests": {"cpu": "8", "memory": "16Gi", "nvidia.com/gpu": 1},
                 "limits": {"memory": "32Gi", "nvidia.com/gpu": 1}}
    docs = render({"worker": {"device": "cpu", "resources": resources}})
    engine = find(docs, "Deployment", "-worker")["spec"]["template"]["spec"]["containers"][0]
    assert engine["resources"] == {"requests": {"cpu": "8", "memory": "16Gi"}, "limits": {"memory": "32Gi"}}
    engine = find(render({"worker": {"device": "cpu"}}), "Deployment", "-worker")["spec"]["template"]["spec"][
        "containers"][0]
    assert "nvidia.com/gpu" not in {**engine["resources"].get("requests", {}), **engine["resources"].get("limits", {})}
    engine = find(render({}), "Deployment", "-worker")["spec"]["template"]["spec"]["containers"][0]
    assert engine["resources"]["requests"]["nvidia.com/gpu"] == engine["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_the_stager_requests_the_disk_its_emptydir_cache_may_fill():
    """An emptyDir cache up to sizeLimit lives on the node's disk: the stager requests that much ephemeral storage,
    so the scheduler places the pod where it fits; a request or limit of the user's own, or a hostPath cache, is
    left as it is."""
    def stager_resources(values: dict) -> dict:
        return find(render(values), "Deployment", "-worker")["spec"]["template"]["spec"]["containers"][1]["resources"]

    assert stager_resources({})["requests"] == {"cpu": "250m", "memory": "512Mi", "ephemeral-storage": "50Gi"}
    assert stager_resources({"worker": {"adapterCache": {"sizeLimit": "200Gi", "sizeBytes": 190 << 30}}})[
        "requests"]["ephemeral-storage"] == "200Gi"
    own = stager_resources({"worker": {"stagerResources": {"requests": {"cpu": "1", "ephemeral-storage": "80Gi"}}}})
    assert own["requests"] == {"cpu": "1", "memory": "512Mi", "ephemeral-storage": "80Gi"}  # beside the defaults
    cached = {"worker": {"adapterCache": {"hostPath": "/var/lib/lorafleet/adapters"}}}
    assert "ephemeral-storage" not in stager_resources(cached)["requests"]
    # A limit of the user's own: Kubernetes takes it as the request too; one above it would refuse the pod.
    capped = stager_resources({"worker": {"stagerResources": {"limits": {"memory": "2Gi", "ephemeral-storage": "20Gi"}}}})
    assert "ephemeral-storage" not in capped["requests"] and capped["limits"]["ephemeral-storage"] == "20Gi"

"""The chart's worker pod keeps the engine's admin API off the Service: the engine gets its own admin listener
(worker.adminPort, on 127.0.0.1), the stager sidecar calls it there, and only the public port is a container
port the Service routes to. worker.adminPort null keeps the admin API on worker.port, as before."""

from __future__ import annotations

import helm_python as helm
import kubernetes_validate
import pytest

from lorafleet.worker.cli import config_from_args

from .test_chart import CHART, CUSTOM_KINDS, K8S_VERSION, SHARED, find, render, trial

LISTEN_VARS = ("LORAFLEET_HOST", "LORAFLEET_PORT", "LORAFLEET_ADMIN_HOST", "LORAFLEET_ADMIN_PORT",
               "LORAFLEET_METRICS_PORT")


def worker_pod(values: dict) -> tuple[dict, dict, dict, list[dict]]:
    """(engine container, stager container, Service, every rendered object) of a release with `values`."""
    docs = render(values)
    engine, stager = find(docs, "Deployment", "-worker")["spec"]["template"]["spec"]["containers"]
    return engine, stager, find(docs, "Service"), docs


def env_value(container: dict, name: str) -> str | None:
    return next((e["value"] for e in container["env"] if e["name"] == name), None)


def engine_listeners(engine: dict):
    """The engine's WorkerConfig as its listening settings in the rendered env make it."""
    worker_config = pytest.importorskip("lorafleet.worker.worker_config")
    env = {e["name"]: e["value"] for e in engine["env"] if e["name"] in LISTEN_VARS}
    return config_from_args(worker_config.WorkerConfig, [], env=env)


@pytest.mark.parametrize(
    ("worker", "port", "admin_port"), [({}, 8000, 8002), ({"port": 9000, "adminPort": 9100}, 9000, 9100)]
)
def test_the_stager_reaches_the_admin_api_on_loopback_and_the_service_does_not(worker, port, admin_port):
    engine, stager, service, docs = worker_pod({"worker": worker})
    config = engine_listeners(engine)
    assert (config.host, config.port) == ("*", port)  # every address of IPv4 and IPv6: any cluster's pod IP
    assert (config.admin_listen_host, config.admin_port) == ("127.0.0.1", admin_port) and config.metrics_port == 8003
    assert env_value(stager, "LORAFLEET_ENGINE_URL") == f"http://127.0.0.1:{admin_port}"
    # The admin port is no container port (the metrics port is: scraped from the pods); the Service and the
    # probes use the public one only.
    assert [p["containerPort"] for p in engine["ports"]] == [port, 8003]
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]
    assert {"name": "http", "containerPort": port} in engine["ports"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert engine[probe]["httpGet"]["port"] == "http"
    for doc in docs:
        if doc["kind"] not in CUSTOM_KINDS:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_admin_port_null_keeps_the_admin_api_on_the_worker_port():
    engine, stager, _, docs = worker_pod({"worker": {"adminPort": None}})
    assert env_value(engine, "LORAFLEET_ADMIN_PORT") is None and engine_listeners(engine).admin_port is None
    assert env_value(stager, "LORAFLEET_ENGINE_URL") == "http://127.0.0.1:8000"
    for doc in docs:
        if doc["kind"] not in CUSTOM_KINDS:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("taken", ["port", "stagerPort", "adminPort"])
def test_a_metrics_port_the_pod_already_uses_is_refused_at_install(taken):
    ports = {"port": 8000, "stagerPort": 8001, "adminPort": 8002}
    with pytest.raises(helm.HelmError, match=f"worker.metricsPort {ports[taken]} is worker.port, worker.stagerPort"):
        render({"worker": {"metricsPort": ports[taken]}})
    render({"worker": {"metricsPort": 8002, "adminPort": None}})  # the admin API on worker.port: 8002 is free


@pytest.mark.parametrize("taken", ["port", "stagerPort"])
def test_an_admin_port_the_pod_already_uses_is_refused_at_install(taken):
    """The worker refuses --admin-port equal to --port (the stager sidecar's port is taken in the pod): the chart
    fails at install, not as a pod that crashes at start."""
    worker_config = pytest.importorskip("lorafleet.worker.worker_config")
    with pytest.raises(ValueError, match="--admin-port 8000 is --port too"):
        worker_config.WorkerConfig(port=8000, admin_port=8000)
    with pytest.raises(helm.HelmError, match="worker.adminPort 800[01] is worker.port or worker.stagerPort"):
        render({"worker": {"adminPort": {"port": 8000, "stagerPort": 8001}[taken]}})
    with pytest.raises(helm.HelmValuesError):
        render({"worker": {"adminPort": 0}})  # no free port: the sidecar must know it


@pytest.mark.parametrize(("worker", "says"), [({}, True), ({"adminPort": 9100}, True), ({"adminPort": None}, False)])
def test_the_install_notes_say_where_the_admin_api_went(worker, says):
    """A caller that used the admin API through the Service gets 404s once it moved to loopback: the notes
    helm prints at install say so, and how to reach it."""
    notes = helm.Chart.load(str(CHART)).render(trial({"worker": worker}), name="demo", namespace="fleet", is_install=True)[
        "lorafleet/templates/NOTES.txt"]
    port = worker.get("adminPort", 8002)
    assert ("not on the service" in notes) is says
    if says:
        assert f"127.0.0.1:{port} inside each pod" in notes and f"deploy/demo-lorafleet-worker 8002:{port}" in notes


def test_a_stager_port_on_the_engines_port_is_refused_at_install():
    """Both containers share the pod's network: one of them failed to bind, restarting for ever."""
    with pytest.raises(helm.HelmError, match="worker.stagerPort 8000 is worker.port too"):
        render({"worker": {"stagerPort": 8000}})
    with pytest.raises(helm.HelmError, match="worker.stagerPort 8000 is worker.port too"):
        render({"worker": {"stagerPort": 8000, "adminPort": None}})


def test_an_operator_watching_another_namespace_than_its_pool_and_workers_is_refused_at_install():
    """The chart puts its pool and workers in the release namespace; an operator watching (and allowed into)
    only another one never reconciled them, and the notes said it would."""
    with pytest.raises(helm.HelmError, match='operator.watchNamespace "tenants" is not the release namespace "fleet"'):
        render({"operator": {"watchNamespace": "tenants"}})
    with pytest.raises(helm.HelmError, match="watchNamespace"):
        render({"operator": {"watchNamespace": "tenants"}, "pool": {"create": False}})  # its workers still here
    for ok in ({"operator": {"watchNamespace": "fleet"}}, {"operator": {"watchNamespace": "*"}},
               {"operator": {"watchNamespace": "tenants"}, "pool": {"create": False}, "worker": {"enabled": False},
                "secrets": SHARED},
               {"operator": {"watchNamespace": "tenants", "enabled": False}, "secrets": SHARED}):
        assert any(d["kind"] == "Deployment" for d in render(ok))


def test_a_changed_token_rolls_the_pods_that_read_it():
    """Tokens reach the containers as env from Secrets, read at start: after `helm upgrade` changed one, running
    pods kept the old one, and a worker started later (a scale-up) had the new one, so the operator's calls to
    it failed with 401. A checksum of the chart's Secrets on both pod templates rolls them together."""
    def templates(token: str) -> dict[str, dict]:
        docs = render({"secrets": {"stagerToken": token * 20, "adminToken": "a" * 20}})
        return {d["metadata"]["name"]: d["spec"]["template"] for d in docs if d["kind"] == "Deployment"}

    before, after, again = templates("A"), templates("B"), templates("A")
    assert set(before) == {"demo-lorafleet-worker", "demo-lorafleet-operator"}
    for name in before:
        assert before[name]["metadata"]["annotations"]["checksum/secrets"] != after[name]["metadata"]["annotations"]["checksum/secrets"]
        assert before[name] == again[name]  # an upgrade that changes no token restarts nothing
    # Rotated API keys reach the workers through their mounted file, read again on change: no restart. Tokens
    # generated at install (none given) are the same Secret across upgrades: no restart either.
    keys = [render({"secrets": {"apiKeys": {"acme": {"keys": [k * 12], "adapters": []}}}}) for k in "xy"]
    generated = [render({}) for _ in range(2)]
    for docs in (keys, generated):
        first, second = ({d["metadata"]["name"]: d["spec"]["template"] for d in r if d["kind"] == "Deployment"} for r in docs)
        assert first == second

"""The Prometheus servers the autoscaler may ask: the setting's origins, what a pool's URL must be, and a
pass over a pool whose Prometheus is not allowed sending no request there (a local server stands for it)."""

from __future__ import annotations

import copy

import pytest
from aiohttp import web

from lorafleet.operator.autoscaler import ScalingSpec
from lorafleet.operator.operator_config import OperatorConfig
from lorafleet.operator.prometheus import MetricsError, PrometheusClient
from lorafleet.operator.prometheus_allowlist import PrometheusAllowlist
from lorafleet.operator.scaler import PoolScaler
from lorafleet.worker.cli import config_from_args

from .local_http import serving

NOW = "2026-01-01T00:00:00Z"
TOKEN = "s" * 16
ALLOWED = "http://prometheus.monitoring:9090"


@pytest.mark.parametrize(
    ("url", "allowed"),
    [
        ("http://prometheus.monitoring:9090", True),
        ("http://prometheus.monitoring:9090/", True),
        ("http://Prometheus.Monitoring:9090/prometheus", True),  # any path on a listed origin
        ("https://prom.example", True),  # the scheme's default port, given or not
        ("https://prom.example:443/", True),
        ("http://prometheus.monitoring:9091", False),  # another port
        ("https://prometheus.monitoring:9090", False),  # another scheme
        ("http://prometheus.monitoring", False),
        ("http://169.254.169.254/latest/meta-data/", False),
        ("http://kubernetes.default.svc:443", False),
        ("http://prometheus.monitoring:9090.evil.example", False),
        ("http://prometheus.monitoring:9090@169.254.169.254/", False),  # a user, not the host
        ("http://user:secret@prometheus.monitoring:9090", False),
        ("ftp://prometheus.monitoring:9090", False),
        ("http://prometheus.monitoring:9090/api/v1/admin/tsdb/delete_series?match[]=up&x=", False),  # a query
        ("http://prometheus.monitoring:9090/x#", False),
        ("http://prometheus.monitoring:9090/?", False),
        ("http://xn--/", False),  # a name IDNA cannot decode: refused, not raised
    ],
)
def test_only_a_listed_origin_is_allowed(url, allowed):
    allowlist = PrometheusAllowlist([ALLOWED, "https://prom.example"])
    assert (allowlist.problem(url) is None) == allowed


def test_a_refusal_names_the_setting():
    problem = PrometheusAllowlist([ALLOWED]).problem("http://169.254.169.254")
    assert "'http://169.254.169.254' is not on a Prometheus the operator may ask" in problem
    assert "--prometheus-urls" in problem and "operator.prometheusURLs" in problem
    empty = PrometheusAllowlist([]).problem(ALLOWED)
    assert (
        "may ask no Prometheus" in empty
        and "LORAFLEET_PROMETHEUS_URLS" in empty
        and "autoscaling is off" in empty
    )


@pytest.mark.parametrize(
    "entry",
    [
        "prometheus.monitoring:9090",
        "ftp://prometheus.monitoring",
        "http://user:pass@prometheus.monitoring:9090",
        "http://prometheus.monitoring:9090/prefix",
        "http://prometheus.monitoring:9090?x=1",
        "http://prometheus.monitoring:99999",
        "http://",
        "http://xn--:9090",
    ],
)
def test_the_setting_refuses_what_is_not_an_origin(entry):
    with pytest.raises(ValueError, match="prometheus_urls: .* must be scheme://host"):
        OperatorConfig(stager_token=TOKEN, prometheus_urls=(entry,))


def test_the_setting_by_flag_and_environment():
    assert OperatorConfig(stager_token=TOKEN).prometheus_urls == ()  # none unless listed: autoscaling off
    env = {"LORAFLEET_STAGER_TOKEN": TOKEN}
    config = config_from_args(
        OperatorConfig, ["--prometheus-urls", f"{ALLOWED},https://prom.example"], env=env
    )
    assert config.prometheus_urls == (ALLOWED, "https://prom.example")
    env["LORAFLEET_PROMETHEUS_URLS"] = ALLOWED
    assert config_from_args(OperatorConfig, [], env=env).prometheus_urls == (ALLOWED,)


@pytest.mark.parametrize(
    "url", ["http://user:secret@prometheus:9090", "http://:secret@prometheus:9090/", "http:///x"]
)
def test_a_pool_url_with_a_user_or_no_host_is_a_valid_spec_the_allowlist_refuses(url):
    """A pool that used a basic-auth Prometheus stays valid (its adapters are still pushed); only its
    autoscaling stops, and the refusal never echoes the password into a status or a log."""
    spec = ScalingSpec.parse({"target": "workers", "prometheusURL": url, "maxReplicas": 2})
    problem = PrometheusAllowlist([ALLOWED]).problem(spec.prometheus_url)
    assert problem is not None and "secret" not in problem


def test_a_refused_user_and_password_says_what_to_do():
    problem = PrometheusAllowlist([ALLOWED]).problem("http://user:secret@prometheus.monitoring:9090")
    assert "credentials in the URL are not allowed" in problem and "remove them" in problem
    assert "--prometheus-urls" in problem and "secret" not in problem


class Recorder:
    """A local HTTP server that records every request: it stands where a pool's URL points."""

    def __init__(self) -> None:
        self.requests: list[str] = []

    def app(self, answer: web.Response | None = None) -> web.Application:
        async def record(request: web.Request) -> web.Response:
            self.requests.append(f"{request.method} {request.path}")
            return answer or web.json_response(
                {"status": "success", "data": {"resultType": "vector", "result": []}}
            )

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", record)
        return app


class Deployments:
    def __init__(self) -> None:
        self.num_gets = 0

    async def get_replicas(self, namespace: str, name: str) -> int:
        self.num_gets += 1
        return 2

    async def autoscalers_of(self, namespace: str, name: str) -> list[str]:
        return []

    async def set_replicas(self, namespace: str, name: str, replicas: int) -> None:
        raise AssertionError("no replicas may change")

    async def close(self) -> None:
        pass


def pool(url: str) -> dict:
    return {
        "metadata": {"name": "p", "namespace": "ns", "generation": 1},
        "spec": {
            "baseModel": "m",
            "workerSelector": {"matchLabels": {"app": "w"}},
            "scaling": {"target": "workers", "prometheusURL": url, "maxReplicas": 6},
        },
    }


READY_POD = {
    "metadata": {"name": "w-0", "labels": {"app": "w"}},
    "status": {"phase": "Running", "podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
}


async def scaling_condition(scaler: PoolScaler, url: str) -> dict:
    wanted = await scaler.run(copy.deepcopy(pool(url)), pods=[READY_POD], other_pools=[], now=NOW)
    return next(c for c in wanted["conditions"] if c["type"] == "Scaling")


@pytest.mark.parametrize("listed", [[], ["http://prometheus.monitoring:9090"]])
async def test_a_pool_whose_prometheus_is_not_allowed_sends_it_no_request(listed):
    recorder, deployments = Recorder(), Deployments()
    scaler = PoolScaler(PrometheusClient(timeout=2.0), deployments, allowed=PrometheusAllowlist(listed))
    try:
        async with serving(recorder.app()) as url:
            cond = await scaling_condition(scaler, url)
    finally:
        await scaler.close()
    assert (cond["status"], cond["reason"]) == ("False", "PrometheusURLNotAllowed")
    assert (
        cond["message"].startswith("spec.scaling.prometheusURL: ") and "--prometheus-urls" in cond["message"]
    )
    assert cond["message"].endswith("replicas are left as they are")
    assert recorder.requests == [] and deployments.num_gets == 0


async def test_a_listed_prometheus_named_with_a_password_is_not_asked(caplog):
    """Credentials in a pool's URL are never sent, even to a listed origin: Scaling is False, the pool's
    workers are still served (its spec is valid), and the password is in no status or log."""
    recorder, deployments = Recorder(), Deployments()
    async with serving(recorder.app()) as url:
        scaler = PoolScaler(PrometheusClient(timeout=2.0), deployments, allowed=PrometheusAllowlist([url]))
        try:
            cond = await scaling_condition(scaler, url.replace("http://", "http://user:secret@"))
        finally:
            await scaler.close()
    assert (cond["status"], cond["reason"]) == ("False", "PrometheusURLNotAllowed")
    assert "credentials in the URL are not allowed" in cond["message"]
    assert "secret" not in cond["message"] and "secret" not in caplog.text
    assert recorder.requests == [] and deployments.num_gets == 0


async def test_a_pool_whose_prometheus_is_allowed_is_asked():
    recorder, deployments = Recorder(), Deployments()
    async with serving(recorder.app()) as url:
        scaler = PoolScaler(PrometheusClient(timeout=2.0), deployments, allowed=PrometheusAllowlist([url]))
        try:
            cond = await scaling_condition(scaler, url + "/")
        finally:
            await scaler.close()
    # asked, and its answers hold no series for the pool's ready worker
    assert (cond["status"], cond["reason"]) == ("False", "MetricsMissing")
    assert recorder.requests == ["POST /api/v1/query"] * 4 and deployments.num_gets == 1


async def test_a_redirect_from_an_allowed_prometheus_is_not_followed():
    """The allowlist vets the URL asked: a redirect would send the request somewhere it never saw."""
    elsewhere = Recorder()
    async with serving(elsewhere.app()) as target:
        redirect = web.Response(status=307, headers={"Location": f"{target}/latest/meta-data/"})
        async with serving(Recorder().app(redirect)) as url:
            client = PrometheusClient(timeout=2.0)
            try:
                with pytest.raises(MetricsError, match="HTTP 307"):
                    await client.query(url, "up")
            finally:
                await client.close()
    assert elsewhere.requests == []

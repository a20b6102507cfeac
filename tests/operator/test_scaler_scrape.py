"""A scale-up waits for Prometheus' first scrape of the replicas the last one added: once ready, a new replica
counts in the replica count at once, but in the pool's means only from its first scrape; scaling on the
earlier replicas' means alone would overshoot."""

from __future__ import annotations

from lorafleet.operator.prometheus import MetricsError
from lorafleet.operator.scaler import SCRAPE_GRACE

from .test_scaler import pod, pool, scaling_condition, setup, tick  # noqa: F401  (fixture)

JUST_READY = "2025-12-31T23:59:50Z"  # 10 s before the passes' time (test_scaler.NOW)
READY_LONG_AGO = "2025-12-31T23:57:00Z"  # 180 s before NOW: past SCRAPE_GRACE


class Scraped:
    """``Metrics.scraped_pods``: the pods Prometheus has series of, and which pods each call asked about."""

    def __init__(self, metrics) -> None:
        self.pods: set[str] | Exception = set()
        self.asked: list[list[str]] = []
        metrics.scraped_pods = self

    async def __call__(self, url: str, namespace: str, pods: list[str]) -> set[str]:
        self.asked.append(pods)
        if isinstance(self.pods, Exception):
            raise self.pods
        return self.pods & set(pods)


async def scaled_up_once(scaler, metrics, deployments) -> dict:
    """2 -> 3 replicas on KV usage 0.9 > kvHigh 0.85; the pool's body."""
    metrics.signals = (0.99, 0.9, 0.0)
    body = pool(kvHigh=0.85)
    await tick(scaler, body, [pod("w-0"), pod("w-1")])
    assert deployments.patches == [3]
    return body


async def test_a_further_scale_up_waits_for_the_new_replicas_first_scrape(setup):  # noqa: F811
    scaler, metrics, deployments, _ = setup
    scraped = Scraped(metrics)
    body = await scaled_up_once(scaler, metrics, deployments)
    pods = [pod("w-0"), pod("w-1"), pod("w-2", since=JUST_READY)]
    # w-2 is ready, not scraped yet: the means still are w-0's and w-1's alone (0.9 would ask for 4).
    st = await tick(scaler, body, pods)
    cond = scaling_condition(st)
    assert deployments.patches == [3] and cond["reason"] == "Steady"
    assert "no series of the new workers w-2 yet" in cond["message"] and scraped.asked == [["w-2"]]
    scraped.pods = {"w-0", "w-1", "w-2"}  # scraped, and the pool is still that loaded: scaled up
    st = await tick(scaler, body, pods)
    assert deployments.patches == [3, 4] and scaling_condition(st)["reason"] == "ScaledUp"


async def test_a_new_replica_never_scraped_holds_scale_ups_for_the_scrape_grace_only(setup):  # noqa: F811
    """Past SCRAPE_GRACE no wait: the scaler scales on what it has (and says MetricsMissing when nothing is
    scraped at all)."""
    scaler, metrics, deployments, _ = setup
    scraped = Scraped(metrics)
    body = await scaled_up_once(scaler, metrics, deployments)
    await tick(scaler, body, [pod("w-0"), pod("w-1"), pod("w-2", since=JUST_READY)])
    assert deployments.patches == [3]
    assert SCRAPE_GRACE < 180
    st = await tick(scaler, body, [pod("w-0"), pod("w-1"), pod("w-2", since=READY_LONG_AGO)])
    assert deployments.patches == [3, 4] and scaling_condition(st)["reason"] == "ScaledUp"
    assert scraped.asked == [["w-2"]]  # only while w-2 was within the grace


async def test_the_scrape_wait_holds_scale_ups_only(setup):  # noqa: F811
    """Scale-downs go on as before; replicas ready before the last scale-up, and a first scale-up once the pods
    just ready are scraped, wait for nothing more; a Prometheus that cannot say which pods it scraped changes no
    replicas."""
    scaler, metrics, deployments, _ = setup
    scraped = Scraped(metrics)
    scraped.pods = {"w-0", "w-1"}
    metrics.signals = (0.99, 0.9, 0.0)
    body = pool(kvHigh=0.85)
    st = await tick(scaler, body, [pod("w-0"), pod("w-1", since=JUST_READY)])  # no scale-up remembered yet
    assert deployments.patches == [3] and scraped.asked == [["w-1"]]
    scraped.asked.clear()
    pods = [pod("w-0"), pod("w-1", since=JUST_READY), pod("w-2", since=JUST_READY)]
    scraped.pods = MetricsError("http://prometheus:9090/api/v1/query: no answer within 5 s")
    st = await tick(scaler, body, pods)
    cond = scaling_condition(st)
    assert deployments.patches == [3] and (cond["reason"], cond["status"]) == ("MetricsUnavailable", "False")
    assert scraped.asked == [["w-2"]]  # w-1 was listed at the scale-up: not one of its new replicas
    metrics.signals = (0.99, 0.1, 0.0)  # little KV in use: down by one, unscraped replica or not
    scraped.pods = set()
    st = await tick(scaler, body, pods)
    assert deployments.patches == [3, 2] and scaling_condition(st)["reason"] == "ScaledDown"


async def test_an_operator_restarted_after_a_scale_up_waits_for_the_pods_just_ready_too(setup):  # noqa: F811
    """The scale-up it made is not remembered across a restart (a new operator, a standby become leader): the
    pods ready for less than SCRAPE_GRACE may be the replicas it added, so a further scale-up waits for their
    first scrape as well (it scaled up again at once on the earlier replicas' means alone, and overshot)."""
    scaler, metrics, deployments, _ = setup
    deployments.replicas = 3  # scaled 2 -> 3 just before the restart
    scraped = Scraped(metrics)
    scraped.pods = {"w-0", "w-1"}  # not w-2 yet
    metrics.signals = (0.99, 0.9, 0.0)  # the means of w-0 and w-1 alone
    body, pods = pool(kvHigh=0.85), [pod("w-0"), pod("w-1"), pod("w-2", since=JUST_READY)]
    st = await tick(scaler, body, pods)
    assert deployments.patches == [] and "no series of the new workers w-2 yet" in scaling_condition(st)["message"]
    scraped.pods = {"w-0", "w-1", "w-2"}
    st = await tick(scaler, body, pods)
    assert deployments.patches == [4] and scraped.asked == [["w-2"], ["w-2"]]

"""The autoscaling policy of a LoRAPool (``spec.scaling``): pure, no I/O, no clock (times are passed in).

``ScalingSpec.parse`` reads the block; ``recommend`` turns the pool's signals into a replica count;
``Stabilizer`` smooths recommendations over time as Kubernetes' HPA does. Signals:

* hit rate: the share of adapter lookups the workers served from GPU-resident adapters;
* KV usage: the workers' mean KV-cache usage (0..1);
* waiting: the mean number of requests per worker waiting to be scheduled. A worker saturates on
  ``max_num_seqs`` (or its token budget) long before a large KV cache fills: then requests queue and are
  refused with 429 ``queue_full`` while KV usage stays low, so KV usage alone would scale it down.

Any may be unknown (``None``: no series, no traffic); an unknown signal never scales on its own. The hit
rate scales up only under load pressure (KV usage at or above kvLow, or requests waiting): adapters and
KV blocks share each worker's page pool, so spreading the load frees pages for adapters; an idle pool's
misses are long-tail traffic that more replicas, each with a pool of the same size, would miss as often.
"""

from __future__ import annotations

import math
import re
from collections import deque
from dataclasses import dataclass
from typing import Any

from lorafleet.operator.crd_models import SpecError, _int, deployment_name
from lorafleet.operator.pinned_need import PinnedNeed

MAX_REPLICAS = 1000  # spec.scaling.maxReplicas at most (the CRD's bound): each pass models that many workers
FIELD = "spec.scaling"
URL_RE = re.compile(r"https?://[^\x00-\x20\x7f-\xa0?#]+")  # fullmatch; the CRD's pattern


def _ratio(value: Any, field_name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise SpecError(f"{field_name}: {value!r} must be a number 0..1")
    return float(value)


@dataclass(slots=True, frozen=True)
class ScalingSpec:
    """A pool's ``spec.scaling``, defaults applied."""

    target: str  # the worker Deployment, in the pool's namespace
    prometheus_url: str
    max_replicas: int
    min_replicas: int = 1
    target_hit_rate: float = 0.9
    kv_high: float = 0.85
    kv_low: float = 0.3
    waiting_high: float = 2.0  # mean requests waiting per worker above which the pool scales up
    scale_up_seconds: int = 0  # stabilization windows
    scale_down_seconds: int = 300
    rate_window_seconds: int = 120  # the hit rate's rate() window

    @classmethod
    def parse(cls, data: Any) -> ScalingSpec:
        """The block as the CRD describes it; ``SpecError`` naming the field otherwise."""
        if not isinstance(data, dict):
            raise SpecError(f"{FIELD}: must be an object (target, prometheusURL, maxReplicas, ...)")
        target = data.get("target")
        if not isinstance(target, str) or not target:
            raise SpecError(f"{FIELD}.target: required (the name of the worker Deployment in the pool's namespace)")
        deployment_name(target, f"{FIELD}.target")
        url = data.get("prometheusURL")
        if url is None:
            raise SpecError(f"{FIELD}.prometheusURL: required (e.g. http://prometheus.monitoring:9090)")
        if not isinstance(url, str) or not URL_RE.fullmatch(url):
            raise SpecError(f"{FIELD}.prometheusURL: must be an http:// or https:// URL with no query, fragment, spaces "
                            "or control characters (the operator adds /api/v1/query to it; the URL is not echoed: it "
                            "may hold a password)")
        if data.get("maxReplicas") is None:
            raise SpecError(f"{FIELD}.maxReplicas: required (the most worker replicas the autoscaler may set)")
        max_replicas = _int(data["maxReplicas"], f"{FIELD}.maxReplicas", lo=1, hi=MAX_REPLICAS)
        min_replicas = _int(data.get("minReplicas", 1), f"{FIELD}.minReplicas", lo=0)
        if min_replicas > max_replicas:
            raise SpecError(f"{FIELD}.minReplicas: {min_replicas} must not exceed {FIELD}.maxReplicas "
                            f"({max_replicas})")
        kv_high = _ratio(data.get("kvHigh", 0.85), f"{FIELD}.kvHigh")
        kv_low = _ratio(data.get("kvLow", 0.3), f"{FIELD}.kvLow")
        if kv_low >= kv_high:
            raise SpecError(f"{FIELD}.kvLow: {kv_low} must be below {FIELD}.kvHigh ({kv_high})")
        waiting_high = data.get("waitingHigh", 2)
        if isinstance(waiting_high, bool) or not isinstance(waiting_high, int | float) or not waiting_high >= 0.1:
            raise SpecError(f"{FIELD}.waitingHigh: {waiting_high!r} must be a number >= 0.1 (mean requests waiting "
                            f"per worker)")
        return cls(
            target=target,
            prometheus_url=url,
            max_replicas=max_replicas,
            min_replicas=min_replicas,
            target_hit_rate=_ratio(data.get("targetHitRate", 0.9), f"{FIELD}.targetHitRate"),
            kv_high=kv_high,
            kv_low=kv_low,
            waiting_high=float(waiting_high),
            scale_up_seconds=_int(data.get("scaleUpStabilizationSeconds", 0),
                                  f"{FIELD}.scaleUpStabilizationSeconds", lo=0),
            scale_down_seconds=_int(data.get("scaleDownStabilizationSeconds", 300),
                                    f"{FIELD}.scaleDownStabilizationSeconds", lo=0),
            rate_window_seconds=_int(data.get("rateWindowSeconds", 120), f"{FIELD}.rateWindowSeconds", lo=10, hi=86400),
        )


def bound_correction(spec: ScalingSpec, current: int) -> tuple[int, str] | None:
    """What HPA does before it looks at metrics: a target scaled to 0 by hand (with minReplicas > 0) is
    left alone, a count outside [minReplicas, maxReplicas] is brought inside. None: within bounds."""
    if current == 0 and spec.min_replicas > 0:
        return 0, "the Deployment is scaled to 0: autoscaling is off until it has replicas again"
    if current > spec.max_replicas:
        return spec.max_replicas, f"{current} replicas is above maxReplicas {spec.max_replicas}"
    if current < spec.min_replicas:
        return spec.min_replicas, f"{current} replicas is below minReplicas {spec.min_replicas}"
    return None


# Mean requests waiting per worker from which requests count as waiting (a queue): below it they are
# mostly arrivals between two engine steps, which any busy worker shows at every scrape.
WAITING = 1.0
# Share of a worker's sequence seats (--max-num-seqs) in use from which it is about full: past it, arrivals
# queue while the KV cache may stay nearly empty.
SEATS_FULL = 0.9


def _waiting_up(spec: ScalingSpec, waiting: float, current: int) -> int:
    """The queue spread over more workers lands at waitingHigh (HPA's average-value target), at least one
    more and at most double: a queue is backlog, not a rate, so it overstates the capacity missing."""
    return max(current + 1, min(2 * current, math.ceil(current * waiting / spec.waiting_high - 1e-9)))


def recommend(spec: ScalingSpec, hit_rate: float | None, kv_usage: float | None, current: int,
              waiting: float | None = None, beside: int = 0, *, seats: float | None = None) -> tuple[int, str]:
    """(replicas, why) for one observation. Up: KV usage above kvHigh (proportionally, at least one more),
    requests waiting per worker above waitingHigh (proportionally, at least one more, at most double), or
    the hit rate below target under load pressure (KV usage >= kvLow or requests waiting: one more); the
    largest of these. Down by one: KV usage below kvLow, unless requests wait (at least ``WAITING`` per
    worker), they or the seats in use are unknown, or one fewer replica would put the KV in use above kvHigh, the queue above waitingHigh or the
    running sequences at SEATS_FULL of the workers' ``--max-num-seqs`` (``seats``: their mean share in use; a
    queue is not linear in load, none waits until the seats are full), or,
    with the hit rate below target, under load pressure (it would be scaled up again at once); otherwise
    hold. Clamped to [minReplicas, maxReplicas], and never down to 0: at 0 no worker is left to show
    demand, so nothing could wake the pool. A target at 0 (minReplicas 0) wakes on any demand, or, where workers
    of other Deployments serve the pool (``beside``), when these rules scale the pool up. ``beside``: the pool's
    ready workers that other Deployments run (a pool naming no spec.workerDeployment may span several, of which
    it scales one): the load is spread
    over them too, and the target's count changes by what the whole pool needs (never to 0 either: they may
    go, and the target's workers are the ones that show demand then)."""
    corrected = bound_correction(spec, current)
    if corrected is not None:
        return corrected
    if hit_rate is None and kv_usage is None and waiting is None:
        return current, "no metrics for the pool's workers (no series or no traffic yet)"
    if current == 0 and not beside:  # minReplicas 0: any traffic, KV in use or queued request wakes the pool
        if hit_rate is not None or (kv_usage or 0.0) > 0 or (waiting or 0.0) > 0:
            return 1, "demand while scaled to 0"
        return 0, "no demand"
    workers = current + beside  # over which the load the metrics show is spread
    is_waiting = waiting is not None and waiting >= WAITING
    pressure = is_waiting or (kv_usage is not None and kv_usage >= spec.kv_low)
    hit_low = hit_rate is not None and hit_rate < spec.target_hit_rate
    reasons, ups = [], []
    if kv_usage is not None and kv_usage > spec.kv_high:
        reasons.append(f"KV usage {kv_usage:.3g} > kvHigh {spec.kv_high:g}")
        # The KV load spread over more workers lands at kvHigh; the epsilon keeps an exact product from
        # rounding up one more.
        ups.append(max(workers + 1, math.ceil(workers * kv_usage / spec.kv_high - 1e-9)))
    if waiting is not None and waiting > spec.waiting_high:
        reasons.append(f"{waiting:.3g} requests waiting per worker > waitingHigh {spec.waiting_high:g}")
        ups.append(_waiting_up(spec, waiting, workers))
    if hit_low and pressure:
        reasons.append(f"GPU hit rate {hit_rate:.3g} < targetHitRate {spec.target_hit_rate:g}")
        ups.append(workers + 1)
    if ups:
        wanted = max(ups) - beside
    elif current == 0:  # the pool's other Deployments serve it: the target wakes when they need more workers
        return 0, (" and ".join(reasons) or "within bounds") + (f" over the {beside} workers other Deployments run: "
                                                                 f"the target stays at 0 until they need more")
    else:
        if hit_low:  # without load pressure: hold, or let the kvLow rule scale down
            reasons.append(f"GPU hit rate {hit_rate:.3g} < targetHitRate {spec.target_hit_rate:g}, but no load "
                           f"pressure (KV usage below kvLow, no requests waiting): more replicas would not hold "
                           f"more adapters")
        if kv_usage is None or kv_usage >= spec.kv_low:
            return current, " and ".join(reasons) or "within bounds"
        wanted = current - 1
        reasons.append(f"KV usage {kv_usage:.3g} < kvLow {spec.kv_low:g}")
        why = " and ".join(reasons)
        if wanted >= max(spec.min_replicas, 1):
            fewer = workers / (workers - 1)  # how much the load spread over one fewer worker grows
            if waiting is None:  # the gauge is always exported: absent is unknown, not 0
                return current, (f"{why}, but the requests waiting are not known (no series in Prometheus): no "
                                 f"scale-down on KV usage alone, which stays low while a worker full at "
                                 f"--max-num-seqs queues requests")
            if is_waiting:
                return current, f"{why}, but {waiting:.3g} requests wait per worker: no scale-down while requests wait"
            if waiting is not None and waiting * fewer > spec.waiting_high:
                return current, (f"{why}, but one fewer replica would put {waiting * fewer:.3g} "
                                 f"requests waiting per worker > waitingHigh {spec.waiting_high:g}")
            if seats is not None and seats * fewer >= SEATS_FULL:
                return current, (f"{why}, but one fewer replica would run {seats * fewer:.3g} of its sequence seats "
                                 f"(--max-num-seqs): requests would queue")
            if kv_usage * fewer > spec.kv_high:
                return current, (f"{why}, but one fewer replica would put KV usage at "
                                 f"{kv_usage * fewer:.3g} > kvHigh {spec.kv_high:g}")
            # (The epsilon: the KV in use spread back over one fewer is the reading that was scaled up from.)
            if hit_low and (kv_usage * fewer >= spec.kv_low - 1e-9
                            or (waiting is not None and waiting * fewer >= WAITING - 1e-9)):
                return current, (f"{why}, but one fewer replica would be under load pressure with the hit rate below "
                                 f"target, and be scaled up again at once")
    clamped = min(max(wanted, spec.min_replicas), spec.max_replicas)
    why = " and ".join(reasons)
    if clamped == 0:
        return 1, why + " (capped at 1: at 0 no worker would be left to show demand and wake the pool)"
    if clamped != wanted:
        why += f" (capped at {'maxReplicas' if wanted > clamped else 'minReplicas'} {clamped})"
    return clamped, why


def pinned_floor(spec: ScalingSpec, wanted: int, current: int, pinned: PinnedNeed | None, beside: int = 0
                 ) -> tuple[int, str]:
    """(replicas, why they are not ``wanted``: "" where they are). A pinned adapter keeps a GPU-resident copy:
    the target never goes below the workers the pool's pinned adapters need (pinned_need.py; ``beside``: the
    pool's ready workers that other Deployments run hold them too), and one below is raised to it, never above
    maxReplicas; while that need is not known (``pinned`` None: no reconcile pass has counted it yet) it is not
    scaled down at all. A target at 0 (by hand, or minReplicas 0) is left as ``wanted`` has it."""
    if current == 0 or (pinned is not None and not pinned.num_pinned):
        return wanted, ""
    if pinned is None:
        floor = min(current, spec.max_replicas)
        return max(wanted, floor), "" if wanted >= floor else (
            f"; held at {floor}: the workers the pool's pinned adapters need are not counted yet (no reconcile "
            f"pass since the operator started, or no worker reported its room), and fewer might not hold them")
    num_pinned, need = pinned.num_pinned, pinned.num_workers
    if not pinned.held:  # no count of workers holds them: no floor, which would only cost workers
        return wanted, (f"; {num_pinned} pinned adapters cannot all stay GPU-resident on any number of workers "
                        f"(copies on every worker that do not fit one together): more workers do not help; give the "
                        f"workers more GPU adapter slots (--max-loras) or room, or unpin one (spec.pinned: false)")
    floor = spec.max_replicas if need is None else min(need - beside, spec.max_replicas)
    if wanted >= floor:
        return wanted, ""
    held = "raised to" if floor > current else "held at"
    pins = f"{num_pinned} pinned adapter{'s need' if num_pinned > 1 else ' needs'}"
    others = f" ({beside} of them in other Deployments)" if beside else ""
    if need is not None and need - beside <= spec.max_replicas:
        return floor, f"; {held} {floor}: {pins} {need} workers{others}"
    workers = f"more than {spec.max_replicas + beside}" if need is None else str(need)
    return floor, (f"; {held} maxReplicas {floor}: {pins} {workers} workers{others}, more than maxReplicas allows, "
                   f"so not all can stay GPU-resident; raise spec.scaling.maxReplicas or the workers' GPU adapter "
                   f"slots (--max-loras), or unpin one (spec.pinned: false)")


class Stabilizer:
    """HPA's stabilization windows for one pool: a scale-up goes to the lowest recommendation of the last
    ``up_seconds``, a scale-down to the highest of the last ``down_seconds``. What was not watched counts as
    the current count (HPA seeds a fresh history with it): a fresh one (a new pool, an operator restart:
    the history is memory), or one that observed nothing for longer than both windows (a standby replica
    leading again, a long metrics outage), scales up only once it has watched a whole up window and down
    only once it has watched a whole down window."""

    def __init__(self) -> None:
        self._history: deque[tuple[float, int]] = deque()  # (time, recommendation), oldest first
        self._since: float = 0.0  # start of the observations without a gap
        self._last: float | None = None  # time of the last observation

    def stabilize(self, recommended: int, current: int, *, now: float, up_seconds: float,
                  down_seconds: float) -> int:
        """The replica count to set now; records ``recommended``."""
        horizon = max(up_seconds, down_seconds)
        if self._last is None or now - self._last >= horizon:  # nothing observed in either window
            self._since = now
        self._last = now
        while self._history and self._history[0][0] <= now - horizon:
            self._history.popleft()
        up = min([r for t, r in self._history if t > now - up_seconds] + [recommended])
        down = max([r for t, r in self._history if t > now - down_seconds] + [recommended])
        if now - self._since < up_seconds:
            up = min(up, current)
        if now - self._since < down_seconds:
            down = max(down, current)
        self._history.append((now, recommended))
        return min(max(current, up), down)

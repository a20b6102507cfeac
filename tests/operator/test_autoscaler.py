"""The autoscaling policy: spec.scaling parsing, recommendations (every branch, unknown signals, bounds,
minReplicas 0) and HPA-like stabilization windows, with the clock passed in."""

from __future__ import annotations

import pytest

from lorafleet.operator.autoscaler import ScalingSpec, Stabilizer, pinned_floor, recommend
from lorafleet.operator.crd_models import PoolSpec, SpecError
from lorafleet.operator.pinned_need import NO_PINNED, PinnedNeed

BASE = {"target": "lorafleet-worker", "prometheusURL": "http://prometheus.monitoring:9090", "maxReplicas": 8}


def spec(**overrides) -> ScalingSpec:
    return ScalingSpec.parse({**BASE, **overrides})


# --- parse -----------------------------------------------------------------------------------------

def test_parse_defaults():
    s = ScalingSpec.parse(BASE)
    assert (s.target, s.prometheus_url, s.max_replicas) == ("lorafleet-worker", BASE["prometheusURL"], 8)
    assert (s.min_replicas, s.target_hit_rate, s.kv_high, s.kv_low) == (1, 0.9, 0.85, 0.3)
    assert (s.scale_up_seconds, s.scale_down_seconds, s.rate_window_seconds, s.waiting_high) == (0, 300, 120, 2.0)


def test_parse_all_fields():
    s = spec(minReplicas=0, targetHitRate=1, kvHigh=0.7, kvLow=0, scaleUpStabilizationSeconds=60,
             scaleDownStabilizationSeconds=0, rateWindowSeconds=600, waitingHigh=0.5)
    assert (s.min_replicas, s.target_hit_rate, s.kv_high, s.kv_low, s.waiting_high) == (0, 1.0, 0.7, 0.0, 0.5)
    assert (s.scale_up_seconds, s.scale_down_seconds, s.rate_window_seconds) == (60, 0, 600)


@pytest.mark.parametrize(("data", "field"), [
    ("yes", "spec.scaling"),
    ({"prometheusURL": "http://p:9090", "maxReplicas": 2}, "spec.scaling.target"),
    ({**BASE, "target": "Worker_Deployment"}, "spec.scaling.target"),
    ({"target": "w", "maxReplicas": 2}, "spec.scaling.prometheusURL"),
    ({**BASE, "prometheusURL": "prometheus:9090"}, "spec.scaling.prometheusURL"),
    ({"target": "w", "prometheusURL": "http://p:9090"}, "spec.scaling.maxReplicas"),
    ({**BASE, "maxReplicas": 0}, "spec.scaling.maxReplicas"),
    ({**BASE, "maxReplicas": 1001}, "spec.scaling.maxReplicas"),  # each pass models that many workers
    ({**BASE, "maxReplicas": "4"}, "spec.scaling.maxReplicas"),
    ({**BASE, "minReplicas": -1}, "spec.scaling.minReplicas"),
    ({**BASE, "minReplicas": 9}, "spec.scaling.minReplicas"),
    ({**BASE, "targetHitRate": 1.5}, "spec.scaling.targetHitRate"),
    ({**BASE, "rateWindowSeconds": 5}, "spec.scaling.rateWindowSeconds"),
    ({**BASE, "target": "workers\n"}, "spec.scaling.target"),  # a trailing newline is no part of a name or URL
    ({**BASE, "prometheusURL": "http://p:9090\n"}, "spec.scaling.prometheusURL"),
    ({**BASE, "prometheusURL": "http://p:9090/api/v1/admin/tsdb/snapshot?x="}, "spec.scaling.prometheusURL"),
    ({**BASE, "prometheusURL": "http://p:9090/#"}, "spec.scaling.prometheusURL"),
    ({**BASE, "rateWindowSeconds": "2m"}, "spec.scaling.rateWindowSeconds"),
    ({**BASE, "kvHigh": True}, "spec.scaling.kvHigh"),
    ({**BASE, "kvLow": "low"}, "spec.scaling.kvLow"),
    ({**BASE, "kvLow": 0.9, "kvHigh": 0.8}, "spec.scaling.kvLow"),
    ({**BASE, "kvLow": 0.9}, "spec.scaling.kvLow"),  # above the default kvHigh
    ({**BASE, "scaleUpStabilizationSeconds": -1}, "spec.scaling.scaleUpStabilizationSeconds"),
    ({**BASE, "scaleDownStabilizationSeconds": 1.5}, "spec.scaling.scaleDownStabilizationSeconds"),
    ({**BASE, "waitingHigh": 0}, "spec.scaling.waitingHigh"),
    ({**BASE, "waitingHigh": "2"}, "spec.scaling.waitingHigh"),
    ({**BASE, "waitingHigh": True}, "spec.scaling.waitingHigh"),
])
def test_parse_refusals_name_the_field(data, field):
    with pytest.raises(SpecError, match=f"^{field.replace('.', '[.]')}:"):
        ScalingSpec.parse(data)


def test_a_bad_scaling_block_is_a_pool_spec_error():
    body = {"metadata": {"name": "p", "namespace": "ns"},
            "spec": {"baseModel": "m", "workerSelector": {"matchLabels": {"a": "b"}}, "scaling": {"target": "w"}}}
    with pytest.raises(SpecError, match="^spec.scaling.prometheusURL:"):
        PoolSpec.parse(body)
    body["spec"]["scaling"] = BASE
    assert PoolSpec.parse(body).scaling == ScalingSpec.parse(BASE)
    del body["spec"]["scaling"]
    assert PoolSpec.parse(body).scaling is None


# --- recommend -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("hit_rate", "kv_usage", "current", "expected", "why"), [
    # KV above kvHigh: in proportion, at least one more.
    (0.95, 0.9, 2, 3, "KV usage 0.9 > kvHigh 0.85"),
    (0.95, 0.99, 4, 5, "KV usage"),
    (None, 1.0, 4, 5, "KV usage"),  # ceil(4 * 1.0 / 0.85) = 5
    (0.95, 1.0, 6, 8, "KV usage"),  # ceil(6 / 0.85) = 8
    (0.5, 0.95, 6, 7, "and GPU hit rate 0.5 < targetHitRate 0.9"),  # both: the proportional step
    # Hit rate below target with KV in use (adapters and KV blocks share the page pool): one more.
    (0.5, 0.5, 3, 4, "GPU hit rate 0.5 < targetHitRate 0.9"),
    (0.5, 0.3, 3, 4, "GPU hit rate"),  # exactly kvLow counts as load
    (0.5, None, 3, 3, "but no load pressure"),  # no load signal: the hit rate alone never scales
    # KV below kvLow with the hit rate on target or unknown: one fewer.
    (0.95, 0.1, 3, 2, "KV usage 0.1 < kvLow 0.3"),
    (0.9, 0.1, 3, 2, "KV usage"),  # exactly on target counts as on target
    (None, 0.1, 3, 2, "KV usage"),
    # Otherwise hold.
    (0.5, 0.1, 3, 2, "more replicas would not hold more adapters and KV usage 0.1 < kvLow 0.3"),  # idle
    (0.95, 0.5, 3, 3, "within bounds"),
    (0.95, 0.85, 3, 3, "within bounds"),  # exactly kvHigh is not above it
    (0.95, 0.3, 3, 3, "within bounds"),  # exactly kvLow is not below it
    (0.95, None, 3, 3, "within bounds"),  # a healthy hit rate alone never scales down
    (None, 0.5, 3, 3, "within bounds"),
    (None, None, 3, 3, "no metrics"),  # both unknown: hold
])
def test_recommend(hit_rate, kv_usage, current, expected, why):
    waiting = None if hit_rate is None and kv_usage is None else 0.0  # no request waits (the queue gauge is there)
    replicas, reason = recommend(spec(), hit_rate, kv_usage, current, waiting)
    assert replicas == expected and why in reason


def test_recommend_is_clamped_to_the_bounds():
    assert recommend(spec(maxReplicas=4), 0.95, 1.0, 4) == (4, "KV usage 1 > kvHigh 0.85 (capped at maxReplicas 4)")
    assert recommend(spec(maxReplicas=4), 0.95, 1.0, 3)[0] == 4  # ceil(3 / 0.85) = 4
    assert recommend(spec(maxReplicas=4), 0.2, 0.5, 4)[0] == 4
    assert recommend(spec(minReplicas=2), 0.95, 0.1, 2) == (2, "KV usage 0.1 < kvLow 0.3 (capped at minReplicas 2)")


@pytest.mark.parametrize(("current", "expected", "why"), [
    (9, 8, "above maxReplicas 8"), (1, 2, "below minReplicas 2"), (0, 0, "scaled to 0"),
])
def test_out_of_bounds_is_corrected_whatever_the_metrics(current, expected, why):
    for signals in [(None, None), (0.95, 0.5), (0.1, 1.0), (1.0, 0.0)]:
        replicas, reason = recommend(spec(minReplicas=2), *signals, current)
        assert replicas == expected and why in reason


@pytest.mark.parametrize(("hit_rate", "kv_usage", "expected"), [
    (None, None, 0), (None, 0.0, 0), (0.95, None, 1), (None, 0.2, 1), (0.2, 0.95, 1), (1.0, 0.0, 1),
])
def test_min_zero_wakes_on_any_demand(hit_rate, kv_usage, expected):
    assert recommend(spec(minReplicas=0), hit_rate, kv_usage, 0)[0] == expected


def test_min_zero_never_scales_itself_to_zero():
    """At 0 no worker is left to show demand, so nothing could wake the pool: the autoscaler stops at 1."""
    replicas, why = recommend(spec(minReplicas=0), 0.95, 0.1, 1, 0.0)
    assert replicas == 1 and "at 0 no worker would be left to show demand" in why
    assert recommend(spec(minReplicas=0), 0.95, 0.1, 2, 0.0)[0] == 1


def test_workers_of_other_deployments_share_the_load_the_target_is_scaled_for():
    """``beside``: the pool's ready workers that other Deployments run. The metrics' load is spread over them
    too, and only the target's count changes by what the whole pool needs."""
    s = spec(kvLow=0.5, kvHigh=0.6, minReplicas=0)
    assert recommend(s, 0.95, 0.9, 2, 0.0, beside=2)[0] == 4  # 4 workers at 0.9 need 6 at 0.6: 2 more
    assert recommend(s, 0.95, 0.9, 2, 0.0)[0] == 3  # alone: 2 at 0.9 need 3
    # 4 workers at 0.45: 3 carry 0.6, not above kvHigh (alone, 2 at 0.45 would put one at 0.9: held)
    assert recommend(s, 0.95, 0.45, 2, 0.0, beside=2)[0] == 1
    assert recommend(s, 0.95, 0.45, 2, 0.0)[0] == 2
    # Never to 0 by itself, although the others serve: they may go, and nothing would bring the target back.
    assert recommend(s, 0.95, 0.2, 1, 0.0, beside=2)[0] == 1
    assert recommend(s, 0.95, 0.2, 2, 0.0, beside=2)[0] == 1


def test_a_scale_down_that_would_cross_kv_high_holds():
    s = spec(kvLow=0.5, kvHigh=0.6)
    # 2 workers at 0.45: one would carry 0.9 > kvHigh and be scaled up again at once.
    replicas, why = recommend(s, 0.95, 0.45, 2, 0.0)
    assert replicas == 2 and "one fewer replica would put KV usage at 0.9 > kvHigh 0.6" in why
    assert recommend(s, 0.95, 0.4, 4, 0.0)[0] == 3  # 3 would carry 0.533 <= 0.6


@pytest.mark.parametrize("hit_rate", [0.95, 0.8])  # at and below the 0.9 target
@pytest.mark.parametrize(("kv_low", "kv_high"), [(0.3, 0.85), (0.5, 0.6), (0.45, 0.5), (0.1, 0.9), (0.7, 0.75)])
def test_a_constant_load_settles_without_flapping(kv_low, kv_high, hit_rate):
    """The KV in use stays the same while the replicas change (it spreads over them): every pass follows the
    recommendation, and the count must settle, not go down and up again (below the hit-rate target, one
    fewer replica under load pressure would be scaled up again)."""
    s = spec(kvLow=kv_low, kvHigh=kv_high, maxReplicas=40)
    for start in (1, 6):
        for tenths in range(1, 120):
            load, current, seen = tenths / 10, start, []  # KV in use, in workers' worth
            for _ in range(40):
                current = recommend(s, hit_rate, min(1.0, load / current), current, 0.0)[0]
                seen.append(current)
            turns = [i for i in range(1, len(seen) - 1) if (seen[i] - seen[i - 1]) * (seen[i + 1] - seen[i]) < 0]
            assert not turns and seen[-1] == seen[-2], (load, start, seen)


def test_a_constant_queue_below_the_hit_rate_target_settles():
    """Requests waiting spread over the replicas as well: 0.6 per worker at 2 is 1.2 at 1, which is load
    pressure with the hit rate below target, so 2 hold."""
    s = spec()
    replicas, why = recommend(s, 0.8, 0.1, 2, waiting=0.6)
    assert replicas == 2 and "one fewer replica would be under load pressure" in why
    assert recommend(s, 0.95, 0.1, 2, waiting=0.6)[0] == 1  # at the target: nothing to gain from 2


# --- stabilizer ------------------------------------------------------------------------------------

def steps(stabilizer: Stabilizer, current: int, recommendations: list[tuple[float, int]], *, up=0.0,
          down=300.0) -> list[int]:
    """Feed (time, recommendation) pairs; the Deployment follows every result."""
    out = []
    for now, rec in recommendations:
        current = stabilizer.stabilize(rec, current, now=now, up_seconds=up, down_seconds=down)
        out.append(current)
    return out


def test_scale_up_at_once_without_an_up_window():
    assert steps(Stabilizer(), 2, [(0, 4), (30, 6)]) == [4, 6]


def test_scale_up_takes_the_lowest_recommendation_of_the_up_window():
    # 60 s window: a spike must last the whole window to count in full.
    assert steps(Stabilizer(), 2, [(0, 2), (30, 5), (60, 4), (90, 6), (120, 6)], up=60) == [2, 2, 4, 4, 6]


def test_a_fresh_stabilizer_waits_a_whole_down_window_before_scaling_down():
    """An operator restart loses the history: it must not scale down on its first observations."""
    assert steps(Stabilizer(), 4, [(1000, 1), (1100, 1), (1299, 1), (1300, 1)]) == [4, 4, 4, 1]
    assert steps(Stabilizer(), 4, [(0, 1)], down=0) == [1]


def test_scale_down_takes_the_highest_recommendation_of_the_down_window():
    s = Stabilizer()
    assert steps(s, 4, [(0, 4), (300, 4)]) == [4, 4]  # the first window has passed
    # Lower recommendations after a 4 at t=300: each held at the highest of the last 300 s.
    assert steps(s, 4, [(400, 3), (500, 2), (599, 2), (601, 2), (699, 2), (701, 2)]) == [4, 4, 4, 3, 3, 2]


def test_scale_up_is_not_held_by_the_down_window():
    s = Stabilizer()
    assert steps(s, 2, [(0, 1), (10, 5)]) == [2, 5]
    # Down to 3 is held while the 5 is in the window; up is free at any time.
    assert steps(s, 5, [(20, 3), (30, 7)]) == [5, 7]


def test_a_fresh_stabilizer_waits_a_whole_up_window_before_scaling_up():
    """As HPA, whose fresh history holds the current count: after a restart a spike must last the whole up
    window too, not scale up on the first observation."""
    assert steps(Stabilizer(), 2, [(1000, 5), (1030, 5), (1059, 5), (1060, 5)], up=60) == [2, 2, 2, 5]
    assert steps(Stabilizer(), 2, [(1000, 5), (1030, 3), (1060, 5)], up=60) == [2, 2, 3]


def test_a_gap_longer_than_the_windows_is_a_fresh_start():
    """No observation in either window (a standby replica that leads again, a long metrics outage): what
    happened meanwhile is unknown, so no scale-down before a whole window is watched again."""
    s = Stabilizer()
    assert steps(s, 4, [(t, 4) for t in range(0, 600, 30)])[-1] == 4
    assert steps(s, 4, [(5000, 1), (5200, 1), (5300, 1)]) == [4, 4, 1]
    assert steps(s, 2, [(9000, 6), (9030, 6), (9060, 6)], up=60) == [2, 2, 6]


def test_old_history_is_dropped():
    s = Stabilizer()
    steps(s, 2, [(t, 2) for t in range(0, 3000, 10)])
    assert len(s._history) <= 31  # only the last down window (300 s at 10 s steps)


# --- requests waiting, and the hit rate without load ----------------------------------------------

@pytest.mark.parametrize(("kv_usage", "waiting", "current", "expected", "why"), [
    # max_num_seqs saturates long before a large KV cache: requests queue while KV usage is under kvLow.
    (0.121, 3.0, 4, 6, "3 requests waiting per worker > waitingHigh 2"),  # ceil(4 * 3 / 2)
    (0.121, 2.5, 4, 5, "requests waiting"),
    (0.121, 2.1, 4, 5, "requests waiting"),  # at least one more
    (0.121, 40.0, 3, 6, "requests waiting"),  # a queue is backlog: at most double per pass
    (0.121, 40.0, 6, 8, "(capped at maxReplicas 8)"),
    (0.9, 3.0, 2, 3, "KV usage 0.9 > kvHigh 0.85 and 3 requests waiting"),  # both: the larger step
    (0.5, 6.0, 2, 4, "requests waiting"),
    # Requests wait (a queue, not arrivals between two steps): never a scale-down.
    (0.121, 2.0, 4, 4, "no scale-down while requests wait"),  # exactly waitingHigh is not above it
    (0.121, 1.0, 4, 4, "no scale-down while requests wait"),
    # A worker or two between steps: down, unless one fewer would queue above waitingHigh.
    (0.121, 0.5, 4, 3, "KV usage 0.121 < kvLow 0.3"),
    (0.121, 0.0, 4, 3, "KV usage"),
    (0.121, 0.9, 2, 2, "one fewer replica would put 1.8 requests waiting per worker > waitingHigh 1.5"),
    (0.5, 1.5, 4, 4, "within bounds"),
])
def test_requests_waiting(kv_usage, waiting, current, expected, why):
    s = spec(waitingHigh=1.5) if "1.5" in why else spec()
    replicas, reason = recommend(s, hit_rate=0.95, kv_usage=kv_usage, current=current, waiting=waiting)
    assert replicas == expected and why in reason, reason


def test_a_saturated_pool_is_never_scaled_down():
    """The reviewed case: 4 workers at max_num_seqs, requests refused with 429 queue_full, KV usage 0.121."""
    replicas, why = recommend(spec(), hit_rate=0.95, kv_usage=0.121, current=4, waiting=12.0)
    assert replicas == 8 and "requests waiting per worker" in why
    # The queue unknown (no series: a relabelling that dropped it): KV usage alone scaled it down, one replica a
    # window; held now, saying why.
    replicas, why = recommend(spec(), hit_rate=0.95, kv_usage=0.121, current=4, seats=1.0)
    assert replicas == 4 and "the requests waiting are not known" in why, why
    assert recommend(spec(), hit_rate=0.95, kv_usage=0.121, current=4, waiting=0.0)[0] == 3  # known: none waits


def test_a_pool_bound_by_its_sequence_seats_settles_instead_of_flapping():
    """300 concurrent requests on workers of --max-num-seqs 256, KV nearly empty: at 2 replicas none waits and
    KV is below kvLow, at 1 the queue builds. Without the seat signal it went 2 -> 1 -> 2 every five minutes
    for ever (429s at each dip); the workers' seat usage (150/256 each) says one fewer would be full."""
    max_num_seqs, demand, kv_per_seq = 256, 300, 0.0005
    for with_seats in (False, True):
        stab, n, moves = Stabilizer(), 2, 0
        for t in range(0, 3600, 30):
            running = min(demand / n, max_num_seqs)
            waiting, seats = max(0.0, demand / n - max_num_seqs), running / max_num_seqs
            wanted, why = recommend(spec(), None, running * kv_per_seq, n, waiting, seats=seats if with_seats else None)
            new = stab.stabilize(wanted, n, now=float(t), up_seconds=0, down_seconds=300)
            moves, n = moves + (new != n), new
        assert (moves, n) == ((0, 2) if with_seats else (moves, n)) and (with_seats or moves >= 8)
    assert "would run 1.17 of its sequence seats" in recommend(spec(), None, 0.075, 2, 0.0, seats=150 / 256)[1]
    assert recommend(spec(), None, 0.075, 4, 0.0, seats=0.3)[0] == 3  # 0.4 of the seats on three: down


@pytest.mark.parametrize(("hit_rate", "kv_usage", "waiting", "current", "expected", "why"), [
    # Sparse long-tail traffic on an idle pool: more replicas would miss as often; kvLow scales down.
    (0.5, 0.05, 0.0, 2, 1, "but no load pressure"),
    (0.5, 0.05, 0.0, 4, 3, "but no load pressure"),
    (0.5, 0.05, None, 4, 4, "the requests waiting are not known"),  # the queue unknown: no scale-down
    (0.5, 0.1, 0.0, 3, 2, "KV usage 0.1 < kvLow 0.3"),
    (0.5, 0.2, 0.0, 3, 3, "one fewer replica would be under load pressure"),  # 2 would carry 0.3: up again
    # Load pressure makes evictions plausible: one more.
    (0.5, 0.05, 1.0, 2, 3, "GPU hit rate 0.5 < targetHitRate 0.9"),  # requests wait
    (0.5, 0.6, 0.0, 2, 3, "GPU hit rate"),  # KV in use
    (0.5, None, 1.0, 2, 3, "GPU hit rate"),
    (0.5, None, 0.2, 2, 2, "but no load pressure"),  # hold: no KV signal, no queue
])
def test_a_low_hit_rate_scales_up_only_under_load(hit_rate, kv_usage, waiting, current, expected, why):
    replicas, reason = recommend(spec(), hit_rate, kv_usage, current, waiting)
    assert replicas == expected and why in reason, reason


def test_an_idle_pool_with_a_low_hit_rate_settles_at_min_replicas():
    s, current = spec(minReplicas=1, maxReplicas=6), 2
    for _ in range(10):
        current = recommend(s, 0.5, 0.05, current, 0.0)[0]
    assert current == 1


def test_min_zero_wakes_on_waiting_requests():
    assert recommend(spec(minReplicas=0), None, None, 0, 3.0)[0] == 1
    assert recommend(spec(minReplicas=0), None, None, 0, 0.0)[0] == 0


def test_a_constant_load_below_the_hit_rate_target_settles_through_the_windows():
    """The loop as the operator runs it (a 30 s timer, the default windows) over 40 minutes of one load:
    0.28 of a worker's KV each at 2 replicas, 0.56 at 1, hit rate 0.8: one change at most, not a cycle."""
    s, stabilizer, current, seen = spec(), Stabilizer(), 2, []
    for i in range(80):
        recommended = recommend(s, 0.8, min(1.0, 0.56 / current), current, 0.0)[0]
        current = stabilizer.stabilize(recommended, current, now=30.0 * i, up_seconds=s.scale_up_seconds,
                                       down_seconds=s.scale_down_seconds)
        seen.append(current)
    assert sum(a != b for a, b in zip(seen, seen[1:], strict=False)) <= 1, seen


# --- the pinned adapters' floor ----------------------------------------------------------------------

@pytest.mark.parametrize(("wanted", "current", "pinned", "beside", "expected", "why"), [
    (1, 3, PinnedNeed(4, 2), 0, 2, "; held at 2: 4 pinned adapters need 2 workers"),
    (1, 3, PinnedNeed(1, 3), 1, 2, "; held at 2: 1 pinned adapter needs 3 workers (1 of them in other Deployments)"),
    (1, 1, PinnedNeed(3, 3), 0, 3, "; raised to 3: 3 pinned adapters need 3 workers"),
    (2, 3, PinnedNeed(4, 2), 0, 2, ""),  # down to the floor, not below
    (4, 3, PinnedNeed(4, 2), 0, 4, ""),  # a scale-up is not the floor's
    (1, 3, PinnedNeed(4, 3), 3, 1, ""),  # the other Deployments' workers hold them
    (1, 3, NO_PINNED, 0, 1, ""),
    (0, 0, PinnedNeed(4, 2), 0, 0, ""),  # a target at 0 (by hand, or minReplicas 0) is left to the policy
    (1, 3, None, 0, 3, "; held at 3: the workers the pool's pinned adapters need are not counted yet"),
    (8, 10, None, 0, 8, ""),  # above maxReplicas: brought down to it all the same
])
def test_a_scale_down_never_leaves_fewer_workers_than_the_pinned_adapters_need(wanted, current, pinned, beside,
                                                                              expected, why):
    replicas, held = pinned_floor(spec(), wanted, current, pinned, beside)
    assert replicas == expected and held.startswith(why) and bool(held) == bool(why), held


@pytest.mark.parametrize("pinned", [PinnedNeed(9, 12), PinnedNeed(9, None)])
def test_pins_needing_more_than_max_replicas_hold_at_max_replicas_and_say_so(pinned):
    replicas, held = pinned_floor(spec(maxReplicas=8), 3, 5, pinned)
    workers = "12" if pinned.num_workers else "more than 8"
    assert replicas == 8 and held.startswith(f"; raised to maxReplicas 8: 9 pinned adapters need {workers} workers, "
                                             f"more than maxReplicas allows"), held
    assert "raise spec.scaling.maxReplicas" in held
    assert pinned_floor(spec(maxReplicas=8), 8, 8, pinned) == (8, "")  # at maxReplicas: nothing to hold

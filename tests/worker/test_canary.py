"""worker/canary.py: stable/canary version resolution, sticky per user."""

from __future__ import annotations

import random

import pytest

from lorafleet.worker.canary import CanaryResolver, VersionSplit, user_bucket

USERS = [f"user-{i}" for i in range(2000)]


def test_no_canary_means_stable():
    r = CanaryResolver()
    assert {r.pick("sql", VersionSplit("v1"), u) for u in USERS[:50]} == {"v1"}
    assert r.pick("sql", VersionSplit("v1")) == "v1"


@pytest.mark.parametrize("weight", [0, 10, 50, 90, 100])
def test_split_follows_weight_and_is_sticky_per_user(weight):
    r, split = CanaryResolver(), VersionSplit("v1", "v2", weight)
    picks = {u: r.pick("sql", split, u) for u in USERS}
    assert all(r.pick("sql", split, u) == picks[u] for u in USERS[:200])  # sticky
    share = sum(v == "v2" for v in picks.values()) / len(USERS)
    assert abs(share - weight / 100) < 0.05


def test_raising_the_weight_only_moves_users_to_the_canary():
    r = CanaryResolver()
    before = {u for u in USERS if r.pick("sql", VersionSplit("v1", "v2", 20), u) == "v2"}
    after = {u for u in USERS if r.pick("sql", VersionSplit("v1", "v2", 40), u) == "v2"}
    assert before < after


def test_buckets_are_independent_across_adapters():
    same = sum(user_bucket("a", u) < 5000 and user_bucket("b", u) < 5000 for u in USERS) / len(USERS)
    assert 0.15 < same < 0.35  # ~0.25 when independent; 0.5 if both used the same hash


def test_requests_without_user_are_split_per_request():
    r = CanaryResolver(rng=random.Random(0))
    picks = [r.pick("sql", VersionSplit("v1", "v2", 30)) for _ in range(2000)]
    assert abs(picks.count("v2") / 2000 - 0.3) < 0.05


def test_an_empty_user_is_no_user():
    """An empty `user` names nobody: it must not put every such request in one bucket (all of them on the
    canary, or none), whatever the weight says."""
    r = CanaryResolver(rng=random.Random(0))
    picks = [r.pick("sql", VersionSplit("v1", "v2", 30), "") for _ in range(2000)]
    assert abs(picks.count("v2") / 2000 - 0.3) < 0.05


@pytest.mark.parametrize("bad", [dict(stable="v1", canary=None, canary_weight=5),
                                 dict(stable="v1", canary="v2", canary_weight=101)])
def test_bad_splits_are_refused(bad):
    with pytest.raises(ValueError):
        VersionSplit(**bad)

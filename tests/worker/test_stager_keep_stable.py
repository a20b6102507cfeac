"""A push whose new stable version cannot be staged keeps the stable version forwarded until now, but with the
rest of the push: the canary it removes or turns to 0 % stays off (the kill switch), its flags apply."""

from __future__ import annotations

from lorafleet.worker.directives import DesiredState
from lorafleet.worker.stager import Stager
from tests.worker.test_stager_bounds import FakeStore, config

GOOD, BAD = "s3://adapters/team/", "s3://elsewhere/team/"  # BAD: outside the allowed locations (a typo)


def push(generation: int, stable: tuple[str, str], canary: tuple[str, str] | None = None, weight: int = 0,
         tenant: str = "acme", **flags) -> DesiredState:
    a = {"name": "sql", "tenant": tenant, "stable": {"version": stable[0], "uri": f"{stable[1]}sql-{stable[0]}/"},
         **flags}
    if canary is not None:
        a |= {"canary": {"version": canary[0], "uri": f"{canary[1]}sql-{canary[0]}/"}, "canary_weight": weight}
    return DesiredState.from_dict({"generation": generation, "adapters": [a]})


def forwarded(stager: Stager) -> tuple:
    d = stager.forwarded["sql"]
    return d.stable.version, d.canary.version if d.canary else None, d.canary_weight, d.warm, d.pinned


async def test_a_push_that_drops_the_canary_and_names_a_stable_version_it_cannot_stage(tmp_path, monkeypatch):
    stager = Stager(config(tmp_path))
    FakeStore(stager, monkeypatch)
    await stager.apply(push(1, ("v1", GOOD), ("v2", GOOD), 20))
    assert forwarded(stager) == ("v1", "v2", 20, False, False)

    report = await stager.apply(push(2, ("v3", BAD)))  # canary removed; v3's URI has a typo
    assert forwarded(stager) == ("v1", None, 0, False, False)
    assert report.find("sql", "v3").error and set(stager.staged) == {("sql", "v1")}

    await stager.apply(push(3, ("v1", GOOD), ("v2", GOOD), 20))
    await stager.apply(push(4, ("v3", BAD), ("v2", GOOD), 0, warm=True, pinned=True))  # weight 0, warm and pinned
    assert forwarded(stager) == ("v1", "v2", 0, True, True)  # registered, no user sent to it

    await stager.apply(push(5, ("v3", BAD), ("v2", GOOD), 5))  # a lower weight applies at once
    assert forwarded(stager) == ("v1", "v2", 5, False, False)
    assert set(stager.staged) == {("sql", "v1"), ("sql", "v2")}

    await stager.apply(push(6, ("v3", BAD), ("v1", GOOD), 50))  # the canary is the stable version kept
    assert forwarded(stager) == ("v1", None, 0, False, False)


async def test_a_name_that_changed_owner_does_not_give_the_new_owner_the_old_weights(tmp_path, monkeypatch):
    stager = Stager(config(tmp_path))
    FakeStore(stager, monkeypatch)
    await stager.apply(push(1, ("v1", GOOD)))
    await stager.apply(push(2, ("v9", BAD), tenant="globex"))  # now globex's, its version cannot be staged
    assert stager.forwarded["sql"].tenant == "acme" and stager.forwarded["sql"].stable.version == "v1"

"""A pool's spec.tenantSources: an adapter's files come only from its own tenant's folders, so the author
of a LoRAAdapter cannot serve another tenant's adapter files under their own tenant."""

from __future__ import annotations

import re

import pytest

from lorafleet.operator.crd_models import PoolSpec, parse_adapter
from lorafleet.operator.reconcile import reconcile_pool

from .crd_validation import validate
from .test_crd_schema import accepts, example_docs
from .test_reconcile import NOW, converge, pool, workers
from .test_reconcile_failures import body, served

TENANTS = ["s3://adapters/tenants/{tenant}/", "/data/{namespace}/{tenant}/"]


@pytest.mark.parametrize(("uri", "ok"), [
    ("s3://adapters/tenants/acme/a/v1/", True),
    ("s3://adapters/tenants/acme/", True),
    ("s3://adapters/tenants//acme/a/", False),  # an empty segment: the stager refuses it too
    ("/data/ns/acme/a/", True),
    ("file:///data/ns/acme/a/", True),
    ("/data/ns/./acme/a/", True),
    ("s3://adapters/tenants/globex/a/v1/", False),  # another tenant's folder
    ("s3://adapters/tenants/acmex/a/", False),  # a longer name is not under the prefix
    ("s3://adapters/tenants/acme", True),  # taken as the folder, as the stager takes it (not acme2's files)
    ("s3://other/tenants/acme/a/", False),
    ("s3://adapters/tenants/acme/../globex/a/", False),
    ("/data/ns/acme/../../other/acme/a/", False),
    ("/data/other/acme/a/", False),  # the same tenant in another namespace's folder
    ("/data/ns/globex/a/", False),
])
def test_an_adapter_is_served_only_from_its_tenants_folders(uri, ok):
    ws = workers(2)
    plan = converge(pool(tenantSources=TENANTS), [parse_adapter(body(source={"uri": uri}))], ws)
    st = plan.adapter_statuses["a"]
    if ok:
        assert st["phase"] == "Ready" and set(served(plan, "a")) == {"w0", "w1"}, st["message"]
    else:
        assert served(plan, "a") == {} and st["phase"] == "Failed"
        assert st["message"].startswith("spec.source.uri:") and "acme" in st["message"], st["message"]


def test_a_canary_from_another_tenants_folder_is_refused_and_the_stable_version_keeps_serving():
    ws, p = workers(2), pool(tenantSources=TENANTS)
    plan = converge(p, [parse_adapter(body(source={"uri": "s3://adapters/tenants/acme/a/v1/"}))], ws)
    st = plan.adapter_statuses["a"]
    assert st["phase"] == "Ready"
    canary = {"version": "v2", "source": {"uri": "s3://adapters/tenants/globex/secret/"}, "weight": 50}
    edited = body(source={"uri": "s3://adapters/tenants/acme/a/v1/"}, canary=canary, status=st)
    plan = reconcile_pool(p, [parse_adapter(edited)], ws, now=NOW)
    st = plan.adapter_statuses["a"]
    assert served(plan, "a") == {"w0": ("v1", None, True), "w1": ("v1", None, True)}
    assert st["phase"] == "Failed" and st["message"].startswith("spec.canary.source.uri:"), st["message"]
    assert "for tenant 'globex', not tenant 'acme'" in st["message"], st["message"]


FOREIGN_CANARY = {"version": "v2", "source": {"uri": "s3://adapters/tenants/globex/secret/"}, "weight": 10}


def test_a_new_adapter_with_a_canary_from_another_tenants_folder_serves_its_stable_version():
    """Not only after an edit: a new adapter whose canary alone is refused is served without it (it was refused
    whole, its own files unserved)."""
    own = {"uri": "s3://adapters/tenants/acme/a/v1/"}
    plan = converge(pool(tenantSources=TENANTS), [parse_adapter(body(source=own, canary=FOREIGN_CANARY))], workers(2))
    st = plan.adapter_statuses["a"]
    assert served(plan, "a") == {"w0": ("v1", None, True), "w1": ("v1", None, True)}
    assert st["phase"] == "Failed" and st["message"].startswith("spec.canary.source.uri:"), st["message"]


def test_setting_tenant_sources_drops_a_served_canary_from_another_tenants_folder_not_its_stable_version():
    """A pool's tenantSources set under an adapter rolling out a canary from another tenant's folder: the canary
    goes, the stable version (its own folder) keeps serving on every worker (it had been unloaded everywhere)."""
    ws, own = workers(2), {"uri": "s3://adapters/tenants/acme/a/v1/"}
    plan = converge(pool(), [parse_adapter(body(source=own, canary=FOREIGN_CANARY))], ws)
    st = plan.adapter_statuses["a"]
    assert st["phase"] == "Ready" and {v[1] for v in served(plan, "a").values()} == {"v2"}, served(plan, "a")
    plan = reconcile_pool(pool(tenantSources=TENANTS), [parse_adapter(body(source=own, canary=FOREIGN_CANARY, status=st))],
                          ws, now=NOW)
    st = plan.adapter_statuses["a"]
    assert served(plan, "a") == {"w0": ("v1", None, True), "w1": ("v1", None, True)}
    assert st["phase"] == "Failed" and "for tenant 'globex', not tenant 'acme'" in st["message"], st["message"]


def test_setting_tenant_sources_unloads_an_adapter_already_served_from_elsewhere():
    ws = workers(2)
    theirs = body(tenant="mallory", source={"uri": "s3://adapters/tenants/acme/a/v1/"})
    plan = converge(pool(), [parse_adapter(theirs)], ws)  # no tenantSources: any allowed location
    st = plan.adapter_statuses["a"]
    assert st["phase"] == "Ready"
    plan = reconcile_pool(pool(tenantSources=TENANTS), [parse_adapter(body(**theirs["spec"], status=st))], ws, now=NOW)
    st = plan.adapter_statuses["a"]
    assert served(plan, "a") == {} and set(plan.pushes) == {"w0", "w1"}  # told to drop it, not kept as last valid
    assert st["phase"] == "Failed" and "tenant 'mallory'" in st["message"]


@pytest.mark.parametrize(("uri", "tenant", "ok"), [
    ("s3://adapters/b/x/", "b", True),
    ("s3://adapters/legacy/", "legacy", True),  # the folder itself: above every tenant's of the second entry
    ("s3://adapters/legacy/x/", "legacy", False),  # tenant x's under the second entry
    ("s3://adapters/legacy/b/secret/", "legacy", False),  # b's folder under the second entry
    ("s3://adapters/legacy/b/x/", "b", False),  # also tenant legacy's under the first: overlapping entries
    ("s3://shared/common/x/", "b", True),  # a folder of no tenant in particular
    ("s3://shared/common/", "legacy", True),
])
def test_a_folder_under_two_entries_is_nobody_elses(uri, tenant, ok):
    """Entries may overlap: a URI that one binds to the adapter's tenant and another to someone else's is refused,
    never handed to the first."""
    p = pool(tenantSources=["s3://adapters/{tenant}/", "s3://adapters/legacy/{tenant}/", "s3://shared/common/"])
    plan = converge(p, [parse_adapter(body(tenant=tenant, source={"uri": uri}))], workers(1))
    st = plan.adapter_statuses["a"]
    assert (st["phase"] == "Ready") == ok, st["message"]
    if not ok:
        assert re.search(r"for tenant '(b|x|legacy)', not tenant", st["message"]), st["message"]


@pytest.mark.parametrize(("prefixes", "ok"), [
    (["s3://adapters/tenants/{tenant}/"], True),
    (["s3://{namespace}/{tenant}/", "file:///srv/{tenant}/", "/", "/data/./{tenant}/"], True),
    ([], True),
    (["s3://adapters/tenants/{tenant}"], False),  # not a folder
    (["s3://adapters/{user}/"], False),
    (["s3://adapters/{tenant/"], False),
    (["s3://adapters/{namespace}-{tenant}/"], False),  # not a whole segment: team-a/b and team/a-b would meet
    (["s3://{namespace}-adapters/{tenant}/"], False),
    (["s3://adapters//{tenant}/"], False),
    (["s3://adapters/../{tenant}/"], False),
    (["/data/{tenant}/../"], False),
    (["file:///srv/../{tenant}/"], False),
    (["http://adapters/{tenant}/"], False),
    (["data/{tenant}/"], False),  # relative
    (["s3://adapters/a\tb/"], False),
    ("s3://adapters/{tenant}/", False),  # one string, not a list
])
def test_crd_and_parser_agree_on_tenant_sources(prefixes, ok):
    doc = next(d for d in example_docs() if d["kind"] == "LoRAPool")
    doc["spec"]["tenantSources"] = prefixes
    assert accepts(lambda: validate(doc, "lorapools")) == ok == accepts(lambda: PoolSpec.parse(doc))



@pytest.mark.parametrize(("uri", "within"), [
    ("/data/ns/acme/a/v1/", ("/data/ns/acme/",)),
    ("file:///data/ns/acme/a/", ("/data/ns/acme/",)),
    ("s3://adapters/tenants/acme/a/", ()),  # an object store has no symlinks: nothing more to check
])
def test_a_local_versions_directive_names_its_tenants_folders(uri, within):
    """The stager follows symlinks, the operator cannot: a local version's directive lists the tenant's own
    folders (placeholders filled), inside which the stager requires the folder and its files to resolve."""
    canary = {"version": "v2", "source": {"uri": "/data/ns/acme/a/v2/"}, "weight": 10}
    plan = converge(pool(tenantSources=[*TENANTS, "file:///data/{namespace}/{tenant}/"]),
                    [parse_adapter(body(source={"uri": uri}, canary=canary))], workers(1))
    (directive,) = plan.desired["w0"].adapters
    doubled = within + ("file:///data/ns/acme/",) if within else ()
    assert directive.stable.within == doubled and directive.canary.within == ("/data/ns/acme/", "file:///data/ns/acme/")
    plan = converge(pool(), [parse_adapter(body(source={"uri": uri}))], workers(1))  # no tenantSources: no rule
    assert plan.desired["w0"].adapters[0].stable.within == ()


@pytest.mark.parametrize(("sources", "tenant", "uri", "within", "without"), [
    (["/a/{tenant}/", "/a/legacy/{tenant}/"], "legacy", "/a/legacy/legacy/m/",
     ("/a/legacy/", "/a/legacy/legacy/"), ("/a/legacy/",)),  # /a/legacy/ holds tenant b's /a/legacy/b/
    (["/a/{tenant}/", "/a/legacy/{tenant}/"], "acme", "/a/acme/m/", ("/a/acme/",), ()),
    (["/a/{tenant}/", "file:///a/legacy/special/{tenant}/"], "legacy", "/a/legacy/other/m/",
     ("/a/legacy/",), ("file:///a/legacy/special/",)),
    (["/d/{namespace}/", "/d/ns/{tenant}/"], "legacy", "/d/ns/legacy/m/", ("/d/ns/", "/d/ns/legacy/"), ("/d/ns/",)),
    (["/data/{tenant}/adapters/"], "acme", "/data/acme/adapters/m/", ("/data/acme/adapters/",), ()),
    (["/a/{tenant}/", "/a/legacy/shared/"], "legacy", "/a/legacy/m/", ("/a/legacy/",), ()),  # everyone's folder
])
def test_a_local_versions_directive_names_where_other_tenants_folders_lie_inside_its_own(
        sources, tenant, uri, within, without):
    """Entries may overlap: a tenant's own folder may hold other tenants' folders (of another entry). The
    directive names the fixed part of such an entry (`without`): the stager requires what resolves inside it to
    lie in one of the tenant's folders below it."""
    plan = converge(pool(tenantSources=sources), [parse_adapter(body(source={"uri": uri}, tenant=tenant))], workers(1))
    assert plan.adapter_statuses["a"]["phase"] != "Failed", plan.adapter_statuses["a"]
    (directive,) = plan.desired["w0"].adapters
    assert (directive.stable.within, directive.stable.without) == (within, without)
    assert directive.stable.to_dict().get("without", []) == list(without)  # left out when empty


def test_a_pod_not_ready_is_told_to_drop_an_adapter_the_pool_now_refuses():
    """A running pod that is not ready (a failing probe) is pushed only what it last accepted less what must go:
    an adapter refused by a new tenantSources (and no earlier spec to keep) goes from it too, not only from
    the ready pods; another adapter it holds stays, and an invalid pool refuses nothing of what it holds."""
    ready, not_ready = workers(1), workers(1)
    not_ready[0].pod = "w1"
    theirs = parse_adapter(body(name="a", tenant="mallory", source={"uri": "s3://adapters/tenants/acme/a/v1/"}))
    mine = parse_adapter(body(name="b", tenant="acme", source={"uri": "s3://adapters/tenants/acme/b/v1/"}))
    converge(pool(), [theirs, mine], ready + not_ready)  # served everywhere, then w1's probe fails
    plan = reconcile_pool(pool(tenantSources=TENANTS), [theirs, mine], ready, now=NOW, held=not_ready)
    assert [d.name for d in plan.desired["w1"].adapters] == ["b"] and "w1" in plan.pushes
    assert [d.name for d in plan.desired["w0"].adapters] == ["b"]
    plan = reconcile_pool(None, [theirs, mine], [], now=NOW, pool_error="spec.workerSelector: required", held=not_ready)
    assert "w1" not in plan.pushes  # an invalid pool: its pods keep what they were last told

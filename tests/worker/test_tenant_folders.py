"""A local version's tenant folders (VersionRef.within, from its pool's spec.tenantSources): the operator
compares the path as written; the stager follows symlinks, so it requires the folder and the files in it
to resolve inside the tenant's own folders. Otherwise a tenant who can write into its own folder links to
another tenant's, which lies inside the same allowed roots."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from lorafleet.worker.directives import AdapterDirective, DesiredState, VersionRef
from lorafleet.worker.file_limits import CONFIG_FILE, WEIGHTS_FILE
from lorafleet.worker.sources import SourceError, Sources, SourcesConfig, adapter_digest
from lorafleet.worker.stager import Stager
from lorafleet.worker.stager_digests import LocalDigests, file_identity
from lorafleet.worker.tenant_folders import TenantFolders
from tests.worker.test_stager_bounds import config, fake_adapter, settled


@pytest.fixture
def tenants(tmp_path):
    """Roots `local/` with tenant folders `acme/` and `globex/`, each holding one adapter, and a second
    folder of acme's elsewhere in the roots."""
    local = tmp_path / "local"
    fake_adapter(local / "acme" / "mine", b"acme weights")
    fake_adapter(local / "globex" / "secret", b"globex weights")
    fake_adapter(local / "shared-acme" / "other", b"acme elsewhere")
    return local


def _refusal(local, uri: str, within: tuple[str, ...], without: tuple[str, ...] = ()) -> SourceError:
    with pytest.raises(SourceError) as err:
        Sources(SourcesConfig(local_roots=[str(local)])).local_path(uri, TenantFolders(within, without))
    assert err.value.kind == "not_allowed", err.value
    return err.value


def test_a_folder_linked_to_another_tenants_is_refused(tenants):
    os.symlink(tenants / "globex" / "secret", tenants / "acme" / "stolen")
    uri, within = str(tenants / "acme" / "stolen"), (f"{tenants}/acme/",)
    assert Sources(SourcesConfig(local_roots=[str(tenants)])).local_path(uri)  # inside the roots: roots alone let it by
    err = _refusal(tenants, uri, within)
    assert "outside its tenant's folders" in str(err) and f"{tenants}/acme/" in str(err)


def test_a_file_linked_to_another_tenants_is_refused(tenants):
    own = tenants / "acme" / "mine"
    (own / "adapter_model.safetensors").unlink()
    os.symlink(tenants / "globex" / "secret" / "adapter_model.safetensors", own / "adapter_model.safetensors")
    err = _refusal(tenants, str(own), (f"file://{tenants}/acme/",))
    assert "symlink points outside its tenant's folders" in str(err)


def test_links_that_stay_in_the_tenants_folders_are_served(tenants):
    os.symlink(tenants / "shared-acme" / "other", tenants / "acme" / "linked")
    own = tenants / "acme" / "mine"
    os.symlink(own / "adapter_config.json", tenants / "acme" / "config-link")
    within = (f"{tenants}/acme/", f"file://{tenants}/shared-acme/")
    src = Sources(SourcesConfig(local_roots=[str(tenants)]))
    linked = src.local_path(str(tenants / "acme" / "linked"), TenantFolders(within))
    assert linked == (tenants / "shared-acme" / "other").resolve()
    assert src.local_path(str(own), TenantFolders(within)) == own.resolve()
    _refusal(tenants, str(tenants / "acme" / "linked"), within[:1])  # the second folder is not acme's here


def test_the_roots_still_bound_a_tenants_folder(tenants, tmp_path):
    """`within` narrows the roots, never widens them: a tenant folder outside the roots allows nothing."""
    fake_adapter(tmp_path / "elsewhere" / "a")
    err = _refusal(tenants, str(tmp_path / "elsewhere" / "a"), (f"{tmp_path}/elsewhere/",))
    assert "outside the allowed local roots" in str(err)


async def test_a_push_stages_the_honest_version_and_reports_the_linked_one(tenants, tmp_path):
    """Through the stager's push: the version whose folder links into another tenant's fails, naming the
    folders, and the other adapter of the same push is staged from its own folder."""
    os.symlink(tenants / "globex" / "secret", tenants / "acme" / "stolen")
    within = (f"{tenants}/acme/",)
    desired = DesiredState(1, [
        AdapterDirective("honest", "acme", VersionRef("v1", str(tenants / "acme" / "mine"), None, within)),
        AdapterDirective("thief", "acme", VersionRef("v1", str(tenants / "acme" / "stolen"), None, within)),
    ])
    stager = Stager(config(tmp_path))
    report = {a.name: a for a in (await stager.apply(desired)).adapters}
    assert report["honest"].error is None, report["honest"]
    assert "outside its tenant's folders" in (report["thief"].error or ""), report["thief"]
    assert stager.staged[("honest", "v1")].sha256 == adapter_digest(tenants / "acme" / "mine")
    assert ("thief", "v1") not in stager.staged
    # The same folder without the rule (an older operator, or a pool without tenantSources) is inside the roots.
    plain = DesiredState(2, [AdapterDirective("thief", "acme", VersionRef("v1", str(tenants / "acme" / "stolen")))])
    report = {a.name: a for a in (await stager.apply(plain)).adapters}
    assert report["thief"].error is None and ("thief", "v1") in stager.staged


def _folders(local, entries: list[str], tenant: str, uri: str, namespace: str = "ns") -> TenantFolders:
    """What the operator puts in a local version's directive for `tenant`, the pool's tenantSources being
    `entries` with `{root}` for the roots; the operator itself accepts the source as written."""
    from lorafleet.operator.tenant_sources import foreign_regions, own_folders, source_problem

    pool = SimpleNamespace(name="p", tenant_sources=tuple(e.replace("{root}", str(local)) for e in entries))
    adapter = SimpleNamespace(name="a", tenant=tenant, namespace=namespace, source=SimpleNamespace(uri=uri),
                              canary=None)
    assert source_problem(pool, adapter) is None
    within = own_folders(pool, adapter, uri)
    return TenantFolders(within, foreign_regions(pool, within))


OVERLAP = ["{root}/a/{tenant}/", "{root}/a/legacy/{tenant}/"]  # tenant legacy's /a/legacy/ holds b's /a/legacy/b/
SPECIAL = ["{root}/a/{tenant}/", "file://{root}/a/legacy/special/{tenant}/"]
BY_NAMESPACE = ["{root}/d/{namespace}/", "{root}/d/team/{tenant}/"]  # namespace team's /d/team/ holds x's /d/team/x/


@pytest.mark.parametrize(("entries", "namespace", "source", "target", "ok"), [
    (OVERLAP, "ns", "a/legacy/legacy/m", None, True),  # a real folder of its own
    (OVERLAP, "ns", "a/legacy/legacy/m", "a/legacy/legacy/real", True),
    (OVERLAP, "ns", "a/legacy/legacy/m", "a/legacy/b/secret", False),  # into tenant b's
    (OVERLAP, "ns", "file://{root}/a/legacy/legacy/m", "a/legacy/b/secret", False),
    ([f"file://{e}" for e in OVERLAP], "ns", "a/legacy/legacy/m", "a/legacy/b/secret", False),
    (SPECIAL, "ns", "a/legacy/other/m", None, True),
    (SPECIAL, "ns", "a/legacy/other/m", "a/legacy/mine", True),  # elsewhere in its own folder
    (SPECIAL, "ns", "a/legacy/other/m", "a/legacy/special/b/secret", False),
    (BY_NAMESPACE, "team", "d/team/legacy/m", "d/team/legacy/real", True),
    (BY_NAMESPACE, "team", "d/team/legacy/m", "d/team/b/secret", False),
])
def test_a_link_into_another_tenants_folder_inside_its_own_is_refused(tmp_path, entries, namespace, source, target,
                                                                       ok):
    """Entries may overlap: tenant legacy's folder /a/legacy/ (from /a/{tenant}/) holds tenant b's /a/legacy/b/
    (from /a/legacy/{tenant}/). A link lands in legacy's folder either way; the directive names /a/legacy/ as
    a region where other tenants' folders lie (`without`), and there only legacy's own folders below it count."""
    local = tmp_path / "local"
    fake_adapter(local / "a" / "legacy" / "b" / "secret", b"b's weights")
    fake_adapter(local / "a" / "legacy" / "special" / "b" / "secret", b"b's weights")
    fake_adapter(local / "d" / "team" / "b" / "secret", b"b's weights")
    for mine in ("a/legacy/legacy/real", "a/legacy/mine", "d/team/legacy/real"):
        fake_adapter(local / mine, b"legacy's weights")
    uri = source.replace("{root}", str(local)) if "{root}" in source else str(local / source)
    path = local / source.replace("file://{root}/", "")
    if target is None:
        fake_adapter(path)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(local / target, path)
    folders = _folders(local, entries, "legacy", uri, namespace)
    src = Sources(SourcesConfig(local_roots=[str(local)]))
    if ok:
        assert src.local_path(uri, folders) == (local / (target or path)).resolve()
        return
    with pytest.raises(SourceError) as err:
        src.local_path(uri, folders)
    assert err.value.kind == "not_allowed" and "where other tenants' folders lie" in str(err.value), err.value
    listed = str(err.value).rsplit("in none of its tenant's folders below it (", 1)[1].rstrip(")").split(", ")
    assert folders.without[0] not in listed and set(listed) <= {*folders.within, "none"}, err.value  # not itself
    # The same link from a file of a real folder: refused too.
    path.unlink()
    fake_adapter(path)
    (path / "adapter_model.safetensors").unlink()
    os.symlink(local / target / "adapter_model.safetensors", path / "adapter_model.safetensors")
    with pytest.raises(SourceError, match="symlink points inside .* where other tenants' folders lie"):
        src.local_path(uri, folders)


async def test_a_push_holds_a_local_version_to_its_without_folders(tmp_path):
    """The directive's `without` reaches the stager's check: tenant legacy's link into b's folder inside its own
    is reported, its real folder staged."""
    local = tmp_path / "local"
    fake_adapter(local / "a" / "legacy" / "b" / "secret", b"b's weights")
    fake_adapter(local / "a" / "legacy" / "legacy" / "mine", b"legacy's weights")
    os.symlink(local / "a" / "legacy" / "b" / "secret", local / "a" / "legacy" / "legacy" / "stolen")
    within, without = (f"{local}/a/legacy/", f"{local}/a/legacy/legacy/"), (f"{local}/a/legacy/",)
    desired = DesiredState(1, [AdapterDirective(name, "legacy", VersionRef(
        "v1", str(local / "a" / "legacy" / "legacy" / name), None, within, without)) for name in ("mine", "stolen")])
    stager = Stager(config(tmp_path))
    report = {a.name: a for a in (await stager.apply(desired)).adapters}
    assert report["mine"].error is None and ("mine", "v1") in stager.staged, report["mine"]
    assert "where other tenants' folders lie" in (report["stolen"].error or ""), report["stolen"]


def test_a_tenant_folder_that_is_a_symlink_inside_the_roots_is_refused(tmp_path):
    """Entry /data/{tenant}/adapters/: a tenant who may write /data/acme/ links /data/acme/adapters to globex's
    folder; following it, the tenant folder itself would lie in globex's. Refused, naming the link."""
    local = tmp_path / "local"
    fake_adapter(local / "globex" / "adapters" / "secret", b"globex weights")
    (local / "acme").mkdir()
    os.symlink(local / "globex" / "adapters", local / "acme" / "adapters")
    uri = str(local / "acme" / "adapters" / "secret")
    folders = _folders(local, ["{root}/{tenant}/adapters/"], "acme", uri)
    assert folders.within == (f"{local}/acme/adapters/",)
    with pytest.raises(SourceError) as err:
        Sources(SourcesConfig(local_roots=[str(local)])).local_path(uri, folders)
    assert err.value.kind == "not_allowed" and f"{local / 'acme' / 'adapters'} is a symlink" in str(err.value)
    # So is a region where other tenants' folders lie (`without`) whose path holds a link.
    fake_adapter(local / "a" / "legacy" / "mine")
    os.symlink(local / "a" / "legacy", local / "a" / "decoy")
    err = _refusal(local, str(local / "a" / "legacy" / "mine"), (f"{local}/a/legacy/",), (f"{local}/a/decoy/",))
    assert f"{local / 'a' / 'decoy'} is a symlink" in str(err)


def test_the_administrators_links_at_and_above_the_roots_are_followed(tmp_path):
    """A root named through a link, and a root inside another that is a link (a faster disk): the tenant folders
    under them are served."""
    fake_adapter(tmp_path / "disk" / "acme" / "mine")
    fake_adapter(tmp_path / "nvme" / "acme" / "fast")
    os.symlink(tmp_path / "disk", tmp_path / "mnt")
    os.symlink(tmp_path / "nvme", tmp_path / "disk" / "fast")
    src = Sources(SourcesConfig(local_roots=[str(tmp_path / "mnt"), str(tmp_path / "mnt" / "fast")]))
    mine, fast = tmp_path / "mnt" / "acme" / "mine", tmp_path / "mnt" / "fast" / "acme" / "fast"
    assert src.local_path(str(mine), TenantFolders((f"{tmp_path}/mnt/acme/",))) == mine.resolve()
    assert src.local_path(str(fast), TenantFolders((f"file://{tmp_path}/mnt/fast/acme/",))) == fast.resolve()
    assert src.local_path(str(mine), TenantFolders((f"{tmp_path}/disk/acme/",))) == mine.resolve()


def test_a_root_replaced_by_a_link_since_start_is_refused(tmp_path):
    """Roots per tenant (/data/acme/adapters, /data/globex/adapters), acme allowed to write /data/acme/: once the
    stager started, acme's root replaced by a link to globex's lands inside a root, but not where it did."""
    local = tmp_path / "local"
    fake_adapter(local / "globex" / "adapters" / "secret", b"globex weights")
    (local / "acme" / "adapters").mkdir(parents=True)
    src = Sources(SourcesConfig(local_roots=[str(local / "acme" / "adapters"), str(local / "globex" / "adapters")]))
    (local / "acme" / "adapters").rmdir()
    os.symlink(local / "globex" / "adapters", local / "acme" / "adapters")
    with pytest.raises(SourceError, match="is a symlink inside the local roots"):
        src.local_path(str(local / "acme" / "adapters" / "secret"), TenantFolders((f"{local}/acme/adapters/",)))


def _swap_for_link(file, target) -> None:
    file.unlink()
    os.symlink(target, file)


@pytest.mark.parametrize("within", [True, False])
def test_a_file_swapped_for_a_link_after_the_check_is_refused_not_hashed(tenants, tmp_path, monkeypatch, within):
    """The folder's files are checked (local_path), then opened and hashed (verify_local): a file swapped for a
    link to another tenant's meanwhile would have had that tenant's bytes hashed, and the engine would then load
    them against that digest. Each file is checked where the descriptor hashed from lies. Without tenant folders,
    the roots bound it the same way."""
    own = tenants / "acme" / "mine"
    fake_adapter(tmp_path / "outside", b"not in the roots")
    theirs = (tenants / "globex" / "secret" if within else tmp_path / "outside") / "adapter_model.safetensors"
    src = Sources(SourcesConfig(local_roots=[str(tenants)]))
    folders = TenantFolders((f"{tenants}/acme/",) if within else ())
    path = src.local_path(str(own), folders)
    _swap_for_link(own / "adapter_model.safetensors", theirs)  # between the check and the hash
    with pytest.raises(SourceError) as err:
        src.verify_local(path, None, str(own), folders)
    assert err.value.kind == "not_allowed" and f"the file opened lies at {theirs}" in str(err.value), err.value


def test_a_file_swapped_between_its_stat_and_its_open_is_refused(tenants, monkeypatch):
    """Closer still: the file is swapped after the size check's stat, before it is opened."""
    from lorafleet.worker import file_limits

    own = tenants / "acme" / "mine"
    real, theirs = file_limits.check_file, tenants / "globex" / "secret" / "adapter_model.safetensors"

    def check_file(file, *args, **kwargs):
        size = real(file, *args, **kwargs)
        if file.name == "adapter_model.safetensors" and not file.is_symlink():
            _swap_for_link(file, theirs)
        return size

    monkeypatch.setattr(file_limits, "check_file", check_file)
    src, folders = Sources(SourcesConfig(local_roots=[str(tenants)])), TenantFolders((f"{tenants}/acme/",))
    with pytest.raises(SourceError, match="the file opened lies at .*outside its tenant's folders"):
        src.verify_local(src.local_path(str(own), folders), None, str(own), folders)


def test_a_digest_kept_in_no_bounds_does_not_answer_in_some(tenants):
    """A folder whose weights link to globex's, hashed without tenant folders (kept: its files settled), then
    checked with acme's folders: read again, and refused, never answered with the digest kept."""
    own, theirs = tenants / "acme" / "mine", tenants / "globex" / "secret"
    settled(theirs)
    _swap_for_link(own / "adapter_model.safetensors", theirs / "adapter_model.safetensors")
    settled(own)
    src = Sources(SourcesConfig(local_roots=[str(tenants)]))
    assert src.verify_local(own, None, str(own)) == adapter_digest(own) and len(src.digests) == 1
    with pytest.raises(SourceError, match="outside its tenant's folders"):
        src.verify_local(own, None, str(own), TenantFolders((f"{tenants}/acme/",)))


def test_a_digest_of_other_files_than_the_ones_stated_is_not_kept(tenants):
    """A file swapped away and back while it was read: the files before and after are the same, the bytes hashed
    another file's. That digest is not kept for them."""
    own = settled(tenants / "acme" / "mine")
    other = settled(tenants / "globex" / "secret")
    digests, computed = LocalDigests(), []

    def compute():
        computed.append(1)
        return "other", tuple(file_identity(os.stat(other / name)) for name in (CONFIG_FILE, WEIGHTS_FILE))

    for _ in range(2):
        assert digests.digest(own, (CONFIG_FILE, WEIGHTS_FILE), compute) == "other"
    assert len(computed) == 2 and len(digests) == 0

"""A local version's tenant folders (VersionRef.within, from its pool's spec.tenantSources): the operator
compares the path as written; the stager follows symlinks, so it requires the folder and the files in it
to resolve inside the tenant's own folders. Otherwise a tenant who can write into its own folder links to
another tenant's, which lies inside the same allowed roots."""

from __future__ import annotations

import os

import pytest

from lorafleet.worker.directives import AdapterDirective, DesiredState, VersionRef
from lorafleet.worker.sources import SourceError, Sources, SourcesConfig, adapter_digest
from lorafleet.worker.stager import Stager
from tests.worker.test_stager_bounds import config, fake_adapter


@pytest.fixture
def tenants(tmp_path):
    """Roots `local/` with tenant folders `acme/` and `globex/`, each holding one adapter, and a second
    folder of acme's elsewhere in the roots."""
    local = tmp_path / "local"
    fake_adapter(local / "acme" / "mine", b"acme weights")
    fake_adapter(local / "globex" / "secret", b"globex weights")
    fake_adapter(local / "shared-acme" / "other", b"acme elsewhere")
    return local


def _refusal(local, uri: str, within: tuple[str, ...]) -> SourceError:
    with pytest.raises(SourceError) as err:
        Sources(SourcesConfig(local_roots=[str(local)])).local_path(uri, within)
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
    assert src.local_path(str(tenants / "acme" / "linked"), within) == (tenants / "shared-acme" / "other").resolve()
    assert src.local_path(str(own), within) == own.resolve()
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

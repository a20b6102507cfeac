"""worker/tenants.py: API keys -> tenant -> allowed adapters; development mode without keys."""

from __future__ import annotations

import json

import pytest

from lorafleet.worker.tenants import AuthenticationError, Tenants, TenantsError

KEYS = {
    "tenants": {
        "acme": {"keys": ["sk-acme"], "adapters": ["sql", "acme-*"]},
        "globex": {"keys": ["sk-globex"], "adapters": [], "base_model": False},
    }
}


@pytest.fixture(params=["json", "yaml"])
def tenants(tmp_path, request) -> Tenants:
    path = tmp_path / f"keys.{request.param}"
    if request.param == "json":
        path.write_text(json.dumps(KEYS))
    else:
        import yaml

        path.write_text(yaml.safe_dump(KEYS))
    return Tenants.from_file(path)


def test_keys_map_to_tenants_and_their_adapters(tenants):
    acme = tenants.authenticate("Bearer sk-acme")
    assert acme.name == "acme" and not tenants.is_open
    assert acme.may_use("sql") and acme.may_use("acme-chat") and acme.may_use(None)
    assert not acme.may_use("globex-sql")
    globex = tenants.authenticate("bearer sk-globex")
    assert not globex.may_use(None)  # base model not allowed
    assert not globex.may_use("sql")
    assert globex.may_use("whatever", owner="globex")  # a directive names globex as owner
    assert not acme.may_use("whatever", owner="globex")


@pytest.mark.parametrize("header", [None, "", "Bearer", "Basic sk-acme", "Bearer sk-wrong", "sk-acme"])
def test_missing_or_wrong_keys_are_refused(tenants, header):
    with pytest.raises(AuthenticationError):
        tenants.authenticate(header)


def test_without_keys_everyone_is_the_dev_tenant():
    t = Tenants.from_file(None)
    assert t.is_open
    dev = t.authenticate(None)
    assert dev.is_dev and dev.may_use("anything") and dev.may_use(None)


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("[1, 2]", "'tenants' mapping"),
        ('{"tenants": {"a": {"keys": "sk"}}}', "tenants.a.keys"),
        ('{"tenants": {"a": {"keys": ["k"], "adapterz": []}}}', "unknown fields"),
        ('{"tenants": {"a": {"keys": ["k"]}, "b": {"keys": ["k"]}}}', "shared with tenant"),
        ('{"tenants": {"a": {"base_model": "yes"}}}', "base_model"),
        ('{"tenants": {"default": {"keys": ["k"], "adapters": []}}}', '"default" is reserved'),  # owns the unowned
        ("{not json", "not valid"),
    ],
)
def test_bad_files_name_the_problem(tmp_path, content, needle):
    path = tmp_path / "keys.json"
    path.write_text(content)
    with pytest.raises(TenantsError, match=needle):
        Tenants.from_file(path)


def test_missing_file_is_an_error_not_dev_mode(tmp_path):
    with pytest.raises(TenantsError, match="cannot read"):
        Tenants.from_file(tmp_path / "absent.yaml")


@pytest.mark.parametrize("content", ['{"tenants": {}}', '{"tenants": {"a": {"keys": [], "adapters": ["*"]}}}'])
def test_a_keys_file_without_keys_refuses_everyone_instead_of_opening(tmp_path, content):
    path = tmp_path / "keys.json"
    path.write_text(content)
    tenants = Tenants.from_file(path)
    assert not tenants.is_open and tenants.num_keys == 0
    for header in (None, "Bearer sk-anything"):
        with pytest.raises(AuthenticationError):
            tenants.authenticate(header)


def test_keys_that_are_not_utf8_are_refused_not_crashed(tenants):
    with pytest.raises(AuthenticationError, match="invalid API key"):
        tenants.authenticate("Bearer sk-\udcff\udcfe")  # how aiohttp hands over bytes that are not UTF-8


def test_a_rewritten_keys_file_takes_effect_without_a_restart(tmp_path):
    """The keys file is a mounted Secret that Kubernetes updates in place (a new file swapped in):
    a revoked key stops working and a new one works, without restarting the worker."""
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"tenants": {"acme": {"keys": ["sk-old"], "adapters": ["sql"]}}}))
    tenants = Tenants.from_file(path)
    assert tenants.authenticate("Bearer sk-old").name == "acme"
    rotated = tmp_path / "keys.json.new"
    rotated.write_text(json.dumps({"tenants": {"acme": {"keys": ["sk-new"], "adapters": ["sql", "chat"]}}}))
    rotated.replace(path)
    assert tenants.authenticate("Bearer sk-old").name == "acme"  # until the watch looks: no file read per request
    assert tenants.reload_if_changed()
    with pytest.raises(AuthenticationError, match="invalid API key"):
        tenants.authenticate("Bearer sk-old")
    assert tenants.authenticate("Bearer sk-new").may_use("chat")


def test_a_reload_names_each_tenant_it_left_out(tmp_path):
    """A name left out of the keys file may be given to another customer later: the engine forgets what it kept
    for it (its prefix-cache blocks). A key rotation leaves the tenant in, and so its blocks."""
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(KEYS))
    tenants, gone = Tenants.from_file(path), []
    tenants.on_gone = gone.append
    rotated = {"tenants": {name: {**spec, "keys": [f"{k}-2" for k in spec["keys"]]}
                           for name, spec in KEYS["tenants"].items()}}
    path.write_text(json.dumps(rotated))
    assert tenants.reload_if_changed() and gone == []
    path.write_text(json.dumps({"tenants": {"acme": rotated["tenants"]["acme"]}}))
    assert tenants.reload_if_changed() and gone == sorted(set(KEYS["tenants"]) - {"acme"})


@pytest.mark.parametrize("broken", ["{not json", b'{"tenants": {"acme": {"keys": ["sk-\xff"]}}}', None],
                         ids=["not-json", "not-utf8", "deleted"])
def test_a_keys_file_that_turns_bad_keeps_the_last_good_keys(tmp_path, broken):
    """A half-written, garbled or deleted keys file neither opens the worker nor locks every tenant out."""
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(KEYS))
    tenants = Tenants.from_file(path)
    if broken is None:
        path.unlink()
    elif isinstance(broken, bytes):
        path.write_bytes(broken)
    else:
        path.write_text(broken)
    assert not tenants.reload_if_changed()
    assert tenants.authenticate("Bearer sk-acme").name == "acme"
    with pytest.raises(AuthenticationError):
        tenants.authenticate("Bearer sk-wrong")
    path.write_text(json.dumps({"tenants": {"acme": {"keys": ["sk-acme-2"]}}}))  # fixed again: read again
    assert tenants.reload_if_changed()
    assert tenants.authenticate("Bearer sk-acme-2").name == "acme"
    with pytest.raises(AuthenticationError):
        tenants.authenticate("Bearer sk-acme")


def test_a_malformed_yaml_keys_file_is_reported_without_its_keys(tmp_path, caplog):
    """PyYAML quotes the line it stumbled on; the keys file's error is logged (at start-up, and at every
    reload), so it must say what and where, never the text, which may be a key."""
    path = tmp_path / "keys.yaml"
    good = "tenants:\n  acme:\n    keys: [sk-acme-secret-1]\n"
    bad = 'tenants:\n  acme:\n    keys: ["sk-acme-secret-1", "sk-acme-secret-2"\n    adapters: ["x"]\n'
    path.write_text(bad)
    with pytest.raises(TenantsError, match="line 4, column 5") as err:
        Tenants.from_file(path)
    assert "secret" not in str(err.value), str(err.value)
    path.write_text(good)
    tenants = Tenants.from_file(path)
    path.write_text(bad + "\n")  # another size: seen as changed
    assert not tenants.reload_if_changed()
    assert tenants.authenticate("Bearer sk-acme-secret-1").name == "acme"  # the last good keys hold
    assert "not valid JSON/YAML" in caplog.text and "secret" not in caplog.text, caplog.text


def test_a_tenant_name_yaml_reads_as_a_number_is_refused(tmp_path):
    """YAML reads `1:` as an int; taken as "1" it would merge with a tenant "1" (one cap, one set of
    permissions for two entries). It must be quoted."""
    path = tmp_path / "keys.yaml"
    path.write_text("tenants:\n  1: {keys: [k1]}\n  '1': {keys: [k2], adapters: ['x-*']}\n")
    with pytest.raises(TenantsError, match=r"tenants\.1: a tenant name must be a non-empty string; quote it"):
        Tenants.from_file(path)
    path.write_text("tenants:\n  '1': {keys: [k2]}\n")
    assert Tenants.from_file(path).authenticate("Bearer k2").name == "1"


def test_keys_file_that_is_a_directory_is_named_as_one(tmp_path):
    """A Secret's mount folder given instead of the file in it: say so and name the file to pass."""
    (tmp_path / "keys.yaml").write_text("tenants: {}\n")
    from lorafleet.worker.worker_config import WorkerConfig

    with pytest.raises(ValueError) as exc:
        WorkerConfig(api_keys_file=str(tmp_path))
    assert f"--api-keys-file {tmp_path} is a directory, not a file" in str(exc.value)
    assert f"--api-keys-file {tmp_path / 'keys.yaml'}" in str(exc.value)
    assert "does not exist" not in str(exc.value)


def test_keys_file_turned_directory_on_reread_is_named_as_one(tmp_path):
    with pytest.raises(TenantsError, match="is a directory, not a file"):
        Tenants._read(tmp_path)


def test_missing_keys_file_says_what_to_pass(tmp_path):
    from lorafleet.worker.worker_config import WorkerConfig

    with pytest.raises(ValueError, match="does not exist: pass the path of a JSON/YAML keys file"):
        WorkerConfig(api_keys_file=str(tmp_path / "keys.yaml"))

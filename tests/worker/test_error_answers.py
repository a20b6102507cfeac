"""What a caller gets when the engine fails its request, a stage fails or the stager refuses its token:
the status, type and code of the answer, and a message that names none of another tenant's adapters."""

import os
from types import SimpleNamespace

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from lorafleet.worker.app_keys import ADAPTERS
from lorafleet.worker.openai_api import _engine_error
from lorafleet.worker.openai_protocol import APIError
from lorafleet.worker.scheduler import CapacityError
from lorafleet.worker.served_adapters import ServedAdapters
from lorafleet.worker.tenants import Tenant


def _request() -> web.Request:
    app = web.Application()
    app[ADAPTERS] = ServedAdapters("base")
    return make_mocked_request("POST", "/v1/completions", app=app)


def test_a_request_the_held_pool_cannot_place_is_a_retryable_503():
    """The scheduler gives up on a request when pinned or busy adapters hold the pool: the worker is out
    of capacity for now (503 with Retry-After, as a shutdown), not broken (500) or the request wrong (400)."""
    job = SimpleNamespace(model="mine", tenant=Tenant("a", adapter_patterns=("mine",)))
    err = _engine_error(CapacityError("every slot is held by the pinned adapters theirs@v1, mine@v2"), job, _request())
    assert (err.status, err.type, err.code) == (503, "service_unavailable", "no_capacity")
    assert err.headers["Retry-After"]
    assert "theirs@v1" not in err.message and "mine@v2" in err.message


def test_an_unexpected_failure_is_a_500():
    job = SimpleNamespace(model="mine", tenant=Tenant("a"))
    err = _engine_error(RuntimeError("boom"), job, _request())
    assert (err.status, err.code) == (500, "engine_error") and "boom" in err.message


def test_a_stage_whose_objects_kept_changing_is_a_conflict():
    from lorafleet.worker.sources import SourceError
    from lorafleet.worker.staging_errors import staging_error

    err = staging_error(SourceError("s3://b/a/: the objects changed during 3 download attempts", "changed"), "s3://b/a/")
    assert (err.status, err.code) == (409, "changed")


@pytest.mark.parametrize("gone", ["adapter_config.json", "adapter_model.safetensors"])
async def test_a_local_adapter_missing_a_file_is_a_404_naming_it(tmp_path, gone):
    """A local folder without one of its two files is answered as an S3 prefix without it is (404
    `missing`, naming the file), not as a broken object store (502)."""
    from lorafleet.worker.sources import SourceError
    from lorafleet.worker.stager import Stager
    from lorafleet.worker.stager_config import StagerConfig
    from lorafleet.worker.staging_errors import staging_error

    folder = tmp_path / "root" / "alpha"
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text('{"r": 4}')
    (folder / "adapter_model.safetensors").write_bytes(b"weights")
    (folder / gone).unlink()
    stager = Stager(StagerConfig(stager_token="t" * 20, stager_cache_dir=str(tmp_path / "cache"),
                                 local_roots=[str(tmp_path / "root")]))
    with pytest.raises(SourceError) as err:
        await stager.stage(str(folder), None)
    answer = staging_error(err.value, str(folder))
    assert (answer.status, answer.code) == (404, "missing"), answer.message
    assert answer.message.startswith(f"{folder}: missing {gone} ")


def _adapter_folder(root, name: str):
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text('{"r": 4}')
    (folder / "adapter_model.safetensors").write_bytes(b"weights")
    return folder


def _break(folder, how: str):
    """Break `folder` as `how` says; the files of which the answer must name one."""
    weights = folder / "adapter_model.safetensors"
    if how == "weights_symlink_loop":
        weights.unlink()
        weights.symlink_to(weights.name)  # a link to itself
        return (weights,)
    if how == "tokenizer_symlink_loop":  # vocab.json -> merges.txt -> vocab.json
        (folder / "vocab.json").symlink_to("merges.txt")
        (folder / "merges.txt").symlink_to("vocab.json")
        return folder / "vocab.json", folder / "merges.txt"
    if how == "folder_symlink_loop":
        folder.rename(folder.with_name("moved"))
        folder.symlink_to(folder.name)
        return (folder,)
    if how == "weights_is_a_directory":
        weights.unlink()
        weights.mkdir()
        return (weights,)
    if how == "weights_mode_000":
        weights.chmod(0)
        return (weights,)
    assert how == "folder_mode_000"
    folder.chmod(0)
    return (folder,)


UNREADABLE = [("weights_symlink_loop", 422, "symlink_loop", "symlink loop"),
              ("tokenizer_symlink_loop", 422, "symlink_loop", "symlink loop"),
              ("folder_symlink_loop", 422, "symlink_loop", "symlink loop"),
              ("weights_is_a_directory", 422, "not_a_file", "not a regular file (a directory)"),
              ("weights_mode_000", 403, "permission_denied", "permission denied"),
              ("folder_mode_000", 403, "permission_denied", "permission denied")]
NOT_ROOT = pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its mode; the symlink loop "
                                                         "cases cover the other read errors")


@pytest.mark.parametrize(("how", "status", "code", "reason"), [
    pytest.param(*case, marks=NOT_ROOT) if "mode_000" in case[0] else case for case in UNREADABLE])
async def test_a_local_adapter_that_cannot_be_read_is_a_4xx_naming_the_file(tmp_path, how, status, code, reason):
    """A local file the stager cannot read (a permission error, a symlink loop, a directory where a file
    should be) is the caller's to fix: a 4xx naming the file and why, never a broken object store (502)."""
    from lorafleet.worker.sources import SourceError
    from lorafleet.worker.stager import Stager
    from lorafleet.worker.stager_config import StagerConfig
    from lorafleet.worker.staging_errors import staging_error

    root = tmp_path / "root"
    good, folder = _adapter_folder(root, "good"), _adapter_folder(root, "broken")
    named = _break(folder, how)
    stager = Stager(StagerConfig(stager_token="t" * 20, stager_cache_dir=str(tmp_path / "cache"),
                                 local_roots=[str(root)]))
    try:
        with pytest.raises(SourceError) as err:
            await stager.stage(str(folder), None)
    finally:
        if how == "folder_mode_000":
            folder.chmod(0o755)  # or tmp_path cannot be removed
    answer = staging_error(err.value, str(folder))
    assert (answer.status, answer.code) == (status, code), answer.message
    assert answer.message.startswith(tuple(f"{f}: " for f in named)) and reason in answer.message, answer.message
    assert "object store" not in answer.message
    assert (await stager.stage(str(good), None)).path == good.resolve()  # the stager keeps serving


async def test_a_stager_token_that_is_not_utf8_is_a_401_not_a_crash(aiohttp_client, tmp_path):
    """aiohttp hands over header bytes that are not UTF-8 as lone surrogates: the stager's token check
    must refuse such a token as it refuses any wrong one, not fail with a 500 (and a logged traceback)."""
    import json

    from lorafleet.worker.stager_config import StagerConfig
    from lorafleet.worker.stager_http import create_app

    from .test_tenant_isolation import raw_bearer_request

    client = await aiohttp_client(create_app(StagerConfig(stager_token="t" * 20,
                                                          stager_cache_dir=str(tmp_path / "cache"))))
    for method, path in (("GET", "/v1/state"), ("POST", "/v1/stage"), ("PUT", "/v1/directives")):
        head, body = await raw_bearer_request(client.server.port, method, path, b"t" * 18 + b"\xff\xfe")
        assert head.startswith(b"HTTP/1.1 401"), (path, head)
        assert json.loads(body)["error"]["code"] == "invalid_token"


@pytest.mark.parametrize("retryable", [True, False])
def test_only_a_load_failure_that_cannot_pass_by_itself_is_remembered(retryable):
    """A failed load that may pass (a read error, a timeout, slots held by pinned adapters) is a 503 with
    Retry-After, and the next request loads the version again; one whose files or settings must change
    first (corrupt, wrong shapes) is remembered, so later requests get the 503 at once until a push."""
    from lorafleet.worker.adapter_entry import AdapterLoadError

    from .test_served_adapters import ACME, SQL, RecordingHost, state

    request = _request()
    request.app[ADAPTERS].apply(state(1, SQL), RecordingHost())
    job = SimpleNamespace(model="sql", tenant=ACME)
    err = _engine_error(AdapterLoadError("sql@v1", "load failed: disk read error", retryable=retryable), job, request)
    assert (err.status, err.code) == (503, "adapter_load_failed") and bool(err.headers.get("Retry-After")) == retryable
    # one that cannot pass by itself tells the official clients not to retry it (they would, twice, by default)
    assert err.headers.get("x-should-retry") == (None if retryable else "false")
    if retryable:
        assert request.app[ADAPTERS].resolve("sql", ACME, None) == "sql@v1"
    else:
        with pytest.raises(APIError, match="disk read error") as answer:
            request.app[ADAPTERS].resolve("sql", ACME, None)
        assert answer.value.status == 503 and answer.value.headers.get("x-should-retry") == "false"


def test_a_load_failure_shows_no_folder_of_the_worker_s_disk():
    """A version whose source the engine refused (a link out of the allowed roots) failed to load with a
    reason that names the roots and where the link leads: the tenant's answer says why without them, now and on
    later requests for it."""
    from lorafleet.worker.adapter_entry import AdapterLoadError

    from .test_served_adapters import ACME, SQL, RecordingHost, state

    request = _request()
    request.app[ADAPTERS].apply(state(1, SQL), RecordingHost())
    reason = ("file:///data/acme/sql: resolves to /srv/secret-tree/gamma, outside the allowed local roots "
              "(/root/.cache/lorafleet/adapters, /data/tenants/) (not_allowed)")
    err = _engine_error(AdapterLoadError("sql@v1", reason), SimpleNamespace(model="sql", tenant=ACME), request)
    with pytest.raises(APIError) as later:
        request.app[ADAPTERS].resolve("sql", ACME, None)
    for message in (err.message, later.value.message):
        assert "resolves to a folder outside the allowed local roots (not_allowed)" in message, message
        assert "secret-tree" not in message and ".cache" not in message and "/data/tenants" not in message, message
    # Text of the caller's own, a path or a JSON pointer in it, goes through as it came.
    said = "'/api/v1/users' is not one of the choices; see #/definitions/Address"
    assert request.app[ADAPTERS].redact(said, ACME) == said


async def test_a_body_in_an_encoding_the_parser_cannot_read_is_one_log_line_not_a_traceback(aiohttp_server, caplog):
    """aiohttp refuses a Content-Encoding it cannot decode (br, zstd) with a 400 before any middleware, and
    logged each as an ERROR with a traceback: a client's fault, which any client could repeat to flood the log."""
    import asyncio
    import logging

    import lorafleet.worker.error_middleware  # noqa: F401 (installs the filter)

    server = await aiohttp_server(web.Application())
    with caplog.at_level(logging.INFO):
        for encoding in ("br", "zstd"):
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(f"POST / HTTP/1.1\r\nHost: x\r\nContent-Encoding: {encoding}\r\nContent-Length: 2\r\n\r\nxx"
                         .encode())
            status = await asyncio.wait_for(reader.readline(), 10)
            writer.close()
            assert status.split()[1] == b"400", status
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.text
    assert len([r for r in caplog.records if "Can not decode content-encoding" in r.getMessage()]) == 2

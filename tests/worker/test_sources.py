"""Adapter sources: allow-lists for local roots and S3 prefixes, `..` and symlink escapes, digests,
the files staged, local read errors, and stores that send more or less than they list."""

import errno
import os

import pytest

from lorafleet.worker.disk_cache import DiskCache
from lorafleet.worker.sources import (
    ADAPTER_FILES,
    STAGED_FILES,
    SourceError,
    Sources,
    SourcesConfig,
    adapter_digest,
    parse_s3,
    read_error,
    verify_digest,
)
from lorafleet.worker.vocab_digest import TOKENIZER_FILES


def fake_adapter(path, payload=b"weights"):
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text('{"r": 4}')
    (path / "adapter_model.safetensors").write_bytes(payload)
    return path


@pytest.fixture
def roots(tmp_path):
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    fake_adapter(root / "good")
    fake_adapter(outside / "secret")
    return root, outside


def test_local_paths_inside_a_root_are_allowed(roots):
    root, _ = roots
    src = Sources(SourcesConfig(local_roots=[str(root)]))
    assert src.local_path(str(root / "good")) == (root / "good").resolve()
    assert src.local_path(f"file://{root / 'good'}") == (root / "good").resolve()


@pytest.mark.parametrize("how", ["dotdot", "outside", "symlink_dir", "symlink_file", "relative", "no_roots"])
def test_escapes_are_refused(roots, how):
    root, outside = roots
    src = Sources(SourcesConfig(local_roots=[] if how == "no_roots" else [str(root)]))
    if how == "dotdot":
        uri = f"{root}/../outside/secret"
    elif how == "outside":
        uri = str(outside / "secret")
    elif how == "symlink_dir":
        os.symlink(outside / "secret", root / "link")
        uri = str(root / "link")
    elif how == "symlink_file":
        d = root / "sneaky"
        d.mkdir()
        (d / "adapter_config.json").write_text("{}")
        os.symlink(outside / "secret" / "adapter_model.safetensors", d / "adapter_model.safetensors")
        uri = str(d)
    elif how == "relative":
        uri = "good"
    else:
        uri = str(root / "good")
    with pytest.raises(SourceError) as err:
        src.local_path(uri)
    assert err.value.kind in ("not_allowed", "bad_uri")


@pytest.mark.parametrize("uri", ["file://../outside/secret", "../outside/secret", "file://good/../../outside/secret"])
def test_relative_paths_with_dotdot_are_escapes_not_malformed(roots, uri):
    """'..' is checked before absoluteness: a caller that lets malformed sources through (to report them
    per version) must still see a relative '..' path as the escape it is."""
    root, _ = roots
    with pytest.raises(SourceError, match="'..' is not allowed") as err:
        Sources(SourcesConfig(local_roots=[str(root)])).local_path(uri)
    assert err.value.kind == "not_allowed"
    with pytest.raises(SourceError, match="must be absolute paths") as err:
        Sources(SourcesConfig(local_roots=[str(root)])).local_path("file://good")
    assert err.value.kind == "bad_uri"


def test_a_folder_that_resolves_to_a_path_with_control_characters_is_that_sources_failure(roots):
    """The resolved path is what is forwarded as the version's uri, which may hold no control character: a
    tenant's link to such a folder inside its own fails that source, not the whole push of every tenant."""
    root, _ = roots
    (root / "v1\nx").mkdir()
    os.symlink(root / "v1\nx", root / "chat")
    with pytest.raises(SourceError, match="control characters") as err:
        Sources(SourcesConfig(local_roots=[str(root)])).local_path(str(root / "chat"))
    assert err.value.kind == "unreadable"


def test_missing_directory(roots):
    root, _ = roots
    with pytest.raises(SourceError, match="no such adapter directory"):
        Sources(SourcesConfig(local_roots=[str(root)])).local_path(str(root / "nope"))


def test_s3_uris_parse_and_the_allow_list_holds():
    assert parse_s3("s3://bucket/a/b") == parse_s3("s3://bucket/a/b/")
    assert parse_s3("s3://bucket/a/b").prefix == "a/b/"
    for bad in ("s3://", "s3:///x", "s3://b/a/../c/", "http://b/x", "s3://b/a/./c/", "s3://b/a//c/", "s3://b//",
                "s3://b/a/.", "s3://b/a//"):
        with pytest.raises(SourceError):
            parse_s3(bad)
    src = Sources(SourcesConfig(s3_allow=["adapters/team/", "open"]))
    assert src.check_s3("s3://adapters/team/sql/").bucket == "adapters"
    assert src.check_s3("s3://open/anything/").prefix == "anything/"
    for refused in ("s3://adapters/teamX/sql/", "s3://adapters/other/", "s3://private/team/"):
        with pytest.raises(SourceError) as err:
            src.check_s3(refused)
        assert err.value.kind == "not_allowed"


def test_env_config(monkeypatch):
    cfg = SourcesConfig.from_env({"LORAFLEET_S3_ENDPOINT": "127.0.0.1:9000", "AWS_ACCESS_KEY_ID": "ak",
                                  "LORAFLEET_S3_SECRET_KEY": "sk", "LORAFLEET_S3_SECURE": "false",
                                  "LORAFLEET_S3_ALLOW": "a/x/,b"})
    assert (cfg.s3_endpoint, cfg.s3_access_key, cfg.s3_secret_key, cfg.s3_secure) == ("127.0.0.1:9000", "ak", "sk", False)
    assert cfg.s3_allow == ["a/x/", "b"]


def test_digest_is_the_adapter_content_digest(tmp_path):
    import hashlib

    d = fake_adapter(tmp_path / "a", b"abc")
    expected = hashlib.sha256(b'{"r": 4}' + b"abc").hexdigest()
    assert adapter_digest(d) == expected == verify_digest(d, expected.upper(), "x")
    with pytest.raises(SourceError, match="sha256 mismatch") as err:
        verify_digest(d, "0" * 64, "s3://b/a/")
    assert err.value.kind == "digest_mismatch"


def test_an_adapter_file_gone_before_it_is_hashed_is_missing(tmp_path):
    """A file removed after the folder was checked (or never there) is a missing source (404), not an
    OSError the stager would answer as a broken object store (502)."""
    d = fake_adapter(tmp_path / "a")
    (d / "adapter_model.safetensors").unlink()
    with pytest.raises(SourceError, match="missing adapter_model.safetensors") as err:
        adapter_digest(d)
    assert err.value.kind == "missing"


@pytest.mark.parametrize("name", ["tokenizer.json", "vocab.json", "merges.txt", "added_tokens.json"])
def test_every_file_the_loader_reads_from_a_local_adapter_is_held_to_the_limit(tmp_path, name):
    """The loader reads the tokenizer files beside the adapter (vocab.json + merges.txt as well as
    tokenizer.json): staging a local folder checks each of them as it checks the weights."""
    root = tmp_path / "root"
    d = fake_adapter(root / "a")  # 8 bytes of config, 7 of weights: within the limit below
    (d / name).write_bytes(b" " * 9)
    src = Sources(SourcesConfig(local_roots=[str(root)], max_adapter_file_bytes=8))
    with pytest.raises(SourceError, match=f"{name}: 9 bytes, over the limit of 8 bytes") as err:
        src.verify_local(src.local_path(str(d)), None, str(d))
    assert err.value.kind == "too_large"


def test_local_and_s3_sources_stage_every_file_the_tokenizer_check_reads():
    """One list for both kinds of source: what the loader's tokenizer check reads is staged from S3 too."""
    assert set(ADAPTER_FILES) | set(TOKENIZER_FILES) <= set(STAGED_FILES)


@pytest.mark.parametrize(("exc", "kind", "says"), [
    (PermissionError(errno.EACCES, "Permission denied", "/r/a/vocab.json"), "permission_denied", "permission denied"),
    (OSError(errno.ELOOP, "Too many levels of symbolic links", "/r/a/vocab.json"), "symlink_loop", "a symlink loop"),
    (RuntimeError("Symlink loop from '/r/a/vocab.json'"), "symlink_loop", "a symlink loop"),
    (OSError(errno.EIO, "Input/output error", "/r/a/vocab.json"), "unreadable", "cannot be read (Input/output error)"),
])
def test_a_local_read_error_names_the_file_and_why(exc, kind, says):
    """The read errors a test cannot cause as root (a permission error) map as those it can (a loop)."""
    from lorafleet.worker.staging_errors import staging_error

    err = read_error("/r/a/vocab.json", exc)
    assert err.kind == kind and str(err).startswith(f"/r/a/vocab.json: {says}"), str(err)
    assert 400 <= staging_error(err, "/r/a").status < 500


def test_digest_agrees_with_the_peft_loader_version(tmp_path, tiny_llama_dir):
    from lorafleet.worker.model_config import ModelConfig
    from lorafleet.worker.peft_adapter import load_peft_adapter
    from tests.lora_factory import make_peft_adapter

    d = make_peft_adapter(tiny_llama_dir, tmp_path / "p", rank=4, seed=0, targets=["q_proj"])
    w = load_peft_adapter(d, ModelConfig.from_dir(tiny_llama_dir), dtype=__import__("torch").float32,
                          strict_base="off")
    assert adapter_digest(d).startswith(w.version)


def test_disk_cache_is_atomic_and_keeps_its_budget(tmp_path):
    cache = DiskCache(tmp_path / "c", budget_bytes=25)

    def fill(n):
        return lambda d: (d / "f").write_bytes(b"x" * n)

    cache.put("a", fill(10))
    cache.put("b", fill(10))
    with pytest.raises(RuntimeError):
        cache.put("c", lambda d: (_ for _ in ()).throw(RuntimeError("download broke")))
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["a", "b"]  # no half entry, no temp dir
    cache.get("a")  # a is now more recent than b
    cache.put("d", fill(10))
    assert sorted(cache.entries()) == ["a", "d"] and cache.evictions == 1
    cache.put("e", fill(10), protect={"a"})
    assert "a" in cache.entries()
    (tmp_path / "c" / ".tmp-x-123").mkdir()  # a crash mid-download
    again = DiskCache(tmp_path / "c", budget_bytes=100)
    assert sorted(again.entries()) == sorted(cache.entries())
    assert not (tmp_path / "c" / ".tmp-x-123").exists()


async def test_an_object_store_redirect_is_not_followed_out_of_the_allow_list(aiohttp_server, tmp_path):
    """The allow-list names buckets and prefixes of the configured store. A store that answers an
    allowed object with a redirect must not make the stager fetch from wherever it points."""
    import asyncio

    from aiohttp import web
    from minio.error import InvalidResponseError

    objects = {"team/alpha/adapter_config.json": b'{"r": 4}', "team/alpha/adapter_model.safetensors": b"weights"}
    elsewhere_hits: list[str] = []

    async def elsewhere(request: web.Request) -> web.Response:
        elsewhere_hits.append(request.path)
        return web.Response(body=b"X" * len(objects[f"team/alpha/{request.match_info['name']}"]))

    other = await aiohttp_server(_app([web.get("/{name}", elsewhere)]))

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPTemporaryRedirect(str(other.make_url(f"/{request.path.rsplit('/', 1)[1]}")))

    store = await aiohttp_server(_app([web.get("/adapters", _listing(objects)),
                                       web.get("/adapters/{key:.+}", redirect)]))
    with pytest.raises(InvalidResponseError, match="307"):
        await asyncio.to_thread(_store_sources(store).download, "s3://adapters/team/alpha/", tmp_path / "staged")
    assert elsewhere_hits == []


@pytest.mark.parametrize("how", ["chunked", "content_length"])
async def test_a_store_sending_more_than_it_listed_is_cut_off(aiohttp_server, tmp_path, how):
    """A store that lists 7 bytes of weights but sends more (a longer Content-Length, or a chunked body
    without one that would not end) must not fill the disk: the listed size bounds the download."""
    import asyncio
    import contextlib

    from aiohttp import web

    objects = {"team/alpha/adapter_config.json": b'{"r": 4}', "team/alpha/adapter_model.safetensors": b"weights"}

    async def get(request: web.Request) -> web.StreamResponse:
        key = request.match_info["key"]
        if key.endswith("adapter_config.json"):
            return web.Response(body=objects[key])
        if how == "content_length":
            return web.Response(body=b"x" * 100)
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        with contextlib.suppress(ConnectionResetError):  # the client hangs up once it has had enough
            for _ in range(64):
                await response.write(b"x" * (128 << 10))
        return response

    store = await aiohttp_server(_app([web.get("/adapters", _listing(objects)), web.get("/adapters/{key:.+}", get)]))
    with pytest.raises(SourceError) as err:
        await asyncio.to_thread(_store_sources(store).download, "s3://adapters/team/alpha/", tmp_path / "staged")
    expected = "announces 100 bytes, more than the 7" if how == "content_length" else "sent more than the 7 bytes"
    assert err.value.kind == "too_large" and expected in str(err.value), str(err.value)
    assert str(err.value).startswith("s3://adapters/team/alpha/adapter_model.safetensors: ")
    weights = tmp_path / "staged" / "adapter_model.safetensors"
    assert (not weights.exists()) if how == "content_length" else weights.stat().st_size <= 7


async def test_a_store_sending_less_than_it_listed_is_a_store_failure_not_a_missing_adapter(aiohttp_server, tmp_path):
    """A chunked body that ends short of the listed size (a dropped connection) is the store's failure,
    which may pass (502, retried by the seed), never a 404 saying the adapter is missing."""
    import asyncio

    from aiohttp import web

    from lorafleet.worker.staging_errors import staging_error

    objects = {"team/alpha/adapter_config.json": b'{"r": 4}', "team/alpha/adapter_model.safetensors": b"weights"}

    async def get(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        await response.write(objects[request.match_info["key"]][:5])
        await response.write_eof()
        return response

    store = await aiohttp_server(_app([web.get("/adapters", _listing(objects)), web.get("/adapters/{key:.+}", get)]))
    with pytest.raises(Exception) as err:
        await asyncio.to_thread(_store_sources(store).download, "s3://adapters/team/alpha/", tmp_path / "staged")
    answer = staging_error(err.value, "s3://adapters/team/alpha/")
    assert not isinstance(err.value, SourceError) and answer.status == 502, answer.message
    assert "adapter_config.json: the store sent 5 of the 8 bytes it listed" in answer.message



@pytest.mark.parametrize("store", ["ranged", "drops", "whole again"])
async def test_a_body_cut_short_is_resumed_from_where_it_stopped(aiohttp_server, tmp_path, store):
    """A connection dropped in the middle of an object (a body that ends short, or breaks) is asked for the
    rest only: Range from the bytes kept, under the same If-Match; a store that answers the whole object
    instead (it ignores Range) has it read again from the start. The files are whole either way."""
    import asyncio

    from aiohttp import web

    weights = bytes(range(256)) * 40
    objects = {"team/alpha/adapter_config.json": b'{"r": 4}', "team/alpha/adapter_model.safetensors": weights}
    asked: list[tuple[str | None, str | None]] = []

    async def get(request: web.Request) -> web.StreamResponse:
        body = objects[request.match_info["key"]]
        ranged = request.headers.get("Range")
        if request.match_info["key"].endswith(".json"):
            return web.Response(body=body)
        asked.append((ranged, request.headers.get("If-Match")))
        start = int(ranged[6:-1]) if ranged and store != "whole again" else 0
        response = web.StreamResponse(status=206 if start else 200)
        if start:
            response.headers["Content-Range"] = f"bytes {start}-{len(body) - 1}/{len(body)}"
        response.enable_chunked_encoding()
        await response.prepare(request)
        # The first two answers stop after 1000 bytes; a store that ignores Range sends all of it the second time.
        end = len(body) if len(asked) > 2 or len(asked) == 2 and store == "whole again" else start + 1000
        await response.write(body[start:end])
        if end < len(body) and store == "drops":
            request.transport.close()  # the connection breaks mid-body
            return response
        await response.write_eof()
        return response

    app = _app([web.get("/adapters", _listing(objects)), web.get("/adapters/{key:.+}", get)])
    server = await aiohttp_server(app)
    dest = await asyncio.to_thread(_store_sources(server).download, "s3://adapters/team/alpha/", tmp_path / "staged")
    assert (dest / "adapter_model.safetensors").read_bytes() == weights
    if store == "whole again":
        assert asked == [(None, '"e"'), ("bytes=1000-", '"e"')]  # answered whole from its start
    else:
        assert asked == [(None, '"e"'), ("bytes=1000-", '"e"'), ("bytes=2000-", '"e"')]


@pytest.mark.parametrize("store", ["wrong range", "no etag", "encoded", "encoded rest", "bare 412"])
async def test_a_rest_that_may_not_be_the_object_s_is_never_appended(aiohttp_server, tmp_path, store):
    """A resume takes only the rest asked, of the same upload: a 206 from another offset fails the download (no
    file of two parts passes as whole); an object listed without an ETag, or sent encoded, is not resumed; a
    bare 412 (a gateway's, no XML) to the ranged GET is a replaced object, listed and read again."""
    import asyncio

    from aiohttp import web

    old, new = bytes(range(256)) * 40, bytes(255 - i % 256 for i in range(10240))
    objects = {"team/alpha/adapter_config.json": b'{"r": 4}', "team/alpha/adapter_model.safetensors": old}
    asked: list[str | None] = []

    async def listing(request: web.Request) -> web.Response:
        response = await _listing(objects)(request)
        if store == "no etag":
            response.text = response.text.replace("<ETag>\"e\"</ETag>", "")
        if store == "bare 412" and objects["team/alpha/adapter_model.safetensors"] == new:
            response.text = response.text.replace("<ETag>\"e\"</ETag>", "<ETag>\"e2\"</ETag>")
        return response

    async def get(request: web.Request) -> web.StreamResponse:
        body = objects[request.match_info["key"]]
        if request.match_info["key"].endswith(".json"):
            return web.Response(body=body)
        asked.append(request.headers.get("Range"))
        if store == "bare 412" and request.headers.get("If-Match") == '"e"' and body == new:
            return web.Response(status=412)
        start = int(request.headers["Range"][6:-1]) if "Range" in request.headers else 0
        response = web.StreamResponse(status=206 if start else 200)
        if start:
            response.headers["Content-Range"] = f"bytes {start - 10 if store == 'wrong range' else start}-10239/10240"
        if store == "encoded" or store == "encoded rest" and start:
            response.headers["Content-Encoding"] = "identity, x"  # bytes as received are not those the range counts
        response.enable_chunked_encoding()
        await response.prepare(request)
        await response.write(body[start:] if start else body[:1000])
        if not start:
            if store == "bare 412":
                objects["team/alpha/adapter_model.safetensors"] = new  # replaced after the first GET was cut
            request.transport.close()
            return response
        await response.write_eof()
        return response

    server = await aiohttp_server(_app([web.get("/adapters", listing), web.get("/adapters/{key:.+}", get)]))
    download = _store_sources(server).download
    if store == "bare 412":  # replaced: listed again, read from its start (cut, resumed): the new upload whole
        dest = await asyncio.to_thread(download, "s3://adapters/team/alpha/", tmp_path / "staged")
        assert (dest / "adapter_model.safetensors").read_bytes() == new
        assert asked == [None, "bytes=1000-", None, "bytes=1000-"]
        return
    with pytest.raises(Exception) as err:
        await asyncio.to_thread(download, "s3://adapters/team/alpha/", tmp_path / "staged")
    assert not isinstance(err.value, SourceError)  # the store's fault: may pass (502), never the adapter's
    if store == "wrong range":
        assert asked == [None, "bytes=1000-"] and "Content-Range 'bytes 990-10239/10240'" in str(err.value)
    elif store == "encoded rest":  # the rest came encoded: not appended
        assert asked == [None, "bytes=1000-"] and "encoded" in str(err.value)
        assert (tmp_path / "staged" / "adapter_model.safetensors").stat().st_size == 1000
    else:
        assert asked == [None]  # not resumed

DEADLINE_S = 5.0


@pytest.mark.parametrize("sending", [True, False])
async def test_a_download_past_its_deadline_is_the_version_s_timeout_unless_the_store_sent_nothing(
        aiohttp_server, tmp_path, sending):
    """A body still arriving at the download's deadline (too slow for its timeout) ends in TimeoutError, the
    version's own failure; a body none of whose bytes came is the store not answering (an outage)."""
    import asyncio
    import contextlib
    import time

    from aiohttp import web

    from lorafleet.worker.stager_store import is_outage

    objects = {"team/alpha/adapter_config.json": b'{"r": 4}', "team/alpha/adapter_model.safetensors": b"w" * 100_000}

    async def get(request: web.Request) -> web.StreamResponse:
        key = request.match_info["key"]
        if key.endswith("adapter_config.json"):
            return web.Response(body=objects[key])
        response = web.StreamResponse(headers={"Content-Length": str(len(objects[key]))})
        await response.prepare(request)
        with contextlib.suppress(ConnectionError):  # the client hangs up at its deadline
            for _ in range(int(DEADLINE_S / 0.05) + 40):  # past the deadline: 2 kB/s never brings 100 kB in time
                if request.transport is None or request.transport.is_closing():
                    break
                if sending:
                    await response.write(b"w" * 100)
                await asyncio.sleep(0.05)
        return response

    store = await aiohttp_server(_app([web.get("/adapters", _listing(objects)), web.get("/adapters/{key:.+}", get)]))
    # Long enough for the listing and the config on a loaded machine: each call before the body may wait
    # a third of what is left (store_clients.py), and with 0.6 s a slow listing timed out as an outage.
    deadline = time.monotonic() + DEADLINE_S
    with pytest.raises(Exception) as err:
        await asyncio.to_thread(_store_sources(store).download, "s3://adapters/team/alpha/", tmp_path / "staged",
                                deadline=deadline)
    assert is_outage(err.value) is not sending, repr(err.value)
    if sending:
        assert type(err.value) is TimeoutError and "download timed out" in str(err.value), repr(err.value)


async def test_a_rest_asked_as_the_download_s_time_runs_out_is_its_timeout(aiohttp_server, tmp_path):
    """The body stalls after 1000 bytes (its read times out and the rest is asked), and the store never answers
    the ranged GET for the rest: the client's attempts end with the download's time. That is the version's
    timeout, as a body still arriving at the deadline is, not urllib3's MaxRetryError (seen as an outage)."""
    import asyncio
    import time

    from aiohttp import web

    objects = {"team/alpha/adapter_config.json": b'{"r": 4}', "team/alpha/adapter_model.safetensors": b"w" * 5000}

    async def get(request: web.Request) -> web.StreamResponse:
        key = request.match_info["key"]
        if key.endswith("adapter_config.json"):
            return web.Response(body=objects[key])
        response = web.StreamResponse(headers={"Content-Length": "5000"})
        if not request.headers.get("Range"):  # the rest is never answered
            await response.prepare(request)
            await response.write(b"w" * 1000)
        while request.transport is not None and not request.transport.is_closing():
            await asyncio.sleep(0.05)
        return response

    store = await aiohttp_server(_app([web.get("/adapters", _listing(objects)), web.get("/adapters/{key:.+}", get)]))
    with pytest.raises(Exception) as err:
        await asyncio.to_thread(_store_sources(store).download, "s3://adapters/team/alpha/", tmp_path / "staged",
                                deadline=time.monotonic() + DEADLINE_S)
    assert type(err.value) is TimeoutError and "download timed out (1008 of 5008 bytes)" in str(err.value), \
        repr(err.value)


def _listing(objects: dict[str, bytes]):
    """A ListObjectsV2 handler of bucket `adapters`, prefix team/alpha/, listing `objects`."""
    from aiohttp import web

    async def bucket(request: web.Request) -> web.Response:
        contents = "".join(f"<Contents><Key>{k}</Key><Size>{len(v)}</Size><ETag>\"e\"</ETag>"
                           f"<LastModified>2026-01-01T00:00:00.000Z</LastModified></Contents>" for k, v in objects.items())
        xml = ('<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
               f"<Name>adapters</Name><Prefix>team/alpha/</Prefix><KeyCount>{len(objects)}</KeyCount>"
               f"<IsTruncated>false</IsTruncated>{contents}</ListBucketResult>")
        return web.Response(text=xml, content_type="application/xml")

    return bucket


def _store_sources(store) -> Sources:
    return Sources(SourcesConfig(s3_allow=["adapters/team/"], s3_endpoint=f"127.0.0.1:{store.port}", s3_access_key="ak",
                                 s3_secret_key="sk", s3_secure=False, s3_region="us-east-1"))


def _app(routes):
    from aiohttp import web

    app = web.Application()
    app.router.add_routes(routes)
    return app


@pytest.mark.parametrize("answer_etag", ["its own", "none", "rewritten"])
async def test_a_store_that_ignores_if_match_never_stages_two_uploads_mixed(aiohttp_server, tmp_path, answer_etag):
    """Some gateways drop If-Match: a replaced object then comes whole, of the new upload, beside files read of the
    old one. An answer whose ETag is not the listed one (`its own`, the new upload's), or that has none, leaves
    the objects to be listed again once read: they changed, so they are read again, and the copy is all of one
    upload. A gateway that rewrites every ETag (`rewritten`) fails nothing: the second listing is the first."""
    import asyncio

    from aiohttp import web

    objects = {"team/alpha/adapter_config.json": b'{"r": 4}', "team/alpha/adapter_model.safetensors": b"old" * 100}
    listed = _listing(objects)
    upload, listings = ["e"], []

    async def listing(request: web.Request) -> web.Response:
        listings.append(upload[0])
        response = await listed(request)
        response.text = response.text.replace('<ETag>"e"</ETag>', f'<ETag>"{upload[0]}"</ETag>')
        return response

    async def get(request: web.Request) -> web.Response:
        key = request.match_info["key"]
        body = objects[key]
        if key.endswith(".json") and upload[0] == "e" and answer_etag != "rewritten":  # a new upload lands
            objects.update({"team/alpha/adapter_config.json": b'{"r": 8}',
                            "team/alpha/adapter_model.safetensors": b"new" * 100})
            upload[0] = "e2"
        etag = {"its own": upload[0] if body in objects.values() else "e", "rewritten": 'W/"gw-1"'}.get(answer_etag)
        return web.Response(body=body, headers={} if etag is None else {"ETag": f'"{etag}"'})  # If-Match or not

    server = await aiohttp_server(_app([web.get("/adapters", listing), web.get("/adapters/{key:.+}", get)]))
    dest = await asyncio.to_thread(_store_sources(server).download, "s3://adapters/team/alpha/", tmp_path / "staged")
    if answer_etag == "rewritten":
        assert (dest / "adapter_model.safetensors").read_bytes() == b"old" * 100 and listings == ["e", "e"]
        return
    assert (dest / "adapter_config.json").read_bytes() == b'{"r": 8}'
    assert (dest / "adapter_model.safetensors").read_bytes() == b"new" * 100
    # Read, listed: changed; read again (answers without an ETag: listed once more, unchanged).
    assert listings == ["e", "e2", "e2"] + (["e2"] if answer_etag == "none" else [])


async def test_objects_listed_without_an_etag_are_told_apart_by_size_and_upload_time(aiohttp_server, tmp_path):
    """A store that lists no ETag: what keys a staged copy without a digest is then each object's size and time
    of upload, so that a replaced upload is not served from the copy of the one before it (keyed by an empty
    ETag, both were the same)."""
    import asyncio

    from aiohttp import web

    objects = {"team/alpha/adapter_config.json": b'{"r": 4}', "team/alpha/adapter_model.safetensors": b"w" * 100}
    listed = _listing(objects)

    async def listing(request: web.Request) -> web.Response:
        response = await listed(request)
        response.text = response.text.replace("<ETag>\"e\"</ETag>", "")
        return response

    async def get(request: web.Request) -> web.Response:
        return web.Response(body=objects[request.match_info["key"]])

    sources = _store_sources(await aiohttp_server(_app([web.get("/adapters", listing),
                                                        web.get("/adapters/{key:.+}", get)])))
    uri = "s3://adapters/team/alpha/"
    first = await asyncio.to_thread(sources.object_etags, uri)
    assert all(version.startswith("no-etag:") for _, version in first), first
    dest = await asyncio.to_thread(sources.download, uri, tmp_path / "one", etags=first)  # the key agrees with it
    assert (dest / "adapter_model.safetensors").read_bytes() == b"w" * 100
    objects["team/alpha/adapter_model.safetensors"] = b"v" * 120  # a new upload
    assert await asyncio.to_thread(sources.object_etags, uri) != first
    with pytest.raises(SourceError) as err:  # the key of the copy before it names other content
        await asyncio.to_thread(sources.download, uri, tmp_path / "two", etags=first)
    assert err.value.kind == "changed"


async def test_objects_listed_without_an_etag_replaced_mid_download_are_read_again(aiohttp_server, tmp_path):
    """No If-Match holds an object listed without an ETag to the listed upload: the download lists the objects
    again once read, and starts over where one changed, so no copy mixes two uploads."""
    import asyncio

    from aiohttp import web

    config, weights = "team/alpha/adapter_config.json", "team/alpha/adapter_model.safetensors"
    objects = {config: b'{"r": 4}', weights: b"w" * 100}
    listed = _listing(objects)

    async def listing(request: web.Request) -> web.Response:
        response = await listed(request)
        response.text = response.text.replace("<ETag>\"e\"</ETag>", "")
        if objects[weights] != b"w" * 100:  # same size: only the time of upload tells
            response.text = response.text.replace("2026-01-01T00:00:00", "2026-01-02T00:00:00")
        return response

    async def get(request: web.Request) -> web.Response:
        key = request.match_info["key"]
        body = objects[key]
        if key == config and body == b'{"r": 4}':  # a new upload lands while the weights are read
            objects.update({config: b'{"r": 8}', weights: b"v" * 100})
        return web.Response(body=body)

    sources = _store_sources(await aiohttp_server(_app([web.get("/adapters", listing),
                                                        web.get("/adapters/{key:.+}", get)])))
    dest = await asyncio.to_thread(sources.download, "s3://adapters/team/alpha/", tmp_path / "staged")
    assert (dest / "adapter_config.json").read_bytes() == b'{"r": 8}'
    assert (dest / "adapter_model.safetensors").read_bytes() == b"v" * 100

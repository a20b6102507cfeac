"""What a caller gets when the engine fails its request or a stage fails: the status, type and code of
the answer, and a message that names none of another tenant's adapters."""

from types import SimpleNamespace

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from lorafleet.worker.app_keys import ADAPTERS
from lorafleet.worker.openai_api import _engine_error
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

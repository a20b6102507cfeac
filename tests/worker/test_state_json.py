"""JSON answers encoded off the loop: the same text as json.dumps, without one GIL-holding call over all of it."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from lorafleet.worker import state_json
from lorafleet.worker.state_json import dumps, encode


@pytest.mark.parametrize("obj", [
    [], {}, "s", float("nan"), list(range(9)), {str(i): i for i in range(10)}, {1: [1] * 9},
    {"a": list(range(9)), "b": {"x": [1, [2] * 9]}}, [[i] * 5 for i in range(6)],
    {"k\u00e9\"": ["\u00fc"] * 9, "n": None}, [{"a": list(range(5))}] * 3,
    [1.5, True, None, [1, 2], {"a": [3] * 7}], {str(i): [i] * 6 for i in range(9)},
])
def test_the_text_is_json_dumps_text_whatever_the_chunks(obj, monkeypatch):
    monkeypatch.setattr(state_json, "CHUNK_ITEMS", 4)  # lists and dicts of 5 or more items go in chunks
    assert dumps(obj) == json.dumps(obj)
    assert asyncio.run(encode(lambda: obj)) == json.dumps(obj).encode()


def test_a_tokenize_sized_answer_leaves_the_event_loop_running():
    """/tokenize with return_token_strs answers a 4 MB prompt with a million ids and strings: json.dumps over
    them held the GIL for its whole call, a third of a second of the event loop stalled by a thread's
    encoding. Written a chunk a call, the loop runs between them."""
    n = 1_000_000
    obj = {"count": n, "tokens": list(range(n)), "token_strs": [f"\u0120tok\u00fc{i}" for i in range(n)]}

    async def main() -> tuple[bytes, float, list[float]]:
        beats: list[float] = []
        encoding = asyncio.ensure_future(encode(lambda: obj))
        start = time.perf_counter()
        while not encoding.done():
            beats.append(time.perf_counter())
            await asyncio.sleep(0.002)
        return encoding.result(), time.perf_counter() - start, beats

    raw, took, beats = asyncio.run(main())
    gaps = [b - a for a, b in zip(beats, beats[1:], strict=False)]
    assert max(gaps) < took / 3, (took, max(gaps))
    assert json.loads(raw) == obj

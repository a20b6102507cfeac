"""When a pool's worker that reported a failed version is pushed again (controller.py)."""

from __future__ import annotations


class RetryBackoff:
    """When a worker that reported a failed version may have it re-pushed: first ``base`` seconds after the
    failure is seen, then ``2*base``, ``4*base``, ... up to ``cap``; cleared once it reports no failure. A retry
    counts once sent, answered or not: a pod that answers after the pass's wait (or refuses) stages again all the
    same, and counted only when accepted within the wait, such a pod was re-pushed every pass. A push queued
    behind one still in flight is not sent yet (and is dropped where the answer takes the same set)."""

    def __init__(self, base: float, cap: float) -> None:
        self.base, self.cap = base, cap
        self._state: dict[str, tuple[int, float]] = {}  # worker url -> (num_retries, not before)

    def may_retry(self, url: str, now: float) -> bool:
        state = self._state.get(url)
        return state is not None and now >= state[1]

    def failing(self, url: str, now: float, *, pushed: bool) -> None:
        """It reported a failed version this pass; ``pushed``: a new generation was just sent to it."""
        if url not in self._state:  # first seen failing (also on a pass that pushed): one base period
            self._state[url] = (0, now + min(self.cap, self.base))
        elif pushed:  # retried: twice as long as before
            num_retries = self._state[url][0] + 1
            self._state[url] = (num_retries, now + min(self.cap, self.base * 2**num_retries))

    def clear(self, url: str) -> None:
        self._state.pop(url, None)

    def retain(self, urls: set[str]) -> None:
        for url in set(self._state) - urls:
            del self._state[url]

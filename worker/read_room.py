"""ReadRoom: the room the CPU tier's budget leaves for the reads requests wait for, per loader group (the
asking tenant): how `AdapterLoading._start_wanted_reads` paces them.

Images of adapters a request waits for cannot be trimmed before they are placed on the GPU, so a burst of
requests for distinct cold adapters while every slot is busy would hold all of their images in (page-locked)
host memory. Instead, each group with requests waiting gets an equal share of the budget, and a read a request
waits for starts only while the group's images waiting for a GPU slot (or being copied there) and its reads
under way leave room for it in that share, each counted at its image's size (a read at its last image's size,
or, for an adapter never read before, the largest image read so far):

* a group with none may always start one, so another tenant's burst never holds a tenant's first cold load;
* reads of adapters never read before (their size a guess) run no more at once in a group than the loader
  threads;
* a read that does not fit waits at the head of its group, so a large adapter is not passed by the same
  group's smaller ones for ever; another group's reads go on;
* a read a loader thread has run longer than STUCK_READ_S (a hung mount) holds no room.

What one tenant holds (its burst, its reads hung on a dead mount) takes nothing from another's share. The
images of k groups then take at most max(budget / k, one image) each, plus a guessed read per loader thread
and the stuck reads, beyond what a group held when fewer shared the budget. Not paced, as before: warm-ups
(prefetches, pinned versions, a new version loading beside the current one), and images whose
requests were refused (pinned adapters keep them out): those do not count, so they never hold a tenant's
other reads back. Images that wait for their owner's GPU quota (its adapters that cannot leave, being in use,
copied or pinned, fill it) do not count in the share either; one at a time is read per owner (the first
placed when a place frees), and the owner's other requested adapters wait unread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

STUCK_READ_S = 10.0  # a read a loader thread has run longer holds no room (a hung mount); it still counts when it lands


@dataclass(slots=True)
class ReadRoom:
    budget: int  # the CPU tier's byte budget
    num_threads: int  # loader threads: the most first reads (of adapters never read before) a group runs at once
    quota_full: Callable[[str, int, int], bool]  # (owner, adapters, bytes) on the GPU: over its quota?
    busy: dict[str, list[int]] = field(default_factory=dict)  # owner -> [adapters, bytes] on the GPU that cannot leave
    tallies: dict[str, list[int]] = field(default_factory=dict)  # group -> [bytes, images and reads, first reads]
    active: set[str] = field(default_factory=set)  # groups that want something on the GPU
    deferred: set[str] = field(default_factory=set)  # groups with a read waiting in line
    quota_waits: dict[str, int] = field(default_factory=dict)  # owner -> images and reads waiting for its GPU quota

    @property
    def share(self) -> int:
        return self.budget // max(len(self.active), 1)

    def held_back(self, owner: str, nbytes: int) -> bool:
        """Whether an image of `owner` of `nbytes` waits for the owner's GPU quota, not for room."""
        count, held = self.busy.get(owner, (0, 0))
        return self.quota_full(owner, count + 1, held + nbytes)

    def waits_for_quota(self, owner: str, nbytes: int) -> bool:
        """Whether an image of `owner` of `nbytes` (or a read of one) waits for the owner's GPU quota; counted if so."""
        if not self.held_back(owner, nbytes):
            return False
        self.quota_waits[owner] = self.quota_waits.get(owner, 0) + 1
        return True

    def took(self, group: str, nbytes: int, *, first_read: bool = False) -> None:
        """`group` holds an image of `nbytes`, or runs a read of that many (a `first_read`: of an adapter never
        read before, whose size is a guess)."""
        self.active.add(group)
        tally = self.tallies.setdefault(group, [0, 0, 0])
        tally[0] += nbytes
        tally[1] += 1
        tally[2] += first_read

    def may_read(self, group: str, nbytes: int, *, first_read: bool = False) -> bool:
        """Whether `group` may start a read of `nbytes` (0: no size to go by) now; False puts it in line."""
        self.active.add(group)
        held, count, guessed = self.tallies.get(group, (0, 0, 0))
        if group in self.deferred:
            return False
        if count == 0:
            return True
        fits = held + nbytes <= self.share if nbytes else held < self.share
        if first_read:  # its size is a guess: no more such reads at once than the loader threads
            fits = fits and guessed < self.num_threads
        if not fits:
            self.deferred.add(group)  # its later reads wait behind this one
        return fits

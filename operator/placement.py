"""Which workers keep each adapter GPU-resident (``warm``); see reconcile.py's docstring for the policy."""

from __future__ import annotations

import itertools

from lorafleet.operator.crd_models import AdapterSpec
from lorafleet.operator.reports import WorkerIndex

UNKNOWN_BYTES = 1  # an adapter no worker has reported yet still counts, so placement spreads it


def warm_count(a: AdapterSpec, num_workers: int) -> int:
    n = num_workers if a.warm == "all" else min(int(a.warm), num_workers)
    return max(n, 1 if a.pinned and num_workers else 0)


def spec_bytes(a: AdapterSpec, workers: list[WorkerIndex]) -> int:
    """Bytes of one copy of what the spec serves: the stable version and its canary (a warm worker
    prefetches the canary beside the stable version, and pins both when pinned); a canary no worker has
    reported yet is taken to be the stable version's size. 0 while no size is known."""

    stable = max(a.known_bytes, reported_bytes(a, workers))
    return stable + canary_bytes(a, workers, default=stable)


def reported_bytes(a: AdapterSpec, workers: list[WorkerIndex], *, staging: bool = False) -> int:
    """The largest size a worker reports for ``a``'s stable version once staged; with ``staging``, also the size
    of a download in progress (its objects' total, known once listed); 0 while none does."""
    return max([0, *(s.bytes for x in workers for s in x.by_name.get(a.name, ())
                     if s.version == a.version and (staging or not s.staging))])


def canary_bytes(a: AdapterSpec, workers: list[WorkerIndex], *, default: int = 0, staging: bool = False) -> int:
    """Bytes of ``a``'s canary version: the largest a worker reports now (``staging``: as in reported_bytes) or
    reported before (status.canaryBytes, kept after the workers dropped it); ``default`` while no size is known;
    0 without a canary."""
    if a.canary is None:
        return 0
    sizes = [s.bytes for x in workers for s in x.by_name.get(a.name, ()) if s.version == a.canary.version
             and (staging or not s.staging)]
    return max([a.known_canary_bytes, *sizes]) or default


def adapter_bytes(a: AdapterSpec, workers: list[WorkerIndex]) -> int:
    """GPU bytes of one warm copy (spec_bytes); an adapter of unknown size counts, so placement spreads it."""
    return spec_bytes(a, workers) or UNKNOWN_BYTES


def copy_slots(a: AdapterSpec) -> int:
    """GPU adapter slots one warm copy takes: the stable version's, and its canary's (prefetched beside it)."""
    return 2 if a.canary is not None else 1


class Placement(dict[str, list[str]]):
    """adapter name -> pods that keep it GPU-resident; ``canary_pods``: name -> those of them where its canary
    was given room beside it (elsewhere the worker prefetches it only into free room: it may stay off the GPU)."""

    def __init__(self, *args, canary_pods: dict[str, set[str]] | None = None) -> None:
        super().__init__(*args)
        self.canary_pods = canary_pods or {}


def place_warm(adapters: list[AdapterSpec], workers: list[WorkerIndex], *, default_capacity: int = 0,
               quiet: list[WorkerIndex] = ()) -> Placement:
    """adapter name -> pods that keep it GPU-resident (see reconcile.py's docstring for the policy). ``quiet``:
    pods whose sidecar missed this pass's answer (their last answer stands in): the copies they keep stay
    placed there, but none is added (they could not be told)."""
    keeping, workers = workers, [*workers, *quiet]
    load = {w.pod: 0 for w in workers}
    taken = {w.pod: 0 for w in workers}
    # The smaller of the worker's own report of its adapter pool size (the pages adapters may take, which
    # the KV cache shares) and the pool's spec.adapterMemory.gpuBytes, where each is known.
    capacity = {w.pod: min([b for b in (w.w.reported.pool_bytes, default_capacity) if b], default=None)
                for w in workers}
    slots = {w.pod: w.w.reported.pool_slots or None for w in workers}  # None: a worker that does not say
    sizes = {a.name: adapter_bytes(a, workers) for a in adapters}
    # A warm copy's canary part: where only the stable version fits, the copy is kept for it alone (the worker
    # prefetches the canary warm, into free room only, evicting nothing), rather than the stable version losing
    # its copy. A pinned copy pins its canary too: it is placed whole or not at all.
    canary_sizes = {a.name: min(canary_bytes(a, workers, default=sizes[a.name] // 2), sizes[a.name])
                    for a in adapters if a.canary is not None and not a.pinned}
    order = sorted(adapters, key=lambda a: (not a.pinned, -a.priority, -sizes[a.name], a.name))
    placement: dict[str, list[str]] = {a.name: [] for a in adapters}
    with_canary: set[tuple[str, str]] = set()  # (name, pod) whose canary's bytes and slot are counted

    def room(pod: str, size: int, need: int) -> bool:
        return ((capacity[pod] is None or load[pod] + size <= capacity[pod])
                and (slots[pod] is None or taken[pod] + need <= slots[pod]))

    by_bytes, by_slots = all(capacity.values()), all(slots.values())  # known for every worker (an upgrade)

    def fullness(pod: str) -> tuple:
        """The tighter of its byte and slot shares taken (each where every worker says it), then bytes."""
        shares = [load[pod] / capacity[pod] if by_bytes else 0.0, taken[pod] / slots[pod] if by_slots else 0.0]
        return max(shares), load[pod], taken[pod], pod

    def count(a: AdapterSpec, pod: str, *, canary: bool) -> None:
        canary = canary or (a.canary is not None and a.name not in canary_sizes)  # pinned: always whole
        extra = canary_sizes.get(a.name, 0)
        load[pod] += sizes[a.name] - (0 if canary else extra)
        taken[pod] += 2 if canary and a.canary is not None else 1
        if canary and a.canary is not None:
            with_canary.add((a.name, pod))

    def place(a: AdapterSpec, candidates: list[WorkerIndex], *, canary: bool) -> None:
        chosen = placement[a.name]
        stable = sizes[a.name] - canary_sizes.get(a.name, 0)
        need = 1 if a.name in canary_sizes or a.canary is None else 2  # a pinned one's canary is pinned too
        fitting = [w.pod for w in candidates if w.pod not in chosen and room(w.pod, stable, need)]
        for pod in sorted(fitting, key=fullness)[:warm_count(a, len(workers)) - len(chosen)]:
            count(a, pod, canary=canary and room(pod, sizes[a.name], copy_slots(a)))
            chosen.append(pod)

    by_pod = {w.pod: w for w in workers}

    def add_canaries(a: AdapterSpec, *, held: bool = False) -> None:
        for pod in placement[a.name]:
            extra = canary_sizes.get(a.name)
            if held and not holds_canary(by_pod[pod], a):
                continue
            if extra is not None and (a.name, pod) not in with_canary and room(pod, extra, 1):
                load[pod] += extra
                taken[pod] += 1
                with_canary.add((a.name, pod))

    # Rank by rank (pinned, then priority), the copies workers already hold are kept before any new copy is
    # placed: a newcomer displaces a resident adapter of a lower rank only, never one of its own; and every
    # held stable copy of the rank before any canary's slot (a canary added to one never moves another), the
    # canaries a worker has on the GPU first (it put them into the free room it had; it moves none for another).
    # A pinned copy is placed whole: one whose canary the worker does not hold yet comes after the rank's other
    # held copies (it moves, or goes unpinned, where both do not fit; the adapter beside it keeps its pin).
    def grows(w: WorkerIndex, a: AdapterSpec) -> bool:
        return a.pinned and a.canary is not None and not holds_canary(w, a)

    for _, group in itertools.groupby(order, key=lambda a: (a.pinned, a.priority)):
        ranked = list(group)
        for growing in (False, True):
            for a in ranked:  # a pod that answered keeps its copy before one whose last answer stands in
                for holders in (keeping, quiet):
                    place(a, [w for w in holders if holds(w, a) and grows(w, a) == growing], canary=False)
        for held in (True, False):
            for a in ranked:
                add_canaries(a, held=held)
        for a in ranked:
            place(a, keeping, canary=True)
    return Placement(((name, sorted(pods)) for name, pods in placement.items()), canary_pods={
        a.name: {pod for pod in placement[a.name] if (a.name, pod) in with_canary} for a in adapters if a.canary})


def holds(w: WorkerIndex, a: AdapterSpec) -> bool:
    """``w`` has ``a``'s version GPU-resident, or was told to keep it warm by the last push."""
    st = w.find(a.name, a.version)
    pushed = w.pushed.get(a.name)
    return (st is not None and st.tier == "gpu") or (pushed is not None and pushed.warm)


def holds_canary(w: WorkerIndex, a: AdapterSpec) -> bool:
    """``w`` has ``a``'s canary version GPU-resident."""
    st = None if a.canary is None else w.find(a.name, a.canary.version)
    return st is not None and st.tier == "gpu"

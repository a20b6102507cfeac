"""LoRAAdapter and LoRAPool statuses, computed only from what workers report (never from what was sent).

An adapter is Ready when every worker that should hold it GPU-resident reports its stable version (and its
canary, which a warm worker prefetches too) at tier ``gpu`` without error, every ready worker has it registered
(a version its stager still stages, ``staging``, is not registered yet), and every worker that reports its traffic
split sends the name's users as the spec says (an edit of the canary, its removal or promotion is Loading
until applied; meanwhile stableVersion, canaryVersion and canaryWeight are the split the workers report). A
worker whose GPU adapter slots are all held by pinned adapters can never make it resident: Degraded, naming
the worker and what to change, rather than Loading for ever on a warm worker, or Ready while an on-demand
worker refuses each of its requests (503). A ready worker whose
sidecar has not answered for longer than the quiet grace is not counted (a dead pod must not hold the status
for ever), and the message says how many, and which, are left out. Conditions keep their
``lastTransitionTime`` until their status flips.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lorafleet.operator.crd_models import AdapterSpec, InvalidAdapter, PoolSpec
from lorafleet.operator.placement import UNKNOWN_BYTES, adapter_bytes, copy_slots
from lorafleet.operator.reports import WorkerIndex, WorkerReport
from lorafleet.operator.tenant_quota import SizeWait

MAX_LISTED = 3  # pods (or their errors) a status message names for one thing, then "and N more"


def _named(items: Sequence[str], sep: str = ", ") -> str:
    """The first MAX_LISTED of `items` joined, then "and N more": a pool of thousands of pods keeps its messages
    (and the object the API server stores) short."""
    items = list(items)
    more = f" and {len(items) - MAX_LISTED} more" if len(items) > MAX_LISTED else ""
    return sep.join(items[:MAX_LISTED]) + more


def condition(old: dict[str, Any], ctype: str, ok: bool | None, reason: str, message: str, now: str) -> dict[str, Any]:
    """One condition of ``old`` (a status) brought up to date (``ok`` None: Unknown); the transition time moves
    only on a flip."""
    prev = next((c for c in old.get("conditions") or [] if c.get("type") == ctype), None)
    status = "Unknown" if ok is None else "True" if ok else "False"
    since = prev["lastTransitionTime"] if prev and prev.get("status") == status and prev.get(
        "lastTransitionTime") else now
    return {"type": ctype, "status": status, "reason": reason, "message": message, "lastTransitionTime": since}


def adapter_status(a: AdapterSpec, live: list[WorkerIndex], warm_pods: list[str], *, now: str,
                   requested: int | None = None, failure: str | None = None, silent: Sequence[str] = (),
                   canary_pods: set[str] | None = None) -> dict[str, Any]:
    """The status of an adapter served as ``a``. ``canary_pods``: the warm pods where placement gave its canary
    room (None: all of them); on the others it loads on demand. ``failure``: why its current spec is refused while ``a``,
    its last valid spec, stays in force (phase Failed, yet the fields say what is really served). ``silent``:
    ready pods whose sidecar did not answer; with none that did, the last status's versions and instances
    stay (those pods may still serve them)."""
    instances, errors, slot_bound, downloading = [], [], [], []
    versions_seen: set[str] = set()
    registered = resident = canary_registered = canary_resident = 0
    size = 0
    warm_set = set(warm_pods)
    canary_set = warm_set if canary_pods is None else warm_set & canary_pods
    for w in live:
        for st in w.by_name.get(a.name, ()):
            if st.error:
                errors.append(f"{w.pod}: {st.name}@{st.version}: {st.error}" + (" (being staged again)"
                                                                                 if st.staging else ""))
                continue
            if st.staging:  # still being downloaded: not registered yet
                if st.bytes_done is not None:
                    downloading.append(f"{w.pod} {st.version} {_mib(st.bytes_done)}"
                                       + (f"/{_mib(st.bytes)} MiB" if st.bytes else " MiB"))
                continue
            versions_seen.add(st.version)
            if st.num_pinned_slots is not None and st.tier != "gpu" and st.version in (
                    a.version, a.canary.version if a.canary else None):  # a warm worker: Ready would wait for ever
                slot_bound.append(
                    f"warm worker {w.pod}: all {st.num_pinned_slots} of its GPU adapter slots (--max-loras) are held "
                    f"by pinned adapters, so {st.name}@{st.version} cannot become GPU-resident there"
                    if w.pod in warm_set else  # on demand there: each of its requests fails to load (503)
                    f"worker {w.pod}: all {st.num_pinned_slots} of its GPU adapter slots (--max-loras) are held by "
                    f"pinned adapters, so its requests for {st.name}@{st.version} are refused (503)")
            if st.tier != "none":
                instances.append({"pod": w.pod, "version": st.version, "tier": st.tier})
            if st.version == a.version:
                registered += 1
                size = max(size, st.bytes)
                resident += w.pod in warm_set and st.tier == "gpu"
            elif a.canary is not None and st.version == a.canary.version:
                canary_registered += 1
                canary_resident += w.pod in canary_set and st.tier == "gpu"  # a warm worker prefetches it too
    instances.sort(key=lambda i: (i["pod"], i["version"]))
    canary_version = a.canary.version if a.canary and canary_registered else None
    canary_weight = a.canary.weight if canary_version else 0
    canary_active = canary_version is not None and canary_registered == len(live) and a.canary.weight > 0
    stable_seen = sorted(versions_seen - ({a.canary.version} if a.canary else set()))
    stable_version = a.version if a.version in versions_seen else (
        a.status.get("stableVersion") if a.status.get("stableVersion") in stable_seen else
        (stable_seen[0] if stable_seen else None))
    # Workers that send the name's users elsewhere than the spec says (a push not applied yet, or refused).
    reported = {w.pod: split for w in live if (split := _split(w, a.name)) is not None}
    wanted_split = _wanted_split(a)
    pending = {pod: used for pod, split in reported.items() if (used := _used(split)) != wanted_split}
    differ = None
    if pending:  # the fields say what is served: the workers' split when they agree on one, else see below
        splits = {tuple(sorted(split.items())) for split in pending.values()}
        agreed = dict(splits.pop()) if len(splits) == 1 and len(pending) == len(live) else None
        # The version the last status called stable while a worker still has it (at 0 % under a 100 % canary)
        previous = a.status.get("stableVersion")
        held = {v for split in reported.values() for v in split}
        if agreed:  # else the most used
            stable_version = previous if previous in held else max(agreed, key=lambda v: (agreed[v], v == a.version))
            others = sorted(v for v in agreed if v != stable_version)
            canary_version = others[0] if len(others) == 1 else None
            canary_weight = agreed[canary_version] if canary_version else 0
        else:  # the workers differ: else the spec's. A canary (the spec's, or the one the last status named)
            # that some still send users to is named at the largest share one gives it, with each worker's split.
            stable_version = previous if previous in held else a.version
            canaries = {a.canary.version if a.canary else None, a.status.get("canaryVersion")} - {None, stable_version}
            shares = [(p, v) for split in reported.values() for v, p in _used(split).items() if v in canaries]
            canary_version = max(shares)[1] if shares else None
            canary_weight = max(shares)[0] if shares else 0
            if shares:
                differ = f"canary {canary_version} while workers differ in the split: " + _named(
                    [f"{pod} {_split_text(_used(split))}" for pod, split in sorted(reported.items())], "; ")
        canary_active = canary_weight > 0
    target = len(warm_pods)
    if isinstance(failure, SizeWait):  # a byte quota's wait for another version's size: not the spec's fault
        phase, msg = "Pending", f"{failure}; version {a.version} serves meanwhile"
    elif failure is not None:
        phase = "Failed"
        msg = f"{failure}; the last valid spec (version {a.version}) stays in force until the spec is fixed"
    elif not live and silent:
        phase = "Pending"
        msg = (f"no answer from the sidecar of {_named(silent)} (ready pods, which may still serve it); "
               f"the status waits for their reports")
    elif not live:
        phase, msg = "Pending", f"no ready worker matches LoRAPool {a.pool!r} spec.workerSelector"
    elif errors:
        phase, msg = "Degraded", _named(errors, "; ") + " (failed versions are re-pushed with a backoff)"
    elif slot_bound:  # an older worker does not say (num_pinned_slots absent): Loading, as before
        phase = "Degraded"
        msg = _named(slot_bound, "; ") + ("; raise --max-loras of the pool's workers, or unpin an adapter there "
                                       "(spec.pinned: false on its LoRAAdapter)")
    elif requested is not None and target < requested:
        phase = "Degraded"
        asks = ("spec.pinned: true (with warm: 0) asks for 1 GPU-resident copy" if a.pinned and a.warm == 0
                else f"spec.warm: {a.warm} asks for {requested} GPU-resident copies")
        need = copy_slots(a)
        msg = (f"{asks} but only {target} workers have room for its {adapter_size_text(a, live)} and "
               f"{need} adapter slot{'s' if need > 1 else ''} (their --max-loras) in their GPU adapter pool; "
               f"it is served on demand elsewhere")
    elif (registered == len(live) and resident == target and not pending
          and (a.canary is None or (canary_registered == len(live) and canary_resident == len(canary_set)))):
        phase = "Ready"
        msg = (f"{a.version} GPU-resident on {resident}/{target} warm workers, registered on {registered}"
               if target else f"{a.version} on demand (warm: 0), registered on {registered} workers")
        if canary_version:
            msg += f"; canary {canary_version} at {a.canary.weight}%"
            if len(canary_set) < target:
                msg += (f", loaded on demand on {_named(sorted(warm_set - canary_set))} (no GPU room beside "
                        f"the stable copy)")
    else:
        phase = "Loading"
        msg = (f"{a.version}: registered on {registered}/{len(live)} workers, GPU-resident on "
               f"{resident}/{target} warm workers")
        if a.canary is not None:
            msg += f"; canary {a.canary.version} registered on {canary_registered}/{len(live)}, " + (
                f"GPU-resident on {canary_resident}/{len(canary_set)} warm workers with room for it" if canary_set
                else "loaded on demand (no warm worker has GPU room for it beside the stable copy)" if target
                else "loaded on demand")
        if pending:
            msg += "; the traffic split is not applied yet on " + _named(
                [f"{pod} ({_split_text(split)})" for pod, split in sorted(pending.items())])
            msg += f", the spec asks {_split_text(wanted_split)}"
        if downloading:  # a few pods' (of a large pool's many)
            msg += "; downloading on " + _named(sorted(downloading))
        worker_errors = [f"{w.pod}: {w.w.reported.error}" for w in live if w.w.reported.error]
        if worker_errors:  # e.g. the sidecar cannot reach its engine: say why it is not loading
            msg += "; " + _named(worker_errors, "; ")
    # Silent past the quiet grace (a quiet one counts as it last answered): dropped from the counts above, so as
    # not to hold the status for ever on a dead pod, yet it may still split users otherwise: said, not hidden.
    uncounted = sorted(set(silent) - {w.pod for w in live})
    if uncounted and live:
        msg += (f"; {len(uncounted)} ready worker{'s' if len(uncounted) > 1 else ''} not counted: no answer from "
                f"the sidecar of {_named(uncounted)}"
                + " (what it serves, and how it splits users, is not known)")
    canary_text = differ or (f"canary {canary_version} at {canary_weight}%" if canary_active else None)
    if not live and silent:  # nothing reported: what the last status said stays (those pods may still serve it)
        stable_version, canary_version = a.status.get("stableVersion"), a.status.get("canaryVersion")
        canary_weight, instances = a.status.get("canaryWeight") or 0, list(a.status.get("instances") or [])
        previous = next((c for c in a.status.get("conditions") or [] if c.get("type") == "CanaryActive"), {})
        canary_text = previous.get("message") if previous.get("status") == "True" else None
    status = _status(a, phase, msg, now=now, validated=failure is None or isinstance(failure, SizeWait),
                     canary_text=canary_text)
    status.update({
        "stableVersion": stable_version,
        "canaryVersion": canary_version,
        "canaryWeight": canary_weight,
        "instances": instances,
        "warmWorkers": warm_pods,
        "ready": f"{resident}/{target}" if target else f"{registered}/{len(live)}",
        "bytes": size or a.known_bytes,
        "bytesVersion": a.version if size or a.known_bytes else None,  # whose size `bytes` is
    })
    return status


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f}"


def _wanted_split(a: AdapterSpec) -> dict[str, int]:
    """version -> share of the name's users the spec sends to it (only shares above 0)."""
    weight = a.canary.weight if a.canary is not None else 0
    split = {a.version: 100 - weight, **({a.canary.version: weight} if a.canary is not None else {})}
    return {v: p for v, p in split.items() if p}


def _split(w: WorkerIndex, name: str) -> dict[str, int] | None:
    """The split worker ``w`` reports for ``name``, versions at 0 % included; None when it reports none (it
    does not hold the name, or its sidecar does not report splits): nothing to compare."""
    states = [st for st in w.by_name.get(name, ()) if st.traffic_percent is not None and st.error is None]
    return {st.version: st.traffic_percent for st in states} if states else None


def _used(split: dict[str, int]) -> dict[str, int]:
    return {v: p for v, p in split.items() if p}


def _split_text(split: dict[str, int]) -> str:
    return ", ".join(f"{v} {p}%" for v, p in sorted(split.items())) or "no version"


def unserved_status(x: AdapterSpec | InvalidAdapter, phase: str, message: str, live: list[WorkerIndex], *,
                    now: str, validated: bool | None = False) -> dict[str, Any]:
    """An adapter no worker is told to serve: only what workers still report (as they unload it, or, in a
    pool whose spec is invalid, as they keep it: ``validated`` None, as its spec cannot be checked against
    the pool; a SizeWait, a spec that waits its turn, is valid). ``bytes`` stays: quota admission needs the last
    known size (clearing it would let an adapter over spec.tenantQuota.maxBytes flap in and out)."""
    validated = True if validated is False and isinstance(message, SizeWait) else validated
    instances, versions, shares = [], set(), {}
    for w in live:
        for st in w.by_name.get(x.name, ()):
            if not st.error:
                versions.add(st.version)
                shares[st.version] = max(shares.get(st.version, 0), st.traffic_percent or 0)
                if st.tier != "none":
                    instances.append({"pod": w.pod, "version": st.version, "tier": st.tier})
    stable = x.status.get("stableVersion")
    stable = stable if stable in versions else None
    # Kept as it is (an invalid pool's pods): a canary they still send users to is still served.
    canary = x.status.get("canaryVersion") if validated is None else None
    weight = shares.get(canary, 0) if canary in versions and canary != stable else 0
    return {
        **_status(x, phase, message, now=now, validated=validated,
                  canary_text=f"canary {canary} at {weight}%" if weight else None),
        "stableVersion": stable,
        "canaryVersion": canary if weight else None,
        "canaryWeight": weight,
        "instances": sorted(instances, key=lambda i: (i["pod"], i["version"])),
        "warmWorkers": [],
        "ready": "0/0",
    }


def adapter_size_text(a: AdapterSpec, live: list[WorkerIndex]) -> str:
    size = adapter_bytes(a, live)
    if size <= UNKNOWN_BYTES:
        return "unknown size"
    return f"{_mib(size)} MiB" + (" (stable and canary versions)" if a.canary is not None else "")


def _status(x: AdapterSpec | InvalidAdapter, phase: str, message: str, *, now: str, validated: bool | None,
            canary_text: str | None = None) -> dict[str, Any]:
    """phase, message, observedGeneration and the three conditions; ``canary_text``: the canary served;
    ``validated`` None: its pool's spec is invalid, so the checks against the pool cannot run."""
    if validated is None:
        reason, text = "PoolInvalid", f"not checked against its pool, whose spec is invalid: {message}"
    else:
        reason, text = ("Valid", "spec accepted") if validated else ("Invalid", message)
    return {
        "phase": phase,
        "message": message,
        "observedGeneration": x.generation,
        "conditions": [
            condition(x.status, "Ready", phase == "Ready", phase, message, now),
            condition(x.status, "Validated", validated, reason, text, now),
            condition(x.status, "CanaryActive", canary_text is not None,
                      "CanaryServing" if canary_text else "NoCanary", canary_text or "no canary is being served", now),
        ],
    }


def pool_status(pool: PoolSpec, num_adapters: int, workers: list[WorkerReport], *, now: str,
                shared_pods: dict[str, str]) -> dict[str, Any]:
    # A quiet pod (no answer this pass, a recent one: controller.py) counts as it last answered.
    known = [(w.pod, said) for w in workers if (said := w.reported or w.last_answer) is not None]
    kv = [said.kv_usage for _, said in known]
    errors = [f"{pod}: {said.error}" for pod, said in known if said.error]
    silent = [w.pod for w in workers if w.reported is None]
    quiet = [w.pod for w in workers if w.reported is None and w.last_answer is not None]
    msg = f"{len(known)} ready workers"
    if silent:
        msg += f"; no answer from the sidecar of {_named(silent)}"
        msg += f" (counted as they last answered, for a while: {_named(quiet)})" if quiet else ""
    if errors:
        msg += "; " + _named(errors, "; ")
    if shared_pods:  # two pools pushing whole adapter sets to one pod would undo each other
        msg += _shared_text(shared_pods)
    status = {
        "readyWorkers": len(known),
        "adapters": num_adapters,
        "observedGeneration": pool.generation,
        # Ready only: the autoscaler owns the Scaling condition (writers merge their own types in).
        "conditions": [condition(pool.status, "Ready", bool(known) and not errors and not shared_pods,
                                 "Workers" if known else "NoWorkers", msg, now)],
    }
    if pool.scaling is None:  # with spec.scaling the autoscaler writes it, from Prometheus
        status["kvUsage"] = round(sum(kv) / len(kv), 4) if kv else 0.0
    return status


def with_ready_note(status: dict[str, Any], note: str | None) -> dict[str, Any]:
    """A pool status (``pool_status``'s) with ``note`` added to its Ready condition's message; as it is without."""
    if not note or not status.get("conditions"):
        return status
    conditions = [{**c, "message": f"{c['message']}; {note}"} if c.get("type") == "Ready" else c
                  for c in status["conditions"]]
    return {**status, "conditions": conditions}


def with_refused_pushes(status: dict[str, Any], old: dict[str, Any], refused: dict[str, str], *,
                        now: str) -> dict[str, Any]:
    """A pool status (``pool_status``'s) whose Ready is False (``PushRefused``) and names each pod whose sidecar
    refused its adapter set, and why (``refused``: pod -> reason); as it is when none did. ``old``: the pool's
    status before the pass (for the transition time)."""
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    if not refused or ready is None:
        return status
    pods_of: dict[str, list[str]] = {}  # reason -> pods (a set too large for every sidecar is said once)
    for pod, reason in sorted(refused.items()):
        pods_of.setdefault(reason, []).append(pod)
    why = "; ".join(f"the sidecar{'s' if len(pods) > 1 else ''} of {', '.join(pods)} refused "
                    f"{'their' if len(pods) > 1 else 'its'} adapter set ({reason})" for reason, pods in pods_of.items())
    new = condition(old, "Ready", False, "PushRefused", f"{ready['message']}; {why}", now)
    return {**status, "conditions": [new if c is ready else c for c in status["conditions"]]}


def invalid_pool_status(status: dict[str, Any], generation: int, message: str, *, now: str,
                        held: list[str] | tuple[str, ...] = (), shared_pods: dict[str, str] | None = None
                        ) -> dict[str, Any]:
    """A pool spec the operator cannot parse: Ready False naming the field, for this generation. ``held``: the
    pods it still owns (nothing is pushed to them, and no other pool takes them over, until the spec is fixed);
    ``shared_pods``: pods it selects that an earlier pool owns (pod -> owner), as a valid pool reports them.
    The counts a valid pool's pass writes (``pool_status``) are removed (None, in a merge patch): no pass counts
    them while the spec is invalid, and the last valid one's would stand for ever."""
    if held:
        message += (f"; its spec.workerSelector still holds {', '.join(held)}: left as they are, and taken over "
                    f"by no other LoRAPool, until the spec is fixed")
    if shared_pods:
        message += _shared_text(shared_pods)
    return {"observedGeneration": generation, "readyWorkers": None, "adapters": None, "kvUsage": None,
            "conditions": [condition(status, "Ready", False, "InvalidSpec", message, now)]}


def _shared_text(shared_pods: dict[str, str]) -> str:
    return "; spec.workerSelector also matches " + ", ".join(
        f"{pod} (owned by LoRAPool {owner!r})" for pod, owner in sorted(shared_pods.items()))

"""Which pool owns a worker pod that several pools' selectors match, and which pods a pool released.

Pure: pools come as their bodies (from the index), pods as the slim bodies discovery keeps. The rule
(``own_pods``) is by name; a pool's ``status.pushedPods`` says which pods it pushed to (push_record.py), so
an invalid pool is known to hold a pod only where it pushed to it before its spec went bad. A pool claims only
the pods it may reach (worker_trust.py: those its spec.workerDeployment made, where it names one), so a pod
that two pools select, and only the later may reach, is that one's: the earlier would never push to it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lorafleet.operator.crd_models import PoolSpec, SpecError, pool_selector
from lorafleet.operator.push_record import pushed_pod_ids
from lorafleet.operator.worker_trust import made_by, replicaset_index, worker_deployment
from lorafleet.operator.workers import discover_workers, selector_matches


@dataclass(slots=True, frozen=True)
class Claim:
    """Another live pool's claim on the pods its selector matches."""

    name: str
    selector: dict[str, Any]
    is_valid: bool  # its spec parses: it pushes its own set to the pods it owns
    pushed: frozenset[tuple[str, str]]  # (name, uid) of the pods its status.pushedPods lists
    deployment: str | None = None  # its spec.workerDeployment: it may reach only the pods that one made
    made: Mapping[tuple[str, str], str | None] = field(default_factory=dict, compare=False)  # ReplicaSets

    def reaches(self, pod: dict[str, Any]) -> bool:
        """Whether this pool may reach ``pod`` (worker_trust.py): one it may not, it never pushes to."""
        return self.deployment is None or made_by(pod, self.deployment, self.made) is None


def ready_worker_pods(pool: PoolSpec, pods: Iterable[dict[str, Any]], other_pools: Iterable[dict[str, Any]],
                      replicasets: Iterable[dict[str, Any]] = ()) -> tuple[list[str], dict[str, str], set[str]]:
    """(names of the pool's ready worker pods, as a reconcile pass finds them (sorted); the ready pods its
    selector matches that another pool owns -> that pool; the names of its own pods that are not ready
    workers yet: pending, starting, failing their probes; not terminating or ended). ``replicasets``: the
    namespace's, as worker_trust.slim_replicaset has them."""
    pods = list(pods)
    own, shared = own_pods(pool.name, pool.worker_selector, pods, pool_claims(other_pools, replicasets))
    ready = discover_workers(own + [p for p in pods if (p.get("metadata") or {}).get("name", "") in shared],
                             pool.worker_selector, default_port=pool.stager_port)
    mine = [w.pod for w in ready if w.pod not in shared]
    # Not terminating, not ended (an evicted pod stays Failed until deleted): replicas that may become ready.
    pending = [p for p in own if not (p.get("metadata") or {}).get("deletionTimestamp")
               and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")]
    return mine, {w.pod: shared[w.pod] for w in ready if w.pod in shared}, set(pod_names(pending)) - set(mine)


def invalid_pool_claim(body: dict[str, Any], pods: Iterable[dict[str, Any]], other_pools: Iterable[dict[str, Any]],
                       replicasets: Iterable[dict[str, Any]] = ()) -> tuple[list[str], dict[str, str]]:
    """(names of the pods a pool whose spec is invalid holds, pod -> the earlier pool that owns each other pod
    it selects), by the rule of ``own_pods``; nothing when its spec.workerSelector is invalid too."""
    selector = pool_selector(body)
    if selector is None:
        return [], {}
    name = (body.get("metadata") or {}).get("name", "")
    own, shared = own_pods(name, selector, list(pods), pool_claims(other_pools, replicasets))
    return sorted(pod_names(own)), shared


def own_pods(name: str, selector: dict[str, Any] | None, pods: list[dict], claims: list[Claim], *,
             draining: bool = False) -> tuple[list[dict], dict[str, str]]:
    """(the pods pool ``name`` owns among those its ``selector`` matches, pod -> owner of each of the others).

    A pod matched by several live pools that may reach it (``Claim.reaches``) belongs to the one whose name
    sorts first; the others leave it alone and report it (each push is a pod's whole adapter set, so two owners
    would undo each other).
    A pool whose spec is invalid keeps its place in that order: it pushes nothing, so the pods it owns
    stay as they are, but no pool after it takes them over (a typo in one pool's spec must not hand its
    workers to another pool that happens to match them); its status names the pods it holds. If its
    spec.workerSelector is invalid too, it holds nothing: which pods it meant is unknown (it still reaches
    the pods it pushed to that no other pool selects, to unload adapters being deleted: controller.py). A pod
    a later pool pushed to before such a pool came to select it is emptied by that later pool
    (``released_pods``).

    A ``draining`` (deleting) pool hands each pod over to the live pool that owns it next when that pool
    pushes its own set (a valid spec) or sorts before this one (an invalid spec); it empties the rest, so no
    adapter of a deleted pool is left behind on a pod nobody pushes to. One whose spec.workerSelector is invalid
    owns no pod: the pods it pushed to are its released pods, handed over by the rule of ``released_pods``.
    ``selector`` None (no pool to act for): every pod, as given.
    """
    if selector is None:
        return pods, {}
    own, shared = [], {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        if not selector_matches(selector, labels):
            continue
        claim = first_claim(pod, claims)
        if claim is not None and (claim.name < name or (draining and claim.is_valid)):
            shared[meta.get("name", "")] = claim.name
        else:
            own.append(pod)
    return own, shared


def released_pods(name: str, remembered: set[tuple[str, str]], pods: list[dict], own: set[str],
                  claims: list[Claim]) -> list[dict]:
    """The pods pool ``name`` pushed to (``remembered``: (name, uid)) that still exist, that it does not own now
    (``own``: their names) and that no other pool takes over as they are.

    A pod it pushed to is taken over by the first live pool by name that selects it when that pool pushes its
    own set (a valid spec), or when its spec is invalid, sorts before ``name`` and pushed to the pod itself
    before (its status.pushedPods). The rest are emptied, so none keeps adapters that no pool pushes to: a
    pod that left the pool, and one an earlier pool with an invalid spec came to select (it owns the pod by
    name, but pushes nothing, and what the pod holds is this pool's). A pod that is gone is simply not here.
    """
    released = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        pod_id = (meta.get("name", ""), meta.get("uid") or "")
        if pod_id not in remembered or pod_id[0] in own:
            continue
        claim = first_claim(pod, claims)
        if claim is None or not (claim.is_valid or (claim.name < name and pod_id in claim.pushed)):
            released.append(pod)
    return released


def pool_claims(other_pools: Iterable[dict[str, Any]], replicasets: Iterable[dict[str, Any]] = ()) -> list[Claim]:
    """The claims of the live pools whose selector parses, by name: parsed once a pass. ``replicasets``: the
    namespace's (worker_trust.slim_replicaset), which say which pods a pool naming its Deployment may reach."""
    made = replicaset_index(replicasets)
    claims = []
    for body in other_pools:
        meta = body.get("metadata") or {}
        other_selector = pool_selector(body)
        if other_selector is None or meta.get("deletionTimestamp"):
            continue
        try:
            PoolSpec.parse(body)
            is_valid = True
        except SpecError:
            is_valid = False
        claims.append(Claim(meta.get("name", ""), other_selector, is_valid,
                            frozenset(pushed_pod_ids(body.get("status"))), worker_deployment(body), made))
    return sorted(claims, key=lambda c: c.name)


def first_claim(pod: dict[str, Any], claims: list[Claim]) -> Claim | None:
    """The first other pool by name whose selector matches ``pod`` and that may reach it."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return next((c for c in claims if selector_matches(c.selector, labels) and c.reaches(pod)), None)


def pod_names(pods: Iterable[dict[str, Any]]) -> list[str]:
    return [(p.get("metadata") or {}).get("name", "") for p in pods]

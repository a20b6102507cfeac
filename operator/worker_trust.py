"""Which of the pods a pool's workerSelector matches the operator may talk to: those its worker Deployment made.

Every request to a sidecar (state read, push) carries the stager token, the same for every sidecar, and a
selector is only labels: anyone who may create a pod in the namespace could give one the labels and collect
the token. So a pool that names its worker Deployment (``spec.workerDeployment``) reaches only the pods whose
controller is a ReplicaSet of that Deployment: the ReplicaSet as the operator's index has it, by name and uid,
controlled by a Deployment of that name. The rest are left out of the pool's pass (never read, or pushed its
set), and logged once each; but those the pool pushed to before, under an earlier spec.workerDeployment (or
none), had the token already: known by (name, uid) in its push record, they are emptied like any pod it
released (controller.py), else they would keep serving what it pushed. ``spec.scaling.target`` is not read
here: a pool's workers may run in several Deployments with the same labels (one per GPU type), of which it
scales one.

A pod's ownerReferences are written by whoever creates it, so this does not stop one who forges them; but
the ReplicaSet controller counts such a pod among its replicas and deletes the surplus, an unscheduled new
pod first, so it rarely lives to be ready (only ready pods are pushed to). A pool that names no Deployment
reaches every pod its selector matches, as before; it is logged once that it does. Which pool owns a pod that
several select counts only the pools that may reach it (ownership.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from lorafleet.operator.crd_models import pool_selector
from lorafleet.operator.workers import selector_matches

if TYPE_CHECKING:  # controller.py imports ownership.py, which imports this
    from lorafleet.operator.controller import PoolKey

log = logging.getLogger(__name__)


def worker_deployment(body: dict[str, Any]) -> str | None:
    """The Deployment a pool's workers must come from: ``spec.workerDeployment``; None where it names none.
    Read from the body, valid or not: an invalid pool's pass still reaches its pods to unload deleted adapters.
    A value that is not a name ("" where not a string) matches no pod."""
    name = (body.get("spec") or {}).get("workerDeployment")
    if name is None:
        return None
    return name if isinstance(name, str) else ""


def slim_replicaset(body: dict[str, Any]) -> dict[str, Any]:
    """What the check needs of a ReplicaSet (the index holds this): its name, uid and controlling Deployment."""
    meta = body.get("metadata") or {}
    owner = _controller(meta)
    deployment = owner.get("name") if owner and owner.get("kind") == "Deployment" else None
    return {"name": meta.get("name"), "uid": meta.get("uid"), "deployment": deployment}


def replicaset_index(replicasets: Iterable[dict[str, Any]]) -> dict[tuple[str, str], str | None]:
    """(name, uid) -> controlling Deployment, of the slim ReplicaSets (``slim_replicaset``) the index holds."""
    return {(rs["name"], rs["uid"]): rs["deployment"] for rs in replicasets}


def _controller(meta: dict[str, Any]) -> dict[str, Any] | None:
    return next((ref for ref in meta.get("ownerReferences") or [] if ref.get("controller")), None)


def made_by(
    pod: dict[str, Any], deployment: str, replicasets: dict[tuple[str, str], str | None]
) -> str | None:
    """None when ``deployment`` made the pod, through a ReplicaSet it controls (``replicasets``: (name, uid) ->
    controlling Deployment); else the pod's controller, as it is."""
    owner = _controller(pod.get("metadata") or {})
    if owner is None:
        return "none"
    named = f"{owner.get('kind')} {owner.get('name')!r}"
    if owner.get("kind") != "ReplicaSet":
        return named
    rs = (owner.get("name"), owner.get("uid"))
    if rs not in replicasets:
        return f"{named}, not known under uid {owner.get('uid')!r}"
    if replicasets[rs] != deployment:
        return (
            f"{named} of Deployment {replicasets[rs]!r}" if replicasets[rs] else f"{named}, of no Deployment"
        )
    return None


def made_elsewhere(pod: dict[str, Any], deployment: str, replicasets: dict[tuple[str, str], str | None]) -> bool:
    """Whether a controller other than ``deployment`` made the pod, as far as is known (``replicasets``: (name,
    uid) -> controlling Deployment): a pod with no controller, or of a ReplicaSet not known yet (a rollout's
    newest), is not counted."""
    owner = _controller(pod.get("metadata") or {})
    if owner is None:
        return False
    if owner.get("kind") != "ReplicaSet":
        return True
    rs = (owner.get("name"), owner.get("uid"))
    return rs in replicasets and replicasets[rs] != deployment


def trusted_pods(
    body: dict[str, Any], pods: Iterable[dict[str, Any]], replicasets: Iterable[dict[str, Any]]
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """(the pods pool ``body`` may reach, pod name -> its controller for each pod its selector matches that it
    may not reach)."""
    pods = list(pods)
    deployment = worker_deployment(body)
    if deployment is None:
        return pods, {}
    made = replicaset_index(replicasets)
    selector = pool_selector(body)
    trusted, skipped = [], {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        why = made_by(pod, deployment, made)
        if why is None:
            trusted.append(pod)
        elif selector is not None and selector_matches(selector, meta.get("labels") or {}):
            skipped[meta.get("name", "")] = why
    return trusted, skipped


class WorkerTrust:
    """``trusted_pods`` for each pool's pass, logging each pod it leaves out once (while it is left out), and
    once that a pool names no Deployment."""

    def __init__(self) -> None:
        self._skipped: dict[PoolKey, set[tuple[str, str]]] = {}  # (pod, uid) left out at the last pass
        self._reasons: dict[PoolKey, tuple[str, dict[str, str], bool]] = {}  # (deployment, pod -> why, RS seen)
        self._open: set[PoolKey] = set()  # pools that name no Deployment, as logged

    def admit(
        self,
        key: PoolKey,
        pools: Iterable[dict[str, Any]],
        pods: Iterable[dict[str, Any]],
        replicasets: Iterable[dict[str, Any]],
    ) -> list[dict[str, Any]]:
        """The pods pool ``key`` (``pools``: its bodies, live or deleting) may reach; none without a pool."""
        body = next(iter(pools), None)
        if body is None:
            return []
        pods, replicasets = list(pods), list(replicasets)
        trusted, skipped = trusted_pods(body, pods, replicasets)
        deployment = worker_deployment(body)
        self._reasons[key] = (deployment or "", skipped, bool(replicasets))
        if deployment is None and key not in self._open:
            self._open.add(key)
            log.warning(
                "LoRAPool %s/%s names no worker Deployment: every pod its workerSelector matches is sent the "
                "stager token; set spec.workerDeployment to the Deployment that runs its workers to reach only "
                "the pods it made (spec.scaling.target does not count: a pool's workers may run in several "
                "Deployments)",
                *key,
            )
        elif deployment is not None:
            self._open.discard(key)
        uids = {
            (p.get("metadata") or {}).get("name", ""): (p.get("metadata") or {}).get("uid") or ""
            for p in pods
        }
        now = {(name, uids.get(name, "")) for name in skipped}
        for pod, _ in sorted(now - self._skipped.get(key, set())):
            log.warning(
                "LoRAPool %s/%s: pod %s matches spec.workerSelector, but its controller (%s) is no ReplicaSet of "
                "Deployment %r (spec.workerDeployment): it is sent nothing, the stager "
                "token included (but for an empty adapter set, where the pool pushed to this pod before)",
                *key,
                pod,
                skipped[pod],
                deployment,
            )
        self._skipped[key] = now
        return trusted

    def left_out(self, key: PoolKey) -> str | None:
        """For the pool's Ready condition: the pods its selector matches that its last pass left out, and why;
        None when there are none."""
        deployment, skipped, replicasets_seen = self._reasons.get(key, ("", {}, True))
        if not skipped:
            return None
        pods = ", ".join(f"{pod} ({why})" for pod, why in sorted(skipped.items()))
        text = (f"spec.workerSelector also matches pods that are no ReplicaSet's of Deployment {deployment!r} "
                f"(spec.workerDeployment), sent nothing: {pods}")
        if not replicasets_seen:
            text += ("; the operator sees no ReplicaSet in this namespace: its role needs get, list and watch "
                     "on apps/replicasets")
        return text

    def forget(self, key: PoolKey) -> None:
        self._skipped.pop(key, None)
        self._reasons.pop(key, None)
        self._open.discard(key)

    def retain(self, keys: set[PoolKey]) -> None:
        """Keep the memory of these pools only (the live ones)."""
        for key in (set(self._skipped) | set(self._reasons) | self._open) - keys:
            self.forget(key)

"""What one reconcile pass knows of a worker pod: its sidecar's report and the operator's last push."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from lorafleet.worker.directives import AdapterDirective, AdapterState, DesiredState, ReportedState


@dataclass(slots=True)
class WorkerReport:
    """One ready worker pod as seen this round."""

    pod: str
    reported: ReportedState | None  # None: its sidecar did not answer this round
    last_pushed: DesiredState | None = None  # operator memory (push_record.py); None: none accepted known
    may_retry: bool = True  # the backoff allows re-pushing versions it reported as failed
    # Its last answer, while its sidecar has been silent for less than the grace (controller.py): the warm
    # copies it keeps stay placed there, rather than moving away and back for one missed answer.
    last_answer: ReportedState | None = None


@dataclass(slots=True)
class WorkerIndex:
    """One live worker's report and last push, indexed once per pass (lookups stay O(1) per adapter)."""

    w: WorkerReport
    by_name: dict[str, list[AdapterState]]
    pushed: dict[str, AdapterDirective]

    @classmethod
    def of(cls, w: WorkerReport) -> WorkerIndex:
        by_name: dict[str, list[AdapterState]] = defaultdict(list)
        for st in w.reported.adapters:
            by_name[st.name].append(st)
        return cls(w, dict(by_name), w.last_pushed.by_name() if w.last_pushed else {})

    @property
    def pod(self) -> str:
        return self.w.pod

    def find(self, name: str, version: str) -> AdapterState | None:
        return next((st for st in self.by_name.get(name, ()) if st.version == version), None)

    def failed_versions(self, directives: list[AdapterDirective], *, retrying: bool = True) -> list[str]:
        """``name@version`` of each desired version this worker reports an error for (staging or loading).
        ``retrying``: with those its stager is staging again (``staging``, the last error standing until the
        retry ends): failing still (the retry backoff goes on), yet not to re-push, which would supersede the
        retry."""
        return [f"{d.name}@{v}" for d in directives for v in d.versions
                if (st := self.find(d.name, v)) is not None and st.error and (retrying or not st.staging)]

    def split_drifted(self, d: AdapterDirective) -> bool:
        """The push applied and every version `d` names is on the GPU without error and serves its users, yet this
        worker sends them elsewhere than `d` says: a leftover version with a share, or other shares. Nothing but a
        re-push corrects that. A version still loading, failing, staging, or held only for requests in flight (no
        share yet: a rollback to it being staged again) leaves its users elsewhere legitimately."""
        wanted = {d.stable.version: 100 - d.canary_weight} | ({d.canary.version: d.canary_weight} if d.canary else {})
        for version, share in wanted.items():
            st = self.find(d.name, version)
            if st is None or st.tier != "gpu" or st.error is not None or st.staging or st.traffic_percent is None \
                    or share and not st.traffic_percent:
                return False
        return any(st.traffic_percent is not None and st.traffic_percent != wanted.get(st.version, 0)
                   for st in self.by_name.get(d.name, ()))

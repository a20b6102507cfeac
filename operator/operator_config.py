"""The operator process's one config dataclass; flags and LORAFLEET_* env vars are generated from it."""

from __future__ import annotations

from dataclasses import dataclass, field

from lorafleet.operator.prometheus_allowlist import PrometheusAllowlist


@dataclass(slots=True)
class OperatorConfig:
    namespace: str | None = field(default=None, metadata={"help": "watch one namespace (default: all)"})
    interval: float = field(default=10.0, metadata={"help": "seconds between drift checks of every pool"})
    scale_interval: float = field(default=30.0, metadata={
        "help": "seconds between autoscaler passes over every pool with spec.scaling"})
    prometheus_urls: tuple[str, ...] = field(default=(), metadata={
        "help": "the Prometheus servers a pool's spec.scaling.prometheusURL may name, as scheme://host:port, "
                "comma-separated (any path on one is allowed); empty: none, and no pool is autoscaled"})
    rank_pods: bool = field(default=False, metadata={
        "help": "before a scale-down, set the worker pods' pod-deletion-cost so that the ReplicaSet removes those "
                "holding no pinned copy first (needs patch on pods)"})
    retry_delay: float = field(default=2.0, metadata={"help": "seconds before a recoverable step is retried"})
    stager_token: str = field(default="", metadata={
        "help": "bearer token of the worker sidecars (from a Secret; required, >= 16 chars as the stager requires)"})
    request_timeout: float = field(default=5.0, metadata={
        "help": "seconds for one sidecar state read, Prometheus query or Kubernetes API call"})
    push_timeout: float = field(default=300.0, metadata={
        "help": "seconds for one directive push (the sidecar answers once what needs no download is applied; "
                "its first push since it started, once staged)"})
    unload_grace: float = field(default=300.0, metadata={
        "help": "seconds a deleted adapter's finalizer waits for a worker pod that cannot be told to unload it (its "
                "sidecar does not answer); after that the object goes, a warning event names the pod, and the pod is "
                "told its pool's adapters once it answers"})
    peering: str | None = field(default=None, metadata={
        "help": "KopfPeering name for leader election when the operator runs replicated (unset: standalone)"})
    peering_priority: int | None = field(default=None, metadata={
        "help": "this replica's peering priority; unset: random. Kopf pauses every replica that sees one of the "
                "same priority, so identical replicas must not share one"})
    liveness_port: int = field(default=8080, metadata={"help": "port of the /healthz liveness endpoint (0: off)"})
    liveness_host: str = field(default="0.0.0.0", metadata={
        "help": "address the liveness endpoint listens on: 0.0.0.0 (IPv4 pods), :: (IPv6-only pods)"})

    def __post_init__(self) -> None:
        if self.interval <= 0:
            raise ValueError(f"interval must be > 0 seconds (got {self.interval})")
        if self.scale_interval <= 0:
            raise ValueError(f"scale_interval must be > 0 seconds (got {self.scale_interval})")
        if self.retry_delay <= 0:
            raise ValueError(f"retry_delay must be > 0 seconds (got {self.retry_delay})")
        if self.request_timeout <= 0:
            raise ValueError(f"request_timeout must be > 0 seconds (got {self.request_timeout})")
        if self.push_timeout <= 0:
            raise ValueError(f"push_timeout must be > 0 seconds (got {self.push_timeout})")
        if self.unload_grace <= 0:
            raise ValueError(f"unload_grace must be > 0 seconds (got {self.unload_grace})")
        PrometheusAllowlist(self.prometheus_urls)  # raises ValueError naming a malformed entry
        if not 0 <= self.liveness_port < 65536:
            raise ValueError(f"liveness_port must be a TCP port or 0 (got {self.liveness_port})")
        if len(self.stager_token) < 16:  # every stager refuses a shorter one (worker/stager_config.py)
            raise ValueError("stager_token must be at least 16 characters, the sidecars' token "
                             "(set LORAFLEET_STAGER_TOKEN)")

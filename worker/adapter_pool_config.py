"""AdapterPoolConfig: the adapter pool's budgets and policies; TenantQuota: one tenant's GPU share."""

from __future__ import annotations

from dataclasses import dataclass, field

from lorafleet.worker.eviction import make_policy


@dataclass(slots=True)
class TenantQuota:
    """Most adapters / bytes one tenant may hold on the GPU at once (None = no limit)."""

    max_adapters: int | None = None
    max_bytes: int | None = None

    def exceeded(self, count: int, nbytes: int) -> bool:
        return (self.max_adapters is not None and count > self.max_adapters) or (
            self.max_bytes is not None and nbytes > self.max_bytes)


@dataclass(slots=True)
class AdapterPoolConfig:
    max_slots: int = 64  # adapters resident on the GPU at once
    max_rank: int = 64
    cpu_budget_bytes: int = 4 << 30  # warm tier
    eviction_policy: str = "lru"  # lru | lfu | cost
    num_load_threads: int = 2
    # More threads, each for a request's load of a tenant with no load running (fair_executor.py): one
    # tenant's slow reads never hold another's request.
    spare_load_threads: int = 8
    tenant_quotas: dict[str, TenantQuota] = field(default_factory=dict)
    default_quota: TenantQuota = field(default_factory=TenantQuota)
    pin_cpu: bool | None = None  # pinned CPU tier; None = when the pool lives on a CUDA device
    load_timeout_s: float | None = 300.0  # a disk/stager load still running after this fails its waiters
    # CUDA workers: intra-op CPU threads of each loader thread (None = torch's default). Measured on an
    # H200 (bench/adapter_pool.py --only decode): limiting to 1 made loads longer and the step loop slower.
    loader_cpu_threads: int | None = None
    # Versions a directive keeps warm come back into free room after pressure evicted them, looked for
    # this often (worker/adapter_warmth.py); a failed load waits warm_retry_s, doubling per failure in a row.
    warm_check_s: float = 0.5
    warm_retry_s: float = 5.0

    def __post_init__(self) -> None:
        if self.max_slots <= 0 or self.max_rank <= 0:
            raise ValueError(f"max_slots ({self.max_slots}) and max_rank ({self.max_rank}) must be > 0")
        if self.num_load_threads <= 0 or self.spare_load_threads < 0:
            raise ValueError(f"need num_load_threads > 0 ({self.num_load_threads}) and spare_load_threads >= 0 "
                             f"({self.spare_load_threads})")
        if self.cpu_budget_bytes < 0:
            raise ValueError("cpu_budget_bytes must be >= 0")
        if self.load_timeout_s is not None and self.load_timeout_s <= 0:
            raise ValueError("load_timeout_s must be > 0 or None")
        if self.warm_check_s < 0 or self.warm_retry_s <= 0:
            raise ValueError(f"need warm_check_s >= 0 ({self.warm_check_s}) and warm_retry_s > 0 ({self.warm_retry_s})")
        make_policy(self.eviction_policy)  # validates the name

    def quota(self, tenant: str) -> TenantQuota:
        return self.tenant_quotas.get(tenant, self.default_quota)

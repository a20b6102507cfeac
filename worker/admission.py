"""Admission: how many sequences the worker holds at once (running batch + queue); more -> 429.

Counted in the HTTP layer, before a request reaches the engine, so a burst is refused at once
with `Retry-After` instead of growing an unbounded queue that only times out later.

An optional per-tenant cap keeps one tenant from filling the whole queue: with capacity 8 and
`max_per_tenant` 3, acme holding 3 sequences is refused its 4th while globex may still take 3. Where several
tenants have keys (`shared`), one tenant holds at most three quarters of the capacity whatever the cap says
(`tenant_share`): without one, two requests of n=256 and n=64 filled a worker of 320 and every other
tenant got 429 until they ended. Tenants are counted only while they hold sequences, so the table never
outgrows the tenants in flight.

Intake (reading a body, parsing it, tokenizing) comes before a request's sequences are known; it is
bounded apart: at most `max_intake` requests at once (worker/intake.py refuses the rest with 429). With the
per-tenant cap, a tenant's requests in intake count against it too (each will need a sequence at least), so
one tenant cannot hold every intake place, with bodies it sends slowly, and lock the others out.
"""

from __future__ import annotations

QUEUE_FULL = "queue_full"  # the worker holds `capacity` sequences
TENANT_QUEUE_FULL = "tenant_queue_full"  # the tenant holds `max_per_tenant` sequences
INTAKE_FULL = "intake_full"  # `max_intake` requests are being read, parsed or tokenized
TENANT_INTAKE_FULL = "tenant_intake_full"  # the tenant's requests in intake reach its share of the places
REQUEST_TIMEOUT = "request_timeout"  # a body that came too slowly (worker/intake.py)


def tenant_share(places: int) -> int:
    """The most of `places` one tenant may hold where several share them: all but a quarter, at least one left
    to the others (0: no cap, with a single place)."""
    return places - max(1, places // 4) if places > 1 else 0


class Admission:
    def __init__(self, capacity: int, max_per_tenant: int = 0, max_intake: int = 0) -> None:
        if capacity < 1:
            raise ValueError(f"admission capacity must be >= 1, got {capacity}")
        if max_per_tenant < 0:
            raise ValueError(
                f"admission max_per_tenant must be >= 0 (0 = no per-tenant limit), got {max_per_tenant}"
            )
        if max_intake < 0:
            raise ValueError(f"admission max_intake must be >= 0 (0 = no limit), got {max_intake}")
        self.capacity = capacity
        self.max_per_tenant = max_per_tenant  # 0 = no per-tenant limit
        self.num_admitted = 0  # sequences admitted and not yet released
        self.num_admitted_by_tenant: dict[str, int] = {}  # tenant -> its share of num_admitted; no zeros
        self.num_refused = 0
        self.max_intake = max_intake  # requests in intake at once; 0 = no limit
        self.num_in_intake = 0
        self.num_in_intake_by_tenant: dict[str, int] = {}  # tenant -> its requests in intake; no zeros
        # Where several tenants have keys (`shared`), one tenant's requests being read leave a quarter of the
        # places to the others, whatever --max-sequences-per-tenant says: its slow bodies cannot hold them all.
        self.intake_share = tenant_share(max_intake)
        self.tenant_share = tenant_share(capacity)  # the same, of sequences

    def tenant_cap(self, shared: bool = False) -> int:
        """The most sequences one tenant may hold (0: no cap): `max_per_tenant`, and with `shared` (several
        tenants) at most `tenant_share`."""
        caps = [c for c in (self.max_per_tenant, self.tenant_share if shared else 0) if c]
        return min(caps) if caps else 0

    def max_seqs_per_request(self, shared: bool = False) -> int:
        """The most sequences one request can ever be admitted with; a larger one never fits."""
        return min(self.capacity, cap) if (cap := self.tenant_cap(shared)) else self.capacity

    def never_fits(self, num_seqs: int, shared: bool = False) -> str | None:
        """Why a request of `num_seqs` sequences can never be admitted, however idle the worker gets (retrying
        cannot help), or None. Known from the request's prompts and n alone, before any is built."""
        if num_seqs <= (most := self.max_seqs_per_request(shared)):
            return None
        where = f"runs at most {most}" if most == self.capacity else f"admits at most {most} per tenant"
        return (f"this request needs {num_seqs} sequences (prompts x n); the worker {where} at once. Lower n or "
                f"send fewer prompts.")

    def refusal(self, num_seqs: int, tenant: str, shared: bool = False) -> str | None:
        """Why `num_seqs` more sequences of `tenant` do not fit now (TENANT_QUEUE_FULL, QUEUE_FULL), or None.

        The tenant's own cap is named first: while it holds, a retry fails however idle the worker gets.
        """
        if (cap := self.tenant_cap(shared)) and self.num_admitted_by_tenant.get(tenant, 0) + num_seqs > cap:
            return TENANT_QUEUE_FULL
        if self.num_admitted + num_seqs > self.capacity:
            return QUEUE_FULL
        return None

    def can_admit(self, num_seqs: int, tenant: str, shared: bool = False) -> bool:
        return self.refusal(num_seqs, tenant, shared) is None

    def early_refusal(self, tenant: str, shared: bool = False) -> str | None:
        """`refusal(1, tenant)`, counted as a refusal when there is one: not even one more sequence fits."""
        reason = self.refusal(1, tenant, shared)
        if reason:
            self.num_refused += 1
        return reason

    def admit(self, num_seqs: int, tenant: str, shared: bool = False) -> bool:
        """Take room for `num_seqs` sequences of `tenant`; False (and nothing taken) when the worker's
        queue or the tenant's share of it is full (`refusal` says which)."""
        _check_positive(num_seqs)
        if not self.can_admit(num_seqs, tenant, shared):
            self.num_refused += 1
            return False
        self.num_admitted += num_seqs
        self.num_admitted_by_tenant[tenant] = self.num_admitted_by_tenant.get(tenant, 0) + num_seqs
        return True

    def intake_refusal(self, tenant: str = "", sequences: bool = True, shared: bool = False) -> str | None:
        """Why one more request of `tenant` may not enter intake now (None: it may): INTAKE_FULL, all places are
        taken; TENANT_QUEUE_FULL, the tenant's sequences admitted and requests in intake reach its cap (with
        `sequences` False, a request that will need none, /tokenize: its requests in intake alone); or, with
        `shared` (several tenants), TENANT_INTAKE_FULL, it reads its share of the places already."""
        reading = self.num_in_intake_by_tenant.get(tenant, 0)
        held = self.tenant_load(tenant) if sequences else reading
        if (cap := self.tenant_cap(shared)) and held >= cap:
            return TENANT_QUEUE_FULL
        if self.max_intake and self.num_in_intake >= self.max_intake:
            return INTAKE_FULL
        if shared and self.intake_share and reading >= self.intake_share:
            return TENANT_INTAKE_FULL
        return None

    def enter_intake(self, tenant: str = "", sequences: bool = True, shared: bool = False) -> str | None:
        """Take an intake place for one request of `tenant`; else (nothing taken) why not (intake_refusal)."""
        if reason := self.intake_refusal(tenant, sequences, shared):
            self.num_refused += 1
            return reason
        self.num_in_intake += 1
        self.num_in_intake_by_tenant[tenant] = self.num_in_intake_by_tenant.get(tenant, 0) + 1
        return None

    def tenant_load(self, tenant: str) -> int:
        """`tenant`'s sequences admitted and requests in intake."""
        return self.num_admitted_by_tenant.get(tenant, 0) + self.num_in_intake_by_tenant.get(tenant, 0)

    def leave_intake(self, tenant: str = "") -> None:
        if self.num_in_intake < 1:
            raise ValueError("leaving intake but no request is in it")
        self.num_in_intake -= 1
        held = self.num_in_intake_by_tenant.pop(tenant, 0)
        if held > 1:
            self.num_in_intake_by_tenant[tenant] = held - 1

    def release(self, num_seqs: int, tenant: str) -> None:
        _check_positive(num_seqs)
        held = self.num_admitted_by_tenant.get(tenant, 0)
        if num_seqs > held:
            raise ValueError(
                f"releasing {num_seqs} sequences of tenant {tenant!r} but only {held} are admitted"
            )
        self.num_admitted -= num_seqs
        if held == num_seqs:
            del self.num_admitted_by_tenant[tenant]  # no entry per tenant ever seen
        else:
            self.num_admitted_by_tenant[tenant] = held - num_seqs


def _check_positive(num_seqs: int) -> None:
    if num_seqs < 1:  # a request has at least one sequence; 0 would leave a zero entry behind
        raise ValueError(f"num_seqs must be >= 1, got {num_seqs}")

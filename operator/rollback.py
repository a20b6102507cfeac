"""A canary's rollback in an edit that is refused for something else.

An edit that fails a check (a mistyped sha256, a field the CRD of the day does not validate, a tenant over
its quota) keeps the last valid spec in force. Its canary part may be the one thing that must not wait: a
canary going wrong is stopped by setting its weight to 0, or lowered, or removed, often in a hurry, and a
typo elsewhere in the same edit kept the canary serving at its old weight. The stager follows the same rule for
staging failures (a weight set to 0 is not undone by a version that fails to stage).

So the held spec takes the edit's canary cut where the edit keeps the same stable version: no canary (removed,
or null), or the same canary version at a lower weight. Nothing else of the edit applies, and nothing that
raises a weight or changes a version: those wait until the edit is valid.

Nor does a cut wait for a typo in the pool: the pods of a pool whose spec is invalid are told nothing else, but
each is told the cuts of what it last accepted (``canary_cuts``; reconcile.py's ``held``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from lorafleet.operator.crd_models import AdapterSpec, InvalidAdapter
from lorafleet.worker.directives import AdapterDirective


def with_rollback(held: AdapterSpec, edit: AdapterSpec | InvalidAdapter) -> AdapterSpec:
    """``held`` (the last valid spec), its canary removed or its weight lowered as the refused ``edit`` asks."""
    if held.canary is None:
        return held
    weight = _cut_weight(edit.raw_spec, held.version, held.canary.version, held.canary.weight)
    if weight is None:
        return dataclasses.replace(held, canary=None)
    return held if weight == held.canary.weight else \
        dataclasses.replace(held, canary=dataclasses.replace(held.canary, weight=weight))


def canary_cuts(directives: Iterable[AdapterDirective],
                specs: Mapping[str, AdapterSpec | InvalidAdapter]) -> list[AdapterDirective]:
    """``directives`` (what a pod last accepted), each canary removed or its weight lowered as its adapter's
    current spec (``specs``, by name) asks; nothing else changes, and an adapter with no spec stays as it is."""
    cut = []
    for d in directives:
        x = specs.get(d.name)
        weight = d.canary_weight if x is None or d.canary is None else \
            _cut_weight(x.raw_spec, d.stable.version, d.canary.version, d.canary_weight)
        cut.append(d if weight == d.canary_weight else
                   dataclasses.replace(d, canary=None if weight is None else d.canary, canary_weight=weight or 0))
    return cut


def _cut_weight(spec: dict[str, Any], version: str, canary_version: str, weight: int) -> int | None:
    """The weight ``spec`` (a spec as written) leaves the canary ``canary_version`` of stable ``version`` at, now
    at ``weight``: lower where it lowers it, None where it removes it (no canary, or null), else ``weight``."""
    if spec.get("version") != version:
        return weight
    canary = spec.get("canary")
    if canary is None:
        return None
    wanted = canary.get("weight") if isinstance(canary, dict) else None
    if (isinstance(canary, dict) and canary.get("version") == canary_version and isinstance(wanted, int)
            and not isinstance(wanted, bool) and 0 <= wanted < weight):
        return wanted
    return weight

"""A canary's rollback in an edit that is refused for something else.

An edit that fails a check (a mistyped sha256, a field the CRD of the day does not validate, a tenant over
its quota) keeps the last valid spec in force. Its canary part may be the one thing that must not wait: a
canary going wrong is stopped by setting its weight to 0, or lowered, or removed, often in a hurry, and a
typo elsewhere in the same edit kept the canary serving at its old weight. The stager follows the same rule for
staging failures (a weight set to 0 is not undone by a version that fails to stage).

So the held spec takes the edit's canary cut where the edit keeps the same stable version: no canary (removed,
or null), or the same canary version at a lower weight. Nothing else of the edit applies, and nothing that
raises a weight or changes a version: those wait until the edit is valid.
"""

from __future__ import annotations

import dataclasses

from lorafleet.operator.crd_models import AdapterSpec, InvalidAdapter


def with_rollback(held: AdapterSpec, edit: AdapterSpec | InvalidAdapter) -> AdapterSpec:
    """``held`` (the last valid spec), its canary removed or its weight lowered as the refused ``edit`` asks."""
    spec = edit.raw_spec
    if held.canary is None or spec.get("version") != held.version:
        return held
    canary = spec.get("canary")
    if canary is None:
        return dataclasses.replace(held, canary=None)
    weight = canary.get("weight") if isinstance(canary, dict) else None
    if (isinstance(canary, dict) and canary.get("version") == held.canary.version and isinstance(weight, int)
            and not isinstance(weight, bool) and 0 <= weight < held.canary.weight):
        return dataclasses.replace(held, canary=dataclasses.replace(held.canary, weight=weight))
    return held

"""Validate an object as the API server would against a CRD of crds/: its OpenAPI schema (jsonschema)
and its CEL rules (``x-kubernetes-validations``, evaluated with cel-python at the node that holds them,
for values that are present)."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[2]


def crd_schema(plural: str) -> dict:
    crd = yaml.safe_load((ROOT / "crds" / f"lorafleet.dev_{plural}.yaml").read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


@functools.lru_cache(maxsize=64)
def _program(rule: str):
    env = celpy.Environment()
    return env.program(env.compile(rule))


def cel_rules(schema: dict, path: str = "") -> list[tuple[str, str]]:
    """(path, rule) of every CEL rule in a schema."""
    found = [(path or ".", r["rule"]) for r in schema.get("x-kubernetes-validations", [])]
    for key, sub in (schema.get("properties") or {}).items():
        found += cel_rules(sub, f"{path}.{key}")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            found += cel_rules(schema[key], f"{path}[*]")
    return found


def check_cel(value: Any, schema: dict, path: str = "") -> None:
    """Raise jsonschema.ValidationError with the rule's message for the first CEL rule ``value`` breaks."""
    for rule in schema.get("x-kubernetes-validations", []):
        if not bool(_program(rule["rule"]).evaluate({"self": celpy.json_to_cel(value)})):
            raise jsonschema.ValidationError(f"{path or '.'}: {rule.get('message', rule['rule'])}")
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key in value:
                check_cel(value[key], sub, f"{path}.{key}")
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in value.keys() - (schema.get("properties") or {}).keys():
                check_cel(value[key], extra, f"{path}.{key}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            check_cel(item, schema["items"], f"{path}[{i}]")


def _go_pattern(validator, pattern: str, instance: Any, schema: dict):
    """`pattern` as the API server matches it, with Go's regexp: there a final `$` is the end of the text, where
    Python's also matches before a final line break (a YAML block scalar's)."""
    if validator.is_type(instance, "string") and not re.search(re.sub(r"(?<!\\)\$$", r"\\Z", pattern), instance):
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


APIServerValidator = jsonschema.validators.extend(jsonschema.Draft202012Validator, {"pattern": _go_pattern})


def validate(doc: dict, plural: str) -> None:
    """The OpenAPI schema first (CEL rules assume its types), then the CEL rules."""
    schema = crd_schema(plural)
    APIServerValidator(schema).validate(doc)
    check_cel(doc, schema)

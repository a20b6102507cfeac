"""Typed access to the fields of a JSON request body, and OpenAI-shaped errors.

Every getter of `Fields` records the field as known, so that `refuse_unknown` can answer the fields
nobody asked for with OpenAI's "Unrecognized request argument" 400; a wrong type or an out-of-range
value is a 400 that names the field.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

from lorafleet.worker.gc_pause import collections_paused


class APIError(Exception):
    """An error answered to the client as `{"error": {"message", "type", "code", "param"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, code=code, param=param)


def parse_json(raw: bytes | str) -> Any:
    """The body's JSON (400 invalid_json when it is none), parsed with the garbage collector paused: a body of a
    million small lists is built with the interpreter lock held, and collections over it were most of the time."""
    try:
        with collections_paused():
            return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:  # e.g. '[' * 50000: deeper than the parser's recursion limit
        raise APIError(400, "request body is not valid JSON: nested too deeply", code="invalid_json") from None


def check_text(v: str, param: str) -> str:
    """`v`, refused when it is not valid Unicode: JSON may carry an unpaired surrogate (`"\\ud800"`),
    which neither the tokenizer nor UTF-8 can encode."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(f"'{param}' is not valid Unicode: it holds an unpaired surrogate (U+{ord(v[exc.start]):04X}); "
                          "send characters beyond U+FFFF as UTF-8 or as a surrogate pair", param,
                          "invalid_unicode") from None
    return v


MAX_DEPTH = 32  # a JSON value the worker walks (chat_template_kwargs, tools): checked, control tokens wrapped


def check_strings(v: Any, param: str, depth: int = 0) -> None:
    """Every string of a JSON value (keys too) valid Unicode (check_text), nested at most MAX_DEPTH deep."""
    if depth > MAX_DEPTH:
        raise bad_request(f"'{param}' is nested deeper than {MAX_DEPTH} levels", param)
    if isinstance(v, str):
        check_text(v, param)
    elif isinstance(v, dict):
        for key, value in v.items():
            check_text(key, param)
            check_strings(value, param, depth + 1)
    elif isinstance(v, list):
        for item in v:
            check_strings(item, param, depth + 1)


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_id_list(v: Any) -> bool:
    """Whether `v` is a list of integers (bools aside), as a JSON body's values can be: one pass in C over the
    items' types (a 2M-id prompt took 0.2 s a check in a Python loop, with the interpreter lock held)."""
    return isinstance(v, list) and set(map(type, v)) <= {int}


def is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


class Fields:
    """Typed access to a request object's fields; every getter records the field as known."""

    def __init__(self, body: Any, what: str) -> None:
        if not isinstance(body, dict):
            raise bad_request(f"the {what} request body must be a JSON object", code="invalid_type")
        self.body = body
        self.seen: set[str] = set()

    def get(self, name: str) -> Any:
        self.seen.add(name)
        return self.body.get(name)

    def integer(self, name: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
        v = self.get(name)
        if v is None:
            return default
        if isinstance(v, float) and math.isfinite(v) and v.is_integer():
            v = int(v)  # 3.0 is 3, as vLLM's parser takes it (a client that builds bodies with floats)
        if not is_int(v):
            raise bad_request(f"'{name}' must be an integer (got {json.dumps(v)})", name, "invalid_type")
        if v < lo or (hi is not None and v > hi):
            bound = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
            raise bad_request(f"'{name}' must be {bound} (got {v})", name)
        return v

    def number(self, name: str, default: float, lo: float, hi: float | None, *, lo_open: bool = False) -> float:
        """hi None: any finite number above lo."""
        v = self.get(name)
        if v is None:
            return default
        if not is_number(v):
            raise bad_request(f"'{name}' must be a number (got {json.dumps(v)})", name, "invalid_type")
        top = sys.float_info.max if hi is None else hi
        if v != v or v > top or v < lo or (lo_open and v == lo):
            bound = f"in ({lo}, {hi}]" if lo_open else f"in [{lo}, {hi}]"
            bound = f"a finite number {'>' if lo_open else '>='} {lo}" if hi is None else bound
            raise bad_request(f"'{name}' must be {bound} (got {v})", name)
        return float(v)

    def flag(self, name: str, default: bool) -> bool:
        v = self.get(name)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise bad_request(f"'{name}' must be true or false (got {json.dumps(v)})", name, "invalid_type")
        return v

    def string(self, name: str, *, required: bool = False) -> str | None:
        v = self.get(name)
        if v is None:
            if required:
                raise bad_request(f"'{name}' is required", name, "missing_required_parameter")
            return None
        if not isinstance(v, str):
            raise bad_request(f"'{name}' must be a string (got {json.dumps(v)})", name, "invalid_type")
        return check_text(v, name)

    def string_map(self, name: str) -> dict[str, str] | None:
        """An object whose values are strings (OpenAI's `metadata`)."""
        v = self.get(name)
        if v is None:
            return None
        if not isinstance(v, dict) or not all(isinstance(x, str) for x in v.values()):
            raise bad_request(f"'{name}' must be an object whose values are strings (got {json.dumps(v)})", name,
                              "invalid_type")
        for key, value in v.items():
            check_text(key, name)
            check_text(value, name)
        return v

    def neutral(self, name: str, neutral: Any, why: str) -> None:
        """Accept a field only at its no-op value; anything else would be silently wrong."""
        v = self.get(name)
        if v is not None and v != neutral:
            raise bad_request(f"'{name}' is not supported by this server ({why})", name, "unsupported_parameter")

    def refuse_unknown(self) -> None:
        unknown = sorted(k for k in set(self.body) - self.seen if self.body[k] is not None)  # null: as left out
        if unknown:
            raise bad_request(f"Unrecognized request argument supplied: {', '.join(unknown)}", unknown[0],
                              "unrecognized_argument")

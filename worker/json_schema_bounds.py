"""Number bounds and string lengths of a JSON Schema (json_schema.py), as the grammar (json_schema_grammar.py)
holds a value to them while it is written.

Bounds (`minimum`, `maximum`, `exclusiveMinimum`, `exclusiveMaximum`; draft 4's boolean exclusives too; and
`multipleOf`) are exact: values and bounds are compared as fractions, a bound written `0.1` is one tenth (0.3
is a multiple of it, which validators dividing doubles may deny). A number under bounds
is written without an exponent (`1e3` is refused, `1000` taken), so that each prefix of it stands for an
interval of values: `12` for 12, 120-129, 1200-1299, ...; `-1.2` for (-1.3, -1.2]. A byte is taken only when
the bounds meet one of its prefix's intervals (hold a multiple of the step, with multipleOf), so a number
once begun can always end inside them.

Lengths (`minLength`, `maxLength`) count characters as JSON Schema does (code points of the decoded string):
a character written as UTF-8 bytes, an escape, or an escaped surrogate pair is one. A `pattern`, or a known
`format` (FORMATS), is a regex_dfa.Regex searched in the text, held to the lengths beside it (regex_length.py).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from lorafleet.worker.regex_dfa import Regex
from lorafleet.worker.regex_grammar import compile_pattern
from lorafleet.worker.regex_length import LengthRegex, length_regex

TYPES = ("string", "number", "integer", "boolean", "null", "object", "array")
BOUND_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
MAX_BOUND = 1.7976931348623157e308
LENGTH_KEYWORDS = ("minLength", "maxLength")


class BoundsError(ValueError):
    """A keyword (a bound, length, count or type) with a value it cannot have (json_schema.py names where)."""


@dataclass(frozen=True, slots=True)
class Bounds:
    """lo/hi: the lowest/highest value (None: unbounded); lo_in/hi_in: whether that value itself is taken; step:
    multipleOf (None: any value)."""

    lo: Fraction | None = None
    lo_in: bool = True
    hi: Fraction | None = None
    hi_in: bool = True
    step: Fraction | None = None

    def takes(self, value: Fraction) -> bool:
        return _meets(self, value, True, value, True)

    def takes_integer(self) -> bool:
        """Whether some integer is inside the bounds."""
        return self._integer_in(*self._integers())

    def _integer_in(self, first: int | None, last: int | None) -> bool:
        """Whether [first, last] (None: unbounded) holds an integer the step takes: a multiple of p where the step
        is p/q in lowest terms (m * p/q is an integer only where q divides m)."""
        if first is None or last is None:
            return True
        if self.step is None:
            return first <= last
        p = self.step.numerator
        return -(-first // p) * p <= last

    def takes_any(self) -> bool:
        return _meets(self, self.lo, True, self.hi, True) if self.lo is not None and self.hi is not None else True

    def _integers(self) -> tuple[int | None, int | None]:
        """The lowest and highest integers inside the bounds (None: unbounded)."""
        first = None if self.lo is None else _ceil(self.lo) + (1 if not self.lo_in and self.lo.denominator == 1 else 0)
        last = None if self.hi is None else _floor(self.hi) - (1 if not self.hi_in and self.hi.denominator == 1 else 0)
        return first, last

    @functools.lru_cache(maxsize=4096)  # noqa: B019 (bounds are few and live as long as their schemas)
    def may_begin(self, text: bytes, integer: bool) -> bool:
        """Whether some number written starting with `text` (a prefix of a JSON number with no exponent: "-",
        "12", "0.", "-3.25") is inside the bounds, an integer when `integer`."""
        negative = text.startswith(b"-")
        body = text[1:] if negative else text
        if not body:  # "-": any value <= 0
            return self._meets_magnitudes(Fraction(0), None, negative=True, integer=integer)
        if b"." in body:  # the digits written so far fix the value to within one unit of the last one
            whole, frac = body.split(b".")
            low = Fraction(int(whole + frac), 10 ** len(frac))
            return self._meets_magnitudes(low, low + Fraction(1, 10 ** len(frac)), negative, integer)
        value = int(body)
        if value == 0:  # "0" takes no more digits: 0, or 0.x when fractions are taken
            return self._meets_magnitudes(Fraction(0), Fraction(1), negative, integer)
        far = self.lo if negative else self.hi  # the bound more digits move toward
        if far is None:
            return True  # more digits grow the magnitude without end, toward an unbounded side
        limit = -far if negative else far
        scale = 1
        while value * scale <= limit:  # value, then value0-value9, value00-value99, ...
            if self._meets_magnitudes(Fraction(value * scale), Fraction((value + 1) * scale), negative, integer):
                return True
            scale *= 10
        return False

    def holds_all(self, text: bytes, integer: bool) -> bool:
        """Whether every number written starting with `text` is inside the bounds (its reader need not keep
        the digits: a long fraction does not make a new state at every digit)."""
        negative = text.startswith(b"-")
        body = text[1:] if negative else text
        if not body:
            return False
        if self.step is not None:
            return False  # a multiple is a point, never a prefix's whole interval
        if b"." in body:
            whole, frac = body.split(b".")
            low = Fraction(int(whole + frac), 10 ** len(frac))
            high = low + Fraction(1, 10 ** len(frac))
        elif int(body) == 0:
            low, high = Fraction(0), Fraction(1)
        else:  # more digits: every magnitude from the one written up
            if (self.lo if negative else self.hi) is not None:
                return False
            low, high = Fraction(int(body)), None
        if negative:
            return _inside(self, None if high is None else -high, False, -low, True)
        return _inside(self, low, True, high, False)

    def _meets_magnitudes(self, low: Fraction, high: Fraction | None, negative: bool, integer: bool) -> bool:
        """Whether the values of magnitude in [low, high) (high None: unbounded), negated when `negative`, meet
        the bounds (integers only when `integer`)."""
        if integer:
            top = None if high is None else _ceil(high) - 1
            span = (-top if top is not None else None, -_ceil(low)) if negative else (_ceil(low), top)
            first, last = self._integers()
            lows = [v for v in (span[0], first) if v is not None]
            highs = [v for v in (span[1], last) if v is not None]
            return self._integer_in(max(lows) if lows else None, min(highs) if highs else None)
        if negative:  # (-high, -low]
            return _meets(self, None if high is None else -high, False, -low, True)
        return _meets(self, low, True, high, False)

    def describe(self) -> str:
        lo = "" if self.lo is None else f"{'>=' if self.lo_in else '>'} {_text(self.lo)}"
        hi = "" if self.hi is None else f"{'<=' if self.hi_in else '<'} {_text(self.hi)}"
        step = "" if self.step is None else f"a multiple of {_text(self.step)}"
        return " and ".join(p for p in (lo, hi, step) if p)


def _meets(b: Bounds, low: Fraction | None, low_in: bool, high: Fraction | None, high_in: bool) -> bool:
    """Whether the interval (low, high) (ends taken where *_in; None: unbounded) meets the bounds."""
    lo, lo_in = _tighter(low, low_in, b.lo, b.lo_in, max)
    hi, hi_in = _tighter(high, high_in, b.hi, b.hi_in, min)
    if lo is None or hi is None:
        return True  # unbounded on a side: values (and multiples of any step) without end there
    if b.step is not None:  # the first multiple of the step at or above lo
        lo = _ceil(lo / b.step) * b.step + (b.step if not lo_in and (lo / b.step).denominator == 1 else 0)
        lo_in = True
    return lo < hi or (lo == hi and lo_in and hi_in)


def _inside(b: Bounds, low: Fraction | None, low_in: bool, high: Fraction | None, high_in: bool) -> bool:
    """Whether the bounds hold the whole interval (low, high) (ends taken where *_in; None: unbounded)."""
    above = b.lo is None or low is not None and (low > b.lo or low == b.lo and (b.lo_in or not low_in))
    below = b.hi is None or high is not None and (high < b.hi or high == b.hi and (b.hi_in or not high_in))
    return above and below


def _tighter(a: Fraction | None, a_in: bool, b: Fraction | None, b_in: bool, pick) -> tuple[Fraction | None, bool]:
    if a is None:
        return b, b_in
    if b is None or a != b:
        return (a, a_in) if b is None or pick(a, b) == a else (b, b_in)
    return a, a_in and b_in


def _ceil(f: Fraction) -> int:
    return -((-f.numerator) // f.denominator)


def _floor(f: Fraction) -> int:
    return f.numerator // f.denominator


def _text(f: Fraction) -> str:
    return str(f.numerator) if f.denominator == 1 else str(float(f))


def as_fraction(value: int | float) -> Fraction:
    """A JSON number's exact value as written: 0.1 is one tenth (not the double nearest it)."""
    return Fraction(value) if isinstance(value, int) else Fraction(repr(value))


def _number(value: Any, name: str) -> Fraction:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BoundsError(f"{name} must be a number")
    if abs(value) > MAX_BOUND:  # a prefix's test walks the bound's digits
        raise BoundsError(f"{name} must be within a double's range (at most {MAX_BOUND:.4g} in magnitude)")
    return as_fraction(value)


def parse_bounds(s: dict) -> Bounds | None:
    """The bounds a schema's keywords set, None when it sets none (BoundsError for a malformed one)."""
    if not any(k in s for k in BOUND_KEYWORDS):
        return None
    lo = hi = None
    lo_in = hi_in = True
    if "minimum" in s:
        lo = _number(s["minimum"], "minimum")
    if "maximum" in s:
        hi = _number(s["maximum"], "maximum")
    step = None
    if "multipleOf" in s:
        step = _number(s["multipleOf"], "multipleOf")
        if step <= 0:
            raise BoundsError("multipleOf must be above 0")
    for name, is_low in (("exclusiveMinimum", True), ("exclusiveMaximum", False)):
        if name not in s:
            continue
        v = s[name]
        if isinstance(v, bool):  # draft 4: makes minimum/maximum exclusive
            if is_low:
                lo_in = lo_in and not v
            else:
                hi_in = hi_in and not v
            continue
        v = _number(v, name)
        if is_low and (lo is None or v >= lo):
            lo, lo_in = v, False
        elif not is_low and (hi is None or v <= hi):
            hi, hi_in = v, False
    return Bounds(lo, lo_in, hi, hi_in, step)


def parse_lengths(s: dict) -> tuple[int, int | None]:
    """(minLength, maxLength) of a schema (0 and None where unset; BoundsError for a malformed one)."""
    return parse_counts(s, "minLength", "maxLength")


def parse_counts(s: dict, low: str, high: str) -> tuple[int, int | None]:
    """(s[low], s[high]): a count's bounds, minItems/maxItems and the like (0 and None where unset; BoundsError
    for a malformed one)."""
    lo, hi = s.get(low, 0), s.get(high)
    for name, v in ((low, lo), (high, hi)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise BoundsError(f"{name} must be an integer >= 0")
    if hi is not None and lo > hi:
        raise BoundsError(f"{low} ({lo}) is above {high} ({hi})")
    return lo, hi


def length_cap(node) -> int:
    """Where a string's character count stops mattering: maxLength, else minLength (fewer states to mask)."""
    return node.max_len if node.max_len is not None else node.min_len


def number_text_takes(bounds: Bounds, text: bytes) -> bool:
    """Whether a complete number (no exponent) is inside the bounds."""
    return bounds.takes(Fraction(text.decode()))


DIGITS = frozenset(b"0123456789")


def number_byte(mode: str, c: int, integer: bool) -> str | None:
    """The number mode after byte `c`, None when `c` does not continue the number (it may end before it)."""
    digit = c in DIGITS
    if mode == "minus":
        return ("zero" if c == 0x30 else "int") if digit else None
    if mode == "int" and digit:
        return "int"
    if integer:
        return None
    if mode in ("zero", "int") and c == 0x2E:
        return "dot"
    if mode in ("zero", "int", "frac") and c in (0x65, 0x45):
        return "exp"
    if mode in ("dot", "frac") and digit:
        return "frac"
    if mode == "exp" and c in (0x2B, 0x2D):
        return "exp_sign"
    if mode in ("exp", "exp_sign", "exp_int") and digit:
        return "exp_int"
    return None


def value_fits(v: Any, s: dict, node) -> bool:
    """Whether an enum/const value fits the lengths, pattern, bounds, item counts and uniqueItems beside it
    (`node`: the json_schema.Node those keywords compiled to)."""
    if isinstance(v, str):
        return node.min_len <= len(v) and (node.max_len is None or len(v) <= node.max_len) and (
            node.pattern is None or compile_pattern(node.pattern.pattern, True, False).matches(v))  # any text: the
        # value is written from its own encoding (a control character escaped), not through the pattern's reader
    if isinstance(v, (int, float)) and not isinstance(v, bool) and node.bounds is not None:
        return node.bounds.takes(as_fraction(v))
    counts = {list: ("minItems", "maxItems"), dict: ("minProperties", "maxProperties")}.get(type(v))
    if counts is not None:
        lo, hi = s.get(counts[0], 0), s.get(counts[1])
        distinct = not isinstance(v, list) or s.get("uniqueItems") is not True or len({same_key(x) for x in v}) == len(v)
        return isinstance(lo, int) and lo <= len(v) and (not isinstance(hi, int) or len(v) <= hi) and distinct
    return True


def encode(value: Any) -> bytes:
    """The compact encoding `enum`/`const` values are written in (and tool arguments checked in)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def same_key(v, number=None):
    """A key equal for values JSON Schema takes as equal: numbers by value at any depth ([1] is [1.0]), booleans
    apart from numbers, objects whatever their key order. `number`: how a number becomes its value (default
    as_fraction, the decimal it is written as; Fraction, a float's exact binary value, as Python compares)."""
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return (kind(v), v)
    if isinstance(v, (int, float)):
        return ("number", (number or as_fraction)(v))
    if isinstance(v, list):
        return ("array", tuple(same_key(x, number) for x in v))
    return ("object", frozenset((k, same_key(x, number)) for k, x in v.items()))


def kind(v: Any) -> str:
    """A JSON value's kind, as a schema's `type` names it ("other" for what JSON has not)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(v), "other")


# `format` values held as patterns, with the lengths beside them (other formats stay the annotations JSON Schema
# makes them): the forms of RFC 3339 as strict checkers take them (year 0001 on,
# upper-case T and Z, no leap second; a day its month has, 29 February in leap years only), RFC 4122, and
# addresses of the dotted form mail is sent to.
_YEAR = r"(000[1-9]|00[1-9]\d|0[1-9]\d\d|[1-9]\d{3})"
_LEAP = r"(\d\d(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"  # 4 | y, and 400 | y if 100 | y
_MONTH_DAY = r"((0[13578]|1[02])-(0[1-9]|[12]\d|3[01])|(0[469]|11)-(0[1-9]|[12]\d|30)|02-(0[1-9]|1\d|2[0-8]))"
_DATE = rf"({_YEAR}-{_MONTH_DAY}|{_LEAP}-02-29)"
_TIME = r"([01]\d|2[0-3]):[0-5]\d:[0-5]\d(\.\d{1,9})?(Z|[+-]([01]\d|2[0-3]):[0-5]\d)"
_OCTET = r"(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_ATEXT = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]"  # RFC 5322's atext: an address's local part is dot-separated runs of it
FORMATS = {"date": f"^{_DATE}$", "time": f"^{_TIME}$", "date-time": f"^{_DATE}T{_TIME}$",
           "uuid": "^[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}$", "ipv4": rf"^({_OCTET}\.){{3}}{_OCTET}$",
           "email": rf"^{_ATEXT}+(\.{_ATEXT}+)*@[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)*\.[A-Za-z]{{2,}}$"}


def parse_pattern(s: dict, min_len: int, max_len: int | None) -> Regex | LengthRegex | None:
    """The pattern a string must match, `pattern`, else a `format` of FORMATS', held to the lengths beside it
    (RegexError for a pattern that cannot be held). Beside a `pattern`, a format stays the annotation JSON Schema
    makes it (libraries write both for one form: zod's email), and the pattern is what holds."""
    fmt = s.get("format")
    if "pattern" in s:
        text = s["pattern"]
    elif isinstance(fmt, str) and fmt in FORMATS:
        text = FORMATS[fmt]
    else:
        return None
    regex = compile_pattern(text, True, True)
    return length_regex(regex, min_len, max_len) if min_len > 0 or max_len is not None else regex


def infer_types(s: dict) -> frozenset[str]:
    """The kinds of value a schema's `type` (and OpenAPI's `nullable`) takes; with no `type`, inferred from its
    keywords (an enum's values say theirs), else any (BoundsError for a malformed one)."""
    t = s.get("type")
    if t is None:
        if "enum" in s or "const" in s:
            types = set(TYPES)
        elif {"properties", "required", "additionalProperties", "patternProperties", "propertyNames", "minProperties",
              "maxProperties"} & set(s):
            types = {"object"}
        elif {"items", "prefixItems", "minItems", "maxItems"} & set(s):
            types = {"array"}
        elif {"pattern", *LENGTH_KEYWORDS} & set(s):
            types = {"string"}
        elif set(BOUND_KEYWORDS) & set(s):
            types = {"number"}
        else:
            types = set(TYPES)
    else:
        listed = t if isinstance(t, list) else [t]
        if not listed or not all(isinstance(x, str) and x in TYPES for x in listed):
            raise BoundsError(f"type must be one of {', '.join(TYPES)} or a list of them (got {json.dumps(t)})")
        types = set(listed)
    if s.get("nullable") is True:
        types.add("null")
    elif s.get("nullable") not in (None, False):
        raise BoundsError("nullable must be true or false")
    return frozenset(types)

"""A JSON Schema, compiled into the nodes the structured-output grammar walks (json_schema_grammar.py).

Structured output (`response_format: {"type": "json_schema", ...}`, a named tool's or a required call's
arguments) holds the output to a schema while it is sampled, so only what the grammar can hold at every
token is taken. Each keyword is enforced, an annotation, or refused with an error naming it and where it
is: a schema is never silently weakened.

Enforced: `type` (one or a list of string, number, integer, boolean, null, object, array), `properties`, `required`,
`additionalProperties` (false, true or a schema), `patternProperties`, `propertyNames` (an enum, or a string's
pattern, format and lengths: json_schema_keys.py), `minProperties`, `maxProperties`, `items`, `prefixItems`,
`minItems`, `maxItems`, `uniqueItems` (of enum or const items, or strings and numbers free of patterns, lengths and
bounds), `minLength`, `maxLength`, `minimum`, `maximum`, `exclusiveMinimum`, `exclusiveMaximum`, `multipleOf`
(json_schema_bounds.py), `pattern` (regex_grammar.py; beside a length, regex_length.py), `format`
date/time/date-time/uuid/ipv4/email (as patterns, held to lengths too; beside a pattern, annotations), `oneOf` of
disjoint alternatives (json_schema_unions.py), `enum`, `const`, `anyOf`, `allOf` of one schema, `nullable`
(OpenAPI's: adds null), and `$ref` to `#`, `#/$defs/...` or `#/definitions/...` (recursion included). Annotations
(never checked): title, description, default, examples, other formats, deprecated, readOnly, writeOnly, $schema,
$id, $comment, contentEncoding, contentMediaType, discriminator (oneOf's disjointness is checked instead).

Where the schema is silent, the output is held as a strict reader of it would expect (as vLLM's xgrammar
backend does by default): an object schema that lists `properties` or `patternProperties` takes no other key
unless `additionalProperties` says so (an object schema without either takes any keys); a schema that only
lists properties or items describes an object or an array. `enum` and `const` values are written in their
compact form (`json.dumps(v, separators=(",", ":"), ensure_ascii=False)`, an object's keys sorted, as in the
canonical text it is compiled from), and listed property names as json.dumps writes them: `1.0` is not taken
for `const: 1`, nor `"\u0061"` for a property `a` (a key written so is read as the key it names, never twice). A top-level schema must describe an
object, an array, a string, a boolean or null: a number has no end a stop token could follow. A schema
must take some finite value everywhere (`{"properties": {"a": {"$ref": "#"}}, "required": ["a"]}` does not).

Bounds, as a schema comes from a request: 2048 parts, 4096 names and enum values, unions and $refs 64 deep."""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any

from lorafleet.worker.json_schema_bounds import (
    BOUND_KEYWORDS,
    FORMATS,
    LENGTH_KEYWORDS,
    TYPES,
    Bounds,
    BoundsError,
    encode,
    infer_types,
    kind,
    parse_bounds,
    parse_counts,
    parse_lengths,
    parse_pattern,
    value_fits,
)
from lorafleet.worker.json_schema_keys import most_keys, object_keys
from lorafleet.worker.json_schema_unions import all_finite, one_of_problem, unique_items
from lorafleet.worker.regex_dfa import Regex, RegexError
from lorafleet.worker.regex_length import MAX_LENGTH_WORK, NoText

ENFORCED = {"type", "properties", "required", "additionalProperties", "patternProperties", "propertyNames",
            "minProperties", "maxProperties", "items",
            "prefixItems", "minItems", "maxItems", "uniqueItems", "enum", "const",
            "anyOf", "oneOf", "allOf", "$ref", "nullable", "$defs", "definitions", "pattern", *BOUND_KEYWORDS,
            *LENGTH_KEYWORDS}
ANNOTATIONS = {"title", "description", "default", "examples", "format", "deprecated", "readOnly", "writeOnly",
               "$schema", "$id", "$comment", "contentEncoding", "contentMediaType", "discriminator"}
ALTERNATIVES = ("anyOf", "oneOf", "allOf")
MAX_NODES = 2048  # schemas are small; this bounds what a request can make the worker compile
MAX_ENUM = 1024  # values of one enum
MAX_NAMES = 4096  # property names and enum values of a schema, in all
MAX_DEPTH = 64  # nesting of a schema document, and of unions expanded at a value's first byte


class SchemaError(ValueError):
    """A schema this server cannot hold the output to; the message names the keyword and where it is."""


@dataclass(frozen=True, slots=True, eq=False)
class Node:
    types: frozenset[str] = frozenset()  # value kinds: string, number, integer, boolean, null, object, array
    props: tuple[tuple[bytes, int], ...] = ()  # (name as written between its quotes, node)
    required: frozenset[int] = frozenset()  # indexes into props
    additional: int | None = None  # node of other keys' values (matching no pattern); None: no such key
    patterns: tuple[tuple[Regex, int], ...] = ()  # patternProperties: (pattern, node of the values of keys it matches)
    language: Any = None  # Regex or LengthRegex of other keys (json_schema_keys.py); None: any text
    min_props: int = 0  # an object's properties, listed and other
    max_props: int | None = None
    key_cap: int | None = None  # the most keys the grammar writes; set: other keys counted by name, each once
    items: int = 0  # node of an array's items (after its prefix)
    prefix: tuple[int, ...] = ()  # nodes of its first items, in order (prefixItems)
    min_items: int = 0
    max_items: int | None = None
    unique: int | None = None  # uniqueItems: how many distinct values its items may take (None: not unique)
    enum: tuple[bytes, ...] | None = None  # the allowed values' compact encodings (enum, const), sorted
    min_len: int = 0  # a string's characters
    max_len: int | None = None
    bounds: Bounds | None = None  # a number's (json_schema_bounds.py)
    pattern: Regex | None = None  # a string's text matches it somewhere (regex_dfa.py)
    untyped: bool = False  # no `type`: the kinds above were inferred from the keywords (json_schema_unions.py)
    any_of: tuple[int, ...] = ()  # a union: the value is one of these nodes (the fields above unused)
    names: dict[bytes, int] = field(default_factory=dict)  # props' names -> index
    sorted_names: tuple[bytes, ...] = ()  # props' names, sorted (prefix queries by bisection)

    @property
    def others(self) -> bool:  # whether an object may have keys other than the listed properties
        return self.additional is not None or bool(self.patterns)


ANY = 0  # node 0 takes any JSON value
ANY_NODE = Node(types=frozenset(TYPES), additional=ANY, items=ANY)


class JsonSchema:
    """A compiled schema: `nodes[root]` describes the whole value. `key` names it for caches (the same schema
    text, keys in any order, gives the same key)."""

    def __init__(self, schema: Any) -> None:
        canonical = _canonical(schema)
        self.key = "schema:" + hashlib.sha256(canonical.encode()).hexdigest()
        # Compiled from the canonical text: the same key always numbers its nodes and properties the same way.
        self.document = json.loads(canonical)
        self.grammars: dict[tuple, Any] = {}  # its SchemaGrammars by (compact, tag), each made once (json_schema_grammar.py)
        self.nodes: list[Node | None] = [ANY_NODE]
        self._compiled: dict[int, int] = {}  # id(subschema dict) -> node
        self._num_names = 0
        self._alternatives: dict[int, list[int]] = {}
        self._one_of: list[tuple[str, tuple[int, ...]]] = []  # (where, alternatives) of each oneOf
        self._unique: list[tuple[int, str]] = []  # (id of the schema, where) of each array with uniqueItems
        self._length_work = 0  # its patterns beside lengths: their compile's cost (regex_length.MAX_LENGTH_WORK)
        self.root = self._node(self.document, "#", 0)
        for i in range(len(self.nodes)):  # every union's alternatives, now: a $ref loop fails here, not while sampling
            self.alternatives(i)
        if (problem := one_of_problem(self, self._one_of)) is not None:
            raise SchemaError(problem)
        for sid, where in self._unique:  # uniqueItems: the distinct items each such array may take
            i = self._compiled[sid]
            if isinstance(cap := unique_items(self, self.nodes[i]), str):
                raise SchemaError(f"{where}: {cap}")
            self.nodes[i] = replace(self.nodes[i], unique=cap)
        self._check_finite()
        self._check_root()

    def _node(self, s: Any, where: str, depth: int) -> int:
        if depth > MAX_DEPTH:
            raise SchemaError(f"{where}: the schema nests deeper than {MAX_DEPTH} levels")
        if s is True or s == {}:
            return ANY
        if s is False:
            raise SchemaError(f"{where}: the schema `false` takes no value")
        if not isinstance(s, dict):
            raise SchemaError(f"{where}: a schema must be an object or a boolean (got {json.dumps(s)[:60]})")
        done = self._compiled.get(id(s))
        if done is not None:
            return done
        if len(self.nodes) >= MAX_NODES:
            raise SchemaError(f"the schema has more than {MAX_NODES} parts")
        index = len(self.nodes)
        self.nodes.append(None)  # a placeholder: a $ref back to this schema finds its index
        self._compiled[id(s)] = index
        self.nodes[index] = self._build(s, where, depth)
        return index

    def _build(self, s: dict, where: str, depth: int) -> Node:
        unknown = sorted(set(s) - ENFORCED - ANNOTATIONS)
        if unknown:
            raise SchemaError(f"{where}: {', '.join(unknown)} cannot be enforced while sampling; this server holds the "
                              f"output to {', '.join(sorted(ENFORCED - {'$defs', 'definitions'}))} and format {', '.join(sorted(FORMATS))} "
                              "(it ignores other formats and annotations such as title and description)")
        enforced = sorted(set(s) & (ENFORCED - {"$defs", "definitions"}))
        for kw in ("$ref", *ALTERNATIVES):
            if kw in s and enforced != [kw]:
                others = ", ".join(k for k in enforced if k != kw)
                raise SchemaError(f"{where}: {kw} beside {others} is not supported; put those keywords inside the "
                                  f"schema {kw} names")
        if "$ref" in s:
            return self._alias(self._node(self._resolve(s["$ref"], where), s["$ref"], depth + 1))
        if "allOf" in s:
            parts = s["allOf"]
            if not isinstance(parts, list) or len(parts) != 1:
                raise SchemaError(f"{where}.allOf: only an allOf of one schema is supported")
            return self._alias(self._node(parts[0], f"{where}.allOf[0]", depth + 1))
        for kw in ("anyOf", "oneOf"):  # oneOf: checked for disjoint alternatives once every node is compiled
            if kw in s:
                parts = s[kw]
                if not isinstance(parts, list) or not parts:
                    raise SchemaError(f"{where}.{kw} must be a non-empty list of schemas")
                nodes = tuple(self._node(p, f"{where}.{kw}[{i}]", depth + 1) for i, p in enumerate(parts))
                if kw == "oneOf":
                    self._one_of.append((where, nodes))
                return Node(any_of=nodes)
        node = self._scalar(s, _checked(where, infer_types, s), where)
        if "type" not in s:  # oneOf's check reads its kinds as a validator does: a keyword binds no kind
            node = replace(node, untyped=True)
        if "enum" in s or "const" in s:
            return Node(types=node.types, enum=self._enum(s, node, where))
        if "object" in node.types:
            node = self._object(s, node, where, depth)
        if "array" in node.types:
            node = self._array(s, node, where, depth)
        return node

    def _scalar(self, s: dict, types: frozenset[str], where: str) -> Node:
        """A node of `types` with the string lengths, pattern and number bounds of `s`; a type no value of which
        fits them (an integer no bound holds, a string no text of its length matches) is dropped if not alone."""
        (min_len, max_len), bounds = _checked(where, parse_lengths, s), _checked(where, parse_bounds, s)
        pattern, key = None, "pattern" if "pattern" in s else "format"  # the keyword the string's regex comes from
        if "string" in types:  # a pattern and a format only hold strings
            try:
                pattern = parse_pattern(s, min_len, max_len)
            except NoText as exc:
                if types == {"string"}:
                    raise SchemaError(f"{where}.{key}: {exc}") from None
                types = types - {"string"}
                self._spend(exc.work, where, key)
            except RegexError as exc:
                raise SchemaError(f"{where}.{key}: {exc}") from None
            self._spend(getattr(pattern, "work", 0), where, key)
        if bounds is not None and types & {"number", "integer"}:
            kept = types - ({"number", "integer"} if not bounds.takes_any() else set() if bounds.takes_integer() else {"integer"})
            if not kept:
                raise SchemaError(f"{where}: no {' or '.join(sorted(types))} is {bounds.describe()}")
            types = frozenset(kept)
        return Node(types=types, min_len=min_len, max_len=max_len, bounds=bounds, pattern=pattern)

    def _spend(self, work: int, where: str, key: str = "pattern") -> None:  # a pattern beside a length: its cost
        self._length_work += work
        if self._length_work > 2 * MAX_LENGTH_WORK:
            raise SchemaError(f"{where}.{key}: the schema's patterns beside lengths cost too much to hold "
                              "together; shorten their lengths or patterns")

    def _alias(self, target: int) -> Node:
        """The node of a schema that is another one ($ref, allOf of one): a union of that one alone."""
        return Node(any_of=(target,))

    def _resolve(self, ref: Any, where: str) -> Any:
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise SchemaError(f"{where}.$ref: only references inside the schema (\"#\", \"#/$defs/...\") are supported "
                              f"(got {json.dumps(ref)[:80]})")
        target = self.document
        for part in ref[2:].split("/") if ref != "#" else ():
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise SchemaError(f"{where}.$ref: {ref} names nothing in the schema")
            target = target[part]
        return target

    def _enum(self, s: dict, node: Node, where: str) -> tuple[bytes, ...]:
        types = node.types
        values = s.get("enum", [s.get("const")])
        if not isinstance(values, list) or len(values) > MAX_ENUM:
            raise SchemaError(f"{where}.enum must be a list of at most {MAX_ENUM} values")
        encodings = {}
        for v in values:
            try:
                fits = value_fits(v, s, node)
            except RegexError as exc:  # the pattern cannot read this value within its bounds
                raise SchemaError(f"{where}.pattern: {exc}") from None
            if kind(v) not in types and not (kind(v) == "integer" and "number" in types) or not fits:
                continue  # a value the type or the lengths and bounds exclude is never valid
            try:
                encodings[encode(v)] = v
            except (TypeError, ValueError) as exc:  # UnicodeEncodeError: a lone surrogate
                raise SchemaError(f"{where}.enum: {v!r} cannot be written as JSON ({exc})") from None
        if "const" in s and "enum" in s:  # both: the const, if the enum lists it (compared as JSON, true is not 1)
            const = encode(s["const"]) if kind(s["const"]) != "other" else None
            encodings = {e: v for e, v in encodings.items() if e == const}
        if not encodings:
            raise SchemaError(f"{where}: no value of its enum/const has one of its types ({', '.join(sorted(types))}) and "
                              "fits its other keywords")
        self._count_names(len(encodings))
        return tuple(sorted(encodings))

    def _count_names(self, n: int) -> None:
        self._num_names += n
        if self._num_names > MAX_NAMES:
            raise SchemaError(f"the schema lists more than {MAX_NAMES} property names and enum values in all")

    def _object(self, s: dict, node: Node, where: str, depth: int) -> Node:
        keys = _checked(where, object_keys, self, s, where, depth)
        self._spend(getattr(keys.language, "work", 0), where)
        names, required = [name for name, _ in keys.listed], keys.required
        lo, hi = _checked(where, parse_counts, s, "minProperties", "maxProperties")
        hi, cap = _checked(where, most_keys, keys, lo, hi)
        if not keys.others and lo > len(names) or hi is not None and (hi < len(required) or lo > hi):
            raise SchemaError(f"{where}: no object takes {len(required)} required properties, at most {len(names)} "
                              f"listed ones{' and others' if keys.others else ''} and {lo}-{hi} in all")
        self._count_names(len(names))
        try:
            encoded = [encode(name)[1:-1] for name in names]
        except UnicodeEncodeError as exc:
            raise SchemaError(f"{where}.properties: a name cannot be written as JSON ({exc})") from None
        return replace(node, props=tuple(zip(encoded, (v for _, v in keys.listed), strict=True)),
                       required=frozenset(names.index(r) for r in required),
                       additional=keys.additional, patterns=keys.patterns, language=keys.language, min_props=lo,
                       max_props=hi, key_cap=cap, names={enc: i for i, enc in enumerate(encoded)}, sorted_names=tuple(sorted(encoded)))

    def _array(self, s: dict, node: Node, where: str, depth: int) -> Node:
        lo, hi = _checked(where, parse_counts, s, "minItems", "maxItems")
        parts = s.get("prefixItems", [])
        if not isinstance(parts, list):
            raise SchemaError(f"{where}.prefixItems must be a list of schemas")
        prefix = tuple(self._node(p, f"{where}.prefixItems[{i}]", depth + 1) for i, p in enumerate(parts))
        items = s.get("items", True)
        if items is False:  # no items past the prefix
            hi = len(prefix) if hi is None else min(hi, len(prefix))
            if lo > hi:
                raise SchemaError(f"{where}: items false with minItems {lo} takes no value")
            items = True
        unique = s.get("uniqueItems", False)
        if not isinstance(unique, bool):
            raise SchemaError(f"{where}.uniqueItems must be true or false")
        if unique:
            self._unique.append((id(s), where))
        return replace(node, items=self._node(items, f"{where}.items", depth + 1), prefix=prefix, min_items=lo,
                       max_items=hi)

    @staticmethod
    def item(node: Node, index: int) -> int:
        """The node of an array's item at `index`: its prefixItems' there, else its items'."""
        return node.prefix[index] if index < len(node.prefix) else node.items

    def alternatives(self, index: int, visiting: frozenset[int] = frozenset()) -> list[int]:
        """The nodes (no union among them) a value of node `index` may be, unions flattened (memoized)."""
        done = self._alternatives.get(index)
        if done is not None:
            return done
        node = self.nodes[index]
        if not node.any_of:
            alts = [index]
        else:
            if index in visiting or len(visiting) > MAX_DEPTH:
                raise SchemaError("the schema's unions or $refs name one another in a loop (or nest deeper than "
                                  f"{MAX_DEPTH}): no value could ever be chosen")
            inner = visiting | {index}
            alts = list(dict.fromkeys(alt for i in node.any_of for alt in self.alternatives(i, inner)))
        self._alternatives[index] = alts
        return alts

    def _check_finite(self) -> None:
        if not all_finite(self):
            raise SchemaError("the schema takes no finite value somewhere (a required property, or the items of an "
                              "array with minItems, that holds itself): the output could never end")

    def _root_kinds(self) -> set[str]:
        """The kinds of value (object, number, ...) the whole schema may take."""
        kinds: set[str] = set()
        for node in (self.nodes[i] for i in self.alternatives(self.root)):
            kinds |= {kind(json.loads(e)) for e in node.enum} if node.enum is not None else node.types
        return kinds

    def takes_only_objects(self) -> bool:
        """Whether every value of the schema is an object (a function's arguments must be)."""
        return self._root_kinds() == {"object"}

    def _check_root(self) -> None:
        if self._root_kinds() & {"number", "integer"}:
            raise SchemaError("#: the top-level schema may describe a number, which has no end a stop token could "
                              "follow; describe an object, an array, a string, a boolean or null")


def _checked(where: str, parse, *args):
    """parse(*args), a BoundsError from it a SchemaError naming where."""
    try:
        return parse(*args)
    except BoundsError as exc:
        raise SchemaError(f"{where}.{exc}") from None


def _canonical(schema: Any) -> str:
    try:
        return json.dumps(schema, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise SchemaError(f"the schema is not plain JSON or nests too deeply ({exc})") from None


_CACHE: OrderedDict[str, JsonSchema] = OrderedDict()
_CACHE_LOCK = threading.Lock()  # large request bodies are parsed in worker threads
MAX_CACHED = 64


def compile_schema(schema: Any) -> JsonSchema:
    """The compiled schema (SchemaError when it cannot be enforced); the same schema text compiles once."""
    text = _canonical(schema)
    with _CACHE_LOCK:
        hit = _CACHE.get(text)
        if hit is not None:
            _CACHE.move_to_end(text)
            return hit
    try:
        compiled = JsonSchema(schema)
    except RecursionError:  # a pattern or a chain of references deeper than the checks follow
        raise SchemaError("the schema nests too deeply to compile") from None
    with _CACHE_LOCK:
        compiled = _CACHE.setdefault(text, compiled)
        _CACHE.move_to_end(text)
        if len(_CACHE) > MAX_CACHED:
            _CACHE.popitem(last=False)
    return compiled

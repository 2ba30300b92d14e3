"""The front half of grammar compilation: so_args -> canonical cache key, and the LRU cache.

``canonical_key`` parses and checks a request's so_args before anything is
compiled, so a bad schema fails while the request is being admitted. It also
refuses what the grammar backend (xgrammar) would silently ignore: a keyword it
drops would let the model emit output that violates the schema.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any, Generic, Hashable, TypeVar

from deepinfer.sampling_params import SCHEMA_TYPES

V = TypeVar("V")

# xgrammar parses these keywords' subschemas but does not enforce them.
_IGNORED_KEYWORDS = (
    "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
    "contains", "minContains", "maxContains", "$dynamicRef", "$recursiveRef",
)
# Formats xgrammar turns into a grammar; any other format is compiled as a plain string.
SUPPORTED_FORMATS = frozenset({
    "date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid",
    "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
})
# xgrammar compiles const/enum to the listed values alone, dropping these siblings.
_VALUE_CONSTRAINTS = frozenset({
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength",
    "maxLength", "pattern", "format", "items", "prefixItems", "minItems", "maxItems", "properties",
    "required", "additionalProperties", "patternProperties", "propertyNames", "minProperties",
    "maxProperties", "anyOf", "oneOf", "allOf", "$ref",
})
_SCHEMA_KEYWORDS = ("items", "additionalProperties", "propertyNames", "additionalItems")
_SCHEMA_LIST_KEYWORDS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAP_KEYWORDS = ("properties", "patternProperties", "$defs", "definitions")

CacheKey = tuple[str, str | None]


def canonical_key(so_args: dict[str, Any]) -> CacheKey:
    """(schema_type, canonical schema text); raises ValueError for anything compile() must refuse.

    JSON schemas are re-serialised compactly with key order kept (xgrammar emits
    properties in declared order, so order is part of the grammar); a dict and
    the equivalent JSON string share one key. A None schema means any JSON object.
    """
    kind = so_args.get("schema_type")
    schema = so_args.get("schema")
    if kind == "json":
        if schema is None:
            return ("json", None)
        parsed = _parse_json_schema(schema)
        check_json_schema(parsed)
        try:
            text = json.dumps(parsed, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"JSON schema is not JSON-serialisable: {e}") from None
        return ("json", text)
    if kind in ("regex", "ebnf"):
        if not isinstance(schema, str) or not schema:
            raise ValueError(f"so_args['schema'] for {kind} must be a non-empty string, got {schema!r}")
        return (kind, normalize_regex(schema) if kind == "regex" else schema)
    raise ValueError(f"so_args['schema_type'] must be one of {SCHEMA_TYPES}, got {kind!r}")


def _parse_json_schema(schema: Any) -> Any:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"so_args['schema'] is not valid JSON ({e}): {schema[:200]!r}") from None
    if isinstance(schema, bool):
        if not schema:
            raise ValueError("JSON schema false admits no value, so nothing could be generated")
        return schema
    if not isinstance(schema, dict):
        raise ValueError(f"JSON schema must be an object or a boolean, got {type(schema).__name__}: {schema!r}")
    return schema


def normalize_regex(regex: str) -> str:
    """Check a regex and give '.' Python's meaning (any character but newline; xgrammar's
    '.' also matches newline). Anchors are only accepted where xgrammar honours them."""
    out: list[str] = []
    class_start = -1  # index of the first member of the open character class, -1 outside one
    i = 0
    while i < len(regex):
        ch = regex[i]
        if ch == "\\":
            out.append(regex[i:i + 2])
            i += 2
            continue
        if class_start >= 0:
            if ch == "]" and i > class_start:  # a ']' first in the class is a member
                class_start = -1
        elif ch == "[":
            class_start = i + 2 if regex[i + 1:i + 2] == "^" else i + 1
        elif ch == ".":
            ch = "[^\\n]"
        elif (ch == "^" and i != 0) or (ch == "$" and i != len(regex) - 1):
            raise ValueError(
                f"regex {regex!r}: anchor {ch!r} at position {i} is only supported at the start or end"
                " (the whole output is always matched)")
        out.append(ch)
        i += 1
    return "".join(out)


def check_json_schema(schema: Any) -> None:
    """Raise ValueError naming the first keyword the backend would not enforce."""
    _check(schema, "#", schema)


def _unsupported(path: str, what: str) -> ValueError:
    return ValueError(f"JSON schema at {path}: {what} is not supported by structured output")


def _check(node: Any, path: str, root: Any) -> None:  # noqa: C901 - one rule per keyword
    if isinstance(node, bool):
        return
    if not isinstance(node, dict):
        raise ValueError(f"JSON schema at {path} must be an object or a boolean, got {node!r}")
    for keyword in _IGNORED_KEYWORDS:
        if keyword in node:
            raise _unsupported(path, f"'{keyword}'")
    if node.get("uniqueItems") is True:
        raise _unsupported(path, "'uniqueItems': true")
    for keyword in ("unevaluatedProperties", "unevaluatedItems"):
        if keyword in node and node[keyword] is not False:
            raise _unsupported(path, f"'{keyword}' other than false")
    for keyword in _SCHEMA_LIST_KEYWORDS:
        if keyword in node and (not isinstance(node[keyword], list) or not node[keyword]):
            raise ValueError(f"JSON schema at {path}: '{keyword}' must be a non-empty array, got {node[keyword]!r}")
    if len(node.get("allOf", ())) > 1:
        raise _unsupported(path, "'allOf' with more than one schema")
    if len(node.get("oneOf", ())) > 1 and not _disjoint(node["oneOf"], root):
        raise _unsupported(path, "'oneOf' whose branches may overlap (give them distinct types or a"
                           " required const discriminator property, or use anyOf)")
    ref = node.get("$ref")
    if ref is not None and (not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/"))):
        raise _unsupported(path, f"'$ref' {ref!r} (only local references '#/...')")
    if "multipleOf" in node:
        value = node["multipleOf"]
        if node.get("type") != "integer" or not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise _unsupported(path, f"'multipleOf' {value!r} (only a positive integer on type 'integer')")
    constrained_text = [k for k in ("pattern", "format") if k in node]
    if constrained_text and ("minLength" in node or "maxLength" in node):
        raise _unsupported(path, f"'{constrained_text[0]}' combined with 'minLength'/'maxLength'")
    if "format" in node and node["format"] not in SUPPORTED_FORMATS:
        raise _unsupported(path, f"'format' {node['format']!r} (supported: {', '.join(sorted(SUPPORTED_FORMATS))})")
    pattern = node.get("pattern")
    if isinstance(pattern, str) and any(look in pattern for look in ("(?=", "(?!", "(?<=", "(?<!")):
        raise _unsupported(path, f"lookaround in 'pattern' {pattern!r}")
    if "items" in node and isinstance(node["items"], list):
        raise _unsupported(path, "'items' as an array (use 'prefixItems')")
    _check_object(node, path)
    _check_const_enum(node, path)
    for keyword in _SCHEMA_KEYWORDS:
        if keyword in node:
            _check(node[keyword], f"{path}/{keyword}", root)
    for keyword in _SCHEMA_LIST_KEYWORDS:
        for i, sub in enumerate(node.get(keyword, ())):
            _check(sub, f"{path}/{keyword}/{i}", root)
    for keyword in _SCHEMA_MAP_KEYWORDS:
        subs = node.get(keyword, {})
        if not isinstance(subs, dict):
            raise ValueError(f"JSON schema at {path}: '{keyword}' must be an object, got {subs!r}")
        for name, sub in subs.items():
            _check(sub, f"{path}/{keyword}/{name}", root)


def _check_object(node: dict[str, Any], path: str) -> None:
    properties = node.get("properties")
    properties = properties if isinstance(properties, dict) else {}
    required = node.get("required")
    required = required if isinstance(required, list) else []
    missing = [name for name in required if name not in properties]
    if missing:
        raise _unsupported(path, f"'required' naming properties not listed in 'properties' {missing}")
    # Undeclared keys may repeat (xgrammar does not track them), and a JSON parser
    # keeps one of each duplicate, so a lower bound on the count cannot be enforced.
    free_keys = (node.get("additionalProperties", "properties" not in node) is not False
                 or "patternProperties" in node or "propertyNames" in node)
    min_properties = node.get("minProperties", 0)
    if free_keys and isinstance(min_properties, int) and min_properties > len(required):
        raise _unsupported(path, "'minProperties' on an object that admits undeclared keys")


def _check_const_enum(node: dict[str, Any], path: str) -> None:
    values = [node["const"]] if "const" in node else node.get("enum")
    if values is None:
        return
    if not isinstance(values, list):
        raise ValueError(f"JSON schema at {path}: 'enum' must be an array, got {values!r}")
    others = sorted(_VALUE_CONSTRAINTS.intersection(node))
    if others:
        raise _unsupported(path, f"'const'/'enum' combined with {others}")
    types = node.get("type")
    allowed = {types} if isinstance(types, str) else set(types or ())
    for value in values if allowed else ():
        kind = _json_type(value)
        if kind not in allowed and not (kind == "integer" and "number" in allowed):
            raise ValueError(f"JSON schema at {path}: enum/const value {value!r} does not match type {types!r}")


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _resolve(node: Any, root: Any) -> Any:
    """Follow local $ref pointers; None when a reference cannot be followed."""
    for _ in range(32):
        if not isinstance(node, dict) or "$ref" not in node:
            return node
        ref = node["$ref"]
        if not isinstance(ref, str) or not ref.startswith("#"):
            return None
        node = root
        for part in ref[1:].split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
    return None


def _value_types(node: Any, root: Any) -> set[str] | None:
    """JSON types a schema can produce (integer folded into number); None if unknown."""
    node = _resolve(node, root)
    if not isinstance(node, dict):
        return None
    if "const" in node or "enum" in node:
        values = [node["const"]] if "const" in node else node["enum"]
        return {"number" if t == "integer" else t for t in map(_json_type, values)}
    types = node.get("type")
    if isinstance(types, str):
        types = [types]
    return {"number" if t == "integer" else t for t in types} if types else None


def _const_values(node: Any, root: Any) -> set[str] | None:
    node = _resolve(node, root)
    if not isinstance(node, dict) or not ("const" in node or "enum" in node):
        return None
    values = [node["const"]] if "const" in node else node["enum"]
    return {json.dumps(v, sort_keys=True) for v in values}


def _pairwise_disjoint(sets: list[set[str] | None]) -> bool:
    seen: set[str] = set()
    for s in sets:
        if s is None or seen & s:
            return False
        seen |= s
    return True


def _disjoint(branches: list[Any], root: Any) -> bool:
    """Whether no value can match two oneOf branches: distinct types, or a required
    property (a discriminator) whose const/enum values differ between branches."""
    if _pairwise_disjoint([_value_types(b, root) for b in branches]):
        return True
    resolved = [_resolve(b, root) for b in branches]
    if not all(isinstance(b, dict) for b in resolved):
        return False
    common = set.intersection(*(set(b.get("required", ())) for b in resolved))
    return any(
        _pairwise_disjoint([_const_values(b.get("properties", {}).get(name), root) for b in resolved])
        for name in sorted(common)
    )


class LRUCache(Generic[V]):
    """A bounded, thread-safe least-recently-used map; capacity 0 disables it."""

    def __init__(self, capacity: int) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0:
            raise ValueError(f"cache_size must be an integer >= 0, got {capacity!r}")
        self.capacity = capacity
        self._items: OrderedDict[Hashable, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> V | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put_if_absent(self, key: Hashable, value: V) -> V:
        """Insert unless another thread got there first; return the value now cached
        (or ``value`` itself when caching is disabled)."""
        with self._lock:
            existing = self._items.get(key)
            if existing is not None:
                self._items.move_to_end(key)
                return existing
            if self.capacity:
                self._items[key] = value
                if len(self._items) > self.capacity:
                    self._items.popitem(last=False)
            return value

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

"""JSON schemas of increasing difficulty for structured output tests.

SUPPORTED: every walk through the tokens such a grammar allows must validate
against the schema (jsonschema, with its format checker). REFUSED: compile()
must raise ValueError whose message contains the given fragment, because the
grammar backend would not enforce the keyword. Shared with the end-to-end tests.
"""
from __future__ import annotations

from typing import Any

# the small grammars the sampler, engine and server tests share: a JSON object, a regex, an EBNF
ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
    },
    "required": ["color", "quantity"],
}
CODE_REGEX = "[A-Z]{2}-[0-9]{3}"
YES_NO_EBNF = 'root ::= "answer=" ("yes" | "no")'

_ITEM = {
    "type": "object",
    "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "size": {"enum": ["S", "M", "L"]},
        "count": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["sku", "count"],
}

SUPPORTED: list[tuple[str, Any]] = [
    ("integer_bounds", {"type": "integer", "minimum": -5, "maximum": 5}),
    ("boolean_or_null", {"type": ["boolean", "null"]}),
    ("enum_strings", {"enum": ["small", "medium", "large"]}),
    ("enum_mixed", {"enum": [1, "two", None, True, {"k": [3]}]}),
    ("number_bounds", {"type": "number", "minimum": -1.5, "maximum": 2.25}),
    ("number_exclusive", {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 10}),
    ("integer_multiple_of", {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100}),
    ("string_length", {"type": "string", "minLength": 3, "maxLength": 6}),
    ("string_pattern", {"type": "string", "pattern": "^[a-z]+_[0-9]{2}$"}),
    ("flat_object", {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
    }),
    ("const_fields", {
        "type": "object",
        "properties": {"version": {"const": 2}, "kind": {"const": "point"}, "ok": {"type": "boolean"}},
        "required": ["version", "kind", "ok"],
    }),
    ("optional_properties", {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 5}, "c": {"type": "boolean"}},
        "required": ["a"],
    }),
    ("max_properties_declared", {
        "type": "object",
        "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}, "z": {"type": "integer"}},
        "minProperties": 1, "maxProperties": 2,
    }),
    ("array_bounds", {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4}),
    ("format_email", {"type": "string", "format": "email"}),
    ("format_ipv6", {"type": "object", "properties": {"host": {"type": "string", "format": "ipv6"}}, "required": ["host"]}),
    ("format_uuid", {"type": "string", "format": "uuid"}),
    ("format_duration", {"type": "string", "format": "duration"}),
    ("nested_object", {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 10}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"],
            },
        },
        "required": ["name", "address"],
    }),
    ("array_of_objects", {"type": "array", "items": _ITEM, "minItems": 1, "maxItems": 3}),
    ("nested_arrays", {
        "type": "array",
        "items": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1}, "minItems": 2, "maxItems": 2},
        "minItems": 1, "maxItems": 3,
    }),
    ("tuple_prefix_items", {
        "type": "array",
        "prefixItems": [{"type": "string", "maxLength": 4}, {"type": "integer"}, {"type": "boolean"}],
        "items": False, "minItems": 3,
    }),
    ("any_of_scalars", {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 3}, {"type": "null"}]}),
    ("nullable_field", {
        "type": "object",
        "properties": {"note": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}]}},
        "required": ["note"],
    }),
    ("one_of_distinct_types", {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 5}, {"type": "string", "maxLength": 2}]}),
    ("one_of_discriminated_refs", {
        "$defs": {
            "Cat": {
                "type": "object",
                "properties": {"pet": {"const": "cat"}, "lives": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["pet", "lives"],
            },
            "Dog": {"type": "object", "properties": {"pet": {"const": "dog"}, "good": {"type": "boolean"}}, "required": ["pet", "good"]},
        },
        "type": "object",
        "properties": {"animal": {"oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}], "discriminator": {"propertyName": "pet"}}},
        "required": ["animal"],
    }),
    ("defs_reused", {
        "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"]}},
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/Point"}, "end": {"$ref": "#/$defs/Point"}},
        "required": ["start", "end"],
    }),
    ("definitions_draft7", {
        "definitions": {"Flag": {"type": "boolean"}},
        "type": "array", "items": {"$ref": "#/definitions/Flag"}, "minItems": 1, "maxItems": 3,
    }),
    ("all_of_single_ref", {
        "$defs": {"Level": {"type": "integer", "minimum": 1, "maximum": 3}},
        "type": "object",
        "properties": {"level": {"allOf": [{"$ref": "#/$defs/Level"}], "description": "pydantic v1 style"}},
        "required": ["level"],
    }),
    ("recursive_tree", {
        "$defs": {"Node": {
            "type": "object",
            "properties": {
                "v": {"type": "integer", "minimum": 0, "maximum": 99},
                "kids": {"type": "array", "items": {"$ref": "#/$defs/Node"}, "maxItems": 2},
            },
            "required": ["v"],
        }},
        "$ref": "#/$defs/Node",
    }),
    ("additional_properties_schema", {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9}}),
    ("pattern_properties", {"type": "object", "patternProperties": {"^x_[a-z]{1,4}$": {"type": "boolean"}}, "additionalProperties": False}),
    ("property_names", {"type": "object", "propertyNames": {"pattern": "^[a-c]{1,2}$"}, "additionalProperties": {"type": "null"}}),
    ("any_json_value", {}),
    ("order_form", {
        "$defs": {"Item": _ITEM},
        "type": "object",
        "properties": {
            "order_id": {"type": "string", "format": "uuid"},
            "customer": {
                "type": "object",
                "properties": {"email": {"type": "string", "pattern": "^[a-z.]{1,12}@[a-z]{2,8}\\.com$"}, "vip": {"type": "boolean"}},
                "required": ["email"],
            },
            "items": {"type": "array", "items": {"$ref": "#/$defs/Item"}, "minItems": 1, "maxItems": 2},
            "priority": {"anyOf": [{"enum": ["low", "high"]}, {"type": "null"}]},
            "discount": {"type": "number", "minimum": 0, "maximum": 0.5},
        },
        "required": ["order_id", "customer", "items"],
    }),
]

# Compiled, but the grammar is looser than the format: every output has the
# format's shape, yet a strict checker rejects some (name, schema, a regex every output matches).
APPROXIMATE: list[tuple[str, Any, str]] = [
    ("format_date", {"type": "string", "format": "date"}, r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"),  # day 31 in any month
    ("format_date_time", {"type": "string", "format": "date-time"},
     r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]+)?([Zz]|[+-][0-9]{2}:[0-9]{2})"),  # also second 60
    ("format_time", {"type": "string", "format": "time"}, r"[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]+)?([Zz]|[+-][0-9]{2}:[0-9]{2})"),
    ("format_ipv4", {"type": "string", "format": "ipv4"}, r"([0-9]{1,3}\.){3}[0-9]{1,3}"),  # leading zeros
    ("format_hostname", {"type": "string", "format": "hostname"}, r"[A-Za-z0-9.-]+"),  # labels over 63 characters
]

REFUSED: list[tuple[str, Any, str]] = [
    ("all_of_two", {"allOf": [{"type": "integer"}, {"minimum": 3}]}, "'allOf' with more than one schema"),
    ("not", {"not": {"type": "string"}}, "'not'"),
    ("if_then_else", {"type": "object", "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["a"]}}, "'if'"),
    ("dependent_required", {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "dependentRequired": {"a": ["b"]},
    }, "'dependentRequired'"),
    ("contains", {"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, "'contains'"),
    ("unique_items", {"type": "array", "items": {"enum": [1, 2, 3]}, "uniqueItems": True}, "'uniqueItems'"),
    ("one_of_overlapping", {"oneOf": [{"type": "integer", "maximum": 5}, {"type": "integer", "minimum": 3}]}, "'oneOf'"),
    ("external_ref", {"$ref": "https://example.com/schema.json"}, "'$ref'"),
    ("missing_ref", {"$ref": "#/$defs/Nope"}, "$defs"),
    ("multiple_of_number", {"type": "number", "multipleOf": 0.5}, "'multipleOf'"),
    ("pattern_with_length", {"type": "string", "pattern": "^a+$", "maxLength": 3}, "'pattern' combined with 'minLength'/'maxLength'"),
    ("unknown_format", {"type": "string", "format": "credit-card"}, "'format' 'credit-card'"),
    ("required_undeclared", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}, "['b']"),
    ("enum_with_bounds", {"enum": [1, 50], "maximum": 10}, "'const'/'enum' combined with ['maximum']"),
    ("min_properties_free_keys", {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2}, "'minProperties'"),
    ("unevaluated_properties_schema", {"type": "object", "unevaluatedProperties": {"type": "string"}}, "'unevaluatedProperties'"),
    ("items_array", {"type": "array", "items": [{"type": "integer"}]}, "'items' as an array"),
    ("nested_unsupported", {
        "type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
    }, "#/properties/tags"),
    ("false_schema", False, "admits no value"),
    ("unknown_type", {"type": "nonsense"}, "nonsense"),
    ("empty_any_of", {"anyOf": []}, "non-empty array"),
    ("min_greater_than_max", {"type": "integer", "minimum": 5, "maximum": 1}, "minimum greater than maximum"),
]

"""Schemas, prompts and checks shared by the structured-output tests."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "maxLength": 60},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "order_id": {"type": "integer", "minimum": 1, "maximum": 99999},
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "maxLength": 12},
                        "quantity": {"type": "integer", "minimum": 1, "maximum": 10},
                    },
                    "required": ["sku", "quantity"],
                    "additionalProperties": False,
                },
            },
            "status": {"enum": ["pending", "shipped", "delivered"]},
        },
        "required": ["order_id", "items", "status"],
        "additionalProperties": False,
    },
    "weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 30},
            "temperature_c": {"type": "number", "minimum": -60, "maximum": 60},
            "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]},
            "forecast": {
                "type": "array",
                "minItems": 2,
                "maxItems": 3,
                "items": {"type": "integer", "minimum": -60, "maximum": 60},
            },
        },
        "required": ["city", "temperature_c", "conditions", "forecast"],
        "additionalProperties": False,
    },
    "book": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 50},
            "author": {
                "type": "object",
                "properties": {
                    "first": {"type": "string", "maxLength": 20},
                    "last": {"type": "string", "maxLength": 20},
                },
                "required": ["first", "last"],
                "additionalProperties": False,
            },
            "year": {"type": "integer", "minimum": 1450, "maximum": 2030},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 15}, "maxItems": 3},
            "in_print": {"type": "boolean"},
        },
        "required": ["title", "author", "year", "in_print"],
        "additionalProperties": False,
    },
    "rating": {
        "type": "object",
        "properties": {
            "score": {"type": "number", "minimum": 0, "maximum": 5},
            "verdict": {"enum": ["good", "bad", "mixed"]},
            "pros": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 2},
        },
        "required": ["score", "verdict", "pros"],
        "additionalProperties": False,
    },
}

_SUBJECTS = [
    "a software engineer from Oslo",
    "an order of three books",
    "the weather in Cairo",
    "a classic novel",
    "a new smartphone",
    "a retired teacher",
    "a pizza delivery",
    "a rainy day in London",
    "a science fiction book",
    "a coffee machine",
]
_TEMPLATES = [
    "Give {s} as JSON:",
    "Describe {s} in JSON format.",
    "Return a JSON object about {s}.",
    "JSON for {s}:",
    "Produce structured data (JSON) describing {s}.",
]


def prompts(n: int) -> list[str]:
    """n varied prompts (templates x subjects)."""
    out = [t.format(s=s) for t in _TEMPLATES for s in _SUBJECTS]
    assert n <= len(out)
    return out[:n]


def check_json(text: str, schema: dict[str, Any]) -> None:
    jsonschema.validate(json.loads(text), schema)


DATE = r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
EMAIL = r"[a-z0-9]{1,12}@[a-z]{1,10}\.(com|org|net)"
PHONE = r"\+1 \(\d{3}\) \d{3}-\d{4}"
REGEXES = {"date": DATE, "email": EMAIL, "phone": PHONE}

ARITH_EBNF = r"""
root ::= expr
expr ::= term (("+" | "-") term){0,3}
term ::= factor (("*" | "/") factor){0,2}
factor ::= number | "(" inner ")"
inner ::= number (("+" | "-" | "*" | "/") number){1,3}
number ::= [1-9] [0-9]{0,2}
"""
"""Arithmetic expressions, bounded (a small model left free repeats `*100` until max_tokens)."""
ARITH_LARK = r"""
?start: expr
?expr: term (("+" | "-") term)*
?term: factor (("*" | "/") factor)*
?factor: NUMBER | "(" expr ")"
NUMBER: /[1-9][0-9]{0,2}/
"""


def fullmatch(pattern: str, text: str) -> bool:
    return re.fullmatch(pattern, text) is not None

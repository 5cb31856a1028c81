"""Random JSON schemas for the structured-output tests: nested objects, arrays, enums, required fields,
integers and numbers with bounds, strings of bounded length (a random model then ends every value in a few
tokens: an unbounded string of a random model closes only when its quote happens to win)."""

from __future__ import annotations

import random
from typing import Any

WORDS = ["shape", "colour", "count", "size", "name", "tags", "items", "left", "right", "ok"]


def random_schema(seed: int, depth: int = 2) -> dict[str, Any]:
    """An object schema drawn from ``seed``: 1-3 properties, some required, values of every kind above."""
    rng = random.Random(seed)
    return _object(rng, depth)


def _object(rng: random.Random, depth: int) -> dict[str, Any]:
    names = rng.sample(WORDS, rng.randint(1, 3))
    properties = {name: _value(rng, depth - 1) for name in names}
    required = [n for n in names if rng.random() < 0.7] or names[:1]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def _value(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = ["enum", "integer", "number", "string", "boolean"] + (["object", "array"] if depth > 0 else [])
    kind = rng.choice(kinds)
    if kind == "enum":
        return {"enum": rng.sample(["circle", "square", "red", "blue", 3, None], rng.randint(1, 4))}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "number":
        return {"type": "number", "minimum": -1.5, "maximum": 99.5}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 6)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "object":
        return _object(rng, depth)
    return {"type": "array", "items": _value(rng, depth - 1), "minItems": 0, "maxItems": rng.randint(1, 3)}

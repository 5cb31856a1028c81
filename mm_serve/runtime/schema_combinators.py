"""JSON Schema combinators (``allOf``, ``anyOf``, ``oneOf``) and ``$ref`` siblings in forms the grammar
engine enforces, or refused.

xgrammar (0.2.9) compiles a schema object by one of its keywords. Checked with its own matcher
(``xgrammar.testing``): a schema holding ``anyOf`` or ``allOf`` beside other validation keywords (``type``,
``properties``, ``required``, ``maximum`` ...) is compiled from the combinator alone, the rest dropped
(``{"type": "integer", "allOf": [{"maximum": 5}]}`` admits ``"a"``); ``allOf`` of two or more schemas is
not enforced at all (its log: "Support for allOf with multiple options is still ongoing"); ``oneOf`` is
compiled as ``anyOf``; a ``$ref``'s sibling keywords are dropped. An output could break such a schema while
the answer claims to follow it, so :func:`enforceable` rewrites what has an exact rewrite and refuses the
rest:

- ``allOf``: its schemas and the keywords beside it are merged into one schema, where no two of them set
  one keyword to different values (``required`` lists are joined: each only adds names an object must
  hold) and the merge keeps each keyword's meaning (``additionalProperties`` judges the ``properties`` of
  its own schema, so it may not meet another's; ``items`` beside ``prefixItems`` likewise).
- ``anyOf`` / ``oneOf`` beside other keywords: those are merged into each of its schemas (``S and (A or
  B)`` is ``(S and A) or (S and B)``, and likewise for exactly-one), under the same rule.
- ``oneOf`` is kept (compiled as ``anyOf``) only where no value can match two of its schemas: they admit
  disjoint JSON types, or they are objects with a required property whose ``const`` / ``enum`` values
  differ (a discriminator, as pydantic writes tagged unions); otherwise it is refused.
- An empty ``anyOf`` / ``oneOf`` (no value matches) is refused; an empty ``allOf`` is dropped.
"""

from __future__ import annotations

from typing import Any

from mm_serve.runtime.grammar_spec import GrammarError

# keywords that describe and do not validate: kept where they are, never merged
_ANNOTATIONS = frozenset({"title", "description", "$comment", "default", "examples", "deprecated", "readOnly",
                          "writeOnly", "$schema", "$id", "$anchor", "discriminator", "$defs", "definitions"})
# a keyword judged against others of its own schema: (keyword, the keywords it depends on)
_ONE_SCHEMA_MEANING = (("additionalProperties", ("properties",)), ("items", ("prefixItems",)),
                       ("additionalItems", ("items",)))
_MAX_REF_HOPS = 32


def enforceable(schema: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    """``schema`` (one schema object, not its sub-schemas: the caller walks those) rewritten so that the
    grammar engine enforces it exactly (module docstring); ``root`` is the whole schema, for ``$ref``.

    Raises:
        GrammarError: a combinator with no exact rewrite (the message names the keyword), an empty
            ``anyOf`` / ``oneOf``, a ``oneOf`` whose schemas may overlap, or a ``$ref`` with validation
            keywords beside it.
    """
    while "allOf" in schema:
        schema = _merged_all_of(schema)
    if "anyOf" in schema and "oneOf" in schema:
        raise GrammarError("a schema holding both anyOf and oneOf is not enforced by the grammar engine (it keeps "
                           "one); put one inside an allOf-free schema of its own")
    for key in ("anyOf", "oneOf"):
        if key in schema:
            schema = _distributed(schema, key)
            if key == "oneOf":
                _check_exclusive(schema["oneOf"], root)
    extra = sorted(set(_validating(schema)) - {"$ref"}) if "$ref" in schema else []
    if extra:
        raise GrammarError(f"$ref beside {', '.join(map(repr, extra))} is not enforced by the grammar engine (it "
                           "drops the keywords beside a $ref); move them into the referenced schema")
    return schema


def _validating(schema: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in schema.items() if key not in _ANNOTATIONS}


def _described(schema: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in schema.items() if key in _ANNOTATIONS}


def _merge(parts: list[dict[str, Any]], where: str) -> dict[str, Any]:
    """One schema equal to all of ``parts`` at once (their validating keywords), or GrammarError. ``required``
    lists are joined; ``properties`` maps too, a name in two of them getting ``allOf`` of its two schemas."""
    out: dict[str, Any] = {}
    owners: dict[str, set[int]] = {}
    for index, part in enumerate(parts):
        for key, value in _validating(part).items():
            if key in out and out[key] == value:
                pass
            elif key == "required" and isinstance(value, list) and isinstance(out.get(key, []), list):
                out[key] = list(dict.fromkeys([*out.get(key, []), *value]))
            elif key == "properties" and isinstance(value, dict) and isinstance(out.get(key, {}), dict):
                merged = dict(out.get(key, {}))
                for name, sub in value.items():
                    merged[name] = {"allOf": [merged[name], sub]} if name in merged and merged[name] != sub else sub
                out[key] = merged
            elif key in out:
                raise GrammarError(f"{where}: {key!r} is set by two of the schemas it combines, which the grammar "
                                   "engine cannot enforce together; combine them into one value")
            else:
                out[key] = value
            owners.setdefault(key, set()).add(index)
    for dependent, on in _ONE_SCHEMA_MEANING:
        for key in on:
            if dependent in owners and key in owners and not owners[key] == owners[dependent] == {min(owners[key])}:
                raise GrammarError(f"{where}: {dependent!r} in one of the schemas it combines and {key!r} in another "
                                   f"cannot be merged ({dependent} judges only its own schema's {key}), and the "
                                   "grammar engine does not enforce them apart")
    return out


def _merged_all_of(schema: dict[str, Any]) -> dict[str, Any]:
    parts = schema["allOf"]
    if not isinstance(parts, list):
        raise GrammarError(f"allOf must be a list of schemas, got {type(parts).__name__}")
    own = {key: value for key, value in schema.items() if key != "allOf"}
    schemas: list[dict[str, Any]] = [own]
    for part in parts:
        if part is True:
            continue
        if part is False or not isinstance(part, dict):
            raise GrammarError("allOf holds a schema no value matches (false)" if part is False
                               else f"allOf must hold schemas (objects), got {type(part).__name__}")
        if set(part) & {"$defs", "definitions"}:
            raise GrammarError("$defs inside an allOf schema are not supported; put them at the schema's root")
        schemas.append(part)
    return {**_described(own), **_merge(schemas, "allOf")}


def _distributed(schema: dict[str, Any], key: str) -> dict[str, Any]:
    branches = schema[key]
    if not isinstance(branches, list):
        raise GrammarError(f"{key} must be a list of schemas, got {type(branches).__name__}")
    siblings = {k: v for k, v in _validating(schema).items() if k != key}
    if key == "anyOf" and any(branch is True for branch in branches):  # anything matches: only the siblings count
        return {**_described(schema), **siblings}
    kept = [branch for branch in branches if not (key == "anyOf" and branch is False)]
    if not kept:
        raise GrammarError(f"{key} holds no schema a value could match: no output can follow it")
    if any(not isinstance(branch, dict) for branch in kept):
        raise GrammarError(f"{key} must hold schemas (objects){'; true or false in a oneOf is not supported' if key == 'oneOf' else ''}")
    if siblings:
        kept = [{**_described(branch), **_merge([siblings, branch], key)} for branch in kept]
    return {**_described(schema), key: kept}


def _resolved(schema: Any, root: dict[str, Any]) -> Any:
    """``schema`` with a local ``$ref`` (``#/...``) followed, as far as it leads (None: it leads nowhere)."""
    for _ in range(_MAX_REF_HOPS):
        if not isinstance(schema, dict) or not isinstance(schema.get("$ref"), str):
            return schema
        target: Any = root
        for name in schema["$ref"].removeprefix("#").strip("/").split("/"):
            if not name:
                continue
            name = name.replace("~1", "/").replace("~0", "~")
            target = target.get(name) if isinstance(target, dict) else None
        schema = target
    return None


def _value_kinds(value: Any) -> set[str]:
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return {"integer"}
    if isinstance(value, float):
        return {"fraction"}
    return {"string" if isinstance(value, str) else "array" if isinstance(value, list) else "object"}


def _kinds(schema: Any, root: dict[str, Any]) -> set[str] | None:
    """The JSON kinds a value of ``schema`` may be ("integer" and "fraction" for numbers), None: unknown."""
    schema = _resolved(schema, root)
    if not isinstance(schema, dict):
        return None
    if "const" in schema:
        return _value_kinds(schema["const"])
    if isinstance(schema.get("enum"), list):
        return set().union(*(_value_kinds(v) for v in schema["enum"])) if schema["enum"] else set()
    types = schema.get("type")
    types = [types] if isinstance(types, str) else types
    if not isinstance(types, list) or any(key in schema for key in ("anyOf", "oneOf", "allOf")):
        return None
    kinds = {t for t in types if isinstance(t, str)} - {"number"}
    return kinds | ({"integer", "fraction"} if "number" in types else set())


def _tag_values(schema: Any, root: dict[str, Any], name: str) -> list[Any] | None:
    """The values ``schema`` (an object schema) allows its required property ``name``, from its const or enum."""
    schema = _resolved(schema, root)
    if not isinstance(schema, dict) or name not in (schema.get("required") or []):
        return None
    prop = _resolved((schema.get("properties") or {}).get(name), root)
    if isinstance(prop, dict) and "const" in prop:
        return [prop["const"]]
    return list(prop["enum"]) if isinstance(prop, dict) and isinstance(prop.get("enum"), list) else None


def _exclusive(a: Any, b: Any, root: dict[str, Any]) -> bool:
    kinds_a, kinds_b = _kinds(a, root), _kinds(b, root)
    if kinds_a is not None and kinds_b is not None and not kinds_a & kinds_b:
        return True
    resolved_a, resolved_b = _resolved(a, root), _resolved(b, root)
    if not (isinstance(resolved_a, dict) and isinstance(resolved_b, dict)):
        return False
    for name in set(resolved_a.get("required") or []) & set(resolved_b.get("required") or []):
        values_a, values_b = _tag_values(a, root, name), _tag_values(b, root, name)
        if values_a is not None and values_b is not None and not any(v in values_b for v in values_a):
            return True
    return False


def _check_exclusive(branches: list[dict[str, Any]], root: dict[str, Any]) -> None:
    for i, a in enumerate(branches):
        for j in range(i + 1, len(branches)):
            if not _exclusive(a, branches[j], root):
                raise GrammarError(f"oneOf schemas {i} and {j} may both match one value, and the grammar engine "
                                   "enforces oneOf as anyOf (either may match); send anyOf if that is meant, or make "
                                   "them exclusive (different types, or a required property with different const "
                                   "values)")

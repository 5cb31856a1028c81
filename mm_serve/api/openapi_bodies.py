"""The OpenAPI request bodies of routes that parse their own body (:mod:`mm_serve.api.body_parser`):
FastAPI documents only the bodies it parses itself."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

REF = "#/components/schemas/{model}"


def request_body_spec(model: type[BaseModel]) -> dict[str, Any]:
    """A route's ``openapi_extra``: a required JSON body of ``model`` (its schema joins the components
    through :func:`with_request_schemas`)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": REF.format(model=model.__name__)}}}}}


def with_request_schemas(app: FastAPI, models: Sequence[type[BaseModel]]) -> None:
    """Make ``app``'s OpenAPI document carry the schemas of ``models`` and of the models they use
    (validation mode), next to the ones FastAPI generates (which keep their names)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        spec = generate()
        _, defs = models_json_schema([(model, "validation") for model in models], ref_template=REF)
        schemas = spec.setdefault("components", {}).setdefault("schemas", {})
        for name, schema in defs.get("$defs", {}).items():
            schemas.setdefault(name, schema)
        return spec

    app.openapi = openapi  # type: ignore[method-assign]

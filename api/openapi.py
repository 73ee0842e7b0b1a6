"""Documenting msgspec bodies in FastAPI's OpenAPI schema.

FastAPI documents pydantic models by itself; the API's bodies are msgspec
structs (shared with the registry and fast to encode), so routes declare
them with :func:`body` and :func:`answers`, and :func:`install_openapi`
adds msgspec's JSON schemas of every declared type to the components.
Routers and the schemathesis suite both read this schema.
"""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from api.errors import ErrorBody

_REF = "#/components/schemas/{name}"
_declared: list[Any] = []


def _schema(t: Any) -> dict[str, Any]:
    if t not in _declared:
        _declared.append(t)
    return {"application/json": {"schema": {"$ref": _REF.format(name=_name(t))}}}


def _name(t: Any) -> str:
    origin = getattr(t, "__origin__", None)
    if origin is list:
        return f"{_name(t.__args__[0])}List"
    return t.__name__


def body(*shapes: Any) -> dict[str, Any]:
    """``openapi_extra`` for a route that decodes a required JSON body of one of the types
    ``shapes`` (a union of structs msgspec cannot tell apart without a tag is documented
    as any of their schemas)."""
    refs = [_schema(t)["application/json"]["schema"] for t in shapes]
    schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def answers(**by_status: tuple[Any, str]) -> dict[int | str, dict[str, Any]]:
    """``responses`` for a route: ``answers(_200=(Type, "what"), _404=(ErrorBody, "why"))``."""
    return {
        int(status.lstrip("_")): {"description": what, "content": _schema(t)}
        for status, (t, what) in by_status.items()
    }


def install_openapi(app: FastAPI) -> None:
    """Generate the schema once, with the msgspec components merged in."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            error = _schema(ErrorBody)
            schema = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
            )
            refs, components = msgspec.json.schema_components(_declared, ref_template=_REF)
            named = dict(zip(map(_name, _declared), refs, strict=True))
            for name, ref in named.items():
                if ref.get("$ref") != _REF.format(name=name):
                    components[name] = ref  # a list type: its schema inline under our name
            schemas = schema.setdefault("components", {}).setdefault("schemas", {})
            schemas.update(components)
            _replace_validation_errors(schema, error)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _replace_validation_errors(schema: dict[str, Any], error: dict[str, Any]) -> None:
    """FastAPI documents its own 422 shape; the API answers ``ErrorBody`` instead."""
    for operation in (op for path in schema["paths"].values() for op in path.values()):
        response = operation.get("responses", {}).get("422")
        if response is not None and "HTTPValidationError" in str(response):
            response["content"] = error
    for name in ("HTTPValidationError", "ValidationError"):
        schema["components"]["schemas"].pop(name, None)

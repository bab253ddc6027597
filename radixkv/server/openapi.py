"""The OpenAPI schema's request bodies: the routes read their bodies themselves (to parse them
off the event loop), so FastAPI cannot see their models; this adds each route's body model to
the schema, so clients and fuzzers (schemathesis) know what to send.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

_REF = "#/components/schemas/{model}"


def document_request_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """Make app.openapi() list `bodies[path]` as the JSON body of POST `path`."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        refs, definitions = models_json_schema([(model, "validation") for model in bodies.values()], ref_template=_REF)
        schema.setdefault("components", {}).setdefault("schemas", {}).update(definitions.get("$defs", {}))
        for path, model in bodies.items():
            post = schema["paths"].get(path, {}).get("post")
            if post is not None:
                body_schema = refs[(model, "validation")]
                post["requestBody"] = {"required": True, "content": {"application/json": {"schema": body_schema}}}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]

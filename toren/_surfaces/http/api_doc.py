"""The pieces of the OpenAPI document every kind's part is made of: :class:`ApiPart`, the
app's list of parts, and the responses routes share (authentication, bad bodies)."""

from __future__ import annotations

from typing import Any

import attrs
import pydantic
from aiohttp import web

from toren._surfaces.http import models as m


def ref(model: type[pydantic.BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def json_content(model: type[pydantic.BaseModel]) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": ref(model)}}}


def problem(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/problem+json": {"schema": ref(m.Problem)}},
    }


RUN_PARAM = {
    "name": "run",
    "in": "path",
    "required": True,
    "description": "The run's uuid (its id without the `run/` prefix).",
    "schema": {"type": "string"},
}
"""The ``{run}`` of a run's paths."""

AUTH_FAIL = {
    "401": problem("No token, or a malformed, unknown, revoked or expired one."),
    "403": problem("The token lacks the route's scope, or may not act on this run's agent."),
    "429": problem("Too many failed authentications from this address (see Retry-After)."),
}
INVALID = {
    "400": problem("The body is not JSON."),
    "413": problem("The body is too large."),
    "422": problem("The body does not fit the schema; `errors` names each field."),
}


@attrs.frozen(kw_only=True, eq=False)
class ApiPart:
    """A kind's part of the OpenAPI document, added as it installs its routes.

    Attributes:
        paths: Its routes' paths, in the order the document lists them.
        models: The pydantic models its paths name (their schemas are components).
        security: The security schemes its paths use besides the API's own.
    """

    paths: dict[str, Any]
    models: tuple[type[pydantic.BaseModel], ...]
    security: dict[str, Any] = attrs.field(factory=dict)


API_PARTS: web.AppKey[list[ApiPart]] = web.AppKey("api_parts", list)
"""The parts of an app's document, in the order its kinds installed their routes."""

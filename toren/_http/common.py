"""What the HTTP modules share: the app keys, problems, body parsing, path parameters."""

from __future__ import annotations

import json as stdjson
import uuid
from typing import TypeVar

import orjson
import pydantic
from aiohttp import web
from pydantic_core import PydanticSerializationError

from toren._client import Client
from toren._http.models import FieldError, Problem
from toren._tokens import Principal

CLIENT: web.AppKey[Client] = web.AppKey("client", Client)
MESSAGE_CAP_KEY: web.AppKey[int] = web.AppKey("message_cap", int)
PRINCIPAL: web.RequestKey[Principal] = web.RequestKey("principal", Principal)
M = TypeVar("M", bound=pydantic.BaseModel)


class ProblemError(Exception):
    """Raised by handlers: answered as an RFC 9457 problem document."""

    def __init__(
        self, status: int, title: str, detail: str, errors: list[FieldError] | None = None
    ) -> None:
        super().__init__(detail)
        self.problem = Problem(title=title, status=status, detail=detail, errors=errors or [])


def problem_response(problem: Problem, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        body=to_json(problem),
        status=problem.status,
        content_type="application/problem+json",
        headers=headers,
    )


def to_json(model: pydantic.BaseModel) -> str:
    """``model`` as JSON text, also when it holds lone surrogates (untrusted text from runs):
    those are written as ``\\uXXXX`` escapes, which JSON allows."""
    try:
        return model.model_dump_json()
    except PydanticSerializationError:
        return stdjson.dumps(model.model_dump(mode="python"), default=str, ensure_ascii=True)


def json(model: pydantic.BaseModel, status: int = 200) -> web.Response:
    return web.Response(body=to_json(model), status=status, content_type="application/json")


async def read_body(request: web.Request, model: type[M]) -> M:
    """The JSON body as ``model``; an empty body is ``{}``.

    Raises:
        ProblemError: 400 if it is not JSON; pydantic's ValidationError (a 422) if it does not fit.
    """
    raw = await request.read()
    try:
        data = orjson.loads(raw) if raw.strip() else {}
    except orjson.JSONDecodeError as exc:
        raise ProblemError(
            400,
            "Malformed body",
            f"the body is not JSON: {exc}",
            [FieldError(field="body", message="not JSON")],
        ) from exc
    if not isinstance(data, dict):
        raise ProblemError(
            422,
            "Invalid request",
            "the body must be a JSON object",
            [FieldError(field="body", message="not an object")],
        )
    return model.model_validate(data)


def principal(request: web.Request) -> Principal:
    return request[PRINCIPAL]


def channel(request: web.Request) -> str:
    """Where a decision or message came from, as recorded in the run's events."""
    return "console" if principal(request).via == "session" else "api"


def run_id(request: web.Request) -> str:
    """``run/<uuid>`` from the path's ``{run}``; a malformed one is an unknown run (404)."""
    raw = request.match_info["run"]
    try:
        return f"run/{uuid.UUID(raw)}"
    except ValueError as exc:
        raise ProblemError(404, "Not found", f"no run {raw!r}") from exc

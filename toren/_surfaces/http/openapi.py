"""The OpenAPI 3.1 document, built from the same pydantic models the handlers use."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import pydantic
from pydantic.json_schema import models_json_schema

from toren._surfaces.http import models as m
from toren._surfaces.http.api_doc import API_PARTS, ApiPart
from toren._surfaces.http.api_doc import AUTH_FAIL as _AUTH_FAIL
from toren._surfaces.http.api_doc import INVALID as _INVALID
from toren._surfaces.http.api_doc import RUN_PARAM as _RUN_PARAM
from toren._surfaces.http.api_doc import json_content as _json
from toren._surfaces.http.api_doc import problem as _problem
from toren._surfaces.http.api_doc import ref as _ref
from toren._version import __version__
from toren.runs.events import STATUSES

__all__ = ["API_PARTS", "ApiPart", "channel_part", "document", "run_part"]

# The models every kind's routes name (a problem), or the server's own routes.
_MODELS: tuple[type[pydantic.BaseModel], ...] = (m.Health, m.Readiness, m.Problem)


_NOT_FOUND = {"404": _problem("No such run.")}
_BOT_PARAM = {
    "name": "bot",
    "in": "path",
    "required": True,
    "description": "The bot's name (`[agents.NAME.telegram] bot`), not its @username.",
    "schema": {"type": "string"},
}


def _write(summary: str, body: type[pydantic.BaseModel], ok: dict[str, Any]) -> dict[str, Any]:
    return {
        "summary": summary,
        "parameters": [_RUN_PARAM],
        "requestBody": {"required": False, **_json(body)},
        "responses": {
            **ok,
            **_AUTH_FAIL,
            **_NOT_FOUND,
            **_INVALID,
            "409": _problem("The run cannot take this now."),
        },
    }


def document(parts: Sequence[ApiPart] | None = None) -> dict[str, Any]:
    """The document of the API with the routes of these kinds' ``parts`` (Toren's own unless
    given: runs, channels, schedules, costs), then the server's own."""
    return _torens() if parts is None else _document(parts)


@functools.cache
def _torens() -> dict[str, Any]:
    from toren._surfaces.http.archives import archive_part
    from toren._surfaces.http.forks import fork_part
    from toren._surfaces.http.retention import cost_part
    from toren._surfaces.http.schedule_api import schedule_part
    from toren._surfaces.http.versions import version_part

    parts = (run_part(), version_part(), fork_part(), archive_part(), channel_part())
    return _document((*parts, schedule_part(), cost_part()))


def _document(parts: Sequence[ApiPart]) -> dict[str, Any]:
    models = [model for part in parts for model in part.models if model not in _MODELS]
    _, defs = models_json_schema(
        [(model, "validation") for model in (*dict.fromkeys(models), *_MODELS)],
        ref_template="#/components/schemas/{model}",
    )
    paths: dict[str, Any] = {
        **{path: item for part in parts for path, item in part.paths.items()},
        **_session_paths(),
        "/healthz": {
            "get": {
                "summary": "Database reachable and live workers; to an authenticated caller also "
                "which workers, their versions, version skew",
                "security": [{}, {"bearer": []}, {"session": []}],
                "responses": {
                    "200": {"description": "Healthy.", **_json(m.Health)},
                    "503": {"description": "The database does not answer.", **_json(m.Health)},
                },
            }
        },
        "/readyz": {
            "get": {
                "summary": "Readiness: migrated, and this process's worker registered (if it runs "
                "one); for load balancers and orchestrators",
                "description": "No token needed. Unlike `/healthz` (is the process alive, does "
                "the database answer), it says whether this process should get traffic: `503` "
                "with a `reason` until migrations are applied and, in `toren up`, until its "
                "worker is registered, and again from the moment it drains on SIGTERM.",
                "security": [{}],
                "responses": {
                    "200": {"description": "Ready.", **_json(m.Readiness)},
                    "503": {"description": "Not ready; `reason` says why.", **_json(m.Readiness)},
                },
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics",
                "responses": {
                    "200": {
                        "description": "The text exposition format.",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    },
                    **_AUTH_FAIL,
                },
            }
        },
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "Toren", "version": __version__},
        "servers": [{"url": "/"}],
        "security": [{"bearer": []}, {"session": []}],
        "components": {
            "schemas": defs["$defs"],
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "`toren tokens create`",
                },
                "session": {"type": "apiKey", "in": "cookie", "name": "toren_session"},
                **{name: scheme for part in parts for name, scheme in part.security.items()},
            },
        },
        "paths": paths,
    }


# What GET /session answers (the console reads it; built in toren._surfaces.http.console.whoami).
_WHOAMI = {
    "type": "object",
    "required": ["name", "principal", "scopes", "agents", "csrf"],
    "properties": {
        "name": {"type": "string"},
        "principal": {
            "type": "object",
            "required": ["kind", "id", "name", "via"],
            "properties": {k: {"type": "string"} for k in ("kind", "id", "name", "via")},
        },
        "scopes": {"type": "array", "items": {"type": "string"}},
        "agents": {"type": ["array", "null"], "items": {"type": "string"}},
        "csrf": {"type": ["string", "null"]},
    },
}


def _session_paths() -> dict[str, Any]:
    """The console's sign-in: a form posting a token, answered with a session cookie."""
    redirect = {"Location": {"schema": {"type": "string"}}}
    return {
        "/session": {
            "post": {
                "summary": "Sign in: exchange a token for a console session cookie",
                "description": "A form with one field, `token`. A live token is answered `303` "
                "to `/` with `Set-Cookie: toren_session=...` (HttpOnly, SameSite=Strict, "
                "Max-Age at most 12 hours and no later than the token's expiry); any other is "
                "answered `303` to `/?denied=1`, without a cookie, and counts as a failed "
                "sign-in. An `Origin` of another host is `403`; an address past the "
                "failed-sign-in limit is `429`, before the token is looked at.",
                "security": [{}],
                "requestBody": {
                    "required": False,
                    "content": {
                        "application/x-www-form-urlencoded": {
                            "schema": {
                                "type": "object",
                                "properties": {"token": {"type": "string"}},
                            }
                        }
                    },
                },
                "responses": {
                    "303": {
                        "description": "Signed in (to `/`, with the cookie) or refused (to "
                        "`/?denied=1`).",
                        "headers": {
                            **redirect,
                            "Set-Cookie": {
                                "description": "The session cookie, when signed in.",
                                "schema": {"type": "string"},
                            },
                        },
                    },
                    "400": _problem("A form that cannot be read."),
                    "403": _problem("A sign-in from another origin."),
                    "413": _problem("The body is too large."),
                    "429": _problem(
                        "Too many failed sign-ins from this address (see Retry-After)."
                    ),
                },
            },
            "get": {
                "summary": "Who the caller is, its scopes, and a session's CSRF token",
                "responses": {
                    "200": {
                        "description": "The caller.",
                        "content": {"application/json": {"schema": _WHOAMI}},
                    },
                    **_AUTH_FAIL,
                },
            },
            "delete": {
                "summary": "Sign out: end the session and clear its cookie",
                "description": "With the session cookie this is a write: it needs the "
                "session's `X-CSRF-Token`.",
                "responses": {
                    "200": {
                        "description": "Signed out.",
                        "content": {
                            "application/json": {
                                "schema": {
                                    "type": "object",
                                    "required": ["signed_out"],
                                    "properties": {"signed_out": {"type": "boolean"}},
                                }
                            }
                        },
                    },
                    **_AUTH_FAIL,
                },
            },
        }
    }


def run_part() -> ApiPart:
    """The runs' routes: start, list, read, follow, message, decide, cancel, retry."""
    models = (m.StartRunBody, m.MessageBody, m.ApprovalBody, m.CancelBody, m.RetryBody, m.Run)
    return ApiPart(paths=_run_paths(), models=(*models, m.RunList, m.EventList, m.Accepted))


def _run_paths() -> dict[str, Any]:
    accepted = {"202": {"description": "Queued for the run.", **_json(m.Accepted)}}
    return {
        "/runs": {
            "post": {
                "summary": "Start a run",
                "requestBody": {"required": True, **_json(m.StartRunBody)},
                "responses": {
                    "201": {"description": "The run, queued.", **_json(m.Run)},
                    **_AUTH_FAIL,
                    **_INVALID,
                    "409": _problem(
                        "The idempotency key was used for this agent with another input."
                    ),
                },
            },
            "get": {
                "summary": "List runs, newest first",
                "parameters": [
                    {
                        "name": "status",
                        "in": "query",
                        "schema": {
                            "type": "string",
                            "enum": list(STATUSES),
                        },
                    },
                    {
                        "name": "agent",
                        "in": "query",
                        "schema": {"type": "string", "pattern": m.AGENT_NAME, "maxLength": 100},
                    },
                    {
                        "name": "limit",
                        "in": "query",
                        "schema": {"type": "integer", "minimum": 1, "maximum": 200, "default": 50},
                    },
                    {"name": "cursor", "in": "query", "schema": {"type": "string"}},
                ],
                "responses": {
                    "200": {"description": "A page of runs.", **_json(m.RunList)},
                    **_AUTH_FAIL,
                    "422": _problem("A query parameter is invalid."),
                },
            },
        },
        "/runs/{run}": {
            "get": {
                "summary": "A run with its receipt",
                "parameters": [_RUN_PARAM],
                "responses": {
                    "200": {"description": "The run.", **_json(m.Run)},
                    **_AUTH_FAIL,
                    **_NOT_FOUND,
                },
            }
        },
        "/runs/{run}/events": {
            "get": {
                "summary": "The run's events (JSON, or a live server-sent-event stream)",
                "description": "With `Accept: text/event-stream`, a stream that follows the run: "
                "each event's `id` is its sequence number; reconnect with `Last-Event-ID` to "
                "resume without gaps or repeats. The server ends a stream with a `toren.closed` "
                'event (`{"reason": ...}`: revoked, expired, idle, stopping, error) when its '
                "token is revoked or expires, after a time with no event, or when it stops.",
                "parameters": [
                    _RUN_PARAM,
                    {
                        "name": "after",
                        "in": "query",
                        "description": "Only events with a greater sequence number.",
                        "schema": {"type": "integer", "minimum": 0},
                    },
                ],
                "responses": {
                    "200": {
                        "description": "Events in order.",
                        "content": {
                            "application/json": {"schema": _ref(m.EventList)},
                            "text/event-stream": {"schema": {"type": "string"}},
                        },
                    },
                    **_AUTH_FAIL,
                    **_NOT_FOUND,
                    "422": _problem("`after` is not a sequence number."),
                    "429": _problem(
                        "Too many open streams (per token or per server process), or too many "
                        "failed authentications; see Retry-After."
                    ),
                },
            }
        },
        "/runs/{run}/messages": {"post": _write("Send a human message", m.MessageBody, accepted)},
        "/runs/{run}/approvals": {
            "post": _write("Approve or deny what the run waits for", m.ApprovalBody, accepted)
        },
        "/runs/{run}/cancel": {"post": _write("Cancel the run", m.CancelBody, accepted)},
        "/runs/{run}/retry": {
            "post": _write("Resume a failed run from its last good step", m.RetryBody, accepted)
        },
    }


def channel_part() -> ApiPart:
    """The channels' routes: bots and chats, delivery states, Telegram's webhook."""
    telegram = {
        "type": "apiKey",
        "in": "header",
        "name": "X-Telegram-Bot-Api-Secret-Token",
        "description": "The bot's webhook secret (its `webhook_secret_env`), which "
        "Telegram sends with each update.",
    }
    models = (m.ChannelList, m.ChannelMessages, m.WebhookAck)
    return ApiPart(paths=_channel_paths(), models=models, security={"telegram": telegram})


def _channel_paths() -> dict[str, Any]:
    return {
        "/channels": {
            "get": {
                "summary": "Telegram channels, with their paired chats and delivery counts",
                "responses": {
                    "200": {"description": "Every channel.", **_json(m.ChannelList)},
                    **_AUTH_FAIL,
                },
            }
        },
        "/channels/{bot}/messages": {
            "get": {
                "summary": "A channel's outbound messages and their delivery states",
                "parameters": [
                    _BOT_PARAM,
                    {
                        "name": "chat",
                        "in": "query",
                        "description": "Only the messages to this chat.",
                        "schema": {
                            "type": "integer",
                            "minimum": -(2**63),
                            "maximum": 2**63 - 1,
                        },
                    },
                ],
                "responses": {
                    "200": {"description": "Oldest first.", **_json(m.ChannelMessages)},
                    **_AUTH_FAIL,
                    "404": _problem("No channel for this bot."),
                    "422": _problem("`chat` is not an integer."),
                },
            }
        },
        "/telegram/{bot}": {
            "post": {
                "summary": "Telegram's webhook: an update for the bot's channel",
                "description": "Called by Telegram, not by API clients: checked with the bot's "
                "secret (`X-Telegram-Bot-Api-Secret-Token`), not a bearer token. The update is "
                "enqueued once per `update_id` before the `200`.",
                "security": [{"telegram": []}],
                "parameters": [_BOT_PARAM],
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "required": ["update_id"],
                                "properties": {
                                    "update_id": {
                                        "type": "integer",
                                        "minimum": 0,
                                        "maximum": 2**63 - 1,
                                    }
                                },
                                "description": "A Telegram `Update` (at most 1 MiB).",
                            }
                        }
                    },
                },
                "responses": {
                    "200": {"description": "Enqueued (or a repeat).", **_json(m.WebhookAck)},
                    "400": _problem("Not a JSON object with an integer `update_id`."),
                    "401": _problem(
                        "No channel for this bot, no secret set for it in the server's "
                        "environment, or a missing or wrong secret."
                    ),
                    "413": _problem("The body is larger than 1 MiB."),
                    "429": _problem("Too many failed requests from this address."),
                    "503": _problem("The channel takes no updates now (see Retry-After)."),
                },
            }
        },
    }

"""``GET /runs/{run}/archive``: a pruned run read back from its archive (as ``toren jobs
restore`` shows it), read-only."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import anyio
from aiohttp import web
from pydantic import BaseModel

from toren._core.errors import ConfigError
from toren._surfaces.http.api_doc import API_PARTS, AUTH_FAIL, RUN_PARAM, ApiPart, json_content
from toren._surfaces.http.api_doc import problem as problem_doc
from toren._surfaces.http.common import CLIENT, OPTIONS, ProblemError, json, run_id
from toren._surfaces.http.models import Event, Receipt

PATH = "/runs/{run}/archive"


class RestoredRun(BaseModel):
    """A pruned run as its archive holds it: folded by the run's fold, every event."""

    id: str
    agent: str
    status: str
    input: str
    output: str | None
    error_class: str | None
    error: str | None
    parent: str | None
    receipt: Receipt
    events: list[Event]


class _Stores:
    """The app's archive store, opened at its first use and closed with the app."""

    def __init__(self) -> None:
        self.store: Any = None
        self.lock = anyio.Lock()

    async def get(self, url: str | None) -> Any:
        from toren._core.stores import store_from_url

        async with self.lock:
            if self.store is None:
                self.store = store_from_url(url or "", setting="archive_store")
            return self.store

    async def close(self, app: web.Application) -> None:
        if self.store is not None:
            await self.store.close()


STORES: web.AppKey[_Stores] = web.AppKey("archive_stores", _Stores)


def install(app: web.Application) -> None:
    """The archive route (the ``read`` scope, as every read)."""
    app[STORES] = _Stores()
    app.on_cleanup.append(app[STORES].close)
    app.router.add_get(PATH, archived)
    app[API_PARTS].append(archive_part())


async def archived(request: web.Request) -> web.Response:
    """The pruned run, read from its archive: 200; 404 if it was not pruned (or has no
    archive); 502 if its archive is missing or damaged; 503 if the store does not answer."""
    from toren._core.archive import CorruptArchive
    from toren._core.stores import StoreError
    from toren.runs.receipt import receipt
    from toren.runs.restore import NotRestorable, restored_run

    rid = run_id(request)
    try:
        store = await request.app[STORES].get(request.app[OPTIONS].archive_store)
        state, events = await restored_run(request.app[CLIENT], rid, store=store)
    except NotRestorable as exc:
        raise ProblemError(404, "Not found", f"no archive of run {rid}: {exc.why}") from exc
    except CorruptArchive as exc:
        raise ProblemError(502, "Archive unusable", str(exc)) from exc
    except (StoreError, ConfigError) as exc:
        raise ProblemError(503, "Archive store unavailable", str(exc)) from exc
    r = receipt(state)
    figures: dict[str, Any] = {name: getattr(r, name) for name in Receipt.model_fields}
    return json(
        RestoredRun(
            id=rid,
            agent=state.agent,
            status=state.status,
            input=state.input,
            output=state.output,
            error_class=state.error_class,
            error=state.error,
            parent=state.parent or None,
            receipt=Receipt.model_validate(
                {k: str(v) if isinstance(v, Decimal) else v for k, v in figures.items()}
            ),
            events=[
                Event(
                    seq=e.seq,
                    type=e.type,
                    data=e.data if isinstance(e.data, dict) else {"value": e.data},
                    at=e.at.isoformat() if e.at is not None else "",
                )
                for e in events
            ],
        )
    )


def archive_part() -> ApiPart:
    """The archive route's part of the OpenAPI document."""
    return ApiPart(
        paths={
            PATH: {
                "get": {
                    "summary": "A pruned run, read back from its journal's archive",
                    "description": "For a run pruned with its journal archived (its agent's "
                    "retention has `archive = true`): its archive is read from the archive "
                    "store, checked against the checksum its audit record keeps, and folded "
                    "by the run's own fold: its status, receipt and every event, as they were "
                    "before it was pruned. Read-only.",
                    "parameters": [RUN_PARAM],
                    "responses": {
                        "200": {
                            "description": "The run from its archive.",
                            **json_content(RestoredRun),
                        },
                        **AUTH_FAIL,
                        "404": problem_doc(
                            "No such run was pruned, or it was pruned without an archive."
                        ),
                        "502": problem_doc(
                            "Its archive is missing from the store or damaged (the detail "
                            "says what does not match)."
                        ),
                        "503": problem_doc("The archive store does not answer."),
                    },
                }
            }
        },
        models=(RestoredRun,),
    )

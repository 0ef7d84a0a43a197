"""Property-based: requests generated from the OpenAPI document (schemathesis) against a real
`toren serve` process get no 5xx and no response the document does not allow."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import anyio
import asyncpg
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import positive_data_acceptance

from tests.conftest import ROOT, TEMPLATE
from toren import Client
from toren._core.db import with_database
from toren._surfaces.http.openapi import document
from toren._surfaces.tokens import SCOPES, create_token
from toren.runs import start_run

schema = schemathesis.openapi.from_dict(document())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def live_api(server_url: str) -> Iterator[dict[str, Any]]:
    name = f"s_{uuid.uuid4().hex[:12]}"
    url = with_database(server_url, name)

    async def prepare() -> str:
        admin = await asyncpg.connect(server_url)
        try:
            await admin.execute(f"CREATE DATABASE {name} TEMPLATE {TEMPLATE}")
        finally:
            await admin.close()
        client = await Client.connect(url)
        try:
            await start_run(client, "support", "a run to find")
            _, token = await create_token(client.pool, "schemathesis", scopes=SCOPES)
        finally:
            await client.close()
        return token

    token = anyio.run(prepare)
    port = _free_port()
    # Schemathesis sends bad credentials on purpose: the failed-sign-in limit is for another test.
    env = dict(
        os.environ,
        TOREN_DATABASE_URL=url,
        PYTHONPATH=str(ROOT),
        TOREN_FAILED_AUTH_PER_MINUTE="1000000",
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "toren", "serve", "--port", str(port)], env=env, cwd=ROOT
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise
            time.sleep(0.1)
    yield {"base": base, "headers": {"Authorization": f"Bearer {token}"}}
    proc.terminate()
    proc.wait(10)

    async def drop() -> None:
        admin = await asyncpg.connect(server_url)
        try:
            await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        finally:
            await admin.close()

    anyio.run(drop)


@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_the_api_keeps_to_its_openapi_document(case: Any, live_api: dict[str, Any]) -> None:
    if case.query and "cursor" in case.query:
        # A cursor is opaque: one the API did not give out is refused with a 422 (documented);
        # paging with real cursors is tested in test_api.py.
        del case.query["cursor"]
    response = case.call(base_url=live_api["base"], headers=live_api["headers"], timeout=10)
    excluded = []
    if case.method == "POST" and case.path.startswith("/schedules"):
        # A schedule's values are checked beyond what a JSON schema says (a cron expression's
        # grammar, IANA time zones, exactly one of cron and every, ISO 8601 with an offset):
        # a body the schema allows may be refused with a 422 naming the field (documented).
        excluded.append(positive_data_acceptance)
    if case.method == "POST" and case.path.endswith("/fork"):
        # A fork's step is checked against the run's steps (and its text against NUL, lone
        # surrogates and the cap): a body the schema allows may be a 422 naming the field.
        excluded.append(positive_data_acceptance)
    case.validate_response(response, excluded_checks=excluded)

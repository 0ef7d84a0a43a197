"""The README's example runs as written."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import anyio
import pytest

from tests.conftest import running_worker

pytestmark = pytest.mark.anyio

README = Path(__file__).resolve().parent.parent / "README.md"


async def test_the_first_actor_example_works(
    db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    text = README.read_text()
    section = text.split("## A first actor", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None
    module = types.ModuleType("readme_example")
    sys.modules["readme_example"] = module
    exec(compile(code.group(1), "README.md", "exec"), module.__dict__)
    async with running_worker(db_url):
        with anyio.fail_after(20):
            await module.main(db_url)
    assert "{'total': 2}" in capsys.readouterr().out

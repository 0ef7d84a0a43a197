"""The docs' pytest commands work in a virtualenv set up as the docs say: Toren, then pytest, and
nothing else. pytest-timeout comes only with the project's own test dependencies, so each run
here leaves it out (``-p no:timeout``) rather than installing or removing anything."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.conftest import ROOT

NO_TIMEOUT = ("-p", "no:timeout")  # as if pytest-timeout were not installed
EXAMPLE = "examples/refund_approval"


def test_an_examples_readme_command_passes_without_pytest_timeout() -> None:
    readme = (ROOT / EXAMPLE / "README.md").read_text()
    assert f"`pytest {EXAMPLE}`" in readme
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *NO_TIMEOUT, EXAMPLE],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    printed = result.stdout + result.stderr
    assert result.returncode == 0, printed
    assert re.search(r"\b\d+ passed\b", result.stdout), printed

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


def test_a_timeout_given_in_the_ini_settings_is_kept() -> None:
    """The 300 s the root conftest.py gives each test is a default: ``-o timeout=N`` (or a
    ``timeout`` key in an ini file, which pytest-timeout reads after ``--timeout`` and
    ``PYTEST_TIMEOUT``) sets it as pytest-timeout documents."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    this = "tests/test_pytest_as_documented.py"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--co", "-p", "no:cacheprovider", "-o", "timeout=7", this],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    [header] = [line for line in result.stdout.splitlines() if line.startswith("timeout: ")]
    assert header == "timeout: 7.0s"
